"""Batch forms of the index's operations, over a request's keys in one call each."""

from __future__ import annotations

import operator
from collections.abc import Iterable, Sequence

from .core import HITS_MAX, ID_MAX, DeviceId, IndexCore, id_column
from .tiers import check_backend


class BatchOps(IndexCore):
    """The operations a tier stack (and its simulator) makes per request, one call per batch."""

    def free_device(self, block_id: DeviceId) -> None:
        """Device block ``block_id`` is freed or about to be overwritten: the key it held, if any, loses its
        device copy (and its entry, if that leaves it nowhere and unreferenced)."""
        self.free_devices((block_id,))

    def free_devices(self, block_ids: Iterable[DeviceId]) -> None:
        """:meth:`free_device` of each id in order: what an engine's block allocation evicted, in one call."""
        rev, dev, host, mask, refs, keys = self._rev[0], self._dev, self._host, self._mask, self._refs, self._keys
        count, n = self._count, len(rev)
        prev, nxt, head, tail, size = self._prev[0], self._next[0], self._head, self._tail, self._lru_len
        for b in block_ids:
            if type(b) is not int:
                b = operator.index(b)
            s = rev[b] if 0 <= b < n else -1
            if s < 0:
                continue
            # _vacate_device(s) inlined: the device copy goes, then the entry if that leaves it unused
            if refs[s] == 0:  # _unlink(DEVICE, s), spelled out: an engine frees blocks by the thousand
                p, q = prev[s], nxt[s]
                if p >= 0:
                    nxt[p] = q
                else:
                    head[0] = q
                if q >= 0:
                    prev[q] = p
                else:
                    tail[0] = p
                prev[s] = nxt[s] = -1
                size[0] -= 1
            dev[s] = -1
            rev[b] = -1
            count[0] -= 1
            if not refs[s] and host[s] < 0 and not mask[s]:
                self._drop_slot(keys[s] or b"", s)  # a live slot always holds a key

    # -- batches: the same operations over a request's keys, one call each (a simulation makes millions;
    # a method call per key per step was most of their cost).  Each is exactly its single-key form
    # applied to the keys in order (test_batch_operations_are_their_single_key_forms_in_order).  Their
    # common paths repeat the steps of the helpers they name (_attach, _detach, _pin_slot...) instead of
    # calling them: with the calls, a simulated replay ran 15 % more instructions (cachegrind).
    def place_on_device_many(self, keys: Sequence[bytes], block_ids: Sequence[DeviceId]) -> None:
        """:meth:`place_on_device` of each ``(keys[i], block_ids[i])`` in order."""
        if len(keys) != len(block_ids):
            raise ValueError(f"place_on_device_many: {len(keys)} keys for {len(block_ids)} device block ids")
        # place_on_device inlined for plain ids (an id of another type, or out of range, takes the
        # single-key form, which converts or raises exactly as it would): the store path's hottest loop.
        get, dev, refs, rev = self._slots.get, self._dev, self._refs, self._rev[0]
        prev, nxt, head, tail = self._prev[0], self._next[0], self._head, self._tail
        n_rev = len(rev)  # the reverse map only grows (here and in place_on_device): re-read after either
        for key, b in zip(keys, block_ids):
            if type(b) is not int or not 0 <= b <= ID_MAX:
                self.place_on_device(key, b)
                n_rev = len(rev)
                continue
            if b >= n_rev:
                rev.extend(id_column(max(b + 1, 2 * n_rev) - n_rev))
                n_rev = len(rev)
            o = rev[b]
            s = get(key)
            if o >= 0 and o != s:
                self._vacate_device(o)  # the block held another key: it loses its device copy
            if s is None:
                s = self._new_slot(key)
            old = dev[s]
            if old == b:  # already there: only recency changes (as _attach's re-set)
                if refs[s] == 0:
                    self._to_mru(0, s)
                continue
            if old >= 0:
                rev[old] = -1
            else:
                self._count[0] += 1
            dev[s] = b
            rev[b] = s
            if refs[s] == 0:
                if old >= 0:
                    self._to_mru(0, s)
                else:  # _link_mru(0, s)
                    p = tail[0]
                    prev[s] = p
                    nxt[s] = -1
                    if p >= 0:
                        nxt[p] = s
                    else:
                        head[0] = s
                    tail[0] = s
                    self._lru_len[0] += 1

    def host_slots(self, keys: Iterable[bytes]) -> list[int]:
        """The host slot of each key, -1 where it has none (or is not in the index)."""
        host = self._host
        return [-1 if s is None else host[s] for s in map(self._slots.get, keys)]

    def acquire_many(self, keys: Iterable[bytes], host_slots: list[int] | None = None) -> None:
        """:meth:`acquire` of each key in order; ``host_slots``, when given, gets each key's host slot (-1:
        none), as :meth:`host_slots` reads it (a pin moves no block), in the same pass."""
        get, refs, dev, host = self._slots.get, self._refs, self._dev, self._host
        # The two tiers' lists spelled out, not a loop over them: this runs for every block a store or a
        # load pins (the simulator's hottest loop after placement).
        (dprev, hprev), (dnext, hnext) = self._prev, self._next
        head, tail, size = self._head, self._tail, self._lru_len
        slots, free, key_of, hits, last, clock = self._slots, self._free, self._keys, self._hits, self._last, self._clock
        for key in keys:
            s = get(key)
            if s is None:
                if type(key) is not bytes or not key or (not free and self._top >= self._cap):
                    s = self._new_slot(key)  # a bad key (its error) or a full table (growth): the helper
                else:  # _new_slot spelled out (a freed slot, else the next never used one), then pinned:
                    if free:  # a new entry is in no tier's list, so pinning it unlinks nothing
                        s = free.pop()
                    else:
                        s = self._top
                        self._top = s + 1
                    slots[key] = s
                    key_of[s] = key
                    hits[s] = 0
                    last[s] = clock()
                    refs[s] = 1
                    self._pinned += 1
                    if host_slots is not None:
                        host_slots.append(-1)
                    continue
            if host_slots is not None:
                host_slots.append(host[s])
            r = refs[s]
            if r == 0:  # _pin_slot: leaves its tiers' LRU lists (_unlink of each, inlined)
                self._pinned += 1
                if dev[s] >= 0:
                    p, n = dprev[s], dnext[s]
                    if p >= 0:
                        dnext[p] = n
                    else:
                        head[0] = n
                    if n >= 0:
                        dprev[n] = p
                    else:
                        tail[0] = p
                    dprev[s] = dnext[s] = -1
                    size[0] -= 1
                if host[s] >= 0:
                    p, n = hprev[s], hnext[s]
                    if p >= 0:
                        hnext[p] = n
                    else:
                        head[1] = n
                    if n >= 0:
                        hprev[n] = p
                    else:
                        tail[1] = p
                    hprev[s] = hnext[s] = -1
                    size[1] -= 1
            refs[s] = r + 1

    def release_many(self, keys: Iterable[bytes]) -> None:
        """:meth:`release` of each key in order."""
        get, refs, dev, host, mask = self._slots.get, self._refs, self._dev, self._host, self._mask
        (dprev, hprev), (dnext, hnext) = self._prev, self._next  # the tiers spelled out, as acquire_many
        head, tail, size = self._head, self._tail, self._lru_len
        for key in keys:
            s = get(key)
            if s is None:
                s = self._slot(key)
            r = refs[s]
            if r != 1:
                self._unpin_slot(key, s, 1)  # still pinned after, or the ValueError of an unpinned key
                continue
            refs[s] = 0  # _unpin_slot to 0: back in its tiers' LRU lists, or dropped if in none
            self._pinned -= 1
            d = dev[s]
            if d >= 0:  # _link_mru(DEVICE, s)
                p = tail[0]
                dprev[s] = p
                dnext[s] = -1
                if p >= 0:
                    dnext[p] = s
                else:
                    head[0] = s
                tail[0] = s
                size[0] += 1
            if host[s] >= 0:  # _link_mru(HOST, s)
                p = tail[1]
                hprev[s] = p
                hnext[s] = -1
                if p >= 0:
                    hnext[p] = s
                else:
                    head[1] = s
                tail[1] = s
                size[1] += 1
            elif d < 0 and not mask[s]:
                self._drop_slot(key, s)

    def loaded_many(self, keys: Sequence[bytes], block_ids: Sequence[DeviceId], now: float | None = None) -> list[int]:
        """A load's pinned blocks are on the device: :meth:`place_on_device_many`, :meth:`touch_many` and
        :meth:`release_many` of ``keys``, in one pass (each key's three steps in turn); the hit counts, as
        touch_many's.  The state is the three calls': placing or touching a pinned entry moves it in no
        list, so the releases alone order the entries, in the same order.  From the first key that is not
        the usual case (absent or unpinned, an id of another type or past the reverse map), the rest take
        the three calls (their errors included)."""
        if len(keys) != len(block_ids):
            raise ValueError(f"loaded_many: {len(keys)} keys for {len(block_ids)} device block ids")
        get, refs, dev, host, rev = self._slots.get, self._refs, self._dev, self._host, self._rev[0]
        hits, last, count = self._hits, self._last, self._count
        (dprev, hprev), (dnext, hnext) = self._prev, self._next  # the tiers spelled out, as release_many
        head, tail, size = self._head, self._tail, self._lru_len
        n_rev = len(rev)
        now = self._clock() if now is None else now  # one timestamp, as touch_many's
        out: list[int] = []
        for j, b in enumerate(block_ids):
            key = keys[j]
            s = get(key)
            if s is None or refs[s] < 1 or type(b) is not int or not 0 <= b < n_rev:
                rest, ids = keys[j:], block_ids[j:]
                try:
                    self.place_on_device_many(rest, ids)
                    out += self.touch_many(rest, now)
                finally:
                    self.release_many(rest)
                return out
            o = rev[b]
            if o != s:  # place_on_device (pinned: in no list); already there, nothing changes
                if o >= 0:
                    self._vacate_device(o)  # the block held another key: it loses its device copy
                old = dev[s]
                if old >= 0:
                    rev[old] = -1
                else:
                    count[0] += 1
                dev[s] = b
                rev[b] = s
            h = hits[s]  # touch (pinned: in no list)
            if h < HITS_MAX:
                h += 1
                hits[s] = h
            last[s] = now
            out.append(h)
            r = refs[s]
            if r != 1:
                self._unpin_slot(key, s, 1)  # still pinned after
                continue
            refs[s] = 0  # release to 0: back at the MRU end of the device list (it is there now) and host's
            self._pinned -= 1
            p = tail[0]
            dprev[s] = p
            dnext[s] = -1
            if p >= 0:
                dnext[p] = s
            else:
                head[0] = s
            tail[0] = s
            size[0] += 1
            if host[s] >= 0:
                p = tail[1]
                hprev[s] = p
                hnext[s] = -1
                if p >= 0:
                    hnext[p] = s
                else:
                    head[1] = s
                tail[1] = s
                size[1] += 1
        return out

    def drop_host_many(self, keys: Iterable[bytes]) -> list[int]:
        """:meth:`clear_host` then :meth:`discard_if_unused` of each key in order (host memory evicted
        them); the slots they had, -1 where a key had none."""
        get, refs, dev, host, mask, rev = self._slots.get, self._refs, self._dev, self._host, self._mask, self._rev[1]
        out: list[int] = []
        for key in keys:
            s = get(key)
            h = -1 if s is None else host[s]
            out.append(h)
            if s is None:
                continue
            r = refs[s]
            if h >= 0:  # _detach(HOST, s)
                if r == 0:
                    self._unlink(1, s)
                host[s] = -1
                rev[h] = -1
                self._count[1] -= 1
            if not r and dev[s] < 0 and not mask[s]:
                self._drop_slot(key, s)
        return out

    def land_host_many(self, keys: Sequence[bytes], slots: Sequence[int]) -> list[bool]:
        """Each key lands in host slot ``slots[i]`` (inserted if absent, then :meth:`set_host`), in order,
        except a key already in another host slot: it keeps that one.  Per key whether it landed (the
        slot of one that did not is the caller's again)."""
        if len(keys) != len(slots):
            raise ValueError(f"land_host_many: {len(keys)} keys for {len(slots)} host slots")
        get, host, refs, rev = self._slots.get, self._host, self._refs, self._rev[1]
        out: list[bool] = []
        n_rev = len(rev)  # the reverse map only grows (in _attach): re-read after it
        for key, slot in zip(keys, slots):
            s = get(key)
            if s is None:
                s = self._new_slot(key)
            elif 0 <= host[s] != slot:
                out.append(False)
                continue
            out.append(True)
            if type(slot) is not int or not 0 <= slot < n_rev or rev[slot] >= 0 or host[s] >= 0:
                self._check_free_id(1, slot, key, s)  # the rare cases (growth, a re-set, a bad slot)
                self._attach(1, s, slot)
                n_rev = len(rev)
                continue
            # _attach(HOST, s, slot) of a free slot to an entry with none: counted, and MRU if unpinned
            self._count[1] += 1
            host[s] = slot
            rev[slot] = s
            if refs[s] == 0:
                self._link_mru(1, s)
        return out

    def refs_many(self, keys: Iterable[bytes]) -> list[int]:
        """The ref count of each key, 0 where it is not in the index."""
        refs = self._refs
        return [0 if s is None else refs[s] for s in map(self._slots.get, keys)]

    def masks(self, keys: Iterable[bytes]) -> list[int]:
        """The backend bitmask of each key (bit ``i``: stored in backend ``i``), 0 where it is not in the
        index: one read for a batch's per-backend decisions (:meth:`in_backends` is one key's)."""
        mask = self._mask
        return [0 if s is None else mask[s] for s in map(self._slots.get, keys)]

    def add_backend_many(self, keys: Iterable[bytes], i: int) -> None:
        """:meth:`add_backend` ``i`` on each key that is in the index (others are skipped)."""
        check_backend(i)
        bit, get, mask, n = 1 << i, self._slots.get, self._mask, 0
        for key in keys:
            s = get(key)
            if s is not None:
                m = mask[s]
                if not m & bit:
                    mask[s] = m | bit
                    n += 1
        self._bcount[i] += n
