"""The worker half of the vLLM connector: executes the scheduler's plans on this rank's KV tensors.

It lives in each vLLM worker process and owns a :class:`~kvtier.stack.TierStack` over the KV tensors
vLLM registers (host memory, transfers, backend I/O).

* Asynchronous loads run in the stack's threads while vLLM runs other requests (vLLM holds the request
  in WAITING_FOR_REMOTE_KVS until ``finished`` reports it).  A synchronous one (``LoadPlan.sync``: the
  request computes in this very step) has ended when ``start`` returns.  A block that is missing,
  corrupt or fails to copy is reported in ``load_errors`` with every block after it (their keys chain
  through it), and vLLM recomputes them; it is never read.
* Stores copy the step's newly computed blocks out of the KV tensors in ``save`` (end of the step),
  so vLLM may free or reuse those blocks as soon as the step is over; the writes to the backends go on
  in the background as the write policy says.
* Nothing here raises into vLLM because of kvtier: a fault is a failed load (recompute), a skipped
  store, a log line and a metric.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import re
import threading
import time
from typing import Any

import torch

from ... import threads
from ...config import KvtierConfig
from ...plans import HostOutcome, LoadPlan, StepPlan, WorkerReport, keep_earliest
from ...stack import LoadHandle, TierStack

log = logging.getLogger("kvtier.vllm")

IDLE_WAIT_MS = 20.0  # kv_connector_extra_config.idle_wait_ms's default: see WorkerSide.finished


def idle_wait_ms(extra: dict[str, Any] | None) -> float:
    """``kv_connector_extra_config.idle_wait_ms``: a number >= 0 (0: never wait)."""
    value = (extra or {}).get("idle_wait_ms", IDLE_WAIT_MS)
    if isinstance(value, bool) or not isinstance(value, int | float) or not 0 <= value <= 10_000:
        raise ValueError(f"kvtier: kv_connector_extra_config.idle_wait_ms: {value!r} is not a number of "
                         "milliseconds from 0 to 10000")
    return float(value)


def detect_layout(t: torch.Tensor, num_kv_heads: int, head_dim: int, block_size: int, mla: bool,
                  cpu_isa: str | None = None) -> str:
    """The kvtier layout kind of one of vLLM's per-layer KV tensors (``cpu_isa``: the kernel vLLM's CPU
    attention writes its cache with, :func:`.facts.vllm_cpu_isa`; its ``amx`` kernel packs K and V)."""
    shape = tuple(t.shape)
    if mla and t.dim() == 3 and shape[1:] == (block_size, head_dim):
        return "mla"
    if t.dim() == 4 and shape[1:] == (num_kv_heads, block_size, 2 * head_dim):
        return "cpu_attn_amx" if cpu_isa == "amx" else "cpu_attn"
    if t.dim() == 5 and shape[0] == 2 and shape[2:] == (block_size, num_kv_heads, head_dim):
        return "flash_attn"
    if t.dim() == 5 and shape[1] == 2 and shape[2:] == (block_size, num_kv_heads, head_dim):
        return "flashinfer"
    raise ValueError(f"kvtier: unsupported vLLM KV cache tensor: shape {shape}, strides {t.stride()} "
                     f"({num_kv_heads} kv heads, head dim {head_dim}, block size {block_size}); supported: "
                     "CPU [N, H, B, 2D], FlashAttention [2, N, B, H, D], FlashInfer [N, 2, B, H, D], MLA [N, B, D]")


def kv_view(t: torch.Tensor, mla: bool) -> torch.Tensor:
    """vLLM's per-layer KV tensor as kvtier's layouts name it: a view of the same memory.  vLLM CPU's MLA
    backend keeps a head axis of one (``[N, 1, B, D]``); kvtier's ``mla`` layout is ``[N, B, D]``."""
    if mla and t.dim() == 4 and t.shape[1] == 1:
        return t.select(1, 0)
    return t


