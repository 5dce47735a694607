"""Issue 6 item 7: property-based fuzzing (hypothesis) of everything a user or an engine hands kvtier.

* YAML configs, 10 000 examples: valid configs with 1-3 known faults injected (each fault's key path must
  be named by a problem line), whole sections replaced by random YAML values, the YAML text itself cut
  and spliced with YAML syntax, environment overrides.  ``load_config`` either returns a config or raises
  ``ConfigError`` whose every line is ``path: problem`` with a path that exists in the input or the
  schema (or the file's ``name:line:col`` for YAML syntax); anything else is a traceback and fails.
  Structure only (``resolve_plugins=False``) for the 10 000: resolving plugins costs ~35 ms per config
  (entry-point scans); a second fuzzer resolves them, with faults in backends' own options, and a third
  runs ``kvtier config check`` in-process.
* Token sequences: hashing gives exactly ``len // block_size`` digests equal to vLLM's reference
  construction (for sha256_cbor) or raises ValueError; incremental hashing equals one-shot hashing.
* Multimodal items, LoRA and cache salts: ValueError naming ``mm[i]`` / the field, or hashes equal to a
  naive reference of the documented extra-key rules.
* Layouts: ``KVLayout`` constructs or raises LayoutError; ``validate`` accepts exactly the right tensors;
  gather/scatter round-trips bytes; bad block ids raise instead of touching another block.
* Keys: ``split_key`` round-trips exactly (canonical keys only) or raises ValueError; the disk backend refuses every key that would
  name a path outside its root (and never writes outside it); Redis and S3 never serve a block for a
  garbage key.
"""

from __future__ import annotations

import contextlib
import io
import os
import random
import re
import string
from typing import Any

import cbor2
import numpy as np
import pytest
import torch
import xxhash
import yaml
from hypothesis import HealthCheck, assume, given, settings
from hypothesis import strategies as st
from hypothesis.extra import numpy as hnp

from kvtier import config
from kvtier.backend_api import BackendError
from kvtier.backends.local_disk import JOURNAL_NAME, LEDGER_NAME, LocalDiskBackend
from kvtier.config import KV_DTYPES, ConfigError, KvtierConfig, load_config, parse_config
from kvtier.format.layout import KINDS, KVLayout, LayoutError
from kvtier.keys import BlockHasher, MMItem, Namespace, SequenceHasher, sha256_cbor, split_key
from kvtier.memory.rows import scatter, to_payload
from kvtier.tools import cli

# Derandomized by default, so the test command gives the same verdict every run (a random draw once failed a
# coverage threshold and once found a real bug: run with KVTIER_FUZZ_RANDOM=1 to explore new inputs).
FUZZ: dict[str, Any] = dict(deadline=None, database=None, suppress_health_check=list(HealthCheck),
            derandomize=not os.environ.get("KVTIER_FUZZ_RANDOM"))
YAML_EXAMPLES = int(os.environ.get("KVTIER_FUZZ_YAML_EXAMPLES", 10_000))

# ======================================================================================= YAML configs

SECTIONS = ("model", "keys", "device", "host", "policies", "transfer", "metrics")
INTS = {  # path -> lowest valid value (no upper bound unless given)
    ("model", "num_layers"): 1, ("model", "num_kv_heads"): 1, ("model", "head_dim"): 1,
    ("model", "block_size"): 1, ("device", "num_blocks"): 1, ("transfer", "threads"): 1,
    ("policies", "prefetch", "threshold_tokens"): 0,
}
LITERALS = {
    ("model", "kv_dtype"): KV_DTYPES, ("model", "attention"): ("mha", "mla"),
    ("keys", "algo"): ("sha256_cbor", "xxh3_128"), ("device", "kind"): ("auto", "cpu", "cuda"),
    ("device", "layout"): ("flash_attn", "flashinfer", "mla", "stacked"),
}
REQUIRED = [("model", "id"), ("model", "num_layers"), ("model", "num_kv_heads"), ("model", "head_dim")]
NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.-]*$")
SOURCE = "fuzz.yaml"


def _dump(doc) -> str:
    """YAML text of ``doc`` (libyaml's emitter when present: the fuzzers dump 10 000 documents)."""
    text: str = yaml.dump(doc, Dumper=getattr(yaml, "CSafeDumper", yaml.SafeDumper), sort_keys=False,
                          allow_unicode=True)
    return text

words = st.text(string.ascii_letters + string.digits + "_-./ :üé€\n\t", min_size=1, max_size=12)
scalars = st.one_of(st.none(), st.booleans(), st.integers(-2**70, 2**70),
                    st.floats(allow_nan=True, allow_infinity=True), st.text(max_size=12))
junk = st.recursive(scalars, lambda inner: st.one_of(
    st.lists(inner, max_size=4), st.dictionaries(st.one_of(words, st.integers(-3, 3), st.none()), inner,
                                                 max_size=4)), max_leaves=12)


def _join(parts) -> str:
    """A key path as config errors write it."""
    out = ""
    for p in parts:
        out += f"[{p}]" if isinstance(p, int) else (str(p) if not out else f".{p}")
    return out


def _names(line: str, path: str) -> bool:
    """Whether problem ``line`` is about ``path`` (a problem is one line: line breaks in keys are spaces)."""
    return line.startswith(" ".join((path + ": ").splitlines()))


def _set(doc: dict[str, Any], path: tuple[str | int, ...], value: Any) -> None:
    """Set ``value`` at ``path``, creating absent sections (never replacing a value that is there)."""
    node: Any = doc
    for p in path[:-1]:
        if isinstance(node, dict) and p not in node:
            node[p] = {}
        node = node[p]
    node[path[-1]] = value


def _related(a: tuple[str | int, ...], b: tuple[str | int, ...]) -> bool:
    """One path is the other or inside it: a second fault there would mask or repair the first."""
    n = min(len(a), len(b))
    return a[:n] == b[:n]


