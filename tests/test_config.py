"""kvtier.config: YAML -> typed config, error messages, sizes, env overrides, schema, `kvtier config`."""

from __future__ import annotations

import json
import subprocess
import sys
from importlib import metadata

import pytest
from pydantic import BaseModel, ConfigDict, Field

from kvtier import plugins
from kvtier.config import (
    ConfigError,
    KvtierConfig,
    apply_env_overrides,
    json_schema,
    load_config,
    parse_config,
    read_yaml,
)
from kvtier.keys import Namespace
from kvtier.plugins import PluginError
from kvtier.tools import cli
from kvtier.units import ByteSize, format_size, parse_size

MODEL = {"id": "m", "num_layers": 4, "num_kv_heads": 4, "head_dim": 32}


# --------------------------------------------------------------------------- a test-local plugin registry


class DiskOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    path: str
    capacity: ByteSize = 0
    timeout_s: float = 5.0


class FakeDisk:
    Options = DiskOptions


class SelectiveOptions(BaseModel):
    model_config = ConfigDict(extra="forbid")
    hits: int = Field(2, ge=1)


class FakeSelective:
    Options = SelectiveOptions


class NoOptions:
    """A plugin without an ``Options`` model: its options stay a plain dict."""


REGISTRY: dict[str, dict[str, type]] = {
    "backend": {"local_disk": FakeDisk, "redis": FakeDisk, "noopts": NoOptions},
    "write_policy": {"write_through": NoOptions, "write_through_selective": FakeSelective, "write_back": NoOptions},
    "prefetch_policy": {"best_effort": NoOptions, "wait_complete": NoOptions, "timeout": NoOptions},
    "eviction_policy": {"lru": NoOptions},
}


@pytest.fixture
def fake_plugins(monkeypatch):
    def load(kind, name):
        if name not in REGISTRY[kind]:
            have = ", ".join(sorted(REGISTRY[kind]))
            raise PluginError(f"unknown {kind.replace('_', ' ')} {name!r}; available: {have}")
        return REGISTRY[kind][name]

    monkeypatch.setattr(plugins, "load", load)
    monkeypatch.setattr(plugins, "names", lambda kind: sorted(REGISTRY[kind]))


def problems(data, **kw) -> list[str]:
    with pytest.raises(ConfigError) as e:
        parse_config(data, **kw)
    assert str(e.value) == "\n".join(e.value.problems)
    return e.value.problems


def cfg(**sections):
    return {"model": dict(MODEL), **sections}


# --------------------------------------------------------------------------- sizes


@pytest.mark.parametrize("text,expected", [
    (0, 0), ("0", 0), (1024, 1024), ("1024", 1024), ("512B", 512),
    ("4GiB", 4 * 2**30), ("512MiB", 512 * 2**20), ("1KiB", 1024), ("2TiB", 2 * 2**40),
    ("1.5GB", 1_500_000_000), ("100kB", 100_000), ("3MB", 3_000_000), ("1TB", 10**12),
    ("4gib", 4 * 2**30), ("4GIB", 4 * 2**30), ("100KB", 100_000), ("8 GiB", 8 * 2**30), (" 1.5KiB ", 1536),
    (".5MiB", 2**19), (1.0e9, 10**9),
])
def test_parse_size(text, expected):
    assert parse_size(text) == expected


@pytest.mark.parametrize("bad,fragment", [
    ("lots", 'got "lots"'), ("4G", 'unknown unit "G"'), ("-1", 'got "-1"'), (-5, "got -5"),
    ("1.5", "whole number"), (True, "got true"), ([1], "got list"), ("4 XB", 'unknown unit "XB"'), ("", 'got ""'),
    (1.5, "whole bytes"),
])
def test_parse_size_errors(bad, fragment):
    with pytest.raises(ValueError, match='expected a size') as e:
        parse_size(bad)
    assert fragment in str(e.value)


def test_format_size():
    assert [format_size(n) for n in (0, 1000, 1024, 1536, 256 * 2**20, 2**40)] == \
        ["0B", "1000B", "1KiB", "1.5KiB", "256MiB", "1TiB"]