def check_cpu_arrangement(kind: str, isa: str, like: torch.Tensor, num_kv_heads: int, head_dim: int,
                          block_size: int, kv_cache_dtype: str) -> None:
    """Prove that kvtier reads vLLM CPU's cache as vLLM's own kernel writes it: known K and V (values
    the KV dtype holds exactly) go through ``cpu_attn_reshape_and_cache`` into a scratch block, and
    kvtier's payload of that block must be them, bit for bit.  Raises ValueError (start-up stops) where
    they differ: kvtier would otherwise store and load permuted KV (another vLLM, another kernel)."""
    import vllm._custom_ops as ops

    from ...format.layout import KVLayout, dtype_name, parse_dtype
    from ...memory.rows import to_payload

    h, d, b = num_kv_heads, head_dim, block_size
    g = torch.Generator().manual_seed(0)
    # Values the KV dtype holds exactly (an fp8 cache is uint8 bytes to vLLM CPU; its kernel quantizes)
    kv_dtype = parse_dtype(kv_cache_dtype) if kv_cache_dtype.startswith("fp8") else like.dtype
    exact = (torch.rand(2, b, h, d, generator=g) * 4 - 2).to(kv_dtype)
    model_dtype = torch.bfloat16 if kv_dtype.itemsize == 1 else kv_dtype
    cache = torch.zeros(2, h, b, 2 * d, dtype=like.dtype)
    k_cache, v_cache = cache.view(2, h, 2 * b, d).chunk(2, dim=2)
    try:
        ops.cpu_attn_reshape_and_cache(exact[0].to(model_dtype), exact[1].to(model_dtype), k_cache, v_cache,
                                       torch.arange(b, dtype=torch.int64) + b, isa, kv_cache_dtype=kv_cache_dtype)
    except Exception as e:  # noqa: BLE001 - whatever the kernel says, it is reported as the cause
        raise ValueError(f"kvtier: cannot check vLLM CPU's KV arrangement ({isa} kernel): {e}") from e
    got = to_payload(KVLayout(kind, 1, 2, b, h, d, like.dtype), [cache], [1])
    want = exact.contiguous().view(torch.uint8).reshape(1, -1)  # K [B, H, D] then V: the payload
    if not torch.equal(got, want):
        raise ValueError(f"kvtier: K and V written by vLLM CPU's {isa} kernel do not come back bit for bit "
                         f"out of kvtier's {kind} layout (KV {dtype_name(kv_dtype)}, block size {b}, head dim "
                         f"{d}): it arranges (or encodes) them otherwise, and kvtier would store KV another "
                         "engine misreads, so it does not start")


def layer_order(names: list[str]) -> list[str]:
    """Layer names sorted by their layer index ("model.layers.12.self_attn.attn" -> 12)."""
    def index(name: str) -> tuple[int, str]:
        m = re.findall(r"\.(\d+)\.", f".{name}.")
        return (int(m[0]) if m else -1, name)
    return sorted(names, key=index)


