"""The tier stack: the conductor that moves KV blocks between device, host memory and storage backends.

Data flows one way down on store (device -> host -> backends, when the write policy says) and one way
up on load (backends -> host -> device), always through here, and backends are only used through the
:class:`~kvtier.backend_api.StorageBackend` contract.  Two halves, as in vLLM's KV connector:

* scheduler side (block hashes only, never tensors): :meth:`TierStack.lookup`, :meth:`TierStack.prefetch`,
  :meth:`TierStack.on_device_freed`;
* worker side (device block ids; the bytes move in worker threads or on CUDA streams):
  :meth:`TierStack.load`, :meth:`TierStack.store`, :meth:`TierStack.flush`.

Invariants:

* **Pinned in flight.**  Every block that a transfer or backend I/O is using holds a reference in the
  index (and its host slot a pin in the host tier) until the operation is over; eviction only ever
  picks blocks with no reference, so bytes are never freed or overwritten under a reader.
* **Index = truth about memory.**  ``index`` says a block is in host slot ``s`` iff that slot holds
  the block's verified bytes (READY); a device entry is the engine's block the stack last copied the
  block to or from (the engine clears it with :meth:`TierStack.on_device_freed`).  Backend bits are
  hints; lookups ask the backends themselves, loads verify every byte.
* **Failures never reach the engine.**  A backend fault is 0 hits (lookup), a skipped store (store),
  a miss to recompute (load), counted in metrics.  A failed load is never counted as loaded: the
  :class:`LoadResult` names exactly the blocks to recompute (everything from the first failure on).
* **Bounded.**  Nothing waits without a bound while holding a lock: a full host tier skips (counted)
  or evicts unpinned blocks; write-back evictions do their I/O outside the lock in worker threads,
  bounded by the backends' own timeouts; every wait takes a timeout.
* **One lock.**  ``_lock`` guards the index and the stack's in-flight sets and is never held across
  I/O, a copy, a wait, or a call into the transfer engine.

The store path lives in :mod:`kvtier._stack_down`, the load and prefetch paths in
:mod:`kvtier._stack_up`, results and handles in :mod:`kvtier._stack_results`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import threading
from collections.abc import Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import torch

from . import threads as kvthreads
from ._stack_backends import BackendSet
from ._stack_down import Downward, HostRoom
from ._stack_groups import Grouped
from ._stack_results import (
    LoadHandle,
    LoadResult,
    LookupResult,
    PendingOps,
    PrefetchHandle,
    StoreHandle,
    StoreResult,
    StoreStatus,
)
from ._stack_up import Upward
from .backend_api import StorageBackend
from .blockids import int_array
from .config import KvtierConfig, direct_loads, load_config
from .host import WRITING, HostTier, memory_available
from .index import BlockIndex, Tier
from .keys import Namespace
from .layout import KVLayout, LayoutError
from .manager import TierManager
from .metrics import StackMetrics
from .plans import WorkerReport
from .policy_api import EvictionPolicy, PrefetchPolicy, WritePolicy
from .tiers import BlockPool, DeviceTier
from .transfer import TransferEngine
from .units import format_size

log = logging.getLogger("kvtier.stack")
REWRITE_CHUNK = 64  # blocks per write-down job when a backend comes back (others' writes interleave)


class TierStack:
    """Device tier + optional host tier + storage backends, with write / prefetch / eviction policies.

    ``kv_caches``: the engine's KV tensors in ``config.device.layout`` (a list of per-layer tensors or
    one stacked tensor); None allocates a standalone cache of ``config.device.num_blocks`` blocks on
    ``config.device.kind`` (and a :class:`~kvtier.tiers.BlockPool` as ``block_pool``).
    ``backends``: instances to use instead of building ``config.backends`` (tests); each is writable
    unless a config backend of the same name says ``write: false``.  The stack closes only the
    backends it built.
    """

    def __init__(self, config: KvtierConfig, *, kv_caches: Any = None,
                 backends: Sequence[StorageBackend] | None = None):
        self.config = config
        self.namespace: Namespace = config.namespace()
        self.block_size = self.namespace.block_size
        self.device, self.block_pool = self._make_device(config, kv_caches)
        self.layout: KVLayout = self.device.layout
        self.host: HostTier | None = (HostTier.from_config(config.host, self.layout.block_nbytes)
                                      if config.host.capacity else None)
        threads = config.transfer.threads
        kvthreads.configure(config.transfer.cpus)  # process-wide: for every pool started from here on
        self._xfer = TransferEngine(self.device, self.host, num_workers=min(threads, 4)) if self.host else None

        cfg_write = {b.name: b.write for b in config.backends}
        if backends is None:
            built = [b.plugin()(b.options, name=b.name) for b in config.backends]
            owned = [True] * len(built)
        else:
            built, owned = list(backends), [False] * len(backends)
        names = [b.name for b in built]
        if len(set(names)) != len(names) or {"device", "host"} & set(names):
            raise ValueError(f"backend names must be unique and not 'device' or 'host', got {names}")
        self.backends: list[StorageBackend] = built
        self._owned = owned

        tiers = ["device", *(["host"] if self.host else []), *names]
        self.metrics = StackMetrics(tiers, self.block_size, gauges=self._gauges)
        # Engine blocks per stored value (storage.block_tokens): see kvtier.groups.
        self.storage_blocks = config.storage_blocks
        self._backends = BackendSet(built, [cfg_write.get(n, True) for n in names], self.metrics,
                                    self.namespace.layout_id, self.layout.block_nbytes * self.storage_blocks)
        pol = config.policies
        self.write_policy: WritePolicy = pol.write.plugin()(pol.write.options)
        self.prefetch_policy: PrefetchPolicy = pol.prefetch.plugin()(pol.prefetch.options)
        self.eviction_policy: EvictionPolicy = pol.eviction.plugin()(pol.eviction.options)
        self.prefetch_threshold_tokens = pol.prefetch.threshold_tokens
        self.prefetch_chunk_blocks = 16  # blocks read per backend call by a prefetch (cancel granularity)
        # A load reads its backend blocks in chunks of about this many bytes, copying each chunk to the
        # device while the next is read (too small: more backend calls; too large: less overlap).
        self.load_chunk_bytes = 32 * 2**20
        # Per backend: whether a load reads its blocks straight into the engine's KV tensors, skipping host
        # memory (kvtier.config.direct_loads: host.promote_loads false, CPU KV rows, a backend that reads
        # segments).
        self.direct_loads = direct_loads(config, self._backends.reads_segments, self.device.holds_payload_rows)

        self._say_memory(threads)
        slots = self.host.num_slots if self.host else 0
        self.index = BlockIndex(capacity=max(1024, self.device.num_blocks + slots))
        # Entries only in backends are hints (hit counts, where a block was written); beyond this many
        # entries the oldest of them are forgotten, so the index stays bounded in a long-lived process.
        self.max_index_entries = max(1 << 20, 4 * (self.device.num_blocks + slots))
        self._lock = threading.Lock()
        self._pending = PendingOps()
        self._storing: set[bytes] = set()  # device -> host copy (or direct backend write) in flight
        self._writing: set[bytes] = set()  # host -> backend write-down in flight
        # Host blocks whose write-back failed (insertion order = oldest first), bounded: see _stack_down.
        self._unwritten: dict[bytes, None] = {}
        # Host blocks the write policy sent down that a writable backend has not taken yet (it failed, was
        # down or refused): written again when a backend comes back (``_backend_back``).  Bounded by host
        # memory: a block leaves it when it leaves host memory.
        self._owed: dict[bytes, None] = {}
        # Host blocks of whole stored-value groups (storage.block_tokens > 1): block -> its group's blocks.
        self._members: dict[bytes, tuple[bytes, ...]] = {}
        self.max_unwritten = max(1, (self.host.num_slots if self.host else 0) // 4)
        self._io = kvthreads.pool(threads, "kvtier-write")  # backend writes (write-down, write-back)
        self._reads = kvthreads.pool(threads, "kvtier-read")  # backend reads (load, prefetch)
        self._closed = False
        # What host memory gained and lost since the last drain_report(): a manager in another process
        # (vLLM's scheduler) mirrors host residency from it.  None = nobody listens, nothing recorded.
        self._report: WorkerReport | None = None
        self.room = HostRoom(self)
        self._down = Downward(self)
        self._up = Upward(self)
        self._grouped = Grouped(self)

        # The scheduler half: the same index and lock, the same backend probing the vLLM connector uses.
        self.manager = TierManager(config, backends=self._backends, index=self.index, lock=self._lock)
        self.manager.on_forgotten = self._backend_evicted_locked
        self.manager.on_backend_back = self._backend_back
        self.tier_names = self.manager.tier_names  # what this deployment calls its tiers (reports, logs)
        self._backends.put_manifests(self.namespace)
        if self._backends.writable:
            self._backends.start_watch()  # a backend back from an outage gets what it missed, traffic or not
        self.metrics_port: int | None = None
        if config.metrics.prometheus_port:
            self.metrics_port = self.metrics.serve(config.metrics.prometheus_port,
                                                   config.metrics.bind_address)

    @classmethod
    def from_config(cls, path_or_config: str | os.PathLike[str] | KvtierConfig | None = None,
                    **kw: Any) -> TierStack:
        """A stack from a config object, a YAML path, or None (the embedded default config)."""
        cfg = path_or_config if isinstance(path_or_config, KvtierConfig) else load_config(path_or_config)
        return cls(cfg, **kw)

    @staticmethod
    def _make_device(config: KvtierConfig, kv_caches: Any) -> tuple[DeviceTier, BlockPool | None]:
        ns, d = config.namespace(), config.device
        if kv_caches is None:
            kind = d.kind if d.kind != "auto" else ("cuda" if torch.cuda.is_available() else "cpu")
            layout = KVLayout.from_namespace(ns, d.num_blocks, d.layout)
            return DeviceTier.allocate(layout, kind), BlockPool(d.num_blocks)
        # The engine's tensors fix the block count; everything else must be what the config says.
        first = kv_caches if isinstance(kv_caches, torch.Tensor) else next(iter(kv_caches), None)
        if not isinstance(first, torch.Tensor):
            raise LayoutError("kv_caches: expected a tensor or a non-empty list of tensors")
        blocks_dim = {"flash_attn": 1, "flashinfer": 0, "mla": 0, "cpu_attn": 0, "cpu_attn_amx": 0,
                      "stacked": 1 + (ns.attention != "mla")}[d.layout]
        if first.dim() <= blocks_dim:
            raise LayoutError(f"kv_caches: a {d.layout} tensor has more than {blocks_dim} dims, got shape "
                              f"{tuple(first.shape)}")
        layout = KVLayout.from_namespace(ns, int(first.shape[blocks_dim]), d.layout)
        layout.validate(kv_caches)
        return DeviceTier(layout, kv_caches), None

    # ------------------------------------------------------------------ scheduler side

    def lookup(self, hashes: Sequence[bytes], *, record: bool = True, start: int = 0) -> LookupResult:
        """The longest prefix of ``hashes`` available in some tier, and where each block is best served
        from.  Memory tiers come from the index; backends are asked (``contains_prefix``) for the rest,
        so blocks another process stored are found.  A failing backend counts as 0 hits.  With
        ``record`` the result is counted as one request in the metrics (matched tokens per tier); pass
        False when a scheduler asks again about the same request.  ``start``: the chain position of
        ``hashes[0]`` (0 for a whole prompt), which places stored values of several blocks."""
        hashes = self.manager.check_hashes(hashes)
        n = len(hashes)
        tiers = self.manager.resolve(hashes, _start(start))
        res = LookupResult(tiers, self.block_size, n, self.manager.tier_names)
        if record:
            self.metrics.record_request(res.tiers, n)
        return res

    def prefetch(self, hashes: Sequence[bytes], *, lookup: LookupResult | None = None,
                 start: int = 0) -> PrefetchHandle:
        """Start copying the blocks of the longest available prefix that are only in backends into host
        memory, if they are at least ``policies.prefetch.threshold_tokens`` tokens; ``lookup`` reuses a
        result just computed for the same hashes.  ``handle.wait()`` applies the prefetch policy."""
        return self._up.prefetch(self.manager.check_hashes(hashes), lookup, _start(start))

    def on_device_freed(self, block_ids: Sequence[int]) -> None:
        """The engine freed or reused these device blocks: forget what the index says they hold."""
        with self._lock:
            self.index.free_devices(int_array(block_ids, "block ids").tolist())

    def drain_report(self) -> WorkerReport:
        """Host-memory changes, and blocks the backends evicted, since the last call (recording starts with
        the first call)."""
        with self._lock:
            self.manager.fold_evictions_locked()
            out, self._report = self._report or WorkerReport(), WorkerReport()
        return out

    def _backend_evicted_locked(self, key: bytes, backend: int) -> None:
        """Backend ``backend`` evicted ``key`` (the manager has unmarked it there): a manager in another
        process must forget it too, or it offers a hit every load of which fails."""
        if self._report is not None:
            self._report.left_backend.add((key, backend))
            self._report.in_backend.discard((key, backend))

    def leading_in_memory(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``hashes`` in host memory or on the device."""
        with self._lock:
            return self.index.lookup_prefix(list(hashes)).in_memory

    # ------------------------------------------------------------------ worker side

    def load(self, hashes: Sequence[bytes], block_ids: Sequence[int], *, layerwise: bool = False,
             start: int = 0) -> LoadHandle:
        """Copy the longest available prefix of ``hashes`` into device blocks ``block_ids`` (same
        length).  Sources, best first: host memory; the same device block already holding it (no copy);
        the backends, fetched into host memory first (promoted; a temporary buffer when host memory has
        no room).  ``handle.wait()`` -> :class:`LoadResult`: ``ok`` per block (a prefix), ``recompute``."""
        hashes = self.manager.check_hashes(hashes)
        ids = self._check_ids(block_ids, len(hashes))
        if len(np.unique(ids)) != ids.size:
            dup = sorted({int(b) for b in ids if (ids == b).sum() > 1})
            raise ValueError(f"block ids: a load needs distinct destination blocks, got duplicates {dup}")
        return self._up.load(hashes, ids, layerwise, _start(start))

    def store(self, hashes: Sequence[bytes], block_ids: Sequence[int], *, start: int = 0) -> StoreHandle:
        """Copy device blocks ``block_ids`` holding ``hashes`` into host memory (allocating slots; when
        full, evicting unpinned blocks as the eviction policy says, or skipping and counting); then the
        write policy decides which go down to the backends, and when (asynchronously).  The engine may
        reuse the device blocks once ``handle.wait()`` has returned."""
        hashes = self.manager.check_hashes(hashes)
        return self._down.store(hashes, self._check_ids(block_ids, len(hashes)), _start(start))

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every store in flight and every pending backend write has finished; False if
        ``timeout`` expired first.  A prefill process calls it before exit."""
        return self._pending.wait(timeout)

    # ------------------------------------------------------------------ observability

    def stats(self) -> dict[str, Any]:
        out = self.metrics.snapshot()
        out["host"] = dataclasses.asdict(self.host.stats()) if self.host else None
        with self._lock:
            out["index"] = {"entries": len(self.index), "device": self.index.count(Tier.DEVICE),
                            "host": self.index.count(Tier.HOST), "pinned": self.index.pinned,
                            "writing_down": len(self._writing),
                            **{n: self.index.count(Tier.backend(i)) for i, n in enumerate(self._backends.names)}}
        out["transfer"] = self._xfer.stats() if self._xfer else None
        out["backends"] = self._backends.stats()
        out["pending"] = self._pending.count
        return out

    def summary(self) -> str:
        """Like FastDeploy's request summary: device / host / storage matched tokens, then per-tier
        hits, bytes and failures, then host occupancy."""
        lines = [self.metrics.summary()]
        if self.host:
            s = self.host.stats()
            with self._lock:
                in_use = self.index.pinned
            lines.append(f"  host slots: {s.ready} ready, {s.writing} writing, {s.free} free of {s.num_slots}; "
                         f"{in_use} blocks in use")
        return "\n".join(lines)

    def _gauges(self) -> dict[str, float]:
        g: dict[str, float] = {"pending_writes": self._pending.count, "index_entries": len(self.index),
                               "pinned_blocks": self.index.pinned}
        if self.host:
            s = self.host.stats()
            g.update(host_slots=s.num_slots, host_slots_used=s.num_slots - s.free,
                     host_unwritten_blocks=len(self._unwritten), host_owed_blocks=len(self._owed))
        return g

    def close(self, timeout: float | None = 30.0) -> None:
        """Flush (up to ``timeout`` s), stop the workers, close the backends the stack built."""
        if self._closed:
            return
        if not self.flush(timeout):
            log.warning("close: %d backend writes still pending after %s s", self._pending.count, timeout)
        self._closed = True
        self._reads.shutdown(wait=True)
        self._io.shutdown(wait=True)
        if self._xfer is not None:
            self._xfer.close()
        self.manager.close()
        self.metrics.close()
        self._backends.close(self._owned)
        if self.host is not None:
            self.host.close()

    def __enter__(self) -> TierStack:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.close()

    # ------------------------------------------------------------------ index bookkeeping (hold _lock)

    def _check_ids(self, block_ids: Sequence[int], n: int) -> np.ndarray:
        ids = int_array(block_ids, "block ids")
        if ids.size != n:
            raise ValueError(f"{n} hashes but {ids.size} block ids")
        bad = ~self.device.valid_block_ids(ids)
        if bad.any():
            raise ValueError(f"block ids {ids[bad].tolist()} out of range [0, {self.device.num_blocks})")
        return ids

    def _trim_index_locked(self) -> None:
        """Forget the least recently used backend-only entries once the index is over its bound."""
        excess = len(self.index) - self.max_index_entries
        if excess <= 0:
            return
        excess += self.max_index_entries // 8  # trim in batches: the scan below is O(entries)
        for i in range(len(self._backends)):
            for key in self.index.eviction_candidates(Tier.backend(i), excess):
                e = self.index.get(key)
                if e is not None and e.refs == 0 and e.device is None and e.host is None:
                    self.index.remove(key)
                    excess -= 1
            if excess <= 0:
                return

    def _hit_locked(self, key: bytes) -> int:
        """Count a hit (a reuse): recency for eviction, and the count write policies look at."""
        hits = self.index.touch(key)
        if self.index.host_slot(key) is not None:
            self.eviction_policy.on_access(Tier.HOST, [key])
        return hits

    def host_tier(self) -> HostTier:
        """The host tier, on the paths that run only when there is one (``host.capacity`` > 0)."""
        if self.host is None:
            raise RuntimeError("this stack has no host tier (host.capacity: 0)")
        return self.host

    def transfers(self) -> TransferEngine:
        """The host <-> device transfer engine: it exists exactly when the host tier does."""
        if self._xfer is None:
            raise RuntimeError("this stack has no host tier (host.capacity: 0), so no host <-> device transfers")
        return self._xfer

    def _commit_host_locked(self, key: bytes, slot: int) -> int:
        """Record ``key`` in host ``slot`` (READY or WRITING, unpinned) unless another slot already holds
        it (a concurrent store or fetch won): then ``slot`` is freed.  Returns the slot holding ``key``."""
        e = self.index.get(key)
        host = self.host_tier()
        if e is not None and e.host is not None and e.host != slot:
            host.free([slot])
            return e.host
        if host.state(slot) == WRITING:
            host.commit([slot], [key])
        if key not in self.index:
            self.index.insert(key)
        self.index.set_host(key, slot)
        self.eviction_policy.on_insert(Tier.HOST, [key])
        if self._report is not None:
            self._report.in_host[key] = slot
            self._report.left_host.discard(key)
        return slot

    def _drop_host_locked(self, key: bytes) -> None:
        """Evict ``key`` from host memory (unpinned): its slot becomes free."""
        slot = self.index.clear_host(key)
        self._unwritten.pop(key, None)
        self._owed.pop(key, None)
        self._members.pop(key, None)
        if slot is not None:
            self.host_tier().free([slot])
            self.eviction_policy.on_remove(Tier.HOST, [key])
            self.metrics.add("host", evictions=1)
            if self._report is not None:
                self._report.in_host.pop(key, None)
                self._report.left_host.add(key)
        self.index.discard_if_unused(key)

    def _say_memory(self, threads: int) -> None:
        """Say at start-up what host memory this process holds for kvtier, and warn when the host tier is a
        large share of what the machine has free: every process running a stack (each vLLM worker, one
        per TP rank, of every instance on the host) reserves its own."""
        tier = "no host tier"
        if self.host is not None:
            s = self.host.stats()
            tier = (f"host tier {format_size(self.host.capacity_bytes)} ({s.num_slots} slots of "
                    f"{format_size(s.block_nbytes)}, {'pinned' if self.host.pin_memory else 'pageable'})")
        log.info("kvtier: this process (pid %d) reserves %s; a load reads through at most %s of buffers at a "
                 "time; %d read and %d write threads", os.getpid(), tier, format_size(self.load_chunk_bytes),
                 threads, threads)
        free = memory_available()
        if self.host is not None and free is not None and self.host.capacity_bytes > free // 2:
            log.warning("kvtier: host.capacity %s is more than half the memory free on this machine (%s "
                        "after reserving it): every process running kvtier reserves its own (each vLLM worker, "
                        "one per TP rank); size host.capacity per process", format_size(self.host.capacity_bytes),
                        format_size(free))

    def _backend_back(self, i: int, in_host: list[bytes]) -> None:
        """Backend ``i`` answers again after an outage, or was found restarted (its marks are forgotten
        already): write to it, in the background, the namespace manifest and what host memory still holds
        that it should have: the blocks it was known to hold (it may have come back empty) and those the
        write policy sent down whose writes failed or were skipped meanwhile.  Bounded: what host memory
        holds, in jobs of ``REWRITE_CHUNK`` blocks queued behind the writes already waiting."""
        if i not in self._backends.writable or self._closed:
            return
        with self._lock:
            # Not the write-back victims that failed (``_unwritten``): write-back wants a block written
            # when it is evicted, which those are again (and then written) at their next eviction.
            wanted = dict.fromkeys([*in_host, *self._owed])
            keys = [k for k in wanted if self.index.host_slot(k) is not None]
        if keys:
            log.info("backend %r is back: writing again %d block(s) host memory holds that it lacks",
                     self._backends.names[i], len(keys))
        self._submit(self._io, self._rewrite, i, keys)

    def _rewrite(self, i: int, keys: list[bytes]) -> None:
        self._backends.put_manifest(i, self.namespace)
        for a in range(0, len(keys), REWRITE_CHUNK):
            self._down.write_down(keys[a:a + REWRITE_CHUNK])

    def _submit(self, pool: ThreadPoolExecutor, fn: Any, *args: Any) -> bool:
        """Run ``fn(*args)`` on ``pool``; False (nothing run) once the stack is closing."""
        try:
            pool.submit(_logged, fn, *args)
            return True
        except RuntimeError:
            return False


def _start(start: int) -> int:
    """A chain position: an int >= 0 (ValueError naming it otherwise)."""
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
        raise ValueError(f"start: expected the chain position of hashes[0], an int >= 0, got {start!r}")
    return int(start)


def _logged(fn: Any, *args: Any) -> None:
    try:
        fn(*args)
    except Exception:  # noqa: BLE001 - a worker's fault is logged; its handles are finished by fn
        log.exception("kvtier worker task %s failed", getattr(fn, "__name__", fn))


__all__ = ["LoadHandle", "LoadResult", "LookupResult", "PrefetchHandle", "StoreHandle", "StoreResult",
           "StoreStatus", "TierStack"]
