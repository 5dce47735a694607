"""The byte-free twin of :class:`~kvtier.stack.TierStack`: the same decisions, no bytes, no threads.

A simulation must decide every hit, store and eviction exactly as a deployment would, and do it at
millions of blocks a second.  So this class keeps the stack's *state* in the stack's own structures and
moves nothing:

* **the same index** (:class:`~kvtier.index.BlockIndex`: refs, per-tier LRU, hit counts), changed by the
  same calls in the same order as the stack's store / load / eviction paths (``_stack_down``,
  ``_stack_up``), so recency and the policies' inputs are identical;
* **the same lookup**: :meth:`lookup` is the manager's (:meth:`~kvtier.manager.TierManager.resolve`),
  probing the backends through the same ``BackendSet``; the backends are
  :class:`~kvtier.simulate.ledger.LedgerBackend` ledgers of keys and sizes;
* **the same policies**: the configured write and eviction plugins are called at the same points (the
  prefetch policy only says how long a caller of ``TierStack.prefetch`` waits for backend reads: time,
  which a simulation has none of; its engine loads as ``kvtier run``'s does, without prefetching);
* host memory is a count of slots (``host.capacity // bytes per block``), as the real slab has.

What the real stack does and this one does not: copy bytes, run I/O in threads (every operation here
completes before it returns, writes to the backends included, as ``kvtier run --wait-writes`` makes it
for the real stack: what a backend evicts, and so writes again, then depends on the requests alone),
and fail (a ledger never faults).  ``tests/test_simulate.py`` holds the two together: on two workloads the
hit rates per tier of a real ``kvtier run`` and of a simulation agree within 1 percentage point.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field

from .._load_plan import Source
from .._stack_backends import BackendSet
from .._stack_results import PRESENT, SKIPPED, STORED, LoadResult, LookupResult, StoreResult, StoreStatus
from ..config import KvtierConfig, direct_loads
from ..groups import group_of, load_chunks, whole_groups
from ..index import BlockIndex, Tier
from ..manager import TierManager
from ..metrics import StackMetrics
from ..policy_api import EvictionPolicy
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


class _Lacking(dict[int, list[int]]):
    """Backend mask -> the writable backends it lacks, in order (``lacking[mask & lacking.bits]``): what
    a write-down sends a block to, read per block in the hottest loops, where a list comprehension
    each time cost more than the rest of the step.  The lists are shared: never change one."""

    def __init__(self, writable: Sequence[int]):
        super().__init__()
        self.writable = list(writable)
        self.bits = sum(1 << i for i in self.writable)

    def __missing__(self, mask: int) -> list[int]:
        out = self[mask] = [i for i in self.writable if not (mask >> i) & 1]
        return out


class _Done:
    """A finished handle: what ``.wait()`` returns."""

    def __init__(self, result: object):
        self.result = result

    def wait(self, timeout: float | None = None) -> object:
        return self.result


class SimulatedStack:
    """Byte-free, synchronous :class:`~kvtier.stack.TierStack` for ``kvtier simulate``.  The engine
    (:class:`~kvtier.integrations.engine.CachedEngine`) drives it through the same methods."""

    def __init__(self, config: KvtierConfig, block_nbytes: int):
        self.config = config
        self.storage_blocks = k = config.storage_blocks  # engine blocks per stored value (kvtier.groups)
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
        self.writable = list(self._backends.writable)
        self._lacking = _Lacking(self.writable)
        self.direct = self._direct_loads(config)  # per backend: loads skip host memory (TierStack.direct_loads)
        pol = config.policies
        self.write_policy = pol.write.plugin()(pol.write.options)
        self.eviction_policy = pol.eviction.plugin()(pol.eviction.options)
        self.index = BlockIndex(capacity=max(1024, config.device.num_blocks + self.host_slots))
        self.manager = TierManager(config, backends=self._backends, index=self.index)
        self._free_slots = list(range(self.host_slots - 1, -1, -1))  # pop() gives the lowest first
        self.load_chunk_bytes = 32 * 2**20  # TierStack.load_chunk_bytes: a load reads this much at a time
        self._members: dict[bytes, tuple[bytes, ...]] = {}  # host blocks of whole groups (TierStack._members)
        self.counters = {n: TierCounters() for n in ["host", *names]}
        self.now = 0.0  # trace time of the request being served (store traffic per second)
        self._keys = self.namespace.keys
        # The eviction policy's order hooks, or None where the policy keeps no order of its own (the
        # built-in LRU reads the index's): a simulation calls them per block, a no-op call is pure cost.
        ev = type(self.eviction_policy)
        self._on_insert = None if ev.on_insert is EvictionPolicy.on_insert else self.eviction_policy.on_insert
        self._on_access = None if ev.on_access is EvictionPolicy.on_access else self.eviction_policy.on_access
        self._on_remove = None if ev.on_remove is EvictionPolicy.on_remove else self.eviction_policy.on_remove

    @staticmethod
    def _direct_loads(config: KvtierConfig) -> list[bool]:
        """``TierStack.direct_loads`` for the device ``kvtier run`` would build from this config."""
        if config.host.promote_loads:
            return [False] * len(config.backends)  # decided without torch: the common case
        import torch

        from ..layout import KVLayout

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
        """``_stack_up.Upward.load`` without the copies: plan (host, same device block, fetch), pin the
        plan, fetch what is only in backends into host slots, then record the device copies."""
        idx, ids = self.index, [int(b) for b in block_ids]
        plan: list[Source] = []
        in_host = idx.host_slots(hashes) if self.host_slots else [-1] * len(hashes)
        for key, b, h in zip(hashes, ids, in_host):
            if h >= 0:
                plan.append(Source.HOST)
            elif idx.key_at_device(b) == key:
                plan.append(Source.SAME)
            elif len(self.ledgers):
                plan.append(Source.FETCH)
            else:
                break
        planned = hashes[:len(plan)]
        idx.acquire_many(planned)
        idx.free_devices([b for source, b in zip(plan, ids) if source is not Source.SAME])
        cut = len(plan)
        pos = [i for i, source in enumerate(plan) if source is Source.FETCH]
        if pos:
            # As Upward.load: puts meanwhile never evict what the load reads.
            held = self._keys(hashes) if self._holds else []
            self._backends.hold(held)
            try:
                got = (self._fetch_groups(hashes, start, pos) if self.storage_blocks > 1
                       else self._fetch([hashes[i] for i in pos]))
            finally:
                self._backends.release(held)
            for i, ok in zip(pos, got):
                if not ok:
                    cut = min(cut, i)
        idx.place_on_device_many(hashes[:cut], ids[:cut])
        on_hit, hit = self.write_policy.on_hit, self._hit
        down = [key for key in hashes[:cut] if on_hit(key, hit(key))]
        idx.release_many(planned)
        if down:
            self._write_down(down)
        loaded = tuple(i < cut for i in range(len(hashes)))
        return _Done(LoadResult(tuple(ids), loaded, loaded, (), (), self.block_size))

    def store(self, hashes: Sequence[bytes], block_ids: Sequence[int], *, start: int = 0) -> _Done:
        """``_stack_down.Downward.store`` without the copies."""
        idx, n = self.index, len(hashes)
        status = [SKIPPED] * n
        new: list[int] = []
        hits: list[bytes] = []
        seen: set[bytes] = set()
        writable = self.writable
        # The stack places, then classifies and pins key by key; nothing of that changes what a later
        # key is classified as (device ids and pins, not host slots or backend marks), so each step
        # runs over the batch.  New blocks are not pinned here: the stack's pins keep them through its
        # copies in other threads, and here nothing runs meanwhile that could drop an entry on the
        # device (the host LRU order is the same: each joins it, in order, as it lands).
        idx.place_on_device_many(hashes, block_ids)  # converts an id of another int type itself
        if self.host_slots:
            held = [h >= 0 for h in idx.host_slots(hashes)]
        else:
            held = [bool(writable) and idx.in_backends(key, writable) for key in hashes]
        on_hit = self.write_policy.on_hit
        for i, key in enumerate(hashes):
            if key in seen or held[i]:
                status[i] = PRESENT
                if key not in seen and on_hit(key, self._hit(key)):
                    hits.append(key)
                seen.add(key)
                continue
            seen.add(key)
            new.append(i)
        fresh = [hashes[i] for i in new]
        if hits:
            self._write_down(hits)
        if not new:
            return _Done(StoreResult(tuple(status)))
        if not self.host_slots:
            self._store_direct(hashes, start, new, status)
            return _Done(StoreResult(tuple(status)))
        slots = self._take(len(new))
        taken = len(slots)
        if taken < len(new):
            self.counters["host"].skipped += len(new) - taken
        self._commit_host_many(fresh[:taken], slots)
        for i in new[:taken]:
            status[i] = STORED
        on_store = self.write_policy.on_store
        down = [key for key in fresh[:taken] if on_store(key)]
        self.counters["host"].written += taken
        if self.storage_blocks > 1:
            groups = [tuple(hashes[a:b + 1]) for a, b in whole_groups(start, n, self.storage_blocks)]
            for g in groups:
                self._remember(g)
            sent = set(down)
            self._write_groups([g for g in groups if sent.intersection(g)])
        elif down:
            self._write_down(down)
        return _Done(StoreResult(tuple(status)))

    def on_device_freed(self, block_ids: Sequence[int]) -> None:
        self.index.free_devices(block_ids)

    def flush(self, timeout: float | None = None) -> bool:
        return True

    def close(self) -> None:
        self.manager.close()
        self.metrics.close()

    # ------------------------------------------------------------------ the way up: backends -> host

    def _fetch(self, keys: list[bytes]) -> list[bool]:
        """Bring ``keys`` up from the backends (``Upward.fetch`` + ``locate``); per key whether it arrived
        (into a host slot when there is room, else into a temporary buffer, as a load does)."""
        idx = self.index
        strs = self._keys(keys)
        where = self._backends.locate(strs)
        out = [False] * len(keys)
        todo = []
        for j in range(len(where)):
            if idx.host_slot(keys[j]) is not None:
                out[j] = True
            else:
                todo.append(j)
        if not todo:
            return out
        straight = {j for j in todo if self.direct[where[j]]}  # read into the device block: no host slot
        slots = self._take(len(todo) - len(straight)) if self.host_slots else []
        r = -1
        for j in todo:
            key = keys[j]
            b = where[j]
            r += j not in straight
            got = self.ledgers[b].record_get([strs[j]])[0]
            if not got:  # evicted meanwhile (a write-back's put made room): the others, in order
                b = next((i for i in range(len(self.ledgers)) if i != where[j] and
                          (self.direct[i] or j not in straight) and self.ledgers[i].record_get([strs[j]])[0]), -1)
                got = b >= 0
                if key in idx:
                    idx.remove_backend(key, where[j])
            if got:
                self.counters[self.ledgers[b].name].read += 1
                if key in idx:
                    idx.add_backend(key, b)
            if j not in straight and r < len(slots):
                if got:
                    self._commit_host(key, slots[r])
                    self.counters["host"].written += 1
                else:
                    self._free_slots.append(slots[r])
            out[j] = got
        return out

    # ------------------------------------------------------------------ the way down

    def _take(self, n: int) -> list[int]:
        """``HostRoom.take_locked`` + ``write_back``: free slots first, then the eviction policy's
        victims (unpinned host blocks); a victim the write policy wants written first goes down, and
        its slot is reused only if a backend took it."""
        idx, free = self.index, self._free_slots
        slots = [free.pop() for _ in range(min(n, len(free)))]
        need = n - len(slots)
        seen: set[bytes] = set()
        wb: list[tuple[bytes, list[int]]] = []
        dropped = 0
        grouped = self.storage_blocks > 1
        on_evict, lacking = self.write_policy.on_evict, self._lacking
        bits = lacking.bits
        while need > 0:
            fresh = [k for k in self.eviction_policy.victims(idx, Tier.HOST, need + len(seen)) if k not in seen]
            if not fresh:
                break
            # Per victim, whether to drop or write back depends on its own entry only (with groups also
            # on its group's other blocks, dropped at once then), so drops and pins go in one batch.
            drop: list[bytes] = []
            pins: list[bytes] = []
            for key, h, m in zip(fresh, idx.host_slots(fresh), idx.masks(fresh)):
                seen.add(key)
                if need == 0 or h < 0 or idx.refs(key):
                    continue
                targets = lacking[m & bits]
                if targets and grouped and self._group_of(key) is None:
                    targets = []  # a block of a group no longer whole in host memory cannot be written
                if targets and on_evict(key):
                    pins.append(key)
                    wb.append((key, targets))
                elif grouped:
                    self._drop_host_many([key])
                    dropped += 1
                else:
                    drop.append(key)
                need -= 1
            if drop:
                self._drop_host_many(drop)
                dropped += len(drop)
            idx.acquire_many(pins)
        slots += [free.pop() for _ in range(dropped)]
        if wb:
            written = self._copy_down(wb)
            gone = []
            for key, _ in wb:
                idx.unpin(key)
                if written[key] and idx.refs(key) == 0 and idx.host_slot(key) is not None:
                    gone.append(key)  # a backend took it: its slot is free (dropped below, in order)
                else:
                    idx.discard_if_unused(key)
            if gone:
                self._drop_host_many(gone)
                slots += [free.pop() for _ in gone]
        return slots

    def _fetch_groups(self, hashes: Sequence[bytes], start: int, pos: list[int]) -> list[bool]:
        """``Upward._fetch_groups`` + ``Grouped.fetch`` for a load: a chunk of values at a time, host room
        made first for the wanted blocks not in host memory (the reads land in their slots; the values
        are held, so a write-back making that room never evicts them), then every value of the chunk
        read (each under its last block's key), the slots of a value that was not there given back; per
        position in ``pos`` whether it arrived."""
        idx, k = self.index, self.storage_blocks
        got = dict.fromkeys(pos, False)
        groups: list[tuple[int, int]] = []
        for i in pos:
            grp = group_of(start, i, k)
            if grp[1] >= len(hashes):
                break  # its value's key is beyond the slice: this block and the rest are not fetched
            if not groups or groups[-1] != grp:
                groups.append(grp)
        strs = self._keys([hashes[last] for _, last in groups])
        where = self._backends.locate(strs)
        for a, z in load_chunks(len(where), self.block_nbytes * k, self.load_chunk_bytes):
            chunk = groups[a:z]
            todo: list[tuple[int, list[int]]] = []  # (group index, its wanted blocks not in host memory)
            for g in range(a, z):
                first, last = groups[g]
                members = [i for i in range(max(first, 0), last + 1) if i in got]
                missing = [i for i in members if idx.host_slot(hashes[i]) is None]
                for i in members:
                    got[i] = not missing or i not in missing
                if missing:
                    todo.append((g, missing))
            held = [strs[g] for g, _ in todo]
            self._backends.hold(held)
            try:
                slots = self._take(sum(len(m) for _, m in todo)) if self.host_slots else []
                src = {}
                for g, _ in todo:
                    b = where[g]
                    if not self.ledgers[b].record_get([strs[g]])[0]:
                        b = next((j for j in range(len(self.ledgers)) if j != where[g] and
                                  self.ledgers[j].record_get([strs[g]])[0]), -1)
                    src[g] = b
            finally:
                self._backends.release(held)
            r = 0
            for g, missing in todo:
                first, last = groups[g]
                mine = slots[r:r + len(missing)]
                r += len(missing)
                if src[g] >= 0:
                    self.counters[self.ledgers[src[g]].name].read += 1
                    for i in range(max(first, 0), last + 1):
                        if hashes[i] in idx:
                            idx.add_backend(hashes[i], src[g])
                    for i, slot in zip(missing, mine):
                        self._commit_host(hashes[i], slot)
                        self.counters["host"].written += 1
                    for i in missing:
                        got[i] = True  # in a host slot, or a temporary row when host memory had no room
                    if first >= 0:
                        self._remember(tuple(hashes[first:last + 1]))
                else:
                    self._free_slots.extend(mine)
                    if hashes[last] in idx:
                        idx.remove_backend(hashes[last], where[g])  # read and not there: a stale hint
            if any(not got[i] for first, last in chunk for i in range(max(first, 0), last + 1) if i in got):
                break
        return [got[i] for i in pos]

    def _write_groups(self, groups: list[tuple[bytes, ...]]) -> set[bytes]:
        """``Grouped.write_from_host`` / ``write_now``: each group whose blocks are all in host memory, once,
        to the writable backends lacking it (by its last block's marks); the last keys written.  Which
        backends lack a group is decided for all groups before the first put (``Grouped._claim_locked``):
        a group a put of this batch evicts is not written again by the same batch."""
        idx = self.index
        todo = []
        for members in dict.fromkeys(groups):
            if any(idx.host_slot(key) is None for key in members):
                continue
            targets = self._lacking[idx.masks(members[-1:])[0] & self._lacking.bits]
            if targets:
                todo.append((members, targets))
        written: set[bytes] = set()
        for b in self.writable:
            part = [members for members, targets in todo if b in targets]
            if not part:
                continue
            for members, good in zip(part, self._put(b, [m[-1] for m in part])):
                if good:
                    written.add(members[-1])
                    for key in members:
                        if key in idx:
                            idx.add_backend(key, b)
            self.counters["host"].read += sum(map(len, part))
        return written

    def _remember(self, members: tuple[bytes, ...]) -> None:
        for key in members:
            if self.index.host_slot(key) is not None:
                self._members[key] = members

    def _group_of(self, key: bytes) -> tuple[bytes, ...] | None:
        members = self._members.get(key)
        if members is None or any(self.index.host_slot(m) is None for m in members):
            return None
        return members

    def _store_direct(self, hashes: Sequence[bytes], start: int, new: list[int], status: list[StoreStatus]) -> None:
        """``Downward._store_direct``: no host tier, every stored value holding a new block (a block, or a
        whole group of the store) is read from the device and written to every writable backend."""
        fresh = set(new)
        spans = [(a, b) for a, b in whole_groups(start, len(hashes), self.storage_blocks)
                 if not fresh.isdisjoint(range(a, b + 1))]
        took = [False] * len(spans)
        for j in self.writable:
            for v, good in enumerate(self._put(j, [hashes[b] for _, b in spans])):
                if good:
                    took[v] = True
                    for key in hashes[spans[v][0]:spans[v][1] + 1]:
                        if key in self.index:
                            self.index.add_backend(key, j)
        for (a, b), ok in zip(spans, took):
            for i in range(a, b + 1):
                if i in fresh:
                    status[i] = STORED if ok else SKIPPED

    def _write_down(self, keys: Sequence[bytes]) -> None:
        """``Downward.write_down``: host blocks to every writable backend lacking them (with values of
        several blocks: their whole groups)."""
        if self.storage_blocks > 1:
            self._write_groups([g for g in map(self._group_of, dict.fromkeys(keys)) if g is not None])
            return
        todo = []
        idx, lacking = self.index, self._lacking
        bits = lacking.bits
        keys = list(dict.fromkeys(keys))
        for key, h, m in zip(keys, idx.host_slots(keys), idx.masks(keys)):
            if h < 0:
                continue
            targets = lacking[m & bits]
            if targets:
                todo.append((key, targets))
        if todo:
            self._copy_down(todo)

    def _copy_down(self, todo: list[tuple[bytes, list[int]]]) -> dict[bytes, bool]:
        if self.storage_blocks > 1:
            groups = {key: self._group_of(key) for key, _ in todo}
            written = self._write_groups([g for g in groups.values() if g is not None])
            return {key: g is not None and g[-1] in written for key, g in groups.items()}
        taken = {key: False for key, _ in todo}
        for b in self.writable:
            part = [key for key, targets in todo if b in targets]
            if not part:
                continue
            ok = [key for key, good in zip(part, self._put(b, part)) if good]
            for key in ok:
                taken[key] = True
            self.index.add_backend_many(ok, b)
            self.counters["host"].read += len(part)
        return taken

    def _put(self, b: int, keys: list[bytes]) -> list[bool]:
        led = self.ledgers[b]
        before = led.evictions
        ok = led.record_put(self._keys(keys))
        c = self.counters[led.name]
        n = sum(ok)
        c.written += n
        c.skipped += len(ok) - n
        c.evicted += led.evictions - before
        sec = int(self.now)
        c.writes_per_s[sec] = c.writes_per_s.get(sec, 0) + n
        return ok

    # ------------------------------------------------------------------ index bookkeeping (as TierStack)

    def _hit(self, key: bytes) -> int:
        hits = self.index.touch(key, self.now)
        if self._on_access is not None and self.index.host_slot(key) is not None:
            self._on_access(Tier.HOST, [key])
        return hits

    def _commit_host(self, key: bytes, slot: int) -> None:
        self._commit_host_many([key], [slot])

    def _commit_host_many(self, keys: Sequence[bytes], slots: Sequence[int]) -> None:
        """Each key lands in its slot (a key already in another slot keeps it; this one goes back)."""
        on_insert, free = self._on_insert, self._free_slots
        for key, slot, landed in zip(keys, slots, self.index.land_host_many(keys, slots)):
            if not landed:
                free.append(slot)
            elif on_insert is not None:
                on_insert(Tier.HOST, [key])

    def _drop_host_many(self, keys: Sequence[bytes]) -> None:
        """Host memory evicts ``keys`` (unpinned): their slots become free."""
        slots = self.index.drop_host_many(keys)
        if self._members:
            for key in keys:
                self._members.pop(key, None)
        if self._on_remove is not None:
            for key, slot in zip(keys, slots):
                if slot >= 0:
                    self._on_remove(Tier.HOST, [key])
        freed = [slot for slot in slots if slot >= 0]
        self._free_slots += freed
        self.counters["host"].evicted += len(freed)


__all__ = ["SimulatedStack", "TierCounters"]
