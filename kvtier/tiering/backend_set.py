"""The storage backends of one tier stack, used only through the backend contract.

Invariants:
* nothing here raises because of a backend.  A ``BackendError`` (or any exception from a backend that
  breaks the contract) becomes 0 hits / a miss / a failed write, is logged, and is counted in the
  backend's ``failures``; hits, misses, bytes and latency are counted per backend by name;
* a backend that was unreachable, or that reports a restart (``restart_count``), is *suspect*: what it
  was known to hold is a guess.  At its next full answer, a call's or the watcher's, ``on_recovered``
  deals with that once (one thread at a time), so what was computed meanwhile can be written again;
* the watcher (``start_watch``) asks each suspect backend every ``RECHECK_S`` whether it answers again
  (its ``health``), so one comes back without waiting for traffic, and reads each backend's restart
  count (no I/O), so a restart that any call noticed is dealt with even if no later call reaches it.
  It is one daemon thread, stopped by ``close``; its probes are not counted as unanswered keys.
"""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Sequence
from typing import Any

from ..backend_api import BackendError, BackendUnavailable, StorageBackend
from ..metrics import StackMetrics

log = logging.getLogger("kvtier.stack")
WARN_EVERY_S = 10.0
RECHECK_S = 1.0  # how often the watcher asks a suspect backend whether it answers again


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
        self._unwarned = [0] * len(self.backends)  # unanswered keys of reads and lookups not yet logged
        self._unwarned_writes = [0] * len(self.backends)  # ... and of writes
        self._warned_at = [-WARN_EVERY_S] * len(self.backends)
        # Backends that were unreachable (wholly or a node) since they last answered in full: a server
        # that comes back may have come back empty (a restarted Redis keeps nothing), so what the index
        # says they hold is a guess until ``on_recovered(i)`` has dealt with it (True) at their next
        # full answer.
        self._suspect = [False] * len(self.backends)
        self._seen_restarts = [0] * len(self.backends)
        self._recovering = threading.Lock()  # one thread at a time turns a suspect backend back
        self.on_recovered: Callable[[int], bool] | None = None
        self._watch_stop = threading.Event()
        self._watcher: threading.Thread | None = None
        metrics.watch_backends(self)  # kvtier_backend_up / _used_bytes / _capacity_bytes, read at scrape time

    def up(self) -> list[bool]:
        """Per backend: False while it has been unreachable since it last answered a whole call."""
        return [not s for s in self._suspect]

    def __len__(self) -> int:
        return len(self.backends)

    def _outage(self, i: int, writing: bool = False) -> bool:
        """Surface keys backend ``i`` left unanswered for unavailability since we last looked (a whole
        outage or, in a Redis Cluster, one node down): the ``unavailable`` metric, and a warning at most
        every ``WARN_EVERY_S`` per backend, so an outage never passes for ordinary misses.  ``writing``:
        the call was a write (its blocks were skipped, not served as misses).  Whether there were any."""
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
        unwarned = self._unwarned_writes if writing else self._unwarned
        unwarned[i] += delta
        now = time.monotonic()
        if now - self._warned_at[i] >= WARN_EVERY_S:
            said = []
            if self._unwarned[i]:
                said.append(f"{self._unwarned[i]} read or looked up: served as misses and recomputed")
            if self._unwarned_writes[i]:
                said.append(f"{self._unwarned_writes[i]} written: skipped, and written again from host memory "
                            "once it answers")
            log.warning("backend %r: key(s) unanswered because it (or part of it) is unavailable (metric "
                        "'unavailable'): %s", self.names[i], "; ".join(said))
            self._warned_at[i], self._unwarned[i], self._unwarned_writes[i] = now, 0, 0
        return True

    def _restarted(self, i: int) -> None:
        """Backend ``i`` says the store behind it restarted since we last looked: suspect."""
        try:
            n = int(self.backends[i].restart_count())
        except Exception:  # noqa: BLE001 - a third-party backend predating the method
            return
        if n > self._seen_restarts[i]:
            self._seen_restarts[i] = n
            self._suspect[i] = True

    def _answered(self, i: int) -> None:
        """Backend ``i`` answered a whole call: if it was unreachable (or restarted) before, it is back."""
        self._restarted(i)
        if self._outage(i) or not self._suspect[i]:
            return
        if not self._recovering.acquire(blocking=False):
            return  # another thread is turning a backend back; this one is asked again at its next answer
        try:
            if self._suspect[i] and (self.on_recovered is None or self.on_recovered(i)):
                self._suspect[i] = False
        finally:
            self._recovering.release()

    # ------------------------------------------------------------------ the watcher

    def start_watch(self) -> None:
        """Start the watcher thread (idempotent): see the module's invariants."""
        if self._watcher is None and self.backends:
            self._watcher = threading.Thread(target=self._watch, name="kvtier-watch", daemon=True)
            self._watcher.start()

    def _watch(self) -> None:
        while not self._watch_stop.wait(RECHECK_S):
            for i in range(len(self.backends)):
                if self._watch_stop.is_set():
                    return
                self._restarted(i)  # a restart any call noticed (no I/O: the backend's own count)
                if self._suspect[i]:
                    self._check(i)

    def _check(self, i: int) -> None:
        """Ask backend ``i`` whether it answers (its ``health``) and fold the answer in."""
        b = self.backends[i]
        before = self._unavailable_count(i)
        try:
            ok = bool(b.health())
        except Exception as e:  # noqa: BLE001 - health must not raise; one that does is a fault
            self._fault(i, "health", e)
            ok = False
        # A refused probe is no unanswered key: not counted as one (the outage was counted already).
        self._seen_unavailable[i] += max(0, self._unavailable_count(i) - before)
        if ok:
            self._answered(i)
        else:
            self._suspect[i] = True

    def _unavailable_count(self, i: int) -> int:
        try:
            return int(self.backends[i].unavailable_count())
        except Exception:  # noqa: BLE001 - a third-party backend predating the method
            return 0

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

    def put(self, i: int, keys: Sequence[str], payloads: Sequence[Any],
            tenants: Sequence[str | None] | None = None) -> list[bool]:
        """Store payloads in backend ``i``; per key, whether it took the block (all False when it fails).
        ``tenants``: per key the ``cache_salt`` tenant tag its quota is charged to (``kvtier.quota``)."""
        if not keys:
            return []
        name = self.names[i]
        t0 = time.perf_counter()
        # Only a put with a tenant names them: a backend overriding ``put`` without ``tenants`` still works.
        more = {"tenants": tenants} if tenants is not None and any(t is not None for t in tenants) else {}
        try:
            ok = [bool(x) for x in self.backends[i].put(keys, payloads, self.layout_id, **more)]
            if len(ok) != len(keys):
                raise BackendError(name, keys[0], f"put returned {len(ok)} results for {len(keys)} keys")
        except Exception as e:  # noqa: BLE001 - a backend fault is a skipped store
            self._fault(i, "put", e)
            self.metrics.add(name, stores_skipped=len(keys))
            self._outage(i, writing=True)
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
            self.put_manifest(i, namespace)

    def put_manifest(self, i: int, namespace: Any) -> None:
        """Best effort: backend ``i`` records what the namespace id means."""
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
        self._watch_stop.set()
        if self._watcher is not None:
            self._watcher.join(timeout=5.0)
        for i, (b, own) in enumerate(zip(self.backends, owned)):
            if own:
                try:
                    b.close()
                except Exception as e:  # noqa: BLE001
                    self._fault(i, "close", e)
