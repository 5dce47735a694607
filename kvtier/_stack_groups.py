"""Stored values of several engine blocks (``storage.block_tokens``; see :mod:`kvtier.groups`): reading a
value into the host slots of its blocks, and writing whole groups from host memory or the device.

Invariants (beside the stack's):
* a value is written only when every one of its blocks is in hand (committed in host memory, or read
  from the device in the same store), and under its last block's key; a partial group is never written;
* a value read from a backend is verified as a whole (one header, one checksum) before any of its blocks
  becomes visible in host memory;
* host slots written down are pinned (no index reference: a copy down is not a use) for the whole put.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from .groups import group_of

if TYPE_CHECKING:
    from .stack import TierStack

log = logging.getLogger("kvtier.stack")

HOST, TMP = "host", "tmp"
Group = tuple[int, int]  # (first, last) indices into a chain slice; first may be < 0


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
              allow_tmp: bool) -> dict[int, Any]:
        """Read the first ``len(where)`` groups and place their blocks at positions in ``want`` (pinned
        by the caller): ``{position: (HOST, slot, backend) | (TMP, row, backend) | None}`` as
        ``Upward.fetch`` answers per key."""
        s, k, nb = self.s, self.k, self.s.layout.block_nbytes
        out: dict[int, Any] = {}
        todo: list[int] = []  # indices into groups still to read
        with s._lock:
            for g, (first, last) in enumerate(groups[:len(where)]):
                members = [i for i in range(max(first, 0), last + 1) if i in want]
                for i in members:
                    slot = s.index.host_slot(hashes[i])
                    out[i] = (HOST, slot, None) if slot is not None else None
                if any(out[i] is None for i in members):
                    todo.append(g)
        for first, last in groups[len(where):]:
            for i in range(max(first, 0), last + 1):
                if i in want:
                    out[i] = None
        if not todo:
            return out
        buf = torch.empty((len(todo), k, nb), dtype=torch.uint8)
        views = [buf[j].view(-1).numpy() for j in range(len(todo))]
        strs = s.namespace.keys([hashes[groups[g][1]] for g in todo])
        src = [-1] * len(todo)
        for b in sorted({where[g] for g in todo}):
            self._get(b, [j for j, g in enumerate(todo) if where[g] == b], strs, views, src)
        for b in range(len(s._backends)):
            self._get(b, [j for j, g in enumerate(todo) if src[j] < 0 and where[g] != b], strs, views, src)
        need = [(j, i) for j, g in enumerate(todo) if src[j] >= 0
                for i in range(max(groups[g][0], 0), groups[g][1] + 1) if i in want and out[i] is None]
        slots = s.room.reserve(len(need)) if s.host is not None else []
        for (j, i), slot in zip(need, slots):
            s.host.slot_view(slot)[:] = views[j][(i - groups[todo[j]][0]) * nb:(i - groups[todo[j]][0] + 1) * nb]
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
            for r, (j, i) in enumerate(need):
                if r < len(slots):
                    out[i] = (HOST, s._commit_host_locked(hashes[i], slots[r]), src[j])
                elif allow_tmp:
                    off = i - groups[todo[j]][0]
                    out[i] = (TMP, buf[j, off], src[j])
        s.metrics.add("host", bytes_in=min(len(need), len(slots)) * nb)
        return out

    def _get(self, b: int, want: list[int], strs: list[str], views: list[Any], src: list[int]) -> None:
        if want:
            ok = self.s._backends.get_into(b, [strs[j] for j in want], [views[j] for j in want])
            for j, good in zip(want, ok):
                if good:
                    src[j] = b

    # ------------------------------------------------------------------ the way down

    def write_from_host(self, groups: Sequence[tuple[bytes, ...]]) -> None:
        """Write each group (its blocks' keys, in chain order) whose blocks are all in host memory to the
        writable backends that lack it, asynchronously (the stack's write pool)."""
        s = self.s
        todo: list[tuple[tuple[bytes, ...], list[int], list[int]]] = []
        with s._lock:
            for members in groups:
                slots = [s.index.host_slot(key) for key in members]
                if any(slot is None for slot in slots) or any(key in s._writing for key in members):
                    continue
                have = [int(slot) for slot in slots if slot is not None]
                targets = [b for b in s._backends.writable if not s.index.in_backends(members[-1], (b,))]
                if not targets:
                    continue
                pinned = s.host.pin(have, list(members))
                if not all(pinned):
                    s.host.unpin([slot for slot, ok in zip(have, pinned) if ok])
                    continue
                s._writing.update(members)
                todo.append((members, have, targets))
            if not todo:
                return
            s._pending.add()
        if not s._submit(s._io, self._write_job, todo):
            self._write_done(todo)

    def _write_job(self, todo: list[tuple[tuple[bytes, ...], list[int], list[int]]]) -> None:
        s = self.s
        try:
            for b in s._backends.writable:
                part = [(members, slots) for members, slots, targets in todo if b in targets]
                if not part:
                    continue
                payloads = [np.concatenate([s.host.slot_view(slot) for slot in slots]) for _, slots in part]
                ok = s._backends.put(b, s.namespace.keys([m[-1] for m, _ in part]), payloads)
                s.metrics.add("host", bytes_out=sum(ok) * self.k * s.layout.block_nbytes)
                with s._lock:
                    for (members, _), good in zip(part, ok):
                        if good:
                            for key in members:
                                if key in s.index:
                                    s.index.add_backend(key, b)
        finally:
            self._write_done(todo)

    def _write_done(self, todo: list[tuple[tuple[bytes, ...], list[int], list[int]]]) -> None:
        s = self.s
        with s._lock:
            for members, slots, _ in todo:
                s.host.unpin(slots)
                s._writing.difference_update(members)
        s._pending.done()

    def write_rows(self, groups: Sequence[tuple[bytes, ...]], rows: torch.Tensor) -> list[bool]:
        """No host tier: write groups whose payloads are ``rows`` ([groups, k * block_nbytes], read from
        the device) to every writable backend; per group whether one took it."""
        return self.s._down.put_rows(groups, rows)


__all__ = ["Grouped"]
