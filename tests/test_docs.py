"""The documentation site (mkdocs.yml, docs/): its generated reference covers the code, no page is orphaned,
and the strict build really fails on a broken link (tests/run.sh builds the real site strictly)."""

import importlib.util
import os
import shutil
import subprocess
import sys
from pathlib import Path
from types import ModuleType, SimpleNamespace
from typing import Any

import pytest
import yaml

ROOT = Path(__file__).resolve().parents[1]
DOCS = ROOT / "docs"


def _hooks() -> ModuleType:
    spec = importlib.util.spec_from_file_location("kvtier_docs_hooks", DOCS / "hooks.py")
    assert spec is not None and spec.loader is not None
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def _schema_paths(node: dict[str, Any], defs: dict[str, Any], path: str) -> list[str]:
    """Every key path of a JSON Schema object, walked independently of the hook's renderer."""
    if "$ref" in node:
        node = defs[node["$ref"].split("/")[-1]]
    if node.get("type") == "array" and isinstance(node.get("items"), dict):
        return _schema_paths(node["items"], defs, f"{path}[i]")
    out = []
    for key, sub in node.get("properties", {}).items():
        p = f"{path}.{key}" if path else key
        out.append(p)
        out += _schema_paths(sub, defs, p)
    return out


def test_config_reference_names_every_section_and_key():
    from kvtier.config import json_schema

    schema = json_schema()
    text = _hooks().config_reference_markdown()
    paths = _schema_paths(schema, schema["$defs"], "")
    assert len(paths) > 30  # the walk found the sections' keys, not just the sections
    for section in schema["properties"]:
        assert f"## `{section}`" in text, section
    missing = [p for p in paths if f"`{p}`" not in text]
    assert not missing, f"config keys missing from the generated reference: {missing}"


def test_config_reference_documents_the_builtin_plugins_options():
    from kvtier.backends.local_disk import LocalDiskBackend
    from kvtier.policies.write import WriteThroughSelective

    text = _hooks().config_reference_markdown()
    for key in LocalDiskBackend.Options.model_fields:
        assert f"`backends[i].options.{key}`" in text, key
    assert "`policies.write.options.threshold`" in text
    assert WriteThroughSelective.Options.model_fields["threshold"].default == 2
    # A description written as an attribute docstring (the redis backend's style, which pydantic leaves out
    # of the schema) reaches the table too.
    row = next(line for line in text.splitlines() if line.startswith("| `backends[i].options.key_prefix` |"))
    description = row.split(" | ")[3].strip(" |")  # key, type, default, description
    assert description not in ("", "—"), row


def test_metrics_table_names_every_counter():
    from kvtier import metrics

    text = _hooks().metrics_markdown()
    for counter in metrics.COUNTERS:
        assert f"| `{counter}` | `kvtier_tier_{counter}` |" in text, counter
    assert "``" not in text  # reStructuredText literals became Markdown code


def test_a_page_that_lost_its_marker_fails_the_build():
    from mkdocs.exceptions import PluginError

    hooks = _hooks()
    page = SimpleNamespace(file=SimpleNamespace(src_uri="config-reference.md"))
    with pytest.raises(PluginError, match="marker"):
        hooks.on_page_markdown("# Config reference\n", page, None, None)
    other = SimpleNamespace(file=SimpleNamespace(src_uri="keys.md"))
    assert hooks.on_page_markdown("# Keys\n", other, None, None) == "# Keys\n"


def _nav_pages(nav: Any) -> list[str]:
    if isinstance(nav, str):
        return [nav]
    if isinstance(nav, list):
        return [p for item in nav for p in _nav_pages(item)]
    if isinstance(nav, dict):
        return [p for v in nav.values() for p in _nav_pages(v)]
    return []


def test_every_page_is_in_the_nav_and_every_nav_entry_is_a_page():
    config = yaml.safe_load((ROOT / "mkdocs.yml").read_text())
    nav = _nav_pages(config["nav"])
    pages = sorted(str(p.relative_to(DOCS)) for p in DOCS.rglob("*.md"))
    assert sorted(nav) == pages
    assert len(nav) == len(set(nav))
    assert config["strict"] is True


def test_strict_build_fails_on_a_broken_link_and_a_broken_anchor(tmp_path):
    # A copy of the real site, so this proves the real mkdocs.yml is strict (the build in tests/run.sh
    # passing only shows the current pages are clean).
    shutil.copy(ROOT / "mkdocs.yml", tmp_path / "mkdocs.yml")
    shutil.copytree(DOCS, tmp_path / "docs", ignore=shutil.ignore_patterns("__pycache__"))
    index = tmp_path / "docs" / "index.md"
    index.write_text(index.read_text() + "\n[gone](no-such-page.md) and [lost](keys.md#no-such-anchor)\n")
    r = subprocess.run([sys.executable, "-m", "mkdocs", "build", "--strict", "--site-dir",
                        str(tmp_path / "site")], cwd=tmp_path, capture_output=True, text=True, timeout=120,
                       env={**os.environ, "NO_MKDOCS_2_WARNING": "1"})
    out = r.stdout + r.stderr
    assert r.returncode != 0, out
    assert "no-such-page.md" in out and "no-such-anchor" in out, out
