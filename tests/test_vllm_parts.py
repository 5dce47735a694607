"""The vLLM connector's pieces that need no vLLM process: layout detection, layer order, config facts.
Bad input gets a message naming what was found and what is supported."""

from __future__ import annotations

import time
import types
from typing import Any

import pytest
import torch
from _stack_helpers import BLOCK, HEAD_DIM, HEADS, LAYERS, config

from kvtier.config import parse_config
from kvtier.integrations.vllm.facts import (
    kv_layers,
    kv_replicated_across_tp,
    model_facts,
    rank_tally,
    worker_rank,
)
from kvtier.integrations.vllm.groups import GroupKind, group_config, host_shares, kv_groups
from kvtier.integrations.vllm.scheduler import LoadMode, SchedulerSide
from kvtier.integrations.vllm.worker import (
    WorkerSide,
    check_cpu_arrangement,
    detect_layout,
    kv_view,
    layer_order,
)
from kvtier.keys import BlockHasher
from kvtier.plans import HostChanges, LoadPlan, RankTally, StepPlan, StorePlan, WorkerReport


def test_detect_layout_of_each_supported_tensor_and_refuse_others():
    h, d, b = 8, 128, 32
    assert detect_layout(torch.empty(4, h, b, 2 * d), h, d, b, mla=False) == "cpu_attn"
    assert detect_layout(torch.empty(4, h, b, 2 * d), h, d, b, mla=False, cpu_isa="vec") == "cpu_attn"
    assert detect_layout(torch.empty(4, h, b, 2 * d), h, d, b, mla=False, cpu_isa="amx") == "cpu_attn_amx"
    assert detect_layout(torch.empty(2, 4, b, h, d), h, d, b, mla=False) == "flash_attn"
    assert detect_layout(torch.empty(4, 2, b, h, d), h, d, b, mla=False) == "flashinfer"
    assert detect_layout(torch.empty(4, b, 576), 1, 576, b, mla=True) == "mla"
    with pytest.raises(ValueError, match=r"unsupported vLLM KV cache tensor: shape \(4, 32, 8, 256\).*"
                                         r"\(8 kv heads, head dim 128, block size 32\); supported: CPU"):
        detect_layout(torch.empty(4, b, h, 2 * d), h, d, b, mla=False)


def test_vllm_cpu_mla_tensor_is_seen_as_kvtier_mla_layout_over_the_same_memory():
    """vLLM CPU's MLA backend keeps a head axis of one, ``[N, 1, B, 576]``: kvtier works on a view of it as
    ``[N, B, 576]``, so a copy into the view lands in vLLM's tensor; other tensors pass unchanged."""
    t = torch.zeros(4, 1, 16, 576)
    v = kv_view(t, mla=True)
    assert tuple(v.shape) == (4, 16, 576) and detect_layout(v, 1, 576, 16, mla=True) == "mla"
    v[2, 3].fill_(7.0)
    assert t[2, 0, 3].eq(7.0).all() and t.sum() == 7.0 * 576
    mha = torch.empty(4, 2, 16, 128)
    assert kv_view(mha, mla=False) is mha and kv_view(t, mla=False) is t


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
@pytest.mark.parametrize("isa, b", [("vec", 32), ("vec16", 16)])
def test_the_start_up_check_accepts_the_arrangement_vllms_kernel_writes(isa, b, dtype):
    """Known K and V through vLLM CPU's own kernel come back out of kvtier's layout bit for bit; the other
    kernel's arrangement is refused (kvtier would store permuted KV)."""
    check_cpu_arrangement("cpu_attn", isa, torch.empty(0, dtype=dtype), 2, 64, b, "auto")
    if torch.cpu._is_amx_tile_supported() and dtype == torch.bfloat16 and b == 32:
        check_cpu_arrangement("cpu_attn_amx", "amx", torch.empty(0, dtype=dtype), 2, 64, b, "auto")
        with pytest.raises(ValueError, match="written by vLLM CPU's amx kernel do not come back bit for bit "
                                             "out of kvtier's cpu_attn layout"):
            check_cpu_arrangement("cpu_attn", "amx", torch.empty(0, dtype=dtype), 2, 64, b, "auto")
    with pytest.raises(ValueError, match=f"{isa} kernel do not come back .* kvtier's cpu_attn_amx layout"):
        check_cpu_arrangement("cpu_attn_amx", isa, torch.empty(0, dtype=dtype), 2, 64, 32, "auto")


def test_the_start_up_check_reports_a_kernel_that_fails():
    with pytest.raises(ValueError, match="cannot check vLLM CPU's KV arrangement \\(nope kernel\\)"):
        check_cpu_arrangement("cpu_attn", "nope", torch.empty(0, dtype=torch.bfloat16), 2, 64, 32, "auto")


def _vllm_config(mla: bool, tp: int, dcp: int = 1, pp: int = 1) -> types.SimpleNamespace:
    mc = types.SimpleNamespace(dtype=torch.bfloat16, served_model_name=None, model="m", use_mla=mla,
                               get_num_kv_heads=lambda pc: 2, get_head_size=lambda: 576 if mla else 64)
    pc = types.SimpleNamespace(tensor_parallel_size=tp, pipeline_parallel_size=pp, decode_context_parallel_size=dcp,
                               prefill_context_parallel_size=1, world_size=tp * pp)
    return types.SimpleNamespace(model_config=mc, cache_config=types.SimpleNamespace(cache_dtype="auto", block_size=16),
                                 parallel_config=pc)


def test_an_mla_namespace_is_the_same_on_every_tp_rank_and_size():
    """MLA ranks hold the same latent (vLLM replicates it), so the TP rank and size stay out of the namespace
    (one copy for all ranks; a TP=8 prefill feeds a TP=4 decode); MHA ranks hold other heads, and under
    decode context parallelism MLA ranks hold other tokens: those keep their rank."""
    def tp_of(facts: dict[str, Any]) -> tuple[int, int]:
        return facts["tp_rank"], facts["tp_size"]
    assert tp_of(model_facts(_vllm_config(mla=True, tp=4), 2, tp_rank=3)) == (0, 1)
    assert model_facts(_vllm_config(mla=True, tp=4), 2, tp_rank=3) == model_facts(_vllm_config(mla=True, tp=1), 2)
    assert tp_of(model_facts(_vllm_config(mla=False, tp=4), 2, tp_rank=3)) == (3, 4)
    assert tp_of(model_facts(_vllm_config(mla=True, tp=4, dcp=2), 2, tp_rank=3)) == (3, 4)
    # the same facts say whose bytes are one shared copy (so rank 0 alone writes it)
    assert kv_replicated_across_tp(_vllm_config(mla=True, tp=4))
    assert not kv_replicated_across_tp(_vllm_config(mla=False, tp=4))
    assert not kv_replicated_across_tp(_vllm_config(mla=True, tp=4, dcp=2))


