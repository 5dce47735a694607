"""Write, prefetch and eviction policies.  Each write policy runs the same sequence of operations on a
2-slot host tier over local_disk, and the test asserts which tier holds which block after every step,
so the policies' differences are pinned down."""

from __future__ import annotations

import time
from typing import Any

import pytest
from _stack_helpers import BLOCK_NBYTES, TIMEOUT, chain, config, fill, make_stack, read, where

from kvtier import plugins
from kvtier.config import ConfigError
from kvtier.format import blockformat
from kvtier.index import BlockIndex, Tier
from kvtier.policies.eviction import LRU
from kvtier.policies.prefetch import BestEffort, Timeout, WaitComplete
from kvtier.policies.write import WriteBack, WriteThrough, WriteThroughSelective
from kvtier.policy_api import EvictionPolicy, PrefetchPolicy, WritePolicy

# Four one-block requests A, B, C, D; each step: (operation, block), then where A, B, C, D are
# ("H" host, "D" disk, "-" nowhere).  Host memory holds 2 blocks.
STEPS = [("store", "A"), ("load", "A"), ("load", "A"), ("store", "B"), ("store", "C"), ("load", "A"),
         ("store", "D")]
EXPECTED = {
    # copy down at once; eviction just drops the host copy
    "write_through": [
        ["HD", "-", "-", "-"],
        ["HD", "-", "-", "-"],
        ["HD", "-", "-", "-"],
        ["HD", "HD", "-", "-"],
        ["D", "HD", "HD", "-"],    # C evicts A (least recently used)
        ["HD", "D", "HD", "-"],    # A comes back from disk (promoted), evicting B
        ["HD", "D", "D", "HD"],    # D evicts C
    ],
    # copy down on the 2nd hit; a block evicted before that is gone
    "write_through_selective": [
        ["H", "-", "-", "-"],
        ["H", "-", "-", "-"],      # 1 hit
        ["HD", "-", "-", "-"],     # 2 hits: copied down
        ["HD", "H", "-", "-"],
        ["D", "H", "H", "-"],
        ["HD", "-", "H", "-"],     # B had no hits: evicted, lost
        ["HD", "-", "-", "H"],     # C too
    ],
    # copy down only on eviction, which completes the copy before freeing the slot
    "write_back": [
        ["H", "-", "-", "-"],
        ["H", "-", "-", "-"],
        ["H", "-", "-", "-"],
        ["H", "H", "-", "-"],
        ["D", "H", "H", "-"],      # A written back, then evicted
        ["HD", "D", "H", "-"],     # A promoted; B written back, then evicted
        ["HD", "D", "D", "H"],
    ],
}


@pytest.mark.parametrize("policy", list(EXPECTED))
def test_write_policy_sequence(tmp_path, policy):
    st, _ = make_stack(tmp_path, write=policy, host_slots=2)
    try:
        names = "ABCD"
        hs = {n: chain(st, 1, start=100 * i) for i, n in enumerate(names)}
        data = {}
        for step, ((op, n), want) in enumerate(zip(STEPS, EXPECTED[policy])):
            if op == "store":
                data[n] = fill(st, [step], seed=step)
                assert st.store(hs[n], [step]).wait(TIMEOUT).status == ("stored",)
            else:
                lr = st.load(hs[n], [20 + step]).wait(TIMEOUT)
                assert lr.num_loaded == 1
                assert read(st, [20 + step]).equal(data[n])
            assert st.flush(TIMEOUT)
            st.on_device_freed(range(st.device.num_blocks))
            got = [where(st, hs[m])[0] for m in names]
            assert got == want, f"{policy} after step {step} ({op} {n}): {got} != {want}"
        with st.planner.lock:
            st.index.validate()
            assert st.index.pinned == 0
    finally:
        st.close()


def test_selective_threshold_comes_from_options(tmp_path):
    st, _ = make_stack(tmp_path, write="write_through_selective", write_options={"threshold": 3})
    try:
        hs = chain(st, 2)
        fill(st, [0, 1], seed=1)
        st.store(hs, [0, 1]).wait(TIMEOUT)
        for k in range(3):
            st.load(hs, [4, 5]).wait(TIMEOUT)
            st.flush(TIMEOUT)
            assert where(st, hs) == (["HD"] * 2 if k == 2 else ["H"] * 2), k
    finally:
        st.close()