_ID_CHARS = string.ascii_letters + string.digits + "_-./ :üé€\n\t"


def _valid_doc(seed: int) -> dict[str, Any]:
    """A valid config built from ``seed`` (plain ``random``: one hypothesis draw instead of thirty, which
    is what lets 10 000 examples run in well under a minute; the faults are still drawn by hypothesis)."""
    r = random.Random(seed)
    tp = r.randint(1, 8)
    model = {"id": "".join(r.choice(_ID_CHARS) for _ in range(r.randint(1, 12))),
             "num_layers": r.randint(1, 96), "num_kv_heads": r.randint(1, 64), "head_dim": r.randint(1, 256)}
    if r.random() < 0.5:
        model.update(kv_dtype=r.choice(KV_DTYPES), block_size=r.randint(1, 256), attention=r.choice(["mha", "mla"]),
                     tp_size=tp, tp_rank=r.randint(0, tp - 1))
    doc: dict[str, Any] = {"model": model}
    if r.random() < 0.5:
        doc["keys"] = {"algo": r.choice(["sha256_cbor", "xxh3_128"]),
                       "seed": r.choice([None, r.randint(0, 2**32), "s" * r.randint(1, 5)])}
    if r.random() < 0.5:
        doc["device"] = {"kind": r.choice(["auto", "cpu", "cuda"]), "num_blocks": r.randint(1, 4096)}
    if r.random() < 0.5:
        doc["host"] = {"capacity": r.choice([r.randint(0, 2**40), "4GiB", "512MiB", "1.5GB", "0", "100kB"]),
                       "pinned": r.choice(["auto", True, False])}
    n = r.randint(0, 3)
    if n:
        backends = []
        for i in range(n):
            kind = r.choice(["local_disk", "redis", "s3"])
            b = {"type": kind, "name": f"{kind}-{i}", "write": r.random() < 0.5}
            b["options"] = {"local_disk": {"path": "/tmp/kv", "capacity": "1GiB"},
                            "redis": {"url": "redis://127.0.0.1:6379/0"}, "s3": {"bucket": "kv-bucket"}}[kind]
            backends.append(b)
        doc["backends"] = backends
    if r.random() < 0.5:
        doc["policies"] = {"write": {"name": "write_through"},
                           "prefetch": {"name": "best_effort", "threshold_tokens": r.randint(0, 4096)}}
    if r.random() < 0.5:
        doc["transfer"] = {"threads": r.randint(1, 16)}
    if r.random() < 0.5:
        doc["metrics"] = {"prometheus_port": r.choice([None, r.randint(1, 65535)])}
    return doc


def valid_docs():
    return st.integers(0, 2**32).map(_valid_doc)


def _not_int(lo: int):
    return st.one_of(st.integers(max_value=lo - 1), st.text(max_size=6), st.floats(), st.booleans(),
                     st.lists(st.integers(), max_size=2), st.just({"a": 1}))


@st.composite
def faults(draw, doc: dict[str, Any], taken: list[tuple[str | int, ...]]) -> tuple[str, bool] | None:
    """Inject one fault into ``doc``; return (the key path a problem line must name, whether that holds
    only when it is the only fault: cross-field checks run only on an otherwise valid config), or None
    when the fault drawn would touch a path an earlier fault (listed in ``taken``) already broke."""
    backends = doc.get("backends")
    nb = len(backends) if isinstance(backends, list) else 0
    kind = draw(st.sampled_from(["int", "literal", "size", "unknown", "missing", "section", "name", "dup",
                                 "rank", "bool", "seed", "port"]))
    if kind in ("dup", "rank"):  # cross-field checks: only meaningful on an otherwise valid config
        if taken or (kind == "dup" and nb < 2):
            return None
        taken.append(("model",) if kind == "rank" else ("backends",))
        if kind == "rank":
            size = draw(st.integers(1, 8))
            doc["model"]["tp_size"] = size
            doc["model"]["tp_rank"] = draw(st.integers(size, size + 8))
            return "model.tp_rank", True
        i, j = draw(st.sampled_from([(i, j) for i in range(nb) for j in range(nb) if i < j]))
        doc["backends"][j]["name"] = doc["backends"][i]["name"]
        return _join(("backends", j, "name")), True
    if kind == "int":
        path = draw(st.sampled_from(sorted(INTS)))
        value = draw(_not_int(INTS[path]))
    elif kind == "literal":
        path = draw(st.sampled_from(sorted(LITERALS)))
        value = draw(st.one_of(words, st.integers(), st.booleans()))
        assume(value not in LITERALS[path])
    elif kind == "size":
        path = ("host", "capacity")
        value = draw(st.sampled_from(["lots", "-1GiB", "4 gallons", "", "1.5.5GiB", -1, 1.5, True, [1], "1e3", None,
                                      float("inf")]))
    elif kind == "unknown":
        where = draw(st.sampled_from([(), *[(s,) for s in SECTIONS], ("policies", "write"),
                                      *[("backends", i) for i in range(nb)]]))
        key = draw(words)
        assume(key not in _fields_at(where))
        path, value = (*where, key), draw(scalars)
    elif kind == "missing":
        path = draw(st.sampled_from([*REQUIRED, ("model",), *[("backends", i, "type") for i in range(nb)]]))
        value = None
    elif kind == "section":
        path = draw(st.sampled_from([(s,) for s in SECTIONS] + [("backends",), ("policies", "write")]
                                    + [("backends", i) for i in range(nb)]))
        value = draw(st.one_of(st.integers(), st.text(max_size=6), st.booleans(), st.floats(),
                               st.lists(st.integers(), min_size=0, max_size=2)))
        if path == ("backends",):
            value = draw(st.one_of(st.integers(), st.text(max_size=6), st.just({"type": "redis"})))
    elif kind == "name":
        if not nb:
            return None
        value = draw(st.text(max_size=8))
        assume(not NAME_RE.match(value))
        path = ("backends", draw(st.integers(0, nb - 1)), "name")
    elif kind == "bool":
        path = draw(st.sampled_from([("host", "pinned")] + [("backends", i, "write") for i in range(nb)]))
        value = draw(st.one_of(st.sampled_from(["yes", "no", "on", "1", "true", "maybe"]), st.integers(0, 2),
                               st.floats()))
    elif kind == "seed":
        path = ("keys", "seed")
        value = draw(st.one_of(st.floats(), st.booleans(), st.lists(st.integers(), max_size=2)))
    else:
        path = ("metrics", "prometheus_port")
        value = draw(st.one_of(st.integers(max_value=0), st.integers(min_value=65536), st.text(max_size=4)))
    if any(_related(path, t) for t in taken):
        return None
    taken.append(path)
    if kind == "missing":
        node = doc
        for p in path[:-1]:
            node = node[p]
        del node[path[-1]]
    else:
        _set(doc, path, value)
    return _join(path), False


