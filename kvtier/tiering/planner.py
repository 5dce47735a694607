"""The planner: every placement decision of a tier stack, and the state those decisions read.

Torch-free by import, never waits on I/O.  It owns the block index, the write and eviction policies, the
host slots' bookkeeping (:class:`~kvtier.memory.host_slots.SlotTable`: which slot a block goes to; the bytes are
the executor's), the scheduler half (:class:`~kvtier.manager.TierManager`, sharing the index and the
lock) and what is in flight.  The executors (:mod:`~kvtier.tiering.store_path`,
:mod:`~kvtier.tiering.load_path`, :mod:`~kvtier.tiering.reads`, :mod:`~kvtier.tiering.writes`) ask it,
under :attr:`Planner.lock`, what to do (which slots, which victims to write back, what to write down and where, where each block of a
load comes from), run that against memory and backends outside the lock, and tell it what happened.

Invariants (checked by :meth:`Planner.check_locked` in the tests, after every operation has settled):

* **Pins.**  A block is evicted from host memory only when nothing uses it: no index reference (loads,
  prefetches, stores, write-back victims) and no copy down in flight (``writing``).  Those two are the
  only pins: the slot table keeps states, no pin count of its own.
* **Index = truth about memory.**  The index says a block is in host slot ``s`` iff slot ``s`` is READY
  or WRITING under this planner's commit (``commit_host_locked``); a slot is never in two blocks.
* **Plans name their slots.**  A store's plan (:class:`StoreStart`) says at its start which host slot each
  of its new blocks goes to (:meth:`StoreStart.room`), and a read's (a load's or a prefetch's backend
  values) says it before its first value is read (:class:`Room`, one for the whole read, handed out
  chunk by chunk in its order); a slot a victim hands over goes from that victim
  to the planned block without being free in between (``SlotTable.reuse``), so the same plan places the
  same blocks in the same slots whenever its write-backs end.
* **A follower takes what the leader named.**  A planner following a plan made elsewhere
  (:meth:`Planner.adopt_store_locked`, :meth:`Planner.adopt_room_locked`: vLLM's ranks, the scheduler's
  plan) takes exactly the slots and holds exactly the victims it names, or refuses it whole
  (:class:`PlanRefused`) and holds nothing of it; it never picks a slot of its own for such a plan.
  The leader places a block in a host slot only where every side stored or read it there
  (:meth:`Planner.fold_store_locked`, :meth:`Planner.fold_load_locked`), and pins the blocks a load it
  leads serves from host memory until that load is folded.
* **One at a time.**  A block is in at most one store (``storing``) and at most one copy down
  (``writing``).
* **Bounded.**  At most ``max_unwritten`` host blocks wait on a write-back that failed (beyond that the
  next such victim is evicted unwritten, counted ``dropped``); ``owed``, ``members`` and ``tenants`` only
  name blocks in host memory (they leave with the block); backend-only index entries beyond
  ``max_index_entries`` are forgotten oldest first.
* **Tenants.**  A host block stored for a ``cache_salt`` tenant (``store(..., tenant=)``) keeps its tag
  until it leaves host memory, so every later write of its value (write-down, write-back, a write again
  after an outage) is charged to that tenant's quota (``kvtier.quota``); the first store to commit a
  block names its tenant.
* **Reports.**  With a listener (``drain_report``, ``drain_host_changes``), every backend mark and
  every host-memory change is recorded for a manager in another process, once.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass, field
from itertools import chain
from operator import itemgetter

from ..config import KvtierConfig
from ..format.groups import whole_groups
from ..index import BlockIndex, Tier
from ..memory.host_slots import READY, WRITING, SlotTable
from ..metrics import StackMetrics
from ..plans import CopyDown, Dropped, HostChanges, HostOutcome, LeadLoad, LeadStore, Room, WorkerReport
from ..policy_api import EvictionPolicy, WritePolicy
from .backend_set import BackendSet
from .load_steps import LoadPlan, Source
from .manager import TierManager
from .results import FAILED, PRESENT, SKIPPED, STORED, StoreStatus

_last = itemgetter(-1)  # a value's key: the last of its blocks' keys


@dataclass(slots=True)
class ValueWrites:
    """Whole stored values (one block, or a group of ``storage_blocks`` blocks) claimed for writing from
    host memory (:meth:`Planner.claim_groups_locked`), as columns: value ``j`` is stored under the last of
    ``members[j]`` (its blocks' keys, in chain order), sits in host slots ``slots[j]``, goes to the
    writable backends lacking it (``targets[j]``), charged to tenant ``tenants[j]`` (None: the
    namespace's).  ``added``: the blocks this claim put in ``writing``, released by it alone
    (:meth:`Planner.release_groups`).  Every copy down writes values so: one path whatever their size.
    Columns, not an object per value: a write-through store claims every block it stores, the
    simulator's hottest path."""

    members: list[tuple[bytes, ...]] = field(default_factory=list)
    slots: list[tuple[int, ...]] = field(default_factory=list)
    targets: list[tuple[int, ...]] = field(default_factory=list)
    tenants: list[str | None] = field(default_factory=list)
    added: list[bytes] = field(default_factory=list)

    def __len__(self) -> int:
        return len(self.members)

    def add(self, members: tuple[bytes, ...], slots: tuple[int, ...], targets: tuple[int, ...],
            tenant: str | None) -> None:
        self.members.append(members)
        self.slots.append(slots)
        self.targets.append(targets)
        self.tenants.append(tenant)

    def to(self, b: int) -> list[int]:
        """The values (their positions) that backend ``b`` lacks."""
        return [j for j, t in enumerate(self.targets) if b in t]


class LackingByMask(dict[int, tuple[int, ...]]):
    """Backend mask (the index's bits) -> the writable backends not in it, in order: computed once per
    mask, then a plain dict lookup (the backend set never changes; a method call per block here was a
    tenth of the simulator's write path)."""

    def __init__(self, writable: Sequence[int]):
        super().__init__()
        self.writable = tuple(writable)

    def __missing__(self, mask: int) -> tuple[int, ...]:
        targets = self[mask] = tuple(b for b in self.writable if not (mask >> b) & 1)
        return targets


class PlanRefused(Exception):
    """A planner cannot follow a plan another planner made (:meth:`Planner.adopt_room_locked`): a slot
    it names is in use here.  The operation is skipped on this side, and reported as failed."""


@dataclass
class StoreStart:
    """What a store does, all decided at its start: per block its status so far; ``new``: positions to
    copy (pinned, in ``storing``); ``hits``: blocks already held that the write policy sends down on this
    hit; ``slots`` / ``victims``: the room for the new blocks (:meth:`room`); ``sends_down``: the new
    blocks the write policy sends down once they are stored.  The executor runs it and reports what
    happened; it asks nothing more."""

    status: list[StoreStatus]
    new: list[int]
    hits: list[bytes]
    slots: list[int]
    victims: list[CopyDown]
    sends_down: frozenset[bytes] = frozenset()
    dropped: list[Dropped] = field(default_factory=list)
    handed: list[bytes] = field(default_factory=list)  # victims copied down and handed over (the executor's)
    ready: frozenset[bytes] = frozenset()  # victims whose slots a follower took at once (Room.ready)
    keys: list[bytes] = field(default_factory=list)  # the new blocks' keys, in ``new``'s order

    def host_room(self) -> Room:
        return Room(self.slots, self.victims, self.dropped, self.ready)

    def lead(self, plan_id: int) -> LeadStore:
        """This plan as the sides that follow it get it (plain data: it crosses processes)."""
        return LeadStore(plan_id, tuple(self.new), tuple(self.hits), self.host_room(), self.sends_down)

    def room(self) -> list[int]:
        """The host slot each of the first new blocks goes to, in order: the slots taken now, then the
        slots the write-back victims hand over once copied down (if one is not, the blocks from the
        chain's head keep the usable slots and the last block finds none: it is skipped)."""
        return self.host_room().order()


@dataclass
class LoadStart:
    """A load as a leading planner started it (:meth:`Planner.start_load_locked`): the blocks it holds in
    host memory (``held``, pinned until the load is folded), the positions it does not (``fetch``), and the
    host room they are read into (``fetch[k]`` goes to ``room.order()[k]``)."""

    held: list[bytes]
    fetch: list[int]
    room: Room

    def lead(self, plan_id: int) -> LeadLoad:
        """This plan as the sides that follow it get it (plain data: it crosses processes)."""
        return LeadLoad(plan_id, tuple(self.fetch), self.room)


class Planner:
    """Placement decisions and their state for one stack (see the module docstring)."""

    def __init__(self, config: KvtierConfig, *, backends: BackendSet, metrics: StackMetrics,
                 slots: SlotTable | None, device_blocks: int, manager: TierManager | None = None,
                 tracks_device: bool = True):
        """``manager``: the scheduler half to plan for, its index and lock (vLLM's scheduler, whose manager
        answers lookups before the workers' host slots are known); None: a new one over ``backends``.
        ``tracks_device``: stores place their blocks on the device in the index (a stack's, which sees the
        engine free its blocks); False for a planner beside an engine that reuses its device blocks
        without saying so (vLLM's scheduler): its lookups must never count a block as on the device."""
        self.config = config
        self.namespace = config.namespace()
        self.storage_blocks = config.storage_blocks  # engine blocks per stored value (kvtier.format.groups)
        self.backends = backends
        self.metrics = metrics
        self.slots = slots
        self.tracks_device = tracks_device
        pol = config.policies
        self.write_policy: WritePolicy = pol.write.plugin()(pol.write.options)
        self.eviction_policy: EvictionPolicy = pol.eviction.plugin()(pol.eviction.options)
        # Its access hook, None where it keeps the base class's no-op (LRU reads the index's recency): a
        # batch of hits then skips finding which of its blocks are in host memory.
        self._on_access = (None if type(self.eviction_policy).on_access is EvictionPolicy.on_access
                           else self.eviction_policy.on_access)
        self._on_insert = (None if type(self.eviction_policy).on_insert is EvictionPolicy.on_insert
                           else self.eviction_policy.on_insert)
        # The write policy's hit hook, None where it keeps the base class's (never sends a hit down): a
        # batch of hits then asks nothing per block.
        self._on_hit = (None if type(self.write_policy).on_hit is WritePolicy.on_hit
                        else self.write_policy.on_hit)
        n_slots = slots.num_slots if slots is not None else 0
        self.index = manager.index if manager is not None else BlockIndex(capacity=max(1024, device_blocks + n_slots))
        # Entries only in backends are hints (hit counts, where a block was written); beyond this many
        # entries the oldest of them are forgotten, so the index stays bounded in a long-lived process.
        self.max_index_entries = max(1 << 20, 4 * (device_blocks + n_slots))
        self.max_unwritten = max(1, n_slots // 4)
        self.lock = manager.lock if manager is not None else threading.Lock()
        # The time a hit is stamped with: None = the clock (a deployment); a simulation sets its trace time.
        self.now: float | None = None
        self._storing: set[bytes] = set()  # device -> host copy (or direct backend write) in flight
        self._writing: set[bytes] = set()  # host -> backend copy in flight
        # Host blocks whose write-back failed (insertion order = oldest first), bounded by max_unwritten.
        self._unwritten: dict[bytes, None] = {}
        # Host blocks the write policy sent down whose write a writable backend refused or failed (it was
        # down): written again when a backend comes back (``owed_to``), settled once every one took them.
        self._owed: dict[bytes, None] = {}
        # Host blocks of whole stored-value groups (storage.block_tokens > 1): block -> its group's blocks.
        self._members: dict[bytes, tuple[bytes, ...]] = {}
        self._lacking = LackingByMask(backends.writable)
        # Host blocks stored for a cache_salt tenant: block -> its tenant tag (kvtier.quota).
        self._tenants: dict[bytes, str] = {}
        # The backend marks and evictions since the last drain_report(), for a manager in another process
        # (vLLM's scheduler); what host memory gained and lost since the last drain_host_changes() (vLLM's
        # scheduler, leading: its event stream).  None = nobody listens, nothing recorded.
        self._report: WorkerReport | None = None
        self._host_changes: HostChanges | None = None
        # The scheduler half: the same index and lock.
        if manager is None:
            manager = TierManager(config, backends=backends, index=self.index, lock=self.lock)
            manager.on_forgotten = self._backend_evicted_locked
        self.manager = manager

    # ------------------------------------------------------------------ host slots and blocks

    def host_slots(self) -> SlotTable:
        if self.slots is None:
            raise RuntimeError("this stack has no host tier (host.capacity: 0)")
        return self.slots

    def hit_locked(self, key: bytes) -> int:
        """Count a hit (a reuse): recency for eviction, and the count write policies look at."""
        hits = self.index.touch(key, self.now)
        if self.index.host_slot(key) is not None:
            self.eviction_policy.on_access(Tier.HOST, [key])
        return hits

    def hits_sent_down_locked(self, keys: Sequence[bytes]) -> list[bytes]:
        """:meth:`hit_locked` on each of ``keys`` in order; those the write policy sends down on that hit.
        One pass for a batch (a load's or a store's hits: the simulator's hottest path)."""
        if not keys:
            return []
        on_hit = self._on_hit
        counts = self.index.touch_many(keys, self.now)
        if self._on_access is not None:
            in_host = [key for key, h in zip(keys, self.index.host_slots(keys)) if h >= 0]
            if in_host:
                self._on_access(Tier.HOST, in_host)
        if on_hit is None:
            return []
        return [key for key, n in zip(keys, counts) if on_hit(key, n)]

    def commit_host_locked(self, key: bytes, slot: int) -> int:
        """Record ``key`` in host ``slot`` (READY or WRITING, unpinned) unless another slot already holds
        it (a concurrent store or fetch won): then ``slot`` is freed.  Returns the slot holding ``key``."""
        e = self.index.get(key)
        table = self.host_slots()
        if e is not None and e.host is not None and e.host != slot:
            table.free([slot])
            return e.host
        if table.state(slot) == WRITING:
            table.commit([slot], [key])
        if key not in self.index:
            self.index.insert(key)
        self.index.set_host(key, slot)
        self.eviction_policy.on_insert(Tier.HOST, [key])
        if self._host_changes is not None:
            self._host_changes.in_host[key] = slot
            self._host_changes.left_host.discard(key)
        return slot

    def commit_host_many_locked(self, keys: Sequence[bytes], slots: Sequence[int]) -> list[int]:
        """:meth:`commit_host_locked` of each (key, slot) in order, in one pass over the index and one
        call of the slot table and the eviction policy each.  Returns the slot holding each key."""
        if len(keys) != len(slots):
            raise ValueError(f"commit_host_many_locked: {len(keys)} keys for {len(slots)} host slots")
        if not keys:
            return []
        table = self.host_slots()
        landed = self.index.land_host_many(keys, slots)
        lost: list[int] = []
        if all(landed):  # the usual case: every key landed in its slot (no listing of which did)
            ok_keys, ok_slots = keys, slots
        else:
            ok_keys = [key for key, good in zip(keys, landed) if good]
            ok_slots = [slot for slot, good in zip(slots, landed) if good]
            lost = [slot for slot, good in zip(slots, landed) if not good]
        if ok_slots:
            try:  # the usual case: every slot is being filled
                table.commit(ok_slots, ok_keys)
            except ValueError:  # some hold their key already (a re-commit): commit the others
                filling = [w for w in zip(ok_slots, ok_keys, table.in_state(ok_slots, WRITING)) if w[2]]
                if filling:
                    table.commit([w[0] for w in filling], [w[1] for w in filling])
        if lost:
            table.free(lost)
        if ok_keys and self._on_insert is not None:
            self._on_insert(Tier.HOST, ok_keys)
        changes = self._host_changes
        if changes is not None:
            for key, slot in zip(ok_keys, ok_slots):
                changes.in_host[key] = slot
                changes.left_host.discard(key)
        if not lost:
            return list(slots)
        held = self.index.host_slots(keys)
        return [slot if good else h for slot, good, h in zip(slots, landed, held)]

    def drop_host_locked(self, key: bytes, *, hand_over: bool = False) -> int | None:
        """Evict ``key`` from host memory (unpinned): its slot becomes free, or with ``hand_over`` WRITING
        for the block planned to take its place (``SlotTable.reuse``).  Returns that slot."""
        slot = self.index.clear_host(key)
        self._unwritten.pop(key, None)
        self._owed.pop(key, None)
        self._members.pop(key, None)
        self._tenants.pop(key, None)
        if slot is not None:
            if hand_over:
                self.host_slots().reuse([slot])
            else:
                self.host_slots().free([slot])
            self.eviction_policy.on_remove(Tier.HOST, [key])
            self.metrics.add("host", evictions=1)
            if self._host_changes is not None:
                self._host_changes.in_host.pop(key, None)
                self._host_changes.left_host.add(key)
        self.index.discard_if_unused(key)
        return slot

    def copying_locked(self, key: bytes) -> bool:
        """Whether a copy of ``key`` to a backend is in flight (it cannot be evicted now)."""
        return key in self._writing

    def release_slots(self, slots: Sequence[int]) -> None:
        """Give back WRITING slots that were not used."""
        if slots:
            self.host_slots().free(list(slots))

    def take_room_locked(self, n: int) -> Room:
        """Room for up to ``n`` blocks, decided now and without I/O: WRITING slots (free slots first, then
        the slots of victims the eviction policy drops), and the victims the write policy wants written
        back first, held (an index reference, ``writing``), each naming the slot it hands over once copied
        (:meth:`written_back_locked`).  The whole room is known here: ``slots`` then the victims' slots,
        in that order, are the slots the first blocks of the caller's batch go to, whenever the
        write-backs end."""
        table = self.host_slots()
        slots = table.allocate(min(n, table.num_free)).slots if n > 0 else []
        need, wb, dropped = n - len(slots), [], []
        if need > 0:
            self.manager.fold_evictions_locked()  # a write-back must not skip a backend that evicted the block
        seen: set[bytes] = set()
        lacking, grouped = self._lacking, self.storage_blocks > 1
        # Victims evicted unwritten, in order, evicted together (one pass over the index and the slot
        # table) before anything reads what evicting them changes: a value's other blocks (whether it is
        # still whole), ``unwritten`` (a dropped block leaves it), the eviction policy's next victims.
        drops: list[bytes] = []
        while need > 0:
            fresh = [k for k in self.eviction_policy.victims(self.index, Tier.HOST, need + len(seen))
                     if k not in seen]
            if not fresh:
                break
            idx = self.index
            for key, host, mask, refs in zip(fresh, idx.host_slots(fresh), idx.masks(fresh), idx.refs_many(fresh)):
                seen.add(key)
                if need == 0 or host < 0 or refs or key in self._writing:
                    continue  # only unpinned host blocks with no copy down in flight are evictable
                targets = lacking[mask]
                if targets and drops and (grouped or key in self._unwritten):
                    dropped += self._hand_over_many_locked(drops)
                    drops = []
                if targets and self.group_of_locked(key) is None:
                    targets = ()  # a block of a value no longer whole in host memory cannot be written
                if targets and key in self._unwritten and len(self._unwritten) > self.max_unwritten:
                    # Its write-back already failed and too many blocks wait on failing writes: evict it
                    # unwritten (a future miss) rather than let a refusing backend hold host memory.
                    drops.append(key)
                    self.metrics.add("host", dropped=1)
                elif targets and self.write_policy.on_evict(key):
                    self.index.acquire(key)
                    self._writing.add(key)
                    wb.append(CopyDown(key, host, targets))
                else:
                    drops.append(key)
                need -= 1
            dropped += self._hand_over_many_locked(drops)
            drops = []
        if dropped:
            slots.extend([d.slot for d in dropped])
        return Room(slots, wb, dropped)

    def adopt_room_locked(self, room: Room) -> Room:
        """Follow a room another planner decided for this planner's copy of the same blocks (vLLM: the
        scheduler's, for each rank): take exactly its slots and hold exactly its victims, so that the same
        blocks land in the same slots on every side.  The leader's word wins over what this side holds
        that the leader does not know of: a named slot holding an unpinned block here that the plan does
        not name is evicted here, and a write-back victim no longer in its slot here hands that slot over
        at once (``Room.ready``: nothing to copy down).  Refused (:class:`PlanRefused`, nothing taken)
        where a named slot is in use here (a store or read in flight, a pinned block, a copy down).
        Returns the room this planner's executor runs."""
        table = self.host_slots()
        for slot in room.order():
            if not 0 <= slot < table.num_slots:
                raise PlanRefused(f"host slot {slot} is out of range (this side has {table.num_slots})")
            state = table.state(slot)
            if state is WRITING:
                raise PlanRefused(f"host slot {slot} is being filled here")
            holder = self.index.key_at_host(slot) if state is READY else None
            if state is READY and holder is None:
                raise PlanRefused(f"host slot {slot} holds a block this side's index does not place there")
            if holder is not None and (self.index.entry(holder).refs or holder in self._writing):
                raise PlanRefused(f"host slot {slot} holds block {holder.hex()[:16]}, in use here")
        if len(set(room.order())) != len(room.order()):
            raise PlanRefused("the room names a host slot twice")
        dropped: list[Dropped] = []
        for slot in room.slots:
            dropped += self._clear_slot_locked(slot)
        ready: set[bytes] = set()
        for v in room.victims:
            if self.index.key_at_host(v.slot) == v.key:
                self.index.acquire(v.key)
                self._writing.add(v.key)
            else:  # gone from its slot here already (a read here took the slot): nothing to copy down
                dropped += self._clear_slot_locked(v.slot)
                ready.add(v.key)
        return Room(list(room.slots), list(room.victims), dropped, frozenset(ready))

    def _clear_slot_locked(self, slot: int) -> list[Dropped]:
        """Take host ``slot`` (checked usable by the caller), WRITING: free here, or evict its block."""
        holder = self.index.key_at_host(slot)
        if holder is None:
            self.host_slots().take([slot])
            return []
        return [Dropped(holder, self._hand_over_locked(holder))]

    def _hand_over_locked(self, key: bytes) -> int:
        """Evict host block ``key`` and hand its slot, WRITING, to the block taking its place."""
        slot = self.drop_host_locked(key, hand_over=True)
        if slot is None:
            raise AssertionError(f"planner: victim {key.hex()[:16]} has no host slot to hand over")
        return slot

    def _hand_over_many_locked(self, keys: Sequence[bytes]) -> list[Dropped]:
        """:meth:`_hand_over_locked` of each of ``keys`` in order, in one pass over the index, one call of
        the slot table, the eviction policy and the metrics each."""
        if not keys:
            return []
        slots = self.index.drop_host_many(keys)  # clear_host, then discard_if_unused, of each
        if min(slots) < 0:
            key = keys[slots.index(min(slots))]
            raise AssertionError(f"planner: victim {key.hex()[:16]} has no host slot to hand over")
        for side in (self._unwritten, self._owed, self._members, self._tenants):
            if side:  # most are empty most of the time (no failed writes, values of one block, no tenants)
                for key in keys:
                    side.pop(key, None)
        self.host_slots().reuse(slots)
        self.eviction_policy.on_remove(Tier.HOST, keys)
        self.metrics.add("host", evictions=len(keys))
        changes = self._host_changes
        if changes is not None:
            for key in keys:
                changes.in_host.pop(key, None)
                changes.left_host.add(key)
        return [Dropped(key, slot) for key, slot in zip(keys, slots)]

    def written_back_locked(self, victims: Sequence[CopyDown], written: dict[bytes, bool]) -> list[int]:
        """Victims of ``take_slots_locked`` were copied down (``written``: per key, whether a backend took
        it): evict those a backend took and nobody referenced meanwhile, and return their own slots,
        WRITING, in the victims' order (the room the plan named: never a slot another caller freed
        meanwhile, so the same plan places the same blocks in the same slots whenever its write-backs
        end).  A victim still dirty or referenced keeps its slot: the caller's batch has that much less
        room (its chain's head keeps what there is)."""
        handed: list[int] = []
        for v in victims:
            key, slot = v.key, v.slot
            self._writing.discard(key)
            self.index.unpin(key)
            e = self.index.get(key)
            if written.get(key):
                self._unwritten.pop(key, None)
            elif e is not None and e.host == slot:
                self._unwritten[key] = None  # still dirty in host memory: counts against the bound
            if written.get(key) and e is not None and e.refs == 0 and e.host == slot:
                handed.append(self._hand_over_locked(key))
            else:
                self.index.discard_if_unused(key)
        return handed

    def abandon_victims(self, victims: Sequence[CopyDown]) -> None:
        """Victims that will not be copied after all (the store that wanted their slots was dropped)."""
        if victims:
            with self.lock:
                for v in victims:
                    self._writing.discard(v.key)
                    self.index.release(v.key)

    def trim_index_locked(self) -> None:
        """Forget the least recently used backend-only entries once the index is over its bound."""
        excess = len(self.index) - self.max_index_entries
        if excess <= 0:
            return
        excess += self.max_index_entries // 8  # trim in batches: the scan below is O(entries)
        for i in range(len(self.backends)):
            for key in self.index.eviction_candidates(Tier.backend(i), excess):
                e = self.index.get(key)
                if e is not None and e.refs == 0 and e.device is None and e.host is None:
                    self.index.remove(key)
                    excess -= 1
            if excess <= 0:
                return

    # ------------------------------------------------------------------ store

    def start_store_locked(self, hashes: list[bytes], ids: list[int]) -> StoreStart:
        """Classify a store's blocks: already held (host memory, or with no host tier the writable
        backends), already being stored, or new (pinned, in ``storing``); take host slots for the new ones.
        Placing a block, or pinning one, changes no later block's host slot or backend marks: the steps run
        over the batch."""
        status, new, fresh, hits = self._classify_store_locked(hashes, ids)
        room = self.take_room_locked(len(new)) if self.slots is not None and new else Room([], [])
        down = frozenset(self.write_policy.sends_on_store(fresh[:len(room.slots) + len(room.victims)]))
        return StoreStart(status, new, hits, room.slots, room.victims, down, room.dropped, keys=fresh)

    def adopt_store_locked(self, hashes: list[bytes], ids: list[int], lead: LeadStore) -> StoreStart:
        """Follow a store another planner started over the same blocks (:meth:`StoreStart.lead`): the same
        new blocks, in the room it named (:meth:`adopt_room_locked`), sent down as it said.  Where this side
        differs, the plan wins: a block it stores that this side holds already (brought up by a load here)
        is stored again in the plan's slot, its copy here dropped; a block new here that the plan does not
        store is not stored here.  Refused (:class:`PlanRefused`, nothing held) where a block the plan
        stores is in use here (pinned, being stored or copied down), or its room cannot be followed."""
        status, new, _, _ = self._classify_store_locked(hashes, ids)
        mine = set(new)
        try:
            extra = [i for i in lead.new if i not in mine]
            for i in extra:
                e = self.index.get(hashes[i])
                if (hashes[i] in self._storing or e is None or e.host is None or e.refs
                        or hashes[i] in self._writing):
                    raise PlanRefused(f"block {hashes[i].hex()[:16]} (position {i}), which the plan stores, is in "
                                      "use here")
            for i in extra:
                self.drop_host_locked(hashes[i])
            room = self.adopt_room_locked(lead.room) if self.slots is not None and lead.new else Room([], [])
        except PlanRefused:
            self._storing.difference_update(hashes[i] for i in new)
            self.index.release_many([hashes[i] for i in new])
            raise
        for i in extra:  # stored again here, as new
            self._storing.add(hashes[i])
            self.index.acquire(hashes[i])
            status[i] = SKIPPED
        planned = set(lead.new)
        for i in new:
            if i not in planned:  # not the plan's: not stored here
                self._storing.discard(hashes[i])
                self.index.release(hashes[i])
        return StoreStart(status, list(lead.new), list(lead.hits), room.slots, room.victims, lead.sends_down,
                          room.dropped, ready=room.ready, keys=[hashes[i] for i in lead.new])

    def fold_store_locked(self, plan: StoreStart, hashes: Sequence[bytes], sides: Sequence[HostOutcome],
                          start: int = 0, tenant: str | None = None) -> list[bytes]:
        """The leader's end of a store ``plan`` (:meth:`start_store_locked` here) that every side ran on its
        own shard of the blocks (``sides``: one outcome per side, vLLM's ranks; no bytes here).  A victim
        counts copied down only where every side handed its slot over, and a new block stored only where
        every side stored it, in the slot this planner's order gives it; anything else is failed here and
        its slot freed, so this planner places a block in a slot only where every side holds it there.
        Returns the blocks the plan sends down (the sides write them)."""
        handed = self._fold_victims_locked(plan.victims, sides)
        slots = plan.slots + handed
        take = plan.new[:len(slots)]
        placed = [plan.slots + [v.slot for v in plan.victims if v.key in r.handed] for r in sides]
        ok = [bool(sides) and all(j < len(there) and there[j] == slots[j] and i in r.placed
                                  for r, there in zip(sides, placed))
              for j, i in enumerate(take)]
        keys = [hashes[i] for i in take]
        self.release_slots([slot for slot, good in zip(slots, ok) if not good])
        down = self.stored_locked(plan, take, keys, slots[:len(take)], ok, tenant)
        self.remember_store_locked(hashes, start)
        for i in plan.new[len(take):]:  # no room for them here: not stored
            self._storing.discard(hashes[i])
            self.index.release(hashes[i])
        return down

    def _fold_victims_locked(self, victims: Sequence[CopyDown], sides: Sequence[HostOutcome]) -> list[int]:
        """The leader's end of a plan's write-back ``victims``: each counts copied down only where every
        side handed it over; returns the slots handed over here (``written_back_locked``)."""
        everywhere = frozenset.intersection(*(r.handed for r in sides)) if sides else frozenset()
        handed = self.written_back_locked(victims, {v.key: v.key in everywhere for v in victims})
        # A victim some sides handed over and others kept is no longer in host memory everywhere: it
        # leaves here too, and its slot is free here (each side evicts what it holds there, a block this
        # planner does not know of, when a later plan names the slot: adopt_room_locked).
        somewhere = frozenset().union(*(r.handed for r in sides)) - everywhere
        for v in victims:
            e = self.index.get(v.key)
            if v.key in somewhere and e is not None and e.host == v.slot and e.refs == 0:
                self.drop_host_locked(v.key)
        return handed

    def _classify_store_locked(self, hashes: list[bytes], ids: list[int]) -> tuple[list[StoreStatus], list[int],
                                                                                  list[bytes], list[bytes]]:
        """Per block of a store: PRESENT (held, or in another store) or new (pinned, in ``storing``); the new
        blocks' positions and keys; and the held blocks the write policy sends down on this hit."""
        n = len(hashes)
        status = [SKIPPED] * n
        new: list[int] = []
        seen: set[bytes] = set()
        idx, writable, storing = self.index, self.backends.writable, self._storing
        if self.slots is not None:  # held: in a host slot (>= 0)
            held = idx.host_slots(hashes)
        else:
            held = [0 if writable and idx.in_backends(key, writable) else -1 for key in hashes]
        reused: list[bytes] = []  # held blocks, each once: a hit (placing or pinning a block changes no hit)
        for i, key in enumerate(hashes):
            if key in seen or key in storing or held[i] >= 0:
                status[i] = PRESENT
                if key not in seen:
                    reused.append(key)
                seen.add(key)
                continue
            seen.add(key)  # (a later copy of a new key is caught here, so ``storing`` can grow after the loop)
            new.append(i)
        fresh = [hashes[i] for i in new]
        storing.update(fresh)
        # Pinned before they are placed: placing a pinned block leaves it out of the device's LRU list, where
        # placing then pinning linked and unlinked it (the same order once the store releases them).  A
        # placement changes no host slot or backend mark, so the classification above stands.
        idx.acquire_many(fresh)
        if self.tracks_device:
            idx.place_on_device_many(hashes, ids)
        return status, new, fresh, self.hits_sent_down_locked(reused)

    def stored_locked(self, plan: StoreStart, take: Sequence[int], keys: Sequence[bytes], slots: Sequence[int],
                      ok: Sequence[bool], tenant: str | None = None) -> list[bytes]:
        """The device -> host copies of store ``plan`` landed (``ok`` per block): commit them (charged to
        ``tenant``, the store's), set the plan's ``status``, and return the blocks it sends down now."""
        return self._land_locked(plan, take, keys, slots, ok, tenant)[0]

    def land_store_locked(self, plan: StoreStart, hashes: Sequence[bytes], start: int, slots: Sequence[int],
                          ok: Sequence[bool] | None = None, tenant: str | None = None) -> ValueWrites:
        """A store's end where this planner's executor ran it: the plan's first ``len(slots)`` new blocks
        were copied into ``slots`` (the chain's head gets the room; ``ok`` per block, None: every copy
        landed).  :meth:`stored_locked` of them, the whole values the store of ``hashes`` at chain position
        ``start`` holds remembered (:meth:`remember_store_locked`), and what the write policy sends down
        claimed for writing (:meth:`claim_to_write_locked`), in one call: the values to write (release
        them with :meth:`release_groups`)."""
        n = len(slots)
        down, at = self._land_locked(plan, plan.new[:n], plan.keys[:n], slots, ok, tenant)
        if self.storage_blocks > 1:
            self.remember_store_locked(hashes, start)
            return self.claim_to_write_locked(down) if down else ValueWrites()
        if not down:
            return ValueWrites()
        self.manager.fold_evictions_locked()  # as claim_to_write_locked: an evicted block is written again
        # Each is a block this call placed in its slot (``at``), once: no lookup of either.
        return self._claim_blocks_locked(down, frozenset(), at)

    def _land_locked(self, plan: StoreStart, take: Sequence[int], keys: Sequence[bytes], slots: Sequence[int],
                     ok: Sequence[bool] | None, tenant: str | None) -> tuple[list[bytes], list[int]]:
        """:meth:`stored_locked`'s steps (``ok`` None: every copy landed); the blocks sent down and their
        slots."""
        status = plan.status
        down: list[bytes] = []
        at: list[int] = []
        n = min(len(take), len(keys), len(slots), len(ok) if ok is not None else len(slots))
        take, keys, slots = take[:n], keys[:n], slots[:n]
        if ok is None or all(ok):  # the usual case: every copy landed (one commit of the batch, no listing)
            held: Sequence[int | None] = self.commit_host_many_locked(keys, slots)
        else:
            landed = [j for j, good in enumerate(ok[:n]) if good]
            where = dict(zip(landed, self.commit_host_many_locked([keys[j] for j in landed],
                                                                   [slots[j] for j in landed])))
            held = [where.get(j) for j in range(n)]
        sends = plan.sends_down
        self._storing.difference_update(keys)
        if held == list(slots):  # the usual case: every block landed in its planned slot
            for i in take:
                status[i] = STORED
            if tenant is not None:
                self._tenants.update(dict.fromkeys(keys, tenant))
            if sends.issuperset(keys):  # write-through: all of them go down
                down, at = list(keys), list(slots)
            else:
                down = [k for k in keys if k in sends]
                at = [h for k, h in zip(keys, slots) if k in sends]
        else:
            for i, key, slot, want in zip(take, keys, held, slots):
                if slot is None:
                    status[i] = FAILED
                elif slot == want:
                    if tenant is not None:
                        self._tenants[key] = tenant
                    status[i] = STORED
                    if key in sends:
                        down.append(key)
                        at.append(slot)
                else:
                    status[i] = PRESENT
        self.index.release_many(keys)
        return down, at

    def end_stores(self, keys: Sequence[bytes]) -> None:
        """Stores of ``keys`` are over without landing in host memory (skipped, failed, written direct)."""
        with self.lock:
            for key in keys:
                self._storing.discard(key)
                self.index.release(key)

    def store_groups(self, hashes: Sequence[bytes], start: int) -> list[tuple[bytes, ...]]:
        """The whole stored values (groups of ``storage_blocks`` keys) a store of ``hashes`` at chain
        position ``start`` holds."""
        return [tuple(hashes[a:b + 1]) for a, b in whole_groups(start, len(hashes), self.storage_blocks)]

    # ------------------------------------------------------------------ writes to backends

    def claim_to_write_locked(self, keys: Sequence[bytes]) -> ValueWrites:
        """The write policy sends host blocks ``keys`` down: the stored values to copy (the whole value each
        is in: the block itself when a value is one block), claimed (:meth:`claim_groups_locked`); values
        already in every writable backend, no longer whole in host memory, or already being copied are left
        alone.  A value a backend then refuses is owed to it (:meth:`put_done_locked` with ``owed``)."""
        self.manager.fold_evictions_locked()  # a block a backend evicted is written to it again
        if self.storage_blocks == 1:  # a value is its block (a claim skips one not in host memory)
            return self._claim_blocks_locked(keys, frozenset())
        uniq = list(dict.fromkeys(keys))
        return self.claim_groups_locked([g for g in map(self.group_of_locked, uniq) if g is not None])

    def begin_put_locked(self, b: int) -> int:
        """Values are about to be written to backend ``b``: the put's ticket for :meth:`put_done_locked`."""
        return self.manager.begin_writes_locked(b)

    def put_done_locked(self, b: int, ticket: int, values: Sequence[tuple[bytes, ...]], ok: Sequence[bool], *,
                        owed: bool = False) -> None:
        """Backend ``b`` took (``ok``) or refused each value of the put :meth:`begin_put_locked` gave
        ``ticket``: mark every block of a value it took (unless the backend evicted it during its own
        write), settle what was owed, and keep the index in its bound (:meth:`trim_index_locked`).
        ``owed``: the write policy sent these values down (:meth:`claim_to_write_locked`), so the host
        blocks of those refused are owed to the backends (:meth:`owed_to`)."""
        evicted = self.manager.end_writes_locked(b, ticket, map(_last, values))
        landed = all(ok)
        # A value evicted during its own write is not there.
        if not evicted and landed:  # the usual case: every block of every value (flattened in C)
            took = list(chain.from_iterable(values))
        else:
            took = [key for members, good in zip(values, ok) if good and members[-1] not in evicted
                    for key in members]
        self.index.add_backend_many(took, b)  # keys not in the index are skipped
        debt = self._owed
        if owed and not landed:
            refused = [key for members, good in zip(values, ok) if not good for key in members]
            debt.update((key, None) for key, h in zip(refused, self.index.host_slots(refused)) if h >= 0)
        if debt:  # settled where every writable backend has it now
            due = [key for key in took if key in debt]
            lacking = self._lacking
            for key, mask in zip(due, self.index.masks(due)):
                if not lacking[mask]:
                    debt.pop(key, None)
        report = self._report
        if report is not None:  # a manager elsewhere learns it without asking the backend
            for key in took:
                report.in_backend.add((key, b))
                report.left_backend.discard((key, b))
        if len(self.index) > self.max_index_entries:  # the marks may have grown it past its bound
            self.trim_index_locked()

    def owed_to(self, i: int, in_host: Sequence[bytes]) -> list[bytes]:
        """Backend ``i`` is back after an outage: the host blocks to write to it again, those it was known
        to hold (it may have come back empty) and those the write policy sent down whose writes failed or
        were refused meanwhile.  Not the write-back victims that failed (``unwritten``): write-back wants a
        block written when it is evicted, which those are again (and then written) at their next
        eviction."""
        with self.lock:
            wanted = dict.fromkeys([*in_host, *self._owed])
            return [k for k in wanted if self.index.host_slot(k) is not None]

    # ------------------------------------------------------------------ stored values (groups of blocks)

    def remember_group_locked(self, members: tuple[bytes, ...]) -> None:
        """Record a whole value of several blocks for the blocks of it in host memory, so a later write of
        one of them (write-back on eviction, a selective write on a hit) writes the value.  Entries leave
        with their block's host copy.  A value of one block needs no record (:meth:`group_of_locked`
        answers it without one), so only stores and reads of values of several blocks call this."""
        for key in members:
            if self.index.host_slot(key) is not None:
                self._members[key] = members

    def remember_store_locked(self, hashes: Sequence[bytes], start: int) -> None:
        """Remember the whole values a store of ``hashes`` at chain position ``start`` holds."""
        if self.storage_blocks > 1:
            for g in self.store_groups(hashes, start):
                self.remember_group_locked(g)

    def group_of_locked(self, key: bytes) -> tuple[bytes, ...] | None:
        """The whole stored value a host block belongs to, if known and every block of it is in host
        memory: the block alone when values are single blocks."""
        if self.storage_blocks == 1:
            return (key,) if self.index.host_slot(key) is not None else None
        members = self._members.get(key)
        if members is None or any(self.index.host_slot(m) is None for m in members):
            return None
        return members

    def claim_groups_locked(self, groups: Sequence[tuple[bytes, ...]],
                            mine: frozenset[bytes] = frozenset()) -> ValueWrites:
        """Claim each value (a group of ``storage_blocks`` blocks, or one block) that is whole in host
        memory, not being written, and missing from a writable backend: its blocks go into ``writing`` (so
        none is evicted while it is written) until :meth:`release_groups`; ``mine``: blocks the caller
        already holds for writing (a write-back victim)."""
        if self.storage_blocks == 1:
            return self._claim_blocks_locked([g[0] for g in groups], mine)
        todo = ValueWrites()
        lacking = self._lacking
        # Values every writable backend holds are left first, in one pass (a write-through store's hits
        # are most of what it is asked to write, and all there already).  A claim changes only
        # ``writing``, read live below.
        uniq = list(dict.fromkeys(groups))
        wanted = [(g, m) for g, m in zip(uniq, self.index.masks([g[-1] for g in uniq])) if lacking[m]]
        slots_of = self.index.host_slots([k for members, _ in wanted for k in members])
        writing, tenants, added = self._writing, self._tenants, todo.added
        at = 0
        for members, mask in wanted:
            group_slots = slots_of[at:at + len(members)]
            at += len(members)
            if min(group_slots) < 0 or any(k in writing and k not in mine for k in members):
                continue
            fresh = [k for k in members if k not in writing]
            writing.update(fresh)
            added += fresh
            todo.add(members, tuple(group_slots), lacking[mask], tenants.get(members[-1]))
        return todo

    def _claim_blocks_locked(self, keys: Sequence[bytes], mine: frozenset[bytes],
                             slots: Sequence[int] | None = None) -> ValueWrites:
        """:meth:`claim_groups_locked` where every value is one block (``keys``: theirs): the same steps in
        one pass over the keys, the columns filled here (this runs for every block a write-through store
        writes: the simulator's hottest path).  ``slots``: the host slot of each key, where the caller
        knows them (``keys`` then distinct: the blocks a store just placed)."""
        lacking, writing, tenants = self._lacking, self._writing, self._tenants
        if slots is None:
            keys = list(dict.fromkeys(keys))
            slots = self.index.host_slots(keys)
        else:
            lacks_all = list(map(lacking.__getitem__, self.index.masks(keys)))
            if all(lacks_all) and writing.isdisjoint(keys):  # none in a backend yet: every one, in columns
                writing.update(keys)
                return ValueWrites(list(zip(keys)), list(zip(slots)), lacks_all,
                                   [tenants.get(k) for k in keys] if tenants else [None] * len(keys), list(keys))
        todo = ValueWrites()
        members, slot_of, targets, tenant_of, added = todo.members, todo.slots, todo.targets, todo.tenants, todo.added
        for key, mask, slot in zip(keys, self.index.masks(keys), slots):
            if slot < 0:
                continue
            lacks = lacking[mask]
            if not lacks:
                continue  # every writable backend holds it
            if key in writing:
                if key not in mine:
                    continue
            else:
                writing.add(key)
                added.append(key)
            members.append((key,))
            slot_of.append((slot,))
            targets.append(lacks)
            tenant_of.append(tenants.get(key) if tenants else None)
        return todo

    def release_groups(self, claims: ValueWrites) -> None:
        with self.lock:
            self._writing.difference_update(claims.added)

    # ------------------------------------------------------------------ load and fetch

    def plan_load_locked(self, hashes: Sequence[bytes], ids: list[int]) -> LoadPlan:
        """Where each block of the longest loadable prefix comes from: host memory, the same device block
        (no copy), or the backends (FETCH).  The planned blocks are pinned (one call: a pin changes no later
        block's plan) and the device blocks about to be overwritten forget what they held."""
        sources: list[Source]
        idx = self.index
        host, same, fetch = Source.HOST, Source.SAME, Source.FETCH
        at_device = idx.key_at_device
        if len(self.backends) > 0 and len(ids) >= len(hashes):
            # Every block has a source (the backends at worst), so all are pinned, and their host slots read,
            # in one pass first (a pin moves no block; an index without a host tier has no host slots).
            in_host: list[int] = []
            idx.acquire_many(hashes, in_host)
            sources = [host if h >= 0 else same if at_device(b) == key else fetch
                       for key, b, h in zip(hashes, ids, in_host)]
        else:
            sources = []
            in_host = idx.host_slots(hashes) if self.slots is not None else [-1] * len(hashes)
            for key, b, h in zip(hashes, ids, in_host):
                if h >= 0:
                    sources.append(host)
                elif at_device(b) == key:
                    sources.append(same)
                elif self.backends:
                    sources.append(fetch)
                else:
                    break  # nowhere to get it from: the usable prefix ends here
            idx.acquire_many(hashes[:len(sources)])
        n = len(sources)
        idx.free_devices([b for src, b in zip(sources, ids) if src is not same])
        return LoadPlan(sources, in_host[:n])

    def start_load_locked(self, hashes: Sequence[bytes], into_host: bool) -> LoadStart:
        """Lead a load that other planners' stacks run (vLLM: the scheduler's, for every rank): pin the
        blocks in host memory here until it is folded (no store's room may take their slots meanwhile), and,
        with ``into_host`` (the sides read from backends into host memory, not straight into the engine's
        KV), take the host room of the others, in chain order."""
        in_host = self.index.host_slots(hashes) if self.slots is not None else [-1] * len(hashes)
        held = [key for key, h in zip(hashes, in_host) if h >= 0]
        fetch = [i for i, h in enumerate(in_host) if h < 0]
        self.index.acquire_many(held)
        room = self.take_room_locked(len(fetch)) if into_host and fetch and self.slots is not None else Room([], [])
        return LoadStart(held, fetch, room)

    def fold_load_locked(self, plan: LoadStart, hashes: Sequence[bytes], sides: Sequence[HostOutcome],
                         start: int = 0) -> None:
        """The leader's end of a load ``plan`` (:meth:`start_load_locked` here) every side ran on its own
        shard: a block it read is placed in the slot the room named only where every side placed it there
        (a side's room hands a position its named slot or none), a victim counts copied down only where
        every side handed it over; every other slot of the room is freed here."""
        room = plan.room
        handed = set(self._fold_victims_locked(room.victims, sides))
        order, n_free = room.order(), len(room.slots)
        settled: set[int] = set()
        for k, i in enumerate(plan.fetch[:len(order)]):
            slot = order[k]
            if (k < n_free or slot in handed) and sides and all(i in r.placed for r in sides):
                self.commit_host_locked(hashes[i], slot)  # placed, or freed: another slot holds it already
                settled.add(slot)
        self.release_slots([s for s in [*room.slots, *handed] if s not in settled])
        self.remember_store_locked(hashes, start)
        self.index.release_many(plan.held)

    def loaded_locked(self, hashes: Sequence[bytes], ids: list[int], num: int, planned: int) -> list[bytes]:
        """A load finished with its first ``num`` blocks on the device: place them, count the hits, unpin
        the ``planned`` blocks; the blocks the write policy sends down on this hit."""
        if self._on_access is None and self._on_hit is None:
            # No policy hook sees a hit (the base classes'): placed, counted and unpinned in one pass.
            try:
                self.index.loaded_many(hashes[:num], ids[:num], self.now)
            finally:
                self.index.release_many(hashes[num:planned])
            return []
        try:
            self.index.place_on_device_many(hashes[:num], ids[:num])
            return self.hits_sent_down_locked(hashes[:num])
        finally:
            self.index.release_many(hashes[:planned])

    def mark_read_locked(self, key: bytes, b: int) -> None:
        """Backend ``b`` delivered ``key`` (verified)."""
        if key in self.index:
            self.index.add_backend(key, b)

    def mark_read_many_locked(self, keys: Sequence[bytes], b: int) -> None:
        """:meth:`mark_read_locked` of each of ``keys``."""
        self.index.add_backend_many(keys, b)

    def mark_missing_locked(self, key: bytes, b: int) -> None:
        """Backend ``b`` did not deliver ``key`` although the index said it held it: the hint was stale."""
        if key in self.index and b in self.index.entry(key).backends:
            self.index.remove_backend(key, b)

    def pin(self, keys: Sequence[bytes]) -> None:
        with self.lock:
            for key in keys:
                self.index.acquire(key)

    def unpin(self, keys: Sequence[bytes]) -> None:
        with self.lock:
            for key in keys:
                self.index.release(key)

    def leading_in_memory(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``hashes`` in host memory or on the device."""
        with self.lock:
            return self.index.lookup_prefix(list(hashes)).in_memory

    def device_freed(self, block_ids: Sequence[int]) -> None:
        with self.lock:
            self.index.free_devices(block_ids)

    # ------------------------------------------------------------------ reports and observability

    def drain_report(self) -> WorkerReport:
        """Backend writes, and blocks the backends evicted, since the last call (recording starts with the
        first call)."""
        with self.lock:
            self.manager.fold_evictions_locked()
            out, self._report = self._report or WorkerReport(), WorkerReport()
        return out

    def drain_host_changes(self) -> HostChanges:
        """Blocks placed in and gone from host memory since the last call (recording starts with the first
        call)."""
        with self.lock:
            out, self._host_changes = self._host_changes or HostChanges(), HostChanges()
        return out

    def _backend_evicted_locked(self, key: bytes, backend: int) -> None:
        """Backend ``backend`` evicted ``key`` (the manager has unmarked it there): a manager in another
        process must forget it too, or it offers a hit every load of which fails."""
        if self._report is not None:
            self._report.left_backend.add((key, backend))
            self._report.in_backend.discard((key, backend))

    def counts(self) -> dict[str, int]:
        """The index and in-flight sizes (stats, gauges)."""
        with self.lock:
            return {"entries": len(self.index), "device": self.index.count(Tier.DEVICE),
                    "host": self.index.count(Tier.HOST), "pinned": self.index.pinned,
                    "writing_down": len(self._writing), "unwritten": len(self._unwritten),
                    "owed": len(self._owed),
                    **{n: self.index.count(Tier.backend(i)) for i, n in enumerate(self.backends.names)}}

    def check_locked(self) -> None:
        """Raise AssertionError naming the first invariant that does not hold (call when nothing is in
        flight: a settled stack)."""
        if self.slots is not None:
            slot_of: dict[int, bytes] = {}
            for key in list(self.index):
                slot = self.index.host_slot(key)
                if slot is None:
                    continue
                if slot in slot_of:
                    raise AssertionError(f"planner: host slot {slot} is held by two blocks")
                slot_of[slot] = key
            self.slots.check()
            ready = self.slots.counts().ready
            if ready != len(slot_of):
                raise AssertionError(f"planner: {ready} READY host slots but the index places {len(slot_of)} "
                                     "blocks in host memory")
        if self._storing or self._writing:
            raise AssertionError(f"planner: {len(self._storing)} stores and {len(self._writing)} copies down "
                                 "still in flight")
        if len(self._unwritten) > self.max_unwritten + 1:
            raise AssertionError(f"planner: {len(self._unwritten)} unwritten blocks, bound {self.max_unwritten}")
        for what, keys in (("owed", self._owed), ("members", self._members), ("tenants", self._tenants)):
            stray = [k for k in keys if self.index.host_slot(k) is None]
            if stray:
                raise AssertionError(f"planner: {len(stray)} {what} block(s) not in host memory")


__all__ = ["CopyDown", "Dropped", "PlanRefused", "Planner", "Room", "StoreStart", "ValueWrites"]