def test_write_back_eviction_that_cannot_write_keeps_the_block(tmp_path):
    st, fb = make_stack(tmp_path, write="write_back", host_slots=2)
    try:
        a, b, c = (chain(st, 1, start=s) for s in (0, 100, 200))
        fill(st, [0, 1, 2], seed=2)
        st.store(a, [0]).wait(TIMEOUT)
        st.store(b, [1]).wait(TIMEOUT)
        fb.fail("put")  # the disk refuses everything
        res = st.store(c, [2]).wait(TIMEOUT)
        assert res.status == ("skipped",)  # no slot: the victim could not be written back
        assert where(st, a + b + c) == ["H", "H", "-"]  # nothing was lost from host
        assert st.metrics.snapshot()["tiers"]["host"]["stores_skipped"] == 1
        fb.clear()
        assert st.store(c, [2]).wait(TIMEOUT).status == ("stored",)
        # A's failed write-back put it back as most recently used (as HostTier.restore does), so B,
        # now the least recently used, was written back and evicted.
        assert where(st, a + b + c) == ["H", "D", "H"]
    finally:
        st.close()


def test_write_back_flushes_nothing_until_eviction(tmp_path):
    st, fb = make_stack(tmp_path, write="write_back", host_slots=4)
    try:
        hs = chain(st, 3)
        fill(st, [0, 1, 2], seed=3)
        st.store(hs, [0, 1, 2]).wait(TIMEOUT)
        assert st.flush(TIMEOUT)
        assert fb.calls["put"] == 0 and where(st, hs) == ["H"] * 3
    finally:
        st.close()


def test_write_back_writes_again_a_block_the_disk_evicted_while_host_memory_held_it(tmp_path):
    """A block loaded from disk is in host memory and on disk; the disk then evicts it (its capacity) and
    says so.  When host memory evicts the block, write-back writes it down again instead of dropping
    what it would otherwise believe is still on disk: the block is never in no tier."""
    value = blockformat.HEADER_SIZE + BLOCK_NBYTES
    disk = {"name": "disk", "type": "local_disk", "options": {"path": str(tmp_path / "disk"), "capacity": 2 * value}}
    st, _ = make_stack(tmp_path, faulty=False, write="write_back", host_slots=2, backends=[disk])
    try:
        a, b, c, e = (chain(st, 1, start=100 * i) for i in range(4))
        for i, h in enumerate((a, b + c)):  # a, then b and c: a is written back to make room
            fill(st, list(range(len(h))), seed=i)
            st.store(h, list(range(len(h)))).wait(TIMEOUT)
            st.on_device_freed(range(len(h)))
        assert st.flush(TIMEOUT) and where(st, a + b + c) == ["D", "H", "H"]
        assert st.load(a, [5]).wait(TIMEOUT).num_loaded == 1  # a comes up; b is written back for room
        st.on_device_freed([5])
        assert st.flush(TIMEOUT) and where(st, a + b + c) == ["HD", "D", "H"]
        others = chain(st, 2, start=900)
        st.backends[0].put(st.namespace.keys(others), [bytes(BLOCK_NBYTES)] * 2, st.namespace.layout_id)
        assert where(st, a + b) == ["H", "-"] and not st.index.in_backends(a[0], (0,))  # evicted a and b
        fill(st, [0], seed=9)
        st.store(e, [0]).wait(TIMEOUT)  # evicts c (least recently used) then, for the next store, a
        fill(st, [1], seed=10)
        st.store(b, [1]).wait(TIMEOUT)
        assert st.flush(TIMEOUT)
        assert where(st, a)[0] in ("D", "HD"), "a block write-back evicted from host memory is on disk"
    finally:
        st.close()


# ---------------------------------------------------------------------- prefetch


def _stored_on_disk(tmp_path, n: int = 6):
    """n blocks stored on disk by an earlier process; returns their hashes."""
    st, _ = make_stack(tmp_path, faulty=False, host_slots=8)
    hs = chain(st, n)
    fill(st, list(range(n)), seed=4)
    st.store(hs, list(range(n))).wait(TIMEOUT)
    assert st.flush(TIMEOUT)
    st.close()
    return hs


