"""Stored values of several engine blocks (``storage.block_tokens``; see :mod:`kvtier.format.groups`): reading a
value into the host slots of its blocks.  Writing values, of one block or several, is
:mod:`kvtier.tiering.writes`' alone.

Invariants (beside the stack's):
* a value read from a backend is verified as a whole (one header, one checksum) before any of its blocks
  becomes visible in host memory;
* a value read whole is remembered by the planner for its blocks in host memory, so a later write of
  one of them writes the whole value.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..format.blockformat import Segments
from ..format.groups import group_of
from .load_steps import Source, Step
from .parts import SlotSource, StackParts

log = logging.getLogger("kvtier.stack")

Group = tuple[int, int]  # (first, last) indices into a chain slice; first may be < 0


@dataclass(frozen=True)
class _Reads:
    """What a grouped read brought up for the values it was given (value ``j`` = ``todo[j]``)."""

    rows: list[list[Any]]                # per value, a numpy uint8 row per block (a host slot or a temporary)
    slot_of: dict[tuple[int, int], int]  # (value, block offset) -> the host slot it was read into
    src: list[int]                       # per value, the backend it came from (-1: from none)


class Grouped:
    """The grouped half of fetch for one stack."""

    def __init__(self, parts: StackParts, room: SlotSource):
        self.parts = parts
        self.room = room
        self.k = parts.storage_blocks

    def groups_of(self, start: int, positions: Sequence[int], n: int) -> tuple[list[Group], list[int]]:
        """The distinct groups holding ``positions`` (in order) that end inside the slice, and the
        positions whose group does not (they cannot be fetched: the value's key is not in the slice)."""
        out: list[Group] = []
        lost: list[int] = []
        for i in positions:
            g = group_of(start, i, self.k)
            if g[1] >= n:
                lost.append(i)
            elif not out or out[-1] != g:
                out.append(g)
        return out, lost

    def locate(self, hashes: Sequence[bytes], groups: Sequence[Group]) -> list[int]:
        """For the longest run of leading ``groups`` stored in some backend, the backend holding each."""
        return self.parts.backends.locate(self.parts.namespace.keys([hashes[last] for _, last in groups]))

    def fetch(self, hashes: Sequence[bytes], groups: Sequence[Group], where: Sequence[int], want: set[int], *,
              allow_tmp: bool) -> dict[int, Step | None]:
        """Read the first ``len(where)`` groups and place their blocks at positions in ``want`` (pinned
        by the caller): ``{position: HOST step | TMP step | None}`` as ``Upward.fetch`` answers per key.

        Each block of a value to read has its destination row before the read: the host slot reserved
        for it (a wanted block not in host memory), else a temporary row.  A backend that reads segments
        fills those rows in place (one read per value, no copy); another reads the value into one
        buffer whose blocks are then copied to their rows.  Why: a value of 16 blocks of 4 MiB read into
        a fresh 64 MiB buffer paid its page faults and a second copy into host slots, 5x slower than the
        same bytes as single blocks."""
        p, planner, nb = self.parts, self.parts.planner, self.parts.layout.block_nbytes
        out: dict[int, Step | None] = {}
        todo: list[int] = []  # indices into groups still to read
        with planner.lock:
            for g, (first, last) in enumerate(groups[:len(where)]):
                members = [i for i in range(max(first, 0), last + 1) if i in want]
                for i in members:
                    slot = planner.index.host_slot(hashes[i])
                    out[i] = Step(Source.HOST, slot) if slot is not None else None
                if any(out[i] is None for i in members):
                    todo.append(g)
        for first, last in groups[len(where):]:
            for i in range(max(first, 0), last + 1):
                if i in want:
                    out[i] = None
        if not todo:
            return out
        # need[j]: the (position, offset in the value) of value j's blocks wanted and not in host memory.
        need = [[(i, i - groups[g][0]) for i in range(max(groups[g][0], 0), groups[g][1] + 1)
                 if i in want and out[i] is None] for g in todo]
        host = p.host
        strs = p.namespace.keys([hashes[groups[g][1]] for g in todo])
        # Held while room is made and the values read: a write-back making that room never evicts them.
        p.backends.hold(strs)
        slots: list[int] = []
        try:
            slots = self.room.reserve(sum(map(len, need))) if host is not None else []
            reads = self._read(todo, need, strs, slots, where)
        except BaseException:
            self.room.release(slots)  # never left WRITING
            raise
        finally:
            p.backends.release(strs)
        rows, slot_of, src = reads.rows, reads.slot_of, reads.src
        unused = [slot_of[(j, off)] for j, blocks in enumerate(need) for _, off in blocks
                  if src[j] < 0 and (j, off) in slot_of]
        with planner.lock:
            for j, g in enumerate(todo):
                first, last = groups[g]
                if src[j] >= 0:
                    for i in range(max(first, 0), last + 1):
                        planner.mark_read_locked(hashes[i], src[j])
                else:
                    planner.mark_missing_locked(hashes[last], where[g])  # read and not there: a stale hint
            n_host = 0
            for j, blocks in enumerate(need):
                if src[j] < 0:
                    continue
                for i, off in blocks:
                    slot = slot_of.get((j, off))
                    if slot is not None:
                        out[i] = Step(Source.HOST, planner.commit_host_locked(hashes[i], slot), src[j])
                        n_host += 1
                    elif allow_tmp:
                        out[i] = Step(Source.TMP, torch.from_numpy(rows[j][off]), src[j])
            for j, g in enumerate(todo):
                first, last = groups[g]
                if src[j] >= 0 and first >= 0:
                    planner.remember_group_locked(tuple(hashes[first:last + 1]))
        self.room.release(unused)
        p.metrics.add("host", bytes_in=n_host * nb)
        return out

    def _read(self, todo: list[int], need: list[list[tuple[int, int]]], strs: list[str], slots: list[int],
              where: Sequence[int]) -> _Reads:
        """Read values ``todo`` (``need[j]``: value j's wanted blocks, as (position, offset)), each block
        into its reserved slot (``slots`` in ``need`` order while they last) or a temporary row."""
        k, nb, host = self.k, self.parts.layout.block_nbytes, self.parts.host
        rows: list[list[Any]] = []
        slot_of: dict[tuple[int, int], int] = {}
        it = iter(slots)
        n_tmp = 0
        for j, blocks in enumerate(need):
            row: list[Any] = [None] * k
            for _, off in blocks:
                slot = next(it, None)
                if slot is not None and host is not None:
                    slot_of[(j, off)] = slot
                    row[off] = host.slot_view(slot)
            n_tmp += row.count(None)
            rows.append(row)
        tmp = torch.empty((n_tmp, nb), dtype=torch.uint8).numpy()
        t = 0
        for row in rows:
            for off in range(k):
                if row[off] is None:
                    row[off] = tmp[t]
                    t += 1
        src = [-1] * len(todo)
        for b in sorted({where[g] for g in todo}):
            self._get(b, [j for j, g in enumerate(todo) if where[g] == b], strs, rows, need, src)
        for b in range(len(self.parts.backends)):
            self._get(b, [j for j, g in enumerate(todo) if src[j] < 0 and where[g] != b], strs, rows, need, src)
        return _Reads(rows, slot_of, src)

    def _get(self, b: int, want: list[int], strs: list[str], rows: list[list[Any]],
             need: list[list[tuple[int, int]]], src: list[int]) -> None:
        """Read values ``want`` from backend ``b`` into their blocks' rows (as segments when ``b`` reads
        them, else through one buffer per value, whose wanted blocks alone are copied to their rows once
        verified)."""
        if not want:
            return
        sb = self.parts.backends
        if sb.reads_segments[b]:
            bufs: list[Any] = [Segments([memoryview(r) for r in rows[j]]) for j in want]
            ok = sb.get_into(b, [strs[j] for j in want], bufs)
        else:
            nb = self.parts.layout.block_nbytes
            whole = torch.empty((len(want), self.k * nb), dtype=torch.uint8).numpy()
            ok = sb.get_into(b, [strs[j] for j in want], list(whole))
            for n, (j, good) in enumerate(zip(want, ok)):
                if good:
                    for _, off in need[j]:
                        rows[j][off][:] = whole[n, off * nb:(off + 1) * nb]
        for j, good in zip(want, ok):
            if good:
                src[j] = b


__all__ = ["Grouped"]