def _fields_at(where: tuple[str | int, ...]) -> set[str]:
    model: Any = KvtierConfig  # a pydantic model class, walked through its fields' annotations
    for p in where:
        if isinstance(p, int):
            continue
        ann = model.model_fields[p].annotation
        model = getattr(ann, "__args__", (ann,))[0] if getattr(ann, "__origin__", None) is list else ann
    return set(model.model_fields)


@st.composite
def faulty_docs(draw):
    doc = draw(valid_docs())
    expected: list[tuple[str, bool]] = []
    taken: list[tuple[str | int, ...]] = []
    for _ in range(draw(st.integers(1, 3))):
        f = draw(faults(doc, taken))
        if f is not None:
            expected.append(f)
    return doc, expected


@st.composite
def env_overrides(draw: st.DrawFn) -> dict[str, str]:
    """KVTIER_... variables: real paths with bad values, misspelt paths, list entries that do not exist."""
    names = ["KVTIER_HOST__CAPACITY", "KVTIER_MODEL__NUM_LAYERS", "KVTIER_HOST__CAPACTY", "KVTIER_BACKENDS__7__TYPE",
             "KVTIER_MODEL", "KVTIER_DEVICE__KIND", "KVTIER_POLICIES__WRITE__NAME", "KVTIER_MODEL____ID",
             "KVTIER_BACKENDS__0__OPTIONS__PATH", "KVTIER_KEYS__SEED__X"]
    return draw(st.dictionaries(st.sampled_from(names), st.text(max_size=8), max_size=2))


YAML_BITS = [":", ": ", "- ", "-", "{", "}", "[", "]", ",", "&a ", "*a", "!!python/object:os.system ", "%YAML 1.2\n",
             "\t", "\n", "  ", "? ", "|", ">", "'", '"', "#", "!!binary ", "---\n", "...\n", "\x00", "\ufeff", "~",
             "<<: *a\n", "!!str ", "0x1F", "1e400", ".inf", "null"]


@st.composite
def yaml_texts(draw) -> tuple[str, list[tuple[str, bool]], dict[str, str]]:
    """(YAML text, expected (path, alone) faults, environment)."""
    mode = draw(st.sampled_from(["valid", "fault", "fault", "fault", "fault", "junk", "junk", "splice", "splice",
                                 "text"]))
    env = draw(env_overrides()) if draw(st.integers(0, 9)) == 0 else {}
    if mode == "valid":
        return _dump(draw(valid_docs())), [], env
    if mode == "fault":
        doc, expected = draw(faulty_docs())
        return _dump(doc), expected, env
    if mode == "junk":
        doc = draw(valid_docs())
        where = draw(st.sampled_from([*SECTIONS, "backends", "top", "extra"]))
        if where == "top":
            doc = draw(junk)
        elif where == "extra":
            doc[draw(words)] = draw(junk)
        else:
            doc[where] = draw(junk)
        return _dump(doc), [], env
    if mode == "splice":
        text = _dump(draw(valid_docs()))
        for _ in range(draw(st.integers(1, 4))):
            i = draw(st.integers(0, len(text)))
            j = draw(st.integers(i, min(len(text), i + 20)))
            text = text[:i] + draw(st.sampled_from(YAML_BITS + [""])) + text[j:]
        return text, [], env
    return draw(st.text(max_size=80)), [], env


def _paths(data, limit: int = 20_000) -> set[str]:
    """Every key path in the loaded YAML, written as the config errors write them."""
    out: set[str] = set()
    seen: set[int] = set()

    def walk(node, parts):
        if len(out) > limit or id(node) in seen:
            return
        if isinstance(node, dict):
            seen.add(id(node))
            for k, v in node.items():
                out.add(_join((*parts, str(k))))
                walk(v, (*parts, str(k)))
        elif isinstance(node, list):
            seen.add(id(node))
            for i, v in enumerate(node):
                out.add(_join((*parts, i)))
                walk(v, (*parts, i))

    walk(data, ())
    return out


def _schema_paths(data) -> set[str]:
    """Paths of every schema key (a missing required key is reported at its path)."""
    out = set()

    def walk(model, parts):
        for name, f in model.model_fields.items():
            out.add(_join((*parts, name)))
            ann = f.annotation
            if isinstance(ann, type) and hasattr(ann, "model_fields"):
                walk(ann, (*parts, name))

    walk(KvtierConfig, ())
    backends = data.get("backends") if isinstance(data, dict) else None
    for i in range(len(backends) if isinstance(backends, list) else 0):
        for name in ("type", "name", "options", "write"):
            out.add(_join(("backends", i, name)))
    return out


_LOC = re.compile(rf"^{re.escape(SOURCE)}(?::\d+:\d+)?: \S")
_BLAMED = re.compile(r"\(set by environment variable (\w+)\)$")