def test_the_scheduler_waits_for_every_rank_and_for_the_ranks_that_write():
    """Every worker of the TP x PP grid reports its own shard; MLA's TP ranks share one copy that TP rank
    0 of each stage writes; a kv_consumer writes nothing.  Worker ranks number the grid without gaps."""
    def counts(t: RankTally) -> tuple[int, int]:
        return t.ranks, t.writers
    assert counts(rank_tally(_vllm_config(mla=False, tp=2, pp=2), writes=True)) == (4, 4)
    assert counts(rank_tally(_vllm_config(mla=True, tp=4, pp=2), writes=True)) == (8, 2)
    assert counts(rank_tally(_vllm_config(mla=True, tp=4, dcp=2), writes=True)) == (4, 4)
    assert counts(rank_tally(_vllm_config(mla=False, tp=2), writes=False)) == (2, 0)
    grid = [worker_rank(tp_rank, 2, pcp_rank, 3, pp_rank) for pp_rank in range(2) for pcp_rank in range(3)
            for tp_rank in range(2)]
    assert sorted(grid) == list(range(12))


def test_a_reading_only_config_writes_no_backend_and_keeps_everything_else():
    cfg = parse_config({"model": _MODEL, "backends": [
        {"name": "d", "type": "local_disk", "options": {"path": "/tmp/x"}},
        {"name": "r", "type": "redis", "options": {"url": "redis://127.0.0.1:1"}, "write": False}]})
    ro = cfg.reading_only()
    assert [b.write for b in ro.backends] == [False, False] and [b.write for b in cfg.backends] == [True, False]
    assert cfg.writes_backends and not ro.writes_backends
    assert ro.namespace() == cfg.namespace() and [b.options for b in ro.backends] == [b.options for b in cfg.backends]
    assert "d (local_disk, read-only)" in ro.summary()


def test_layer_order_is_by_layer_index_not_by_name():
    names = [f"model.layers.{i}.self_attn.attn" for i in (10, 2, 1, 0)]
    assert layer_order(names) == [f"model.layers.{i}.self_attn.attn" for i in (0, 1, 2, 10)]


def test_kv_layers_is_the_one_group_path():
    one = types.SimpleNamespace(kv_cache_groups=[types.SimpleNamespace(layer_names=["a", "b"])])
    assert kv_layers(one) == ["a", "b"]
    two = types.SimpleNamespace(kv_cache_groups=one.kv_cache_groups * 2)
    with pytest.raises(ValueError, match="models with 2 KV cache groups"):
        kv_layers(two)  # a hybrid model's groups go through groups.kv_groups, one stream each


# ---------------------------------------------------------------- the scheduler side's load mode


BS = 4
_MODEL = {"id": "m", "kv_dtype": "float32", "num_layers": 1, "num_kv_heads": 1, "head_dim": 4, "block_size": BS}


def _request(req_id: str, tokens: list[int]) -> types.SimpleNamespace:
    return types.SimpleNamespace(request_id=req_id, prompt_token_ids=tokens, num_prompt_tokens=len(tokens),
                                 num_computed_tokens=0, block_hashes=None)


def _in_host(side: SchedulerSide, keys, group: int = 0) -> None:
    """Blocks in host memory on every rank: the scheduler's leader placed them (its fold of every rank's
    outcome; no worker report says what host memory holds).  One rank of 64 slots per group, told as the
    handshake does, the first time."""
    if side.streams[group].leader is None:
        side.set_host_slots([{s.group.index: 64 for s in side.streams}])
    leader = side.streams[group].leader
    assert leader is not None
    planner = leader.planner
    with planner.lock:
        for h in keys:
            planner.commit_host_locked(h, planner.host_slots().allocate(1).slots[0])


def _left_host(side: SchedulerSide, keys, group: int = 0) -> None:
    leader = side.streams[group].leader
    assert leader is not None
    planner = leader.planner
    with planner.lock:
        for h in keys:
            planner.drop_host_locked(h)


def _side(mode: LoadMode, tmp_path, in_host: bool = False) -> SchedulerSide:
    """A scheduler side whose worker reported the first 3 blocks of ``PROMPT`` written to its local_disk
    backend, or (``in_host``) in its host memory."""
    cfg = parse_config({"model": _MODEL, "host": {"capacity": "64KiB"},
                        "backends": [{"name": "disk", "type": "local_disk", "options": {"path": str(tmp_path)}}]},
                       env={})
    side = SchedulerSide(cfg, load=True, store=False, vllm_hash_algo=None, load_mode=mode)
    hashes = side.hasher.hash_blocks(PROMPT)
    if in_host:
        _in_host(side, hashes[:3])
    else:
        side.apply(WorkerReport(in_backend={(h, 0) for h in hashes[:3]}))
    return side


PROMPT = list(range(1, 4 * BS + 2))  # 4 full blocks and a token: 4 loadable, 3 of them in host memory


def _matched(side: SchedulerSide, request, num_computed_tokens: int) -> tuple[int | None, bool]:
    """``matched_tokens`` once kvtier's probe of the backend (for the block after those it knows of) has
    answered: vLLM asks again at its next step while it is pending."""
    deadline = time.monotonic() + 10
    while (got := side.matched_tokens(request, num_computed_tokens))[0] is None and time.monotonic() < deadline:
        time.sleep(0.01)
    return got


def _step(side: SchedulerSide, scheduled: dict[str, int]):
    return side.build_plan(types.SimpleNamespace(num_scheduled_tokens=scheduled))


def test_auto_loads_in_the_step_only_when_no_other_request_ran(tmp_path):
    side = _side(LoadMode.AUTO, tmp_path)
    # Nothing ran yet: the hit is loaded in the step that schedules the request (load_kv_async False).
    assert _matched(side, _request("a", PROMPT), 0) == (3 * BS, False)
    side.after_alloc(_request("a", PROMPT), [7, 8, 9, 10], 3 * BS)
    plan = _step(side, {"a": 4})
    assert [(lp.req_id, lp.block_ids, lp.sync) for lp in plan.loads] == [("a", (7, 8, 9), True)]
    assert not plan.idle
    # "a" ran in that step and decodes on: the next request's load must not hold its steps up.
    assert _matched(side, _request("b", PROMPT), 0) == (3 * BS, True)
    side.after_alloc(_request("b", PROMPT), [1, 2, 3, 4], 3 * BS)
    assert [lp.sync for lp in _step(side, {"a": 1}).loads] == [False]
    # Once "a" has finished and nothing else ran, loads are in the step again.
    side.finished(_request("a", PROMPT))
    assert _matched(side, _request("c", PROMPT), 0) == (3 * BS, False)
    # A request asked about again is not held up by itself (it may have run a chunk already).
    _step(side, {"c": 4})
    assert _matched(side, _request("c", PROMPT), 0) == (3 * BS, False)
    assert _step(side, {}).idle  # a step in which nothing computes