def _prefetch_stack(tmp_path, prefetch: str, options: dict[str, Any] | None = None, threshold: int = 0):
    st, fb = make_stack(tmp_path, host_slots=8, prefetch=prefetch, prefetch_options=options,
                        threshold_tokens=threshold)
    st.prefetch_chunk_blocks = 2
    return st, fb


def test_prefetch_below_threshold_does_not_start(tmp_path):
    hs = _stored_on_disk(tmp_path)
    st, fb = _prefetch_stack(tmp_path, "wait_complete", threshold=25)  # 6 blocks x 4 tokens = 24
    try:
        h = st.prefetch(hs)
        assert not h.started and h.wait() == 0 and fb.calls["get"] == 0
    finally:
        st.close()
    st, fb = _prefetch_stack(tmp_path, "wait_complete", threshold=24)
    try:
        h = st.prefetch(hs)
        assert h.started and h.num_tokens == 24 and h.wait(TIMEOUT) == 6
    finally:
        st.close()


def test_prefetch_best_effort_takes_what_has_arrived(tmp_path):
    hs = _stored_on_disk(tmp_path)
    st, fb = _prefetch_stack(tmp_path, "best_effort")
    try:
        gate = fb.gate("get", after=1)  # the first 2-block read passes, the rest is held
        h = st.prefetch(hs)
        assert gate.entered.wait(TIMEOUT)
        t0 = time.monotonic()
        assert h.wait() == 2  # at once, with what has arrived
        assert time.monotonic() - t0 < 1.0 and h.cancelled.is_set()
        gate.release()
        h._done.wait(TIMEOUT)
        assert h.fetched == 4  # the read in flight landed; the rest was not started
        assert where(st, hs) == ["HD"] * 4 + ["D"] * 2
        assert st.index.pinned == 0
    finally:
        st.close()


def test_prefetch_wait_complete_waits_for_everything(tmp_path):
    hs = _stored_on_disk(tmp_path)
    st, fb = _prefetch_stack(tmp_path, "wait_complete")
    try:
        fb.delay("get", 0.05)
        h = st.prefetch(hs)
        assert h.wait_s is None and h.wait() == 6
        assert where(st, hs) == ["HD"] * 6
        lr = st.load(hs, [10, 11, 12, 13, 14, 15]).wait(TIMEOUT)
        assert lr.num_loaded == 6 and lr.tiers == (Tier.HOST,) * 6
    finally:
        st.close()


def test_prefetch_timeout_stops_after_its_budget(tmp_path):
    hs = _stored_on_disk(tmp_path)
    st, fb = _prefetch_stack(tmp_path, "timeout", {"base_s": 0.2, "per_1k_tokens_s": 0.0, "max_s": 0.2})
    try:
        gate = fb.gate("get", after=1)
        h = st.prefetch(hs)
        assert h.wait_s == pytest.approx(0.2)
        assert gate.entered.wait(TIMEOUT)
        assert h.wait() == 2
        assert time.monotonic() - h._t0 >= 0.2
        gate.release()
    finally:
        st.close()


def test_prefetch_with_everything_in_memory_is_a_no_op(tmp_path):
    st, fb = _prefetch_stack(tmp_path, "wait_complete")
    try:
        hs = chain(st, 3)
        fill(st, [0, 1, 2], seed=5)
        st.store(hs, [0, 1, 2]).wait(TIMEOUT)
        h = st.prefetch(hs)
        assert not h.started and h.wait() == 3 and fb.calls["get"] == 0
    finally:
        st.close()


def test_timeout_formula_and_options():
    t = Timeout({"base_s": 1.0, "per_1k_tokens_s": 0.5, "max_s": 3.0})
    assert t.wait_seconds(0) == 1.0
    assert t.wait_seconds(2000) == 2.0
    assert t.wait_seconds(100_000) == 3.0
    assert Timeout().wait_seconds(4000) == 2.0  # defaults 1 + 0.25 * 4, capped at 3
    assert BestEffort().wait_seconds(10**6) == 0.0
    assert WaitComplete().wait_seconds(10**6) is None
    with pytest.raises(ValueError, match="max_s"):
        Timeout({"base_s": 2.0, "max_s": 1.0})