# --------------------------------------------------------------------------- structure, defaults


def test_defaults(fake_plugins):
    c = parse_config(cfg())
    assert (c.model.kv_dtype, c.model.block_size, c.model.attention, c.model.tp_size) == ("bfloat16", 16, "mha", 1)
    assert (c.keys.algo, c.keys.seed) == ("sha256_cbor", None)
    assert (c.device.kind, c.device.num_blocks, c.device.layout) == ("auto", 1024, "flash_attn")
    assert (c.host.capacity, c.host.pinned) == (2**30, "auto")
    assert c.backends == []
    assert (c.policies.write.name, c.policies.prefetch.name, c.policies.eviction.name) == \
        ("write_through", "best_effort", "lru")
    assert c.policies.prefetch.threshold_tokens == 256
    assert (c.transfer.threads, c.metrics.prometheus_port) == (4, None)


def test_empty_sections_mean_defaults(fake_plugins):
    c = parse_config(cfg(host=None, policies={"write": None}, backends=[{"type": "noopts", "options": None}]))
    assert c.host.capacity == 2**30 and c.policies.write.name == "write_through"
    assert c.backends[0].options == {}


def test_backend_options_are_validated_models(fake_plugins):
    c = parse_config(cfg(backends=[{"type": "local_disk", "options": {"path": "~/kv", "capacity": "2GiB"}},
                                   {"name": "ro", "type": "noopts", "options": {"anything": 1}, "write": False}]))
    disk, ro = c.backends
    assert disk.name == "local_disk" and disk.write is True  # name defaults to the type
    assert isinstance(disk.options, DiskOptions) and disk.options.capacity == 2 * 2**30
    assert disk.options.path == "~/kv"  # expanded by the backend, not here
    assert (ro.name, ro.options, ro.write) == ("ro", {"anything": 1}, False)
    assert disk.plugin() is FakeDisk


def test_policy_options_are_validated(fake_plugins):
    c = parse_config(cfg(policies={"write": {"name": "write_through_selective", "options": {"hits": 3}}}))
    assert isinstance(c.policies.write.options, SelectiveOptions) and c.policies.write.options.hits == 3
    assert problems(cfg(policies={"write": {"name": "write_through_selective", "options": {"hits": 0}}})) == [
        "policies.write.options.hits: expected an integer >= 1, got 0"]


def test_namespace(fake_plugins):
    c = parse_config(cfg(model={**MODEL, "kv_dtype": "float8_e4m3fn", "tp_rank": 1, "tp_size": 2},
                         keys={"algo": "xxh3_128", "seed": 7}))
    assert c.namespace() == Namespace(model="m", kv_dtype="float8_e4m3fn", num_layers=4, num_kv_heads=4,
                                      head_dim=32, block_size=16, tp_rank=1, tp_size=2,
                                      hash_algo="xxh3_128", hash_seed=7)
    other = parse_config(cfg(model={**MODEL, "kv_dtype": "bfloat16", "tp_rank": 1, "tp_size": 2},
                             keys={"algo": "xxh3_128", "seed": 7}))
    assert other.namespace().id != c.namespace().id


def test_storage_payload_engine_names_a_head_major_layout_in_the_namespace(fake_plugins):
    canonical = parse_config(cfg(device={"layout": "cpu_attn_amx"}))
    engine = parse_config(cfg(device={"layout": "cpu_attn_amx"}, storage={"payload": "engine"}))
    assert canonical.namespace().payload == "canonical"
    assert engine.namespace().payload == "cpu_attn_amx" and engine.namespace().id != canonical.namespace().id
    assert engine.summary().endswith("; values keep cpu_attn_amx's own arrangement")
    # A layout whose blocks are the canonical payload: engine changes nothing, not even a key.
    flash = parse_config(cfg(storage={"payload": "engine"}))
    assert flash.namespace() == parse_config(cfg()).namespace()
    assert problems(cfg(storage={"payload": "native"})) == [
        'storage.payload: expected one of "canonical", "engine", got "native"']


