"""``KvtierTier``: kvtier's backends as a secondary tier under vLLM's own KV offloading.

vLLM's ``OffloadingConnector`` keeps a primary CPU tier (a shared memory region, one row per chunk) and
cascades every chunk it stores there to each secondary tier; on a primary miss it asks the secondary
tiers and promotes a hit back into a primary row.  This tier serves those calls from kvtier's backends
(local_disk, Redis, Redis Cluster, S3, plugins) through :class:`~kvtier.tiering.backend_set.BackendSet`,
each chunk one framed, checksummed kvtier value (:mod:`kvtier.format.blockformat`), named as
:mod:`.naming` says.

Invariants:

* every method vLLM calls runs on its scheduler thread and never waits on a backend: existence probes run
  in vLLM's own :class:`AsyncLookupManager` thread (a lookup is RETRY until its probe answered), stores
  and loads in this tier's I/O threads; ``drain_jobs`` (vLLM's reset) and ``shutdown`` alone wait;
* a backend fault (down, timing out, full) is a miss, a failed key of a job and a metric, never an
  exception out of a method: :class:`BackendSet` turns it into False, and each job's body is guarded;
* a chunk is promoted only from a value that passed every check (header, namespace, hash, layout,
  length, checksum); a damaged value is deleted by the backend, its key fails in the job result (vLLM
  then drops the primary slot it had reserved, so the bytes written there are never served) and its
  lookup verdict turns to a miss;
* a job's result names only keys of that job; a store succeeds when every key is in some writable
  backend, a load reports exactly the keys whose verified bytes are in their rows.
"""

from __future__ import annotations

import concurrent.futures
import logging
import queue
import threading
import time
from collections import OrderedDict
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from enum import Enum
from typing import TYPE_CHECKING, Any, ClassVar

from vllm.distributed.kv_transfer.kv_connector.v1.offloading.metrics import OffloadingConnectorStats
from vllm.v1.kv_offload.base import (
    Locality,
    LookupResult,
    Medium,
    OffloadingCounterMetadata,
    OffloadingEvent,
    OffloadingMetricMetadata,
    OffloadKey,
    ReqContext,
    RequestOffloadingContext,
    ScheduleEndContext,
)
from vllm.v1.kv_offload.tiering.async_lookup import AsyncLookupManager
from vllm.v1.kv_offload.tiering.base import JobId, JobResult, SecondaryTierManager, TransferJob

from ...backend_api import StorageBackend
from ...metrics import StackMetrics
from ...tiering.backend_set import BackendSet
from ..vllm.events import Medium as KvtierMedium
from .naming import TierNaming, tier_naming

if TYPE_CHECKING:
    from vllm.v1.kv_offload.base import OffloadingSpec
    from vllm.v1.kv_offload.tiering.backpressure import BackpressureDetector

log = logging.getLogger("kvtier.vllm_tier")

#: Chunks this tier remembers as stored (so a cascade of a chunk it already holds writes nothing).
KNOWN_CHUNKS = 1 << 20


class TierMetrics:
    """Prometheus names of the counters this tier adds to vLLM's offloading metrics."""

    STORED = "vllm:kv_offload_kvtier_stored_chunks"
    LOADED = "vllm:kv_offload_kvtier_loaded_chunks"
    FAILED = "vllm:kv_offload_kvtier_failed_chunks"


class Direction(Enum):
    STORE = "store"
    LOAD = "load"


@dataclass
class _Job:
    """One submitted job as the I/O thread sees it (row index per key)."""

    job_id: JobId
    direction: Direction
    keys: list[OffloadKey]
    rows: list[int]


@dataclass
class _Done:
    """A finished job, handed from an I/O thread to the scheduler thread."""

    job: _Job
    ok: list[bool]
    seconds: float
    nbytes: int
    #: per backend index, the keys it took (stores) or delivered (loads)
    by_backend: dict[int, list[OffloadKey]] = field(default_factory=dict)


class _Probes(AsyncLookupManager):
    """vLLM's non-blocking lookup machinery, asking kvtier's backends in its own thread."""

    def __init__(self, tier: KvtierTier):
        super().__init__(tier_type=tier.tier_type)
        self._tier = tier

    def batch_lookup(self, keys: list[OffloadKey], req_context: ReqContext) -> Iterable[bool]:
        return self._tier._probe(keys)


