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
from collections.abc import Iterable
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorHandshakeMetadata,
    KVConnectorMetadata,
    KVConnectorRole,
    KVConnectorTransferResults,
    KVConnectorWorkerMetadata,
    SupportsHMA,
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
from .groups import KvGroup, group_config, host_shares, kv_groups
from .logs import join_vllm_logging
from .scheduler import LoadMode, SchedulerSide
from .worker import (
    GroupWorkers,
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
class KvtierHandshake(KVConnectorHandshakeMetadata):
    """Each worker -> the scheduler, once at start-up (vLLM's KV connector handshake, after the KV caches
    are registered): this rank's host slots per KV cache group (0: no host tier), and per group whether its
    loads read every backend straight into vLLM's KV (``direct``: they take no host room).  The scheduler's
    planner places stores and loads in the smallest rank's number of slots, which every rank has."""

    host_slots: dict[int, int] = field(default_factory=dict)
    direct: dict[int, bool] = field(default_factory=dict)


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


def _kv_events_on(vllm_config: Any) -> bool:
    kec = getattr(vllm_config, "kv_events_config", None)
    return bool(kec is not None and kec.enable_kv_cache_events)


def _group_line(g: KvGroup) -> str:
    what = {"full": "every prompt block", "sliding_window": "every prompt block, loads the window",
            "state": "the state at block boundaries"}[g.kind.value]
    return f"group {g.index} {g.label()} x{len(g.layer_names)} layers: stores {what}"


def state_rows(t: torch.Tensor, name: str, row_nbytes: int) -> torch.Tensor:
    """A state layer's KV cache tensor (vLLM: its state page per block, ``[N, 1, 1, bytes]`` int8, strided by
    the padded page) as kvtier's ``mla``-shaped row layout ``[N, 1, bytes]``: a view of the same memory."""
    if t.dtype not in (torch.int8, torch.uint8) or t.shape[-1] != row_nbytes or t.numel() != t.shape[0] * row_nbytes:
        raise ValueError(f"kvtier: state layer {name}: expected vLLM's state page tensor [N, ..., {row_nbytes}] of "
                         f"int8, got shape {tuple(t.shape)} {t.dtype}")
    if t.stride(-1) != 1:
        raise ValueError(f"kvtier: state layer {name}: its page bytes are not contiguous (strides {t.stride()})")
    return torch.as_strided(t.view(torch.int8), (t.shape[0], 1, row_nbytes), (t.stride(0), row_nbytes, 1))


def _own_cpus() -> set[int]:
    return os.sched_getaffinity(0) if hasattr(os, "sched_getaffinity") else set()


def _cpu_list(cpus: set[int]) -> str:
    return ",".join(map(str, sorted(cpus))) or "?"


class KvtierConnector(KVConnectorBase_V1, SupportsHMA):
    """kvtier's tiers (host memory, local disk, Redis, S3, plugins) behind vLLM's KV connector API.

    It supports vLLM's hybrid KV cache manager (``SupportsHMA``), which vLLM then keeps on: a hybrid
    model's groups (full attention, sliding window, Mamba / gated-delta state) are stored as one stream
    each (:mod:`.groups`)."""

    def __init__(self, vllm_config: VllmConfig, role: KVConnectorRole, kv_cache_config: Any = None):
        super().__init__(vllm_config, role, kv_cache_config)
        join_vllm_logging()  # before the first line kvtier logs in this process
        ktc = self._kv_transfer_config  # the base class checked it is set
        self._load = ktc.kv_role in ("kv_consumer", "kv_both")
        self._store = ktc.kv_role in ("kv_producer", "kv_both")
        self._scheduler: SchedulerSide | None = None
        self._worker: WorkerSide | GroupWorkers | None = None
        self._last_stats: dict[str, int] = {}
        # A hybrid model's KV cache groups (one-group models keep the path they always had: [] here).
        hybrid = kv_cache_config is not None and len(kv_cache_config.kv_cache_groups) > 1
        self._groups: list[KvGroup] = kv_groups(kv_cache_config) if hybrid else []
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
            layers = (sum(len(g.layer_names) for g in self._groups) if hybrid
                      else len(kv_layers(kv_cache_config)))
            cfg = kvtier_config(vllm_config, layers, layout=cpu_kv_layout(vllm_config))
            seed = key_seed_problem(cfg, vllm_config.cache_config.prefix_caching_hash_algo)
            if seed is not None:
                raise ValueError(f"kvtier: {seed}")
            mode = LoadMode.from_extra_config(ktc.kv_connector_extra_config)
            idle_wait_ms(ktc.kv_connector_extra_config)  # a bad value fails start-up here, before the workers
            configs = self._group_configs(cfg) if hybrid else [cfg]
            self._scheduler = SchedulerSide(configs, load=self._load, store=self._store,
                                            vllm_hash_algo=vllm_config.cache_config.prefix_caching_hash_algo,
                                            load_mode=mode, ranks=rank_tally(vllm_config, writes=self._store),
                                            groups=self._groups if hybrid else None,
                                            events=_kv_events_on(vllm_config))
            log.info("kvtier: scheduler side up (%s), namespace %s, load_mode %s",
                     cfg.summary(getattr(kv_cache_config, "num_blocks", None), engine="vLLM"),
                     ", ".join(c.namespace().id for c in configs), self._scheduler.load_mode.value)
            asked = (ktc.kv_connector_extra_config or {}).get("load_mode")  # the default is not a request
            if hybrid and asked is not None and mode is not LoadMode.ASYNC:
                log.warning("kvtier: load_mode %s is ignored for a hybrid model: its loads run in the background "
                            "(vLLM takes a failed load of a model with several KV cache groups only from a load "
                            "it waits for)", mode.value)
            if hybrid:
                log.info("kvtier: vLLM's hybrid KV cache manager is on: %d KV cache groups, each stored as a "
                         "stream of its own: %s; a hit is offered only where every group can be restored, "
                         "and loads run in the background (a failed one recomputes the request)",
                         len(self._groups), "; ".join(_group_line(g) for g in self._groups))

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a future miss

    # ------------------------------------------------------------------ worker side

    def _group_configs(self, cfg: Any) -> list[Any]:
        """One config per KV cache group (its namespace names the group; host memory is shared out), the
        metrics port served by the first group's stack alone."""
        shares = host_shares(self._groups)
        out = []
        for g in self._groups:
            c = group_config(cfg, g, shares[g.index])
            if g.index and c.metrics.prometheus_port:
                c = c.model_copy(update={"metrics": c.metrics.model_copy(update={"prometheus_port": None})})
            out.append(c)
        return out

    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        if len(self._groups) > 1:
            self._register_groups(kv_caches)
            return
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

    def _register_groups(self, kv_caches: dict[str, torch.Tensor]) -> None:
        """A hybrid model's worker: one :class:`WorkerSide` per KV cache group, over that group's layers."""
        from vllm.distributed.parallel_state import get_pcp_group, get_pp_group, get_tp_group

        mc, pc, cc = self._vllm_config.model_config, self._vllm_config.parallel_config, self._vllm_config.cache_config
        heads, head_dim = mc.get_num_kv_heads(pc), mc.get_head_size()
        tp, pcp, pp = get_tp_group(), get_pcp_group(), get_pp_group()
        expected = cpu_kv_layout(self._vllm_config)
        layers = sum(len(g.layer_names) for g in self._groups)
        base = kvtier_config(self._vllm_config, layers, tp_rank=tp.rank_in_group, pp_rank=pp.rank_in_group,
                             layout=expected)
        configs = self._group_configs(base)
        rank = worker_rank(tp.rank_in_group, tp.world_size, pcp.rank_in_group, pcp.world_size, pp.rank_in_group)
        wait_ms = idle_wait_ms(self._kv_transfer_config.kv_connector_extra_config)
        sides: dict[int, WorkerSide] = {}
        for g, cfg in zip(self._groups, configs):
            names = [n for n in layer_order(list(g.layer_names)) if n in kv_caches]
            if not names:
                continue  # this pipeline stage holds none of the group's layers
            if g.is_attention:
                tensors = [kv_caches[n] for n in names]
                layout = detect_layout(tensors[0], heads, head_dim, cc.block_size, False)
                if expected is not None and layout != expected:
                    raise ValueError(f"kvtier: group {g.index}'s KV tensors have layout {layout}, but vLLM's "
                                     f"configuration implies {expected} (the scheduler's namespace)")
            else:
                tensors = [state_rows(kv_caches[n], n, g.state_row_nbytes) for n in names]
            cfg = cfg.model_copy(update={"model": cfg.model.model_copy(update={"num_layers": len(names)})})
            sides[g.index] = WorkerSide(cfg, tensors, rank=rank, idle_wait_ms=wait_ms)
        self._worker = GroupWorkers(sides)
        first = next(iter(sides.values()))
        log.info("kvtier: worker side up: %d KV cache groups (%s), %s", len(sides),
                 "; ".join(_group_line(g) for g in self._groups if g.index in sides),
                 configs[0].summary(first.stack.device.num_blocks))

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

    def get_transfer_results(self, finished_req_ids: set[str]) -> KVConnectorTransferResults:
        """Loads that ended, and (a hybrid model) the requests whose load failed in some group: vLLM
        recomputes those from their start (it maps failed block ids to requests only with one group)."""
        finished_sending, finished_recving = self.get_finished(finished_req_ids)
        failed = self._worker.failed() if isinstance(self._worker, GroupWorkers) else set()
        return KVConnectorTransferResults(finished_sending=set(finished_sending or ()),
                                          finished_recving=set(finished_recving or ()) | failed,
                                          failed_recving=failed)

    def get_block_ids_with_load_errors(self) -> set[int]:
        return self._worker.load_errors() if self._worker is not None else set()

    def get_handshake_metadata(self) -> KVConnectorHandshakeMetadata | None:
        if self._worker is None:
            return None
        if isinstance(self._worker, GroupWorkers):
            return KvtierHandshake(self._worker.host_slots(), self._worker.loads_direct())
        return KvtierHandshake({0: self._worker.host_slots()}, {0: self._worker.loads_direct()})

    def build_connector_worker_meta(self) -> KVConnectorWorkerMetadata | None:
        if self._worker is None:
            return None
        if isinstance(self._worker, GroupWorkers):
            reps = self._worker.report()
            return KvtierWorkerMetadata(reps) if reps else None
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

    def set_xfer_handshake_metadata(self, metadata: dict[int, KVConnectorHandshakeMetadata]) -> None:
        self._handshake(list(metadata.values()))

    def set_xfer_handshake_metadata_pp_aware(
            self, metadata: dict[tuple[int, int], KVConnectorHandshakeMetadata]) -> None:
        self._handshake(list(metadata.values()))  # every pipeline stage's ranks hold host slots alike

    def _handshake(self, told: list[KVConnectorHandshakeMetadata]) -> None:
        """Every rank's host slots: the scheduler places stores and loads in the smallest rank's number, per
        group."""
        if self._scheduler is not None:
            mine = [m for m in told if isinstance(m, KvtierHandshake)]
            self._scheduler.set_host_slots([m.host_slots for m in mine], [m.direct for m in mine])

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
            self._scheduler.after_alloc(request, blocks.get_block_ids(), num_external_tokens)

    def build_connector_meta(self, scheduler_output: Any) -> KVConnectorMetadata:
        assert self._scheduler is not None
        return KvtierMetadata(self._scheduler.build_plan(scheduler_output))

    def take_events(self) -> Iterable[Any]:
        """kvtier's tiers' changes as vLLM KV events (``--kv-events-config``): :mod:`.events`."""
        return self._scheduler.take_events() if self._scheduler is not None else ()

    def update_connector_output(self, connector_output: Any) -> None:
        meta = getattr(connector_output, "kv_connector_worker_meta", None)
        if self._scheduler is not None and isinstance(meta, KvtierWorkerMetadata):
            self._scheduler.apply(*meta.reports)

    def request_finished(self, request: Request, block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self._scheduler is not None:
            self._scheduler.finished(request)
        return False, None  # the step that computed a block also copied it out: nothing to wait for

    def request_finished_all_groups(self, request: Request,
                                    block_ids: tuple[list[int], ...]) -> tuple[bool, dict[str, Any] | None]:
        return self.request_finished(request, block_ids[0] if block_ids else [])
