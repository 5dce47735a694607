"""The manager (scheduler half): torch-free by import, a lookup that never waits on a backend (hit / miss /
pending), worker reports folded into the one index, plan objects that check their invariants and pickle."""

from __future__ import annotations

import pickle
import subprocess
import sys
import threading
import time

import pytest

from kvtier.backends.local_disk import LocalDiskBackend
from kvtier.config import parse_config
from kvtier.format import blockformat
from kvtier.index import Tier
from kvtier.plans import LoadPlan, Lookup, LookupState, RankTally, StepPlan, StorePlan, WorkerReport
from kvtier.testing.faults import FaultyBackend
from kvtier.tiering.manager import TierManager

DISK = Tier.backend(0)  # the one backend of _manager, named "disk"
MODEL = {"id": "m", "kv_dtype": "float32", "num_layers": 1, "num_kv_heads": 1, "head_dim": 4, "block_size": 4}


def test_manager_imports_no_torch():
    code = ("import sys, kvtier.tiering.manager, kvtier.plans, kvtier.backends.local_disk, kvtier.backends.redis, "
            "kvtier.backends.s3; bad = [m for m in sys.modules if m == 'torch' or m.startswith('torch.')]; "
            "print(bad); sys.exit(1 if bad else 0)")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stdout + r.stderr


def _manager(tmp_path, fb=None) -> tuple[TierManager, FaultyBackend]:
    cfg = parse_config({"model": MODEL, "backends": [{"name": "disk", "type": "local_disk",
                                                      "options": {"path": str(tmp_path / "d")}}]}, env={})
    fb = fb or FaultyBackend(LocalDiskBackend({"path": str(tmp_path / "d")}, name="disk"))
    return TierManager(cfg, backends=[fb]), fb


def _eventually(fn, timeout=10.0):
    deadline = time.monotonic() + timeout
    while True:
        got = fn()
        if got.state is not LookupState.PENDING or time.monotonic() > deadline:
            return got
        time.sleep(0.005)


def test_lookup_is_pending_while_backends_are_asked_then_answers(tmp_path):
    m, fb = _manager(tmp_path)
    try:
        h = m.namespace.hasher().hash_blocks(list(range(16)))  # 4 blocks
        fb.put(m.namespace.keys(h[:3]), [bytes(16)] * 3, m.namespace.layout_id)
        gate = fb.gate("contains", times=1)  # the backend answers only when we say so
        t0 = time.monotonic()
        first = m.lookup(h)
        assert first == Lookup(LookupState.PENDING) and time.monotonic() - t0 < 0.5  # no wait here
        assert m.lookup(h) == Lookup(LookupState.PENDING)  # asked again: the same probe, still running
        gate.release()
        got = _eventually(lambda: m.lookup(h))
        assert got == Lookup(LookupState.HIT, 3, (DISK,) * 3)
        # What the probe found is remembered: asked again, no backend call is needed for those blocks.
        assert m.lookup(h[:3]) == Lookup(LookupState.HIT, 3, (DISK,) * 3)
    finally:
        m.close()


def test_lookup_may_wait_for_its_probe_when_the_caller_can_block(tmp_path):
    m, fb = _manager(tmp_path)
    try:
        h = m.namespace.hasher().hash_blocks(list(range(16)))
        fb.put(m.namespace.keys(h[:2]), [bytes(16)] * 2, m.namespace.layout_id)
        gate = fb.gate("contains", times=1)
        threading.Timer(0.2, gate.release).start()
        t0 = time.monotonic()
        assert m.lookup(h, wait_s=10) == Lookup(LookupState.HIT, 2, (DISK,) * 2)  # no polling
        assert 0.15 < time.monotonic() - t0 < 5
        gate = fb.gate("contains", times=1)  # a probe that outlives the wait: still PENDING
        m.forget_probes()
        assert m.lookup(h[::-1], wait_s=0.05) == Lookup(LookupState.PENDING)
        gate.release()
    finally:
        m.close()


def _in_host(m, placed: dict[bytes, int]) -> None:
    """Blocks in host memory, as a planner sharing the manager's index places them (vLLM: the scheduler's
    leader; no worker report says what host memory holds)."""
    with m.lock:
        for h, slot in placed.items():
            if h not in m.index:
                m.index.insert(h)
            m.index.set_host(h, slot)


def _left_host(m, keys) -> None:
    with m.lock:
        for h in keys:
            m.index.clear_host(h)
            m.index.discard_if_unused(h)