def test_blocks_after_what_vllm_holds_are_offered_though_kvtier_lost_the_ones_before():
    """Keys chain through token ids: with vLLM holding blocks 0-1 itself, kvtier's blocks 2-3 are offered
    whether or not kvtier still holds 0-1 (evicted, or deleted as corrupt); from 0, nothing is."""
    cfg = parse_config({"model": _MODEL, "host": {"capacity": "64KiB"}, "backends": []}, env={})
    side = SchedulerSide(cfg, load=True, store=False, vllm_hash_algo=None)
    hashes = side.hasher.hash_blocks(PROMPT)
    _in_host(side, hashes[2:4])
    assert _matched(side, _request("a", PROMPT), 2 * BS) == (2 * BS, False)  # in host memory: in the step
    side.after_alloc(_request("a", PROMPT), [5, 6, 7, 8], 2 * BS)
    assert [(lp.hashes, lp.block_ids, lp.start) for lp in _step(side, {}).loads] == [
        (tuple(hashes[2:4]), (7, 8), 2)]
    assert _matched(side, _request("b", PROMPT), 0) == (0, False)
    assert side.external_sources(_request("a", PROMPT)) == {"host": 2 * BS}


def test_a_storing_instance_stores_the_prefix_vllm_held_itself_before_the_loaded_blocks():
    """kv_both: vLLM holds blocks 0-1, kvtier loads 2-3.  Blocks 0-1 go out with that step's plan (kvtier
    may have lost them; the worker skips what it holds), the loaded ones never; computing the last
    block stores only that one."""
    cfg = parse_config({"model": _MODEL, "host": {"capacity": "64KiB"}, "backends": []}, env={})
    side = SchedulerSide(cfg, load=True, store=True, vllm_hash_algo=None)
    side.kv_cache_manager = types.SimpleNamespace(get_block_ids=lambda req_id: ([5, 6, 7, 8, 9],))
    prompt = list(range(1, 5 * BS + 2))  # 5 full blocks and a token
    hashes = side.hasher.hash_blocks(prompt)
    _in_host(side, hashes[2:4])
    req = _request("a", prompt)
    assert _matched(side, req, 2 * BS) == (2 * BS, False)  # in host memory: in the step
    side.after_alloc(req, [5, 6, 7, 8, 9], 2 * BS)
    plan = _step(side, {})
    assert [(lp.block_ids, lp.start) for lp in plan.loads] == [((7, 8), 2)]
    assert [(sp.hashes, sp.block_ids, sp.start) for sp in plan.stores] == [(tuple(hashes[:2]), (5, 6), 0)]
    req.num_computed_tokens = 4 * BS  # loaded; vLLM now computes the rest of the prompt
    assert [(sp.block_ids, sp.start) for sp in _step(side, {"a": BS + 1}).stores] == [((9,), 4)]


@pytest.mark.parametrize("mode, in_background", [(LoadMode.ASYNC, True), (LoadMode.SYNC, False)])
def test_async_and_sync_modes_ignore_what_runs(mode, in_background, tmp_path):
    side = _side(mode, tmp_path)
    assert _matched(side, _request("a", PROMPT), 0) == (3 * BS, in_background)
    _step(side, {"a": 4, "x": 1})
    assert _matched(side, _request("b", PROMPT), 0) == (3 * BS, in_background)


@pytest.mark.parametrize("mode", list(LoadMode))
def test_a_hit_in_host_memory_loads_in_the_step_in_every_mode(mode, tmp_path):
    """No backend I/O, only a copy: the request computes in the step that schedules it, also while
    other requests run (the issue's "asynchronous when the hit is not in host memory")."""
    side = _side(mode, tmp_path, in_host=True)
    _step(side, {"x": 1})
    assert _matched(side, _request("a", PROMPT), 0) == (3 * BS, False)


def test_idle_wait_ms_from_extra_config_names_the_key_and_the_range():
    from kvtier.integrations.vllm.worker import IDLE_WAIT_MS, idle_wait_ms

    assert idle_wait_ms(None) == idle_wait_ms({"kvtier_config": "x.yaml"}) == IDLE_WAIT_MS
    assert idle_wait_ms({"idle_wait_ms": 0}) == 0.0 and idle_wait_ms({"idle_wait_ms": 2.5}) == 2.5
    for bad in (-1, "20", True, 10_001):
        with pytest.raises(ValueError, match=r"kv_connector_extra_config.idle_wait_ms: .* is not a number of "
                                             r"milliseconds from 0 to 10000"):
            idle_wait_ms({"idle_wait_ms": bad})


def test_extra_config_refuses_a_key_the_connector_does_not_read():
    """A misspelt kvtier_config ran the instance on the embedded default config, silently."""
    from kvtier.integrations.vllm.facts import check_extra_config

    check_extra_config(None)
    check_extra_config({"kvtier_config": "x.yaml", "load_mode": "sync", "idle_wait_ms": 0})
    with pytest.raises(ValueError, match=r"kv_connector_extra_config: unknown key\(s\) \['kvtier_confg'\]; did you "
                                         r"mean 'kvtier_config'\? \(known: kvtier_config, load_mode, idle_wait_ms\)"):
        check_extra_config({"kvtier_confg": "x.yaml"})
    with pytest.raises(ValueError, match=r"unknown key\(s\) \['shared_storage_path'\] \(known: "):
        check_extra_config({"kvtier_config": "x.yaml", "shared_storage_path": "/tmp/x"})


def test_load_mode_from_extra_config_names_the_key_and_the_choices():
    assert LoadMode.from_extra_config(None) is LoadMode.AUTO  # the default (LoadMode says why)
    assert LoadMode.from_extra_config({"kvtier_config": "x.yaml"}) is LoadMode.AUTO
    assert LoadMode.from_extra_config({"load_mode": "sync"}) is LoadMode.SYNC
    assert LoadMode.from_extra_config({"load_mode": "async"}) is LoadMode.ASYNC
    with pytest.raises(ValueError, match=r"kv_connector_extra_config.load_mode: 'later' is not one of "
                                         r"\['auto', 'async', 'sync'\]"):
        LoadMode.from_extra_config({"load_mode": "later"})


# ---------------------------------------------------------------- the worker side: loads in the step


def _worker(tmp_path) -> tuple[WorkerSide, list[torch.Tensor]]:
    kv = [torch.randn(32, HEADS, BLOCK, 2 * HEAD_DIM) for _ in range(LAYERS)]  # vLLM CPU's head-major layout
    return WorkerSide(config(tmp_path, layout="cpu_attn", num_blocks=32), kv), kv


def test_a_load_in_the_step_has_landed_when_start_returns_and_is_never_reported_finished(tmp_path):
    ws, kv = _worker(tmp_path)
    try:
        hashes = ws.stack.namespace.hasher().hash_blocks(list(range(3 * BLOCK)))
        ws.save(StepPlan(stores=[StorePlan("p", tuple(hashes), (0, 1, 2))]))
        want = [t[0:3].clone() for t in kv]
        for t in kv:
            t[10:13] = 0
        ws.start(StepPlan(loads=[LoadPlan("d", tuple(hashes), (10, 11, 12), sync=True)]))
        assert all(torch.equal(t[10:13], w) for t, w in zip(kv, want))  # no wait: landed already
        assert ws.finished() == set() and ws.load_errors() == set()
        assert ws.stats["sync_loads"] == 1 and ws.stats["loaded_blocks"] == 3
    finally:
        ws.close()