class WorkerSide:
    def __init__(self, config: KvtierConfig, kv_caches: list[torch.Tensor], *, idle_wait_ms: float = IDLE_WAIT_MS,
                 rank: int = 0):
        self.stack = TierStack(config, kv_caches=kv_caches)
        self.idle_wait_s = idle_wait_ms / 1e3  # see finished()
        self.writes = config.writes_backends  # WorkerReport.writes
        self.rank = rank  # WorkerReport.rank: this worker among vLLM's TP x PP ranks (facts.worker_rank)
        self.stack.drain_report()  # start recording backend writes and evictions for the scheduler
        self._loads: dict[str, tuple[LoadPlan, LoadHandle]] = {}
        self._errors: set[int] = set()
        self._lost: set[bytes] = set()
        self._refused: set[str] = set()  # loads that never started: finished at once, all blocks failed
        self._failed: set[str] = set()  # requests whose load (or part of it) failed, for failed_requests()
        # request id -> first chain position a load did not deliver, for the scheduler (WorkerReport)
        self._unloaded: dict[str, int] = {}
        # The same for this step's in-step loads: the step computes those requests over blocks that hold
        # no valid KV from there on (the engine rewinds them afterwards), so save() must not store them.
        self._garbage_from: dict[str, int] = {}
        self._started: dict[str, float] = {}
        self._outcomes: dict[int, HostOutcome] = {}  # per lead plan run since the last report (WorkerReport.outcomes)
        self._ended = threading.Event()  # set when an asynchronous load ends (finished() may wait on it)
        self.stats = {"loads": 0, "sync_loads": 0, "loaded_blocks": 0, "failed_blocks": 0,
                      "stored_blocks": 0, "store_errors": 0}

    def thread_cpus(self) -> set[int]:
        """The CPUs a kvtier thread started from here runs on (asked of one, as the stack's pools start them)."""
        if not hasattr(os, "sched_getaffinity"):
            return set()
        with threads.pool(1, "kvtier-cpus") as pool:
            return pool.submit(os.sched_getaffinity, 0).result(timeout=30)

    def start(self, plan: StepPlan) -> None:
        """Start the step's loads; return once its synchronous ones have ended (all of them started
        first, so they share the stack's threads and backend batches)."""
        in_step: list[tuple[LoadPlan, LoadHandle]] = []
        for lp in plan.loads:
            self.stats["loads"] += 1
            self.stats["sync_loads"] += lp.sync
            try:
                self._started[lp.req_id] = time.perf_counter()
                # vLLM allocated these blocks for the load, and reuses blocks without telling the worker
                # (decode tokens, partial blocks: KV kvtier never stores), so what the stack last placed
                # in them is not there any more: never "already on the device", always copied in.
                self.stack.on_device_freed(lp.block_ids)
                if lp.lead is not None:
                    # The scheduler hears what this rank did with its plan, whatever happens below.
                    self._outcomes[lp.lead.plan_id] = HostOutcome.nothing()
                handle = self.stack.load(list(lp.hashes), list(lp.block_ids), start=lp.start, plan=lp.lead)
            except Exception as e:  # noqa: BLE001 - a kvtier fault is a recompute, never a crash
                log.error("kvtier: load for request %s refused: %s", lp.req_id, e)
                self._errors.update(lp.block_ids)
                self.stats["failed_blocks"] += len(lp.block_ids)
                self._started.pop(lp.req_id, None)
                self._failed.add(lp.req_id)
                self._not_delivered(lp, lp.start)
                if not lp.sync:  # vLLM waits for an asynchronous load's end: it ended now
                    self._refused.add(lp.req_id)
                continue
            if lp.sync:
                in_step.append((lp, handle))
            else:
                self._loads[lp.req_id] = (lp, handle)
                handle.add_done_callback(self._ended.set)
        for lp, handle in in_step:
            # No timeout: vLLM may reuse the blocks once the step ends, so a copy still running into them
            # must not outlive it; backends bound their own I/O (timeouts become failed blocks).
            handle.wait()
            self._settle(lp, handle)

    def save(self, plan: StepPlan) -> None:
        """Copy the step's stored blocks out; for a request whose in-step load failed, only the blocks
        before the first one it did not deliver (the rest were computed over it)."""
        garbage, self._garbage_from = self._garbage_from, {}
        for sp in plan.stores:
            lead = sp.lead
            if lead is not None:
                # The scheduler hears what this rank did with its plan, whatever happens below.
                self._outcomes[lead.plan_id] = HostOutcome.nothing()
            cut = garbage.get(sp.req_id)
            if cut is not None:
                keep = max(0, cut - sp.start)
                if keep < len(sp.hashes):
                    log.info("kvtier: request %s: blocks %d-%d not stored (computed over blocks its load did not "
                             "deliver; stored once recomputed)", sp.req_id, sp.start + keep,
                             sp.start + len(sp.hashes) - 1)
                    if lead is not None:
                        continue  # a plan is followed whole or not at all: the scheduler folds it as not stored
                sp = dataclasses.replace(sp, hashes=sp.hashes[:keep], block_ids=sp.block_ids[:keep])
                if not sp.hashes:
                    continue
            try:
                res = self.stack.store(list(sp.hashes), list(sp.block_ids), start=sp.start,
                                       tenant=sp.tenant, plan=lead).wait(timeout=60)
                if lead is not None:
                    self._outcomes[lead.plan_id] = res.outcome()
                self.stats["stored_blocks"] += res.num_stored
                log.debug("kvtier: request %s: blocks %d-%d copied out (%d new)", sp.req_id, sp.start,
                          sp.start + len(sp.hashes) - 1, res.num_stored)
            except Exception as e:  # noqa: BLE001 - a failed store is a future miss, never a crash
                self.stats["store_errors"] += 1
                log.error("kvtier: store for request %s failed: %s", sp.req_id, e)

    def finished(self, idle: bool = False) -> set[str]:
        """Requests whose load has ended (loaded, or failed and reported in ``load_errors``).

        ``idle`` (the step computed nothing: vLLM only waits for loads): wait up to ``idle_wait_s``
        (``kv_connector_extra_config.idle_wait_ms``) for one to end first.  vLLM otherwise runs empty steps back to back while a load is in flight, on the
        cores the load runs on (measured here, 512 MiB from local_disk: ~50-70 ms more TTFT in the
        background than in the step); the bound keeps a request that arrives meanwhile from waiting long."""
        if idle and self._loads and self.idle_wait_s > 0:
            self._ended.wait(self.idle_wait_s)
        self._ended.clear()  # before the scan: a load that ends after it sets it again
        done, self._refused = self._refused, set()
        for req_id, (lp, handle) in list(self._loads.items()):
            if not handle.done():
                continue
            del self._loads[req_id]
            done.add(req_id)
            self._settle(lp, handle)
        return done

    def _settle(self, lp: LoadPlan, handle: LoadHandle) -> None:
        """Count an ended load, and queue its failed blocks for ``load_errors`` (vLLM recomputes them)."""
        res = handle.wait(0)
        if lp.lead is not None:
            self._outcomes[lp.lead.plan_id] = res.outcome
        self.stats["loaded_blocks"] += res.num_loaded
        took = time.perf_counter() - self._started.pop(lp.req_id, time.perf_counter())
        log.debug("kvtier: request %s: %d blocks loaded (%s, %s) in %.3f s", lp.req_id, res.num_loaded,
                  ",".join(sorted({self.stack.tier_names(t) for t in res.tiers if t is not None})),
                  "in the step" if lp.sync else "in the background", took)
        if res.recompute:
            self._failed.add(lp.req_id)
            self.stats["failed_blocks"] += len(res.recompute)
            self._errors.update(res.recompute)
            self._lost.update(lp.hashes[res.num_loaded:res.num_loaded + 1])
            self._not_delivered(lp, lp.start + res.num_loaded)
            log.warning("kvtier: request %s: %d of %d blocks not loaded (recomputed): %s", lp.req_id,
                        len(res.recompute), len(lp.block_ids), "; ".join(res.errors[:3]) or "missing")

    def _not_delivered(self, lp: LoadPlan, pos: int) -> None:
        keep_earliest(self._unloaded, lp.req_id, pos)
        if lp.sync:
            keep_earliest(self._garbage_from, lp.req_id, pos)

    def load_errors(self) -> set[int]:
        out, self._errors = self._errors, set()
        return out

    def host_slots(self) -> int:
        """This rank's host slots (0: no host tier), which the scheduler's planner places stores and loads in."""
        return self.stack.planner.slots.num_slots if self.stack.planner.slots is not None else 0

    def loads_direct(self) -> bool:
        """Whether this rank's loads read every backend straight into vLLM's KV (no host room)."""
        return all(self.stack.direct_loads)

    def failed_requests(self) -> set[str]:
        """Requests whose load failed (some block not delivered) since the last call."""
        out, self._failed = self._failed, set()
        return out

    def report(self) -> WorkerReport:
        rep = self.stack.drain_report()
        rep.lost |= self._lost
        rep.unloaded, self._unloaded = self._unloaded, {}
        rep.outcomes, self._outcomes = self._outcomes, {}
        rep.writes, rep.rank = self.writes, self.rank
        self._lost = set()
        return rep

    def close(self) -> None:
        for _, handle in self._loads.values():
            with contextlib.suppress(Exception):  # a stuck load must not stop the shutdown
                handle.wait(30)
        self.stack.close()