def test_summary(fake_plugins):
    c = parse_config(cfg(host={"capacity": "256MiB"},
                         backends=[{"type": "local_disk", "options": {"path": "/x"}},
                                   {"name": "shared", "type": "redis", "options": {"path": "/y"}, "write": False}]))
    assert c.summary() == ("device (auto, flash_attn, 1024 blocks) -> host 256MiB -> local_disk (local_disk) "
                           "-> shared (redis, read-only)")
    assert "host off" in parse_config(cfg(host={"capacity": "0"})).summary()
    assert c.summary(48, engine="vLLM").startswith("device (vLLM's KV cache, 48 blocks) -> host 256MiB")


# --------------------------------------------------------------------------- error messages


def test_bad_size(fake_plugins):
    assert problems(cfg(host={"capacity": "lots"})) == ['host.capacity: expected a size like "4GiB", got "lots"']


class PlainOptions(BaseModel):
    """A third party's options as a plain pydantic model: pydantic alone would drop unknown keys."""

    size: int = 1
    url: str = "x"


class PlainPlugin:
    Options = PlainOptions


def test_plain_basemodel_options_refuse_unknown_keys(fake_plugins, monkeypatch):
    monkeypatch.setitem(REGISTRY["backend"], "plain", PlainPlugin)
    monkeypatch.setitem(REGISTRY["write_policy"], "plain", PlainPlugin)
    assert problems(cfg(backends=[{"type": "plain", "options": {"sise": 2}}])) == [
        'backends[0].options.sise: unknown key; did you mean "size"?']
    assert problems(cfg(policies={"write": {"name": "plain", "options": {"ulr": "y"}}})) == [
        'policies.write.options.ulr: unknown key; did you mean "url"?']
    c = parse_config(cfg(backends=[{"type": "plain", "options": {"size": 2}}],
                         policies={"write": {"name": "plain", "options": {"url": "y"}}}))
    opts = c.backends[0].options
    assert isinstance(opts, PlainOptions) and type(opts).__name__ == "PlainOptions" and opts.size == 2
    assert c.policies.write.options.url == "y"


def test_unknown_key_did_you_mean(fake_plugins):
    assert problems(cfg(host={"capacty": "1GiB"})) == ['host.capacty: unknown key; did you mean "capacity"?']
    assert problems(cfg(transfer={"zzz": 1})) == ["transfer.zzz: unknown key; allowed keys: threads, cpus"]
    assert problems({**cfg(), "tiers": {}}) == [
        "tiers: unknown key; allowed keys: model, keys, device, host, backends, storage, policies, transfer, metrics, "
        "security"]
    assert problems(cfg(backends=[{"type": "local_disk", "options": {"pth": "/x"}}])) == [
        "backends[0].options.path: missing required key",
        'backends[0].options.pth: unknown key; did you mean "path"?']


