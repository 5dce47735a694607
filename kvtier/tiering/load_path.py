"""The way up: backends -> host (fetch, prefetch) and host -> device (load).

Invariants:
* every block a load or prefetch plans to use is pinned from planning until its result is known;
* a block fetched from a backend lands in a host slot that becomes visible (READY, in the index) only
  after the backend verified it; a block that no backend could deliver ends the usable prefix;
* a load reports a block loaded only if all its bytes landed and every block before it did too.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING, Any

import numpy as np
import torch

from ..format.blockformat import Segments
from ..format.groups import load_chunks
from ..index import Tier
from ..memory.transfer import TransferGroup
from ..plans import HostOutcome, LeadLoad
from .load_steps import Source, Step, lost
from .parts import StackParts
from .planner import PlanRefused
from .reads import Direct, Group, ValueReader
from .results import LoadHandle, LoadResult, LookupResult, PrefetchHandle
from .room import Reservation
from .store_path import Downward, HostRoom

if TYPE_CHECKING:
    from ..memory.transfer import TransferHandle, TransferResult

log = logging.getLogger("kvtier.stack")

class Upward:
    """``load``, ``prefetch`` and the backend fetches both use."""

    def __init__(self, parts: StackParts, room: HostRoom, down: Downward, lookup: Callable[..., LookupResult]):
        self.parts = parts
        self.room = room
        self.down = down
        self.reader = ValueReader(parts, room.write_back)  # every backend read, whatever the stored value's size
        self.lookup = lookup  # the stack's lookup (a prefetch without a lookup result asks it)

    # ------------------------------------------------------------------ load

    def load(self, hashes: list[bytes], ids: np.ndarray, layerwise: bool, start: int = 0,
             lead: LeadLoad | None = None) -> LoadHandle:
        """``lead``: the load as a leading planner started it, whose host room this side's reads take."""
        p, planner, workers = self.parts, self.parts.planner, self.parts.workers
        handle = LoadHandle(len(hashes), p.layout.num_layers, layerwise)
        with planner.lock:
            plan = planner.plan_load_locked(hashes, ids.tolist()).steps()  # per block of the planned prefix
        if any(step.source is Source.FETCH for step in plan):
            # A put meanwhile (write-back, another request's store) must not evict what this load reads.
            held = p.namespace.keys(hashes)
            p.backends.hold(held)
            if not workers.submit(workers.reads, self._load_job, handle, hashes, ids, plan, start, held, lead):
                p.backends.release(held)
                self._finish_load(handle, hashes, ids, plan, 0, None, [], ["stack closed"])
        else:
            self._scatter(handle, hashes, ids, plan, len(plan), [])
        return handle

    def _load_job(self, handle: LoadHandle, hashes: list[bytes], ids: np.ndarray, plan: list[Step],
                  start: int = 0, held: Sequence[str] = (), lead: LeadLoad | None = None) -> None:
        """Fetch the backend blocks a chunk at a time and start each chunk's host -> device copy as soon
        as the chunk is in host memory, so copies (transfer workers) overlap the reads (this thread);
        blocks already in host memory start copying before the first read.  ``held``: the keys the
        backends keep for this load (``BackendSet.hold``), released once the reads are done."""
        p = self.parts
        errors: list[str] = []
        copies: list[TransferHandle] = []
        order: list[int] = []  # plan positions, in the order their copies were submitted
        cut = len(plan)
        done = [0]  # plan positions below this are copied (or failed)
        outcome = HostOutcome.nothing()

        def advance() -> None:
            # Copy what is settled: the blocks before the first one still to fetch or failed, so no block
            # after the end of the usable prefix is ever written to the device.
            stop = next((i for i, step in enumerate(plan) if step.source in (Source.FETCH, Source.LOST)),
                        len(plan))
            part = range(done[0], stop)
            self._write_tmp([i for i in part if plan[i].source is Source.TMP and not plan[i].landed], ids, plan,
                            errors)
            self._copy([i for i in part if plan[i].source is Source.HOST and not plan[i].landed], handle, hashes,
                       ids, plan, copies, order, errors)
            done[0] = max(done[0], stop)

        try:
            advance()
            pos = [i for i, step in enumerate(plan) if step.source is Source.FETCH]
            outcome = self._fetch_values(hashes, ids, start, pos, plan, advance, lead)
            for i in pos:
                if plan[i].source is Source.FETCH:
                    plan[i] = lost()  # never read (an earlier chunk ended the chain)
            cut = next((i for i, step in enumerate(plan) if step.source is Source.LOST), len(plan))
        except Exception as e:  # noqa: BLE001 - a fault fails the blocks, never the engine
            log.exception("load: fetch failed")
            errors.append(f"fetch: {type(e).__name__}: {e}")
            cut = 0
        finally:
            p.backends.release(held)
        if not copies:
            handle.stage(None)
            self._finish_load(handle, hashes, ids, plan, cut, None, [], errors, outcome)
            return
        xh = copies[0] if len(copies) == 1 else TransferGroup(copies)
        handle.stage(xh)
        xh.add_done_callback(lambda r: self._finish_load(handle, hashes, ids, plan, cut, r, order, errors, outcome))

    def _fetch_values(self, hashes: list[bytes], ids: np.ndarray, start: int, pos: list[int], plan: list[Step],
                      advance: Callable[[], None], lead: LeadLoad | None = None) -> HostOutcome:
        """``_load_job``'s reads: the stored values holding plan positions ``pos``, a chunk of values at a
        time, each block placed where the plan wants it and each chunk's copies started at once.  Returns
        what a ``lead`` plan's leader folds: the positions read into the slots its room named, the victims
        handed over (nothing without a lead)."""
        p, reader = self.parts, self.reader
        groups, gone = reader.groups_of(start, pos, len(hashes))
        for i in gone:
            plan[i] = lost()
        where = reader.locate(hashes, groups)
        chunks = load_chunks(len(where), p.layout.block_nbytes * reader.k, p.tuning.load_chunk_bytes)
        land = direct = None
        landed: set[int] = set()  # plan positions whose reading thread copied them to the device
        if not p.device.is_cuda:
            if p.layout.rearranges:
                # Each block copied on by its reading thread only where the copy rearranges it (head-major
                # KV): a transposing copy reads its source again and again, so a source still in cache
                # pays.  Whole rows move faster in the load's one batched copy (many rows a call, the GIL
                # released) than block by block in the reading threads.  Measured here, 256 blocks of 512
                # KiB from local_disk, medians of 7 in two rounds: cpu_attn 308 / 310 ms landed against
                # 339 / 381 batched; flash_attn 281 / 254 landed against 178 / 172 batched.
                land = self._lander(ids, landed)
            if any(p.direct_loads):
                direct = self._segments(ids)
            if where and all(p.direct_loads[w] for w in where):
                # Every value is read straight into its place in the engine's KV (CPU, host.promote_loads
                # false): no copy waits for a chunk, so chunks only add barriers, each waiting for its
                # slowest read.  One read of the whole load: 128 MiB, 1 MiB blocks, 4 threads: 111 ms
                # against 152 in 32 MiB chunks (A/B interleaved, medians of 9).
                chunks = [(0, len(where))]
        want = set(pos)
        rows = self._room(hashes, groups, where, want, direct, lead)  # the whole read's host slots, named now
        try:
            for a, b in chunks:
                got = reader.fetch(hashes, groups[a:b], where[a:b], want, rows=rows, allow_tmp=True, land=land,
                                   direct=direct)
                for i, g in got.items():
                    plan[i] = g or lost()
                    if g is not None and i in landed:
                        g.landed = True
                advance()
                if any(g is None for g in got.values()):
                    break  # the chain is broken here: later blocks are of no use
        finally:
            rows.close()
        if lead is None:
            return HostOutcome.nothing()
        placed = frozenset(i for i in lead.fetch if i < len(plan) and plan[i].source is Source.HOST
                           and plan[i].backend is not None and plan[i].at == rows.named(i))
        return HostOutcome(placed, rows.handed())

    def _room(self, hashes: list[bytes], groups: list[Group], where: list[int], want: set[int],
              direct: Direct | None, lead: LeadLoad | None) -> Reservation:
        """The host room of a load's reads: its own (``ValueReader.reserve``), or the one ``lead`` names.
        A room this side cannot follow (a named slot in use here) leaves the reads without host room: the
        load goes on (temporary rows), and the leader places none of its blocks."""
        if lead is None:
            return self.reader.reserve(hashes, groups, where, want, direct)
        try:
            return Reservation.follow(self.parts.planner, lead.room, lead.fetch, self.room.write_back)
        except PlanRefused as e:
            log.warning("load: the plan's host room for blocks of chain positions %d-%d is refused here: %s",
                        min(lead.fetch), max(lead.fetch), e)
            return Reservation.take(self.parts.planner, [], self.room.write_back)

    def _lander(self, ids: np.ndarray, landed: set[int]) -> Callable[[int, Any], None]:
        """``ValueReader.fetch``'s ``land`` for a load into head-major CPU KV: copy each block into its device
        block in the thread that read and verified it, while its bytes are still in the CPU cache, and
        record its plan position in ``landed``.  A copy that fails leaves the block to the usual host ->
        device copy.  Blocks after a break in the chain may land too: they are reported not loaded whatever
        their device block holds (the engine recomputes them)."""
        device = self.parts.device

        def land(i: int, buf: Any) -> None:
            try:
                device.write_payload(buf, int(ids[i]))
                landed.add(i)
            except Exception as e:  # noqa: BLE001 - never into the backend's reading thread
                log.warning("load: copying block %d to the device as it was read failed (%s); copying it "
                            "from host memory", int(ids[i]), e)

        return land

    def _segments(self, ids: np.ndarray) -> Callable[[int], Segments | None]:
        """``ValueReader.reserve``'s and ``fetch``'s ``direct`` for a load into CPU memory: a plan position's
        device block, as segments, built once per load (the reservation and the read both ask for it)."""
        device = self.parts.device
        made: dict[int, Segments | None] = {}

        def segments(i: int) -> Segments | None:
            if i not in made:
                made[i] = device.block_segments(int(ids[i]))
            return made[i]

        return segments

    def _copy(self, part: list[int], handle: LoadHandle, hashes: list[bytes], ids: np.ndarray,
              plan: list[Step], copies: list[TransferHandle], order: list[int], errors: list[str]) -> None:
        """Submit the host -> device copy of the plan positions ``part`` (blocks in host slots)."""
        if not part:
            return
        try:
            copies.append(self.parts.transfers().load([plan[i].at for i in part], ids[part],
                                                  layerwise=handle.layerwise, keys=[hashes[i] for i in part]))
            order += part
        except Exception as e:  # noqa: BLE001 - those blocks are not loaded; the engine recomputes them
            errors.append(f"transfer: {type(e).__name__}: {e}")
            for i in part:
                plan[i].source = Source.LOST

    def _write_tmp(self, part: list[int], ids: np.ndarray, plan: list[Step], errors: list[str]) -> None:
        """Blocks that found no host room were read into temporary rows: write them to the device now."""
        if not part:
            return
        try:
            self.parts.device.write_blocks(torch.stack([plan[i].at for i in part]), ids[part])
            self.parts.metrics.add("device", bytes_in=len(part) * self.parts.layout.block_nbytes)
        except Exception as e:  # noqa: BLE001 - those blocks fail, the rest goes on
            errors.append(f"device write: {type(e).__name__}: {e}")
            self.parts.metrics.add("device", failures=1)
            for i in part:
                plan[i].source = Source.LOST

    def _scatter(self, handle: LoadHandle, hashes: list[bytes], ids: np.ndarray, plan: list[Step],
                 cut: int, errors: list[str]) -> None:
        """Host -> device for the planned blocks before ``cut`` that sit in host memory."""
        hp = [i for i in range(cut) if plan[i].source is Source.HOST]
        if not hp:
            handle.stage(None)
            self._finish_load(handle, hashes, ids, plan, cut, None, hp, errors)
            return
        try:
            xh = self.parts.transfers().load([plan[i].at for i in hp], ids[hp], layerwise=handle.layerwise,
                                    keys=[hashes[i] for i in hp])
        except Exception as e:  # noqa: BLE001
            errors.append(f"transfer: {type(e).__name__}: {e}")
            self._finish_load(handle, hashes, ids, plan, cut, None, hp, errors)
            return
        handle.stage(xh)
        xh.add_done_callback(lambda r: self._finish_load(handle, hashes, ids, plan, cut, r, hp, errors))

    def _finish_load(self, handle: LoadHandle, hashes: list[bytes], ids: np.ndarray, plan: list[Step],
                     cut: int, r: TransferResult | None, hp: list[int], errors: list[str],
                     outcome: HostOutcome | None = None) -> None:
        p, planner = self.parts, self.parts.planner
        n = len(hashes)
        copied = [False] * n
        tiers: list[Tier | None] = [None] * n
        down: list[bytes] = []
        try:
            for i in range(min(cut, len(plan))):
                tiers[i] = plan[i].tier
                copied[i] = plan[i].on_device
            if r is not None:
                for i, landed in zip(hp, r.ok):
                    copied[i] = landed
                errors = [*errors, *r.errors]
            num = next((i for i in range(n) if not copied[i]), n)
            with planner.lock:
                down += planner.loaded_locked(hashes, ids.tolist(), num, len(plan))
            self._count(plan[:num], n, r)
        except Exception as e:  # noqa: BLE001 - the handle is finished whatever happens
            log.exception("load: completion failed")
            errors = [*errors, f"completion: {e}"]
            num = 0
        ok = tuple(i < num for i in range(n))
        handle.finish(LoadResult(tuple(int(b) for b in ids), ok, tuple(copied), tuple(tiers), tuple(errors),
                                 p.namespace.block_size, outcome or HostOutcome.nothing()))
        if down:
            self.down.write_down(down)

    def _count(self, served: list[Step], n: int, r: TransferResult | None) -> None:
        m = self.parts.metrics
        same = sum(1 for p in served if p.source is Source.SAME)
        landed = sum(1 for p in served if p.landed or p.source is Source.DIRECT)
        m.add("device", bytes_in=landed * self.parts.layout.block_nbytes)
        from_host = sum(1 for p in served if p.source is Source.HOST and p.backend is None)
        m.hit("device", same)
        m.add("device", misses=n - same)
        m.hit("host", from_host)
        m.add("host", misses=n - same - from_host)
        if r is not None:
            m.add("host", bytes_out=r.nbytes, failures=int(not r.all_ok))
            m.add("device", bytes_in=r.nbytes)
            m.observe("host", "read", r.seconds)

    # ------------------------------------------------------------------ prefetch

    def prefetch(self, hashes: list[bytes], lookup: LookupResult | None, start: int = 0) -> PrefetchHandle:
        p, planner, workers = self.parts, self.parts.planner, self.parts.workers
        in_memory = planner.leading_in_memory
        if p.host is None or not len(p.backends):
            return PrefetchHandle(in_memory, hashes, 0, 0.0, started=False)
        res = lookup if lookup is not None and lookup.num_requested == len(hashes) else \
            self.lookup(hashes, record=False, start=start)
        pos = [i for i, t in enumerate(res.tiers) if t.is_backend]
        tokens = len(pos) * p.namespace.block_size
        if not pos or tokens < p.prefetch_threshold_tokens:
            return PrefetchHandle(in_memory, hashes, 0, 0.0, started=False)
        prefix = hashes[:res.num_blocks]
        planner.pin(prefix)  # the memory part too: making room must not evict the request's own head
        handle = PrefetchHandle(in_memory, hashes, tokens, p.prefetch_policy.wait_seconds(tokens), started=True)
        if not workers.submit(workers.reads, self._prefetch_job, handle, prefix, hashes, start, pos, res):
            self._prefetch_done(handle, prefix)
        return handle

    def _prefetch_job(self, handle: PrefetchHandle, prefix: list[bytes], hashes: list[bytes], start: int,
                      pos: list[int], res: LookupResult) -> None:
        """Bring the values holding positions ``pos`` into host memory, ``prefetch_chunk_blocks`` blocks
        at a time (the granularity of a cancel), stopping at the first block not delivered."""
        reader = self.reader
        try:
            groups, _ = reader.groups_of(start, pos, len(hashes))
            lasts = [res.tiers[last] if last < len(res.tiers) else None for _, last in groups]
            # The lookup located every value already (one block each, or its last block in a backend):
            # no second round trip to ask the backends again.
            where = ([t.as_backend_index() for t in lasts if t is not None] if all(t is not None and t.is_backend
                     for t in lasts) else reader.locate(hashes, groups))
            want = set(pos)
            per = max(1, self.parts.tuning.prefetch_chunk_blocks // reader.k)
            rows = reader.reserve(hashes, groups, where, want)  # the whole prefetch's host slots, named now
            try:
                for a in range(0, len(where), per):
                    if handle.cancelled.is_set():
                        break
                    got = reader.fetch(hashes, groups[a:a + per], where[a:a + per], want, rows=rows,
                                       allow_tmp=False)
                    order = sorted(got)
                    n_ok = next((j for j, i in enumerate(order) if got[i] is None), len(order))
                    handle.fetched += n_ok
                    if n_ok < len(order):
                        break  # the chain is broken here: later blocks are of no use
            finally:
                rows.close()
        finally:
            self._prefetch_done(handle, prefix)

    def _prefetch_done(self, handle: PrefetchHandle, prefix: list[bytes]) -> None:
        try:
            self.parts.planner.unpin(prefix)
        finally:
            handle.finish(handle.fetched)