def _check_lines(err: ConfigError, data, env: dict[str, str]) -> None:
    """Every problem line is ``path: problem`` with a path found in the input ``data``, the schema, the
    environment or the file's location."""
    assert err.problems and str(err) == "\n".join(err.problems)
    cands = {"(top level)", *env} | _paths(data) | _schema_paths(data)
    for line in err.problems:
        assert "Traceback" not in line
        if _LOC.match(line):
            continue
        blamed = _BLAMED.search(line)
        if blamed and blamed.group(1) in env:
            continue  # a key the override itself brought (not in the file): the line names that variable
        assert any(_names(line, c) for c in cands), f"no key path in {line!r}"


def _covered(expected: str, lines: list[str]) -> bool:
    """Some line names ``expected`` or a section above it (a fault inside a section that another fault
    replaced is reported at that section)."""
    for line in lines:
        for p in (expected, *[expected[:m.start()] for m in re.finditer(r"[.\[]", expected)]):
            if p and _names(line, p):
                return True
    return False


def test_fuzz_yaml_configs(figures):
    """10 000 documents through the loader (``load_config`` = ``read_yaml`` + ``parse_config``; called as
    those two here so the test sees the parsed data without a second parse)."""
    counts = {"examples": 0, "valid": 0, "invalid": 0, "yaml": 0, "faults_named": 0}

    @settings(max_examples=YAML_EXAMPLES, **FUZZ)
    @given(case=yaml_texts())
    def run(case):
        text, expected, env = case
        counts["examples"] += 1
        try:
            data = config.read_yaml(text, SOURCE)
        except ConfigError as e:  # not YAML: reported at the file's line and column
            counts["yaml"] += 1
            assert not expected, "a dumped document must parse"
            assert [line for line in e.problems if not _LOC.match(line)] == []
            return
        try:
            parse_config(data, source=SOURCE, env=env, resolve_plugins=False)
        except ConfigError as e:
            counts["invalid"] += 1
            _check_lines(e, data, env)
            for want, alone in ([] if env else expected):  # an override may have replaced a faulty value
                if alone and len(expected) > 1:
                    continue  # cross-field checks run only on an otherwise valid config
                assert _covered(want, e.problems), f"fault at {want!r} not reported: {e.problems}"
                counts["faults_named"] += 1
        else:
            counts["valid"] += 1
            assert not expected or env, f"faults {expected} accepted"

    run()
    figures("YAML configs fuzzed (hypothesis)", counts["examples"])
    figures("YAML configs: valid / invalid YAML / ConfigError naming key paths / other exception",
            f"{counts['valid']}/{counts['yaml']}/{counts['invalid']}/0")
    figures("injected faults named by their key path", counts["faults_named"])
    assert counts["examples"] >= YAML_EXAMPLES


@st.composite
def plugin_docs(draw):
    """Configs whose backends' options (validated by each plugin's Options) or policy names are wrong."""
    doc: dict[str, Any] = {"model": {"id": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 64}, "backends": []}
    kinds = draw(st.lists(st.sampled_from(["local_disk", "redis", "s3"]), min_size=1, max_size=3))
    for i, kind in enumerate(kinds):
        opts = {"local_disk": {"path": "/tmp/kv"}, "redis": {"url": "redis://h:1/0"}, "s3": {"bucket": "abc"}}[kind]
        doc["backends"].append({"type": kind, "name": f"b{i}", "options": dict(opts)})
    i = draw(st.integers(0, len(kinds) - 1))
    kind = kinds[i]
    opts = doc["backends"][i]["options"]
    fault = draw(st.sampled_from(["unknown", "value", "type", "policy"]))
    if fault == "unknown":
        key = draw(words)
        assume(key not in {"local_disk": LocalDiskBackend.Options.model_fields}.get(kind, {}) and key not in
               ("url", "password", "username", "cluster", "startup_nodes", "ttl_s", "timeout_s", "bucket", "prefix",
                "endpoint_url", "region", "max_workers", "retries", "key_prefix", "capacity", "threads", "fsync"))
        opts[key] = draw(scalars)
        return doc, f"backends[{i}].options.{key}"
    if fault == "value":
        key, bad = {"local_disk": ("capacity", draw(st.sampled_from(["lots", -5, "1.5.5GiB", [1]]))),
                    "redis": ("url", draw(st.sampled_from(["http://h:1", "redis://", "redis://h:1/x", "redis://h:1/0?a=b"]))),
                    "s3": ("max_workers", draw(st.integers(max_value=0) | st.integers(min_value=257)))}[kind]
        opts[key] = bad
        return doc, f"backends[{i}].options" + ("" if kind == "redis" else f".{key}")
    if fault == "type":
        key = {"local_disk": "threads", "redis": "ttl_s", "s3": "retries"}[kind]
        opts[key] = draw(st.one_of(st.text(min_size=1, max_size=4).filter(lambda s: not s.strip().lstrip("-").isdigit()),
                                   st.lists(st.integers(), max_size=2), st.just({"a": 1})))
        return doc, f"backends[{i}].options.{key}"
    doc["policies"] = {draw(st.sampled_from(["write", "prefetch", "eviction"])): {"name": draw(words)}}
    sect = next(iter(doc["policies"]))
    assume(doc["policies"][sect]["name"] not in ("write_through", "write_through_selective", "write_back",
                                                 "best_effort", "wait_complete", "timeout", "lru"))
    return doc, f"policies.{sect}.name"


def test_fuzz_configs_with_plugins(tmp_path, figures):
    """Plugins resolved: each backend's own Options validates its mapping; problems carry the full path."""
    path = tmp_path / SOURCE
    n = {"examples": 0}

    @settings(max_examples=120, **FUZZ)
    @given(case=plugin_docs())
    def run(case):
        doc, want = case
        n["examples"] += 1
        path.write_text(_dump(doc), encoding="utf-8")
        with pytest.raises(ConfigError) as ei:
            load_config(str(path), env={})
        e = ei.value
        _check_lines(e, doc, {})
        assert any(_names(line, want) for line in e.problems), (want, e.problems)

    run()
    figures("configs fuzzed with plugin options resolved", n["examples"])