@pytest.mark.parametrize("section,value,expected", [
    ({"model": {**MODEL, "num_layers": "four"}}, None, 'model.num_layers: expected an integer >= 1, got "four"'),
    ({"model": {**MODEL, "num_layers": "4"}}, None, 'model.num_layers: expected an integer >= 1, got "4"'),
    ({"model": {**MODEL, "head_dim": 0}}, None, "model.head_dim: expected an integer >= 1, got 0"),
    ({"model": {**MODEL, "head_dim": 4.5}}, None, "model.head_dim: expected an integer >= 1, got 4.5"),
    ({"model": {**MODEL, "id": ""}}, None, 'model.id: expected a non-empty string, got ""'),
    ({"model": {**MODEL, "id": 12}}, None, "model.id: expected a string, got 12"),
    ({"backends": [{"type": "local_disk", "options": {"path": "/x"}, "write": "no"}]}, None,
     'backends[0].write: expected true or false, got "no"'),
    ({"host": [1]}, None, "host: expected a mapping, got a list [1]"),
    ({"backends": {"type": "redis"}}, None, 'backends: expected a list, got a mapping {"type": "redis"}'),
    ({"backends": [5]}, None, "backends[0]: expected a mapping, got 5"),
    ({"backends": [{"type": "noopts", "options": "x"}]}, None,
     'backends[0].options: expected a mapping of plugin options, got "x"'),
    ({"backends": [{"type": "noopts", "name": "a b"}]}, None,
     'backends[0].name: expected a name matching ^[A-Za-z0-9][A-Za-z0-9_.-]*$, got "a b"'),
    ({"keys": {"seed": 1.5}}, None, "keys.seed: expected a string, an integer or null, got 1.5"),
    ({"host": {"pinned": "sometimes"}}, None, 'host.pinned: expected "auto", true or false, got "sometimes"'),
    ({"metrics": {"prometheus_port": 70000}}, None,
     "metrics.prometheus_port: expected an integer in [1, 65535], got 70000"),
    ({"policies": {"prefetch": {"threshold_tokens": -1}}}, None,
     "policies.prefetch.threshold_tokens: expected an integer >= 0, got -1"),
    ({"device": {"kind": "gpu"}}, None, 'device.kind: expected one of "auto", "cpu", "cuda", got "gpu"'),
    ({"model": {**MODEL, "kv_dtype": "bf16"}}, None,
     'model.kv_dtype: expected one of "bfloat16", "float16", "float32", "float8_e4m3fn", "float8_e5m2", "int8", '
     'got "bf16"; did you mean "bfloat16"?'),
    ({"keys": {"algo": "xxh3"}}, None,
     'keys.algo: expected one of "sha256_cbor", "xxh3_128", "sglang_sha256", got "xxh3"; did you mean "xxh3_128"?'),
])
def test_wrong_values(fake_plugins, section, value, expected):
    assert problems({"model": dict(MODEL), **section}) == [expected]


def test_missing(fake_plugins):
    assert problems({"host": {}}) == ["model: missing required section"]
    assert problems({"model": {"num_layers": 1, "num_kv_heads": 1, "head_dim": 1}}) == [
        "model.id: missing required key"]
    assert problems(cfg(backends=[{"options": {}}])) == ["backends[0].type: missing required key"]


def test_every_problem_reported_at_once(fake_plugins):
    got = problems({"model": {**MODEL, "num_layers": 0}, "host": {"capacity": "x", "pinnd": 1},
                    "backends": [{"type": "nosuch"}]})
    assert got == ['model.num_layers: expected an integer >= 1, got 0',
                   'host.capacity: expected a size like "4GiB", got "x"',
                   'host.pinnd: unknown key; did you mean "pinned"?',
                   "backends[0].type: unknown backend 'nosuch'; available: local_disk, noopts, redis"]


def test_cross_field_checks(fake_plugins):
    assert problems(cfg(model={**MODEL, "tp_rank": 2, "tp_size": 2})) == [
        "model.tp_rank: expected 0 <= tp_rank < tp_size (2), got 2"]
    assert problems(cfg(backends=[{"type": "noopts"}, {"type": "noopts"}])) == [
        'backends[1].name: duplicate backend name "noopts" (also backends[0]); give each instance a unique name']


def test_unknown_plugin_names(fake_plugins):
    assert problems(cfg(backends=[{"type": "redsi"}])) == [
        "backends[0].type: unknown backend 'redsi'; available: local_disk, noopts, redis; did you mean \"redis\"?"]
    assert problems(cfg(policies={"write": {"name": "write_bak"}})) == [
        "policies.write.name: unknown write policy 'write_bak'; available: write_back, write_through, "
        'write_through_selective; did you mean "write_back"?']


def test_plugin_that_fails_to_import(monkeypatch):
    """Through the real registry: a plugin whose module is missing is named, with the key path."""
    broken = metadata.EntryPoint("broken", "kvtier_no_such_module:Backend", "kvtier.backends")
    real = plugins._entry_points
    monkeypatch.setattr(plugins, "_entry_points",
                        lambda group: [broken] if group == "kvtier.backends" else real(group))
    got = problems(cfg(backends=[{"type": "broken"}]), resolve_plugins=True)
    mine = [p for p in got if p.startswith("backends[0]")]
    assert len(mine) == 1 and mine[0].startswith("backends[0].type: backend plugin 'broken' ")
    assert "failed to import" in mine[0] and "kvtier_no_such_module" in mine[0]


