"""Plain plan objects the manager (scheduler side) and the worker (tensor side) exchange.

They cross process boundaries (vLLM pickles connector metadata from its EngineCore to every worker, and
worker reports back), so they hold only bytes, ints, strings and tuples: never a tensor, a handle or a
reference into either side's state.  Invariants (checked by ``__post_init__``): a plan's ``hashes`` and
``block_ids`` have the same length, block ids are distinct and >= 0.
"""

from __future__ import annotations

import enum
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import Any, ClassVar

from .index import Tier
from .quota import tenant_problem


class LookupState(enum.Enum):
    """What a non-blocking lookup knows now."""

    HIT = "hit"  # a leading run of blocks is available (``num_blocks`` > 0)
    MISS = "miss"  # nothing available
    PENDING = "pending"  # backends are being asked; ask again later


@dataclass(frozen=True)
class Lookup:
    """A lookup answer: the leading ``num_blocks`` blocks are available, ``tiers[i]`` is where block
    ``i`` is best served from.  A hint, never a promise: a load may still fail (evicted, corrupt,
    backend down) and then the engine recomputes."""

    state: LookupState
    num_blocks: int = 0
    tiers: tuple[Tier, ...] = ()

    def __post_init__(self) -> None:
        if self.num_blocks < 0 or (self.state is LookupState.HIT) != (self.num_blocks > 0):
            raise ValueError(f"lookup: state {self.state.value} with {self.num_blocks} blocks")


@dataclass(frozen=True)
class _BlockPlan:
    """Blocks ``hashes`` of request ``req_id`` and the device blocks ``block_ids`` they go to / come from;
    ``start`` is the chain position of ``hashes[0]`` in the request's prompt."""

    KIND: ClassVar[str] = "block"
    req_id: str
    hashes: tuple[bytes, ...]
    block_ids: tuple[int, ...]
    start: int = 0
    #: The engine's KV cache group these blocks belong to (vLLM's hybrid KV cache manager: one block
    #: table per group); 0 for a model with one group.
    group: int = 0

    def __post_init__(self) -> None:
        what, ids = f"{self.KIND} plan for {self.req_id!r}", self.block_ids
        if self.start < 0:
            raise ValueError(f"{what}: start must be >= 0, got {self.start}")
        if len(self.hashes) != len(ids):
            raise ValueError(f"{what}: {len(self.hashes)} hashes but {len(ids)} block ids")
        if len(set(ids)) != len(ids):
            raise ValueError(f"{what}: duplicate destination block ids {sorted(ids)}")
        bad = [b for b in ids if b < 0]
        if bad:
            raise ValueError(f"{what}: negative block ids {bad}")


@dataclass(frozen=True)
class LoadPlan(_BlockPlan):
    """Load ``hashes`` (a chain prefix) into device blocks ``block_ids`` for request ``req_id``.

    ``sync``: the engine computes on these blocks in the same step, so the worker finishes the load
    before the step's forward pass (a failed block is then reported and recomputed, never read); an
    asynchronous load (the default) ends in a later step, reported as finished."""

    KIND: ClassVar[str] = "load"
    sync: bool = False
    #: The load as the scheduler's planner started it: every rank's stack reads what it brings up into
    #: host memory in the slots it names (None: each rank's stack makes that room itself).
    lead: LeadLoad | None = None


@dataclass(frozen=True)
class StorePlan(_BlockPlan):
    """Store device blocks ``block_ids`` (holding ``hashes``, already computed this step) for ``req_id``.
    ``tenant``: the tag of the request's ``cache_salt`` (``kvtier.keys.tenant_tag``; None: unsalted), whose
    quota the stored blocks are charged to in the backends (``kvtier.quota``)."""

    KIND: ClassVar[str] = "store"
    tenant: str | None = None
    #: The store as the scheduler's planner started it: every rank's stack follows it (None: each rank's
    #: stack plans the store itself).
    lead: LeadStore | None = None

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.tenant is not None and (why := tenant_problem(self.tenant)) is not None:
            raise ValueError(f"store plan for {self.req_id!r}: tenant: {why}")


@dataclass
class StepPlan:
    """Everything the worker must do in one engine step."""

    loads: list[LoadPlan] = field(default_factory=list)
    stores: list[StorePlan] = field(default_factory=list)
    #: No request computes in this step: the engine only waits for loads in the background (the worker
    #: may then wait a little for one to end instead of returning at once into another empty step).
    idle: bool = False

    def __bool__(self) -> bool:
        return bool(self.loads or self.stores)


@dataclass(frozen=True)
class CopyDown:
    """A write-back victim: a host block held (an index reference, ``writing``) until the executor
    reports it copied down (``Planner.written_back_locked``); its value is written as a
    :class:`~kvtier.tiering.planner.ValueWrites`."""

    key: bytes
    slot: int
    targets: tuple[int, ...]  # the writable backends lacking it


