"""``KvtierConnector``: kvtier as a vLLM v1 KV connector.

Enable it with::

    --kv-transfer-config '{"kv_connector":"KvtierConnector","kv_connector_module_path":"kvtier.integrations.vllm",
                           "kv_role":"kv_both","kv_connector_extra_config":{"kvtier_config":"PATH.yaml"}}'

``kv_role``: ``kv_producer`` stores only, ``kv_consumer`` loads only, ``kv_both`` does both.  vLLM builds
the connector twice: role SCHEDULER in its EngineCore process (:class:`SchedulerSide`, around kvtier's
torch-free manager) and role WORKER in every worker process (:class:`WorkerSide`, around the tier stack
on that rank's KV tensors).  They talk only through vLLM: :class:`KvtierMetadata` (a
:class:`~kvtier.plans.StepPlan`) goes to the workers each step, :class:`KvtierWorkerMetadata` (a
:class:`~kvtier.plans.WorkerReport`) and the finished / failed loads come back.

kvtier is a cache: a block that cannot be loaded is recomputed.  So the connector sets vLLM's
``kv_load_failure_policy`` to ``recompute`` (logged), whatever the flag said: failing a request because
a cached block went missing would turn a cache miss into an error.
"""

from __future__ import annotations

import logging
import os
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorWorkerMetadata,
)
from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats

from ...plans import StepPlan, WorkerReport
from .facts import (
    cpu_kv_layout,
    key_seed_problem,
    kv_layers,
    kv_replicated_across_tp,
    kvtier_config,
    rank_tally,
    vllm_cpu_isa,
    why_loads_cannot_work,
    worker_rank,
)
from .logs import join_vllm_logging
from .scheduler import LoadMode, SchedulerSide
from .worker import (
    WorkerSide,
    check_cpu_arrangement,
    detect_layout,
    idle_wait_ms,
    kv_view,
    layer_order,
)

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvtier.vllm")


@dataclass
class KvtierMetadata(KVConnectorMetadata):
    """Scheduler -> workers, once per step."""

    plan: StepPlan = field(default_factory=StepPlan)


@dataclass
class KvtierWorkerMetadata(KVConnectorWorkerMetadata):
    """Workers -> scheduler, once per step: each rank's report, kept apart (vLLM aggregates the ranks
    that had something to say; the scheduler's :class:`~kvtier.plans.RankTally` counts them per block)."""

    reports: list[WorkerReport] = field(default_factory=list)

    def aggregate(self, other: KVConnectorWorkerMetadata) -> KVConnectorWorkerMetadata:
        assert isinstance(other, KvtierWorkerMetadata)
        return KvtierWorkerMetadata(self.reports + other.reports)


@dataclass
class KvtierStats(KVConnectorStats):
    """Per-interval counters from the workers (loaded / failed / stored blocks), summed across ranks."""

    def reset(self) -> None:
        self.data = {}

    def aggregate(self, other: KVConnectorStats) -> KVConnectorStats:
        for k, v in other.data.items():
            self.data[k] = self.data.get(k, 0) + v
        return self

    def reduce(self) -> dict[str, int | float]:
        return dict(self.data)

    def is_empty(self) -> bool:
        return not any(self.data.values())


def _own_cpus() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()


def _cpu_list(cpus: set[int]) -> str:
    return ",".join(map(str, sorted(cpus))) or "?"


