"""The way down: device -> host (store), host -> backends (write-down, write-back), and making room.

Invariants:
* a block is evicted from host memory only when no transfer or I/O uses it: it has no index reference
  (loads, prefetches, stores, write-back) and no copy down in flight (``_writing``).  Those two are the
  only pins: the host slab keeps slot states, no pin count of its own;
* with a write policy that wants it (write-back), an evicted block is first copied to the writable
  backends and its slot is freed only if a backend took it and nobody referenced it meanwhile; otherwise it
  stays, and whatever needed the slot is skipped and counted.  At most ``max_unwritten`` blocks wait
  in host memory on a write-back that failed (gauge ``host_unwritten_blocks``); beyond that the next
  such victim is evicted unwritten (counter ``dropped``), so a backend that refuses every write cannot
  fill host memory for good.  Never a wait without a bound;
* a block is in at most one write-down at a time (``_writing``) and in at most one store (``_storing``);
* backend I/O and copies run outside the stack's lock.
"""

from __future__ import annotations

import logging
from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ._stack_results import FAILED, PRESENT, SKIPPED, STORED, StoreHandle, StoreResult, StoreStatus
from .groups import whole_groups
from .index import Tier

if TYPE_CHECKING:
    from .stack import TierStack
    from .transfer import TransferResult

log = logging.getLogger("kvtier.stack")

# (key, host slot, backend indices to write): a block held for a copy down (in ``_writing``).
Victim = tuple[bytes, int, list[int]]


class HostRoom:
    """Host slots for blocks coming into host memory: free slots first, then the eviction policy's
    victims.  ``take_locked`` never does I/O; victims that must be written back first are returned
    held (an index reference, ``_writing``), and ``write_back`` turns them into slots."""

    def __init__(self, stack: TierStack):
        self.s = stack

    def take_locked(self, n: int) -> tuple[list[int], list[Victim]]:
        """Up to ``n`` WRITING slots without I/O, plus the victims to write back (held) for the rest."""
        s, host = self.s, self.s.host_tier()
        slots = host.allocate(min(n, host.num_free)).slots if n > 0 else []
        need, dropped, wb = n - len(slots), 0, []
        if need > 0:
            s.manager.fold_evictions_locked()  # a write-back must not skip a backend that evicted the block
        seen: set[bytes] = set()
        while need > 0:
            fresh = [k for k in s.eviction_policy.victims(s.index, Tier.HOST, need + len(seen)) if k not in seen]
            if not fresh:
                break
            for key in fresh:
                seen.add(key)
                e = s.index.get(key)
                if need == 0 or e is None or e.host is None or e.refs or key in s._writing:
                    continue  # only unpinned host blocks with no copy down in flight are evictable
                targets = [i for i in s._backends.writable if i not in e.backends]
                if targets and s.storage_blocks > 1 and s._grouped.group_of(key) is None:
                    targets = []  # a block of a group no longer whole in host memory cannot be written
                if targets and key in s._unwritten and len(s._unwritten) > s.max_unwritten:
                    # Its write-back already failed and too many blocks wait on failing writes: evict it
                    # unwritten (a future miss) rather than let a refusing backend hold host memory.
                    s._drop_host_locked(key)
                    s.metrics.add("host", dropped=1)
                    dropped += 1
                elif targets and s.write_policy.on_evict(key):
                    s.index.acquire(key)
                    s._writing.add(key)
                    wb.append((key, e.host, targets))
                else:
                    s._drop_host_locked(key)
                    dropped += 1
                need -= 1
        if dropped:
            slots += host.allocate(dropped).slots
        return slots, wb

    def write_back(self, victims: Sequence[Victim]) -> list[int]:
        """Copy victims down (no lock held), then free those a backend took and nobody referenced meanwhile;
        returns as many WRITING slots as were freed."""
        if not victims:
            return []
        s = self.s
        written = s._down.copy_down(victims)
        freed = 0
        with s._lock:
            for key, slot, _ in victims:
                s._writing.discard(key)
                s.index.unpin(key)
                e = s.index.get(key)
                if written.get(key):
                    s._unwritten.pop(key, None)
                elif e is not None and e.host == slot:
                    s._unwritten[key] = None  # still dirty in host memory: counts against the bound
                if written.get(key) and e is not None and e.refs == 0 and e.host == slot:
                    s._drop_host_locked(key)
                    freed += 1
                else:
                    s.index.discard_if_unused(key)
            return s.host_tier().allocate(freed).slots if freed else []

    def reserve(self, n: int) -> list[int]:
        """Up to ``n`` WRITING slots, writing victims back when the policy says (call without the lock,
        from a worker: it may do backend I/O)."""
        s = self.s
        with s._lock:
            slots, wb = self.take_locked(n)
        return slots + self.write_back(wb)

    def release(self, slots: Sequence[int]) -> None:
        """Give back WRITING slots that were not used."""
        if slots:
            self.s.host_tier().free(list(slots))


