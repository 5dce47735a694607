"""Stored values of several engine blocks (``storage.block_tokens``; see :mod:`kvtier.groups`): reading a
value into the host slots of its blocks, and writing whole groups from host memory or the device.

Invariants (beside the stack's):
* a value is written only when every one of its blocks is in hand (committed in host memory, or read
  from the device in the same store), and under its last block's key; a partial group is never written;
* a value read from a backend is verified as a whole (one header, one checksum) before any of its blocks
  becomes visible in host memory;
* the blocks of a value being written are in ``_writing`` for the whole put, which keeps eviction away (no
  index reference: a copy down is not a use);
* a block in host memory that belongs to a whole group known to the stack (stored or fetched as one) is
  found in ``TierStack._members``, so a write of any of its blocks (write-back on eviction, a selective
  write on a hit) writes the whole group; a group no longer whole in host memory is not written.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._load_plan import Source, Step
from .blockformat import Segments
from .groups import group_of

if TYPE_CHECKING:
    from .stack import TierStack

log = logging.getLogger("kvtier.stack")

Group = tuple[int, int]  # (first, last) indices into a chain slice; first may be < 0


@dataclass(frozen=True)
class _Reads:
    """What :meth:`Grouped._read` brought up for the values it was given (value ``j`` = ``todo[j]``)."""

    rows: list[list[Any]]                # per value, a numpy uint8 row per block (a host slot or a temporary)
    slot_of: dict[tuple[int, int], int]  # (value, block offset) -> the host slot it was read into
    src: list[int]                       # per value, the backend it came from (-1: from none)


@dataclass(frozen=True)
class _Claim:
    """A group claimed for writing (:meth:`Grouped._claim_locked`)."""

    members: tuple[bytes, ...]   # its blocks' keys, in chain order
    slots: list[int]             # their host slots
    targets: list[int]           # the writable backends lacking it
    added: list[bytes]           # the blocks this claim put in ``_writing`` (released by it alone)


class Grouped:
    """The grouped halves of fetch and write-down for one stack."""

    def __init__(self, stack: TierStack):
        self.s = stack
        self.k = stack.storage_blocks

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
        return self.s._backends.locate(self.s.namespace.keys([hashes[last] for _, last in groups]))

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
        s, nb = self.s, self.s.layout.block_nbytes
        out: dict[int, Step | None] = {}
        todo: list[int] = []  # indices into groups still to read
        with s._lock:
            for g, (first, last) in enumerate(groups[:len(where)]):
                members = [i for i in range(max(first, 0), last + 1) if i in want]
                for i in members:
                    slot = s.index.host_slot(hashes[i])
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
        host = s.host
        strs = s.namespace.keys([hashes[groups[g][1]] for g in todo])
        # Held while room is made and the values read: a write-back making that room never evicts them.
        s._backends.hold(strs)
        slots: list[int] = []
        try:
            slots = s.room.reserve(sum(map(len, need))) if host is not None else []
            reads = self._read(todo, need, strs, slots, where)
        except BaseException:
            s.room.release(slots)  # never left WRITING
            raise
        finally:
            s._backends.release(strs)
        rows, slot_of, src = reads.rows, reads.slot_of, reads.src
        unused = [slot_of[(j, off)] for j, blocks in enumerate(need) for _, off in blocks
                  if src[j] < 0 and (j, off) in slot_of]
        with s._lock:
            for j, g in enumerate(todo):
                first, last = groups[g]
                known = [hashes[i] for i in range(max(first, 0), last + 1)]
                if src[j] >= 0:
                    for key in known:
                        if key in s.index:
                            s.index.add_backend(key, src[j])
                elif hashes[last] in s.index:
                    s.index.remove_backend(hashes[last], where[g])  # read and not there: a stale hint
            n_host = 0
            for j, blocks in enumerate(need):
                if src[j] < 0:
                    continue
                for i, off in blocks:
                    slot = slot_of.get((j, off))
                    if slot is not None:
                        out[i] = Step(Source.HOST, s._commit_host_locked(hashes[i], slot), src[j])
                        n_host += 1
                    elif allow_tmp:
                        out[i] = Step(Source.TMP, torch.from_numpy(rows[j][off]), src[j])
            for j, g in enumerate(todo):
                first, last = groups[g]
                if src[j] >= 0 and first >= 0:
                    self.remember(tuple(hashes[first:last + 1]))
        s.room.release(unused)
        s.metrics.add("host", bytes_in=n_host * nb)
        return out

    def _read(self, todo: list[int], need: list[list[tuple[int, int]]], strs: list[str], slots: list[int],
              where: Sequence[int]) -> _Reads:
        """Read values ``todo`` (``need[j]``: value j's wanted blocks, as (position, offset)), each block
        into its reserved slot (``slots`` in ``need`` order while they last) or a temporary row."""
        s, k, nb, host = self.s, self.k, self.s.layout.block_nbytes, self.s.host
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
        for b in range(len(s._backends)):
            self._get(b, [j for j, g in enumerate(todo) if src[j] < 0 and where[g] != b], strs, rows, need, src)
        return _Reads(rows, slot_of, src)

    def _get(self, b: int, want: list[int], strs: list[str], rows: list[list[Any]],
             need: list[list[tuple[int, int]]], src: list[int]) -> None:
        """Read values ``want`` from backend ``b`` into their blocks' rows (as segments when ``b`` reads
        them, else through one buffer per value, whose wanted blocks alone are copied to their rows once
        verified)."""
        if not want:
            return
        sb = self.s._backends
        if sb.reads_segments[b]:
            bufs: list[Any] = [Segments([memoryview(r) for r in rows[j]]) for j in want]
            ok = sb.get_into(b, [strs[j] for j in want], bufs)
        else:
            nb = self.s.layout.block_nbytes
            whole = torch.empty((len(want), self.k * nb), dtype=torch.uint8).numpy()
            ok = sb.get_into(b, [strs[j] for j in want], list(whole))
            for n, (j, good) in enumerate(zip(want, ok)):
                if good:
                    for _, off in need[j]:
                        rows[j][off][:] = whole[n, off * nb:(off + 1) * nb]
        for j, good in zip(want, ok):
            if good:
                src[j] = b

    # ------------------------------------------------------------------ the way down

    def remember(self, members: tuple[bytes, ...]) -> None:
        """Record a whole group (its blocks' keys in chain order) for the blocks of it in host memory, so a
        later write of one of them (write-back on eviction, a selective write on a hit) writes the group.
        Call with the stack's lock held.  Entries leave with their block's host copy (``forget``)."""
        s = self.s
        for key in members:
            if s.index.host_slot(key) is not None:
                s._members[key] = members

    def forget(self, key: bytes) -> None:
        """``key`` left host memory (lock held)."""
        self.s._members.pop(key, None)

    def group_of(self, key: bytes) -> tuple[bytes, ...] | None:
        """The whole group of a host block, if known and every block of it is in host memory (lock held)."""
        s = self.s
        members = s._members.get(key)
        if members is None or any(s.index.host_slot(m) is None for m in members):
            return None
        return members

    def _claim_locked(self, groups: Sequence[tuple[bytes, ...]],
                      mine: frozenset[bytes] = frozenset()) -> list[_Claim]:
        """Claim each group that is whole in host memory, not being written, and missing from a writable
        backend: its blocks go into ``_writing`` (so none is evicted while the group is written);
        ``mine``: blocks the caller already holds for writing (a write-back victim)."""
        s = self.s
        todo: list[_Claim] = []
        for members in dict.fromkeys(groups):
            slots = [s.index.host_slot(key) for key in members]
            if any(slot is None for slot in slots) or any(k in s._writing and k not in mine for k in members):
                continue
            have = [int(slot) for slot in slots if slot is not None]
            targets = [b for b in s._backends.writable if not s.index.in_backends(members[-1], (b,))]
            if not targets:
                continue
            added = [k for k in members if k not in s._writing]
            s._writing.update(added)
            todo.append(_Claim(members, have, targets, added))
        return todo

    def write_from_host(self, groups: Sequence[tuple[bytes, ...]]) -> None:
        """Write each group (its blocks' keys, in chain order) whose blocks are all in host memory to the
        writable backends that lack it, asynchronously (the stack's write pool)."""
        s = self.s
        with s._lock:
            todo = self._claim_locked(groups)
            if not todo:
                return
            s._pending.add()
        if not s._submit(s._io, self._write_job, todo):
            self._release(todo)
            s._pending.done()

    def write_now(self, groups: Sequence[tuple[bytes, ...]], mine: frozenset[bytes]) -> set[bytes]:
        """Write groups in this thread (a write-back makes room); the last keys of those a backend took."""
        with self.s._lock:
            todo = self._claim_locked(groups, mine)
        try:
            return self._put(todo)
        finally:
            self._release(todo)

    def _write_job(self, todo: list[_Claim]) -> None:
        try:
            self._put(todo)
        finally:
            self._release(todo)
            self.s._pending.done()

    def _put(self, todo: list[_Claim]) -> set[bytes]:
        s = self.s
        written: set[bytes] = set()
        for b in s._backends.writable:
            part = [c for c in todo if b in c.targets]
            if not part:
                continue
            host = s.host_tier()
            payloads = [np.concatenate([host.slot_view(slot) for slot in c.slots]) for c in part]
            ok = s._down.put_values(b, [c.members for c in part], payloads)
            s.metrics.add("host", bytes_out=sum(ok) * self.k * s.layout.block_nbytes)
            written.update(c.members[-1] for c, good in zip(part, ok) if good)
        return written

    def _release(self, todo: list[_Claim]) -> None:
        s = self.s
        with s._lock:
            for c in todo:
                s._writing.difference_update(c.added)


__all__ = ["Grouped"]
