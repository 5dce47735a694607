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
* **One lock.**  The planner's ``lock`` guards the index and what is in flight and is never held across
  I/O, a copy, a wait, or a call into the transfer engine.

This class is a facade: every placement decision is the planner's
(:class:`~kvtier.tiering.planner.Planner`, torch-free), the executors run them (the store path in
:mod:`kvtier.tiering.store_path`, the load and prefetch paths in :mod:`kvtier.tiering.load_path`, every
read of a stored value, whatever its size, in :mod:`kvtier.tiering.reads`, every write of one in
:mod:`kvtier.tiering.writes`), results and handles are in
:mod:`kvtier.tiering.results`.
"""

from __future__ import annotations

import dataclasses
import logging
import os
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from . import threads as kvthreads
from .backend_api import StorageBackend
from .config import KvtierConfig, direct_loads, load_config
from .format.layout import KVLayout, LayoutError
from .index import BlockIndex
from .keys import Namespace
from .memory.blockids import int_array
from .memory.blockpool import BlockPool
from .memory.device import DeviceTier
from .memory.host import HostTier, memory_available
from .memory.transfer import TransferEngine
from .metrics import StackMetrics
from .plans import LeadLoad, LeadStore, WorkerReport
from .policy_api import EvictionPolicy, PrefetchPolicy, WritePolicy
from .quota import tenant_problem
from .tiering.backend_set import BackendSet
from .tiering.load_path import Upward
from .tiering.manager import TierManager
from .tiering.parts import StackParts, Tuning, Workers
from .tiering.planner import Planner
from .tiering.results import (
    LoadHandle,
    LoadResult,
    LookupResult,
    PrefetchHandle,
    StoreHandle,
    StoreResult,
    StoreStatus,
)
from .tiering.store_path import Downward, HostRoom
from .tiering.writes import BackendWriter
from .units import format_size

log = logging.getLogger("kvtier.stack")
REWRITE_CHUNK = 64  # blocks per write-down job when a backend comes back (others' writes interleave)


class TierStack:
    """Device tier + optional host tier + storage backends, with write / prefetch / eviction policies.

    ``kv_caches``: the engine's KV tensors in ``config.device.layout`` (a list of per-layer tensors or
    one stacked tensor); None allocates a standalone cache of ``config.device.num_blocks`` blocks on
    ``config.device.kind`` (and a :class:`~kvtier.memory.BlockPool` as ``block_pool``).
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
            built = config.build_backends()
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
        # Engine blocks per stored value (storage.block_tokens): see kvtier.format.groups.
        self.storage_blocks = config.storage_blocks
        self._backends = BackendSet(built, [cfg_write.get(n, True) for n in names], self.metrics,
                                    self.namespace.layout_id, self.layout.block_nbytes * self.storage_blocks)
        self.planner = Planner(config, backends=self._backends, metrics=self.metrics, slots=self.host,
                               device_blocks=self.device.num_blocks)
        pol = config.policies
        self.write_policy: WritePolicy = self.planner.write_policy
        self.eviction_policy: EvictionPolicy = self.planner.eviction_policy
        self.prefetch_policy: PrefetchPolicy = pol.prefetch.plugin()(pol.prefetch.options)
        self.index: BlockIndex = self.planner.index
        self.manager: TierManager = self.planner.manager
        self.tier_names = self.manager.tier_names  # what this deployment calls its tiers (reports, logs)
        # Per backend: whether a load reads its blocks straight into the engine's KV tensors, skipping host
        # memory (kvtier.config.direct_loads: host.promote_loads false, CPU KV rows, a backend that reads
        # segments).
        self.direct_loads = direct_loads(config, self._backends.reads_segments, self.device.holds_payload_rows)
        self._tuning = Tuning()
        self._say_memory(threads)
        self._workers = Workers(threads)
        self._parts = StackParts(self.planner, self.device, self.host, self._xfer, self._backends, self.metrics,
                                 self.namespace, self._workers, self._tuning, self.direct_loads,
                                 self.prefetch_policy, pol.prefetch.threshold_tokens)
        writer = BackendWriter(self._parts)
        self._room = HostRoom(self._parts, writer)
        self._down = Downward(self._parts, self._room, writer)
        self._up = Upward(self._parts, self._room, self._down, self.lookup)

        self.manager.on_backend_back = self._backend_back
        self._backends.put_manifests(self.namespace)
        if self._backends.writable:
            self._backends.start_watch()  # a backend back from an outage gets what it missed, traffic or not
        self.metrics_port: int | None = None
        if config.metrics.prometheus_port:
            self.metrics_port = self.metrics.serve(config.metrics.prometheus_port,
                                                   config.metrics.bind_address)

    # Sizes the executors read at each operation; tests and benchmarks change them on a live stack.
    @property
    def load_chunk_bytes(self) -> int:
        """A load reads its backend blocks in chunks of about this many bytes (``Tuning``)."""
        return self._tuning.load_chunk_bytes

    @load_chunk_bytes.setter
    def load_chunk_bytes(self, n: int) -> None:
        self._tuning.load_chunk_bytes = n

    @property
    def prefetch_chunk_blocks(self) -> int:
        """Blocks read per backend call by a prefetch (its cancel granularity)."""
        return self._tuning.prefetch_chunk_blocks

    @prefetch_chunk_blocks.setter
    def prefetch_chunk_blocks(self, n: int) -> None:
        self._tuning.prefetch_chunk_blocks = n

    @property
    def max_index_entries(self) -> int:
        """Index entries kept before backend-only ones are forgotten, oldest first."""
        return self.planner.max_index_entries

    @max_index_entries.setter
    def max_index_entries(self, n: int) -> None:
        self.planner.max_index_entries = n

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
        self.planner.device_freed(int_array(block_ids, "block ids").tolist())

    def drain_report(self) -> WorkerReport:
        """Backend writes, and blocks the backends evicted, since the last call (recording starts with the
        first call)."""
        return self.planner.drain_report()

    def leading_in_memory(self, hashes: Sequence[bytes]) -> int:
        """Leading blocks of ``hashes`` in host memory or on the device."""
        return self.planner.leading_in_memory(hashes)

    def evict_host(self, hashes: Sequence[bytes]) -> int:
        """Evict these blocks from host memory now, where nothing uses them (an operator freeing memory, a
        test standing in for memory pressure); returns how many left."""
        n = 0
        with self.planner.lock:
            for key in hashes:
                e = self.index.get(key)
                if e is not None and e.host is not None and e.refs == 0 and not self.planner.copying_locked(key):
                    self.planner.drop_host_locked(key)
                    n += 1
        return n

    # ------------------------------------------------------------------ worker side

    def load(self, hashes: Sequence[bytes], block_ids: Sequence[int], *, layerwise: bool = False,
             start: int = 0, plan: LeadLoad | None = None) -> LoadHandle:
        """Copy the longest available prefix of ``hashes`` into device blocks ``block_ids`` (same
        length).  Sources, best first: host memory; the same device block already holding it (no copy);
        the backends, fetched into host memory first (promoted; a temporary buffer when host memory has
        no room).  ``handle.wait()`` -> :class:`LoadResult`: ``ok`` per block (a prefix), ``recompute``.

        ``plan``: this load as another planner started it (a scheduler's, one plan for every rank): the
        blocks read from backends into host memory take the slots its room names, and no other
        (``LoadResult.outcome`` says which did, for that planner to fold)."""
        hashes = self.manager.check_hashes(hashes)
        ids = self._check_ids(block_ids, len(hashes))
        if len(np.unique(ids)) != ids.size:
            dup = sorted({int(b) for b in ids if (ids == b).sum() > 1})
            raise ValueError(f"block ids: a load needs distinct destination blocks, got duplicates {dup}")
        if plan is not None and any(not 0 <= i < len(hashes) for i in plan.fetch):
            raise ValueError(f"load: the plan reads positions {list(plan.fetch)}, the load has {len(hashes)} blocks")
        return self._up.load(hashes, ids, layerwise, _start(start), plan)

    def store(self, hashes: Sequence[bytes], block_ids: Sequence[int], *, start: int = 0,
              tenant: str | None = None, plan: LeadStore | None = None) -> StoreHandle:
        """Copy device blocks ``block_ids`` holding ``hashes`` into host memory (allocating slots; when
        full, evicting unpinned blocks as the eviction policy says, or skipping and counting); then the
        write policy decides which go down to the backends, and when (asynchronously).  The engine may
        reuse the device blocks once ``handle.wait()`` has returned.  ``tenant``: the tag of the request's
        ``cache_salt`` (``kvtier.keys.tenant_tag``): the blocks it stores are charged to that tenant's quota
        in the backends, whenever they are written (``kvtier.quota``); None: the namespace's.

        ``plan``: this store as another planner started it over the same blocks (a scheduler's, one plan
        for every rank's stack): this stack takes the host slots and write-back victims it names instead
        of choosing its own, and sends down what it says (``Planner.adopt_store_locked``).  Where this
        stack cannot follow it (a named slot in use here, other blocks new here), the plan's new blocks
        are FAILED here, a log line and ``stores_skipped``; nothing is held."""
        hashes = self.manager.check_hashes(hashes)
        if tenant is not None and (why := tenant_problem(tenant)) is not None:
            raise ValueError(f"store: tenant: {why}")
        ids = self._check_ids(block_ids, len(hashes))
        if plan is not None and any(not 0 <= i < len(hashes) for i in plan.new):
            raise ValueError(f"store: the plan stores positions {list(plan.new)}, the store has {len(hashes)} blocks")
        return self._down.store(hashes, ids, _start(start), tenant, plan)

    def flush(self, timeout: float | None = None) -> bool:
        """Wait until every store in flight and every pending backend write has finished; False if
        ``timeout`` expired first.  A prefill process calls it before exit."""
        return self._workers.pending.wait(timeout)

    # ------------------------------------------------------------------ observability

    def stats(self) -> dict[str, Any]:
        out = self.metrics.snapshot()
        out["host"] = dataclasses.asdict(self.host.stats()) if self.host else None
        counts = self.planner.counts()
        out["index"] = {k: v for k, v in counts.items() if k not in ("unwritten", "owed")}
        out["transfer"] = self._xfer.stats() if self._xfer else None
        out["backends"] = self._backends.stats()
        out["pending"] = self._workers.pending.count
        return out

    def summary(self) -> str:
        """Like FastDeploy's request summary: device / host / storage matched tokens, then per-tier
        hits, bytes and failures, then host occupancy."""
        lines = [self.metrics.summary()]
        if self.host:
            s = self.host.stats()
            in_use = self.planner.counts()["pinned"]
            lines.append(f"  host slots: {s.ready} ready, {s.writing} writing, {s.free} free of {s.num_slots}; "
                         f"{in_use} blocks in use")
        return "\n".join(lines)

    def _gauges(self) -> dict[str, float]:
        counts = self.planner.counts()
        g: dict[str, float] = {"pending_writes": self._workers.pending.count, "index_entries": counts["entries"],
                               "pinned_blocks": counts["pinned"]}
        if self.host:
            s = self.host.stats()
            g.update(host_slots=s.num_slots, host_slots_used=s.num_slots - s.free,
                     host_unwritten_blocks=counts["unwritten"], host_owed_blocks=counts["owed"])
        return g

    def close(self, timeout: float | None = 30.0) -> None:
        """Flush (up to ``timeout`` s), stop the workers, close the backends the stack built."""
        if self._workers.closed:
            return
        if not self.flush(timeout):
            log.warning("close: %d backend writes still pending after %s s", self._workers.pending.count, timeout)
        self._workers.close()
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

    # ------------------------------------------------------------------ checks and parts

    def _check_ids(self, block_ids: Sequence[int], n: int) -> np.ndarray:
        ids = int_array(block_ids, "block ids")
        if ids.size != n:
            raise ValueError(f"{n} hashes but {ids.size} block ids")
        bad = ~self.device.valid_block_ids(ids)
        if bad.any():
            raise ValueError(f"block ids {ids[bad].tolist()} out of range [0, {self.device.num_blocks})")
        return ids

    def host_tier(self) -> HostTier:
        """The host tier, on the paths that run only when there is one (``host.capacity`` > 0)."""
        return self._parts.host_tier()

    def transfers(self) -> TransferEngine:
        """The host <-> device transfer engine: it exists exactly when the host tier does."""
        return self._parts.transfers()

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
        that it should have (the planner's ``owed_to``).  Bounded: what host memory holds, in jobs of
        ``REWRITE_CHUNK`` blocks queued behind the writes already waiting."""
        if i not in self._backends.writable or self._workers.closed:
            return
        keys = self.planner.owed_to(i, in_host)
        if keys:
            log.info("backend %r is back: writing again %d block(s) host memory holds that it lacks",
                     self._backends.names[i], len(keys))
        self._workers.submit(self._workers.io, self._rewrite, i, keys)

    def _rewrite(self, i: int, keys: list[bytes]) -> None:
        self._backends.put_manifest(i, self.namespace)
        for a in range(0, len(keys), REWRITE_CHUNK):
            self._down.write_down(keys[a:a + REWRITE_CHUNK])


def _start(start: int) -> int:
    """A chain position: an int >= 0 (ValueError naming it otherwise)."""
    if isinstance(start, bool) or not isinstance(start, (int, np.integer)) or start < 0:
        raise ValueError(f"start: expected the chain position of hashes[0], an int >= 0, got {start!r}")
    return int(start)


__all__ = ["LoadHandle", "LoadResult", "LookupResult", "PrefetchHandle", "StoreHandle", "StoreResult",
           "StoreStatus", "TierStack"]