def test_a_load_into_the_blocks_a_prefix_was_stored_from_reads_it_again(tmp_path):
    """vLLM reuses a device block for KV kvtier never sees (decode tokens, a partial block) without
    telling the worker, then may allocate that same block to load the prefix once stored from it: the
    load must bring the stored bytes, not trust the block to still hold them (a real vLLM soak served
    wrong tokens from exactly this)."""
    ws, kv = _worker(tmp_path)
    try:
        hashes = ws.stack.namespace.hasher().hash_blocks(list(range(3 * BLOCK)))
        want = [t[0:3].clone() for t in kv]
        ws.save(StepPlan(stores=[StorePlan("p", tuple(hashes), (0, 1, 2))]))
        assert ws.stack.flush(10)
        with ws.stack.planner.lock:  # host memory pressure: the blocks are on the disk only
            for h in hashes:
                ws.stack.planner.drop_host_locked(h)
        for t in kv:
            t[0] = torch.randn_like(t[0])  # vLLM wrote another request's decode KV into block 0
        ws.start(StepPlan(loads=[LoadPlan("d", tuple(hashes), (0, 1, 2), sync=True)]))
        assert ws.load_errors() == set() and ws.stats["loaded_blocks"] == 3
        assert all(torch.equal(t[0:3], w) for t, w in zip(kv, want))
    finally:
        ws.close()


def test_a_load_in_the_step_reports_its_missing_blocks_before_start_returns(tmp_path):
    """Blocks 1-2 were never stored: vLLM must hear of them in this step (it recomputes them), and the
    request is not reported finished (vLLM never waited for it)."""
    ws, kv = _worker(tmp_path)
    try:
        hashes = ws.stack.namespace.hasher().hash_blocks(list(range(3 * BLOCK)))
        ws.save(StepPlan(stores=[StorePlan("p", tuple(hashes[:1]), (0,))]))
        ws.start(StepPlan(loads=[LoadPlan("d", tuple(hashes), (10, 11, 12), sync=True)]))
        assert ws.load_errors() == {11, 12}
        assert ws.finished() == set() and ws.stats["failed_blocks"] == 2
        # The same load in the background ends in a later call of finished(), with the same errors.
        ws.start(StepPlan(loads=[LoadPlan("e", tuple(hashes), (20, 21, 22))]))
        deadline = time.monotonic() + 10
        done: set[str] = set()
        while not done and time.monotonic() < deadline:
            done = ws.finished()
            time.sleep(0.01)
        assert done == {"e"} and ws.load_errors() == {21, 22}
    finally:
        ws.close()


def test_an_idle_step_waits_for_a_background_load_to_end_within_a_bound(tmp_path):
    """When vLLM's step computed nothing (it only waits for loads), finished() waits for a background
    load to end and reports it in that same call instead of returning into another empty step; the wait
    is bounded, and a step that computed something never waits."""
    import threading

    from kvtier.testing.faults import FaultyBackend

    ws, kv = _worker(tmp_path)
    fb = FaultyBackend(ws.stack.backends[0])
    try:
        hashes = ws.stack.namespace.hasher().hash_blocks(list(range(3 * BLOCK)))
        ws.save(StepPlan(stores=[StorePlan("p", tuple(hashes), (0, 1, 2))]))
        assert ws.stack.flush(10)
        with ws.stack.planner.lock:  # on the disk only: the load must read it
            for h in hashes:
                ws.stack.planner.drop_host_locked(h)
        ws.stack.planner.backends.backends[0] = fb  # the same disk, behind a gate
        gate = fb.gate("get")
        ws.idle_wait_s = 2.0
        ws.start(StepPlan(loads=[LoadPlan("d", tuple(hashes), (10, 11, 12))]))
        assert gate.entered.wait(10)
        t0 = time.monotonic()
        assert ws.finished() == set() and time.monotonic() - t0 < 1.0  # a busy step: no wait
        t0 = time.monotonic()
        assert ws.finished(idle=True) == set() and time.monotonic() - t0 >= 2.0  # bounded
        ws.idle_wait_s = 60.0
        threading.Timer(0.2, gate.release).start()
        t0 = time.monotonic()
        assert ws.finished(idle=True) == {"d"} and time.monotonic() - t0 < 30  # woken by the load's end
        assert ws.load_errors() == set() and ws.stats["loaded_blocks"] == 3
    finally:
        fb.clear()
        ws.close()


def test_blocks_computed_over_a_failed_in_step_load_are_not_stored(tmp_path):
    """Request "d" loads blocks 0-2 in the step, block 1 was never stored: the step computes d's blocks
    3-4 over block 1's stale contents, so save() stores none of d's blocks from 1 on (blocks before
    the failure and other requests' blocks go out), and the report tells the scheduler where d's
    undelivered blocks start.  In the next step (vLLM recomputed them) d's blocks are stored again."""
    ws, kv = _worker(tmp_path)
    try:
        hashes = ws.stack.namespace.hasher().hash_blocks(list(range(5 * BLOCK)))
        ws.save(StepPlan(stores=[StorePlan("p", (hashes[0], hashes[2]), (0, 2))]))  # not block 1's key
        ws.report()
        other = ws.stack.namespace.hasher().hash_blocks(list(range(100, 100 + BLOCK)))
        ws.start(StepPlan(loads=[LoadPlan("d", tuple(hashes[:3]), (10, 11, 12), sync=True)]))
        assert ws.load_errors() == {11, 12}
        ws.save(StepPlan(stores=[StorePlan("d", tuple(hashes[:5]), (10, 11, 12, 13, 14)),
                                 StorePlan("q", tuple(other), (20,))]))
        assert ws.stack.leading_in_memory(hashes) == 1 and ws.stack.leading_in_memory(other) == 1
        assert ws.stack.leading_in_memory(hashes[3:]) == 0
        assert ws.report().unloaded == {"d": 1}
        ws.save(StepPlan(stores=[StorePlan("d", tuple(hashes[1:5]), (11, 12, 13, 14), 1)]))
        assert ws.stack.leading_in_memory(hashes) == 5
    finally:
        ws.close()


def test_the_scheduler_stores_again_what_a_load_did_not_deliver():
    """A load of blocks 0-3 delivered 0-1: once vLLM has recomputed 2-3 they are stored (the plan had
    counted them stored)."""
    cfg = parse_config({"model": _MODEL, "host": {"capacity": "64KiB"}, "backends": []}, env={})
    side = SchedulerSide(cfg, load=True, store=True, vllm_hash_algo=None)
    side.kv_cache_manager = types.SimpleNamespace(get_block_ids=lambda req_id: ([5, 6, 7, 8, 9],))
    prompt = list(range(1, 5 * BS + 2))
    hashes = side.hasher.hash_blocks(prompt)
    _in_host(side, hashes[:4])
    req = _request("a", prompt)
    assert side.matched_tokens(req, 0) == (4 * BS, False)  # in host memory: in the step
    side.after_alloc(req, [5, 6, 7, 8, 9], 4 * BS)
    assert _step(side, {}).stores == []
    side.apply(WorkerReport(lost={hashes[2]}, unloaded={"a": 2}))
    req.num_computed_tokens = 2 * BS  # vLLM rewound the request to what was delivered
    assert [(sp.block_ids, sp.start) for sp in _step(side, {"a": 3 * BS + 1}).stores] == [((7, 8, 9), 2)]



