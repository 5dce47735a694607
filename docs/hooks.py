"""MkDocs hooks (``hooks:`` in mkdocs.yml): the pages that restate code are generated from it at build time.

* ``config-reference.md``: every config section and key from :func:`kvtier.config.json_schema` (type,
  default, description), then the options of each built-in backend and policy from its ``Options``
  model.  Replaces the page's ``<!-- kvtier:config-reference -->`` marker.
* ``operations.md``: the per-tier counters from :mod:`kvtier.metrics`' docstring table (and its
  per-backend gauges).  Replaces ``<!-- kvtier:metrics -->``.

Generating them means a new config key or counter appears in the docs without anyone remembering to add
it; a marker that goes missing fails the build rather than silently dropping the reference.
"""

from __future__ import annotations

import ast
import inspect
import json
import textwrap
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from mkdocs.config.defaults import MkDocsConfig
    from mkdocs.structure.files import Files
    from mkdocs.structure.pages import Page

CONFIG_MARKER = "<!-- kvtier:config-reference -->"
METRICS_MARKER = "<!-- kvtier:metrics -->"
# kvtier's own plugins get their options documented; third-party ones installed beside it document theirs.
BUILTIN_DISTRIBUTION = "kvtier"
# Where each plugin kind's options sit in the YAML (as error messages and --grid print paths).
OPTION_PATHS = {"backend": "backends[i].options", "write_policy": "policies.write.options",
                "prefetch_policy": "policies.prefetch.options", "eviction_policy": "policies.eviction.options"}
PLUGIN_KIND_NAMES = {"backend": "Backends", "write_policy": "Write policies",
                     "prefetch_policy": "Prefetch policies", "eviction_policy": "Eviction policies"}


# --------------------------------------------------------------------------- rendering one schema

def _cell(text: str) -> str:
    """One table cell: a single line, its pipes escaped (a bare ``|`` would start a new cell), docstrings'
    reStructuredText literals (double backquotes) as Markdown code."""
    return " ".join(text.split()).replace("``", "`").replace("|", "\\|")


def _para(text: str) -> str:
    """A paragraph from a docstring or schema description: one line, RST literals as Markdown code."""
    return " ".join(text.split()).replace("``", "`")


def _resolve(node: dict[str, Any], defs: dict[str, Any]) -> dict[str, Any]:
    ref = node.get("$ref")
    if isinstance(ref, str) and ref.startswith("#/$defs/"):
        return dict(defs[ref.split("/")[-1]])
    return node


def _is_size(node: dict[str, Any]) -> bool:
    from kvtier.units import SIZE_PATTERN

    return any(alt.get("pattern") == SIZE_PATTERN for alt in node.get("anyOf", ()))


def _type(node: dict[str, Any], defs: dict[str, Any]) -> str:
    """A property's type in words: ``integer ≥ 1``, one of `a`, `b`, a size, ``string or null`` ..."""
    node = _resolve(node, defs)
    if _is_size(node):
        return 'size: bytes, or a string like `"4GiB"`'
    if "anyOf" in node:
        return " or ".join(dict.fromkeys(_type(alt, defs) for alt in node["anyOf"]))
    if "enum" in node:
        return "one of " + ", ".join(f"`{json.dumps(v)}`" for v in node["enum"])
    if "const" in node:
        return f"`{json.dumps(node['const'])}`"
    kind = node.get("type", "any")
    if kind == "array":
        items = node.get("items")
        return f"list of {_type(items, defs)}" if isinstance(items, dict) else "list"
    bounds = [f"{sym} {node[k]}" for k, sym in (("minimum", "≥"), ("exclusiveMinimum", ">"),
                                                 ("maximum", "≤"), ("exclusiveMaximum", "<")) if k in node]
    return f"{kind} {', '.join(bounds)}" if bounds else str(kind)


def _default(node: dict[str, Any], required: bool) -> str:
    if required:
        return "required"
    if "default" not in node:
        return "—"
    value = node["default"]
    if _is_size(node) and isinstance(value, int) and not isinstance(value, bool):
        from kvtier.units import format_size

        return f"`{format_size(value)}`"
    return f"`{json.dumps(value)}`"


