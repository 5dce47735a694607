"""Writes to backends: every put of a stored value goes through :class:`BackendWriter`, whatever the value's
size (one engine block, or a group of ``storage.block_tokens`` blocks): a copy down from host memory (a
write-back making room, the write policy's write-down), a store written straight from the device.

Invariants:
* the planner hears of every put before it starts and after it returns (``begin_put_locked`` /
  ``put_done_locked``), so a value the backend evicted during its own write is never marked there, and a
  value a backend took is marked for each of its blocks;
* no payload is copied here: a group from host memory goes down as its slots' views (``Segments``), a
  value from the device as its row of the one buffer the device read filled;
* a value is written from host memory only whole (every block of it claimed by
  ``claim_groups_locked``, and so kept from eviction, for the whole put; released exactly once), under its
  last block's key;
* no lock is held during the I/O; a backend fault is a refused value (``BackendSet.put`` never raises);
* a value is charged to the ``cache_salt`` tenant its store named (``ValueWrites.tenants``, the planner's
  record of its last block), whenever it is written, so a tenant's quota counts it (``kvtier.quota``).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from ..format.blockformat import Segments
from .parts import StackParts
from .planner import ValueWrites


class BackendWriter:
    """Puts stored values into backends."""

    def __init__(self, parts: StackParts):
        self.parts = parts

    def put_values(self, b: int, values: Sequence[tuple[bytes, ...]], payloads: Sequence[Any],
                   tenants: Sequence[str | None] | None = None, *, owed: bool = False) -> list[bool]:
        """Put stored values into backend ``b`` (each under its last block's key) and mark every block of
        the values it took as stored there; per value whether it did.  ``tenants``: per value the tenant tag
        its quota is charged to (None: the namespace's).  ``owed``: the write policy sent them down, so
        those refused are written again when the backend is back (``Planner.put_done_locked``)."""
        p, planner = self.parts, self.parts.planner
        with planner.lock:
            ticket = planner.begin_put_locked(b)
        ok = p.backends.put(b, p.namespace.keys([v[-1] for v in values]), payloads, tenants)  # a fault: all False
        with planner.lock:
            planner.put_done_locked(b, ticket, values, ok, owed=owed)
        return ok

    def put_rows(self, values: Sequence[tuple[bytes, ...]], rows: torch.Tensor,
                 tenant: str | None = None) -> list[bool]:
        """Write stored values whose payloads are ``rows`` (``[values, bytes]``, read from the device) to
        every writable backend, charged to ``tenant`` (a store's); per value whether one took it."""
        views = [rows[j].numpy() for j in range(len(values))]
        took = [False] * len(values)
        tenants = None if tenant is None else [tenant] * len(values)
        for b in self.parts.backends.writable:
            took = [t or good for t, good in zip(took, self.put_values(b, values, views, tenants))]
        return took

    # ------------------------------------------------------------------ from host memory

    def write_down(self, keys: Sequence[bytes]) -> None:
        """The write policy sends host blocks ``keys`` down: write their values (each whole in host memory)
        to the writable backends that lack them, asynchronously (the stack's write pool)."""
        planner = self.parts.planner
        with planner.lock:
            todo = planner.claim_to_write_locked(keys)
            if not todo:
                return
            self.parts.workers.pending.add()
        self._submit(todo)

    def write_claimed(self, todo: ValueWrites) -> None:
        """Write values already claimed for writing down (``Planner.land_store_locked``) the same way,
        counted pending from now (the caller's own operation still is)."""
        if todo:
            self.parts.workers.pending.add()
            self._submit(todo)

    def _submit(self, todo: ValueWrites) -> None:
        workers = self.parts.workers
        if not workers.submit(workers.io, self._write_job, todo):
            self.parts.planner.release_groups(todo)
            workers.pending.done()

    def write_now(self, values: Sequence[tuple[bytes, ...]], mine: frozenset[bytes]) -> set[bytes]:
        """Write values in this thread (a write-back makes room; ``mine``: the victims the caller holds);
        the last keys of those a backend took."""
        planner = self.parts.planner
        with planner.lock:
            todo = planner.claim_groups_locked(values, mine)
        try:
            return self._put(todo)
        finally:
            planner.release_groups(todo)

    def _write_job(self, todo: ValueWrites) -> None:
        try:
            self._put(todo, owed=True)
        finally:
            self.parts.planner.release_groups(todo)
            self.parts.workers.pending.done()

    def _put(self, todo: ValueWrites, owed: bool = False) -> set[bytes]:
        p = self.parts
        written: set[bytes] = set()
        for b in p.backends.writable:
            part = todo.to(b)
            if not part:
                continue
            host = p.host_tier()
            members = [todo.members[j] for j in part]
            # A one-block value is its slot's bytes as they are (no copy).  A group's blocks sit in slots
            # that need not be adjacent: its payload is their views as segments, in chain order, which
            # a backend that writes segments stores with no joined copy (the base class joins them,
            # once, for one that does not: StorageBackend.put).
            payloads = [host.slot_view(slots[0]) if len(slots) == 1 else Segments(host.slot_views(slots))
                        for slots in (todo.slots[j] for j in part)]
            ok = self.put_values(b, members, payloads, [todo.tenants[j] for j in part], owed=owed)
            p.metrics.add("host", bytes_out=sum(len(m) for m, good in zip(members, ok) if good)
                          * p.layout.block_nbytes)
            written.update(m[-1] for m, good in zip(members, ok) if good)
        return written


__all__ = ["BackendWriter"]
