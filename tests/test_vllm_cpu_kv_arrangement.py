"""How vLLM's CPU build arranges K and V inside a head of its ``[N, H, B, 2*D]`` KV cache, read back from its
own ``cpu_attn_reshape_and_cache`` kernel with coded values (each element's bits name its token, head and
dim).  This pins the facts behind the README's known issue: kvtier copies a head's K and V rows as if
they were token-major (``[B, D]``), which vLLM CPU's kernels do not write:

* ``vec`` / ``vec16`` (x86 without AMX, or blocks not a multiple of 32): K dim-major ``[D, B]``, V
  token-major ``[B, D]``;
* ``amx`` (bf16, blocks a multiple of 32, a CPU with AMX), VNNI-packed in tiles of 16: K
  ``[B/16, D/2, 16, 2]`` (pairs of dims, 16 tokens a tile), V ``[D/16, B/2, 16, 2]`` (pairs of tokens, 16
  dims a tile).

When kvtier converts vLLM CPU's arrangement to its canonical payload, these are the permutations to undo;
if a vLLM release changes them, this test says so before any block is misread.
"""

from __future__ import annotations

import pytest
import torch

H, D = 2, 64


def _written(isa: str, B: int) -> torch.Tensor:
    """Block 1 of a cache after vLLM's kernel wrote tokens 0..B-1 into it: ``[H, 2, B*D]`` int16 codes,
    K's region then V's per head.  Code bits: 0x4000 (K) or 0x5000 (V) | head << 11 | token << 6 | dim."""
    import vllm._custom_ops as ops

    cache = torch.zeros(2, H, B, 2 * D, dtype=torch.bfloat16)
    k_cache, v_cache = cache.view(2, H, 2 * B, D).chunk(2, dim=2)
    t = torch.arange(B)[:, None, None]
    h = torch.arange(H)[None, :, None]
    d = torch.arange(D)[None, None, :]
    key = (0x4000 | (h << 11) | (t << 6) | d).to(torch.int16).view(torch.bfloat16).contiguous()
    value = (0x5000 | (h << 11) | (t << 6) | d).to(torch.int16).view(torch.bfloat16).contiguous()
    ops.cpu_attn_reshape_and_cache(key, value, k_cache, v_cache, torch.arange(B, dtype=torch.int64) + B, isa)
    return cache[1].view(torch.int16).reshape(H, 2, B * D)


def _codes(base: int, B: int, order: str) -> torch.Tensor:
    """Expected ``[H, B*D]`` codes of one component laid out in ``order``."""
    h = torch.arange(H)[:, None, None]
    if order == "token-major":  # [B, D]
        t, d = torch.arange(B)[None, :, None], torch.arange(D)[None, None, :]
    elif order == "dim-major":  # [D, B]
        d, t = torch.arange(D)[None, :, None], torch.arange(B)[None, None, :]
    elif order == "amx-k":  # [B/16, D/2, 16, 2]: (t, d) at (t // 16, d // 2, t % 16, d % 2)
        tg, dg, ti, di = torch.meshgrid(*(torch.arange(n) for n in (B // 16, D // 2, 16, 2)), indexing="ij")
        t, d, h = (tg * 16 + ti)[None], (dg * 2 + di)[None], torch.arange(H).view(H, 1, 1, 1, 1)
    elif order == "amx-v":  # [D/16, B/2, 16, 2]: (t, d) at (d // 16, t // 2, d % 16, t % 2)
        dg, tg, di, ti = torch.meshgrid(*(torch.arange(n) for n in (D // 16, B // 2, 16, 2)), indexing="ij")
        t, d, h = (tg * 2 + ti)[None], (dg * 16 + di)[None], torch.arange(H).view(H, 1, 1, 1, 1)
    else:
        raise AssertionError(order)
    return (base | (h << 11) | (t << 6) | d).to(torch.int16).reshape(H, B * D)


@pytest.mark.parametrize("isa, B", [("vec", 32), ("vec16", 16), ("vec16", 32)])
def test_vllm_cpu_vec_kernels_keep_k_dim_major_and_v_token_major(isa, B):
    got = _written(isa, B)
    assert torch.equal(got[:, 0], _codes(0x4000, B, "dim-major"))
    assert torch.equal(got[:, 1], _codes(0x5000, B, "token-major"))


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="vLLM's amx kernel needs a CPU with AMX")
def test_vllm_cpu_amx_kernel_packs_k_and_v_in_16_wide_tiles_of_pairs():
    got = _written("amx", 32)
    assert torch.equal(got[:, 0], _codes(0x4000, 32, "amx-k"))
    assert torch.equal(got[:, 1], _codes(0x5000, 32, "amx-v"))


@pytest.mark.skipif(not torch.cpu._is_amx_tile_supported(), reason="vLLM's AMX MLA kernel needs a CPU with AMX")
def test_vllm_cpu_amx_mla_keeps_the_latent_token_major():
    """Unlike its MHA kernel, vLLM CPU's AMX MLA cache write keeps ``[B, 512 + 64]`` per block as it is:
    kvtier's ``mla`` layout reads it as is."""
    import vllm._custom_ops as ops

    B, L, P = 32, 512, 64
    cache = torch.zeros(2, B, L + P, dtype=torch.bfloat16)
    code = torch.arange(B * (L + P), dtype=torch.int16).view(B, L + P)  # element i of the block holds i
    ops.amx_mla_concat_and_cache(code[:, :L].contiguous().view(torch.bfloat16),
                                 code[:, L:].contiguous().view(torch.bfloat16), cache, torch.arange(B) + B)
    assert torch.equal(cache[1].view(torch.int16), code)