class GroupWorkers:
    """A hybrid model's workers: one :class:`WorkerSide` (its own tier stack and namespace) per KV cache
    group, each running the plans of its group.  A request's load has ended once every group's has; it
    failed if any group's did, and is then reported as a whole (``failed``), never as block ids: vLLM maps
    failed block ids back to requests only with one group, and recomputes a failed request from its start."""

    def __init__(self, sides: dict[int, WorkerSide]):
        self.sides = sides
        self._waiting: dict[str, set[int]] = {}  # request -> groups whose load has not ended
        self._failed: set[str] = set()
        self.stats: dict[str, int] = {}

    def thread_cpus(self) -> set[int]:
        return next(iter(self.sides.values())).thread_cpus()

    def host_slots(self) -> dict[int, int]:
        return {g: side.host_slots() for g, side in self.sides.items()}

    def loads_direct(self) -> dict[int, bool]:
        return {g: side.loads_direct() for g, side in self.sides.items()}

    def _split(self, plan: StepPlan, g: int) -> StepPlan:
        return StepPlan([lp for lp in plan.loads if lp.group == g], [sp for sp in plan.stores if sp.group == g],
                        idle=plan.idle)

    def start(self, plan: StepPlan) -> None:
        for lp in plan.loads:
            if not lp.sync:
                self._waiting.setdefault(lp.req_id, set()).add(lp.group)
        for g, side in self.sides.items():
            side.start(self._split(plan, g))

    def save(self, plan: StepPlan) -> None:
        for g, side in self.sides.items():
            side.save(self._split(plan, g))

    def finished(self, idle: bool = False) -> set[str]:
        done: set[str] = set()
        waited = False
        for g, side in self.sides.items():
            # One wait for the first group with a load in flight: the others' ends are scanned right after.
            ended = side.finished(idle=idle and not waited)
            waited = waited or bool(ended)
            self._failed |= side.failed_requests()
            for req_id in ended:
                groups = self._waiting.get(req_id)
                if groups is None:
                    continue
                groups.discard(g)
                if not groups:
                    del self._waiting[req_id]
                    done.add(req_id)
        self._sum_stats()
        return done

    def failed(self) -> set[str]:
        """Requests whose load failed in some group, once every group's load of theirs has ended."""
        out = {r for r in self._failed if r not in self._waiting}
        self._failed -= out
        return out

    def load_errors(self) -> set[int]:
        for side in self.sides.values():
            side.load_errors()  # drained: a hybrid model's failures are whole requests (failed)
        return set()

    def report(self) -> list[WorkerReport]:
        out = []
        for g, side in self.sides.items():
            rep = side.report()
            rep.group = g
            if rep:
                out.append(rep)
        return out

    def _sum_stats(self) -> None:
        total: dict[str, int] = {}
        for side in self.sides.values():
            for k, v in side.stats.items():
                total[k] = total.get(k, 0) + v
        self.stats = total

    def close(self) -> None:
        for side in self.sides.values():
            side.close()