def _is_section(node: dict[str, Any]) -> bool:
    return node.get("type") == "object" and bool(node.get("properties"))


def _tables(schema: dict[str, Any], path: str, defs: dict[str, Any], level: int,
            docs: dict[str, str] | None = None) -> Iterator[str]:
    """Markdown for the object ``schema`` at ``path``: a table of its plain keys, then a heading and a table
    for each key that is itself an object of keys (``policies.write``) or a list of them (``backends``)."""
    required = set(schema.get("required", ()))
    rows, nested = [], []
    for key, raw in schema.get("properties", {}).items():
        node = _resolve(raw, defs)
        items = _resolve(node["items"], defs) if node.get("type") == "array" and "items" in node else None
        if _is_section(node):
            nested.append((f"{path}.{key}", node, raw))
        elif items is not None and _is_section(items):
            nested.append((f"{path}.{key}[i]", items, {**node, "description": f"`{path}.{key}`: a list, each entry "
                           f"with the keys below. {node.get('description') or items.get('description') or ''}"}))
        else:
            # A field's own words first: an enum's class docstring describes the type, not this key.
            desc = raw.get("description") or (docs or {}).get(key) or node.get("description") or ""
            rows.append(f"| `{path}.{key}` | {_cell(_type(raw, defs))} | {_default(raw, key in required)} "
                        f"| {_cell(desc)} |")
    if rows:
        yield "| key | type | default | description |\n| --- | --- | --- | --- |\n" + "\n".join(rows)
    for sub_path, node, outer in nested:
        yield f"{'#' * level} `{sub_path}`"
        desc = outer.get("description") or node.get("description")
        if desc:
            yield _para(desc)
        yield from _tables(node, sub_path, defs, level + 1)


# --------------------------------------------------------------------------- the config reference

def _attribute_docs(model: type) -> dict[str, str]:
    """``{field: the string literal under it}`` over a class and its bases: plugins such as redis document
    options that way (PEP 257 attribute docstrings), which pydantic leaves out of the schema by default."""
    out: dict[str, str] = {}
    for cls in reversed(model.__mro__):
        try:
            tree = ast.parse(textwrap.dedent(inspect.getsource(cls)))
        except (OSError, TypeError, SyntaxError):
            continue  # builtins, or a class made at run time: nothing to read
        body = tree.body[0].body if tree.body and isinstance(tree.body[0], ast.ClassDef) else []
        for stmt, nxt in zip(body, body[1:]):
            if isinstance(stmt, ast.AnnAssign) and isinstance(stmt.target, ast.Name) \
                    and isinstance(nxt, ast.Expr) and isinstance(nxt.value, ast.Constant) \
                    and isinstance(nxt.value.value, str):
                out[stmt.target.id] = nxt.value.value
    return out


def _plugin_sections() -> Iterator[str]:
    from pydantic import BaseModel

    from kvtier import plugins

    for kind, title in PLUGIN_KIND_NAMES.items():
        yield f"### {title}"
        for info in plugins.available(kind):
            if info.distribution != BUILTIN_DISTRIBUTION:
                continue
            path = OPTION_PATHS[kind]
            yield f"#### `{info.name}`"
            try:
                options = getattr(plugins.load(kind, info.name), "Options", None)
            except plugins.PluginError as e:
                # A build without that plugin's optional dependency still documents everything else.
                yield f"Not importable where this site was built: {e}"
                continue
            if not (isinstance(options, type) and issubclass(options, BaseModel)):
                yield "No options."
                continue
            schema = options.model_json_schema()
            if not schema.get("properties"):
                yield "No options."
                continue
            where = f"`{path}` when `type: {info.name}`" if kind == "backend" else \
                f"`{path}` when `name: {info.name}`"
            yield f"In {where} (`{info.value}`, its `Options`):"
            yield from _tables(schema, path, schema.get("$defs", {}), 5, docs=_attribute_docs(options))