def test_a_salted_requests_store_plans_carry_its_tenant_and_the_worker_charges_it(tmp_path):
    """Quotas per cache_salt tenant (kvtier.quota): the scheduler's StorePlans of a salted request name the
    tag of its salt (never the salt), an unsalted request's name none; the worker stores them so, and its
    local_disk records each block's tenant beside it (the share its quota counts)."""
    from kvtier.keys import tenant_tag
    from kvtier.quota import Share

    cfg = parse_config({"model": _MODEL, "host": {"capacity": "64KiB"}, "backends": []}, env={})
    side = SchedulerSide(cfg, load=False, store=True, vllm_hash_algo=None)
    side.kv_cache_manager = types.SimpleNamespace(get_block_ids=lambda req_id: ([1, 2, 3],) if req_id == "a"
                                                  else ([4, 5, 6],))
    prompt = list(range(1, 2 * BS + 2))  # 2 full blocks and a token
    salted = _request("a", prompt)
    salted.cache_salt = "tenant-a-salt"
    plain = _request("b", prompt)
    for req in (salted, plain):
        assert side.matched_tokens(req, 0) == (0, False)
    plan = _step(side, {"a": len(prompt), "b": len(prompt)})
    by_req = {sp.req_id: sp for sp in plan.stores}
    tag = tenant_tag("tenant-a-salt")
    assert by_req["a"].tenant == tag and by_req["b"].tenant is None
    assert by_req["a"].hashes != by_req["b"].hashes  # the salt is in the keys, as before
    with pytest.raises(ValueError, match="store plan for 'a': tenant: expected a tenant tag"):
        StorePlan("a", by_req["a"].hashes, (1, 2), tenant="tenant-a-salt")

    ws, _ = _worker(tmp_path)
    try:
        hashes = ws.stack.namespace.hasher().hash_blocks(list(range(2 * BLOCK)), cache_salt="tenant-a-salt")
        others = ws.stack.namespace.hasher().hash_blocks(list(range(2 * BLOCK)))
        ws.save(StepPlan(stores=[StorePlan("a", tuple(hashes), (0, 1), tenant=tag),
                                 StorePlan("b", tuple(others), (2, 3))]))
        assert ws.stack.flush(10)
        backend, ns = ws.stack.backends[0], ws.stack.namespace
        assert [b.key for b in backend._share_blocks(Share(ns.id, tag))] == ns.keys(hashes)
        assert [b.key for b in backend._share_blocks(Share(ns.id))] == ns.keys(others)
    finally:
        ws.close()


@pytest.fixture
def bare_logging(monkeypatch):
    """Logging as vLLM leaves it in its server processes: a handler on ``vllm`` only (writing into a
    buffer here), none on the root logger or on ``kvtier``; restored afterwards."""
    import io
    import logging

    root, ours, vllm = logging.getLogger(), logging.getLogger("kvtier"), logging.getLogger("vllm")
    saved = (root.handlers[:], ours.handlers[:], ours.level, ours.propagate, vllm.handlers[:], vllm.level)
    buf = io.StringIO()
    theirs = logging.StreamHandler(buf)
    theirs.setFormatter(logging.Formatter("VLLMFMT %(levelname)s [%(filename)s] %(message)s"))
    vllm.setLevel(logging.INFO)
    monkeypatch.delenv("KVTIER_LOG_LEVEL", raising=False)

    def bare() -> io.StringIO:
        # in the test's body: pytest gives the root logger its capture handlers once the test starts
        root.handlers, ours.handlers, vllm.handlers = [], [], [theirs]
        return buf

    yield bare
    root.handlers, ours.handlers, ours.level, ours.propagate, vllm.handlers, vllm.level = \
        saved[0], saved[1], saved[2], saved[3], saved[4], saved[5]


def test_kvtier_logs_through_a_handler_like_vllms(bare_logging):
    import logging

    from kvtier.integrations.vllm.logs import join_vllm_logging

    out = bare_logging()
    assert join_vllm_logging() and not join_vllm_logging()  # once per process
    log = logging.getLogger("kvtier.vllm")
    log.info("scheduler side up")
    log.debug("not at vLLM's level")
    assert out.getvalue() == "VLLMFMT INFO [test_vllm_parts.py] scheduler side up\n"


def test_kvtier_log_level_comes_from_its_variable_and_a_bad_one_is_named(bare_logging, monkeypatch):
    import logging

    from kvtier.integrations.vllm.logs import join_vllm_logging

    out = bare_logging()
    monkeypatch.setenv("KVTIER_LOG_LEVEL", "verbose")
    with pytest.raises(ValueError, match=r"KVTIER_LOG_LEVEL='verbose': expected one of DEBUG, INFO"):
        join_vllm_logging()
    monkeypatch.setenv("KVTIER_LOG_LEVEL", "debug")
    assert join_vllm_logging()
    logging.getLogger("kvtier.vllm").debug("copied out")
    assert "DEBUG" in out.getvalue() and "copied out" in out.getvalue()


def test_kvtier_leaves_logging_alone_where_the_application_set_it_up(bare_logging):
    import logging

    from kvtier.integrations.vllm.logs import join_vllm_logging

    bare_logging()
    logging.getLogger().handlers = [logging.NullHandler()]  # a script's basicConfig
    assert not join_vllm_logging() and not logging.getLogger("kvtier").handlers
    logging.getLogger().handlers = []
    logging.getLogger("vllm").handlers = []  # VLLM_CONFIGURE_LOGGING=0
    assert not join_vllm_logging() and not logging.getLogger("kvtier").handlers


# ---------------------------------------------------------------- hybrid models: one stream per KV cache group


def _hybrid_groups() -> list[Any]:
    """vLLM's own specs for a sliding window group, a gated-delta-net state group and a full attention group."""
    from vllm.v1.kv_cache_interface import (
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
        MambaSpec,
        SlidingWindowSpec,
    )

    att: dict[str, Any] = {"block_size": BS, "num_kv_heads": 1, "head_size": 4, "dtype": torch.float32}
    specs = [SlidingWindowSpec(**att, sliding_window=2 * BS + 1),
             MambaSpec(block_size=BS, shapes=((3, 8), (2, 4, 4)), dtypes=(torch.bfloat16, torch.float32)),
             FullAttentionSpec(**att)]
    cfg = KVCacheConfig(num_blocks=64, kv_cache_tensors=[],
                        kv_cache_groups=[KVCacheGroupSpec([f"model.layers.{i}.x"], s) for i, s in enumerate(specs)])
    return kv_groups(cfg)


