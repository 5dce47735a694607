"""Reads from backends: every stored value a load or a prefetch brings up goes through :class:`ValueReader`,
whatever its size (one engine block, or a group of ``storage.block_tokens`` blocks; see
:mod:`kvtier.format.groups`).  Writing values is :mod:`kvtier.tiering.writes`' alone.

Each wanted block of a value has its destination before the read: a host slot, the engine's device
block itself (a CPU engine's KV, read straight in: ``direct``), or a temporary row; a block of the value
nobody wants (or already in host memory) gets a temporary row.  The host slots of a whole read are
decided before its first value is read (:meth:`ValueReader.reserve`: one
:class:`~kvtier.tiering.room.Reservation`), and handed out as each chunk of values is read.  A backend that reads
segments fills those destinations in place, one read per value and no copy; another reads a value of
several blocks into one buffer, whose wanted blocks are copied to their rows as soon as it is verified.
A value of one block is read straight into its one destination by every backend.

Invariants (beside the stack's):
* a value read from a backend is verified as a whole (one header, one checksum) before any of its blocks
  becomes visible in host memory or is reported delivered;
* every value is read while its key is held (``BackendSet.hold``), so room made meanwhile by a
  write-back's put never evicts it;
* every slot handed out is either committed (the block is in host memory) or released, exactly once
  (what the reservation never handed out, it settles itself at ``close``);
* a value read whole is remembered by the planner for its blocks in host memory, so a later write of one
  of them writes the whole value.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np
import torch

from ..format.blockformat import Segments
from ..format.groups import group_of
from .load_steps import Source, Step
from .parts import StackParts
from .room import Reservation, WriteBack

log = logging.getLogger("kvtier.stack")

Group = tuple[int, int]  # (first, last) indices into a chain slice; first may be < 0

#: Where a wanted block's bytes land once verified: ``land(position, row)``, called in the reading thread
#: while they are still in the CPU cache (a load into CPU memory copies them on to the device block).
Lander = Callable[[int, np.ndarray], None]
#: The device block of a position as segments, to read straight into (None: it cannot be).
Direct = Callable[[int], Segments | None]


@dataclass
class _Value:
    """One value to read: group ``g``, its blocks' destinations (``dest[off]``: a row, or the device
    block's segments), and the wanted blocks it delivers (position, offset in the value, slot or None)."""

    g: int
    dest: list[Any]
    wanted: list[tuple[int, int, int | None]] = field(default_factory=list)
    direct: bool = False
    src: int = -1  # the backend it came from (-1: from none yet)
    whole: np.ndarray | None = None  # the one buffer a backend that reads no segments fills
    placed: bool = False  # its wanted blocks are copied out of ``whole``
    broken: bool = False  # verified, but placing its blocks failed: not delivered from this backend


