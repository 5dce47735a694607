"""A self-managed pool of device block ids, for standalone use (tests, benchmarks, the main job) when no
engine allocates the blocks.  Scheduler-side: it hands out integers and never touches a tensor.

Semantics follow vLLM's v1 KV cache manager (the seed): every block has a ref count; a block whose count
drops to 0 goes to the tail of a free queue but *keeps* its cached key, so a later request can revive it
with :meth:`BlockPool.touch`; :meth:`BlockPool.allocate` takes blocks from the head of the queue (the
least recently freed), dropping whatever key they held.  The queue is an ``OrderedDict`` (O(1) pop,
append and removal from the middle).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterable, Sequence
from itertools import islice


class PoolExhausted(RuntimeError):
    """Asked for more blocks than are free.  Raised at once: the pool never waits."""

    def __init__(self, wanted: int, free: int, total: int):
        self.wanted, self.free, self.total = wanted, free, total
        super().__init__(f"block pool exhausted: {wanted} blocks wanted, {free} free of {total} "
                         "(free finished requests' blocks, or register more device blocks)")


class BlockPool:
    """Free queue + ref counts + key <-> block id map over ``num_blocks`` device blocks.

    Invariants (checked by :meth:`check`):
    * a block is in the free queue iff its ref count is 0;
    * a key maps to at most one block and that block maps back to it; a block holds at most one key;
    * ``num_free`` counts free blocks, cached or not: allocating that many never raises.

    ``on_evict(keys, block_ids)``, when given, is called once per :meth:`allocate` that dropped cached
    keys (under the pool's lock; keep it short), with those keys and their blocks in allocation order, so
    an index can follow: one call a batch, since a full pool evicts on nearly every allocation.
    """

    def __init__(self, num_blocks: int, *,
                 on_evict: Callable[[list[Hashable], list[int]], None] | None = None):
        if isinstance(num_blocks, bool) or not isinstance(num_blocks, int) or num_blocks < 1:
            raise ValueError(f"num_blocks: expected an integer >= 1, got {num_blocks!r}")
        self.num_blocks = num_blocks
        self._ref = [0] * num_blocks
        self._free: OrderedDict[int, None] = OrderedDict.fromkeys(range(num_blocks))
        self._key_of: dict[int, Hashable] = {}
        self._block_of: dict[Hashable, int] = {}
        self._on_evict = on_evict
        self._lock = threading.Lock()
        self.evictions = 0

    # ------------------------------------------------------------------ queries

    @property
    def num_free(self) -> int:
        """Blocks with ref count 0 (including cached ones that allocation may evict)."""
        return len(self._free)

    @property
    def num_cached(self) -> int:
        return len(self._block_of)

    def usage(self) -> float:
        return 1.0 - len(self._free) / self.num_blocks

    def ref_count(self, block_id: int) -> int:
        return self._ref[self._check_id(block_id)]

    def key_of(self, block_id: int) -> Hashable | None:
        return self._key_of.get(self._check_id(block_id))

    def lookup(self, key: Hashable) -> int | None:
        """The block caching ``key``, or None.  Does not take a reference (see :meth:`touch`)."""
        return self._block_of.get(key)

    def lookup_prefix(self, keys: Iterable[Hashable]) -> list[int]:
        """Blocks of the longest cached prefix of the key chain ``keys``."""
        out = []
        with self._lock:
            for k in keys:
                b = self._block_of.get(k)
                if b is None:
                    break
                out.append(b)
        return out

    # ------------------------------------------------------------------ updates

    def allocate(self, n: int) -> list[int]:
        """``n`` blocks with ref count 1, least recently freed first; cached keys they held are dropped.
        Raises :class:`PoolExhausted` (taking nothing) when fewer than ``n`` are free."""
        if n < 0:
            raise ValueError(f"allocate: n must be >= 0, got {n}")
        with self._lock:
            if n > len(self._free):
                raise PoolExhausted(n, len(self._free), self.num_blocks)
            free = self._free
            # The n least recently freed, read in one C pass, then deleted (popitem(last=False) per block
            # cost twice as much).
            out = list(islice(free, n))
            keys: list[Hashable] = []
            ids: list[int] = []
            key_pop, block_of, ref = self._key_of.pop, self._block_of, self._ref
            for b in out:
                del free[b]
                ref[b] = 1
                key = key_pop(b, None)
                if key is not None:
                    del block_of[key]
                    keys.append(key)
                    ids.append(b)
            if keys:
                self.evictions += len(keys)
                if self._on_evict is not None:
                    self._on_evict(keys, ids)
            return out

    def touch(self, block_ids: Sequence[int]) -> None:
        """Take one more reference on each block (a prefix hit); a free block leaves the free queue."""
        with self._lock:
            if len(block_ids) and (min(block_ids) < 0 or max(block_ids) >= self.num_blocks):  # all or nothing
                for b in block_ids:
                    self._check_id(b)
            ref, free = self._ref, self._free
            for b in block_ids:
                r = ref[b]
                if r == 0:
                    del free[b]
                ref[b] = r + 1

    def free(self, block_ids: Sequence[int]) -> None:
        """Drop one reference on each block, in the order given; a block reaching 0 goes to the tail of
        the free queue (keeping its key).  Free a request's blocks tail first, as vLLM does, so its
        prefix outlives its suffix."""
        with self._lock:
            ref, free, n = self._ref, self._free, self.num_blocks
            for j, b in enumerate(block_ids):
                if not 0 <= b < n or ref[b] == 0:  # all or nothing: undo this call's drops, then refuse
                    for u in block_ids[:j]:
                        if ref[u] == 0:
                            del free[u]
                        ref[u] += 1
                    self._check_id(b)
                    times = sum(1 for u in block_ids if u == b)
                    raise ValueError(f"free: block {b} has ref count {ref[b]}, freed {times} time(s)")
                r = ref[b] - 1
                ref[b] = r
                if r == 0:
                    free[b] = None

    def cache(self, block_id: int, key: Hashable) -> bool:
        """Record that ``block_id`` (allocated, full) holds ``key``.  Returns False (and records nothing)
        when ``key`` is already cached in another block, so block tables stay append-only as in vLLM."""
        return self.cache_many((block_id,), (key,))[0]

    def cache_many(self, block_ids: Sequence[int], keys: Sequence[Hashable]) -> list[bool]:
        """:meth:`cache` of each ``(block_ids[i], keys[i])`` in order, under one lock (a request's full
        prompt blocks once computed or loaded), with ``cache``'s answer for each.  All or nothing: every
        block is checked allocated before anything is recorded."""
        if len(block_ids) != len(keys):
            raise ValueError(f"cache_many: {len(block_ids)} block ids for {len(keys)} keys")
        with self._lock:
            ref, n = self._ref, self.num_blocks
            for b in block_ids:
                if not 0 <= b < n or ref[b] == 0:
                    self._check_id(b)  # out of range: the IndexError naming the range
                    raise ValueError(f"cache: block {b} is not allocated")
            key_of, block_of = self._key_of, self._block_of
            out: list[bool] = []
            for b, key in zip(block_ids, keys):
                held = block_of.get(key)
                if held is not None:
                    out.append(held == b)
                    continue
                old = key_of.get(b)
                if old is not None:
                    del block_of[old]
                key_of[b] = key
                block_of[key] = b
                out.append(True)
            return out

    def uncache(self, block_id: int) -> Hashable | None:
        """Forget the key of ``block_id`` (e.g. its KV turned out wrong); returns it."""
        with self._lock:
            key = self._key_of.pop(self._check_id(block_id), None)
            if key is not None:
                del self._block_of[key]
            return key

    def reset(self) -> None:
        """Everything free and uncached (no block may be in use)."""
        with self._lock:
            if any(self._ref):
                raise ValueError("reset: blocks are still referenced")
            self._free = OrderedDict.fromkeys(range(self.num_blocks))
            self._key_of.clear()
            self._block_of.clear()

    def check(self) -> None:
        """Assert the invariants (tests)."""
        with self._lock:
            for b in range(self.num_blocks):
                assert (self._ref[b] == 0) == (b in self._free), f"block {b}: ref {self._ref[b]}"
            for k, b in self._block_of.items():
                assert self._key_of.get(b) == k, f"key {k!r} -> {b} -> {self._key_of.get(b)!r}"
            assert len(self._key_of) == len(self._block_of)

    def _check_id(self, b: int) -> int:
        if not 0 <= b < self.num_blocks:
            raise IndexError(f"block id {b} out of range [0, {self.num_blocks})")
        return b
