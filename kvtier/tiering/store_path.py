"""The way down, executed: device -> host (store), host -> backends (write-down, write-back), making room.

What to do is the planner's (:class:`~kvtier.tiering.planner.Planner`: which slots, which victims, what goes
down where); this module runs it against the device, host memory and the backends and reports back.

Invariants:
* every block the planner hands out held (a store's new blocks, a write-back victim, a value claimed for a
  copy down) is handed back exactly once, whatever fails: ``land_store_locked`` / ``end_stores``,
  ``written_back_locked`` / ``abandon_victims``, ``release_groups`` (:mod:`~kvtier.tiering.writes`);
* one way down for every stored value, of one block or a group of them: the writer's claimed values.
* a WRITING host slot taken for a store is committed or released, never left WRITING;
* backend I/O and copies run outside the planner's lock; write-back victims reach a backend before their
  slots take new blocks (the copy of a store that needed them is issued after that I/O).
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..format.groups import whole_groups
from ..plans import LeadStore
from .parts import StackParts
from .planner import CopyDown, PlanRefused, StoreStart
from .results import FAILED, PRESENT, SKIPPED, STORED, StoreHandle, StoreResult, StoreStatus
from .writes import BackendWriter

if TYPE_CHECKING:
    from ..memory.transfer import TransferResult

log = logging.getLogger("kvtier.stack")


class HostRoom:
    """Host slots for blocks coming into host memory: the planner's free slots and victims, the victims
    that must be written back first copied down here (outside the lock)."""

    def __init__(self, parts: StackParts, writer: BackendWriter):
        self.parts = parts
        self.writer = writer

    def write_back(self, victims: Sequence[CopyDown]) -> list[int]:
        """Copy victims down (no lock held), then let the planner evict those a backend took and nobody
        referenced meanwhile; returns their own slots, WRITING, handed over to the blocks planned there."""
        if not victims:
            return []
        written = self.copy_down(victims)
        planner = self.parts.planner
        with planner.lock:
            return planner.written_back_locked(victims, written)

    def release(self, slots: list[int]) -> None:
        """Give back WRITING slots that were not used."""
        self.parts.planner.release_slots(slots)

    def copy_down(self, todo: Sequence[CopyDown]) -> dict[bytes, bool]:
        """Write held victims' values to the backends lacking them, in this thread (no lock held during
        I/O).  Returns {key: its value taken by at least one backend}."""
        planner = self.parts.planner
        with planner.lock:
            values = {c.key: planner.group_of_locked(c.key) for c in todo}
        written = self.writer.write_now([v for v in values.values() if v is not None],
                                        frozenset(c.key for c in todo))
        return {key: v is not None and v[-1] in written for key, v in values.items()}


class Downward:
    """``store`` and the write-down of host blocks to the backends."""

    def __init__(self, parts: StackParts, room: HostRoom, writer: BackendWriter):
        self.parts = parts
        self.room = room
        self.writer = writer

    # ------------------------------------------------------------------ store

    def store(self, hashes: list[bytes], ids: np.ndarray, start: int = 0, tenant: str | None = None,
              lead: LeadStore | None = None) -> StoreHandle:
        """Store ``hashes`` from device blocks ``ids``: as this stack's planner plans it, or as ``lead``, a
        plan another planner made over the same blocks, says (:meth:`Planner.adopt_store_locked`)."""
        p, planner, workers = self.parts, self.parts.planner, self.parts.workers
        handle = StoreHandle(len(hashes))
        refused: str | None = None
        with planner.lock:
            try:
                plan = (planner.start_store_locked(hashes, ids.tolist()) if lead is None
                        else planner.adopt_store_locked(hashes, ids.tolist(), lead))
            except PlanRefused as e:
                refused = str(e)
            workers.pending.add()
        if refused is not None and lead is not None:
            # The leader counts these blocks stored only if every side stored them: here none is.
            log.warning("store: the plan for blocks %d-%d is refused here: %s", start, start + len(hashes) - 1,
                        refused)
            p.metrics.add("host", stores_skipped=len(lead.new))
            planned = set(lead.new)
            self._finish(handle, [FAILED if i in planned else PRESENT for i in range(len(hashes))])
            return handle
        status, new = plan.status, plan.new
        if plan.hits:
            self.write_down(plan.hits)
        if not new:
            self._finish(handle, status)
        elif p.host is None:
            self._store_direct(handle, hashes, ids, new, status, start, tenant)
        elif plan.victims:
            # Write-back victims must reach a backend before their slots take new blocks: that I/O runs
            # in a worker, which then issues the copy after the work queued so far on this stream.
            ev = None
            if p.device.is_cuda:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(p.device.device))
            if not workers.submit(workers.io, self._store_deferred, handle, hashes, ids, plan, ev, start, tenant):
                room = plan.host_room()
                self._abandon(handle, hashes, new, status, plan.slots + room.ready_slots(), room.held())
        else:
            self._store_submit(handle, hashes, ids, plan, plan.slots, start, tenant)
        return handle

    def _store_deferred(self, handle: StoreHandle, hashes: list[bytes], ids: np.ndarray, plan: StoreStart,
                        ev: Any, start: int, tenant: str | None = None) -> None:
        try:
            # The victims' own slots, those copied down (and those a follower found gone: Room.ready).
            written = set(self.room.write_back(plan.host_room().held()))
            handed = [v for v in plan.victims if v.key in plan.ready or v.slot in written]
            # What this side handed over, for a leader folding every side's run of its plan.
            plan.handed.extend(v.key for v in handed)
            if ev is not None:
                torch.cuda.current_stream(self.parts.device.device).wait_event(ev)
        except Exception:  # noqa: BLE001 - the store is skipped, never lost track of
            log.exception("store: write-back failed")
            self._abandon(handle, hashes, plan.new, plan.status, plan.slots + plan.host_room().ready_slots(), [])
            return
        self._store_submit(handle, hashes, ids, plan, plan.slots + [v.slot for v in handed], start, tenant)

    def _store_submit(self, handle: StoreHandle, hashes: list[bytes], ids: np.ndarray, plan: StoreStart,
                      slots: list[int], start: int = 0, tenant: str | None = None) -> None:
        """Copy the plan's first new blocks into ``slots`` (its room, less the slots of victims that were
        not copied down: the chain's head gets what there is)."""
        p, new, status = self.parts, plan.new, plan.status
        take, skip = new[:len(slots)], new[len(slots):]  # the chain's head gets the room
        if skip:
            p.metrics.add("host", stores_skipped=len(skip))
            p.planner.end_stores(plan.keys[len(take):])
        if not take:
            self._finish(handle, status, plan.handed)
            return
        keys = plan.keys[:len(take)]
        try:
            xh = p.transfers().store(ids[take], slots, keys=keys)
        except Exception as e:  # noqa: BLE001 - e.g. the transfer engine is closed
            log.warning("store: transfer not submitted: %s", e)
            self.room.release(slots)
            for i in take:
                status[i] = FAILED
            p.planner.end_stores(keys)
            self._finish(handle, status, plan.handed)
            return
        xh.add_done_callback(lambda r: self._on_stored(handle, r, plan, hashes, start, tenant))

    def _on_stored(self, handle: StoreHandle, r: TransferResult, plan: StoreStart, hashes: Sequence[bytes],
                   start: int = 0, tenant: str | None = None) -> None:
        p, planner = self.parts, self.parts.planner
        status = plan.status
        try:
            with planner.lock:
                # Values of several blocks are remembered: a write of one of their blocks (now, or a
                # write-back later) writes the whole value.
                todo = planner.land_store_locked(plan, hashes, start, r.slots, r.ok, tenant)
            p.metrics.add("device", bytes_out=r.nbytes)
            p.metrics.add("host", bytes_in=r.nbytes, failures=int(not r.all_ok))
            p.metrics.observe("host", "write", r.seconds)
            self.writer.write_claimed(todo)
        finally:
            self._finish(handle, status, plan.handed)

    def _store_direct(self, handle: StoreHandle, hashes: list[bytes], ids: np.ndarray, new: list[int],
                      status: list[StoreStatus], start: int, tenant: str | None = None) -> None:
        """No host tier: copy the stored values' blocks out of the device now (this thread, so the copy is
        ordered after the engine's work), then write them to the writable backends in a worker.  With
        values of several blocks, a value is a whole group of the store holding a new block; a new block
        in no whole group is skipped (a partial group is never stored)."""
        p, planner, workers = self.parts, self.parts.planner, self.parts.workers
        fresh = set(new)
        spans = [(a, b) for a, b in whole_groups(start, len(hashes), p.storage_blocks)
                 if not fresh.isdisjoint(range(a, b + 1))]
        keys = [hashes[i] for i in new]
        if not spans:
            planner.end_stores(keys)
            self._finish(handle, status)
            return
        try:
            rows = p.device.read_blocks(np.concatenate([ids[a:b + 1] for a, b in spans]))
        except Exception as e:  # noqa: BLE001
            log.warning("store: device read failed: %s", e)
            p.metrics.add("device", failures=1)
            for i in new:
                status[i] = FAILED
            planner.end_stores(keys)
            self._finish(handle, status)
            return
        p.metrics.add("device", bytes_out=rows.numel())
        rows = rows.view(len(spans), -1)

        def write() -> None:
            try:
                took = self.writer.put_rows([tuple(hashes[a:b + 1]) for a, b in spans], rows, tenant)
                for (a, b), ok in zip(spans, took):
                    for i in range(a, b + 1):
                        if i in fresh:
                            status[i] = STORED if ok else SKIPPED
            finally:
                planner.end_stores(keys)
                self._finish(handle, status)

        if not workers.submit(workers.io, write):
            planner.end_stores(keys)
            self._finish(handle, status)

    def _abandon(self, handle: StoreHandle, hashes: list[bytes], new: list[int], status: list[StoreStatus],
                 slots: list[int], wb: list[CopyDown]) -> None:
        p = self.parts
        self.room.release(slots)
        p.planner.abandon_victims(wb)
        p.metrics.add("host", stores_skipped=len(new))
        p.planner.end_stores([hashes[i] for i in new])
        self._finish(handle, status)

    def _finish(self, handle: StoreHandle, status: list[StoreStatus], handed: Sequence[bytes] = ()) -> None:
        if handle.finish(StoreResult(tuple(status), tuple(handed))):
            self.parts.workers.pending.done()

    # ------------------------------------------------------------------ write-down

    def write_down(self, keys: Sequence[bytes]) -> None:
        """Asynchronously copy the values of host blocks ``keys`` to every writable backend that lacks
        them (values already there, no longer whole in host memory, or already being written are left
        alone)."""
        self.writer.write_down(keys)


__all__ = ["Downward", "HostRoom"]
