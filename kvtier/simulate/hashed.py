"""A trace hashed once, replayed by every grid point that keys blocks alike.

Reading a trace row, drawing a ``length`` row's random tokens and hashing the blocks cost about a fifth of
a simulated request; a grid repeated that for every point, in every worker process.  The keys depend
only on the namespace's block size, hash algorithm and seed, so :func:`hash_trace` computes them once per
such combination into a file and :func:`iter_hashed` replays it: the requests the engine sees are the
same (same hashes, same prompt lengths, times and output lengths), read one at a time, never all in
memory.

File: ``MAGIC`` (8 bytes), the digest size (u16), then per request ``t`` (f64, NaN = none),
``num_tokens``, ``max_new_tokens`` and the number of block hashes (u32 each), then the hashes.  A
scratch file of one ``kvtier simulate`` run, not a stored format: it is written and read by the same code.
"""

from __future__ import annotations

import math
import struct
import time
from collections.abc import Iterable, Iterator
from pathlib import Path

from ..keys import BlockHasher
from ..workload import Request
from .replay import check_hashed_row

MAGIC = b"KVTHASH1"
_HEAD = struct.Struct("<H")
_ROW = struct.Struct("<dIII")


def hash_trace(requests: Iterable[Request], hasher: BlockHasher, path: str | Path) -> tuple[int, float]:
    """Write ``requests``' block hashes to ``path``; returns (requests written, seconds spent hashing)."""
    n, hash_s = 0, 0.0
    clock = time.perf_counter
    with open(path, "wb") as f:
        f.write(MAGIC + _HEAD.pack(hasher.digest_size))
        for req in requests:
            if req.hashes is not None:
                hashes = req.hashes
                check_hashed_row(hashes, req.num_tokens, hasher, n)  # the file slices every hash at one size
                num_tokens = req.num_tokens or len(hashes) * hasher.block_size
            else:
                h0 = clock()
                hashes = hasher.hash_blocks(req.tokens, mm=req.mm, cache_salt=req.cache_salt, lora=req.lora)
                hash_s += clock() - h0
                num_tokens = len(req.tokens)
            t = math.nan if req.t is None else req.t
            f.write(_ROW.pack(t, num_tokens, req.max_new_tokens, len(hashes)))
            f.write(b"".join(hashes))
            n += 1
    return n, hash_s


def iter_hashed(path: str | Path) -> Iterator[Request]:
    """The requests of a file :func:`hash_trace` wrote, one at a time (``hashes`` and ``num_tokens`` set)."""
    with open(path, "rb", buffering=1 << 20) as f:
        head = f.read(len(MAGIC) + _HEAD.size)
        if head[:len(MAGIC)] != MAGIC:
            raise ValueError(f"{path}: not a hashed trace (kvtier.simulate.hashed)")
        (size,) = _HEAD.unpack(head[len(MAGIC):])
        row, unpack = _ROW.size, _ROW.unpack
        user = 0
        while fixed := f.read(row):
            t, num_tokens, max_new, n = unpack(fixed)
            raw = f.read(n * size)
            yield Request([], max_new, user=user, t=None if math.isnan(t) else t,
                          hashes=[raw[i:i + size] for i in range(0, len(raw), size)], num_tokens=num_tokens)
            user += 1


__all__ = ["MAGIC", "hash_trace", "iter_hashed"]
