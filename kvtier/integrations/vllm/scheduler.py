"""The scheduler half of the vLLM connector: vLLM's requests and block ids in, plan objects out.

It lives in vLLM's EngineCore process and holds a :class:`~kvtier.tiering.manager.TierManager` (no tensors)
per KV cache group and, once the workers told it their host slots (``set_host_slots``), the planner that
places every store in host memory for all ranks (:class:`~.placement.HostLeader`).

* ``matched_tokens``: the longest run of stored blocks right after the prefix vLLM holds itself (full
  blocks, at most all but the last prompt token, since vLLM must compute one).  A backend probe in
  flight answers None, so vLLM asks again next step while other requests run.  A hit is loaded as :class:`LoadMode` says: by default
  asynchronously (vLLM holds the request until a later step reports the load finished, and no step
  ever waits on kvtier's I/O).
* ``after_alloc``: records a :class:`~kvtier.plans.LoadPlan` for the blocks vLLM allocated.
* ``build_plan``: the step's loads, and a :class:`~kvtier.plans.StorePlan` for every prompt block that
  becomes fully computed in this step, naming the request's ``cache_salt`` tenant (its tag) when it has
  one, so the worker's stack charges the blocks to that tenant's quota (``kvtier.quota``), and, with a
  leader, the store as it started it (``StorePlan.lead``), which every rank follows.  The worker copies those out before the step ends, so a finished
  request's blocks never need to outlive it (``request_finished`` frees at once).

Keys are kvtier's own block hashes (from token ids, LoRA, multimodal items and the cache salt), so a
router or another engine computes them from the prompt alone.  With ``keys.algo: sha256_cbor`` and
vLLM run with ``--prefix-caching-hash-algo sha256_cbor`` they equal vLLM's ``request.block_hashes``;
each request checks that, and a mismatch is counted (``key_mismatches``) and logged once.
"""

from __future__ import annotations

import enum
import logging
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from functools import partial
from typing import Any, cast

from ...config import KvtierConfig
from ...keys import tenant_tag
from ...plans import LoadPlan, LookupState, RankTally, StepPlan, StorePlan, WorkerReport
from ...tiering.manager import TierManager
from .events import TierEvents
from .groups import GroupKind, KvGroup
from .placement import HostLeader

log = logging.getLogger("kvtier.vllm")


class LoadMode(enum.Enum):
    """When the connector loads a hit in the step that schedules the request (``sync``) or in the
    background while vLLM holds the request back (``async``).  ``kv_connector_extra_config.load_mode``.

    A hit wholly in host memory (no backend I/O, only a copy) is loaded in the step in every mode.

    * ``auto`` (default): ``sync`` when no other request ran in the last step (nobody to hold up), else
      ``async``.
    * ``async``: a hit that needs backend reads loads in the background; no step ever waits on kvtier's I/O.
    * ``sync``: always in the step, as LMCache loads: the request skips the step(s) between its load's
      end and vLLM scheduling it, and every request running in that step waits for the load.

    ``auto`` is the default because it takes the step's path only where that holds nobody up: a load in
    the background costs the steps between its end and vLLM scheduling the request (on 2 cores vLLM's
    empty steps also spin on the cores the load needs), while a load in the step makes every running
    request wait for it, which ``auto`` never does (a running request's inter-token latency is the same as
    with ``async``).  Measured inside vLLM here (local_disk in the page cache): 512 MiB of KV, 262 ms TTFT
    in the step against 304 ms in the background (2026-11-25); figures for both modes:
    docs/performance.md, "vLLM: time to first token".
    """

    AUTO = "auto"
    ASYNC = "async"
    SYNC = "sync"

    @classmethod
    def from_extra_config(cls, extra: Mapping[str, Any] | None) -> LoadMode:
        value = (extra or {}).get("load_mode", cls.AUTO.value)
        try:
            return cls(value)
        except ValueError:
            raise ValueError(f"kvtier: kv_connector_extra_config.load_mode: {value!r} is not one of "
                             f"{[m.value for m in cls]}") from None