def test_fuzz_config_check_cli(tmp_path, figures):
    """``kvtier config check FILE`` on fuzzed files: exit 0 or 2, never a traceback, problems indented
    ``path: problem`` lines."""
    path = tmp_path / SOURCE
    n = {"examples": 0, "rc2": 0}

    @settings(max_examples=60, **FUZZ)
    @given(case=yaml_texts())
    def run(case):
        text, _, _ = case
        n["examples"] += 1
        path.write_text(text, encoding="utf-8")
        out, err = io.StringIO(), io.StringIO()
        with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
            rc = cli.main(["config", "check", "--no-env", str(path)])
        assert rc in (0, 2), (rc, err.getvalue())
        assert "Traceback" not in out.getvalue() + err.getvalue()
        if rc == 2:
            n["rc2"] += 1
            lines = err.getvalue().splitlines()
            assert lines[0].startswith(f"{path}: invalid (")
            assert all(line.startswith("  ") and ": " in line for line in lines[1:])
        else:
            assert out.getvalue().startswith(f"{path}: ok\n  tiers: device")

    run()
    figures("`kvtier config check` runs on fuzzed files (exit 2 / tracebacks)", f"{n['examples']} ({n['rc2']}/0)")
    assert 0 < n["rc2"] < n["examples"], "both valid and invalid files were checked"


def test_config_alias_bomb_and_recursion(tmp_path):
    """A 9^9-element YAML alias bomb and self-referencing aliases: a prompt ConfigError, not a hang or a
    traceback (both used to happen: the error message rendered the whole value)."""
    import time

    bomb = ['a: &a ["x","x","x","x","x","x","x","x","x"]']
    for prev, name in zip("abcdefgh", "bcdefghi"):
        bomb.append(f"{name}: &{name} [{', '.join(['*' + prev] * 9)}]")
    cases = {"bomb": "\n".join(bomb) + "\nmodel: *i\nbackends: *i\n",
             "list": "model: &m [*m]\n",
             "backends": "model: {id: x, num_layers: 1, num_kv_heads: 1, head_dim: 1}\nbackends: &b [*b]\n",
             "seed": "model: {id: x, num_layers: 1, num_kv_heads: 1, head_dim: 1}\nkeys: {seed: &s [*s]}\n"}
    for name, text in cases.items():
        p = tmp_path / f"{name}.yaml"
        p.write_text(text)
        t0 = time.perf_counter()
        with pytest.raises(ConfigError) as ei:
            load_config(str(p), env={}, resolve_plugins=False)
        assert time.perf_counter() - t0 < 5, name
        assert all(len(line) < 300 for line in ei.value.problems)


# ======================================================================================= tokens, mm, lora


def _reference(hasher: BlockHasher, tokens: list[int], extras: list[Any]) -> list[bytes]:
    """vLLM's construction, block by block, with the extra keys given per block."""
    B = hasher.block_size
    h = hasher.none_hash
    out = []
    for i in range(len(tokens) // B):
        block = tokens[i * B:(i + 1) * B]
        extra = extras[i]
        if hasher.algo == "sha256_cbor":
            h = sha256_cbor((h, tuple(block), extra))
        else:
            raw = np.asarray(block, dtype="<i8").tobytes()
            tail = cbor2.dumps(extra, canonical=True) if extra is not None else b"\xf6"
            h = xxhash.xxh3_128_digest(h + raw + tail, hasher._xxh_seed)
        out.append(h)
    return out


BOUNDARIES = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1]
good_tokens = st.lists(st.one_of(st.integers(0, 50_000), st.sampled_from(BOUNDARIES)), max_size=160)
bad_items = st.one_of(st.integers(max_value=-1), st.integers(min_value=2**63), st.floats(), st.text(max_size=2),
                      st.none(), st.lists(st.integers(), max_size=1))
token_inputs = st.one_of(
    good_tokens,
    good_tokens.map(tuple),
    st.lists(st.one_of(st.integers(0, 100), bad_items), max_size=40),
    hnp.arrays(st.sampled_from([np.int8, np.int16, np.int32, np.int64, np.uint8, np.uint16, np.uint32, np.uint64,
                                np.float32, np.float64, np.bool_]), st.integers(0, 64)),
    hnp.arrays(np.int64, st.tuples(st.integers(1, 3), st.integers(1, 3))),
    st.text(max_size=5), st.none(), st.integers(),
)