class KvtierTier(SecondaryTierManager):
    """kvtier's backends below vLLM's primary CPU tier.  Tier config (``secondary_tiers`` entry)::

        {"type": "KvtierTier", "module_path": "kvtier.integrations.vllm_tier",
         "kvtier_config": "configs/vllm-tier.yaml", "enable_kv_events": true}

    ``kvtier_config``: the kvtier YAML whose ``backends`` (and ``keys``, ``model.id``) this tier uses;
    its ``host`` section is unused (vLLM's primary tier is the host memory).  ``io_threads``: threads moving
    chunks.  ``locality``: LOCAL / REMOTE for vLLM's per-request tier filters (default: from the backends,
    unset when they differ).
    """

    medium: ClassVar[Medium] = Medium.STORAGE

    def __init__(self, offloading_spec: OffloadingSpec, primary_kv_view: memoryview, tier_type: str,
                 kvtier_config: str | None = None, io_threads: int = 4, enable_kv_events: bool = False,
                 locality: str | None = None, backpressure_detector: BackpressureDetector | None = None,
                 backends: Sequence[StorageBackend] | None = None):
        super().__init__(offloading_spec, primary_kv_view, tier_type, backpressure_detector)
        self.naming: TierNaming = tier_naming(offloading_spec.config, kvtier_config)
        cfg = self.naming.config
        if self.naming.payload_nbytes > self.block_size_bytes:
            raise ValueError(f"kvtier tier: a chunk's payload is {self.naming.payload_nbytes} bytes but the primary "
                             f"rows are {self.block_size_bytes}")
        # A flat byte view of the primary region: row c is [c * stride, c * stride + payload).
        self._flat = primary_kv_view.cast("B") if primary_kv_view.format != "B" or primary_kv_view.ndim != 1 \
            else primary_kv_view
        self._owned = backends is None
        built = list(backends) if backends is not None else cfg.build_backends()
        names = [b.name for b in built]
        writable = {b.name: b.write for b in cfg.backends}
        self.kinds = [next((c.type for c in cfg.backends if c.name == b.name), type(b).__name__.lower())
                      for b in built]
        self.media = [KvtierMedium.of_backend(k) for k in self.kinds]
        self.metrics = StackMetrics(names, self.naming.namespace.block_size)
        self.backends = BackendSet(built, [writable.get(n, True) for n in names], self.metrics,
                                   self.naming.namespace.layout_id, self.naming.payload_nbytes)
        if locality is not None:
            self.locality = Locality(locality.upper())
        elif self.media and len({m.locality for m in self.media}) == 1:
            self.locality = Locality(self.media[0].locality)
        self._events_on = bool(enable_kv_events and offloading_spec.kv_events_config.enable_kv_cache_events)
        if enable_kv_events and not self._events_on:
            log.warning("kvtier tier %r: enable_kv_events is set but vLLM's KV cache events are off; no events",
                        tier_type)
        self._events: list[OffloadingEvent] = []
        # chunk -> backends it was announced stored in (scheduler thread only)
        self._announced: OrderedDict[OffloadKey, set[int]] = OrderedDict()
        self._evictions: queue.SimpleQueue[tuple[int, list[str]]] = queue.SimpleQueue()
        for i, b in enumerate(built):
            b.on_evicted = self._evicted_listener(i)
        # Chunks known to be stored (scheduler thread only), least recently used first.
        self._known: OrderedDict[OffloadKey, None] = OrderedDict()
        self._done: queue.SimpleQueue[_Done] = queue.SimpleQueue()
        self._open: dict[JobId, concurrent.futures.Future[None] | None] = {}
        self._pool = concurrent.futures.ThreadPoolExecutor(max_workers=max(1, int(io_threads)),
                                                           thread_name_prefix="kvtier-vllm-tier")
        self._counts: dict[tuple[str, str], int] = {}
        self._counts_lock = threading.Lock()
        self._probes = _Probes(self)
        self.backends.start_watch()
        if self.backends.writable:  # what the namespace id means, for kvtier's tools; off this thread
            self._pool.submit(self.backends.put_manifests, self.naming.namespace)
        log.info("kvtier tier %r up: namespace %s (%s), %d-byte values, backends %s%s", tier_type,
                 self.naming.namespace.id, self.naming.namespace.payload, self.naming.payload_nbytes,
                 ", ".join(f"{n} ({k})" for n, k in zip(names, self.kinds)) or "none",
                 "; the values are KvtierConnector's" if self.naming.connector_compatible else "")

    # ------------------------------------------------------------------ vLLM's scheduler-thread API

    def on_new_request(self, req_context: ReqContext) -> RequestOffloadingContext:
        return RequestOffloadingContext()

    def lookup(self, key: OffloadKey, req_context: ReqContext) -> LookupResult:
        """HIT / MISS once this step's probe answered, RETRY while it is in flight (never waits)."""
        if self.naming.block_hash(key) is None or not len(self.backends):
            return LookupResult.MISS
        found = self._probes.lookup(key, req_context)
        if found is None:
            return LookupResult.RETRY
        return LookupResult.HIT if found else LookupResult.MISS

    def submit_store(self, job_metadata: TransferJob) -> None:
        """Cascade: the chunks' rows to every writable backend, in an I/O thread.  Chunks this tier
        already holds are not written again."""
        keys = list(job_metadata.keys)
        rows = [int(c) for c in job_metadata.chunk_ids]
        todo = [j for j, k in enumerate(keys) if k not in self._known]
        for k in keys:
            if k in self._known:
                self._known.move_to_end(k)
        job = _Job(job_metadata.job_id, Direction.STORE, [keys[j] for j in todo], [rows[j] for j in todo])
        self._submit(job)

    def submit_load(self, job_metadata: TransferJob) -> None:
        """Promotion: verified values into the chunks' primary rows, in an I/O thread."""
        job = _Job(job_metadata.job_id, Direction.LOAD, list(job_metadata.keys),
                   [int(c) for c in job_metadata.chunk_ids])
        self._submit(job)

    def get_finished_jobs(self) -> Iterable[JobResult]:
        results: list[JobResult] = []
        while True:
            try:
                done = self._done.get_nowait()
            except queue.Empty:
                break
            self._open.pop(done.job.job_id, None)
            results.append(self._finish(done))
        # After the stores: a backend's eviction notice follows the put that stored (and evicted) a chunk.
        self._take_evictions()
        return results

    def has_pending_work(self) -> bool:
        return bool(self._open)

    def take_events(self) -> Iterable[OffloadingEvent]:
        self._take_evictions()
        out, self._events = self._events, []
        return out

    def touch(self, keys: Collection[OffloadKey], req_context: ReqContext) -> None:
        """Recently used chunks stay longest in what this tier remembers as stored.  No backend I/O: a
        backend keeps its own recency from reads (local_disk's LRU, Redis' LRU / TTL)."""
        for k in keys:
            if k in self._known:
                self._known.move_to_end(k)

    def on_request_finished(self, req_context: ReqContext) -> None:
        self._probes.cleanup(req_context.req_id)

    def on_schedule_end(self, context: ScheduleEndContext) -> None:
        self._probes.flush()

    def drain_jobs(self) -> None:
        """Wait for every submitted job (vLLM's reset); their results stay queued for get_finished_jobs."""
        futures = [f for f in self._open.values() if f is not None]
        concurrent.futures.wait(futures)

    def shutdown(self) -> None:
        self._probes.shutdown()
        self._pool.shutdown(wait=True)
        self.backends.close([self._owned] * len(self.backends))
        self.metrics.close()
        # vLLM then closes the region's mmap, which it cannot while a view of it is exported.
        if self._flat is not self._primary_kv_view:
            self._flat.release()

    @classmethod
    def build_metric_definitions(cls, extra_config: dict[str, Any]) -> dict[str, OffloadingMetricMetadata]:
        return {
            TierMetrics.STORED: OffloadingCounterMetadata(
                documentation="Chunks the kvtier tier stored, labeled by kvtier backend.", labelnames=("backend",)),
            TierMetrics.LOADED: OffloadingCounterMetadata(
                documentation="Chunks the kvtier tier promoted from a verified value, labeled by kvtier backend.",
                labelnames=("backend",)),
            TierMetrics.FAILED: OffloadingCounterMetadata(
                documentation="Chunks of the kvtier tier's jobs that failed (no backend took them, or none "
                              "delivered a verified value), labeled by direction.", labelnames=("direction",)),
        }

    def get_stats(self) -> OffloadingConnectorStats | None:
        with self._counts_lock:
            counts, self._counts = self._counts, {}
        if not counts:
            return None
        stats = OffloadingConnectorStats()
        for (name, label), n in counts.items():
            stats.increase_counter(name, n, (label,))
        return stats

    def stats(self) -> dict[str, Any]:
        """kvtier's own view: the namespace, per-backend counters (hits, corrupt, unavailable...) and the
        tier's metrics; for tools and tests (reads backend usage: not for the scheduler thread)."""
        return {"namespace": self.naming.namespace.id, "payload": self.naming.namespace.payload,
                "backends": self.backends.stats(), "metrics": self.metrics.snapshot()}

    # ------------------------------------------------------------------ internals

    def _row(self, chunk: int) -> memoryview:
        start = chunk * self.block_size_bytes
        return self._flat[start:start + self.naming.payload_nbytes]

    def _submit(self, job: _Job) -> None:
        if not job.keys:  # nothing to move: done at once
            self._open[job.job_id] = None
            self._done.put(_Done(job, [], 0.0, 0))
            return
        try:
            self._open[job.job_id] = self._pool.submit(self._run, job)
        except RuntimeError as e:  # the pool is shut down: the job fails, the method does not
            log.warning("kvtier tier: job %s not run: %s", job.job_id, e)
            self._open[job.job_id] = None
            self._done.put(_Done(job, [False] * len(job.keys), 0.0, 0))

    def _run(self, job: _Job) -> None:
        """An I/O thread: the job's transfer; whatever happens, exactly one result is queued."""
        t0 = time.perf_counter()
        try:
            done = self._store(job) if job.direction is Direction.STORE else self._load(job)
        except Exception as e:  # noqa: BLE001 - a fault is a failed job, never an error in vLLM
            log.warning("kvtier tier: %s job %s failed: %s: %s", job.direction.value, job.job_id,
                        type(e).__name__, e)
            done = _Done(job, [False] * len(job.keys), 0.0, 0)
        done.seconds = time.perf_counter() - t0
        self._done.put(done)

    def _stored_keys(self, job: _Job) -> list[str | None]:
        return [self.naming.stored_key(k) for k in job.keys]

    def _store(self, job: _Job) -> _Done:
        names = self._stored_keys(job)
        idx = [j for j, s in enumerate(names) if s is not None]
        strs = [s for s in names if s is not None]  # in the order of idx
        views = [self._row(job.rows[j]) for j in idx]
        ok = [False] * len(job.keys)
        done = _Done(job, ok, 0.0, 0)
        for i in self.backends.writable:
            took = self.backends.put(i, strs, views)
            for j, t in zip(idx, took):
                if t:
                    ok[j] = True
                    done.by_backend.setdefault(i, []).append(job.keys[j])
        done.nbytes = sum(len(v) for v in done.by_backend.values()) * self.naming.payload_nbytes
        return done

    def _load(self, job: _Job) -> _Done:
        names = self._stored_keys(job)
        ok = [False] * len(job.keys)
        done = _Done(job, ok, 0.0, 0)
        todo = [j for j, s in enumerate(names) if s is not None]
        held = [s for s in names if s is not None]
        self.backends.hold(held)
        try:
            for i in range(len(self.backends)):  # fastest first; what one lacks (or holds damaged) from the next
                if not todo:
                    break
                got = self.backends.get_into(i, [names[j] or "" for j in todo], [self._row(job.rows[j]) for j in todo])
                for j, g in zip(todo, got):
                    if g:
                        ok[j] = True
                        done.by_backend.setdefault(i, []).append(job.keys[j])
                todo = [j for j in todo if not ok[j]]
        finally:
            self.backends.release(held)
        done.nbytes = sum(ok) * self.naming.payload_nbytes
        return done

    def _probe(self, keys: list[OffloadKey]) -> list[bool]:
        """Which ``keys`` some backend holds (the probe thread): the leading run of them that the backends
        hold between them, as kvtier's own lookups count a prefix.  A fault is a miss."""
        names = [self.naming.stored_key(k) for k in keys]
        run: list[str] = []
        for s in names:
            if s is None:
                break
            run.append(s)
        try:
            n = len(self.backends.locate(run))
        except Exception as e:  # noqa: BLE001 - BackendSet never raises; a miss if it ever did
            log.warning("kvtier tier: probe failed: %s: %s", type(e).__name__, e)
            n = 0
        return [j < n for j in range(len(keys))]

    def _finish(self, done: _Done) -> JobResult:
        """Scheduler thread: bookkeeping, events and metrics of a finished job, and its result."""
        job = done.job
        failed = [k for k, g in zip(job.keys, done.ok) if not g]
        for i, keys in done.by_backend.items():
            self._count(TierMetrics.LOADED if job.direction is Direction.LOAD else TierMetrics.STORED,
                        self.backends.names[i], len(keys))
        if failed:
            self._count(TierMetrics.FAILED, job.direction.value, len(failed))
        for k, g in zip(job.keys, done.ok):
            if g:
                self._remember(k)
        if job.direction is Direction.STORE:
            for i, keys in done.by_backend.items():
                self._announce(i, keys)
            return JobResult(job.job_id, success=not failed, transfer_time=done.seconds, transfer_bytes=done.nbytes)
        if failed:
            # Not loadable after all (gone, damaged and deleted, backend down): a miss from now on, and no
            # longer announced anywhere.
            for k in failed:
                self._known.pop(k, None)
                for i in sorted(self._announced.pop(k, set())):
                    self._event([k], i, removed=True)
            self._probes.mark_miss(failed)
        good = [k for k, g in zip(job.keys, done.ok) if g]
        return JobResult(job.job_id, success=not failed,
                         successful_keys=tuple(good) if failed and good else None,
                         transfer_time=done.seconds, transfer_bytes=done.nbytes)

    def _remember(self, key: OffloadKey) -> None:
        self._known[key] = None
        self._known.move_to_end(key)
        while len(self._known) > KNOWN_CHUNKS:
            self._known.popitem(last=False)

    def _announce(self, backend: int, keys: list[OffloadKey]) -> None:
        new = []
        for k in keys:
            media = self._announced.setdefault(k, set())
            self._announced.move_to_end(k)
            if backend not in media:
                media.add(backend)
                new.append(k)
        while len(self._announced) > KNOWN_CHUNKS:
            self._announced.popitem(last=False)
        if new:
            self._event(new, backend, removed=False)

    def _event(self, keys: list[OffloadKey], backend: int, *, removed: bool) -> None:
        if not self._events_on:
            return
        m = self.media[backend]
        # vLLM's medium is STORAGE for every secondary tier; which kvtier backend holds the chunk goes in the
        # event's ownership (kvtier:<backend type>), as kvtier's connector names its tiers.
        self._events.append(OffloadingEvent(keys=list(keys), medium=Medium.STORAGE, removed=removed,
                                            locality=Locality(m.locality), ownership=m.ownership))

    def _evicted_listener(self, backend: int) -> Any:
        def listener(keys: list[str]) -> None:  # a backend's thread: queued for the scheduler thread
            self._evictions.put((backend, keys))
        return listener

    def _take_evictions(self) -> None:
        prefix = self.naming.namespace.id + "/"
        while True:
            try:
                backend, keys = self._evictions.get_nowait()
            except queue.Empty:
                return
            gone = []
            for s in keys:
                if not s.startswith(prefix):
                    continue
                k = OffloadKey(self.naming.offload_key(bytes.fromhex(s[len(prefix):])))
                self._known.pop(k, None)
                media = self._announced.get(k)
                if media is not None and backend in media:
                    media.discard(backend)
                    if not media:
                        del self._announced[k]
                    gone.append(k)
            if gone:
                self._event(gone, backend, removed=True)

    def _count(self, name: str, label: str, n: int) -> None:
        with self._counts_lock:
            self._counts[(name, label)] = self._counts.get((name, label), 0) + n
