"""Reuse is exact, never wrong: what a decode instance may reuse from what a prefill instance stored."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvtier.config import parse_config
from kvtier.integrations.engine import CachedEngine

B = 16


def engine(tmp_path, **model_overrides) -> CachedEngine:
    model = {"id": "kvtier/tiny-llama", "kv_dtype": "float32", "num_layers": 2, "num_kv_heads": 2,
             "head_dim": 16, "block_size": B, **model_overrides}
    cfg = parse_config({
        "model": model, "device": {"kind": "cpu", "num_blocks": 64}, "host": {"capacity": "8MiB"},
        "backends": [{"name": "disk", "type": "local_disk",
                      "options": {"path": str(tmp_path / "kv"), "capacity": "256MiB"}}],
    })
    return CachedEngine.from_config(cfg)


@pytest.fixture
def prompt():
    return torch.randint(0, 2048, (10 * B + 5,), generator=torch.Generator().manual_seed(11)).tolist()


def store_then_decode(tmp_path, stored: dict[str, Any], asked: dict[str, Any], **decode_model) -> int:
    """Prefill ``stored`` in one engine, decode ``asked`` in a fresh one sharing only the disk; return the
    number of prefix blocks the decode side reused."""
    p = engine(tmp_path)
    try:
        p.run_request(**stored, max_new_tokens=1)
        p.flush()
    finally:
        p.close()
    d = engine(tmp_path, **decode_model)
    try:
        r = d.run_request(**asked, max_new_tokens=2, store=False)
        assert r.failed_blocks == 0 and r.device_blocks == 0
        assert r.computed_tokens == len(asked["prompt"]) - r.cached_blocks * B
        return r.cached_blocks
    finally:
        d.close()


@pytest.mark.parametrize("k", [0, 1, 4, 9])
def test_prompts_sharing_k_blocks_reuse_exactly_k(tmp_path, prompt, k):
    other = prompt[: k * B] + [(t + 1) % 2048 for t in prompt[k * B :]]
    assert store_then_decode(tmp_path, {"prompt": prompt}, {"prompt": other}) == k


@pytest.mark.parametrize("j", [0, 3, 9])
def test_token_changed_in_block_j_reuses_blocks_before_j(tmp_path, prompt, j):
    other = list(prompt)
    other[j * B + 7] = (other[j * B + 7] + 1) % 2048
    assert store_then_decode(tmp_path, {"prompt": prompt}, {"prompt": other}) == j


def test_different_image_identifier_stops_reuse_at_the_image(tmp_path, prompt):
    image = {"identifier": "img-1", "offset": 3 * B + 5, "length": 2 * B}  # blocks 3, 4 and 5
    stored = {"prompt": prompt, "mm": [image]}
    assert store_then_decode(tmp_path, stored, {"prompt": prompt, "mm": [image]}) == 10
    other = {"prompt": prompt, "mm": [{**image, "identifier": "img-2"}]}
    assert store_then_decode(tmp_path, stored, other) == 3


def test_different_cache_salt_reuses_nothing(tmp_path, prompt):
    assert store_then_decode(tmp_path, {"prompt": prompt, "cache_salt": "a"},
                             {"prompt": prompt, "cache_salt": "b"}) == 0
    assert store_then_decode(tmp_path, {"prompt": prompt, "cache_salt": "a"},
                             {"prompt": prompt, "cache_salt": "a"}) == 10


@pytest.mark.parametrize("change", [{"kv_dtype": "bfloat16"}, {"id": "another/model"}, {"num_layers": 3}])
def test_other_model_or_kv_dtype_gets_zero_hits(tmp_path, prompt, change):
    assert store_then_decode(tmp_path, {"prompt": prompt}, {"prompt": prompt}, **change) == 0
