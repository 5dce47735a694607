"""The simulated stack: the real planner, run by a ledger executor (keys and sizes, no bytes, no threads).

A simulation must decide every hit, store and eviction exactly as a deployment would, and do it fast.
So it does not copy the stack's decisions: it runs them.  Every placement decision is made by the same
:class:`~kvtier.tiering.planner.Planner` a :class:`~kvtier.stack.TierStack` asks (the same index, the same
write and eviction policies, the same host slot table, the same scheduler half for lookups), called in
the order the stack's executors call it; this module is the executor that, where the stack would copy
bytes and do backend I/O in worker threads, records keys in :class:`~kvtier.simulate.ledger.LedgerBackend`
ledgers and counts the traffic.

What the real stack does and this one does not: copy bytes, run I/O in threads (every operation here
completes before it returns, writes to the backends included, as ``kvtier run --wait-writes`` makes it
for the real stack: what a backend evicts, and so writes again, then depends on the requests alone),
and fail (a ledger never faults).  The prefetch policy only says how long a caller of
``TierStack.prefetch`` waits for backend reads: time, which a simulation has none of; its engine loads as
``kvtier run``'s does, without prefetching.  ``tests/test_simulate.py`` holds the two together: the hit
rates per tier of real ``kvtier run``s and of simulations of the same workloads agree.

Invariants: every block the planner hands out held (a store's new blocks, a write-back victim, a copy
down, a load's plan) is handed back before the call returns (checked by ``Planner.check_locked`` in the
tests); the counters count each block moved once.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from ..config import KvtierConfig, direct_loads
from ..format.groups import group_of, load_chunks, whole_groups
from ..index import BlockIndex
from ..memory.host_slots import SlotTable
from ..metrics import StackMetrics
from ..tiering.backend_set import BackendSet
from ..tiering.manager import TierManager
from ..tiering.planner import CopyDown, Planner, ValueWrites
from ..tiering.results import SKIPPED, STORED, LoadResult, LookupResult, StoreResult, StoreStatus
from ..tiering.room import Reservation
from .ledger import LedgerBackend


@dataclass
class TierCounters:
    """Traffic of one tier over a simulation, in blocks (bytes = blocks x bytes per block)."""

    written: int = 0
    read: int = 0
    evicted: int = 0
    skipped: int = 0
    # (trace time in whole seconds) -> blocks written in that second: the store traffic a backend sees.
    writes_per_s: dict[int, int] = field(default_factory=dict)


class _Done:
    """A finished handle: what ``.wait()`` returns."""

    def __init__(self, result: object):
        self.result = result

    def wait(self, timeout: float | None = None) -> object:
        return self.result


class SimulatedStack:
    """Byte-free, synchronous :class:`~kvtier.stack.TierStack` for ``kvtier simulate``: the planner plus a
    ledger executor.  The engine (:class:`~kvtier.integrations.engine.CachedEngine`) drives it through the
    same methods."""

    def __init__(self, config: KvtierConfig, block_nbytes: int):
        self.config = config
        self.storage_blocks = k = config.storage_blocks  # engine blocks per stored value (kvtier.format.groups)
        self.namespace = config.namespace()
        self.block_size = self.namespace.block_size
        self.block_nbytes = block_nbytes
        cap = int(config.host.capacity)
        self.host_slots = cap // block_nbytes if cap else 0
        if cap and not self.host_slots:
            raise ValueError(f"host.capacity: {cap} B holds no block of {block_nbytes} B")
        self.ledgers = [LedgerBackend.for_config(b, block_nbytes * k) for b in config.backends]
        # Holds (a load's keys, kept from evictions) change nothing where no backend evicts: skipped there.
        self._holds = any(led.capacity is not None for led in self.ledgers)
        names = [led.name for led in self.ledgers]
        self.metrics = StackMetrics(["device", *(["host"] if self.host_slots else []), *names], self.block_size)
        self._backends = BackendSet(self.ledgers, [b.write for b in config.backends], self.metrics,
                                    self.namespace.layout_id, block_nbytes)
        self.planner = Planner(config, backends=self._backends, metrics=self.metrics,
                               slots=SlotTable(self.host_slots) if self.host_slots else None,
                               device_blocks=config.device.num_blocks)
        self.index: BlockIndex = self.planner.index
        self.manager: TierManager = self.planner.manager
        self.direct = self._direct_loads(config)  # per backend: loads skip host memory (TierStack.direct_loads)
        self.load_chunk_bytes = 32 * 2**20  # TierStack.load_chunk_bytes: a load reads this much at a time
        self._counters = {n: TierCounters() for n in ["host", *names]}
        self._keys = self.namespace.keys

    @property
    def now(self) -> float:
        """Trace time of the request being served (recency stamps, store traffic per second)."""
        return self.planner.now or 0.0

    @now.setter
    def now(self, t: float) -> None:
        self.planner.now = t

    @staticmethod
    def _direct_loads(config: KvtierConfig) -> list[bool]:
        """``TierStack.direct_loads`` for the device ``kvtier run`` would build from this config."""
        if config.host.promote_loads:
            return [False] * len(config.backends)  # decided without torch: the common case
        import torch

        from ..format.layout import KVLayout

        kind = config.device.kind if config.device.kind != "auto" else (
            "cuda" if torch.cuda.is_available() else "cpu")
        layout = KVLayout.from_namespace(config.namespace(), 1, config.device.layout)
        reads = [bool(getattr(b.plugin(), "reads_segments", False)) for b in config.backends]
        return direct_loads(config, reads, kind == "cpu" and not layout.rearranges)

    # ------------------------------------------------------------------ what the engine calls

    def lookup(self, hashes: Sequence[bytes], *, start: int = 0) -> LookupResult:
        return LookupResult(self.manager.resolve(hashes, start), self.block_size, len(hashes),
                            self.manager.tier_names)

    def load(self, hashes: Sequence[bytes], block_ids: Sequence[int], *, start: int = 0) -> _Done:
        """``load_path.Upward.load``: the planner's plan (host, same device block, fetch), what is only in
        backends fetched into host slots, then the planner told what landed."""
        p, ids, hashes = self.planner, list(map(int, block_ids)), list(hashes)
        with p.lock:
            plan = p.plan_load_locked(hashes, ids)
        cut = len(plan)
        pos = plan.fetch()
        if pos:
            # As Upward.load: puts meanwhile never evict what the load reads.
            held = self._keys(hashes) if self._holds else []
            self._backends.hold(held)
            try:
                got = self._fetch_values(hashes, start, pos)
            finally:
                self._backends.release(held)
            cut = next((i for i, ok in zip(pos, got) if not ok), cut)
        with p.lock:
            down = p.loaded_locked(hashes, ids, cut, len(plan))
        if down:
            self._write_down(down)
        loaded = (True,) * cut + (False,) * (len(hashes) - cut)
        return _Done(LoadResult(tuple(ids), loaded, loaded, (), (), self.block_size))

    def store(self, hashes: Sequence[bytes], block_ids: Sequence[int], *, start: int = 0,
              tenant: str | None = None) -> _Done:
        """``store_path.Downward.store``: the planner's classification and slots, victims written back,
        the new blocks committed (no copy), then what the write policy sends down.  ``tenant`` is taken
        and not modelled: the ledgers bound capacities, not quotas."""
        p, hashes = self.planner, list(hashes)
        with p.lock:
            plan = p.start_store_locked(hashes, list(map(int, block_ids)))
        status, new = plan.status, plan.new
        if plan.hits:
            self._write_down(plan.hits)
        if not new:
            return _Done(StoreResult(tuple(status)))
        if not self.host_slots:
            self._store_direct(hashes, start, new, status)
            return _Done(StoreResult(tuple(status)))
        slots = (plan.slots + self._write_back(plan.victims)) if plan.victims else plan.slots
        taken = min(len(new), len(slots))  # the chain's head gets the room
        if taken < len(new):
            self._counters["host"].skipped += len(new) - taken
            p.end_stores(plan.keys[taken:])
        with p.lock:
            claims = p.land_store_locked(plan, hashes, start, slots[:taken])
        self._counters["host"].written += taken
        if claims.members:
            self._write_claims(claims, owed=True)
        return _Done(StoreResult(tuple(status)))

    def on_device_freed(self, block_ids: Sequence[int]) -> None:
        self.planner.device_freed(block_ids)  # the index converts an id of another int type itself

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def close(self) -> None:
        self.manager.close()
        self.metrics.close()

    # ------------------------------------------------------------------ the way up: backends -> host

    def _read(self, gs: list[int], strs: list[str], where: list[int]) -> dict[int, int]:
        """``ValueReader._read`` of values ``gs`` (indices into ``strs`` / ``where``): a batch from each
        backend a value was located in, in backend order, then those that failed (vanished: a write-back's
        put made room) from each of the others in order (only those that load straight in, for a value
        whose own does).  Per value the backend it came from, or -1."""
        src = dict.fromkeys(gs, -1)
        for b in sorted({where[g] for g in gs}):
            self._get(b, [g for g in gs if where[g] == b], strs, src)
        direct = self.direct
        for b in range(len(self.ledgers)):
            self._get(b, [g for g in gs if src[g] < 0 and where[g] != b and (direct[b] or not direct[where[g]])],
                      strs, src)
        return src

    def _get(self, b: int, batch: list[int], strs: list[str], src: dict[int, int]) -> None:
        """``ValueReader._get``: values ``batch`` from ledger ``b``; ``src`` names it for those it held."""
        if not batch:
            return
        ok = self.ledgers[b].record_get([strs[g] for g in batch])
        for g, good in zip(batch, ok):
            if good:
                src[g] = b
        self._counters[self.ledgers[b].name].read += sum(ok)

    def _fetch_values(self, hashes: list[bytes], start: int, pos: list[int]) -> list[bool]:
        """``Upward._fetch_values`` + ``ValueReader.fetch`` for a load: the values holding ``pos`` (one
        block each, or groups of ``storage.block_tokens``), a chunk of them at a time.  A value whose
        backend loads straight into the engine's KV is read there; for the others, the whole read's
        host room is named before the first value is read (``ValueReader.reserve``: a slot for each wanted
        block not in host memory), and each chunk takes its blocks' slots, its victims written back then
        (the values held, so a write-back making that room never evicts them; no room: a temporary row);
        then every value is read under its last block's key.  Per position in ``pos``, whether it
        arrived."""
        p, k = self.planner, self.storage_blocks
        got = dict.fromkeys(pos, False)
        groups: list[tuple[int, int]] = []
        for i in pos:
            grp = (i, i) if k == 1 else group_of(start, i, k)
            if grp[1] >= len(hashes):
                break  # its value's key is beyond the slice: this block and the rest are not fetched
            if not groups or groups[-1] != grp:
                groups.append(grp)
        strs = self._keys([hashes[last] for _, last in groups])
        where = self._backends.locate(strs)
        # Per value, its wanted positions (listed once: every step below walks them).
        spans = [list(filter(got.__contains__, range(max(first, 0), last + 1))) for first, last in groups]
        chunks = load_chunks(len(where), self.block_nbytes * k, self.load_chunk_bytes)
        if where and all(self.direct[w] for w in where):
            chunks = [(0, len(where))]  # as Upward._fetch_values: every value read straight in, at once
        rows: list[int] = []
        if self.host_slots:
            wanted = [i for span, b in zip(spans, where) if not self.direct[b] for i in span]
            with p.lock:
                rows = [i for i, h in zip(wanted, p.index.host_slots([hashes[i] for i in wanted])) if h < 0]
        room = Reservation.take(p, rows, self._write_back)
        try:
            self._fetch_chunks(hashes, groups, spans, strs, where, chunks, got, room)
        finally:
            room.close()
        return [got[i] for i in pos]

    def _fetch_chunks(self, hashes: list[bytes], groups: list[tuple[int, int]], spans: list[list[int]],
                      strs: list[str], where: list[int], chunks: list[tuple[int, int]], got: dict[int, bool],
                      room: Reservation) -> None:
        """``_fetch_values``' chunks, each as ``ValueReader.fetch`` reads one (``spans[g]``: value ``g``'s
        wanted positions)."""
        p, k = self.planner, self.storage_blocks
        for a, z in chunks:
            todo: list[tuple[int, list[int]]] = []  # (group index, its wanted blocks not in host memory)
            members = [(g, i) for g in range(a, z) for i in spans[g]]
            with p.lock:
                slots = p.index.host_slots([hashes[i] for _, i in members])
            for (g, i), h in zip(members, slots):
                got[i] = h >= 0
                if h < 0:
                    if todo and todo[-1][0] == g:
                        todo[-1][1].append(i)
                    else:
                        todo.append((g, [i]))
            held = [strs[g] for g, _ in todo] if self._holds else []
            self._backends.hold(held)
            try:
                given = room.slots_for([i for g, m in todo if not self.direct[where[g]] for i in m])
                src = self._read([g for g, _ in todo], strs, where)
            finally:
                self._backends.release(held)
            with p.lock:
                # In one pass each, as the reads' results in order would: every block of a value read is
                # marked in the backend it came from, then its wanted blocks land in their host slots.
                read_from: dict[int, list[bytes]] = {}
                landing: list[int] = []
                for g, missing in todo:
                    first, last = groups[g]
                    if src[g] >= 0:
                        read_from.setdefault(src[g], []).extend(hashes[max(first, 0):last + 1])
                        landing.extend(filter(given.__contains__, missing))
                        for i in missing:
                            got[i] = True  # in a host slot, a temporary row, or the device block itself
                    else:
                        p.release_slots([given[i] for i in missing if i in given])
                        p.mark_missing_locked(hashes[last], where[g])  # read and not there: a stale hint
                for b, keys in read_from.items():
                    p.mark_read_many_locked(keys, b)
                p.commit_host_many_locked([hashes[i] for i in landing], [given[i] for i in landing])
                self._counters["host"].written += len(landing)
                if k > 1:
                    for g, _ in todo:
                        first, last = groups[g]
                        if src[g] >= 0 and first >= 0:
                            p.remember_group_locked(tuple(hashes[first:last + 1]))
            if not all(map(got.__getitem__, [i for _, i in members])):
                break

    # ------------------------------------------------------------------ the way down

    def _write_back(self, victims: Sequence[CopyDown]) -> list[int]:
        """``HostRoom.write_back``: copy the victims down, then the planner frees those a backend took."""
        if not victims:
            return []
        written = self._copy_down(victims)
        with self.planner.lock:
            return self.planner.written_back_locked(victims, written)

    def _write_down(self, keys: Sequence[bytes]) -> None:
        """``BackendWriter.write_down`` (run at once): the values of host blocks to every writable backend
        lacking them."""
        p = self.planner
        with p.lock:
            claims = p.claim_to_write_locked(keys)
        if claims.members:
            self._write_claims(claims, owed=True)

    def _copy_down(self, todo: Sequence[CopyDown]) -> dict[bytes, bool]:
        """``HostRoom.copy_down``: held victims' values to the backends lacking them."""
        with self.planner.lock:
            values = {c.key: self.planner.group_of_locked(c.key) for c in todo}
        written = self._write_values([v for v in values.values() if v is not None], frozenset(c.key for c in todo))
        return {key: v is not None and v[-1] in written for key, v in values.items()}

    def _write_values(self, values: Sequence[tuple[bytes, ...]], mine: frozenset[bytes] = frozenset()) -> set[bytes]:
        """``BackendWriter.write_now``: the last keys of the values a backend took."""
        with self.planner.lock:
            claims = self.planner.claim_groups_locked(values, mine)
        written: set[bytes] = set()
        self._write_claims(claims, written=written)
        return written

    def _write_claims(self, claims: ValueWrites, owed: bool = False,
                      written: set[bytes] | None = None) -> None:
        """``BackendWriter._put`` of claimed values, then released; ``written`` (when given) gets the last
        keys of those a backend took."""
        p, k, writable = self.planner, self.storage_blocks, self._backends.writable
        try:
            for b in writable:
                # One writable backend: every claimed value lacks it (a claim names a backend for each).
                members = claims.members if len(writable) == 1 else [claims.members[j] for j in claims.to(b)]
                if not members:
                    continue
                ok = self._put(b, members, owed)
                if written is not None:
                    written.update([m[-1] for m, good in zip(members, ok) if good])
                self._counters["host"].read += len(members) if k == 1 else sum(len(m) for m in members)
        finally:
            p.release_groups(claims)

    def _store_direct(self, hashes: list[bytes], start: int, new: list[int], status: list[StoreStatus]) -> None:
        """``Downward._store_direct``: no host tier, every stored value holding a new block (a block, or a
        whole group of the store) written to every writable backend."""
        fresh = set(new)
        spans = [(a, b) for a, b in whole_groups(start, len(hashes), self.storage_blocks)
                 if not fresh.isdisjoint(range(a, b + 1))]
        took = [False] * len(spans)
        values = [tuple(hashes[a:b + 1]) for a, b in spans]
        for j in self._backends.writable:
            for v, good in enumerate(self._put(j, values)):
                took[v] = took[v] or good
        for (a, b), ok in zip(spans, took):
            for i in range(a, b + 1):
                if i in fresh:
                    status[i] = STORED if ok else SKIPPED
        self.planner.end_stores([hashes[i] for i in new])

    def _put(self, b: int, values: Sequence[tuple[bytes, ...]], owed: bool = False) -> list[bool]:
        """``BackendWriter.put_values`` into ledger ``b``, counting its traffic."""
        p, led = self.planner, self.ledgers[b]
        with p.lock:
            ticket = p.begin_put_locked(b)
        before = led.evictions
        ok = led.record_put(self._keys([v[-1] for v in values]))
        with p.lock:
            p.put_done_locked(b, ticket, values, ok, owed=owed)
        c = self._counters[led.name]
        n = sum(ok)
        c.written += n
        c.skipped += len(ok) - n
        c.evicted += led.evictions - before
        sec = int(self.now)
        c.writes_per_s[sec] = c.writes_per_s.get(sec, 0) + n
        return ok

    @property
    def counters(self) -> dict[str, TierCounters]:
        """Traffic per tier so far: host memory's evictions are the planner's (counted in the metrics)."""
        if self.host_slots:
            self._counters["host"].evicted = int(self.metrics.snapshot()["tiers"]["host"]["evictions"])
        return self._counters


__all__ = ["SimulatedStack", "TierCounters"]