def test_fuzz_token_sequences(figures):
    n = {"hashed": 0, "refused": 0}

    @settings(max_examples=500, **FUZZ)
    @given(tokens=token_inputs, block_size=st.integers(1, 17), algo=st.sampled_from(["sha256_cbor", "xxh3_128"]))
    def run(tokens, block_size, algo):
        hasher = BlockHasher(block_size, algo, seed="fuzz")
        try:
            got = hasher.hash_blocks(tokens)
        except ValueError as e:
            n["refused"] += 1
            assert str(e).startswith("tokens"), e
            as_list = tokens.tolist() if isinstance(tokens, np.ndarray) else tokens
            valid = isinstance(as_list, (list, tuple)) and all(type(t) is int and 0 <= t < 2**63 for t in as_list)
            if valid and (not isinstance(tokens, np.ndarray) or (tokens.dtype.kind in "iu" and tokens.ndim == 1)):
                raise AssertionError(f"valid tokens refused: {e}") from None
            return
        n["hashed"] += 1
        toks = [int(t) for t in (tokens.tolist() if isinstance(tokens, np.ndarray) else tokens)]
        assert all(0 <= t < 2**63 for t in toks)
        assert got == _reference(hasher, toks, [None] * (len(toks) // block_size))
        # split anywhere, hashed incrementally: the same keys
        cut = len(toks) // 3
        seq = SequenceHasher(hasher, toks[:cut])
        seq.extend(toks[cut:2 * cut])
        seq.extend(toks[2 * cut:])
        assert seq.hashes == got

    run()
    figures("token sequences fuzzed: hashed = reference / refused with ValueError", f"{n['hashed']}/{n['refused']}")
    assert n["hashed"] > 100 and n["refused"] > 100


mm_item = st.one_of(
    st.fixed_dictionaries({"identifier": st.one_of(words, st.integers(), st.none(), st.just("")),
                           "offset": st.one_of(st.integers(-3, 120), st.floats(), st.booleans()),
                           "length": st.one_of(st.integers(-1, 60), st.text(max_size=1))},
                          optional={"extra": st.integers()}),
    st.builds(MMItem, words, st.integers(0, 120), st.integers(1, 40)),
    st.tuples(words, st.integers(0, 120), st.integers(1, 40)),
    st.dictionaries(st.sampled_from(["identifier", "offset"]), st.integers(0, 9), max_size=2),
    st.integers(), st.text(max_size=3),
)


@st.composite
def valid_mm(draw, n: int) -> list[dict[str, Any] | tuple[str, int, int] | MMItem]:
    """Sorted, non-overlapping items inside ``n`` tokens, as dicts, tuples or MMItems."""
    cuts = sorted(draw(st.lists(st.integers(0, n), max_size=8, unique=True)))
    items: list[dict[str, Any] | tuple[str, int, int] | MMItem] = []
    for a, b in zip(cuts[0::2], cuts[1::2]):
        form = draw(st.sampled_from(["dict", "tuple", "item"]))
        ident = draw(words)
        items.append({"identifier": ident, "offset": a, "length": b - a} if form == "dict" else
                     (ident, a, b - a) if form == "tuple" else MMItem(ident, a, b - a))
    return items


def test_fuzz_multimodal_lora_salt(figures):
    n_ = {"hashed": 0, "with_mm": 0, "refused": 0}

    @settings(max_examples=400, **FUZZ)
    @given(n=st.integers(0, 120), block_size=st.integers(1, 16),
           lora=st.one_of(st.none(), st.none(), st.tuples(words, words), st.tuples(words, words),
                          st.just(("", "p")), st.just({"name": "x", "bad": 1})),
           salt=st.one_of(st.none(), st.none(), words, words, st.just(""), st.integers()),
           algo=st.sampled_from(["sha256_cbor", "xxh3_128"]), data=st.data())
    def run(n, block_size, lora, salt, algo, data):
        items = data.draw(st.one_of(valid_mm(n), valid_mm(n), st.lists(mm_item, max_size=4)))
        hasher = BlockHasher(block_size, algo, seed=7)
        tokens = list(range(1000, 1000 + n))
        try:
            got = hasher.hash_blocks(tokens, mm=items, lora=lora, cache_salt=salt)
        except ValueError as e:
            n_["refused"] += 1
            assert str(e).startswith(("mm[", "lora", "cache_salt")), e
            return
        n_["hashed"] += 1
        n_["with_mm"] += bool(items)
        # a naive reading of the documented rules
        norm = [it if isinstance(it, MMItem) else MMItem(*it) if isinstance(it, tuple) else
                MMItem(it["identifier"], it["offset"], it["length"]) for it in items]
        assert all(isinstance(m.identifier, str) and m.identifier and type(m.offset) is int
                   and type(m.length) is int and m.offset >= 0 and m.length >= 1 and m.offset + m.length <= n
                   for m in norm)
        assert all(a.offset + a.length <= b.offset for a, b in zip(norm, norm[1:])), "sorted, non-overlapping"
        lkey = None if lora is None else ("lora", lora[0], lora[1])
        extras = []
        for i in range(n // block_size):
            s, end = i * block_size, (i + 1) * block_size
            ex: list[tuple[Any, ...]] = [lkey] if lkey else []
            ex += [("mm", m.identifier, m.offset - s) for m in norm if m.offset < end and m.offset + m.length > s]
            if salt is not None and i == 0:
                ex.append(("cache_salt", salt))
            extras.append(tuple(ex) if ex else None)
        assert got == _reference(hasher, tokens, extras)

    run()
    figures("mm/lora/salt inputs fuzzed: hashed = reference (with mm items) / refused",
            f"{n_['hashed']} ({n_['with_mm']})/{n_['refused']}")
    assert n_["with_mm"] > 40 and n_["refused"] > 40


# ======================================================================================= layouts

bad_dims = st.sampled_from([0, -1, True, 2.0, "2", None])


def test_fuzz_layouts(figures):
    n = {"refused": 0, "validate_refused": 0, "round_trips": 0}

    @settings(max_examples=300, **FUZZ)
    @given(valid=st.integers(0, 3), kind=st.sampled_from(KINDS), dtype=st.sampled_from(
               ["bfloat16", "fp16", "float32", "fp8", "uint8", "int8", torch.float16, torch.float64]),
           inner=st.sampled_from([None, None, "flash_attn", "flashinfer", "mla"]),
           perturb=st.sampled_from(["none", "none", "dtype", "shape", "count", "strides"]), data=st.data())
    def run(valid, kind, dtype, inner, perturb, data):
        dims = [data.draw(st.integers(1, 3)) for _ in range(5)]
        if kind == "mla" or (kind == "stacked" and inner == "mla"):
            dims[3] = 1  # one latent per token
        if kind == "cpu_attn_amx":  # vLLM CPU's AMX kernel packs tiles of 16 tokens and 16 dims
            dims[2], dims[4] = (16 * data.draw(st.integers(1, 2)) for _ in range(2))
        if not valid:  # break one thing
            what = data.draw(st.sampled_from(["dim", "kind", "dtype", "inner"]))
            if what == "dim":
                dims[data.draw(st.integers(0, 4))] = data.draw(bad_dims)
            elif what == "kind":
                kind = data.draw(words.filter(lambda w: w not in KINDS))
            elif what == "dtype":
                dtype = data.draw(st.sampled_from(["float64", "bf17", 3, None, "torch.int99"]))
            else:
                inner = "stacked" if kind == "stacked" else data.draw(st.sampled_from(["flash_attn", "mla", "x"]))
        L, N, B, H, D = dims
        try:
            layout = KVLayout(kind, L, N, B, H, D, dtype, inner if kind == "stacked" or not valid else None)
        except LayoutError:
            n["refused"] += 1
            assert not valid, "a valid layout refused"
            return
        assert valid, "an invalid layout was accepted"
        assert all(type(v) is int and v >= 1 for v in (L, N, B, H, D))
        assert layout.block_nbytes == L * layout.num_components * B * H * D * layout.itemsize
        shapes = layout.tensor_shapes()
        tensors = [torch.randint(0, 256, (int(np.prod(s)) * layout.itemsize,), dtype=torch.uint8)
                   .view(layout.dtype).reshape(s) for s in shapes]
        bad = True
        if perturb == "dtype":
            other = torch.float32 if layout.dtype != torch.float32 else torch.float16
            tensors = [t.view(torch.uint8)[..., :t.shape[-1]].to(other) for t in tensors]
        elif perturb == "shape":
            dim = data.draw(st.integers(0, len(shapes[0]) - 1))
            s = list(shapes[0])
            s[dim] += 1
            tensors[0] = torch.zeros(s, dtype=layout.dtype)
        elif perturb == "count":
            tensors = tensors + [tensors[0]] if data.draw(st.booleans()) else tensors[:-1]
        elif perturb == "strides":
            # Same shape, last two dims transposed in memory: not contiguous within a block unless one of
            # them has size 1 (then the bytes are laid out the same and validate may accept it; the round
            # trip below then proves the copies are still right).
            t = tensors[0]
            tensors[0] = t.transpose(-1, -2).contiguous().transpose(-1, -2)
            bad = t.shape[-1] > 1 and t.shape[-2] > 1
        else:
            bad = False
        if bad:
            with pytest.raises(LayoutError):
                layout.validate(tensors)
            n["validate_refused"] += 1
            return
        try:
            layout.validate(tensors)
        except LayoutError:
            assert perturb == "strides"  # a size-1 dim's stride is arbitrary; refusing it is allowed
            return
        ids = data.draw(st.lists(st.integers(0, N - 1), min_size=0, max_size=N, unique=True))
        pay = to_payload(layout, tensors, ids)
        assert tuple(pay.shape) == (len(ids), layout.block_nbytes)
        zeros = [torch.zeros_like(t) for t in tensors]
        scatter(layout, zeros, pay, ids)
        assert torch.equal(to_payload(layout, zeros, ids), pay)
        n["round_trips"] += 1
        # block ids that name no block are refused before anything is written
        wrong = data.draw(st.sampled_from([[-1], [N], [0.5], [True], [-N - 1]]))
        before = [z.clone() for z in zeros]
        with pytest.raises((IndexError, TypeError, ValueError)):
            scatter(layout, zeros, torch.zeros(1, layout.block_nbytes, dtype=torch.uint8), wrong)
        assert all(torch.equal(a.contiguous().view(torch.uint8), b.contiguous().view(torch.uint8))
                   for a, b in zip(before, zeros)), \
            "a refused scatter wrote nothing"  # compared as bytes: random bits include NaNs
        with pytest.raises((IndexError, TypeError, ValueError)):
            to_payload(layout, tensors, wrong)

    run()
    figures("layouts fuzzed: refused / tensors refused by validate / gather-scatter round trips",
            f"{n['refused']}/{n['validate_refused']}/{n['round_trips']}")
    assert n["round_trips"] > 50 and n["validate_refused"] > 30


# ======================================================================================= keys

NS = Namespace("fuzz/model", "bfloat16", 1, 1, 8, 4)
HEX = "0123456789abcdef"
hexes = st.text(HEX + "ABCDEFxyz", min_size=0, max_size=66)
key_parts = st.sampled_from(["..", ".", "", "/", "\\", "~", "%2e%2e", "\x00", "manifest.json", "\n", "．．", "ab",
                             "etc/passwd", "..\\..", "*", "?", " ", NS.id, "0" * 32, "0" * 64, "A" * 32])
path_keys = st.lists(st.one_of(key_parts, hexes), min_size=1, max_size=6).map("/".join)
valid_keys = st.builds(lambda h, ns: f"{ns}/{h}", st.one_of(st.text(HEX, min_size=32, max_size=32),
                                                            st.text(HEX, min_size=64, max_size=64)),
                       st.sampled_from([NS.id, "0" * 32, "f" * 32]))
near_keys = valid_keys.flatmap(lambda k: st.sampled_from([k.upper(), k + "\n", k + "/", "/" + k, k[:-1], k + "0",
                                                          k.replace("/", "\\"), k.replace("/", "/../"),
                                                          k.replace("/", "//"), "./" + k, k[:33] + "." + k[34:]]))
fuzz_keys = st.one_of(valid_keys, near_keys, path_keys, st.text(max_size=70), hexes.map(lambda h: f"{NS.id}/{h}"),
                      st.builds(lambda a, b: f"{a}/{b}", hexes, hexes), st.just("/" + "0" * 32 + "/" + "0" * 32),
                      st.just(f"{NS.id}/../{'0' * 32}"), st.just(f"../{NS.id}/{'0' * 32}"))
_STRICT = re.compile(r"[0-9a-f]{32}/(?:[0-9a-f]{32}|[0-9a-f]{64})")


def _well_formed(key: str) -> bool:
    try:
        split_key(key)
        return True
    except ValueError:
        return False


@settings(max_examples=1000, **FUZZ)
@given(key=fuzz_keys)
def test_fuzz_split_key(key):
    try:
        ns, h = split_key(key)
    except ValueError as e:
        assert repr(key) in str(e)
        return
    assert len(ns) == 16 and len(h) in (16, 32)
    assert f"{ns.hex()}/{h.hex()}" == key, "only the canonical spelling is accepted"


def test_fuzz_disk_refuses_keys_outside_its_root(tmp_path, figures):
    """Every operation with a fuzzed key: either refused (ValueError / BackendError) or the key is a
    well-formed block key; nothing is ever created, read or deleted outside the root."""
    jail = tmp_path / "jail"
    root = jail / "root"
    canary = tmp_path / "canary"
    canary.write_bytes(b"keep me")
    (jail / "etc").mkdir(parents=True)
    (jail / "etc" / "passwd").write_bytes(b"outside")
    b = LocalDiskBackend({"path": str(root), "capacity": "64MiB", "threads": 1})
    payload = np.arange(64, dtype=np.uint8)
    n = {"keys": 0, "refused": 0, "accepted": 0}

    def attempt(fn) -> bool:
        try:
            fn()
            return True
        except (ValueError, BackendError):
            return False

    @settings(max_examples=600, **FUZZ)
    @given(key=fuzz_keys)
    def run(key):
        n["keys"] += 1
        results = [attempt(lambda: b.put([key], [payload], NS.layout_id)),
                   attempt(lambda: b.get_into([key], [bytearray(64)], NS.layout_id)),
                   attempt(lambda: b.exists([key])), attempt(lambda: b.contains_prefix([key])),
                   attempt(lambda: b.delete([key]))]
        if any(results):
            assert _STRICT.fullmatch(key), f"accepted {key!r}"
            assert all(results)
            n["accepted"] += 1
        else:
            n["refused"] += 1

    run()
    b.close()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["canary", "jail"]
    assert canary.read_bytes() == b"keep me" and (jail / "etc" / "passwd").read_bytes() == b"outside"
    assert sorted(p.name for p in jail.iterdir()) == ["etc", "root"]
    assert sorted(p.name for p in (jail / "etc").iterdir()) == ["passwd"]
    for d, _, files in os.walk(root):
        for f in files:
            rel = os.path.relpath(os.path.join(d, f), root)
            if rel in (LEDGER_NAME, JOURNAL_NAME):  # the directory's usage ledger and removal journal
                continue
            assert re.fullmatch(r"[0-9a-f]{32}/[0-9a-f]{2}/(?:[0-9a-f]{32}|[0-9a-f]{64})", rel), rel
    figures("fuzzed keys refused / accepted by local_disk (5 ops each)", f"{n['refused']}/{n['accepted']}")
    figures("files created outside the disk root", 0)


def test_disk_never_follows_a_planted_symlink(tmp_path):
    """A symlink planted under a block's name is a miss on read and is replaced (not written through) on
    put: the file it points to is never read or changed."""
    root = tmp_path / "root"
    b = LocalDiskBackend({"path": str(root), "capacity": "64MiB"})
    key = NS.key(bytes(range(16)))
    outside = tmp_path / "outside"
    outside.write_bytes(b"x" * (88 + 64))
    ns, h = key.split("/")
    (root / ns / h[:2]).mkdir(parents=True)
    (root / ns / h[:2] / h).symlink_to(outside)
    assert b.get_into([key], [bytearray(64)], NS.layout_id) == [False]
    assert b.put([key], [np.arange(64, dtype=np.uint8)], NS.layout_id) == [True]
    assert outside.read_bytes() == b"x" * (88 + 64)
    assert not (root / ns / h[:2] / h).is_symlink()
    buf = bytearray(64)
    assert b.get_into([key], [buf], NS.layout_id) == [True] and bytes(buf) == bytes(range(64))
    b.close()


def test_fuzz_redis_and_s3_keys(redis_server, moto_server, s3_bucket, figures):
    """Garbage keys (CRLF, RESP fragments, glob characters, path pieces) never hit, never inject a
    command, and never disturb the blocks that are stored."""
    from kvtier.backends.redis import RedisBackend
    from kvtier.backends.s3 import S3Backend

    rb = RedisBackend({"url": redis_server.url})
    sb = S3Backend({"bucket": s3_bucket, "endpoint_url": moto_server.endpoint_url})
    good = NS.keys([bytes([i]) * 16 for i in range(4)])
    data = [np.full(64, i + 1, dtype=np.uint8) for i in range(4)]
    for be in (rb, sb):
        assert be.put(good, data, NS.layout_id) == [True] * 4
    n = {"redis": 0, "s3": 0}
    resp = st.sampled_from(["\r\n", "*1\r\n$8\r\nFLUSHALL\r\n", "FLUSHALL", "$-1", "*", "?", "[a-z]", "\\", "{tag}",
                            "kvtier:", good[0], "/", ".."])
    garbage = st.one_of(fuzz_keys, st.lists(resp, min_size=1, max_size=4).map("".join),
                        st.builds(lambda a, b: a + b, st.sampled_from(good), resp))

    def probe(be, key, name):
        n[name] += 1
        for fn in (lambda: be.get_into([key], [bytearray(64)], NS.layout_id),
                   lambda: be.exists([key]), lambda: be.put([key], [data[0]], NS.layout_id)):
            try:
                r = fn()
            except (ValueError, BackendError):
                continue
            assert r in ([False], 0), (name, key, r)

    @settings(max_examples=150, **FUZZ)
    @given(key=garbage)
    def run_redis(key):
        assume(not _well_formed(key))
        probe(rb, key, "redis")

    @settings(max_examples=40, **FUZZ)
    @given(key=garbage)
    def run_s3(key):
        assume(not _well_formed(key))
        probe(sb, key, "s3")

    run_redis()
    run_s3()
    for be in (rb, sb):
        bufs = [bytearray(64) for _ in good]
        assert be.get_into(good, bufs, NS.layout_id) == [True] * 4
        assert [bytes(x) for x in bufs] == [bytes(d) for d in data]
        assert be.stats().corrupt == 0
        be.close()
    assert int(redis_server.cli("DBSIZE").strip()) == 4
    figures("garbage keys probed (redis / s3)", f"{n['redis']}/{n['s3']}")
