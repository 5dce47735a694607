"""The index's entries: the struct-of-arrays columns, the per-tier LRU lists, and every single-key
operation (insert, remove, reads, pins, recency, locations, backend marks, tier-wide queries), with the
invariant check.  The batch forms (:mod:`.batches`) and prefix lookups (:mod:`.prefix`) build on it."""

from __future__ import annotations

import array
import time
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np

from .tiers import MAX_BACKENDS, Tier, check_backend, mask_bits, mask_of, tier_backend

ID_MAX = 2**31 - 2  # ids live in int32 columns; -1 means "none"
# A device block id as engines hand them over: a Python int or a numpy integer (an id read out of a numpy
# array is one); the index stores plain ints.
DeviceId = int | np.integer[Any]
HITS_MAX = 2**32 - 1


@dataclass(frozen=True)
class BlockEntry:
    """A snapshot of one entry (not live: later changes to the index do not show here).

    ``last_access`` is in the index's clock (``time.monotonic`` seconds unless one was given).
    """

    key: bytes
    device: int | None
    host: int | None
    backends: tuple[int, ...]
    refs: int
    hits: int
    last_access: float


def _add(seen: set[bytes], k: bytes) -> bool:
    """``seen.add(k)`` as an expression (False), for a generator that finds the first repeat."""
    seen.add(k)
    return False


def _hex(key: bytes) -> str:
    return key.hex() if isinstance(key, (bytes, bytearray)) else repr(key)


def _filled(typecode: str, value: float, n: int) -> array.array[float]:
    return array.array(typecode, [value]) * n


def id_column(n: int, value: int = -1) -> list[int]:
    return [value] * n


