"""The scheduler half of the vLLM connector: vLLM's requests and block ids in, plan objects out.

It lives in vLLM's EngineCore process and holds a :class:`~kvtier.tiering.manager.TierManager` (no tensors).

* ``matched_tokens``: the longest run of stored blocks right after the prefix vLLM holds itself (full
  blocks, at most all but the last prompt token, since vLLM must compute one).  A backend probe in
  flight answers None, so vLLM asks again next step while other requests run.  A hit is loaded as :class:`LoadMode` says: by default
  asynchronously (vLLM holds the request until a later step reports the load finished, and no step
  ever waits on kvtier's I/O).
* ``after_alloc``: records a :class:`~kvtier.plans.LoadPlan` for the blocks vLLM allocated.
* ``build_plan``: the step's loads, and a :class:`~kvtier.plans.StorePlan` for every prompt block that
  becomes fully computed in this step.  The worker copies those out before the step ends, so a finished
  request's blocks never need to outlive it (``request_finished`` frees at once).

Keys are kvtier's own block hashes (from token ids, LoRA, multimodal items and the cache salt), so a
router or another engine computes them from the prompt alone.  With ``keys.algo: sha256_cbor`` and
vLLM run with ``--prefix-caching-hash-algo sha256_cbor`` they equal vLLM's ``request.block_hashes``;
each request checks that, and a mismatch is counted (``key_mismatches``) and logged once.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from functools import partial
from typing import Any

from ...config import KvtierConfig
from ...plans import LoadPlan, LookupState, RankTally, StepPlan, StorePlan, WorkerReport
from ...tiering.manager import TierManager

log = logging.getLogger("kvtier.vllm")


class LoadMode(enum.Enum):
    """When the connector loads a hit in the step that schedules the request (``sync``) or in the
    background while vLLM holds the request back (``async``).  ``kv_connector_extra_config.load_mode``.

    A hit wholly in host memory (no backend I/O, only a copy) is loaded in the step in every mode.

    * ``async`` (default): a hit that needs backend reads loads in the background; no step ever waits
      on kvtier's I/O.
    * ``sync``: always in the step, as LMCache loads: the request skips the step(s) between its load's
      end and vLLM scheduling it, and every request running in that step waits for the load.
    * ``auto``: ``sync`` when no other request ran in the last step (nobody to hold up), else ``async``.

    Measured inside vLLM here (512 MiB of KV from local_disk in the page cache, 2 CPU cores, 18 loads
    each, interleaved): 262 ms TTFT in the step, 304 ms in the background, vLLM's ExampleConnector 315 ms.
    The background load stays the default: a step that loads from a slow backend (S3, a busy Redis)
    would hold every running request for as long.
    """

    AUTO = "auto"
    ASYNC = "async"
    SYNC = "sync"

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> LoadMode:
        value = (extra or {}).get("load_mode", cls.ASYNC.value)
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"kvtier: kv_connector_extra_config.load_mode: {value!r} is not one of "
                             f"{[m.value for m in cls]}") from None


@dataclass
class _Request:
    request: Any
    hashes: list[bytes]
    stored_blocks: int = 0  # leading prompt blocks already stored (or planned) by this instance
    local_tokens: int = 0  # tokens vLLM had computed itself when the connector's hit was counted
    external_tokens: int = 0
    sync: bool = False  # the offered hit is loaded in the step that schedules the request
    loaded_from: dict[str, int] = field(default_factory=dict)  # tier name -> tokens (for people: stats)


class SchedulerSide:
    """``load``/``store``: what this instance's role allows (kv_consumer loads, kv_producer stores)."""

    def __init__(self, config: KvtierConfig, *, load: bool, store: bool, vllm_hash_algo: str | None,
                 load_mode: LoadMode = LoadMode.ASYNC, ranks: RankTally | None = None):
        self.config = config
        self.ranks = ranks or RankTally()  # what the workers (vLLM's TP x PP ranks) reported, per block
        self.load_mode = load_mode
        self.manager = TierManager(config)
        self.hasher = self.manager.namespace.hasher()
        self.block_size = self.manager.block_size
        self.load, self.store = load, store
        self.check_vllm_hashes = (config.keys.algo == "sha256_cbor" and vllm_hash_algo == "sha256_cbor")
        self.key_checks = 0
        self.key_mismatches = 0
        self._reqs: dict[str, _Request] = {}
        self._loads: list[LoadPlan] = []
        self._stores: list[StorePlan] = []  # planned outside build_plan (after_alloc), sent with the next step
        # Requests vLLM scheduled in the last step and has not finished: the ones a synchronous load
        # would hold up (vLLM schedules running requests before it asks about waiting ones).
        self._running: set[str] = set()
        self.kv_cache_manager: Any = None

    # ------------------------------------------------------------------ per request

    def _state(self, request: Any) -> _Request:
        st = self._reqs.get(request.request_id)
        if st is None:
            st = _Request(request, self._hash(request))
            self._reqs[request.request_id] = st
        return st

    def _hash(self, request: Any) -> list[bytes]:
        tokens = list(request.prompt_token_ids or ())
        mm = [{"identifier": f.identifier, "offset": f.mm_position.offset, "length": f.mm_position.length}
              for f in (getattr(request, "mm_features", None) or ())]
        lr = getattr(request, "lora_request", None)
        lora = (lr.lora_name, lr.lora_path) if lr is not None else None
        hashes = self.hasher.hash_blocks(tokens, mm=mm, lora=lora,
                                         cache_salt=getattr(request, "cache_salt", None))
        if self.check_vllm_hashes:
            theirs = [bytes(h) for h in (request.block_hashes or ())]
            k = min(len(theirs), len(hashes))
            self.key_checks += 1
            if theirs[:k] != hashes[:k]:
                self.key_mismatches += 1
                if self.key_mismatches == 1:
                    log.error("kvtier: block keys differ from vLLM's request.block_hashes for request %s "
                              "(same algorithm, so a seed or extra-key mismatch: check keys.seed and "
                              "PYTHONHASHSEED); kvtier keeps using its own keys", request.request_id)
        return hashes

    def matched_tokens(self, request: Any, num_computed_tokens: int) -> tuple[int | None, bool]:
        st = self._state(request)  # a producer needs the keys too, to store
        if not self.load:
            return 0, False
        loadable = min(len(st.hashes), (request.num_prompt_tokens - 1) // self.block_size)
        if num_computed_tokens >= loadable * self.block_size:
            return 0, False
        # Keys chain through the token ids, not through what kvtier holds: the blocks vLLM computed itself
        # need not be stored anywhere (evicted, deleted as corrupt) for the ones after them to be found.
        first = num_computed_tokens // self.block_size
        found = self.manager.lookup(st.hashes[first:loadable], start=first)
        if found.state is LookupState.PENDING:
            return None, False
        ext = (first + found.num_blocks) * self.block_size - num_computed_tokens
        if ext <= 0:
            return 0, False
        st.local_tokens, st.external_tokens = num_computed_tokens, ext
        blocks = self.manager.tier_names.count(found.tiers)
        st.loaded_from = {name: n * self.block_size for name, n in blocks.items()}
        st.sync = self._load_in_step(request.request_id, in_memory=not any(t.is_backend for t in found.tiers))
        return ext, not st.sync

    def _load_in_step(self, req_id: str, in_memory: bool) -> bool:
        if self.load_mode is LoadMode.AUTO:
            return in_memory or not (self._running - {req_id})
        return in_memory or self.load_mode is LoadMode.SYNC

    def after_alloc(self, request: Any, block_ids: list[int], num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        st = self._state(request)
        if num_external_tokens != st.external_tokens:
            raise RuntimeError(f"kvtier: vLLM allocated {num_external_tokens} external tokens for request "
                               f"{request.request_id}, the connector offered {st.external_tokens}")
        first = st.local_tokens // self.block_size
        last = (st.local_tokens + num_external_tokens) // self.block_size
        self._loads.append(LoadPlan(request.request_id, tuple(st.hashes[first:last]),
                                    tuple(block_ids[first:last]), first, sync=st.sync))
        # The prefix vLLM held itself was found without kvtier, which may have lost some of it: store it
        # (what kvtier holds is skipped as present), so the chain heals for instances that lack it.
        sp = self._store_upto(st, first, lambda: block_ids) if self.store else None
        if sp is not None:
            self._stores.append(sp)
        # Loaded blocks are stored already: never write them back.
        st.stored_blocks = max(st.stored_blocks, last)

    # ------------------------------------------------------------------ per step

    def build_plan(self, scheduler_output: Any) -> StepPlan:
        plan = StepPlan(loads=self._loads, stores=self._stores, idle=not scheduler_output.num_scheduled_tokens)
        self._loads, self._stores = [], []
        self._running = set(scheduler_output.num_scheduled_tokens)
        if not self.store:
            return plan
        for req_id, n_sched in scheduler_output.num_scheduled_tokens.items():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            req = st.request
            done = min(req.num_computed_tokens + n_sched, req.num_prompt_tokens)
            upto = min(done // self.block_size, len(st.hashes))
            sp = self._store_upto(st, upto, partial(self._block_ids, req_id))
            if sp is not None:
                plan.stores.append(sp)
        return plan

    def _block_ids(self, req_id: str) -> list[int]:
        return list(self.kv_cache_manager.get_block_ids(req_id)[0])

    def _store_upto(self, st: _Request, upto: int, block_ids: Callable[[], list[int]]) -> StorePlan | None:
        """The plan storing ``st``'s blocks not yet stored, up to block ``upto``, counted stored; None when
        there are none (``block_ids``, the request's device blocks, is then never asked for).  Stored
        values of several blocks (storage.block_tokens) are whole groups: up to the last complete group,
        from the boundary of the first group not yet stored."""
        k = self.manager.storage_blocks
        upto = upto // k * k
        if upto <= st.stored_blocks:
            return None
        first = st.stored_blocks // k * k
        st.stored_blocks = upto
        ids = block_ids()
        return StorePlan(st.request.request_id, tuple(st.hashes[first:upto]), tuple(ids[first:upto]), first)

    def apply(self, *reports: WorkerReport) -> None:
        """Fold the reports the workers sent with one step (one per rank that had something to say)."""
        report = self.ranks.fold(reports)
        self.manager.apply(report)
        # vLLM recomputes what a load did not deliver: store it once computed (the plan counted it stored).
        for req_id, pos in report.unloaded.items():
            st = self._reqs.get(req_id)
            if st is not None:
                st.stored_blocks = min(st.stored_blocks, pos)

    def finished(self, request: Any) -> None:
        self._reqs.pop(request.request_id, None)
        self._running.discard(request.request_id)

    def external_sources(self, request: Any) -> dict[str, int]:
        st = self._reqs.get(request.request_id)
        return dict(st.loaded_from) if st else {}

    def close(self) -> None:
        self.manager.close()
