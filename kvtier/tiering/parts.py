"""What the executors of one stack share: the memory they copy between, the backends, the worker pools.

Nothing here decides placement (the :class:`~kvtier.tiering.planner.Planner` does); the executors reach
the planner through :attr:`StackParts.planner` and each other through the objects the stack wires up.

Invariants:
* ``pending`` counts every operation that will still write to a backend (stores in flight, copies down):
  one ``add`` before the work is handed to a pool, one ``done`` when it is over, also when it fails or
  the pool refuses it (``Workers.submit`` returns False);
* nothing is submitted once ``close`` has begun: a refused submit is the caller's to undo.
"""

from __future__ import annotations

import logging
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from typing import Any

from .. import threads as kvthreads
from ..format.layout import KVLayout
from ..keys import Namespace
from ..memory.device import DeviceTier
from ..memory.host import HostTier
from ..memory.transfer import TransferEngine
from ..metrics import StackMetrics
from ..policy_api import PrefetchPolicy
from .backend_set import BackendSet
from .planner import Planner
from .results import PendingOps

log = logging.getLogger("kvtier.stack")


class Workers:
    """The stack's backend write and read pools, and the count of pending backend writes."""

    def __init__(self, threads: int):
        self.io = kvthreads.pool(threads, "kvtier-write")  # backend writes (write-down, write-back)
        self.reads = kvthreads.pool(threads, "kvtier-read")  # backend reads (load, prefetch)
        self.pending = PendingOps()
        self.closed = False

    def submit(self, pool: ThreadPoolExecutor, fn: Callable[..., Any], *args: Any) -> bool:
        """Run ``fn(*args)`` on ``pool``; False (nothing run) once the stack is closing."""
        try:
            pool.submit(_logged, fn, *args)
            return True
        except RuntimeError:
            return False

    def close(self) -> None:
        self.closed = True
        self.reads.shutdown(wait=True)
        self.io.shutdown(wait=True)


@dataclass
class Tuning:
    """Sizes the executors read at each operation (tests and benchmarks change them on a live stack)."""

    # A load reads its backend blocks in chunks of about this many bytes, copying each chunk to the device
    # while the next is read (too small: more backend calls; too large: less overlap).
    load_chunk_bytes: int = 32 * 2**20
    prefetch_chunk_blocks: int = 16  # blocks read per backend call by a prefetch (cancel granularity)


@dataclass
class StackParts:
    """One stack's planner, memory, backends and workers, as the executors see them."""

    planner: Planner
    device: DeviceTier
    host: HostTier | None
    xfer: TransferEngine | None
    backends: BackendSet
    metrics: StackMetrics
    namespace: Namespace
    workers: Workers
    tuning: Tuning
    # Per backend: whether a load reads its blocks straight into the engine's KV tensors, skipping host
    # memory (kvtier.config.direct_loads).
    direct_loads: list[bool]
    prefetch_policy: PrefetchPolicy
    prefetch_threshold_tokens: int

    @property
    def layout(self) -> KVLayout:
        return self.device.layout

    @property
    def storage_blocks(self) -> int:
        return self.planner.storage_blocks

    def host_tier(self) -> HostTier:
        """The host tier, on the paths that run only when there is one (``host.capacity`` > 0)."""
        if self.host is None:
            raise RuntimeError("this stack has no host tier (host.capacity: 0)")
        return self.host

    def transfers(self) -> TransferEngine:
        """The host <-> device transfer engine: it exists exactly when the host tier does."""
        if self.xfer is None:
            raise RuntimeError("this stack has no host tier (host.capacity: 0), so no host <-> device transfers")
        return self.xfer


def _logged(fn: Callable[..., Any], *args: Any) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - a worker's fault is logged; its handles are finished by fn
        log.exception("kvtier worker task %s failed", getattr(fn, "__name__", fn))


__all__ = ["StackParts", "Tuning", "Workers"]