class IndexCore:
    """The entries of a :class:`~kvtier.index.BlockIndex` and their single-key operations (the invariants
    are the package's docstring)."""

    def __init__(self, capacity: int = 1024, clock: Callable[[], float] = time.monotonic) -> None:
        cap = max(1, int(capacity))
        self._clock = clock
        self._slots: dict[bytes, int] = {}
        self._keys: list[bytes | None] = [None] * cap
        self._free: list[int] = []
        self._top = 0  # slots >= _top have never been used
        self._cap = cap
        self._dev = id_column(cap)
        self._host = id_column(cap)
        self._mask = id_column(cap, 0)
        self._refs = id_column(cap)  # -1 marks a free slot, so vector scans need no live column
        self._hits = id_column(cap, 0)
        self._last = _filled("d", 0.0, cap)
        self._loc = (self._dev, self._host)  # indexed by Tier.DEVICE / Tier.HOST
        self._prev = (id_column(cap), id_column(cap))
        self._next = (id_column(cap), id_column(cap))
        self._head = [-1, -1]  # least recently used
        self._tail = [-1, -1]  # most recently used
        self._lru_len = [0, 0]
        self._rev: tuple[list[int], list[int]] = ([], [])  # device id / host slot -> slot
        self._count = [0, 0]
        self._bcount = [0] * MAX_BACKENDS
        self._pinned = 0

    # -- basics
    def __len__(self) -> int:
        return len(self._slots)

    def __contains__(self, key: object) -> bool:
        return key in self._slots

    def __iter__(self) -> Iterator[bytes]:
        """Keys in insertion order; do not mutate the index while iterating."""
        return iter(self._slots)

    @property
    def capacity(self) -> int:
        return self._cap

    def _slot(self, key: bytes) -> int:
        s = self._slots.get(key)
        if s is None:
            raise KeyError(f"block {_hex(key)}: not in the index")
        return s

    def _grow(self, need: int) -> None:
        new = self._cap
        while new < need:
            new *= 2
        extra = new - self._cap
        for col, fill in ((self._dev, -1), (self._host, -1), (self._mask, 0), (self._refs, -1),
                          (self._hits, 0), *((c, -1) for c in self._prev + self._next)):
            col.extend(id_column(extra, fill))
        self._last.extend(_filled("d", 0.0, extra))
        self._keys.extend([None] * extra)
        self._cap = new

    def _alloc(self) -> int:
        if self._free:
            return self._free.pop()
        if self._top == self._cap:
            self._grow(self._cap * 2)
        self._top += 1
        return self._top - 1

    def _np(self, last: bool = False) -> tuple[np.ndarray, ...]:
        """Copies of the mask and refs columns, and of last access times if asked (O(capacity) scans
        of backend marks: the only columns they read)."""
        cols = (np.array(self._mask, dtype=np.uint32), np.array(self._refs, dtype=np.int32))
        return (*cols, np.frombuffer(self._last, dtype=np.float64).copy()) if last else cols

    # -- LRU lists (intrusive, in the prev/next columns)
    def _link_mru(self, t: int, s: int) -> None:
        tail, nxt = self._tail, self._next[t]
        p = tail[t]
        self._prev[t][s] = p
        nxt[s] = -1
        if p >= 0:
            nxt[p] = s
        else:
            self._head[t] = s
        tail[t] = s
        self._lru_len[t] += 1

    def _unlink(self, t: int, s: int) -> None:
        prev, nxt = self._prev[t], self._next[t]
        p, n = prev[s], nxt[s]
        if p >= 0:
            nxt[p] = n
        else:
            self._head[t] = n
        if n >= 0:
            prev[n] = p
        else:
            self._tail[t] = p
        prev[s] = nxt[s] = -1
        self._lru_len[t] -= 1

    def _to_mru(self, t: int, s: int) -> None:
        tail = self._tail
        last = tail[t]
        if last == s:
            return
        prev, nxt = self._prev[t], self._next[t]
        p, n = prev[s], nxt[s]  # s is linked and not the tail, so n >= 0 and last >= 0
        if p >= 0:
            nxt[p] = n
        else:
            self._head[t] = n
        prev[n] = p
        prev[s] = last
        nxt[s] = -1
        nxt[last] = s
        tail[t] = s

    # -- insert / remove
    def _new_slot(self, key: bytes) -> int:
        """``insert(key)`` with no locations (refs 0, hits 0, last access now); its slot.  The batch
        operations' insert: the caller has found ``key`` absent."""
        if type(key) is not bytes or not key:
            self.insert(key)  # raises the TypeError naming what it got
        # _alloc's common cases without its call: a freed slot, else the next never used one.
        if self._free:
            s = self._free.pop()
        elif self._top < self._cap:
            s = self._top
            self._top = s + 1
        else:
            s = self._alloc()
        self._slots[key] = s
        self._keys[s] = key
        self._refs[s] = 0
        self._hits[s] = 0
        self._last[s] = self._clock()
        return s

    def insert(self, key: bytes, *, device: int | None = None, host: int | None = None,
               backends: Iterable[int] = ()) -> None:
        """Add a new entry (refs 0, hits 0, last access now).  ValueError if the key is already present."""
        if not isinstance(key, bytes) or not key:
            raise TypeError(f"block key must be non-empty bytes, got {type(key).__name__}")
        if key in self._slots:
            raise ValueError(f"block {key.hex()}: already in the index")
        mask = mask_of(backends) if backends != () else 0
        # validate ids before allocating, so a bad call leaves the index unchanged
        if device is not None:
            self._check_free_id(0, device, key, -1)
        if host is not None:
            self._check_free_id(1, host, key, -1)
        s = self._alloc()
        self._slots[key] = s
        self._keys[s] = key
        self._refs[s] = 0
        self._hits[s] = 0
        self._last[s] = self._clock()
        if mask:
            self._mask[s] = mask
            for i in mask_bits(mask):
                self._bcount[i] += 1
        if device is not None:
            self._attach(0, s, device)
        if host is not None:
            self._attach(1, s, host)

    def insert_many(self, keys: Sequence[bytes], *, backends: Iterable[int] = ()) -> None:
        """Bulk-add new keys present only in ``backends`` (e.g. rebuilding from a disk listing at start).

        All-or-nothing: ValueError if any key is already present or repeated, before anything changes.
        """
        mask = mask_of(backends)
        keys = list(keys)
        n = len(keys)
        for k in keys:
            if not isinstance(k, bytes) or not k:
                raise TypeError(f"block key must be non-empty bytes, got {type(k).__name__}")
        if len(set(keys)) != n or not self._slots.keys().isdisjoint(keys):
            seen: set[bytes] = set()
            dup = next(k for k in keys if k in self._slots or k in seen or _add(seen, k))
            raise ValueError(f"block {dup.hex()}: " + ("already in the index" if dup in self else "repeated"))
        a, b = self._top, self._top + n
        if b > self._cap:
            self._grow(b)
        self._top = b
        self._slots.update(zip(keys, range(a, b)))
        self._keys[a:b] = keys
        self._refs[a:b] = id_column(n, 0)
        self._hits[a:b] = id_column(n, 0)
        self._last[a:b] = _filled("d", self._clock(), n)
        self._mask[a:b] = id_column(n, mask)
        for i in mask_bits(mask):
            self._bcount[i] += n

    def remove(self, key: bytes) -> BlockEntry:
        """Drop an entry and return its last state.  ValueError if pinned; KeyError if absent."""
        s = self._slot(key)
        if self._refs[s] > 0:
            raise ValueError(f"block {key.hex()}: cannot remove, pinned (ref count {self._refs[s]})")
        snap = self._snapshot(key, s)
        self._drop_slot(key, s)
        return snap

    def _drop_slot(self, key: bytes, s: int) -> None:
        if self._dev[s] >= 0:
            self._detach(0, s)
        if self._host[s] >= 0:
            self._detach(1, s)
        if self._mask[s]:
            for i in mask_bits(self._mask[s]):
                self._bcount[i] -= 1
            self._mask[s] = 0
        self._refs[s] = -1
        self._hits[s] = 0
        self._keys[s] = None
        del self._slots[key]
        self._free.append(s)

    # -- reading
    def _snapshot(self, key: bytes, s: int) -> BlockEntry:
        d, h = self._dev[s], self._host[s]
        return BlockEntry(key, d if d >= 0 else None, h if h >= 0 else None, mask_bits(self._mask[s]),
                          self._refs[s], self._hits[s], self._last[s])

    def get(self, key: bytes) -> BlockEntry | None:
        s = self._slots.get(key)
        return None if s is None else self._snapshot(key, s)

    def entry(self, key: bytes) -> BlockEntry:
        return self._snapshot(key, self._slot(key))

    # Single-field reads for hot paths (a snapshot builds an object and a backend tuple).
    def host_slot(self, key: bytes) -> int | None:
        """The host slot holding ``key``, or None (also when ``key`` is not in the index)."""
        s = self._slots.get(key)
        h = -1 if s is None else self._host[s]
        return h if h >= 0 else None

    def in_backends(self, key: bytes, backends: Iterable[int]) -> bool:
        """Whether ``key`` is marked in every one of ``backends`` (False when not in the index)."""
        s = self._slots.get(key)
        if s is None:
            return False
        m = self._mask[s]
        for i in backends:  # noqa: SIM110 - a loop, not all(<generator>): called per block on the store path
            if not (m >> i) & 1:
                return False
        return True

    def refs(self, key: bytes) -> int:
        """Ref count of ``key``; KeyError if absent."""
        s = self._slots.get(key)
        return self._refs[self._slot(key) if s is None else s]

    def hits(self, key: bytes) -> int:
        """Hit count of ``key``; KeyError if absent."""
        s = self._slots.get(key)
        return self._hits[self._slot(key) if s is None else s]

    def key_at_device(self, block_id: int) -> bytes | None:
        return self._key_at(0, block_id)

    def key_at_host(self, slot: int) -> bytes | None:
        return self._key_at(1, slot)

    def _key_at(self, t: int, ident: int) -> bytes | None:
        rev = self._rev[t]
        return self._keys[rev[ident]] if 0 <= ident < len(rev) and rev[ident] >= 0 else None

    # -- refs and recency
    def pin(self, key: bytes, n: int = 1) -> int:
        """Add ``n`` references; a pinned entry is never an eviction candidate.  Returns the new count."""
        s = self._slots.get(key)
        return self._pin_slot(key, self._slot(key) if s is None else s, n)

    def unpin(self, key: bytes, n: int = 1) -> int:
        """Drop ``n`` references; at 0 the entry rejoins its tiers' LRU lists at the MRU end."""
        s = self._slots.get(key)
        return self._unpin_slot(key, self._slot(key) if s is None else s, n)

    # The single-key operations below look the key up once and work on its slot: a simulation makes
    # millions of them, and a method call per step was most of their cost.
    def _pin_slot(self, key: bytes, s: int, n: int) -> int:
        if n < 1:
            raise ValueError(f"block {key.hex()}: pin count must be >= 1, got {n}")
        r = self._refs[s]
        if r == 0:
            self._pinned += 1
            if self._dev[s] >= 0:
                self._unlink(0, s)
            if self._host[s] >= 0:
                self._unlink(1, s)
        self._refs[s] = r + n
        return r + n

    def _unpin_slot(self, key: bytes, s: int, n: int) -> int:
        r = self._refs[s]
        if n < 1 or n > r:
            raise ValueError(f"block {key.hex()}: cannot unpin by {n}, ref count is {r}"
                             + (" (would go below zero)" if n > r else ""))
        r -= n
        self._refs[s] = r
        if r == 0:
            self._pinned -= 1
            if self._dev[s] >= 0:
                self._link_mru(0, s)
            if self._host[s] >= 0:
                self._link_mru(1, s)
        return r

    def touch(self, key: bytes, now: float | None = None) -> int:
        """Count a hit, stamp the access time, and move the entry to MRU in its memory tiers.  Returns
        the hit count now (what write policies read: a hit's caller needs no second lookup)."""
        s = self._slots.get(key)
        if s is None:
            s = self._slot(key)
        h = self._hits[s]
        if h < HITS_MAX:
            h += 1
            self._hits[s] = h
        self._last[s] = self._clock() if now is None else now
        if self._refs[s] == 0:
            if self._dev[s] >= 0:
                self._to_mru(0, s)
            if self._host[s] >= 0:
                self._to_mru(1, s)
        return h

    def touch_many(self, keys: Iterable[bytes], now: float | None = None) -> list[int]:
        """``touch`` each key in order with one timestamp (so the last key ends up most recent); each
        one's hit count after it.  A pinned key's (a load's blocks) in one step, without touch's call."""
        now = self._clock() if now is None else now
        get, hits, last, refs = self._slots.get, self._hits, self._last, self._refs
        out: list[int] = []
        for k in keys:
            s = get(k)
            if s is None or not refs[s]:
                out.append(self.touch(k, now))  # absent (its KeyError), or unpinned: moves to MRU
                continue
            h = hits[s]
            if h < HITS_MAX:
                h += 1
                hits[s] = h
            last[s] = now
            out.append(h)
        return out

    # -- locations
    def _check_free_id(self, t: int, ident: int, key: bytes, s: int) -> None:
        if type(ident) is not int or not 0 <= ident <= ID_MAX:
            self._check_id_type(t, ident, key)
        rev = self._rev[t]
        owner = rev[ident] if ident < len(rev) else -1
        if owner >= 0 and owner != s:
            what = ("device block", "host slot")[t]
            raise ValueError(f"block {key.hex()}: {what} {ident} already holds block "
                             f"{_hex(self._keys[owner] or b'')}")

    @staticmethod
    def _check_id_type(t: int, ident: object, key: bytes) -> None:
        what = ("device block", "host slot")[t]
        if not isinstance(ident, (int, np.integer)) or not 0 <= ident <= ID_MAX:
            raise ValueError(f"block {key.hex()}: {what} must be an int in [0, {ID_MAX}], got {ident!r}")

    def _attach(self, t: int, s: int, ident: int) -> None:
        ident = int(ident)
        rev, loc = self._rev[t], self._loc[t]
        if ident >= len(rev):
            rev.extend(id_column(max(ident + 1, 2 * len(rev)) - len(rev)))
        old = loc[s]
        if old >= 0:
            rev[old] = -1
        else:
            self._count[t] += 1
        loc[s] = ident
        rev[ident] = s
        if self._refs[s] == 0:
            if old >= 0:
                self._to_mru(t, s)
            else:
                self._link_mru(t, s)

    def _detach(self, t: int, s: int) -> int | None:
        old = self._loc[t][s]
        if old < 0:
            return None
        if self._refs[s] == 0:
            self._unlink(t, s)
        self._loc[t][s] = -1
        self._rev[t][old] = -1
        self._count[t] -= 1
        return old

    def set_device(self, key: bytes, block_id: int) -> int | None:
        """Record the block in device block ``block_id`` (MRU); returns the id it replaced, if any."""
        return self._set(0, key, block_id)

    def set_host(self, key: bytes, slot: int) -> int | None:
        """Record the block in host slot ``slot`` (MRU); returns the slot it replaced, if any."""
        return self._set(1, key, slot)

    def clear_device(self, key: bytes) -> int | None:
        """Forget the device copy; returns the device block id it had, or None."""
        return self._detach(0, self._slot(key))

    def clear_host(self, key: bytes) -> int | None:
        """Forget the host copy; returns the host slot it had, or None."""
        s = self._slots.get(key)
        return self._detach(1, self._slot(key) if s is None else s)

    def _set(self, t: int, key: bytes, ident: int) -> int | None:
        s = self._slots.get(key)
        if s is None:
            s = self._slot(key)
        self._check_free_id(t, ident, key, s)
        old = self._loc[t][s]
        self._attach(t, s, ident)
        return old if old >= 0 else None

    def add_backend(self, key: bytes, i: int) -> bool:
        """Mark the block stored in backend ``i``; returns False if it already was."""
        return self._flip(key, i, True)

    def remove_backend(self, key: bytes, i: int) -> bool:
        """Unmark backend ``i``; returns False if it was not marked."""
        return self._flip(key, i, False)

    def leave_backend(self, keys: Iterable[bytes], i: int) -> None:
        """Backend ``i`` no longer holds ``keys`` (it evicted them): unmark each one marked there, dropping
        an entry that leaves in no tier and unreferenced (as ``discard_if_unused``).  Keys not in the index
        are ignored.  One call for a batch: a full backend evicts on every put."""
        check_backend(i)
        bit = 1 << i
        slots, mask, refs, dev, host = self._slots, self._mask, self._refs, self._dev, self._host
        for key in keys:
            s = slots.get(key)
            if s is None:
                continue
            m = mask[s]
            if m & bit:
                mask[s] = m ^ bit
                self._bcount[i] -= 1
                if m == bit and not refs[s] and dev[s] < 0 and host[s] < 0:  # _drop_if_unused
                    self._drop_slot(key, s)

    def _flip(self, key: bytes, i: int, on: bool) -> bool:
        if type(i) is not int or not 0 <= i < MAX_BACKENDS:
            check_backend(i)
        s = self._slots.get(key)
        if s is None:
            s = self._slot(key)
        m = self._mask[s]
        if bool((m >> i) & 1) == on:
            return False
        self._mask[s] = m ^ (1 << i)
        self._bcount[i] += 1 if on else -1
        return True

    # -- tier-wide queries
    def count(self, tier: int) -> int:
        """Entries present in ``tier`` (pinned or not)."""
        return self._count[tier] if tier in (0, 1) else self._bcount[tier_backend(tier)]

    @property
    def pinned(self) -> int:
        """Entries with ref count > 0."""
        return self._pinned

    def evictable_count(self, tier: int) -> int:
        """Entries present in ``tier`` with ref count 0."""
        if tier in (0, 1):
            return self._lru_len[tier]
        mask, refs = self._np()
        return int(np.count_nonzero(((mask >> tier_backend(tier)) & 1).astype(bool) & (refs == 0)))

    def eviction_candidates(self, tier: int, n: int) -> list[bytes]:
        """Up to ``n`` keys present in ``tier`` with ref count 0, least recently used first.

        DEVICE / HOST: a walk of the tier's LRU list, O(n), never visiting a pinned entry.  Backends keep
        no list (they evict on their own): O(capacity) numpy scan ordered by last access, then slot.
        The list is a copy, so the caller may evict while going through it.
        """
        if tier in (0, 1):
            out: list[bytes] = []
            s, nxt, keys = self._head[tier], self._next[tier], self._keys
            while s >= 0 and len(out) < n:
                out.append(keys[s] or b"")  # a linked slot always holds a key
                s = nxt[s]
            return out
        b = tier_backend(tier)
        if n <= 0:
            return []
        mask, refs, last = self._np(last=True)
        sel = np.flatnonzero(((mask >> b) & 1).astype(bool) & (refs == 0))
        order = sel[np.argsort(last[sel], kind="stable")[:n]]
        return [self._keys[s] for s in order.tolist()]

    def host_keys_in_backend(self, i: int) -> list[bytes]:
        """Keys of the blocks in host memory that are marked in backend ``i``.  O(capacity)."""
        check_backend(i)
        mask, refs = self._np()
        marked = np.flatnonzero((mask & (1 << i)).astype(bool) & (refs >= 0)).tolist()
        host, keys = self._host, self._keys
        return [k for s in marked if host[s] >= 0 and (k := keys[s]) is not None]

    def forget_backend(self, i: int) -> int:
        """Unmark backend ``i`` on every entry: what it holds is unknown again (a server that came back
        from an outage may have come back empty).  Entries this leaves in no tier and unreferenced are
        dropped, as ``discard_if_unused`` would.  Returns how many entries were unmarked.  O(capacity)."""
        check_backend(i)
        mask, refs = self._np()
        bit = 1 << i
        marked = np.flatnonzero((mask & bit).astype(bool) & (refs >= 0)).tolist()
        col = self._mask
        for s in marked:
            col[s] ^= bit
        self._bcount[i] = 0
        for s in marked:
            self._drop_if_unused(s)
        return len(marked)

    def discard_if_unused(self, key: bytes) -> bool:
        """Remove ``key`` if it is in no tier and unreferenced (keeps an index of hints bounded)."""
        s = self._slots.get(key)
        return s is not None and self._drop_if_unused(s)

    def _drop_if_unused(self, s: int) -> bool:
        """Drop live slot ``s`` if its entry is in no tier and unreferenced; whether it did."""
        if self._refs[s] or self._dev[s] >= 0 or self._host[s] >= 0 or self._mask[s]:
            return False
        self._drop_slot(self._keys[s] or b"", s)  # a live slot always holds a key
        return True

    def _vacate_device(self, s: int) -> None:
        """Live slot ``s`` loses its device copy, and its entry if that leaves it unused."""
        self._detach(0, s)
        self._drop_if_unused(s)

    # -- compound updates (the tier stack and its simulator make exactly these)
    def acquire(self, key: bytes) -> None:
        """An operation starts using ``key``: pin it, inserting it first if absent."""
        s = self._slots.get(key)
        if s is None:
            self.insert(key)
            s = self._slots[key]
        self._pin_slot(key, s, 1)

    def release(self, key: bytes) -> None:
        """An operation is done with ``key``: unpin it, and drop the entry if that leaves it nowhere and
        unreferenced."""
        s = self._slots.get(key)
        if s is None:
            s = self._slot(key)
        if not self._unpin_slot(key, s, 1):
            self._drop_if_unused(s)

    def place_on_device(self, key: bytes, block_id: DeviceId) -> None:
        """``key`` is now in device block ``block_id`` (inserted if absent): whatever key the index said
        that block held loses its device copy first."""
        if type(block_id) is not int:
            self._check_id_type(0, block_id, key)  # a numpy int passes; a float, a string: ValueError
            block_id = int(block_id)
        rev = self._rev[0]
        o = rev[block_id] if 0 <= block_id < len(rev) else -1
        if o >= 0 and self._keys[o] != key:
            self._vacate_device(o)
        s = self._slots.get(key)
        if s is None:
            self.insert(key)
            s = self._slots[key]
        self._check_free_id(0, block_id, key, s)
        self._attach(0, s, block_id)

    # -- self-check (tests, debugging)
    def validate(self) -> None:
        """Check every invariant in O(capacity); raises AssertionError naming the first broken one."""
        live = set(self._slots.values())
        checks = [
            (len(live) == len(self._slots) and all(self._keys[s] is k for k, s in self._slots.items()),
             "dict and key column disagree"),
            (not set(self._free) & live and len(self._free) + len(live) == self._top, "free list leaks"),
            (all((s in live) == (self._refs[s] >= 0) for s in range(self._cap)), "refs -1 iff slot free"),
            (sum(self._refs[s] > 0 for s in live) == self._pinned, "pinned count"),
            *((sum((self._mask[s] >> i) & 1 for s in live) == self._bcount[i], f"backend[{i}] count")
              for i in range(MAX_BACKENDS)),
        ]
        for t in (0, 1):
            order: list[int] = []
            s, p = self._head[t], -1
            while s >= 0 and len(order) <= self._cap and self._prev[t][s] == p:
                order.append(s)
                p, s = s, self._next[t][s]
            present = [x for x in live if self._loc[t][x] >= 0]
            name = Tier.label(t)
            checks += [
                (s < 0 and p == self._tail[t] and len(order) == self._lru_len[t], f"{name} LRU links"),
                (set(order) == {x for x in present if self._refs[x] == 0},
                 f"{name} LRU must hold exactly the unpinned entries present in {name}"),
                (len(present) == self._count[t], f"{name} count"),
                (all(self._rev[t][self._loc[t][x]] == x for x in present)
                 and sum(v >= 0 for v in self._rev[t]) == len(present), f"{name} reverse map"),
            ]
        for ok, msg in checks:
            if not ok:
                raise AssertionError(f"BlockIndex invariant broken: {msg}")
