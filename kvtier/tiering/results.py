"""What the tier stack hands back: lookup / load / store results and the handles to wait on.

Invariants shared by every handle: its result is set exactly once; every wait takes a timeout and
raises ``TimeoutError`` when it expires (the operation keeps going); a handle is finished even when
the operation inside fails (a failed block is reported, never raised).
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum
from typing import TYPE_CHECKING, Any, Generic, TypeVar, cast

from ..index import Tier, TierNames
from ..plans import HostOutcome

if TYPE_CHECKING:
    from ..memory.transfer import TransferGroup, TransferHandle

log = logging.getLogger("kvtier.stack")


@dataclass(frozen=True)
class LookupResult:
    """The longest prefix of the asked blocks available in some tier.  ``tiers[i]`` is where block ``i``
    is best served from (fastest first); ``names`` says what this deployment calls each tier."""

    tiers: tuple[Tier, ...]
    block_size: int
    num_requested: int
    names: TierNames = TierNames()

    @property
    def num_blocks(self) -> int:
        return len(self.tiers)

    @property
    def num_tokens(self) -> int:
        return len(self.tiers) * self.block_size

    @property
    def counts(self) -> dict[str, int]:
        """{tier name: blocks}, in the order tiers first appear (for people: reports and logs)."""
        return self.names.count(self.tiers)

    @property
    def device_tokens(self) -> int:
        return self.tiers.count(Tier.DEVICE) * self.block_size

    @property
    def host_tokens(self) -> int:
        return self.tiers.count(Tier.HOST) * self.block_size

    @property
    def storage_tokens(self) -> int:
        """Tokens only in backends (FastDeploy's storage_match_token_num)."""
        return self.num_tokens - self.device_tokens - self.host_tokens

    def __str__(self) -> str:
        return (f"{self.num_blocks}/{self.num_requested} blocks: device {self.device_tokens}, host "
                f"{self.host_tokens}, storage {self.storage_tokens} tokens")


@dataclass(frozen=True)
class LoadResult:
    """Outcome of a load.  Invariant: ``ok`` is a prefix (True for exactly the first ``num_loaded``
    blocks): a block after the first failure is never usable, since its key chains through the failed
    one.  The engine recomputes ``recompute`` (block ids ``num_loaded..``)."""

    block_ids: tuple[int, ...]
    ok: tuple[bool, ...]
    copied: tuple[bool, ...]  # bytes landed (diagnostics: may be True after a failure, still not usable)
    tiers: tuple[Tier | None, ...]  # where each block came from (None: not available / not tried)
    errors: tuple[str, ...]
    block_size: int
    #: What a lead load's leader folds of this side's run (``Planner.fold_load_locked``).
    outcome: HostOutcome = HostOutcome.nothing()

    @property
    def num_loaded(self) -> int:
        return sum(self.ok)

    @property
    def num_tokens(self) -> int:
        return self.num_loaded * self.block_size

    @property
    def recompute_indices(self) -> list[int]:
        return list(range(self.num_loaded, len(self.block_ids)))

    @property
    def recompute(self) -> list[int]:
        """Device block ids whose KV the engine must compute itself."""
        return list(self.block_ids[self.num_loaded:])

    @property
    def all_ok(self) -> bool:
        return all(self.ok)


class StoreStatus(StrEnum):
    """What a store did with one block.  A ``str`` enum: each member equals its value (``"stored"``...),
    the strings these statuses were before the enum, so callers comparing with those keep working."""

    STORED = "stored"    # copied into host memory, or, without a host tier, into a backend
    PRESENT = "present"  # already held, or already on its way
    SKIPPED = "skipped"  # no room, nothing evictable, no backend took it: counted in stores_skipped
    FAILED = "failed"    # the copy failed


STORED, PRESENT, SKIPPED, FAILED = StoreStatus.STORED, StoreStatus.PRESENT, StoreStatus.SKIPPED, StoreStatus.FAILED


@dataclass(frozen=True)
class StoreResult:
    """Per block of a store, in order, its :class:`StoreStatus`; ``handed``: the write-back victims this
    store copied down and whose host slots it took (what a leader folding several sides' runs of one plan
    needs: ``Planner.fold_store_locked``)."""

    status: tuple[StoreStatus, ...]
    handed: tuple[bytes, ...] = ()

    def outcome(self) -> HostOutcome:
        """What a leader folds of this store (``Planner.fold_store_locked``)."""
        return HostOutcome(frozenset(i for i, st in enumerate(self.status) if st is STORED), frozenset(self.handed))

    def count(self, what: StoreStatus) -> int:
        return self.status.count(what)

    @property
    def num_stored(self) -> int:
        return self.count(STORED)

    @property
    def num_present(self) -> int:
        return self.count(PRESENT)

    @property
    def num_skipped(self) -> int:
        return self.count(SKIPPED)

    @property
    def num_failed(self) -> int:
        return self.count(FAILED)


R = TypeVar("R")


class _Handle(Generic[R]):
    """An operation in flight whose ``wait()`` returns its result, an ``R``."""

    def __init__(self, what: str):
        self._what = what
        self._done = threading.Event()
        self._result: Any = None
        self._lock = threading.Lock()
        self._callbacks: list[Callable[[], None]] = []

    def done(self) -> bool:
        return self._done.is_set()

    def add_done_callback(self, fn: Callable[[], None]) -> None:
        """Call ``fn()`` once this is done: in the thread that finishes it, or at once if it is done."""
        with self._lock:
            if not self._done.is_set():
                self._callbacks.append(fn)
                return
        fn()

    def wait(self, timeout: float | None = None) -> R:
        if not self._done.wait(timeout):
            raise TimeoutError(f"{self._what} not done after {timeout} s")
        return cast(R, self._result)

    def finish(self, result: Any) -> bool:
        """Set the result (the executor finishing the operation); False (and nothing changes) if it was already set."""
        with self._lock:
            if self._done.is_set():
                return False
            self._result = result
            self._done.set()
            callbacks, self._callbacks = self._callbacks, []
        for fn in callbacks:
            try:
                fn()
            except Exception:  # noqa: BLE001 - a waiter's fault never fails the operation
                log.exception("%s: a done callback failed", self._what)
        return True


class StoreHandle(_Handle["StoreResult"]):
    """A store in flight.  ``wait()`` returns the :class:`StoreResult` once the device blocks have been
    copied out (the engine may then reuse them); writes to the backends go on behind it
    (``TierStack.flush`` waits for those)."""

    def __init__(self, n: int):
        super().__init__(f"store of {n} blocks")


class LoadHandle(_Handle["LoadResult"]):
    """A load in flight.  ``wait()`` returns the :class:`LoadResult`; ``wait_layer(i)`` returns once
    layer ``i`` of the host -> device copy has landed (True) or failed (False), so the engine can run
    layer ``i`` while later layers are still copying (pass ``layerwise=True`` to ``TierStack.load``).
    Blocks fetched from a backend are in host memory before the first layer is copied."""

    def __init__(self, n: int, num_layers: int, layerwise: bool):
        super().__init__(f"load of {n} blocks")
        self.num_layers = num_layers
        self.layerwise = layerwise
        self._staged = threading.Event()  # backend fetches done; the host -> device copy is submitted
        self._xfer: TransferHandle | TransferGroup | None = None

    def wait_layer(self, layer: int, timeout: float | None = None, *, sync: bool = False) -> bool:
        if not 0 <= layer < self.num_layers:
            raise IndexError(f"layer {layer} out of range [0, {self.num_layers})")
        deadline = None if timeout is None else time.monotonic() + timeout
        if not self._staged.wait(timeout):
            raise TimeoutError(f"{self._what}: blocks not staged in host memory after {timeout} s")
        if self._xfer is None or not self.layerwise:
            # Whole-block copies land all layers at once: the layer is there when the load is done.
            res = self.wait(_left(deadline))
            return res.num_loaded > 0 or not res.block_ids
        return self._xfer.wait_layer(layer, _left(deadline), sync=sync)

    def stage(self, xfer: TransferHandle | TransferGroup | None) -> None:
        self._xfer = xfer
        self._staged.set()

    def finish(self, result: Any) -> bool:
        self._staged.set()  # a waiter on a layer must never hang on a load that ended early
        return super().finish(result)


class PrefetchHandle(_Handle[int]):
    """A prefetch (backends -> host) in flight, or one that was never started (below the threshold, no
    backend hit, no host tier): then it is done at once.

    ``wait(timeout=None)`` applies the prefetch policy (waits until ``wait_seconds`` for this prefetch's
    tokens have passed since the prefetch started; ``timeout``, counted from the call, caps it further),
    stops what has not arrived, and returns the number of leading blocks now in memory (host, or
    already on the device): what a load can serve without backend I/O."""

    def __init__(self, in_memory: Callable[[list[bytes]], int] | None, hashes: list[bytes], num_tokens: int,
                 wait_s: float | None, *, started: bool):
        super().__init__(f"prefetch of {num_tokens} tokens")
        self._in_memory = in_memory  # leading blocks of a chain in memory (the planner's leading_in_memory)
        self._hashes = hashes
        self.num_tokens = num_tokens  # tokens this prefetch fetches from backends
        self.started = started
        self.wait_s = wait_s
        self.fetched = 0  # blocks fetched into host so far
        self.cancelled = threading.Event()
        self._t0 = time.monotonic()
        if not started:
            self.finish(0)

    def cancel(self) -> None:
        """Stop after the batch being read (blocks already read still land in host memory)."""
        self.cancelled.set()

    def wait(self, timeout: float | None = None) -> int:
        policy_left = None if self.wait_s is None else max(0.0, self._t0 + self.wait_s - time.monotonic())
        limits = [t for t in (policy_left, timeout) if t is not None]
        if not limits:
            self._done.wait()
        elif not self._done.wait(min(limits)):
            self.cancel()
        return self._in_memory(self._hashes) if self._in_memory is not None else 0


class PendingOps:
    """Count of operations that will still write to a backend (stores in flight, write-downs); ``wait``
    returns when it reaches 0.  ``flush`` is built on it."""

    def __init__(self) -> None:
        self._n = 0
        self._cond = threading.Condition()

    def add(self, n: int = 1) -> None:
        with self._cond:
            self._n += n

    def done(self, n: int = 1) -> None:
        with self._cond:
            self._n -= n
            if self._n <= 0:
                self._cond.notify_all()

    @property
    def count(self) -> int:
        return self._n

    def wait(self, timeout: float | None) -> bool:
        with self._cond:
            return self._cond.wait_for(lambda: self._n <= 0, timeout)


def _left(deadline: float | None) -> float | None:
    return None if deadline is None else max(0.0, deadline - time.monotonic())


__all__ = ["FAILED", "PRESENT", "SKIPPED", "STORED", "StoreStatus", "LoadHandle", "LoadResult", "LookupResult",
           "PrefetchHandle", "StoreHandle", "StoreResult"]
