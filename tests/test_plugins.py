"""Entry-point plugins: built-ins and a real third-party package register the same way."""

from __future__ import annotations

import pytest

from kvtier import plugins
from kvtier.tools.cli import main


def test_builtins_register_through_entry_points():
    infos = {(p.group, p.name): p for p in plugins.available()}
    for group, name in [("kvtier.backends", "local_disk"), ("kvtier.backends", "redis"),
                        ("kvtier.backends", "s3"), ("kvtier.write_policies", "write_through"),
                        ("kvtier.write_policies", "write_through_selective"),
                        ("kvtier.write_policies", "write_back"), ("kvtier.prefetch_policies", "best_effort"),
                        ("kvtier.prefetch_policies", "wait_complete"), ("kvtier.prefetch_policies", "timeout"),
                        ("kvtier.eviction_policies", "lru")]:
        assert infos[(group, name)].distribution == "kvtier"


def test_third_party_backend_is_found_with_its_distribution():
    info = next(p for p in plugins.available("backend") if p.name == "memstore")
    assert (info.distribution, info.version) == ("kvtier-memstore", "0.3.1")
    cls = plugins.load("backend", "memstore")
    assert cls.__module__ == "kvtier_memstore"


def test_unknown_plugin_lists_available_names():
    with pytest.raises(plugins.PluginError) as e:
        plugins.load("backend", "nfs")
    msg = str(e.value)
    assert "unknown backend 'nfs'; available:" in msg
    for name in ("local_disk", "memstore", "redis", "s3"):
        assert name in msg


def test_broken_plugin_names_itself_and_its_distribution_and_leaves_others_usable():
    with pytest.raises(plugins.PluginError) as e:
        plugins.load("backend", "broken")
    msg = str(e.value)
    assert "backend plugin 'broken'" in msg and "kvtier-memstore 0.3.1" in msg
    assert "kvtier_memstore_missing_dependency" in msg
    assert plugins.load("backend", "memstore") is not None  # the same distribution's other plugin works


def test_unknown_kind():
    with pytest.raises(ValueError, match="unknown plugin kind 'codec'"):
        plugins.load("codec", "x")


def test_plugins_command_lists_group_name_distribution_version(capsys):
    assert main(["plugins"]) == 0
    out = capsys.readouterr().out
    line = next(ln for ln in out.splitlines() if " memstore " in f" {ln} ")
    assert "kvtier.backends" in line and "kvtier-memstore" in line and "0.3.1" in line
    assert main(["plugins", "--check"]) == 1  # the broken plugin is reported, the rest still listed
    out = capsys.readouterr().out
    assert "error:" in next(ln for ln in out.splitlines() if " broken " in ln)
    assert " ok" in next(ln for ln in out.splitlines() if " memstore " in ln)


def test_third_party_backend_used_from_yaml_through_the_stack(tmp_path):
    import numpy as np
    import torch

    from kvtier.config import load_config
    from kvtier.stack import TierStack

    cfg_path = tmp_path / "vendor.yaml"
    cfg_path.write_text("""
model: {id: vendor/test, kv_dtype: float32, num_layers: 2, num_kv_heads: 2, head_dim: 8, block_size: 4}
device: {kind: cpu, num_blocks: 8}
host: {capacity: "0"}            # no host tier: every load must come from the vendor's backend
backends:
  - name: vendor
    type: memstore
    options: {max_values: 100}
""")
    cfg = load_config(cfg_path, env={})
    assert type(cfg.backends[0].options).__name__ == "MemStoreOptions"
    with TierStack(cfg) as stack:
        assert type(stack.backends[0]).__module__ == "kvtier_memstore"
        hashes = stack.namespace.hasher().hash_blocks(list(range(12)))
        rng = np.random.default_rng(0)
        for t in stack.device.tensors if isinstance(stack.device.tensors, list) else [stack.device.tensors]:
            t.copy_(torch.from_numpy(rng.standard_normal(t.shape).astype(np.float32)))
        before = stack.device.read_blocks([0, 1, 2]).clone()
        stack.store(hashes, [0, 1, 2]).wait()
        stack.flush()
        assert stack.lookup(hashes).num_blocks == 3
        res = stack.load(hashes, [5, 6, 7]).wait()
        assert res.num_loaded == 3
        assert torch.equal(stack.device.read_blocks([5, 6, 7]), before)
        assert stack.backends[0].stats().puts == 3


def test_config_naming_an_unknown_backend_lists_available(tmp_path):
    from kvtier.config import ConfigError, parse_config

    with pytest.raises(ConfigError) as e:
        parse_config({"model": {"id": "m", "num_layers": 1, "num_kv_heads": 1, "head_dim": 8},
                      "backends": [{"type": "memstor"}]})
    msg = str(e.value)
    assert "backends[0].type" in msg and "memstore" in msg


def test_plain_basemodel_options_of_a_backend_or_policy_refuse_unknown_keys():
    """A plugin whose ``Options`` is a plain pydantic ``BaseModel`` (not kvtier's base, so pydantic's default
    of dropping unknown keys): a mistyped option is an error, not silently its default."""
    from pydantic import BaseModel, ConfigDict, ValidationError

    from kvtier.policy_api import WritePolicy
    from kvtier_memstore import MemStoreBackend

    class PlainOptions(BaseModel):
        max_values: int = 10

    class AllowOptions(BaseModel):
        model_config = ConfigDict(extra="allow")  # said explicitly: the plugin wants the extra keys
        max_values: int = 10

    class PlainMem(MemStoreBackend):
        Options = PlainOptions

    class AllowMem(MemStoreBackend):
        Options = AllowOptions

    class PlainPolicy(WritePolicy):
        Options = PlainOptions

    with pytest.raises(ValidationError, match="max_valuez"):
        PlainMem({"max_valuez": 3})
    with pytest.raises(ValidationError, match="max_valuez"):
        PlainPolicy({"max_valuez": 3})
    assert PlainMem({"max_values": 3}).options.max_values == 3
    assert isinstance(PlainPolicy({"max_values": 3}).options, PlainOptions)
    assert AllowMem({"max_values": 3, "extra_thing": 1}).options.model_extra == {"extra_thing": 1}
    assert plugins.strict_options(PlainOptions) is plugins.strict_options(PlainOptions)  # made once


def test_options_given_as_a_mapping_that_is_not_a_dict_are_validated_like_one():
    """A backend kept such a mapping as its options, unvalidated (a typo surfaced later as an
    AttributeError, or never); a backend and a policy now validate it as they validate a dict."""
    from types import MappingProxyType

    from pydantic import ValidationError

    from kvtier.policy_api import PolicyOptions, WritePolicy
    from kvtier_memstore import MemStoreBackend, MemStoreOptions

    with pytest.raises(ValidationError, match="max_valuez"):
        MemStoreBackend(MappingProxyType({"max_valuez": 3}))
    good = MemStoreBackend(MappingProxyType({"max_values": 3}))
    assert isinstance(good.options, MemStoreOptions) and good.options.max_values == 3
    with pytest.raises(ValidationError, match="thresholdz"):
        WritePolicy(MappingProxyType({"thresholdz": 3}))  # type: ignore[arg-type]
    assert isinstance(WritePolicy(MappingProxyType({})).options, PolicyOptions)  # type: ignore[arg-type]
