"""``kvtier bench keys``: block hashing throughput on a long prompt, beside vLLM's own construction.

The reference reproduces how vLLM computes prefix-caching hashes for a request: walk the full blocks,
build each block's extra keys (LoRA, multimodal, cache salt; all empty here), then
``sha256(cbor2.dumps((parent, tuple(block_tokens), extra_keys), canonical=True))`` one block at a time.
Both run on the same token list in the same process, and the run fails if their bytes differ.
"""

from __future__ import annotations

import argparse
import hashlib
from collections.abc import Callable, Sequence
from typing import Any

import cbor2
import numpy as np

from ...keys import BlockHasher, sha256_cbor
from ..args import out_file, positive_int
from ..output import print_table, write_json
from ._util import median_time

HELP = "block hashing tokens/s: sha256_cbor (vs vLLM's construction, byte-identical) and xxh3_128"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=positive_int, default=128 * 1024, help="prompt length (default 131072)")
    p.add_argument("--block-size", type=positive_int, default=16)
    p.add_argument("--vocab", type=positive_int, default=128_256, help="token ids drawn from [0, vocab)")
    p.add_argument("--repeats", type=positive_int, default=9)
    p.add_argument("--json", type=out_file, metavar="PATH", help="write the figures as JSON")


# ----- the reference: vLLM's per-block construction, kept in vLLM's shape (one call per step) -------


def _vllm_sha256_cbor(obj: Any) -> bytes:
    input_bytes = cbor2.dumps(obj, canonical=True)
    return hashlib.sha256(input_bytes).digest()


def _vllm_extra_keys(start: int, end: int, mm_idx: int, lora: Any = None, mm: Sequence[Any] = (),
                     salt: str | None = None) -> tuple[tuple[Any, ...] | None, int]:
    lora_keys = [lora] if lora else []
    mm_keys: list[Any] = []
    for it in mm[mm_idx:]:  # empty in this benchmark, as for a text-only request
        mm_keys.append(it)
    salt_keys = [salt] if start == 0 and salt else []
    extra = lora_keys + mm_keys + salt_keys
    return (tuple(extra) if extra else None), mm_idx


def _vllm_hash_block_tokens(hash_fn: Callable[[Any], bytes], parent: bytes | None, block_tokens: Sequence[int],
                            extra_keys: tuple[Any, ...] | None, none_hash: bytes) -> bytes:
    if not parent:
        parent = none_hash
    return hash_fn((parent, tuple(block_tokens), extra_keys))


def vllm_reference(tokens: list[int], block_size: int, none_hash: bytes) -> list[bytes]:
    out: list[bytes] = []
    prev = None
    mm_idx = 0
    start = 0
    while start + block_size <= len(tokens):
        end = start + block_size
        extra, mm_idx = _vllm_extra_keys(start, end, mm_idx)
        prev = _vllm_hash_block_tokens(_vllm_sha256_cbor, prev, tokens[start:end], extra, none_hash)
        out.append(prev)
        start = end
    return out


def run(args: argparse.Namespace) -> int:
    rng = np.random.default_rng(0)
    tokens = rng.integers(0, args.vocab, size=args.tokens).tolist()
    B = args.block_size
    sha = BlockHasher(B, "sha256_cbor")
    xxh = BlockHasher(B, "xxh3_128")
    assert sha.none_hash == sha256_cbor(sha.seed)

    ours = sha.hash_blocks(tokens)
    ref = vllm_reference(tokens, B, sha.none_hash)
    identical = ours == ref
    t_ours = median_time(lambda: sha.hash_blocks(tokens), args.repeats)
    t_ref = median_time(lambda: vllm_reference(tokens, B, sha.none_hash), args.repeats)
    t_xxh = median_time(lambda: xxh.hash_blocks(tokens), args.repeats)
    arr = np.asarray(tokens, dtype=np.int64)
    t_ours_np = median_time(lambda: sha.hash_blocks(arr), args.repeats)

    n = len(tokens)
    rows = [
        {"hash": "sha256_cbor (kvtier, list input)", "Mtok/s": n / t_ours / 1e6, "ms": t_ours * 1e3,
         "vs vLLM": t_ref / t_ours, "goal": ">= 3x vLLM"},
        {"hash": "sha256_cbor (kvtier, numpy input)", "Mtok/s": n / t_ours_np / 1e6, "ms": t_ours_np * 1e3,
         "vs vLLM": t_ref / t_ours_np, "goal": ""},
        {"hash": "sha256_cbor (vLLM construction)", "Mtok/s": n / t_ref / 1e6, "ms": t_ref * 1e3,
         "vs vLLM": 1.0, "goal": "reference"},
        {"hash": "xxh3_128 (kvtier)", "Mtok/s": n / t_xxh / 1e6, "ms": t_xxh * 1e3,
         "vs vLLM": t_ref / t_xxh, "goal": ">= 20 Mtok/s"},
    ]
    print(f"{n} tokens, block size {B}, {n // B} blocks, medians of {args.repeats}")
    print_table(rows, ["hash", "Mtok/s", "ms", "vs vLLM", "goal"])
    print(f"sha256_cbor byte-identical to vLLM's construction: {'yes' if identical else 'NO'}")
    write_json(args.json, {
        "tokens": n, "block_size": B, "byte_identical": identical,
        "sha256_cbor_mtok_s": n / t_ours / 1e6, "reference_mtok_s": n / t_ref / 1e6,
        "sha256_cbor_ratio_vs_reference": t_ref / t_ours,
        "sha256_cbor_numpy_ratio_vs_reference": t_ref / t_ours_np,
        "xxh3_128_mtok_s": n / t_xxh / 1e6,
    })
    if not identical:
        first = next(i for i, (a, b) in enumerate(zip(ours, ref)) if a != b)
        print(f"first differing block: {first}")
        return 1
    return 0
