"""Every example in configs/ loads and validates with the real plugins; the embedded default is local.yaml."""

from __future__ import annotations

import pathlib
from importlib import resources

import pytest

from kvtier.config import DEFAULT_CONFIG, load_config

CONFIGS = pathlib.Path(__file__).resolve().parents[1] / "configs"
FILES = sorted(CONFIGS.glob("*.yaml"))


def test_the_documented_examples_exist():
    assert {p.name for p in FILES} >= {"local.yaml", "redis.yaml", "s3.yaml", "pd-prefill.yaml", "pd-decode.yaml"}


@pytest.mark.parametrize("path", FILES, ids=[p.name for p in FILES])
def test_config_file_is_valid(path):
    cfg = load_config(path, env={})  # real entry points: every backend and policy must exist
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
