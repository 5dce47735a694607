"""Plain plan objects the manager (scheduler side) and the worker (tensor side) exchange.

They cross process boundaries (vLLM pickles connector metadata from its EngineCore to every worker, and
worker reports back), so they hold only bytes, ints, strings and tuples: never a tensor, a handle or a
reference into either side's state.  Invariants (checked by ``__post_init__``): a plan's ``hashes`` and
``block_ids`` have the same length, block ids are distinct and >= 0.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import ClassVar

from .index import Tier


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


@dataclass(frozen=True)
class StorePlan(_BlockPlan):
    """Store device blocks ``block_ids`` (holding ``hashes``, already computed this step) for ``req_id``."""

    KIND: ClassVar[str] = "store"


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


def keep_earliest(positions: dict[str, int], req_id: str, pos: int) -> None:
    """Record ``pos`` for ``req_id`` unless an earlier position is recorded already."""
    positions[req_id] = min(pos, positions.get(req_id, pos))


@dataclass
class WorkerReport:
    """What the worker learnt since its last report: blocks now in its host memory (hash, slot), blocks
    that left it, blocks a load found missing or corrupt (hints the manager must forget), blocks it
    wrote to a backend and blocks a backend evicted to stay within its capacity (hash, backend index),
    and where each request's failed load left off.

    Reports of several workers (TP ranks) merge with :meth:`merge`: a block counts as in host memory or
    written to a backend only if every rank says so (each rank holds its own shard), and anything lost or
    evicted on one rank is gone.  Only ranks that write the backends (``writes``) have a say on what is
    written: where every rank holds the same bytes (MLA), rank 0 alone writes the one shared copy."""

    in_host: dict[bytes, int] = field(default_factory=dict)
    left_host: set[bytes] = field(default_factory=set)
    lost: set[bytes] = field(default_factory=set)
    in_backend: set[tuple[bytes, int]] = field(default_factory=set)
    left_backend: set[tuple[bytes, int]] = field(default_factory=set)
    # request id -> chain position of the first block its load did not deliver: the engine recomputes
    # from there, so those blocks are not stored yet (the scheduler plans them again once recomputed).
    unloaded: dict[str, int] = field(default_factory=dict)
    # Whether this worker writes the backends; one that does not (its in_backend is always empty) does
    # not veto the blocks a writing rank reports written.
    writes: bool = True

    def merge(self, other: WorkerReport) -> WorkerReport:
        both = {h: s for h, s in self.in_host.items() if h in other.in_host}
        gone = self.left_host | other.left_host | (self.in_host.keys() ^ other.in_host.keys())
        unloaded = dict(self.unloaded)
        for req_id, pos in other.unloaded.items():
            keep_earliest(unloaded, req_id, pos)
        if self.writes and other.writes:
            written = self.in_backend & other.in_backend
        else:
            written = set(self.in_backend if self.writes else other.in_backend)
        return WorkerReport(in_host=both, left_host=set(gone), lost=self.lost | other.lost, in_backend=written,
                            left_backend=self.left_backend | other.left_backend, unloaded=unloaded,
                            writes=self.writes or other.writes)

    def __bool__(self) -> bool:
        return bool(self.in_host or self.left_host or self.lost or self.in_backend or self.left_backend
                    or self.unloaded)


__all__ = ["LoadPlan", "Lookup", "LookupState", "StepPlan", "StorePlan", "WorkerReport", "keep_earliest"]