@dataclass(frozen=True)
class Dropped:
    """A host block evicted unwritten to make room: its ``slot`` is among the room's ``slots``."""

    key: bytes
    slot: int


@dataclass
class Room:
    """Host room for a batch of blocks coming up, decided at once (``Planner.take_room_locked``):
    ``slots`` (WRITING now), then the slots the write-back ``victims`` hand over once copied down.  The
    k-th block of the batch goes to ``order()[k]`` whenever the write-backs end; a victim that is not
    copied down keeps its slot, and the block planned there finds none.  ``dropped``: the blocks evicted
    unwritten whose slots are among ``slots`` (the rest of ``slots`` were free), so another planner can
    follow the same room (``Planner.adopt_room_locked``).  ``ready``: victims a follower found gone from
    their slot (it holds another block there that the leader does not know of, or nothing), whose slots it
    took at once: handed over with nothing to copy down."""

    slots: list[int]
    victims: list[CopyDown]
    dropped: list[Dropped] = field(default_factory=list)
    ready: frozenset[bytes] = frozenset()

    def order(self) -> list[int]:
        return [*self.slots, *(v.slot for v in self.victims)]

    def held(self) -> list[CopyDown]:
        """The victims to copy down before their slots are used (those not ``ready``)."""
        return [v for v in self.victims if v.key not in self.ready]

    def ready_slots(self) -> list[int]:
        """The slots of the ``ready`` victims: taken already (WRITING), the room's to use or release."""
        return [v.slot for v in self.victims if v.key in self.ready]


@dataclass(frozen=True)
class LeadStore:
    """A store as a leading planner started it (``Planner.start_store_locked``, vLLM: the scheduler's),
    for every side's stack to follow over the same blocks (``TierStack.store(..., plan=)``): the positions
    new to the leader, the held blocks it sends down on this hit, the host room of the new ones and the
    new blocks it sends down once stored.  ``plan_id`` names it in the sides' outcomes (:class:`HostOutcome`)."""

    plan_id: int
    new: tuple[int, ...]
    hits: tuple[bytes, ...]
    room: Room
    sends_down: frozenset[bytes] = frozenset()


@dataclass(frozen=True)
class LeadLoad:
    """A load as a leading planner started it (``Planner.start_load_locked``, vLLM: the scheduler's), for
    every side's stack to follow (``TierStack.load(..., plan=)``): the positions the leader does not hold
    in host memory (``fetch``), and the host room a side reads them into from a backend (``fetch[k]`` goes
    to ``room.order()[k]``; an empty room: the sides read them straight into the engine's KV, or keep
    them out of host memory).  ``plan_id`` names it in the sides' outcomes (:class:`HostOutcome`)."""

    plan_id: int
    fetch: tuple[int, ...]
    room: Room


@dataclass(frozen=True)
class HostOutcome:
    """What one side's run of a lead plan (:class:`LeadStore`, :class:`LeadLoad`) did in host memory: the
    positions it placed there in the slots the plan named (a store's copies, a load's reads), and the
    write-back victims it handed over (copied down, or gone here already).  The leader folds every side's
    (``Planner.fold_store_locked``, ``fold_load_locked``)."""

    placed: frozenset[int]
    handed: frozenset[bytes]

    @classmethod
    def nothing(cls) -> HostOutcome:
        """A side that did not run the plan, or refused it."""
        return cls(frozenset(), frozenset())


def keep_earliest(positions: dict[str, int], req_id: str, pos: int) -> None:
    """Record ``pos`` for ``req_id`` unless an earlier position is recorded already."""
    positions[req_id] = min(pos, positions.get(req_id, pos))


@dataclass
class HostChanges:
    """Blocks placed in host memory (hash -> slot) and gone from it since a planner's last drain
    (``Planner.drain_host_changes``): what vLLM's scheduler, which places every block in host memory
    itself, announces on its KV event stream.  ``in_host`` and ``left_host`` are disjoint (the latest word
    on a block wins)."""

    in_host: dict[bytes, int] = field(default_factory=dict)
    left_host: set[bytes] = field(default_factory=set)