def config_reference_markdown() -> str:
    """The reference: one heading per top-level section (in the schema's order), a table per object."""
    from kvtier.config import json_schema

    schema = json_schema()
    defs = schema.get("$defs", {})
    parts = [_para(schema.get("description", ""))]
    required = set(schema.get("required", ()))
    for key, raw in schema["properties"].items():
        node = _resolve(raw, defs)
        items = _resolve(node["items"], defs) if node.get("type") == "array" and "items" in node else None
        path = f"{key}[i]" if items is not None else key
        parts.append(f"## `{key}`")
        desc = raw.get("description") or node.get("description")
        if desc:
            parts.append(_para(desc))
        if key in required:
            parts.append("This section is required.")
        section = items if items is not None else node
        if _is_section(section):
            for part in _tables(section, path, defs, 3):
                parts.append(part)
        else:
            parts.append(f"Type: {_cell(_type(raw, defs))}; default {_default(raw, key in required)}.")
    parts.append("## Options of the built-in plugins")
    parts.append("A plugin validates its own `options` (the schema above leaves them open); kvtier's "
                 "built-in plugins take these. Unknown keys are errors.")
    parts.extend(_plugin_sections())
    return "\n\n".join(p for p in parts if p) + "\n"


# --------------------------------------------------------------------------- the metrics tables

def metrics_markdown() -> str:
    """The per-tier counter table of :mod:`kvtier.metrics`' docstring (an RST simple table: a rule, rows of
    ````name``  meaning`` whose meaning may wrap onto indented lines, a rule), as Markdown, with each
    counter's Prometheus name; then the per-backend gauges where the module has them."""
    from kvtier import metrics

    lines = (metrics.__doc__ or "").splitlines()
    rules = [i for i, line in enumerate(lines) if line.startswith("====")]
    if len(rules) < 2:
        raise ValueError("kvtier.metrics' docstring has no counter table (two ==== rules) to document")
    width = lines[rules[0]].index(" ")  # the first column's width: where a row's meaning starts
    rows: list[list[str]] = []
    for line in lines[rules[0] + 1:rules[1]]:
        name, meaning = line[:width].strip(), line[width:].strip()
        if name:
            rows.append([name.strip("`"), meaning])
        elif rows and meaning:
            rows[-1][1] += " " + meaning
    missing = set(metrics.COUNTERS) - {name for name, _ in rows}
    if missing:
        raise ValueError(f"kvtier.metrics' docstring table lacks counters {sorted(missing)}")
    out = ["| counter | Prometheus | what it counts |", "| --- | --- | --- |"]
    out += [f"| `{n}` | `kvtier_tier_{n}` | {_cell(m)} |" for n, m in rows]
    gauges: dict[str, str] = getattr(metrics, "BACKEND_GAUGES", {})
    if gauges:
        out += ["", "Per storage backend, read at scrape time, each the gauge `kvtier_backend_<name>` with the "
                "label `tier` (the backend's instance name):", "",
                "| gauge | Prometheus | what it says |", "| --- | --- | --- |"]
        out += [f"| `{n}` | `kvtier_backend_{n}` | {_cell(h)} |" for n, h in gauges.items()]
    return "\n".join(out) + "\n"


# --------------------------------------------------------------------------- the MkDocs hook

GENERATED = {"config-reference.md": (CONFIG_MARKER, config_reference_markdown),
             "operations.md": (METRICS_MARKER, metrics_markdown)}


def on_page_markdown(markdown: str, page: Page, config: MkDocsConfig, files: Files) -> str:
    entry = GENERATED.get(page.file.src_uri)
    if entry is None:
        return markdown
    marker, generate = entry
    if marker not in markdown:
        # Without the marker the page would build without its reference and nobody would notice.
        from mkdocs.exceptions import PluginError

        raise PluginError(f"docs/{page.file.src_uri} lost its {marker} marker: the generated part has "
                          "nowhere to go")
    return markdown.replace(marker, generate())
