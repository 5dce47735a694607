"""Every example in configs/ loads and validates with the real plugins; the embedded default is local.yaml."""

from __future__ import annotations

import pathlib
from importlib import resources

import pytest

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