def test_resolve_plugins_false_checks_structure_only():
    c = parse_config(cfg(backends=[{"type": "not-installed", "options": {"x": 1}}]), resolve_plugins=False)
    assert c.backends[0].options == {"x": 1}


# --------------------------------------------------------------------------- files and YAML


def write(tmp_path, text, name="c.yaml"):
    p = tmp_path / name
    p.write_bytes(text.encode() if isinstance(text, str) else text)
    return p


def load_problems(path, **kw):
    with pytest.raises(ConfigError) as e:
        load_config(path, env={}, **kw)
    return e.value.problems


def test_yaml_syntax_error_names_file_line_column(tmp_path):
    p = write(tmp_path, "model:\n  id: m\n  head_dim: [1, 2\nhost: {}\n")
    (line,) = load_problems(p)
    assert line.startswith(f"{p}:4:5: invalid YAML: ") or line.startswith(f"{p}:4:1: invalid YAML: ")
    p = write(tmp_path, "model:\n  id: m\n    bad: indent\n")
    (line,) = load_problems(p)
    assert line.startswith(f"{p}:3:8: invalid YAML: mapping values are not allowed here")


def test_yaml_errors_are_worded_as_pythons_parser_words_them_though_libyaml_reads_first(tmp_path):
    """kvtier reads YAML with libyaml's parser where PyYAML has it (14x faster) and, for a document it
    refuses, reports the pure-Python parser's error: a tab is named, a lone surrogate is a one-line error,
    not a traceback; a valid document reads as PyYAML's safe loader reads it."""
    import pathlib

    import yaml

    assert yaml.__with_libyaml__  # the install command's PyYAML: the fast path is the one taken here
    p = write(tmp_path, "model:\n\tid: m\n")
    (line,) = load_problems(p)
    assert line.startswith(f"{p}:2:1: invalid YAML: found character '\\t' that cannot start any token")
    with pytest.raises(ConfigError) as e:
        read_yaml("model: \ud800\n", "inline")
    assert e.value.problems == ["inline:1:8: invalid YAML: unacceptable character #xd800: special characters "
                                "are not allowed"]
    for path in sorted((pathlib.Path(__file__).parents[1] / "configs").glob("*.yaml")):
        text = path.read_text()
        assert read_yaml(text, path.name) == yaml.safe_load(text)


def test_duplicate_yaml_key(tmp_path):
    p = write(tmp_path, "host:\n  capacity: 1GiB\n  capacity: 2GiB\n")
    assert load_problems(p) == [f'{p}:3:3: invalid YAML: duplicate key "capacity" (first at line 2)']
    p = write(tmp_path, "host: {pinned: true, pinned: false}\n")
    assert load_problems(p) == [f'{p}:1:22: invalid YAML: duplicate key "pinned" (first at line 1)']


@pytest.mark.parametrize("text,expected", [
    ("", 'the file is empty; expected a mapping with at least a "model:" section'),
    ("# only a comment\n", 'the file is empty; expected a mapping with at least a "model:" section'),
    ("- a\n- b\n", 'expected a mapping at the top level (model:, host:, backends:, ...), got a list ["a", "b"]'),
    ("just text\n", 'expected a mapping at the top level (model:, host:, backends:, ...), got "just text"'),
])
def test_empty_or_not_a_mapping(tmp_path, text, expected):
    p = write(tmp_path, text)
    assert load_problems(p) == [f"{p}: {expected}"]


def test_unreadable_files(tmp_path):
    assert load_problems(tmp_path / "nope.yaml") == [f"{tmp_path / 'nope.yaml'}: cannot read the file: "
                                                     "No such file or directory"]
    assert load_problems(tmp_path)[0].startswith(f"{tmp_path}: cannot read the file: ")
    assert "cannot read the file" in load_problems(write(tmp_path, b"model: \xff\xfe\n"))[0]