def test_each_group_gets_a_namespace_naming_it_and_the_structure():
    groups = _hybrid_groups()
    assert [g.kind for g in groups] == [GroupKind.SLIDING, GroupKind.STATE, GroupKind.FULL]
    assert groups[0].window_blocks() == 2  # cdiv(window - 1, block size), as vLLM counts a hit's blocks
    assert groups[1].state_row_nbytes == 3 * 8 * 2 + 2 * 4 * 4 * 4  # conv bf16 + ssm fp32, unpadded
    base = parse_config({"model": _MODEL, "host": {"capacity": "64KiB"}, "storage": {"block_tokens": 2 * BS}},
                        env={})
    shares = host_shares(groups)
    assert sum(shares.values()) == pytest.approx(1.0)
    cfgs = [group_config(base, g, shares[g.index]) for g in groups]
    ids = {c.namespace().id for c in cfgs}
    assert len(ids) == 3 and base.namespace().id not in ids  # a hybrid deployment never reads a plain one's
    assert "kv_group" not in base.namespace().manifest()  # one-group namespaces keep their keys
    for g, c in zip(groups, cfgs):
        assert g.label() in c.namespace().kv_group and "sliding_window(9) x1, state(" in c.namespace().kv_group
    state = cfgs[1].namespace()
    # a state value: one int8 row of the unpadded state per layer, never grouped with others
    assert (state.kv_dtype, state.block_size, state.head_dim, state.attention, state.storage_blocks) == (
        "int8", 1, groups[1].state_row_nbytes, "mla", 1)
    assert cfgs[2].namespace().storage_blocks == 2
    assert sum(c.host.capacity for c in cfgs) <= base.host.capacity


def test_a_kind_kvtier_cannot_store_is_refused_at_start_up():
    from vllm.v1.kv_cache_interface import (
        ChunkedLocalAttentionSpec,
        FullAttentionSpec,
        KVCacheConfig,
        KVCacheGroupSpec,
    )

    att: dict[str, Any] = {"block_size": BS, "num_kv_heads": 1, "head_size": 4, "dtype": torch.float32}
    cfg = KVCacheConfig(num_blocks=8, kv_cache_tensors=[], kv_cache_groups=[
        KVCacheGroupSpec(["l0"], FullAttentionSpec(**att)),
        KVCacheGroupSpec(["l1"], ChunkedLocalAttentionSpec(**att, attention_chunk_size=8))])
    with pytest.raises(ValueError, match="group 1 .*ChunkedLocalAttentionSpec, which kvtier cannot store"):
        kv_groups(cfg)


def _hybrid_side(store: bool = False) -> tuple[SchedulerSide, list[Any]]:
    groups = _hybrid_groups()
    base = parse_config({"model": _MODEL, "host": {"capacity": "64KiB"}, "backends": []}, env={})
    cfgs = [group_config(base, g, 1 / 3) for g in groups]
    return SchedulerSide(cfgs, load=True, store=store, vllm_hash_algo=None, groups=groups), groups


def test_a_hybrid_hit_ends_where_every_group_can_be_restored():
    """Full and window groups hold blocks 0-5, the state group the states after blocks 1 and 3: the hit ends
    after block 3, the last state boundary inside the attention run.
    The load restores the full group's blocks from vLLM's hit on, the window's trailing run (vLLM gives
    it blocks only inside the window) and the one state; asynchronously, whatever the tier."""
    side, groups = _hybrid_side()
    prompt = list(range(1, 9 * BS + 2))
    hashes = side.hasher.hash_blocks(prompt)
    for g, held in ((0, hashes[:6]), (2, hashes[:6]), (1, [hashes[1], hashes[3]])):
        _in_host(side, held, g)
    req = _request("a", prompt)
    assert _matched(side, req, BS) == (3 * BS, True)  # vLLM holds block 0; blocks 1-3 from kvtier
    side.after_alloc(req, ([0, 0, 21, 22], [0, 0, 0, 31], [40, 41, 42, 43]), 3 * BS)
    plan = _step(side, {})
    assert sorted((lp.group, lp.block_ids, lp.start, lp.sync) for lp in plan.loads) == [
        (0, (21, 22), 2, False), (1, (31,), 3, False), (2, (41, 42, 43), 1, False)]
    # From the start, the same boundary; without any state stored, no hit at all.
    _left_host(side, [hashes[1]], 1)
    assert _matched(side, _request("b", prompt), 0) == (4 * BS, True)
    _left_host(side, [hashes[3]], 1)
    assert _matched(side, _request("c", prompt), 0) == (0, False)


def test_a_hybrid_step_stores_attention_blocks_and_the_states_vllm_hands_over():
    side, groups = _hybrid_side(store=True)
    prompt = list(range(1, 3 * BS + 2))
    hashes = side.hasher.hash_blocks(prompt)
    tables = ([0, 11, 12, 13], [0, 0, 21, 22], [30, 31, 32, 33])  # the window group freed block 0 already
    side.kv_cache_manager = types.SimpleNamespace(get_block_ids=lambda req_id: tables)
    req = _request("a", prompt)
    assert _matched(side, req, 0) == (0, False)
    # One step computes the 3 full blocks; vLLM hands over the state after block 2 (and one inside a block,
    # a partial prompt tail, which has no block key).
    out = types.SimpleNamespace(num_scheduled_tokens={"a": 3 * BS + 1}, kv_connector_block_state=types.SimpleNamespace(
        boundary_state_offloads={"a": [(1, 22, 3 * BS), (1, 23, 3 * BS + 1)]}))
    plan = side.build_plan(out)
    assert sorted((sp.group, sp.block_ids, sp.start) for sp in plan.stores) == [
        (0, (11, 12), 1), (1, (22,), 2), (2, (30, 31, 32), 0)]
    assert [sp.hashes for sp in plan.stores if sp.group == 1] == [(hashes[2],)]


# ---------------------------------------------------------------- kvtier's tiers in vLLM's KV event stream