def test_backend_fault_is_a_miss_and_worker_reports_are_the_truth(tmp_path):
    m, fb = _manager(tmp_path)
    try:
        h = m.namespace.hasher().hash_blocks(list(range(16)))
        fb.fail("contains")
        assert _eventually(lambda: m.lookup(h)) == Lookup(LookupState.MISS)
        fb.clear()
        m.forget_probes()
        _in_host(m, {h[0]: 5, h[1]: 6})
        assert m.index.lookup_prefix(h).in_memory == 2
        got = _eventually(lambda: m.lookup(h))
        assert got == Lookup(LookupState.HIT, 2, (Tier.HOST, Tier.HOST))  # the backend has none of the rest
        _left_host(m, [h[1]])
        assert m.index.lookup_prefix(h).in_memory == 1
        m.apply(WorkerReport(lost={h[0]}))
        assert h[0] not in m.index
    finally:
        m.close()


def test_blocks_a_backend_evicts_are_forgotten_there(tmp_path):
    """A capacity eviction the backend tells of unmarks the blocks and drops the probe answer that
    counted them: the next lookup asks the backend again instead of offering a hit whose load would fail.
    Another namespace's keys (a shared store) and a report from a worker elsewhere work the same way."""
    value = blockformat.HEADER_SIZE + 16
    disk = LocalDiskBackend({"path": str(tmp_path / "d"), "capacity": 4 * value}, name="disk")
    m, _ = _manager(tmp_path, fb=FaultyBackend(disk))
    forgotten: list[tuple[bytes, int]] = []
    m.on_forgotten = lambda h, i: forgotten.append((h, i))
    try:
        ns, hasher = m.namespace, m.namespace.hasher()
        a = hasher.hash_blocks(list(range(16)))  # 4 blocks
        b = hasher.hash_blocks(list(range(100, 108)))  # 2 other blocks
        disk.put(ns.keys(a), [bytes(16)] * 4, ns.layout_id)
        assert _eventually(lambda: m.lookup(a)) == Lookup(LookupState.HIT, 4, (DISK,) * 4)
        assert m.lookup(a) == Lookup(LookupState.HIT, 4, (DISK,) * 4)  # remembered: no probe
        disk.on_evicted(["0" * 32 + "/" + a[0].hex()])  # another namespace's block: not ours
        assert forgotten == [] and m.index.in_backends(a[0], (0,))
        disk.put(ns.keys(b), [bytes(16)] * 2, ns.layout_id)  # evicts a[0], a[1]
        assert sorted(forgotten) == sorted([(a[0], 0), (a[1], 0)])
        assert a[0] not in m.index and a[1] not in m.index  # in no tier any more: dropped
        assert m.index.in_backends(a[2], (0,))
        assert _eventually(lambda: m.lookup(a)) == Lookup(LookupState.MISS)  # asked again, not offered
        assert _eventually(lambda: m.lookup(a[2:])) == Lookup(LookupState.HIT, 2, (DISK,) * 2)
        # The scheduler's manager hears of it through the worker's report.
        m.apply(WorkerReport(left_backend={(a[2], 0)}))
        assert not m.index.in_backends(a[2], (0,))
        assert _eventually(lambda: m.lookup(a[2:])) == Lookup(LookupState.HIT, 2, (DISK,) * 2)  # still there
        # What a worker writes, the scheduler knows at once: no probe, and none that missed it kept.
        c = hasher.hash_blocks(list(range(200, 208)))
        assert _eventually(lambda: m.lookup(c)) == Lookup(LookupState.MISS)  # asked: the answer is kept
        disk.put(ns.keys(c), [bytes(16)] * 2, ns.layout_id)
        assert m.lookup(c) == Lookup(LookupState.MISS)  # the kept answer, until...
        m.apply(WorkerReport(in_backend={(c[0], 0), (c[1], 0)}))
        assert m.lookup(c) == Lookup(LookupState.HIT, 2, (DISK,) * 2)  # ...the report: no probe needed
        assert not any(k[0] == c[0] for k in m._probes)
    finally:
        m.close()


def test_plans_check_invariants_and_pickle():
    h = [bytes([i]) * 32 for i in range(3)]
    with pytest.raises(ValueError, match="3 hashes but 2 block ids"):
        LoadPlan("r", tuple(h), (1, 2))
    with pytest.raises(ValueError, match=r"duplicate destination block ids \[4, 4, 7\]"):
        LoadPlan("r", tuple(h), (4, 7, 4))
    with pytest.raises(ValueError, match=r"negative block ids \[-1\]"):
        StorePlan("r", tuple(h[:1]), (-1,))
    with pytest.raises(ValueError, match="state hit with 0 blocks"):
        Lookup(LookupState.HIT, 0)
    step = StepPlan([LoadPlan("a", tuple(h), (1, 2, 3))], [StorePlan("b", tuple(h[:1]), (9,))])
    assert pickle.loads(pickle.dumps(step)) == step
    rep = WorkerReport(in_backend={(h[0], 1)}, left_backend={(h[1], 0)}, lost={h[2]}, rank=1)
    assert pickle.loads(pickle.dumps(rep)) == rep


