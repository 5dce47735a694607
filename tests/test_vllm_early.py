"""kvtier's part of a vLLM command line is checked before vLLM loads the model (issue 40, defects 5 and 7).

A real vLLM OpenAI server (the CPU build) started with a misspelt key in kvtier's YAML stops while it builds
its config from the command line, before any engine process or model exists: exit status 2, its log ending
in kvtier's one line naming the key, no traceback.  The same check (``kvtier.integrations.vllm.early``) on
vLLM's real ``KVTransferConfig`` names each other kind of mistake in one line: a missing file, an unknown
extra-config key, a bad load mode, and a ``keys.seed`` that would make kvtier's keys differ from vLLM's
block hashes (the shipped P/D recipe's ERROR), while every vLLM YAML under configs/ passes.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import pytest

CONFIGS = Path(__file__).resolve().parent.parent / "configs"


@pytest.fixture(scope="module")
def vllm_config_classes() -> Any:
    try:
        from vllm.config import CacheConfig, KVTransferConfig
    except ImportError as e:  # the README's test command installs it
        pytest.fail(f"vLLM is not importable ({e}); run the README's test command (bash tests/run.sh)")
    return CacheConfig, KVTransferConfig


def _problem(classes: Any, extra: dict[str, Any], hash_algo: str = "sha256_cbor") -> str | None:
    from kvtier.integrations.vllm.early import problem

    cache_cls, ktc_cls = classes
    ktc = ktc_cls(kv_connector="KvtierConnector", kv_connector_module_path="kvtier.integrations.vllm",
                  kv_role="kv_both", kv_connector_extra_config=extra)
    vllm_config = SimpleNamespace(cache_config=cache_cls(prefix_caching_hash_algo=hash_algo))
    return problem(ktc, vllm_config)


def test_each_mistake_is_one_line_naming_it(vllm_config_classes, tmp_path, monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    for name in ("vllm-local.yaml", "vllm-redis.yaml"):
        assert _problem(vllm_config_classes, {"kvtier_config": str(CONFIGS / name)}) is None, name
    assert _problem(vllm_config_classes, {}) is None  # the embedded default's tiers

    missing = tmp_path / "nope.yaml"
    got = _problem(vllm_config_classes, {"kvtier_config": str(missing)})
    assert got == f"kvtier: {missing}: {missing}: cannot read the file: No such file or directory"

    got = _problem(vllm_config_classes, {"kvtier_confg": "x.yaml"})
    assert got is not None and "unknown key(s) ['kvtier_confg']; did you mean 'kvtier_config'?" in got

    got = _problem(vllm_config_classes, {"load_mode": "eager"})
    assert got is not None and "load_mode: 'eager' is not one of" in got

    seeded = tmp_path / "seeded.yaml"
    seeded.write_text("keys:\n  algo: sha256_cbor\n  seed: kvtier-pd-1\n")
    got = _problem(vllm_config_classes, {"kvtier_config": str(seeded)})
    assert got == (f"kvtier: {seeded}: keys.seed: 'kvtier-pd-1' would make kvtier's block keys differ from "
                   "vLLM's request.block_hashes, which vLLM seeds from PYTHONHASHSEED='0'; remove keys.seed "
                   "from the YAML and set PYTHONHASHSEED alike on every instance and router")
    assert "\n" not in got
    # The same seed as vLLM's, or another hash algorithm in vLLM (kvtier's keys are its own then): fine.
    monkeypatch.setenv("PYTHONHASHSEED", "kvtier-pd-1")
    assert _problem(vllm_config_classes, {"kvtier_config": str(seeded)}) is None
    monkeypatch.setenv("PYTHONHASHSEED", "0")
    assert _problem(vllm_config_classes, {"kvtier_config": str(seeded)}, hash_algo="sha256") is None


@pytest.fixture(scope="module")
def config_only_model(tmp_path_factory) -> str:
    """A model directory with a config and no weights: the server must stop before it would read them."""
    from transformers import LlamaConfig

    d = tmp_path_factory.mktemp("llama-config-only")
    LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=2,
                num_attention_heads=4, num_key_value_heads=2, head_dim=64,
                max_position_embeddings=4096).save_pretrained(d)
    return str(d)


def test_a_yaml_typo_stops_the_server_before_the_model_loads(config_only_model, tmp_path):
    """The model directory has no weights: a server that got as far as loading them would fail on that,
    not on kvtier's YAML."""
    from kvtier.testing.redis_server import free_port

    bad = tmp_path / "typo.yaml"
    bad.write_text("host:\n  capacty: 1GiB\n")
    flag = ('{"kv_connector":"KvtierConnector","kv_connector_module_path":"kvtier.integrations.vllm",'
            f'"kv_role":"kv_both","kv_connector_extra_config":{{"kvtier_config":"{bad}"}}}}')
    cmd = [sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", config_only_model,
           "--skip-tokenizer-init", "--enforce-eager", "--host", "127.0.0.1", "--port", str(free_port()),
           "--kv-transfer-config", flag]
    t0 = time.monotonic()
    proc = subprocess.run(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, timeout=300,
                          env={**os.environ, "VLLM_CPU_KVCACHE_SPACE": "1"})
    took = time.monotonic() - t0
    log = proc.stdout.strip()
    lines = log.splitlines()
    assert proc.returncode == 2, log[-3000:]
    assert lines[-1].endswith(f'kvtier: {bad}: host.capacty: unknown key; did you mean "capacity"? (checked '
                              "before the model loads; the server stops)"), lines[-5:]
    assert " ERROR " in lines[-1]
    assert "Traceback" not in log, log[-3000:]
    assert not any("EngineCore" in line for line in lines), "an engine process started"
    print(f"stopped after {took:.1f} s")