def test_tier_events_announce_each_block_once_per_medium_and_remove_only_what_was_announced():
    from vllm.distributed.kv_events import BlockRemoved, BlockStored

    from kvtier.integrations.vllm.events import TierEvents

    ev = TierEvents(["local_disk", "redis"], BS)
    prompt = list(range(1, 3 * BS + 1))
    raw = BlockHasher(BS, "sha256_cbor", seed="0").hash_blocks(prompt)
    ev.learn(raw[1:3], prompt, 1, raw[0])
    ev.record(WorkerReport(in_backend={(raw[1], 0), (raw[1], 1)}), host=HostChanges(in_host={raw[1]: 0, raw[2]: 1}))
    ev.record(WorkerReport(), host=HostChanges(in_host={raw[1]: 0}))  # said again: no second announcement
    got = ev.take()
    # Hashes as vLLM publishes its own: the digest's last 8 bytes, an integer (VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES)
    h = [int.from_bytes(x[-8:], "big") for x in raw]
    assert [(type(e).__name__, e.medium, e.locality, e.ownership, e.block_hashes) for e in got] == [
        ("BlockStored", "CPU", "LOCAL", "kvtier:host", [h[1]]), ("BlockStored", "CPU", "LOCAL", "kvtier:host", [h[2]]),
        ("BlockStored", "STORAGE", "LOCAL", "kvtier:local_disk", [h[1]]),
        ("BlockStored", "STORAGE", "REMOTE", "kvtier:redis", [h[1]])]
    assert isinstance(got[0], BlockStored) and got[0].parent_block_hash == h[0]
    assert got[0].token_ids == prompt[BS:2 * BS] and got[0].block_size == BS
    assert ev.take() == []
    # Redis evicted h1 itself (its notice reached the manager); a load found h2 corrupt; h0 was never
    # announced, so its removal is not sent.
    ev.forgotten(0, raw[1], 1)
    ev.record(WorkerReport(lost={raw[2]}), host=HostChanges(left_host={raw[0]}))
    got = ev.take()
    assert all(isinstance(e, BlockRemoved) for e in got)
    assert sorted((e.ownership, tuple(e.block_hashes)) for e in got) == [("kvtier:host", (h[2],)),
                                                                         ("kvtier:redis", (h[1],))]
    # Redis answers again after an outage (it may have come back empty): what was announced there goes,
    # and only there; a block written again is announced again.
    ev.record(WorkerReport(in_backend={(raw[0], 1), (raw[1], 1), (raw[1], 0)}))  # h1 on the disk: announced already
    assert sorted((e.ownership, e.block_hashes[0]) for e in ev.take()) == sorted([("kvtier:redis", h[0]),
                                                                                  ("kvtier:redis", h[1])])
    ev.backend_reset(0, 1)
    got = ev.take()
    assert [(type(e).__name__, e.ownership, sorted(e.block_hashes)) for e in got] == [
        ("BlockRemoved", "kvtier:redis", sorted([h[0], h[1]]))]
    ev.record(WorkerReport(in_backend={(raw[1], 1)}))
    assert [(type(e).__name__, e.ownership) for e in ev.take()] == [("BlockStored", "kvtier:redis")]


def test_hybrid_stores_group_attention_values_and_never_state_values():
    """storage.block_tokens of two blocks: attention groups store whole two-block values (a sliding window
    group from the first whole value after the blocks vLLM freed), a state group one value per state."""
    groups = _hybrid_groups()
    base = parse_config({"model": _MODEL, "host": {"capacity": "64KiB"}, "backends": [],
                         "storage": {"block_tokens": 2 * BS}}, env={})
    side = SchedulerSide([group_config(base, g, 1 / 3) for g in groups], load=True, store=True,
                         vllm_hash_algo=None, groups=groups)
    prompt = list(range(1, 5 * BS + 2))
    tables = ([0, 0, 0, 13, 14], [0, 0, 0, 0, 24], [30, 31, 32, 33, 34])
    side.kv_cache_manager = types.SimpleNamespace(get_block_ids=lambda req_id: tables)
    req = _request("a", prompt)
    assert _matched(side, req, 0) == (0, False)
    out = types.SimpleNamespace(num_scheduled_tokens={"a": 5 * BS}, kv_connector_block_state=None)
    plan = side.build_plan(out)
    assert sorted((sp.group, sp.block_ids, sp.start) for sp in plan.stores) == [
        (1, (24,), 4),  # the step ended on a boundary: the state after block 4, one value
        (2, (30, 31, 32, 33), 0)]  # 4 of 5 blocks: two whole values; the window group has no whole value


def test_a_state_tensor_that_is_not_vllms_state_page_is_refused_with_its_shape():
    from kvtier.integrations.vllm.connector import state_rows

    page = torch.zeros(4, 1, 1, 48, dtype=torch.int8)
    assert state_rows(page, "model.layers.0.linear_attn", 48).shape == (4, 1, 48)
    with pytest.raises(ValueError, match=r"state layer model.layers.0.linear_attn: expected vLLM's state page "
                                         r"tensor \[N, \.\.\., 40\] of int8, got shape \(4, 1, 1, 48\)"):
        state_rows(page, "model.layers.0.linear_attn", 40)
    with pytest.raises(ValueError, match=r"got shape \(4, 1, 1, 24\) torch.bfloat16"):
        state_rows(torch.zeros(4, 1, 1, 24, dtype=torch.bfloat16), "model.layers.0.linear_attn", 24)


# ---------------------------------------------------------------- one placement authority for all ranks


def _faulty_ranks(configs, kv_shape: tuple[int, ...], disks) -> tuple[list[WorkerSide], list[Any]]:
    """One WorkerSide per config (rank = its index), its stack's disk (``disks[rank]``) behind a fault
    wrapper."""
    from kvtier.backends.local_disk import LocalDiskBackend
    from kvtier.stack import TierStack
    from kvtier.testing.faults import FaultyBackend

    ranks, faults = [], []
    for r, c in enumerate(configs):
        kv = [torch.randn(*kv_shape) for _ in range(LAYERS)]
        ws = WorkerSide(c, kv, rank=r)
        ws.stack.close()  # the same stack over the same tensors, its disk behind a fault wrapper
        fb = FaultyBackend(LocalDiskBackend({"path": str(disks[r])}, name="disk"))
        ws.stack = TierStack(c, kv_caches=kv, backends=[fb])
        ws.stack.drain_report()
        ranks.append(ws)
        faults.append(fb)
    return ranks, faults


def _close_checked(ranks: list[WorkerSide], side: SchedulerSide, ok: bool) -> None:
    """Every rank's planner invariants (``ok``: the test got this far), then everything closed."""
    try:
        for ws in ranks if ok else []:
            assert ws.stack.flush(10)
            with ws.stack.planner.lock:
                ws.stack.planner.check_locked()
    finally:
        for ws in ranks:
            ws.close()
        side.close()