@pytest.mark.parametrize("text", [
    "[", "{", "model: *nope", "!!python/object/apply:os.system [echo hi]", "? [a, b]\n: c\n", "model: !!binary xyz",
    "model: 5", "model: {id: [1], num_layers: .nan}", "1: 2", "null: 1", "backends: [[[]]]", "\t\x00",
    "a: " + "[" * 200 + "]" * 200, "backends: [{type: 1}]", "policies: {write: {name: [1]}}", "---\na: 1\n---\nb: 2\n",
    "host: {capacity: 1e400}", "host: {capacity: -.inf}", "keys: {seed: 2020-01-01}",
])
def test_never_a_traceback(tmp_path, fake_plugins, text):
    with pytest.raises(ConfigError) as e:
        load_config(write(tmp_path, text), env={})
    assert e.value.problems and all(": " in p for p in e.value.problems)


# --------------------------------------------------------------------------- environment overrides


def test_env_overrides(fake_plugins):
    data = cfg(backends=[{"type": "local_disk", "options": {"path": "/a"}}])
    env = {"KVTIER_HOST__CAPACITY": "8GiB", "KVTIER_BACKENDS__0__OPTIONS__PATH": "/data/kv",
           "KVTIER_POLICIES__WRITE__NAME": "write_back", "KVTIER_TRANSFER__THREADS": "8",
           "KVTIER_BACKENDS__0__WRITE": "false", "KVTIER_METRICS__PROMETHEUS_PORT": "9400",
           "KVTIER_KEYS__SEED": "", "KVTIER_CONFIG": "/elsewhere.yaml", "KVTIER_LOG_LEVEL": "debug", "PATH": "/bin"}
    c = parse_config(data, env=env)
    assert c.host.capacity == 8 * 2**30 and c.backends[0].options.path == "/data/kv"
    assert c.policies.write.name == "write_back" and c.transfer.threads == 8
    assert c.backends[0].write is False and c.metrics.prometheus_port == 9400 and c.keys.seed is None
    assert data["backends"][0]["options"]["path"] == "/a"  # the caller's data is not modified


def test_env_overrides_from_os_environ(tmp_path, monkeypatch, fake_plugins):
    p = write(tmp_path, json.dumps(cfg()))
    monkeypatch.setenv("KVTIER_HOST__CAPACITY", "3MiB")
    assert load_config(p).host.capacity == 3 * 2**20
    assert load_config(p, env={}).host.capacity == 2**30


def test_env_override_errors(fake_plugins):
    data = cfg(backends=[{"type": "noopts"}])
    assert problems(data, env={"KVTIER_HOST__CAPACTY": "1"}) == [
        'KVTIER_HOST__CAPACTY: host has no key "capacty"; did you mean "capacity"?']
    assert problems(data, env={"KVTIER_HOSTS__CAPACITY": "1"})[0].startswith(
        'KVTIER_HOSTS__CAPACITY: the top level has no key "hosts"; did you mean "host"?')
    assert problems(data, env={"KVTIER_BACKENDS__1__TYPE": "redis"}) == [
        'KVTIER_BACKENDS__1__TYPE: backends has no entry "1" (it has 1; an override can change an entry, '
        "not add one)"]
    assert problems(data, env={"KVTIER_MODEL__ID__X": "1"}) == [
        'KVTIER_MODEL__ID__X: model.id is a single value; it has no key "x"']
    assert problems(data, env={"KVTIER_HOST____CAPACITY": "1"}) == [
        "KVTIER_HOST____CAPACITY: empty name between '__' separators"]
    assert problems(data, env={"KVTIER_HOST__CAPACITY": "lots"}) == [
        'host.capacity: expected a size like "4GiB", got "lots" (set by environment variable KVTIER_HOST__CAPACITY)']


def test_env_override_into_plugin_options_blames_the_variable(fake_plugins):
    data = cfg(backends=[{"type": "local_disk", "options": {"path": "/a"}}])
    assert problems(data, env={"KVTIER_BACKENDS__0__OPTIONS__PTH": "/b"}) == [
        'backends[0].options.pth: unknown key; did you mean "path"? '
        "(set by environment variable KVTIER_BACKENDS__0__OPTIONS__PTH)"]