class Downward:
    """``store`` and the write-down of host blocks to the backends."""

    def __init__(self, stack: TierStack):
        self.s = stack

    # ------------------------------------------------------------------ store

    def store(self, hashes: list[bytes], ids: np.ndarray, start: int = 0) -> StoreHandle:
        s = self.s
        n = len(hashes)
        handle = StoreHandle(n)
        status = [SKIPPED] * n
        new: list[int] = []
        hits: list[bytes] = []
        seen: set[bytes] = set()
        slots: list[int] = []
        wb: list[Victim] = []
        with s._lock:
            # Placing a block, or pinning one, changes no later block's host slot or backend marks: the
            # steps run over the batch (the simulator's store makes the same calls).
            idx, writable, storing = s.index, s._backends.writable, s._storing
            idx.place_on_device_many(hashes, ids.tolist())
            if s.host:
                held = [h >= 0 for h in idx.host_slots(hashes)]
            else:
                held = [bool(writable) and idx.in_backends(key, writable) for key in hashes]
            for i, key in enumerate(hashes):
                if key in seen or key in storing or held[i]:
                    status[i] = PRESENT
                    if key not in seen and s.write_policy.on_hit(key, s._hit_locked(key)):
                        hits.append(key)
                    seen.add(key)
                    continue
                seen.add(key)
                new.append(i)
                storing.add(key)
            idx.acquire_many([hashes[i] for i in new])
            if s.host is not None and new:
                slots, wb = s.room.take_locked(len(new))
            s._pending.add()
        if hits:
            self.write_down(hits)
        if not new:
            self._finish(handle, status)
        elif s.host is None:
            self._store_direct(handle, hashes, ids, new, status, start)
        elif wb:
            # Write-back victims must reach a backend before their slots take new blocks: that I/O runs
            # in a worker, which then issues the copy after the work queued so far on this stream.
            ev = None
            if s.device.is_cuda:
                ev = torch.cuda.Event()
                ev.record(torch.cuda.current_stream(s.device.device))
            if not s._submit(s._io, self._store_deferred, handle, hashes, ids, new, status, slots, wb, ev, start):
                self._abandon(handle, hashes, new, status, slots, wb)
        else:
            self._store_submit(handle, hashes, ids, new, status, slots, start)
        return handle

    def _store_deferred(self, handle: StoreHandle, hashes: list[bytes], ids: np.ndarray, new: list[int],
                        status: list[StoreStatus], slots: list[int], wb: list[Victim], ev: Any, start: int) -> None:
        try:
            more = self.s.room.write_back(wb)
            if ev is not None:
                torch.cuda.current_stream(self.s.device.device).wait_event(ev)
        except Exception:  # noqa: BLE001 - the store is skipped, never lost track of
            log.exception("store: write-back failed")
            self._abandon(handle, hashes, new, status, slots, [])
            return
        self._store_submit(handle, hashes, ids, new, status, slots + more, start)

    def _store_submit(self, handle: StoreHandle, hashes: list[bytes], ids: np.ndarray, new: list[int],
                      status: list[StoreStatus], slots: list[int], start: int = 0) -> None:
        s = self.s
        take, skip = new[:len(slots)], new[len(slots):]  # the chain's head gets the room
        if skip:
            s.metrics.add("host", stores_skipped=len(skip))
            self._release_keys([hashes[i] for i in skip])
        if not take:
            self._finish(handle, status)
            return
        keys = [hashes[i] for i in take]
        try:
            xh = s.transfers().store(ids[take], slots, keys=keys)
        except Exception as e:  # noqa: BLE001 - e.g. the transfer engine is closed
            log.warning("store: transfer not submitted: %s", e)
            s.room.release(slots)
            for i in take:
                status[i] = FAILED
            self._release_keys(keys)
            self._finish(handle, status)
            return
        xh.add_done_callback(lambda r: self._on_stored(handle, r, take, keys, status, hashes, start))

    def _on_stored(self, handle: StoreHandle, r: TransferResult, take: list[int], keys: list[bytes],
                   status: list[StoreStatus], hashes: Sequence[bytes] = (), start: int = 0) -> None:
        s = self.s
        down: list[bytes] = []
        try:
            with s._lock:
                for i, key, slot, ok in zip(take, keys, r.slots, r.ok):
                    s._storing.discard(key)
                    if ok:
                        if s._commit_host_locked(key, slot) == slot:
                            status[i] = STORED
                            if s.write_policy.on_store(key):
                                down.append(key)
                        else:
                            status[i] = PRESENT
                    else:
                        status[i] = FAILED
                    s.index.release(key)
            s.metrics.add("device", bytes_out=r.nbytes)
            s.metrics.add("host", bytes_in=r.nbytes, failures=int(not r.all_ok))
            s.metrics.observe("host", "write", r.seconds)
            if s.storage_blocks > 1:
                # Values of several blocks: the store's whole groups are remembered (a later write of one
                # of their blocks writes the group), and those holding a block the write policy sends
                # down now are written (their blocks are in host memory, stored here or before).
                groups = [tuple(hashes[a:b + 1]) for a, b in whole_groups(start, len(hashes), s.storage_blocks)]
                sent = set(down)
                with s._lock:
                    for g in groups:
                        s._grouped.remember(g)
                s._grouped.write_from_host([g for g in groups if sent.intersection(g)])
            elif down:
                self.write_down(down)
        finally:
            self._finish(handle, status)

    def _store_direct(self, handle: StoreHandle, hashes: list[bytes], ids: np.ndarray, new: list[int],
                      status: list[StoreStatus], start: int) -> None:
        """No host tier: copy the stored values' blocks out of the device now (this thread, so the copy is
        ordered after the engine's work), then write them to the writable backends in a worker.  With
        values of several blocks, a value is a whole group of the store holding a new block; a new block
        in no whole group is skipped (a partial group is never stored)."""
        s = self.s
        fresh = set(new)
        spans = [(a, b) for a, b in whole_groups(start, len(hashes), s.storage_blocks)
                 if not fresh.isdisjoint(range(a, b + 1))]
        keys = [hashes[i] for i in new]
        if not spans:
            self._release_keys(keys)
            self._finish(handle, status)
            return
        try:
            rows = s.device.read_blocks(np.concatenate([ids[a:b + 1] for a, b in spans]))
        except Exception as e:  # noqa: BLE001
            log.warning("store: device read failed: %s", e)
            s.metrics.add("device", failures=1)
            for i in new:
                status[i] = FAILED
            self._release_keys(keys)
            self._finish(handle, status)
            return
        s.metrics.add("device", bytes_out=rows.numel())
        rows = rows.view(len(spans), -1)

        def write() -> None:
            try:
                took = self.put_rows([tuple(hashes[a:b + 1]) for a, b in spans], rows)
                for (a, b), ok in zip(spans, took):
                    for i in range(a, b + 1):
                        if i in fresh:
                            status[i] = STORED if ok else SKIPPED
            finally:
                self._release_keys(keys)
                self._finish(handle, status)

        if not s._submit(s._io, write):
            self._release_keys(keys)
            self._finish(handle, status)

    def put_rows(self, values: Sequence[tuple[bytes, ...]], rows: torch.Tensor) -> list[bool]:
        """Write stored values whose payloads are ``rows`` (``[values, bytes]``, read from the device) to
        every writable backend; each value is the blocks it holds, stored under the last one's key, and
        all of them are marked where a backend took it.  Per value whether one did."""
        views = [rows[j].numpy() for j in range(len(values))]
        took = [False] * len(values)
        for b in self.s._backends.writable:
            took = [t or good for t, good in zip(took, self.put_values(b, values, views))]
        return took

    def put_values(self, b: int, values: Sequence[tuple[bytes, ...]], payloads: Sequence[Any]) -> list[bool]:
        """Put stored values into backend ``b`` (each under its last block's key) and mark every block of
        the values it took as stored there; per value whether it did.  Every write to a backend goes
        through here (no lock held during the I/O)."""
        s = self.s
        lasts = [v[-1] for v in values]
        with s._lock:
            s.manager.begin_writes_locked(b, lasts)
        ok = s._backends.put(b, s.namespace.keys(lasts), payloads)  # never raises: a fault is all False
        with s._lock:
            evicted = s.manager.end_writes_locked(b, lasts)
            report = s._report
            writable = s._backends.writable
            for members, good in zip(values, ok):
                if good and members[-1] not in evicted:  # a value evicted during its own write is not there
                    for key in members:
                        if key in s.index:
                            s.index.add_backend(key, b)
                            if key in s._owed and s.index.in_backends(key, writable):
                                del s._owed[key]
                        if report is not None:  # a manager elsewhere learns it without asking the backend
                            report.in_backend.add((key, b))
                            report.left_backend.discard((key, b))
        return ok

    def _abandon(self, handle: StoreHandle, hashes: list[bytes], new: list[int], status: list[StoreStatus],
                 slots: list[int], wb: list[Victim]) -> None:
        s = self.s
        s.room.release(slots)
        if wb:
            with s._lock:
                for key, _, _ in wb:
                    s._writing.discard(key)
                    s.index.release(key)
        s.metrics.add("host", stores_skipped=len(new))
        self._release_keys([hashes[i] for i in new])
        self._finish(handle, status)

    def _release_keys(self, keys: Sequence[bytes]) -> None:
        s = self.s
        with s._lock:
            for key in keys:
                s._storing.discard(key)
                s.index.release(key)

    def _finish(self, handle: StoreHandle, status: list[StoreStatus]) -> None:
        if handle._finish(StoreResult(tuple(status))):
            self.s._pending.done()

    # ------------------------------------------------------------------ write-down

    def write_down(self, keys: Sequence[bytes]) -> None:
        """Asynchronously copy host blocks to every writable backend that lacks them (blocks already
        there, not in host, or already being written are left alone)."""
        s = self.s
        if s.storage_blocks > 1:
            with s._lock:  # values of several blocks: the whole groups these blocks are in
                groups = [g for g in map(s._grouped.group_of, dict.fromkeys(keys)) if g is not None]
                s._owed.update((k, None) for g in groups for k in g if s.index.host_slot(k) is not None
                               and not s.index.in_backends(k, s._backends.writable))
            s._grouped.write_from_host(groups)
            return
        todo: list[Victim] = []
        with s._lock:
            s.manager.fold_evictions_locked()  # a block a backend evicted is written to it again
            for key in dict.fromkeys(keys):
                e = s.index.get(key)
                if e is None or e.host is None:
                    continue
                targets = [i for i in s._backends.writable if i not in e.backends]
                if targets:
                    s._owed[key] = None  # until every writable backend took it (put_values)
                if key in s._writing:
                    continue
                # No index reference: a copy down is not a use and must not change the block's recency
                # (an index reference takes it off the LRU list); ``_writing`` keeps eviction away.
                if not targets:
                    continue
                s._writing.add(key)
                todo.append((key, e.host, targets))
            if not todo:
                return
            s._pending.add()
        if not s._submit(s._io, self._write_down_job, todo):
            self._write_down_done(todo)

    def _write_down_job(self, todo: list[Victim]) -> None:
        try:
            self.copy_down(todo)
        finally:
            self._write_down_done(todo)

    def _write_down_done(self, todo: list[Victim]) -> None:
        s = self.s
        with s._lock:
            for key, _, _ in todo:
                s._writing.discard(key)
        s._pending.done()

    def copy_down(self, todo: Sequence[Victim]) -> dict[bytes, bool]:
        """Write held host blocks to their target backends (no lock held during I/O); record which
        backends took them.  Returns {key: taken by at least one backend}.  With values of several
        blocks, each block's whole group is written instead."""
        s = self.s
        if s.storage_blocks > 1:
            with s._lock:
                groups = {key: s._grouped.group_of(key) for key, _, _ in todo}
            written = s._grouped.write_now([g for g in groups.values() if g is not None],
                                           frozenset(key for key, _, _ in todo))
            return {key: g is not None and g[-1] in written for key, g in groups.items()}
        taken = {key: False for key, _, _ in todo}
        for b in s._backends.writable:
            part = [(key, slot) for key, slot, targets in todo if b in targets]
            if not part:
                continue
            host = s.host_tier()
            ok = self.put_values(b, [(key,) for key, _ in part], [host.slot_view(slot) for _, slot in part])
            s.metrics.add("host", bytes_out=sum(ok) * s.layout.block_nbytes)
            for (key, _), good in zip(part, ok):
                taken[key] = taken[key] or good
            with s._lock:
                s._trim_index_locked()
        return taken
