"""The vLLM connector's pieces that need no vLLM process: layout detection, layer order, config facts.
Bad input gets a message naming what was found and what is supported."""

from __future__ import annotations

import types

import pytest
import torch

from kvtier.integrations.vllm.facts import kv_layers
from kvtier.integrations.vllm.worker import detect_layout, layer_order


def test_detect_layout_of_each_supported_tensor_and_refuse_others():
    h, d, b = 8, 128, 32
    assert detect_layout(torch.empty(4, h, b, 2 * d), h, d, b, mla=False) == "cpu_attn"
    assert detect_layout(torch.empty(2, 4, b, h, d), h, d, b, mla=False) == "flash_attn"
    assert detect_layout(torch.empty(4, 2, b, h, d), h, d, b, mla=False) == "flashinfer"
    assert detect_layout(torch.empty(4, b, 576), 1, 576, b, mla=True) == "mla"
    with pytest.raises(ValueError, match=r"unsupported vLLM KV cache tensor: shape \(4, 32, 8, 256\).*"
                                         r"\(8 kv heads, head dim 128, block size 32\); supported: CPU"):
        detect_layout(torch.empty(4, b, h, 2 * d), h, d, b, mla=False)


def test_layer_order_is_by_layer_index_not_by_name():
    names = [f"model.layers.{i}.self_attn.attn" for i in (10, 2, 1, 0)]
    assert layer_order(names) == [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2, 10)]


def test_hybrid_kv_cache_groups_are_refused_with_the_count():
    one = types.SimpleNamespace(kv_cache_groups=[types.SimpleNamespace(layer_names=["a", "b"])])
    assert kv_layers(one) == ["a", "b"]
    two = types.SimpleNamespace(kv_cache_groups=one.kv_cache_groups * 2)
    with pytest.raises(ValueError, match="models with 2 KV cache groups .* are not supported yet"):
        kv_layers(two)
