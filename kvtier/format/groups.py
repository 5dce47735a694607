"""Stored values of several engine blocks (``storage.block_tokens``): which blocks a value holds, and its key.

With ``k`` engine blocks per value, value ``g`` of a prompt holds the blocks at chain positions
``[g*k, (g+1)*k)`` (aligned to the start of the prompt, so every instance groups a shared prefix the
same way) and is stored under the key of its **last** block, whose chained hash names the whole prefix
up to it.  A prompt's last, partial group is never stored; a backend lookup therefore rounds down to
whole groups.  Memory tiers (device, host) keep single engine blocks.

Callers hand the stack a slice of a chain: ``start`` is the chain position of its element 0.
"""

from __future__ import annotations


def group_ends(start: int, p: int, n: int, k: int) -> list[int]:
    """Indices into a chain slice (element 0 at chain position ``start``, ``n`` elements) of the last block
    of each group, from the group holding element ``p`` on, for the groups that end inside the slice."""
    if k < 1 or start < 0 or not 0 <= p <= n:
        raise ValueError(f"group_ends: bad arguments start={start} p={p} n={n} k={k}")
    first_end = ((start + p) // k + 1) * k - 1 - start
    return list(range(first_end, n, k))


def group_of(start: int, i: int, k: int) -> tuple[int, int]:
    """``(first, last)`` indices (into the slice, ``first`` may be negative) of the group holding element ``i``."""
    first = (start + i) // k * k - start
    return first, first + k - 1


def whole_groups(start: int, n: int, k: int) -> list[tuple[int, int]]:
    """``(first, last)`` of every group lying entirely inside a slice of ``n`` elements."""
    first = -start % k
    return [(a, a + k - 1) for a in range(first, n - k + 1, k)]


MIN_PARALLEL_READS = 4  # local_disk's default I/O threads per batch


def load_chunks(n: int, unit_nbytes: int, chunk_bytes: int) -> list[tuple[int, int]]:
    """How a load of ``n`` units (blocks, or values of several blocks) of ``unit_nbytes`` each is cut into
    backend reads: ``[a, b)`` spans that start at a quarter of ``chunk_bytes`` and double up to four times
    it.  The first read is small so the first copy to the device starts early; later reads grow, because
    every read has a fixed cost (a backend call, its thread hand-offs: ~1 ms measured on local disk),
    which 4 MiB vLLM blocks in 32 MiB chunks paid 16 times for a 4k-token prompt.  Reads grow to at least
    ``MIN_PARALLEL_READS`` units whatever their size: a backend reads a chunk's values in parallel, and
    values of 16 such blocks (64 MiB) read two at a time loaded at 4.8 GiB/s on an H200 machine where
    single blocks, read four at a time, loaded at 8.7."""
    unit = max(1, unit_nbytes)
    size, most = max(1, chunk_bytes // 4 // unit), max(MIN_PARALLEL_READS, chunk_bytes * 4 // unit)
    out, a = [], 0
    while a < n:
        out.append((a, min(n, a + size)))
        a += size
        size = min(most, size * 2)
    return out


__all__ = ["group_ends", "group_of", "load_chunks", "whole_groups"]
