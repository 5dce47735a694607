"""The storage backends of one tier stack, used only through the backend contract.

Invariant: nothing here raises because of a backend.  A ``BackendError`` (or any exception from a
backend that breaks the contract) becomes 0 hits / a miss / a failed write, is logged, and is counted
in the backend's ``failures``; hits, misses, bytes and latency are counted per backend by name.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable, Sequence
from typing import Any

from .backend_api import BackendError, BackendUnavailable, StorageBackend
from .metrics import StackMetrics

log = logging.getLogger("kvtier.stack")
WARN_EVERY_S = 10.0


class BackendSet:
    """Backends in lookup order (fastest first), each with a name and a writable flag."""

    def __init__(self, backends: Sequence[StorageBackend], writable: Sequence[bool], metrics: StackMetrics,
                 layout_id: int, block_nbytes: int):
        self.backends = list(backends)
        self.names = [b.name for b in self.backends]
        # Per backend: whether get_into takes segments (a payload read straight into a CPU engine's KV)
        self.reads_segments = [bool(getattr(b, "reads_segments", False)) for b in self.backends]
        self.writable = [i for i, w in enumerate(writable) if w]
        self.metrics = metrics
        self.layout_id = layout_id
        self.block_nbytes = block_nbytes
        self._seen_unavailable = [0] * len(self.backends)
        self._unwarned = [0] * len(self.backends)
        self._warned_at = [-WARN_EVERY_S] * len(self.backends)
        # Backends that were unreachable (wholly or a node) since they last answered in full: a server
        # that comes back may have come back empty (a restarted Redis keeps nothing), so what the index
        # says they hold is a guess until ``on_recovered(i)`` has dealt with it (True) at their next
        # full answer.
        self._suspect = [False] * len(self.backends)
        self.on_recovered: Callable[[int], bool] | None = None
        metrics.watch_backends(self)  # kvtier_backend_up / _used_bytes / _capacity_bytes, read at scrape time

    def up(self) -> list[bool]:
        """Per backend: False while it has been unreachable since it last answered a whole call."""
        return [not s for s in self._suspect]

    def __len__(self) -> int:
        return len(self.backends)

    def _outage(self, i: int) -> bool:
        """Surface keys backend ``i`` left unanswered for unavailability since we last looked (a whole
        outage or, in a Redis Cluster, one node down): the ``unavailable`` metric, and a warning at most
        every ``WARN_EVERY_S`` per backend, so an outage never passes for ordinary misses.  Whether there
        were any."""
        try:
            now_count = int(self.backends[i].unavailable_count())
        except Exception:  # noqa: BLE001 - a third-party backend predating the method
            return False
        delta = now_count - self._seen_unavailable[i]
        if delta <= 0:
            return False
        self._seen_unavailable[i] = now_count
        self._suspect[i] = True
        self.metrics.add(self.names[i], unavailable=delta)
        self._unwarned[i] += delta
        now = time.monotonic()
        if now - self._warned_at[i] >= WARN_EVERY_S:
            log.warning("backend %r: %d key(s) unanswered because it (or part of it) is unavailable "
                        "(metric 'unavailable'); they are served as misses and recomputed",
                        self.names[i], self._unwarned[i])
            self._warned_at[i], self._unwarned[i] = now, 0
        return True

    def _answered(self, i: int) -> None:
        """Backend ``i`` answered a whole call: if it was unreachable before, it is back."""
        if self._outage(i) or not self._suspect[i]:
            return
        if self.on_recovered is None or self.on_recovered(i):
            self._suspect[i] = False

    def _fault(self, i: int, what: str, e: BaseException) -> None:
        name = self.names[i]
        self.metrics.add(name, failures=1)
        if isinstance(e, BackendUnavailable):
            self._suspect[i] = True
        if isinstance(e, BackendError):
            log.warning("backend %r: %s failed: %s", name, what, e)
        else:  # a backend that breaks the contract: still never reaches the engine
            log.error("backend %r: %s raised %s (not a BackendError): %s", name, what, type(e).__name__, e)

    def contains_prefix(self, i: int, keys: Sequence[str]) -> int:
        """Leading keys present in backend ``i``; 0 when it fails."""
        if not keys:
            return 0
        t0 = time.perf_counter()
        try:
            n = int(self.backends[i].contains_prefix(keys))
        except Exception as e:  # noqa: BLE001 - a backend fault is a miss
            self._fault(i, "contains_prefix", e)
            self._outage(i)
            return 0
        self._answered(i)
        self.metrics.observe(self.names[i], "lookup", time.perf_counter() - t0)
        return max(0, min(n, len(keys)))

    def longest_prefix(self, keys: Sequence[str]) -> tuple[int, int]:
        """``(n, i)``: the longest run of leading ``keys`` present in one backend, and which (the
        fastest on a tie); ``(0, 0)`` when none has the first key or every backend fails."""
        best, who = 0, 0
        for i in range(len(self.backends)):
            got = self.contains_prefix(i, keys)
            if got > best:
                best, who = got, i
            if best == len(keys):
                break
        return best, who

    def locate(self, keys: Sequence[str]) -> list[int]:
        """For the longest run of leading ``keys`` stored across the backends (each run from one), the
        backend holding each key: the fastest backend wherever several have it."""
        where: list[int] = []
        while len(where) < len(keys):
            best, who = self.longest_prefix(keys[len(where):])
            if best == 0:
                break
            where += [who] * best
        return where

    def put(self, i: int, keys: Sequence[str], payloads: Sequence[Any]) -> list[bool]:
        """Store payloads in backend ``i``; per key, whether it took the block (all False when it fails)."""
        if not keys:
            return []
        name = self.names[i]
        t0 = time.perf_counter()
        try:
            ok = [bool(x) for x in self.backends[i].put(keys, payloads, self.layout_id)]
            if len(ok) != len(keys):
                raise BackendError(name, keys[0], f"put returned {len(ok)} results for {len(keys)} keys")
        except Exception as e:  # noqa: BLE001 - a backend fault is a skipped store
            self._fault(i, "put", e)
            self.metrics.add(name, stores_skipped=len(keys))
            self._outage(i)
            return [False] * len(keys)
        self._answered(i)
        self.metrics.observe(name, "write", time.perf_counter() - t0)
        n_ok = sum(ok)
        self.metrics.add(name, bytes_in=n_ok * self.block_nbytes, stores_skipped=len(ok) - n_ok)
        return ok

    def hold(self, keys: Sequence[str]) -> None:
        """Every backend keeps ``keys`` from its own evictions until ``release`` (a load will read them);
        a backend that fails to is logged, never an error: the load may then find a block gone."""
        self._each("hold", keys)

    def release(self, keys: Sequence[str]) -> None:
        self._each("release", keys)

    def _each(self, what: str, keys: Sequence[str]) -> None:
        for i, b in enumerate(self.backends):
            try:
                getattr(b, what)(keys)
            except Exception as e:  # noqa: BLE001 - a hold is an optimisation, its failure a possible miss
                self._fault(i, what, e)

    def get_into(self, i: int, keys: Sequence[str], buffers: Sequence[Any],
                 on_verified: Callable[[int], None] | None = None) -> list[bool]:
        """Read blocks of backend ``i`` into ``buffers``; per key ok (all False when it fails).  A buffer
        whose key is not ok holds undefined bytes.  ``on_verified``: see ``StorageBackend.get_into``."""
        if not keys:
            return []
        name = self.names[i]
        t0 = time.perf_counter()
        try:
            ok = [bool(x) for x in self.backends[i].get_into(keys, buffers, self.layout_id, on_verified=on_verified)]
            if len(ok) != len(keys):
                raise BackendError(name, keys[0], f"get_into returned {len(ok)} results for {len(keys)} keys")
        except Exception as e:  # noqa: BLE001 - a backend fault is a miss
            self._fault(i, "get_into", e)
            self.metrics.add(name, misses=len(keys))
            self._outage(i)
            return [False] * len(keys)
        self._answered(i)
        self.metrics.observe(name, "read", time.perf_counter() - t0)
        n_ok = sum(ok)
        self.metrics.hit(name, n_ok, n_ok * self.block_nbytes)
        self.metrics.add(name, misses=len(ok) - n_ok)
        return ok

    def put_manifests(self, namespace: Any) -> None:
        """Best effort: each writable backend records what the namespace id means."""
        for i in self.writable:
            try:
                self.backends[i].put_manifest(namespace)
            except Exception as e:  # noqa: BLE001 - a manifest is informational
                self._fault(i, "put_manifest", e)

    def stats(self) -> dict[str, dict[str, Any]]:
        out = {}
        for name, b in zip(self.names, self.backends):
            try:
                s = b.stats()
                out[name] = {k: v for k, v in vars(s).items()}
            except Exception as e:  # noqa: BLE001
                out[name] = {"error": str(e)}
        return out

    def close(self, owned: Sequence[bool]) -> None:
        for i, (b, own) in enumerate(zip(self.backends, owned)):
            if own:
                try:
                    b.close()
                except Exception as e:  # noqa: BLE001
                    self._fault(i, "close", e)