class KvtierConnector(KVConnectorBase_V1):
    """kvtier's tiers (host memory, local disk, Redis, S3, plugins) behind vLLM's KV connector API."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        join_vllm_logging()  # before the first line kvtier logs in this process
        ktc = self._kv_transfer_config  # the base class checked it is set
        self._load = ktc.kv_role in ("kv_consumer", "kv_both")
        self._store = ktc.kv_role in ("kv_producer", "kv_both")
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | None = None
        self._last_stats: dict[str, int] = {}
        if role == KVConnectorRole.SCHEDULER:
            if ktc.kv_load_failure_policy != "recompute":
                log.info("kvtier: setting kv_load_failure_policy=recompute (a block kvtier cannot load is "
                         "recomputed, never an error)")
                ktc.kv_load_failure_policy = "recompute"
            why = why_loads_cannot_work(vllm_config) if self._load else None
            if why is not None:
                log.warning("kvtier: loads are off: %s; %s", why,
                            "this instance only stores" if self._store else "this kv_consumer does nothing")
                self._load = False
            cfg = kvtier_config(vllm_config, len(kv_layers(kv_cache_config)), layout=cpu_kv_layout(vllm_config))
            seed = key_seed_problem(cfg, vllm_config.cache_config.prefix_caching_hash_algo)
            if seed is not None:
                raise ValueError(f"kvtier: {seed}")
            mode = LoadMode.from_extra_config(ktc.kv_connector_extra_config)
            idle_wait_ms(ktc.kv_connector_extra_config)  # a bad value fails start-up here, before the workers
            self._scheduler = SchedulerSide(cfg, load=self._load, store=self._store,
                                            vllm_hash_algo=vllm_config.cache_config.prefix_caching_hash_algo,
                                            load_mode=mode, ranks=rank_tally(vllm_config, writes=self._store))
            log.info("kvtier: scheduler side up (%s), namespace %s, load_mode %s",
                     cfg.summary(getattr(kv_cache_config, "num_blocks", None), engine="vLLM"), cfg.namespace().id,
                     mode.value)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss

    # ------------------------------------------------------------------ worker side

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        from vllm.distributed.parallel_state import get_pcp_group, get_pp_group, get_tp_group

        names = layer_order(list(kv_caches))
        mc, pc = self._vllm_config.model_config, self._vllm_config.parallel_config
        mla = bool(getattr(mc, "use_mla", False))
        tensors = [kv_view(kv_caches[n], mla) for n in names]
        cc, heads, head_dim = self._vllm_config.cache_config, 1 if mla else mc.get_num_kv_heads(pc), mc.get_head_size()
        model_dtype = mc.dtype if isinstance(mc.dtype, torch.dtype) else tensors[0].dtype  # resolved by vLLM
        isa = (vllm_cpu_isa(model_dtype, cc.block_size, head_dim, cc.cache_dtype)
               if not mla and tensors[0].device.type == "cpu" else None)
        layout = detect_layout(tensors[0], heads, head_dim, cc.block_size, mla, cpu_isa=isa)
        expected = cpu_kv_layout(self._vllm_config)
        if expected is not None and layout != expected:
            # The scheduler named ``expected`` in its namespace (storage.payload: engine): keys would differ.
            raise ValueError(f"kvtier: vLLM's KV tensors have layout {layout}, but its configuration implies "
                             f"{expected} (the scheduler's namespace)")
        if isa is not None and layout.startswith("cpu_attn"):
            check_cpu_arrangement(layout, isa, tensors[0], heads, head_dim, cc.block_size, cc.cache_dtype)
        tp_rank = get_tp_group().rank_in_group
        cfg = kvtier_config(self._vllm_config, len(tensors), tp_rank=tp_rank, pp_rank=get_pp_group().rank_in_group,
                            layout=layout)
        if tp_rank and kv_replicated_across_tp(self._vllm_config) and cfg.writes_backends:
            # Every rank would write the same bytes under the same keys: rank 0 writes them, the others
            # only read (and the scheduler hears what is written from rank 0 alone: WorkerReport.writes).
            cfg = cfg.reading_only()
            log.info("kvtier: TP rank %d reads the backends and leaves writing to rank 0 (MLA: every rank "
                     "holds the same latent)", tp_rank)
        tp, pcp = get_tp_group(), get_pcp_group()
        rank = worker_rank(tp_rank, tp.world_size, pcp.rank_in_group, pcp.world_size, get_pp_group().rank_in_group)
        self._worker = WorkerSide(cfg, tensors, rank=rank,
                                  idle_wait_ms=idle_wait_ms(self._kv_transfer_config.kv_connector_extra_config))
        log.info("kvtier: worker side up: %d layers, layout %s%s, %s", len(tensors), layout,
                 f" (vLLM CPU's {isa} kernel, checked)" if isa is not None else "",
                 cfg.summary(self._worker.stack.device.num_blocks))
        log.info("kvtier: threads run on CPUs %s (transfer.cpus: %s); vLLM's worker thread is bound to %s",
                 _cpu_list(self._worker.thread_cpus()), cfg.transfer.cpus, _cpu_list(_own_cpus()))

    def _plan(self) -> StepPlan:
        meta = self._get_connector_metadata() if self.has_connector_metadata() else None
        return meta.plan if isinstance(meta, KvtierMetadata) else StepPlan()

    def start_load_kv(self, forward_context: Any, **kwargs: Any) -> None:
        if self._worker is not None:
            self._worker.start(self._plan())

    def wait_for_layer_load(self, layer_name: str) -> None:
        # Synchronous loads ended in start_load_kv (a stored value holds every layer of its blocks, so
        # there is no layer to wait for alone); vLLM schedules an asynchronous one only once finished.
        return

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        return  # blocks are copied out once per step, in wait_for_save, after every layer wrote them

    def wait_for_save(self) -> None:
        if self._worker is not None:
            self._worker.save(self._plan())

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        if self._worker is None:
            return None, None
        done = self._worker.finished(idle=self._plan().idle)
        return None, (done or None)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors() if self._worker is not None else set()

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        rep = self._worker.report()
        return KvtierWorkerMetadata([rep]) if rep else None

    def get_kv_connector_stats(self) -> KVConnectorStats | None:
        if self._worker is None:
            return None
        now = dict(self._worker.stats)
        delta = {k: v - self._last_stats.get(k, 0) for k, v in now.items()}
        self._last_stats = now
        return KvtierStats(data=delta) if any(delta.values()) else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> KVConnectorStats | None:
        return KvtierStats(data=dict(data or {}))

    def shutdown(self) -> None:
        if self._worker is not None:
            self._worker.close()
            self._worker = None
        if self._scheduler is not None:
            self._scheduler.close()
            self._scheduler = None

    # ------------------------------------------------------------------ scheduler side

    def bind_kv_cache_manager(self, kv_cache_manager: Any) -> None:
        super().bind_kv_cache_manager(kv_cache_manager)
        if self._scheduler is not None:
            self._scheduler.kv_cache_manager = kv_cache_manager

    def get_num_new_matched_tokens(self, request: Request, num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self._scheduler is not None
        try:
            return self._scheduler.matched_tokens(request, num_computed_tokens)
        except Exception as e:  # noqa: BLE001 - a kvtier fault is a miss, never a crash
            log.error("kvtier: lookup for request %s failed: %s", request.request_id, e)
            return 0, False

    def update_state_after_alloc(self, request: Request, blocks: Any, num_external_tokens: int) -> None:
        assert self._scheduler is not None
        if num_external_tokens:
            self._scheduler.after_alloc(request, list(blocks.get_block_ids()[0]), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return KvtierMetadata(self._scheduler.build_plan(scheduler_output))

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if self._scheduler is not None and isinstance(meta, KvtierWorkerMetadata):
            self._scheduler.apply(*meta.reports)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is not None:
            self._scheduler.finished(request)
        return False, None  # the step that computed a block also copied it out: nothing to wait for