def test_rank_tally_believes_a_block_once_every_rank_said_it_in_any_steps():
    """TP ranks each hold a shard: written only once every rank reported it, whichever steps their reports
    came in; a rank that said nothing this step (vLLM drops its empty report) never lets the others' word
    count alone; lost or evicted on any rank is gone at once."""
    h = [bytes([i]) * 32 for i in range(4)]
    tally = RankTally(ranks=2)
    step1 = tally.fold([WorkerReport(in_backend={(h[0], 0), (h[2], 0)}, lost={h[3]}, rank=0)])
    assert step1.in_backend == set() and step1.lost == {h[3]}  # rank 1 said nothing yet
    assert tally.pending == 2
    step2 = tally.fold([WorkerReport(in_backend={(h[0], 0)}, rank=1)])
    assert step2.in_backend == {(h[0], 0)} and not step2.left_backend
    assert tally.pending == 1  # h[2] waits for rank 1
    # Evicted from a backend on one rank: gone, and the count of writers restarts.
    tally.fold([WorkerReport(in_backend={(h[1], 1)}, rank=0)])
    gone = tally.fold([WorkerReport(left_backend={(h[1], 1)}, rank=1)])
    assert gone.left_backend == {(h[1], 1)} and gone.in_backend == set()
    assert tally.fold([WorkerReport(in_backend={(h[1], 1)}, rank=1)]).in_backend == set()
    assert tally.fold([WorkerReport(unloaded={"x": 3}, rank=0), WorkerReport(unloaded={"x": 1, "y": 5}, rank=1)]
                      ).unloaded == {"x": 1, "y": 5}
    with pytest.raises(ValueError, match="a report from rank 2, expected ranks 0..1"):
        tally.fold([WorkerReport(rank=2)])
    with pytest.raises(ValueError, match="3 ranks and 4 writers"):
        RankTally(3, 4)


def test_rank_tally_counts_only_the_ranks_that_write():
    """MLA: every TP rank holds the same bytes and rank 0 alone writes them; the readers never hold a
    write back, and what a reader lost is still lost."""
    h = [bytes([i]) * 32 for i in range(3)]
    tally = RankTally(ranks=2, writers=1)
    reader = WorkerReport(in_backend={(h[2], 0)}, lost={h[2]}, writes=False, rank=1)
    writer = WorkerReport(in_backend={(h[0], 0), (h[1], 0)}, rank=0)
    out = tally.fold([reader, writer])
    assert out.in_backend == {(h[0], 0), (h[1], 0)} and out.lost == {h[2]}
    bounded = RankTally(ranks=2, max_pending=2)
    for i in range(3):
        bounded.fold([WorkerReport(in_backend={(h[i], 0)}, rank=0)])
    assert bounded.pending == 2  # the oldest half-reported block was dropped (a hint never learnt)
    assert bounded.fold([WorkerReport(in_backend={(h[0], 0)}, rank=1)]).in_backend == set()