def test_apply_env_overrides_reports_sources():
    out, sources, errs = apply_env_overrides({"model": {}}, {"KVTIER_HOST__PINNED": "true"})
    assert out["host"] == {"pinned": True} and sources == {"host.pinned": "KVTIER_HOST__PINNED"} and errs == []


# --------------------------------------------------------------------------- schema and CLI


def test_json_schema():
    schema = json.loads(json.dumps(json_schema()))
    assert schema["$schema"].startswith("https://json-schema.org/")
    assert set(schema["properties"]) == set(KvtierConfig.model_fields)
    assert schema["required"] == ["model"] and schema["additionalProperties"] is False
    backend = schema["$defs"]["BackendConfig"]["properties"]
    assert backend["options"]["type"] == "object" and "description" in backend["options"]
    assert "anyOf" in schema["$defs"]["HostSection"]["properties"]["capacity"]
    assert "KVTIER_" in schema["description"]


def test_json_schema_validates_the_example_configs():
    jsonschema = pytest.importorskip("jsonschema")
    import pathlib

    import yaml

    for path in sorted((pathlib.Path(__file__).parents[1] / "configs").glob("*.yaml")):
        if path.name.startswith(("vllm-", "sglang-")):  # the engine fills their model section (test_configs_dir)
            continue
        jsonschema.validate(yaml.safe_load(path.read_text()), json_schema())
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"model": MODEL, "host": {"capacity": "4G"}}, json_schema())


def test_cli_check(tmp_path, capsys, fake_plugins):
    good = write(tmp_path, json.dumps(cfg(backends=[{"type": "local_disk", "options": {"path": "/x"}}])), "good.yaml")
    assert cli.main(["config", "check", "--no-env", str(good)]) == 0
    out = capsys.readouterr().out.splitlines()
    assert out[0] == f"{good}: ok" and out[1].startswith("  tiers: device (auto") and "namespace: " in out[2]

    bad = write(tmp_path, json.dumps(cfg(host={"capacty": 1})), "bad.yaml")
    assert cli.main(["config", "check", "--no-env", str(good), str(bad)]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines() == [f"{bad}: invalid (1 problem)",
                                         '  host.capacty: unknown key; did you mean "capacity"?']


def test_cli_schema(capsys):
    assert cli.main(["config", "schema"]) == 0
    assert json.loads(capsys.readouterr().out) == json_schema()


def test_cli_subprocess_exit_code(tmp_path):
    bad = write(tmp_path, "model:\n  id: m\n  num_layers: 0\n")
    r = subprocess.run([sys.executable, "-m", "kvtier", "config", "check", str(bad)],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr
    assert "model.num_layers: expected an integer >= 1, got 0" in r.stderr


def test_never_a_traceback_fuzzed(fake_plugins):
    """Random YAML-like values spliced into a valid config: only ConfigError, each line `path: problem`."""
    hypothesis = pytest.importorskip("hypothesis")
    st = hypothesis.strategies
    scalars = st.none() | st.booleans() | st.integers() | st.floats() | st.text(max_size=8)
    values = st.recursive(scalars, lambda kids: st.lists(kids, max_size=3)
                          | st.dictionaries(st.text(max_size=8) | st.integers(), kids, max_size=3), max_leaves=8)
    keys = st.sampled_from(["model", "keys", "device", "host", "backends", "policies", "transfer", "metrics", "x"])
    sub = st.sampled_from(["id", "num_layers", "capacity", "kind", "type", "options", "name", "seed", "write"])

    @hypothesis.settings(max_examples=300, deadline=None)
    @hypothesis.given(keys, sub, values)
    def check(section, key, value):
        data = cfg(backends=[{"type": "local_disk", "options": {"path": "/x"}}])
        node = data.setdefault(section, {})
        if isinstance(node, list):
            node = node[0]
        node[key] = value
        try:
            parse_config(data)
        except ConfigError as e:
            assert e.problems and all(": " in p for p in e.problems)

    check()