@dataclass
class _Request:
    request: Any
    hashes: list[bytes]
    # per attention group: leading prompt blocks already stored (or planned) by this instance
    stored_blocks: dict[int, int] = field(default_factory=dict)
    # per state group: block positions whose state is stored (or planned)
    stored_states: dict[int, set[int]] = field(default_factory=dict)
    local_tokens: int = 0  # tokens vLLM had computed itself when the connector's hit was counted
    external_tokens: int = 0
    sync: bool = False  # the offered hit is loaded in the step that schedules the request
    loaded_from: dict[str, int] = field(default_factory=dict)  # tier name -> tokens (for people: stats)
    # The tag of the request's cache_salt (None: unsalted): its stores are charged to that tenant's quota.
    tenant: str | None = None


@dataclass
class Stream:
    """One KV cache group's stored values: its group, the manager of its namespace, and the planner that
    places its stores in every rank's host memory (once the workers said how many host slots they have)."""

    group: KvGroup
    manager: TierManager
    ranks: RankTally
    leader: HostLeader | None = None


NULL_BLOCK = 0  # vLLM's null block: a position of a table holding nothing (outside a window, skipped state)


class SchedulerSide:
    """``load``/``store``: what this instance's role allows (kv_consumer loads, kv_producer stores).

    ``configs``: one config per KV cache group (``groups``), or one config for a model with one group."""

    def __init__(self, config: KvtierConfig | list[KvtierConfig], *, load: bool, store: bool,
                 vllm_hash_algo: str | None, load_mode: LoadMode = LoadMode.AUTO, ranks: RankTally | None = None,
                 groups: list[KvGroup] | None = None, events: bool = False):
        configs = config if isinstance(config, list) else [config]
        groups = groups or [KvGroup(0, GroupKind.FULL, (), configs[0].model.block_size)]
        if len(groups) != len(configs):
            raise ValueError(f"kvtier: {len(groups)} KV cache groups but {len(configs)} configs")
        self.config = configs[0]
        self.ranks = ranks or RankTally()  # what the workers (vLLM's TP x PP ranks) reported, per block
        self.streams = [Stream(g, TierManager(c), RankTally(self.ranks.ranks, self.ranks.writers))
                        for g, c in zip(groups, configs)]
        self.hybrid = len(self.streams) > 1
        # A hybrid model's failed load is reported per request (vLLM maps block ids back to requests only
        # with one group), and vLLM takes that only from a load it waits for: every hybrid load is async.
        self.load_mode = LoadMode.ASYNC if self.hybrid else load_mode
        self.manager = self.streams[0].manager
        # Keys and token counts come from an attention group's namespace (a state group's value is one row,
        # its namespace's block size 1); every hybrid model vLLM serves has one.
        tokens = next((s.manager for s in self.streams if s.group.is_attention), None)
        if tokens is None:
            raise ValueError("kvtier: a model whose KV cache groups are all state groups is not supported")
        self.hasher = tokens.namespace.hasher()
        self.block_size = tokens.block_size
        self.load, self.store = load, store
        self.check_vllm_hashes = (self.config.keys.algo == "sha256_cbor" and vllm_hash_algo == "sha256_cbor")
        self.key_checks = 0
        self.key_mismatches = 0
        self._reqs: dict[str, _Request] = {}
        self._loads: list[LoadPlan] = []
        self._stores: list[StorePlan] = []  # planned outside build_plan (after_alloc), sent with the next step
        # Requests vLLM scheduled in the last step and has not finished: the ones a synchronous load
        # would hold up (vLLM schedules running requests before it asks about waiting ones).
        self._running: set[str] = set()
        self.kv_cache_manager: Any = None
        # vLLM's KV event stream (--kv-events-config): what kvtier's tiers hold, for routers
        self.events = TierEvents([b.type for b in self.config.backends], self.block_size) if events else None
        if self.events is not None:
            for s in self.streams:
                s.manager.on_forgotten = partial(self.events.forgotten, s.group.index)
                s.manager.on_backend_back = partial(_backend_back, self.events, s.group.index)

    def set_host_slots(self, ranks: Sequence[Mapping[int, int]], direct: Sequence[Mapping[int, bool]] = ()) -> None:
        """Each rank's host slots per KV cache group (vLLM's KV connector handshake, once at start-up): from
        now on this side plans the host room of every store and load for all ranks
        (:class:`~.placement.HostLeader`), in the smallest rank's number of slots.  ``direct``: per rank and
        group, whether its loads read every backend straight into vLLM's KV (no host room to plan).  A
        group without host memory on some rank (0) keeps each rank planning its own room."""
        if not (self.store or self.load) or not ranks:
            return
        slots = {s.group.index: min(r.get(s.group.index, 0) for r in ranks) for s in self.streams}
        for s in self.streams:
            g = s.group.index
            if slots[g] > 0 and s.leader is None:
                into_host = not direct or not all(d.get(g, False) for d in direct)
                s.leader = HostLeader(s.manager, slots[g], self.ranks.ranks, loads_into_host=into_host)
        log.info("kvtier: the scheduler places stores and loads in host memory for all %d rank(s): %s",
                 self.ranks.ranks, ", ".join(f"group {g}: {n} slots" for g, n in slots.items()))

    def _led(self, s: Stream, sp: StorePlan) -> StorePlan:
        return s.leader.lead(sp) if s.leader is not None else sp

    def _led_load(self, s: Stream, lp: LoadPlan) -> LoadPlan:
        return s.leader.lead_load(lp) if s.leader is not None else lp

    @property
    def attention_streams(self) -> list[Stream]:
        return [s for s in self.streams if s.group.is_attention]

    @property
    def state_streams(self) -> list[Stream]:
        return [s for s in self.streams if not s.group.is_attention]

    # ------------------------------------------------------------------ per request

    def _state(self, request: Any) -> _Request:
        st = self._reqs.get(request.request_id)
        if st is None:
            salt = getattr(request, "cache_salt", None)
            st = _Request(request, self._hash(request), tenant=tenant_tag(salt) if salt else None)
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
        end, tiers = self._hit_end(st.hashes, first, loadable)
        if end is None:
            return None, False
        ext = end * self.block_size - num_computed_tokens
        if ext <= 0:
            return 0, False
        st.local_tokens, st.external_tokens = num_computed_tokens, ext
        blocks = self.manager.tier_names.count(tiers)
        st.loaded_from = {name: n * self.block_size for name, n in blocks.items()}
        st.sync = self._load_in_step(request.request_id, in_memory=not any(t.is_backend for t in tiers))
        return ext, not st.sync

    def _hit_end(self, hashes: list[bytes], first: int, loadable: int) -> tuple[int | None, tuple[Any, ...]]:
        """The block the hit ends before (``first`` when there is none), and the first group's tiers for
        blocks ``first`` onwards; None while a backend probe is in flight.  Every attention group must hold
        the run from ``first`` (a sliding window group stores every block, so its run is the one a hit at
        any block needs), and every state group the state at the hit's last block."""
        end, tiers = loadable, cast("tuple[Any, ...]", ())
        for s in self.attention_streams:
            found = s.manager.lookup(hashes[first:end], start=first)
            if found.state is LookupState.PENDING:
                return None, ()
            end = first + found.num_blocks
            if s is self.streams[0] or not tiers:
                tiers = found.tiers
        if end > first and self.state_streams:
            # The last block at or before ``end`` whose state every state group holds.
            best, pending = first, False
            for i in range(end - 1, first - 1, -1):
                answers = [s.manager.lookup(hashes[i:i + 1], start=i) for s in self.state_streams]
                if any(a.state is LookupState.PENDING for a in answers):
                    pending = True  # every probe is started now, in one pass
                    continue
                if all(a.num_blocks for a in answers) and not pending:
                    best = i + 1
                    break
            if pending:
                return None, ()
            end = best
        return end, tuple(tiers[:end - first])

    def _load_in_step(self, req_id: str, in_memory: bool) -> bool:
        if self.load_mode is LoadMode.AUTO:
            return in_memory or not (self._running - {req_id})
        return self.load_mode is LoadMode.SYNC or (in_memory and not self.hybrid)

    def after_alloc(self, request: Any, block_ids: tuple[list[int], ...] | list[int], num_external_tokens: int) -> None:
        if num_external_tokens == 0:
            return
        tables = _tables(block_ids)
        st = self._state(request)
        if num_external_tokens != st.external_tokens:
            raise RuntimeError(f"kvtier: vLLM allocated {num_external_tokens} external tokens for request "
                               f"{request.request_id}, the connector offered {st.external_tokens}")
        first = st.local_tokens // self.block_size
        last = (st.local_tokens + num_external_tokens) // self.block_size
        rid = request.request_id
        for s in self.streams:
            g, ids = s.group.index, tables[s.group.index]
            if s.group.is_attention:
                # A sliding window group holds (and is given blocks for) only the window ending at the hit.
                lo = _run_start(ids, first, last)
                self._loads.append(self._led_load(s, LoadPlan(rid, tuple(st.hashes[lo:last]), tuple(ids[lo:last]), lo,
                                                              group=g, sync=st.sync)))
                # The prefix vLLM held itself was found without kvtier, which may have lost some of it: store
                # it (what kvtier holds is skipped as present), so the chain heals for instances that lack it.
                sp = self._store_upto(st, s, first, lambda ids=ids: ids) if self.store else None  # type: ignore[misc]
                if sp is not None:
                    self._stores.append(sp)
                # Loaded blocks are stored already: never write them back.
                st.stored_blocks[g] = max(st.stored_blocks.get(g, 0), last)
            else:
                self._loads.append(self._led_load(s, LoadPlan(rid, (st.hashes[last - 1],), (ids[last - 1],), last - 1,
                                                              group=g, sync=st.sync)))
                st.stored_states.setdefault(g, set()).add(last - 1)

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
            tables: tuple[list[int], ...] | None = None

            def ids(g: int, req_id: str = req_id) -> list[int]:
                nonlocal tables
                if tables is None:
                    tables = _tables(self.kv_cache_manager.get_block_ids(req_id))
                return tables[g]

            for s in self.attention_streams:
                sp = self._store_upto(st, s, upto, partial(ids, s.group.index))
                if sp is not None:
                    plan.stores.append(sp)
            # A step that ends on a block boundary leaves the state there in the group's block at that
            # position (vLLM's "align" mode), whether or not vLLM keeps it for its own cache: a prompt that
            # shares only part of this one resumes from the last such boundary.
            if done % self.block_size == 0 and done > req.num_computed_tokens and upto > 0:
                for s in self.state_streams:
                    g = s.group.index
                    block_id = ids(g)[upto - 1] if upto <= len(ids(g)) else NULL_BLOCK
                    if block_id != NULL_BLOCK and upto - 1 not in st.stored_states.setdefault(g, set()):
                        st.stored_states[g].add(upto - 1)
                        self._learn(st, upto - 1, upto)
                        plan.stores.append(self._led(s, StorePlan(req_id, (st.hashes[upto - 1],), (block_id,),
                                                                  upto - 1, group=g, tenant=st.tenant)))
        if self.state_streams:
            plan.stores.extend(self._state_stores(scheduler_output))
        return plan

    def _state_stores(self, scheduler_output: Any) -> list[StorePlan]:
        """The boundary states vLLM's forward writes in this step (it names each: group, block, tokens)."""
        bs = getattr(scheduler_output, "kv_connector_block_state", None)
        offers = getattr(bs, "boundary_state_offloads", None) or {}
        out = []
        state_groups = {s.group.index: s for s in self.state_streams}
        for req_id, items in offers.items():
            st = self._reqs.get(req_id)
            if st is None:
                continue
            for g, block_id, boundary in items:
                # A boundary inside a block (a partial prompt tail) has no block key: not stored.
                if g not in state_groups or boundary % self.block_size or block_id == NULL_BLOCK:
                    continue
                i = boundary // self.block_size - 1
                if not 0 <= i < len(st.hashes) or i in st.stored_states.setdefault(g, set()):
                    continue
                st.stored_states[g].add(i)
                self._learn(st, i, i + 1)
                out.append(self._led(state_groups[g], StorePlan(req_id, (st.hashes[i],), (block_id,), i, group=g,
                                                                tenant=st.tenant)))
        return out

    def _store_upto(self, st: _Request, s: Stream, upto: int, block_ids: Callable[[], list[int]]) -> StorePlan | None:
        """The plan storing ``st``'s blocks of stream ``s`` not yet stored, up to block ``upto``, counted
        stored; None when there are none (``block_ids``, the request's device blocks of that group, is then
        never asked for).  Stored values of several blocks (storage.block_tokens) are whole groups: up to the
        last complete group, from the boundary of the first group not yet stored.  Positions vLLM holds
        nothing at (a sliding window's freed blocks) are skipped: the plan starts after the last of them."""
        g = s.group.index
        k = s.manager.storage_blocks
        upto = upto // k * k
        done = st.stored_blocks.get(g, 0)
        if upto <= done:
            return None
        first = done // k * k
        st.stored_blocks[g] = upto
        ids = block_ids()
        lo = _run_start(ids, first, upto)
        lo = -(-lo // k) * k
        if lo >= upto:
            return None
        self._learn(st, lo, upto)
        return self._led(s, StorePlan(st.request.request_id, tuple(st.hashes[lo:upto]), tuple(ids[lo:upto]), lo,
                                      group=g, tenant=st.tenant))

    def _learn(self, st: _Request, lo: int, upto: int) -> None:
        """Tell the event stream the token ids and parents of blocks ``lo..upto`` of ``st`` (being stored)."""
        if self.events is not None:
            self.events.learn(st.hashes[lo:upto], st.request.prompt_token_ids or (), lo,
                              st.hashes[lo - 1] if lo else None)

    def take_events(self) -> list[Any]:
        return self.events.take() if self.events is not None else []

    def apply(self, *reports: WorkerReport) -> None:
        """Fold the reports the workers sent with one step (one per rank and group that had something to say)."""
        for s in self.streams:
            mine = [r for r in reports if r.group == s.group.index]
            if not mine:
                continue
            if s.leader is not None:
                s.leader.fold(mine)  # this side places blocks in host memory, from the ranks' outcomes
            report = s.ranks.fold(mine)
            if s.leader is not None:
                report.lost = s.leader.lose(report.lost)
            s.manager.apply(report)
            if self.events is not None:
                self.events.record(report, s.group.index,
                                   s.leader.host_changes() if s.leader is not None else None)
            # vLLM recomputes what a load did not deliver: store it once computed (the plan counted it stored).
            for req_id, pos in report.unloaded.items():
                st = self._reqs.get(req_id)
                if st is None:
                    continue
                for g in st.stored_blocks:
                    st.stored_blocks[g] = min(st.stored_blocks[g], pos)
                for g, done in st.stored_states.items():
                    st.stored_states[g] = {i for i in done if i < pos}

    def finished(self, request: Any) -> None:
        self._reqs.pop(request.request_id, None)
        self._running.discard(request.request_id)

    def external_sources(self, request: Any) -> dict[str, int]:
        st = self._reqs.get(request.request_id)
        return dict(st.loaded_from) if st else {}

    def close(self) -> None:
        for s in self.streams:
            s.manager.close()


def _tables(block_ids: Any) -> tuple[list[int], ...]:
    """vLLM's block ids per group (a tuple of lists), from either form it passes."""
    if block_ids and isinstance(block_ids[0], int):
        return (list(block_ids),)
    return tuple(list(t) for t in block_ids)


def _run_start(ids: list[int], first: int, last: int) -> int:
    """The first position of the trailing run of ``ids[first:last]`` that holds blocks (no null block)."""
    lo = first
    for i in range(first, min(last, len(ids))):
        if ids[i] == NULL_BLOCK:
            lo = i + 1
    return lo



def _backend_back(events: TierEvents, group: int, backend: int, _host_blocks: list[bytes]) -> None:
    """A scheduler-side manager's backend answers again after an outage: the blocks announced there go."""
    events.backend_reset(group, backend)