def test_the_scheduler_places_every_store_in_the_same_host_slots_on_every_rank(tmp_path):
    """The scheduler's planner starts each store (StorePlan.lead) in the smallest rank's host slots; both
    ranks' stacks follow it, and the scheduler folds their outcomes.  Write-back, 4 slots: stores evict.
    Rank 1's disk fails some write-backs, so rank 1 keeps victims rank 0 handed over; still, every block
    the scheduler places in a host slot is in that slot on both ranks (a host hit it offers is there on
    every rank), and once both ranks followed the same plans they hold the same blocks where it says."""
    from kvtier.index import Tier

    cfg = config(tmp_path / "sched", layout="cpu_attn", num_blocks=32, write="write_back", host_slots=4)
    side = SchedulerSide(cfg, load=False, store=True, vllm_hash_algo=None, ranks=RankTally(2))
    ranks, faults = _faulty_ranks(
        [config(tmp_path / f"r{r}", layout="cpu_attn", num_blocks=32, write="write_back", host_slots=4 + r)
         for r in range(2)], (32, HEADS, BLOCK, 2 * HEAD_DIM), [tmp_path / f"r{r}" / "disk" for r in range(2)])
    side.set_host_slots([{0: ws.host_slots()} for ws in ranks])  # 4 and 5: rank 0's 4 are every rank's
    leader = side.streams[0].leader
    assert leader is not None and leader.planner.host_slots().num_slots == 4
    tables: dict[str, list[int]] = {}
    side.kv_cache_manager = types.SimpleNamespace(get_block_ids=lambda req_id: (tables[req_id],))
    diverged = placed_total = 0
    ok = False
    try:
        for t in range(10):
            rid = f"r{t}"
            prompt = [1000 * t + i for i in range(2 * BLOCK + 1)]  # 2 full blocks and a token
            tables[rid] = [(3 * t) % 30, (3 * t) % 30 + 1, (3 * t) % 30 + 2]
            req = _request(rid, prompt)
            side.matched_tokens(req, 0)
            plan = _step(side, {rid: len(prompt)})
            assert plan.stores and all(sp.lead is not None for sp in plan.stores)
            if t % 3 == 2:
                faults[1].fail("put", times=1)  # rank 1's next write-back fails
            for ws in ranks:
                ws.save(plan)
            faults[1].clear()
            side.apply(*[ws.report() for ws in ranks])
            side.finished(req)
            assert leader.pending == 0
            # vLLM reuses its device blocks without telling the scheduler: never offered as on the device.
            hashes = side.hasher.hash_blocks(prompt)
            assert Tier.DEVICE not in side.manager.lookup(hashes).tiers
            with leader.planner.lock:
                placed = {k: leader.planner.index.host_slot(k) for k in list(leader.planner.index)}
            placed = {k: s for k, s in placed.items() if s is not None}
            placed_total += len(placed)
            for ws in ranks:
                assert {k: ws.stack.index.host_slot(k) for k in placed} == placed
            diverged += any(ranks[0].stack.index.host_slot(k) != ranks[1].stack.index.host_slot(k)
                            for k in list(ranks[0].stack.index))
        assert placed_total >= 20 and diverged >= 1  # stores were placed, and the ranks did diverge
        leader.check()
        ok = True
    finally:
        _close_checked(ranks, side, ok)


def test_the_scheduler_places_what_every_ranks_loads_bring_up_in_the_same_host_slots(tmp_path):
    """Loads are led too (LoadPlan.lead): the scheduler pins the blocks it serves from host memory until
    every rank reported, and names the host slots of the blocks the ranks read from their disks.  Both
    ranks read into those slots; rank 1's disk fails some reads, and then the scheduler places none of that
    load's failed blocks, though rank 0 holds them: every block the scheduler places in a host slot is in
    that slot on both ranks, and nothing stays pinned or WRITING once the plans are folded."""
    from kvtier.memory.host_slots import WRITING

    def cfg(rank: int, slots: int):  # TP=2 over one disk: each rank's keys in its own namespace
        c = config(tmp_path, num_blocks=32, write="write_through", host_slots=slots)
        return c.model_copy(update={"model": c.model.model_copy(update={"tp_rank": rank, "tp_size": 2})})

    side = SchedulerSide(cfg(0, 4), load=True, store=True, vllm_hash_algo=None, ranks=RankTally(2),
                         load_mode=LoadMode.SYNC)
    # flash_attn: loads read into host memory (never straight into the KV), so they take host room
    ranks, faults = _faulty_ranks([cfg(r, 4 + r) for r in range(2)], (2, 32, BLOCK, HEADS, HEAD_DIM),
                                  [tmp_path / "disk"] * 2)
    side.set_host_slots([{0: ws.host_slots()} for ws in ranks], [{0: ws.loads_direct()} for ws in ranks])
    leader = side.streams[0].leader
    assert leader is not None and leader.loads_into_host
    tables: dict[str, list[int]] = {}
    side.kv_cache_manager = types.SimpleNamespace(get_block_ids=lambda req_id: (tables[req_id],))

    def run(plan: StepPlan, fail_rank1: bool = False) -> None:
        if fail_rank1:
            faults[1].fail("get", times=1)  # rank 1's next read fails
        for ws in ranks:
            ws.start(plan)
            ws.save(plan)
            assert ws.stack.flush(10)
        faults[1].clear()
        side.apply(*[ws.report() for ws in ranks])

    def prompt(t: int) -> list[int]:
        return [1000 * t + i for i in range(3 * BLOCK + 1)]  # 3 full blocks and a token

    def placed_everywhere() -> int:
        with leader.planner.lock:
            placed = {k: leader.planner.index.host_slot(k) for k in list(leader.planner.index)}
        placed = {k: s for k, s in placed.items() if s is not None}
        for ws in ranks:
            assert {k: ws.stack.index.host_slot(k) for k in placed} == placed
        return len(placed)

    ok = False
    try:
        for t in range(6):  # stored on both disks; host memory (4 slots) keeps the last ones only
            rid = f"s{t}"
            tables[rid] = [1 + 4 * t + i for i in range(4)]  # 0 is vLLM's null block
            req = _request(rid, prompt(t))
            assert _matched(side, req, 0) == (0, False)
            run(_step(side, {rid: len(prompt(t))}))
            side.finished(req)
        loaded = lost = 0
        for t in range(6):  # each prompt again: its blocks come back from the disks into host memory
            rid = f"l{t}"
            tables[rid] = [25 + (t % 2) * 3 + i for i in range(3)] + [31]
            req = _request(rid, prompt(t))
            tokens, _ = _matched(side, req, 0)
            assert tokens == 3 * BLOCK
            side.after_alloc(req, tables[rid], tokens)
            plan = _step(side, {rid: 1})
            (lp,) = plan.loads
            assert lp.lead is not None
            held = [k for k in lp.hashes if leader.planner.index.host_slot(k) is not None]
            assert all(leader.planner.index.entry(k).refs > 0 for k in held)  # pinned until folded
            assert sorted(lp.lead.fetch) == [i for i, k in enumerate(lp.hashes) if k not in held]
            assert len(lp.lead.room.order()) == len(lp.lead.fetch)
            run(plan, fail_rank1=t % 2 == 1)
            assert leader.pending == 0
            assert not any(leader.planner.index.entry(k).refs for k in held if k in leader.planner.index)
            got = {k for k in lp.hashes if leader.planner.index.host_slot(k) is not None}
            if t % 2 == 1 and lp.lead.fetch:
                first = lp.hashes[lp.lead.fetch[0]]
                assert first not in got  # rank 1 did not read it: not placed, whatever rank 0 holds
                lost += 1
            loaded += len(got)
            placed_everywhere()
            side.finished(req)
        assert loaded >= 6 and lost >= 1
        leader.check()
        table = leader.planner.host_slots()
        assert not any(table.state(s) is WRITING for s in range(table.num_slots))
        ok = True
    finally:
        _close_checked(ranks, side, ok)
