"""A load's plan, block by block: where each block's bytes are and what a load does with them.

The worker side builds one :class:`Step` per block of the planned prefix when a load starts, and updates
it as reads land (``FETCH`` becomes ``HOST``, ``TMP`` or ``LOST``); the load's result is read off the
finished plan.  A step is an object, not a tagged tuple, so a reader sees what each field means.
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


def lost() -> Step:
    return Step(Source.LOST)


__all__ = ["Source", "Step", "lost"]