class ValueReader:
    """Brings stored values up from the backends for one stack."""

    def __init__(self, parts: StackParts, write_back: WriteBack):
        self.parts = parts
        self.write_back = write_back  # held victims copied down (the room of a read, HostRoom.write_back)
        self.k = parts.storage_blocks

    def groups_of(self, start: int, positions: Sequence[int], n: int) -> tuple[list[Group], list[int]]:
        """The distinct values holding ``positions`` (in order) that end inside the slice, and the
        positions whose value does not (they cannot be read: the value's key is not in the slice)."""
        out: list[Group] = []
        lost: list[int] = []
        k = self.k
        for i in positions:
            g = (i, i) if k == 1 else group_of(start, i, k)
            if g[1] >= n:
                lost.append(i)
            elif not out or out[-1] != g:
                out.append(g)
        return out, lost

    def locate(self, hashes: Sequence[bytes], groups: Sequence[Group]) -> list[int]:
        """For the longest run of leading ``groups`` stored in some backend, the backend holding each."""
        return self.parts.backends.locate(self.parts.namespace.keys([hashes[last] for _, last in groups]))

    def reserve(self, hashes: Sequence[bytes], groups: Sequence[Group], where: Sequence[int], want: set[int],
                direct: Direct | None = None) -> Reservation:
        """The host room of a read of the first ``len(where)`` values, decided now, before any is read: a
        slot for each wanted block not in host memory, of every value not read straight into the device
        (``direct``, as :meth:`fetch` decides), in the order of the values."""
        p, planner = self.parts, self.parts.planner
        if p.host is None:
            return Reservation.take(planner, [], self.write_back)
        rows: list[int] = []
        with planner.lock:
            host_slot = planner.index.host_slot
            for (first, last), b in zip(groups, where):
                missing = [i for i in range(max(first, 0), last + 1) if i in want and host_slot(hashes[i]) is None]
                if missing and self._segments(missing, b, direct) is None:
                    rows += missing
        return Reservation.take(planner, rows, self.write_back)

    def _segments(self, missing: Sequence[int], b: int, direct: Direct | None) -> list[Segments] | None:
        """The device blocks of ``missing`` as segments when backend ``b`` reads them straight in there
        (all of them or none)."""
        if direct is None or not self.parts.direct_loads[b]:
            return None
        segs = [direct(i) for i in missing]
        return None if any(s is None for s in segs) else [s for s in segs if s is not None]

    def fetch(self, hashes: Sequence[bytes], groups: Sequence[Group], where: Sequence[int], want: set[int], *,
              rows: Reservation, allow_tmp: bool, land: Lander | None = None,
              direct: Direct | None = None) -> dict[int, Step | None]:
        """Read the first ``len(where)`` values (``where[j]``: the backend to try first) and place their
        blocks at positions in ``want`` (pinned by the caller).  Per wanted position: a HOST step (verified,
        now in host memory, or already there), a TMP step (no host room: a temporary row, only with
        ``allow_tmp``), a DIRECT step (read into ``direct(position)``), or None (not delivered).

        ``direct``: a value whose first backend loads straight into the engine's KV
        (``StackParts.direct_loads``) and whose wanted blocks all have device segments is read there and
        never lands in host memory (the backend keeps it: a local disk's page cache already holds what host
        memory would); should that backend fail it, only backends that load straight in are tried.
        ``rows``: the read's host room (:meth:`reserve`), whose slots the blocks read now take."""
        p, planner = self.parts, self.parts.planner
        out: dict[int, Step | None] = {}
        todo: list[_Value] = []
        need: list[list[int]] = []  # per value in todo, its wanted positions not in host memory
        k = self.k
        with planner.lock:
            host_slot = planner.index.host_slot
            for g, (first, last) in enumerate(groups[:len(where)]):
                missing = []
                for i in range(max(first, 0), last + 1):
                    if i in want:
                        slot = host_slot(hashes[i])
                        if slot is not None:
                            out[i] = Step(Source.HOST, slot)  # already there (a store, another read)
                        else:
                            missing.append(i)
                            out[i] = None  # until read
                if missing:
                    todo.append(_Value(g, [None] * k))
                    need.append(missing)
        for first, last in groups[len(where):]:
            for i in range(max(first, 0), last + 1):
                if i in want:
                    out[i] = None
        if not todo:
            return out
        keys = p.namespace.keys([hashes[groups[v.g][1]] for v in todo])
        # Held while room is made and the values read: a write-back making that room never evicts them.
        p.backends.hold(keys)
        slots: list[int] = []
        try:
            self._destinations(groups, where, todo, need, rows, allow_tmp, direct, slots)
            self._read(todo, [j for j, v in enumerate(todo) if v.wanted], keys, where, land)
        except BaseException:
            planner.release_slots(slots)  # never left WRITING
            raise
        finally:
            p.backends.release(keys)
        unused: list[int] = []
        n_host = 0
        with planner.lock:
            for v in todo:
                first, last = groups[v.g]
                if not v.wanted:
                    continue  # nowhere to put it (no host room, no temporary rows): never read
                if v.src < 0:
                    planner.mark_missing_locked(hashes[last], where[v.g])  # read and not there: a stale hint
                    unused += [s for _, _, s in v.wanted if s is not None]
                    continue
                for i in range(max(first, 0), last + 1):
                    planner.mark_read_locked(hashes[i], v.src)
                for i, off, slot in v.wanted:
                    if v.direct:
                        out[i] = Step(Source.DIRECT, None, v.src)
                    elif slot is not None:
                        out[i] = Step(Source.HOST, planner.commit_host_locked(hashes[i], slot), v.src)
                        n_host += 1
                    else:
                        out[i] = Step(Source.TMP, torch.from_numpy(v.dest[off]), v.src)
                if k > 1 and first >= 0:
                    planner.remember_group_locked(tuple(hashes[first:last + 1]))
        planner.release_slots(unused)
        p.metrics.add("host", bytes_in=n_host * p.layout.block_nbytes)
        return out

    def _destinations(self, groups: Sequence[Group], where: Sequence[int], todo: list[_Value],
                      need: list[list[int]], rows: Reservation, allow_tmp: bool, direct: Direct | None,
                      handed: list[int]) -> None:
        """Give every block of the values ``todo`` its destination (``need[j]``: value j's wanted blocks
        not in host memory, which alone are delivered): the slot ``rows`` named for it, the device block,
        or a temporary row.  The host slots handed out go into ``handed`` at once (the caller releases
        them should anything fail); ``wanted`` names each.
        A value none of whose wanted blocks has a destination other than a temporary row is left
        without ``wanted`` (not read) unless ``allow_tmp``."""
        p, k = self.parts, self.k
        via_host: list[int] = []  # indices into todo of the values read through host rows
        for j, (v, missing) in enumerate(zip(todo, need)):
            segs = self._segments(missing, where[v.g], direct)
            if segs is not None:
                first = groups[v.g][0]
                for i, s in zip(missing, segs):
                    v.dest[i - first] = s
                    v.wanted.append((i, i - first, None))
                v.direct = True
                continue
            via_host.append(j)
        host = p.host
        given = rows.slots_for([i for j in via_host for i in need[j]]) if host is not None else {}
        handed += given.values()
        for j in via_host:
            v = todo[j]
            first = groups[v.g][0]
            for i in need[j]:
                slot = given.get(i)
                if slot is not None and host is not None:
                    v.dest[i - first] = host.slot_view(slot)
                    v.wanted.append((i, i - first, slot))
                elif allow_tmp:
                    v.wanted.append((i, i - first, None))
        # Temporary rows: wanted blocks without a slot, and a value's blocks nobody wants.
        n_tmp = sum(d is None for v in todo if v.wanted for d in v.dest)
        if n_tmp:
            tmp = torch.empty((n_tmp, p.layout.block_nbytes), dtype=torch.uint8).numpy()
            t = 0
            for v in todo:
                if v.wanted:
                    for off in range(k):
                        if v.dest[off] is None:
                            v.dest[off] = tmp[t]
                            t += 1

    def _read(self, todo: list[_Value], order: list[int], keys: list[str], where: Sequence[int],
              land: Lander | None) -> None:
        """Read values ``order`` (indices into ``todo``): each from the backend that has it, then what
        failed (vanished, corrupt) from the others."""
        n = len(self.parts.backends)
        segs = self.parts.direct_loads
        for b in sorted({where[todo[j].g] for j in order}):
            self._get(b, [j for j in order if where[todo[j].g] == b], todo, keys, land)
        for b in range(n):
            self._get(b, [j for j in order if todo[j].src < 0 and where[todo[j].g] != b
                          and (segs[b] or not todo[j].direct)], todo, keys, land)

    def _get(self, b: int, batch: list[int], todo: list[_Value], keys: list[str], land: Lander | None) -> None:
        """Read values ``batch`` from backend ``b`` into their destinations; record where each came from."""
        if not batch:
            return
        sb, k, nb = self.parts.backends, self.k, self.parts.layout.block_nbytes
        values = [todo[j] for j in batch]
        if k == 1:
            bufs: list[Any] = [v.dest[0] for v in values]
        elif sb.reads_segments[b]:
            bufs = [Segments([part for d in v.dest for part in (d.parts if isinstance(d, Segments) else [memoryview(d)])])
                    for v in values]
        else:
            whole = torch.empty((len(values), k * nb), dtype=torch.uint8).numpy()
            for v, row in zip(values, whole):
                v.whole = row
            bufs = list(whole)

        def verified(n: int) -> None:
            # The value's bytes are verified: copy its wanted blocks out of one buffer, and hand them on,
            # in this (the reading) thread while they are in the CPU cache.
            v = values[n]
            try:
                if v.whole is not None and not v.placed:
                    v.placed = True
                    for _, off, _ in v.wanted:
                        v.dest[off][:] = v.whole[off * nb:(off + 1) * nb]
                if land is not None and not v.direct:
                    for i, off, _ in v.wanted:
                        land(i, v.dest[off])
            except Exception:  # noqa: BLE001 - never into the backend's reading thread: the value is a miss
                log.exception("read: placing the verified value %s failed", keys[batch[n]])
                v.broken = True

        tell = verified if (k > 1 and not sb.reads_segments[b]) or land is not None else None
        ok = sb.get_into(b, [keys[j] for j in batch], bufs, tell)
        for n, (v, good) in enumerate(zip(values, ok)):
            if good and v.whole is not None and not v.placed:
                verified(n)  # a backend that never said so: placed now, once
            if good and not v.broken:
                v.src = b
            v.whole, v.placed, v.broken = None, False, False


__all__ = ["ValueReader"]