def test_policy_options_are_validated_by_the_config(tmp_path):
    with pytest.raises(ConfigError, match=r"policies.write.options.treshold: unknown key"):
        config(tmp_path, write="write_through_selective", write_options={"treshold": 2})
    with pytest.raises(ConfigError, match=r"policies.prefetch.options.base_s"):
        config(tmp_path, prefetch="timeout", prefetch_options={"base_s": -1})
    cfg = config(tmp_path, write="write_through_selective", write_options={"threshold": 5})
    assert cfg.policies.write.options.threshold == 5
    with pytest.raises(ValueError):
        WriteThrough({"anything": 1})


def test_builtins_are_registered_by_entry_point():
    want = {"write_policy": {"write_through": WriteThrough, "write_through_selective": WriteThroughSelective,
                             "write_back": WriteBack},
            "prefetch_policy": {"best_effort": BestEffort, "wait_complete": WaitComplete, "timeout": Timeout},
            "eviction_policy": {"lru": LRU}}
    bases = {"write_policy": WritePolicy, "prefetch_policy": PrefetchPolicy, "eviction_policy": EvictionPolicy}
    for kind, classes in want.items():
        for name, cls in classes.items():
            assert plugins.load(kind, name) is cls
            assert issubclass(cls, bases[kind])


# ---------------------------------------------------------------------- eviction


def test_lru_picks_least_recently_used_unpinned():
    idx = BlockIndex()
    keys = [bytes([i]) * 16 for i in range(5)]
    for i, k in enumerate(keys):
        idx.insert(k, host=i)
    idx.touch(keys[0])  # 0 is now the most recent
    idx.pin(keys[1])  # pinned: never a victim
    lru = LRU()
    assert lru.victims(idx, Tier.HOST, 3) == [keys[2], keys[3], keys[4]]
    assert lru.victims(idx, Tier.HOST, 10) == [keys[2], keys[3], keys[4], keys[0]]
    assert lru.victims(idx, Tier.HOST, 0) == []


def test_stack_evicts_in_lru_order(tmp_path):
    st, _ = make_stack(tmp_path, host_slots=3)
    try:
        a, b, c, d = (chain(st, 1, start=s) for s in (0, 100, 200, 300))
        fill(st, [0, 1, 2, 3], seed=6)
        for h, i in ((a, 0), (b, 1), (c, 2)):
            st.store(h, [i]).wait(TIMEOUT)
        assert st.flush(TIMEOUT)  # a block whose write-through is in flight is not evictable
        st.on_device_freed([0, 1, 2])
        st.load(a, [10]).wait(TIMEOUT)  # a is used again: b is now the least recently used
        st.store(d, [3]).wait(TIMEOUT)
        assert st.flush(TIMEOUT)
        assert where(st, a + b + c + d) == ["HD", "D", "HD", "HD"]
    finally:
        st.close()


def test_write_back_to_a_backend_refusing_everything_is_bounded(tmp_path):
    """A backend that refuses every write may hold at most ``max_unwritten`` host blocks hostage; past
    that, victims are evicted unwritten (counted ``dropped``) and new blocks keep landing in host memory."""
    st, fb = make_stack(tmp_path, write="write_back", host_slots=8)
    try:
        fb.fail("put")  # the disk refuses everything, from the start
        bound = st.planner.max_unwritten
        assert bound == 2
        statuses: list[str] = []  # StoreStatus members, which equal their names
        for i in range(24):
            fill(st, [i % 8], seed=i)
            statuses += st.store(chain(st, 1, start=1000 * i), [i % 8]).wait(TIMEOUT).status
        host = st.metrics.snapshot()["tiers"]["host"]
        # Without the bound, the 8 slots fill with unwritable blocks and every store after them is skipped.
        assert statuses[-8:].count("stored") >= 4, statuses
        assert host["dropped"] > 0
        assert st.metrics.snapshot()["gauges"]["host_unwritten_blocks"] <= bound + 1
    finally:
        st.close()