def test_grouped_values_the_backend_evicts_are_never_offered(tmp_path):
    """With values of several blocks (storage.block_tokens), a value is stored under its group's last
    block's key, and the other blocks of the group come out of it.  An evicted value unmarks that block,
    and a lookup offers a block only in a backend only with its group's last block marked there and
    inside the lookup: so neither a group whose value is gone nor the first half of a group that ends
    beyond the blocks asked about (a prompt's last, never loadable block) is offered as a load that
    must fail."""
    value = blockformat.HEADER_SIZE + 32
    disk = LocalDiskBackend({"path": str(tmp_path / "d"), "capacity": 3 * value}, name="disk")
    cfg = parse_config({"model": MODEL, "storage": {"block_tokens": 8},
                        "backends": [{"name": "disk", "type": "local_disk",
                                      "options": {"path": str(tmp_path / "d")}}]}, env={})
    m = TierManager(cfg, backends=[disk])
    forgotten: list[tuple[bytes, int]] = []
    m.on_forgotten = lambda h, i: forgotten.append((h, i))
    try:
        ns, hasher = m.namespace, m.namespace.hasher()
        a = hasher.hash_blocks(list(range(24)))  # 6 blocks, 3 values: under a[1], a[3], a[5]
        disk.put(ns.keys([a[1], a[3], a[5]]), [bytes(32)] * 3, ns.layout_id)
        m.apply(WorkerReport(in_backend={(h, 0) for h in a}))  # a worker marks every block of its values
        assert m.lookup(a) == Lookup(LookupState.HIT, 6, (DISK,) * 6)
        # Blocks 2..4 asked about: block 4's value is under a[5], outside: two blocks, no probe.
        assert m.lookup(a[2:5], start=2) == Lookup(LookupState.HIT, 2, (DISK,) * 2)
        assert not m._probes
        b = hasher.hash_blocks(list(range(100, 108)))
        disk.put(ns.keys([b[1]]), [bytes(32)], ns.layout_id)  # evicts the oldest value, a[1]'s
        assert forgotten == [(a[1], 0)] and not m.index.in_backends(a[1], (0,))
        assert m.index.in_backends(a[0], (0,))  # a hint the lookup must not trust alone
        assert _eventually(lambda: m.lookup(a)) == Lookup(LookupState.MISS)  # the chain's first value is gone
        assert m.lookup(a[2:], start=2) == Lookup(LookupState.HIT, 4, (DISK,) * 4)
        # Block 1 in memory does not stand for its value: block 0 is not offered from the backend.
        _in_host(m, {a[1]: 3})
        assert _eventually(lambda: m.lookup(a)) == Lookup(LookupState.MISS)
    finally:
        m.close()


def test_malformed_keys_a_backend_says_it_evicted_never_break_a_lookup(tmp_path):
    """A third-party backend may tell garbage (a manifest, a path, not even a str): those are dropped,
    the block keys beside them are still forgotten, and lookups keep answering."""
    m, fb = _manager(tmp_path)
    try:
        ns, h = m.namespace, m.namespace.hasher().hash_blocks(list(range(8)))
        m.apply(WorkerReport(in_backend={(h[0], 0), (h[1], 0)}))
        assert m.lookup(h) == Lookup(LookupState.HIT, 2, (DISK,) * 2)
        assert fb.on_evicted is not None  # the manager listens
        fb.on_evicted([f"{ns.id}/manifest.json", "../x", None,  # type: ignore[list-item]
                       ns.keys(h[1:])[0], ns.id + "/zz"])
        assert not m.index.in_backends(h[1], (0,)) and m.index.in_backends(h[0], (0,))
        assert m.lookup(h[:1]) == Lookup(LookupState.HIT, 1, (DISK,))
    finally:
        m.close()


def test_evictions_during_writes_are_named_to_the_writes_they_hit_and_the_record_stays_bounded(tmp_path):
    """A put is told of exactly the values its backend evicted after it started (not before), whatever
    other puts overlap it; and a backend that is always writing and evicting keeps only the evictions a
    write still in flight can own."""
    m, fb = _manager(tmp_path)
    m.EVICTED_WHILE_WRITING_MAX = 8  # small, so the bound shows in a short test
    try:
        ns = m.namespace
        h = ns.hasher().hash_blocks(list(range(16 * 40)))  # 40 blocks
        assert fb.on_evicted is not None  # the manager listens
        evict = fb.on_evicted
        first = m.begin_writes_locked(0)
        evict(ns.keys([h[0]]))
        second = m.begin_writes_locked(0)
        evict(ns.keys([h[1]]))
        assert m.end_writes_locked(0, first, [h[0], h[1], h[2]]) == {h[0], h[1]}
        assert m.end_writes_locked(0, second, [h[0], h[1]]) == {h[1]}  # h[0] went before it started
        quiet = m.begin_writes_locked(0)
        assert m.end_writes_locked(0, quiet, [h[0], h[1]]) == set()  # nothing in flight kept anything
        # Always one write in flight, each eviction during the next: named to the write it hit, and the
        # record holds no more than its bound (plus the evictions of one write).
        older = m.begin_writes_locked(0)
        for k in h[2:]:
            newer = m.begin_writes_locked(0)
            evict(ns.keys([k]))
            assert m.end_writes_locked(0, older, [k]) == {k}
            older = newer
            assert len(m._evicted_while_writing.get(0, {})) <= m.EVICTED_WHILE_WRITING_MAX + 1
        assert m.end_writes_locked(0, older, [h[-1]]) == {h[-1]}
        assert m._evicted_while_writing == {} and m._writes_in_flight == {}
    finally:
        m.close()
