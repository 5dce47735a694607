"""Longest-prefix lookups over the index: the best tier of each leading block present somewhere."""

from __future__ import annotations

import operator
from collections.abc import Sequence
from dataclasses import dataclass

import numpy as np

from .core import IndexCore
from .tiers import TIER_OF_CODE, Tier

SHORT_CHAIN = 48


@dataclass(frozen=True)
class PrefixMatch:
    """Result of :meth:`BlockIndex.lookup_prefix`: the leading ``length`` keys are available somewhere.

    ``tiers[i]`` is the tier block ``i`` is best served from (device > host > lowest backend index);
    ``device_ids[i]`` / ``host_slots[i]`` are its device block id / host slot, -1 where absent.
    """

    length: int
    tiers: np.ndarray  # int8[length]
    device_ids: np.ndarray  # int32[length]
    host_slots: np.ndarray  # int32[length]

    @property
    def in_memory(self) -> int:
        """Leading blocks served from device or host memory (before the first backend-only one)."""
        mem = self.tiers <= Tier.HOST
        return int(mem.argmin()) if not mem.all() else self.length

    def counts(self) -> dict[int, int]:
        codes, n = np.unique(self.tiers, return_counts=True)
        return {int(c): int(k) for c, k in zip(codes, n)}

    def runs(self) -> list[tuple[int, int, int]]:
        """Maximal runs of one tier as ``(tier, start, stop)``, e.g. device 0..10, host 10..15."""
        if not self.length:
            return []
        cuts = np.flatnonzero(np.diff(self.tiers)) + 1
        starts = [0, *cuts.tolist()]
        stops = [*cuts.tolist(), self.length]
        return [(int(self.tiers[a]), a, b) for a, b in zip(starts, stops)]


class PrefixLookups(IndexCore):
    """:meth:`lookup_prefix` (device ids and host slots too) and :meth:`prefix_tiers` (tiers only)."""

    # -- prefix lookup
    def lookup_prefix(self, keys: Sequence[bytes]) -> PrefixMatch:
        """Longest run of leading ``keys`` present in some tier, with the best tier of each block.

        Read-only (no touch, no hit counted: a scheduler asks again every step until it admits a
        request).  The chain stops at the first key that is absent or present in no tier.
        """
        get, total = self._slots.get, len(keys)
        if total <= SHORT_CHAIN:
            return self._lookup_short(keys)
        slots: list[int] = []
        pos, chunk = 0, 64
        # growing chunks: a chain that misses early costs a few dict probes, a full hit ~log(n) chunks
        while pos < total:
            part = list(map(get, keys[pos:pos + chunk]))
            if None in part:
                slots += [x for x in part[:part.index(None)] if x is not None]
                break
            slots += [x for x in part if x is not None]
            pos += chunk
            chunk *= 4
        # itemgetter gathers a column's values in C (a list comprehension took twice as long in all)
        pick = operator.itemgetter(*slots) if len(slots) > 1 else (lambda col: tuple(col[s] for s in slots))
        dev = np.array(pick(self._dev), dtype=np.int32)
        host = np.array(pick(self._host), dtype=np.int32)
        mask = np.array(pick(self._mask), dtype=np.int64)
        low_bit = np.frexp((mask & -mask).astype(np.float64))[1] - 1  # index of lowest set bit; -1 if none
        tiers = np.where(dev >= 0, Tier.DEVICE,
                         np.where(host >= 0, Tier.HOST, np.where(mask != 0, low_bit + 2, Tier.MISSING)))
        holes = np.flatnonzero(tiers < 0)
        n = int(holes[0]) if holes.size else len(slots)
        return PrefixMatch(n, tiers[:n].astype(np.int8), dev[:n].copy(), host[:n].copy())

    def prefix_tiers(self, keys: Sequence[bytes]) -> list[Tier]:
        """``lookup_prefix(keys).tiers`` as a list of :class:`Tier`: the best tier of each block of the
        longest run of leading keys present somewhere.  What the manager's lookups read, without the
        device ids, host slots and numpy arrays a walk would build only to drop.  A walk at any length:
        with list columns it costs ~60 ns a key, less than the vector path's copies below thousands."""
        get, dev_col, host_col, mask_col = self._slots.get, self._dev, self._host, self._mask
        device, host, of_code = Tier.DEVICE, Tier.HOST, TIER_OF_CODE
        out: list[Tier] = []
        for key in keys:
            s = get(key)
            if s is None:
                break
            if dev_col[s] >= 0:
                out.append(device)
            elif host_col[s] >= 0:
                out.append(host)
            else:
                m = mask_col[s]
                if not m:
                    break  # present in no tier (a placeholder): the chain stops
                out.append(of_code[(m & -m).bit_length() + 2])  # code 2 + lowest backend bit, shifted by 1
        return out

    def _lookup_short(self, keys: Sequence[bytes]) -> PrefixMatch:
        """``lookup_prefix`` of a short chain, key by key over the columns: the vector path's dozen
        numpy calls cost more than the walk itself below ``SHORT_CHAIN`` keys (most lookups: what the
        device prefix cache left over), and a simulated replay spent a quarter of its time there."""
        get, dev_col, host_col, mask_col = self._slots.get, self._dev, self._host, self._mask
        tiers: list[int] = []
        devs: list[int] = []
        hosts: list[int] = []
        for key in keys:
            s = get(key)
            if s is None:
                break
            d, h = dev_col[s], host_col[s]
            t: int
            if d >= 0:
                t = Tier.DEVICE
            elif h >= 0:
                t = Tier.HOST
            else:
                m = mask_col[s]
                if not m:
                    break  # present in no tier (a placeholder): the chain stops
                t = (m & -m).bit_length() + 1  # 2 + index of the lowest backend holding it
            tiers.append(t)
            devs.append(d)
            hosts.append(h)
        return PrefixMatch(len(tiers), np.array(tiers, dtype=np.int8), np.array(devs, dtype=np.int32),
                           np.array(hosts, dtype=np.int32))
