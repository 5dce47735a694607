"""Every example in configs/ loads and validates with the real plugins; the embedded default is local.yaml."""

from __future__ import annotations

import pathlib
from importlib import resources

import pytest
import yaml

from kvtier.config import DEFAULT_CONFIG, ConfigError, load_config, load_engine_config

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
FILES = sorted(CONFIGS.glob("*.yaml"))


def test_the_documented_examples_exist():
    assert {p.name for p in FILES} >= {"local.yaml", "redis.yaml", "s3.yaml", "pd-prefill.yaml", "pd-decode.yaml",
                                       "vllm-local.yaml", "vllm-redis.yaml"}


def test_vllm_examples_take_the_model_from_vllm_and_refuse_disagreement(tmp_path):
    cfg = load_example(CONFIGS / "vllm-local.yaml")
    assert (cfg.model.num_layers, cfg.model.num_kv_heads, cfg.model.block_size) == (32, 8, 16)
    assert load_example(CONFIGS / "vllm-redis.yaml").model.id == "meta-llama/Llama-3.1-8B-Instruct"
    bad = tmp_path / "bad.yaml"
    bad.write_text("model:\n  num_layers: 4\n  block_size: 16\n")
    with pytest.raises(ConfigError) as e:
        load_engine_config(bad, VLLM_FACTS, engine="vLLM", env={})
    assert e.value.problems == ["model.num_layers: the YAML says 4 but vLLM runs 32; remove the key (the engine "
                                "fills it) or make it match"]


# What vLLM tells the connector about a Llama-3-8B (the vllm-*.yaml examples leave the model to vLLM).
VLLM_FACTS = {"id": "meta-llama/Llama-3.1-8B-Instruct", "kv_dtype": "bfloat16", "num_layers": 32,
              "num_kv_heads": 8, "head_dim": 128, "block_size": 16}


ENGINES = {"vllm-": "vLLM", "sglang-": "SGLang"}  # examples whose model section the engine fills


def load_example(path):
    engine = next((e for prefix, e in ENGINES.items() if path.name.startswith(prefix)), None)
    if engine is not None:
        return load_engine_config(path, VLLM_FACTS, engine=engine, env={})
    return load_config(path, env={})


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_config_file_is_valid(path):
    cfg = load_example(path)  # real entry points: every backend and policy must exist
    assert cfg.namespace().id
    for b in cfg.backends:  # options were validated by the backend's own Options model
        schema = getattr(b.plugin(), "Options", None)
        assert schema is None or isinstance(b.options, schema)
    assert path.read_text().lstrip().startswith("#"), "each example documents itself in a comment header"


def test_embedded_default_is_configs_local_yaml():
    embedded = resources.files("kvtier.configs").joinpath(DEFAULT_CONFIG).read_text(encoding="utf-8")
    assert embedded == (CONFIGS / "local.yaml").read_text(encoding="utf-8")
    assert load_config(None, env={}) == load_config(CONFIGS / "local.yaml", env={})


def test_local_default_needs_no_server():
    cfg = load_config(None, env={})
    assert [b.type for b in cfg.backends] == ["local_disk"]
    assert cfg.model.id == "kvtier/tiny-llama" and cfg.host.capacity == 256 * 2**20


def test_pd_pair_shares_a_namespace_and_a_backend():
    prefill = load_config(CONFIGS / "pd-prefill.yaml", env={})
    decode = load_config(CONFIGS / "pd-decode.yaml", env={})
    assert prefill.namespace() == decode.namespace()
    (p,), (d,) = prefill.backends, decode.backends
    assert (p.type, p.options) == (d.type, d.options)
    assert p.write is True and d.write is False
    assert decode.policies.prefetch.name == "wait_complete"


def check(capsys, *argv: str) -> tuple[int, list[str], str]:
    from kvtier.tools import cli

    rc = cli.main(["config", "check", "--no-env", *argv])
    out, err = capsys.readouterr()
    return rc, out.splitlines(), err


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_config_check_accepts_every_example(path, capsys):
    """`kvtier config check configs/vllm-local.yaml` said `model: missing required section`: a YAML whose
    model vLLM or SGLang fills is now checked as the engine fills it, and says so."""
    rc, out, err = check(capsys, str(path))
    assert rc == 0, err
    assert out[0] == f"{path}: ok" and out[1].startswith("  tiers: device (")
    if path.name.startswith(tuple(ENGINES)):
        assert out[2].startswith("  model: filled by the engine (vllm / sglang) at start-up; this file sets ")
        given = yaml.safe_load(path.read_text()).get("model") or {}
        assert out[2].endswith(f"model.id = {given['id']}" if "id" in given else
                               "will be the engine's model name)")
        assert out[3].startswith("  namespace: set at start-up from the engine's model")
        engine = "vllm" if path.name.startswith("vllm-") else "sglang"
        rc, out, err = check(capsys, "--engine", engine, str(path))
        assert rc == 0, err
        assert out[2].startswith(f"  model: filled by the engine ({engine}) at start-up")
    else:  # a complete config: as before, with its own namespace
        ns = load_config(path, env={}).namespace().id
        assert out[2] == f"  namespace: {ns} (kvtier/tiny-llama, float32, sha256_cbor)"


def test_config_check_engine_yaml_problems(tmp_path, capsys):
    bad = tmp_path / "bad.yaml"
    text = (CONFIGS / "vllm-local.yaml").read_text()
    assert "\nhost:\n  capacity: " in text  # the key the typo below misspells
    bad.write_text(text.replace("\nhost:\n  capacity: ", "\nhost:\n  capacty: "))
    rc, out, err = check(capsys, str(bad))
    assert rc == 2 and out == []
    assert err.splitlines() == [f"{bad}: invalid (1 problem)",
                                '  host.capacty: unknown key; did you mean "capacity"?']
    # A model key the file sets is checked as written; the fields it leaves out take no part.
    bad.write_text("model:\n  id: m\n  num_layers: 0\n")
    rc, _, err = check(capsys, str(bad))
    assert rc == 2 and err.splitlines()[1:] == ["  model.num_layers: expected an integer >= 1, got 0"]
    bad.write_text("model:\n  block_size: 16\nstorage:\n  block_tokens: 24\n")
    rc, _, err = check(capsys, str(bad))
    assert rc == 2 and err.splitlines()[1:] == ["  storage.block_tokens: expected a multiple of "
                                                "model.block_size (16), got 24"]
    bad.write_text("storage:\n  block_tokens: 24\n")  # the engine's block size is checked at start-up
    rc, out, _ = check(capsys, str(bad))
    assert rc == 0 and out[0] == f"{bad}: ok"
    # SGLang names its pages itself: another keys.algo is refused as SGLang refuses it at start-up.
    rc, _, err = check(capsys, "--engine", "sglang", str(CONFIGS / "vllm-local.yaml"))
    assert rc == 2 and "keys.algo: the YAML says \"sha256_cbor\" but SGLang names its pages itself" in err
    # --engine none: kvtier alone (run, pd) needs the whole model section.
    rc, _, err = check(capsys, "--engine", "none", str(CONFIGS / "vllm-local.yaml"))
    assert rc == 2 and err.splitlines()[1] == "  model: missing required section"
