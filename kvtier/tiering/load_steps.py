"""A load's plan, block by block: where each block's bytes are and what a load does with them.

The planner answers a load with a :class:`LoadPlan` (plain columns: per block of the planned prefix its
source and host slot).  The worker side builds one :class:`Step` per block from it when a load starts
(:meth:`LoadPlan.steps`), and updates it as reads land (``FETCH`` becomes ``HOST``, ``TMP`` or ``LOST``);
the load's result is read off the finished steps.  A step is an object, not a tagged tuple, so a reader
sees what each field means; the plan is columns, so an executor that needs no per-block state (the
simulator's) makes no object per block.
"""

from __future__ import annotations

import enum
from dataclasses import dataclass
from typing import Any

from ..index import Tier


class Source(enum.Enum):
    """Where a planned block's bytes are now."""

    HOST = "host"  # a READY host slot (``Step.at``): copied host -> device
    SAME = "same"  # already in the destination device block: nothing to copy
    FETCH = "fetch"  # only in backends: still to read
    TMP = "tmp"  # read into a temporary row (``Step.at``) because host memory had no room
    DIRECT = "direct"  # read straight into the destination device block (a CPU engine's KV): nothing to copy
    LOST = "lost"  # not available (unreadable, corrupt, or after a break in the chain)


@dataclass(slots=True)
class Step:
    """One block of a load plan.  ``at``: the host slot (HOST) or the temporary row (TMP); ``backend``:
    the backend index the bytes were read from, None when they were already in memory; ``landed``: the
    bytes were already copied into the device block, by the thread that read and verified them."""

    source: Source
    at: Any = None
    backend: int | None = None
    landed: bool = False

    @property
    def on_device(self) -> bool:
        """Whether the device block holds this block's bytes once the step is settled (nothing to copy)."""
        return self.landed or self.source in (Source.SAME, Source.TMP, Source.DIRECT)

    @property
    def tier(self) -> Tier | None:
        """The tier the block is served from, once settled (None while FETCH or when LOST)."""
        if self.source in (Source.FETCH, Source.LOST):
            return None
        if self.source is Source.SAME:
            return Tier.DEVICE
        return Tier.HOST if self.backend is None else Tier.backend(self.backend)


@dataclass(slots=True)
class LoadPlan:
    """The planner's plan of a load (:meth:`~kvtier.tiering.planner.Planner.plan_load_locked`), per block of
    the planned prefix: ``sources[i]`` is HOST, SAME or FETCH; ``slots[i]`` the host slot of a HOST block
    (-1 for the others)."""

    sources: list[Source]
    slots: list[int]

    def __len__(self) -> int:
        return len(self.sources)

    def fetch(self) -> list[int]:
        """Positions of the blocks to read from the backends."""
        fetch = Source.FETCH
        return [i for i, src in enumerate(self.sources) if src is fetch]

    def steps(self) -> list[Step]:
        """One :class:`Step` per block, for an executor that tracks each block as its reads land."""
        host = Source.HOST
        return [Step(src, slot if src is host else None) for src, slot in zip(self.sources, self.slots)]


def lost() -> Step:
    return Step(Source.LOST)


__all__ = ["LoadPlan", "Source", "Step", "lost"]