@dataclass
class WorkerReport:
    """What one worker learnt since its last report: its completions and failures.  Blocks a load found
    missing or corrupt (hints the manager must forget), blocks it wrote to a backend and blocks a backend
    evicted to stay within its capacity (hash, backend index), where each request's failed load left off,
    and per lead plan what it placed in host memory (the scheduler places blocks in host memory itself,
    from those outcomes: no report says what a worker's host memory holds).

    Within a report, ``in_backend`` and ``left_backend`` are disjoint.  Reports of several workers (TP /
    PP ranks) are folded by a :class:`RankTally`, never merged pairwise: ranks report the same block in
    different steps."""

    lost: set[bytes] = field(default_factory=set)
    in_backend: set[tuple[bytes, int]] = field(default_factory=set)
    left_backend: set[tuple[bytes, int]] = field(default_factory=set)
    # request id -> chain position of the first block its load did not deliver: the engine recomputes
    # from there, so those blocks are not stored yet (the scheduler plans them again once recomputed).
    unloaded: dict[str, int] = field(default_factory=dict)
    # Whether this worker writes the backends; one that does not (its in_backend is always empty) does
    # not count towards the writers a block waits for.
    writes: bool = True
    # Per lead plan (LeadStore / LeadLoad plan_id) this worker ran since its last report, what it did.
    outcomes: dict[int, HostOutcome] = field(default_factory=dict)
    # This worker's rank among the engine's workers, in [0, ranks) of the RankTally that folds it.
    rank: int = 0
    # The KV cache group whose blocks this report is about (a worker reports each group apart: the same
    # block hash names one value per group).
    group: int = 0

    def __bool__(self) -> bool:
        return bool(self.lost or self.in_backend or self.left_backend or self.unloaded or self.outcomes)


class RankTally:
    """Folds the reports of an engine's ``ranks`` workers into what the manager may believe, across steps.

    Each rank holds its own shard of every block (TP: its KV heads; PP: its layers), so a block is written
    to a backend only once *every* writing rank has said so; ``writers`` of them write the backends (all of
    them, or one per pipeline stage where every TP rank holds the same bytes: MLA).  Ranks need not say it
    in the same step: a backend write ends on each rank's own threads.  Hence a count per block, kept
    between folds, and not a per-step intersection: vLLM merges one step's worker metadata skipping the
    ranks that said nothing, so an intersection took one rank's word alone, and never saw a block that two
    ranks reported in different steps.  (Host memory needs no tally: the scheduler places blocks there
    itself, from every rank's outcome of its plans.)

    Anything one rank lost, or a backend evicted, is gone at once (and its count restarts).  A block some
    rank never reports (a write that failed there) waits in the count until it leaves; the count keeps at
    most ``max_pending`` blocks, oldest dropped first (a hint never learnt, no more: lookups still find the
    block by probing)."""

    def __init__(self, ranks: int = 1, writers: int | None = None, *, max_pending: int = 1 << 20):
        writers = ranks if writers is None else writers
        if ranks < 1 or not 0 <= writers <= ranks:
            raise ValueError(f"rank tally: {ranks} ranks and {writers} writers (want 1 <= ranks, "
                             "0 <= writers <= ranks)")
        self.ranks, self.writers, self.max_pending = ranks, writers, max_pending
        self._written: dict[tuple[bytes, int], set[int]] = {}  # (block, backend) -> writing ranks that wrote it

    @property
    def pending(self) -> int:
        """Blocks some but not all writing ranks reported written."""
        return len(self._written)

    def fold(self, reports: Iterable[WorkerReport]) -> WorkerReport:
        """One report for the manager from the reports that arrived in one step, in any order."""
        out = WorkerReport()
        for rep in reports:
            if not 0 <= rep.rank < self.ranks:
                raise ValueError(f"rank tally: a report from rank {rep.rank}, expected ranks 0..{self.ranks - 1}")
            out.lost |= rep.lost
            for req_id, pos in rep.unloaded.items():
                keep_earliest(out.unloaded, req_id, pos)
            for pair in rep.left_backend:
                self._written.pop(pair, None)
                out.in_backend.discard(pair)
                out.left_backend.add(pair)
            if rep.writes:
                for pair in rep.in_backend:
                    if self._tally(self._written, pair, rep.rank, self.writers):
                        out.in_backend.add(pair)
                        out.left_backend.discard(pair)
        return out

    def _tally(self, table: dict[Any, set[int]], key: Any, rank: int, need: int) -> bool:
        """Count ``rank`` for ``key``; True once ``need`` ranks said it, and the count is done."""
        seen = table.get(key)
        if seen is None:
            seen = table[key] = set()
            self._bound(table)
        seen.add(rank)
        if len(seen) < need:
            return False
        del table[key]
        return True

    def _bound(self, table: dict[Any, Any]) -> None:
        while len(table) > self.max_pending:
            del table[next(iter(table))]


__all__ = ["CopyDown", "Dropped", "LeadStore", "LoadPlan", "Lookup", "LookupState", "RankTally", "Room", "StepPlan",
           "HostChanges", "HostOutcome", "LeadLoad", "StorePlan", "WorkerReport", "keep_earliest"]
