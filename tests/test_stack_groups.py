"""``storage.block_tokens``: stored values of several engine blocks, on a real local_disk backend."""

from __future__ import annotations

import json
from pathlib import Path
from typing import cast

import pytest
import torch
from _stack_helpers import BLOCK, TIMEOUT, chain, config, fill, make_stack, read

from kvtier.config import ConfigError
from kvtier.format.groups import group_ends, group_of, whole_groups
from kvtier.index import BlockEntry, Tier
from kvtier.integrations.engine import CachedEngine

K = 4  # engine blocks per stored value


def _evict_memory(st) -> None:
    with st.planner.lock:
        for key in st.index.eviction_candidates(Tier.HOST, 10**6):
            st.planner.drop_host_locked(key)
    st.on_device_freed(range(st.device.num_blocks))


@pytest.fixture(params=[True, False], ids=["segments", "one-buffer"])
def grouped(tmp_path, request):
    """A grouped stack whose backend reads a value straight into its blocks' rows (segments: local_disk,
    Redis) or into one buffer first (S3's way)."""
    st, fb = make_stack(tmp_path, host_slots=16, storage={"block_tokens": K * BLOCK}, segments=request.param)
    yield st, fb
    fb.clear()
    st.close(timeout=TIMEOUT)


def _disk_values(st) -> list[str]:
    return sorted(b.key for b in st.backends[0].scan(st.namespace.id))


def test_group_arithmetic():
    assert group_ends(0, 0, 10, 4) == [3, 7] and group_ends(2, 0, 10, 4) == [1, 5, 9]
    assert group_ends(2, 3, 10, 4) == [5, 9] and group_ends(0, 0, 3, 4) == []
    assert group_of(2, 1, 4) == (-2, 1) and group_of(2, 2, 4) == (2, 5)
    assert whole_groups(2, 10, 4) == [(2, 5), (6, 9)] and whole_groups(0, 3, 4) == []


def test_whole_groups_are_one_value_each_under_their_last_key(grouped):
    st, _ = grouped
    hs = chain(st, 10)
    rows = fill(st, list(range(10)), seed=1)
    assert st.store(hs, list(range(10))).wait(TIMEOUT).num_stored == 10
    assert st.flush(TIMEOUT)
    # blocks 0-3 and 4-7 are two values named by blocks 3 and 7; the partial group 8-9 is not stored
    assert _disk_values(st) == sorted(st.namespace.keys([hs[3], hs[7]]))
    _evict_memory(st)
    lk = st.lookup(hs)
    assert lk.num_blocks == 8 and lk.counts == {"disk": 8}  # rounded down to whole groups
    lr = st.load(hs[:8], list(range(10, 18))).wait(TIMEOUT)
    assert lr.num_loaded == 8 and torch.equal(read(st, list(range(10, 18))), rows[:8])
    # the blocks came up into host memory one slot each
    assert all(st.index.get(h).host is not None for h in hs[:8])


def test_a_slice_that_starts_inside_a_group(grouped):
    st, _ = grouped
    hs = chain(st, 8)
    rows = fill(st, list(range(8)), seed=2)
    st.store(hs, list(range(8))).wait(TIMEOUT)
    st.flush(TIMEOUT)
    _evict_memory(st)
    # Blocks 0-4 are "on the device" for the caller: it asks from block 5 (group 4-7).
    lk = st.lookup(hs[5:], start=5)
    assert lk.num_blocks == 3
    lr = st.load(hs[5:], [20, 21, 22], start=5).wait(TIMEOUT)
    assert lr.num_loaded == 3 and torch.equal(read(st, [20, 21, 22]), rows[5:])
    # Without the position the slice's group ends are elsewhere: nothing is found in the backend.
    _evict_memory(st)
    assert st.lookup(hs[5:]).num_blocks == 0
    with pytest.raises(ValueError, match="start: expected the chain position"):
        st.lookup(hs, start=-1)


def test_a_corrupt_value_fails_its_whole_group_and_nothing_after(grouped):
    st, fb = grouped
    hs = chain(st, 12)
    rows = fill(st, list(range(12)), seed=3)
    st.store(hs, list(range(12))).wait(TIMEOUT)
    st.flush(TIMEOUT)
    _evict_memory(st)
    fb.corrupt(keys=[st.namespace.key(hs[7])])
    lr = st.load(hs, list(range(12, 24))).wait(TIMEOUT)
    assert lr.ok == (True,) * 4 + (False,) * 8
    assert torch.equal(read(st, [12, 13, 14, 15]), rows[:4])
    assert all(st.index.get(h) is None or st.index.get(h).host is None for h in hs[4:8])
    assert st.backends[0].stats().corrupt >= 1


def test_prefetch_brings_whole_groups_into_host_memory(tmp_path):
    st, _ = make_stack(tmp_path, faulty=False, host_slots=16, prefetch="wait_complete",
                       storage={"block_tokens": K * BLOCK})
    try:
        _prefetch(st)
    finally:
        st.close(timeout=TIMEOUT)


def _prefetch(st):
    hs = chain(st, 8)
    fill(st, list(range(8)), seed=4)
    st.store(hs, list(range(8))).wait(TIMEOUT)
    st.flush(TIMEOUT)
    _evict_memory(st)
    h = st.prefetch(hs)
    assert h.wait(TIMEOUT) == 8
    assert st.lookup(hs).counts == {"host": 8}


def test_no_host_tier_stores_whole_groups_from_the_device(tmp_path):
    st, _ = make_stack(tmp_path, faulty=False, host_slots=0, storage={"block_tokens": K * BLOCK})
    assert st.host is None
    try:
        hs = chain(st, 9)
        rows = fill(st, list(range(9)), seed=5)
        res = st.store(hs, list(range(9))).wait(TIMEOUT)
        assert st.flush(TIMEOUT)
        assert res.status[:8] == ("stored",) * 8 and res.status[8] == "skipped"
        assert _disk_values(st) == sorted(st.namespace.keys([hs[3], hs[7]]))
        st.on_device_freed(range(32))
        lr = st.load(hs[:8], list(range(16, 24))).wait(TIMEOUT)
        assert lr.num_loaded == 8 and torch.equal(read(st, list(range(16, 24))), rows[:8])
    finally:
        st.close(timeout=TIMEOUT)


def test_grouped_and_single_block_values_never_meet(tmp_path):
    one = config(tmp_path)
    four = config(tmp_path, storage={"block_tokens": K * BLOCK})
    assert one.namespace().id != four.namespace().id
    assert "storage_blocks" not in one.namespace().manifest()  # keys of ungrouped deployments unchanged
    assert four.namespace().manifest()["storage_blocks"] == K


def test_config_refuses_what_it_cannot_group(tmp_path):
    with pytest.raises(ConfigError, match=r"storage.block_tokens: expected a multiple of model.block_size \(4\), got 6"):
        config(tmp_path, storage={"block_tokens": 6})
    assert config(tmp_path, write="write_back", storage={"block_tokens": BLOCK}).storage_blocks == 1


def test_engine_prefill_then_decode_loads_whole_groups(tmp_path):
    # A prefill engine stores a prompt; a fresh decode engine (empty device and host) loads its whole
    # groups and computes the rest; its logits equal a run that computes everything.
    data = dict(model={"id": "test/engine", "kv_dtype": "float32", "num_layers": 2, "num_kv_heads": 2,
                       "head_dim": 16, "block_size": 16},
                device={"kind": "cpu", "num_blocks": 64}, host={"capacity": "4MiB", "pinned": False},
                backends=[{"name": "disk", "type": "local_disk", "options": {"path": str(tmp_path / "d")}}],
                storage={"block_tokens": 64})
    from kvtier.config import parse_config

    cfg = parse_config(data)
    prompt = torch.randint(0, 2048, (300,), generator=torch.Generator().manual_seed(0)).tolist()
    pre = CachedEngine.from_config(cfg)
    try:
        pre.run_request(prompt, max_new_tokens=2)
        pre.flush()
    finally:
        pre.close()
    dec = CachedEngine.from_config(cfg)
    base = CachedEngine.from_config(cfg)
    try:
        r = dec.run_request(prompt, max_new_tokens=4, keep_logits=True)
        # 300 tokens: 18 full blocks, 4 groups of 4 stored (16 blocks); 16 loaded, the rest computed
        assert r.loaded_blocks == {"disk": 16} and r.computed_tokens == 300 - 16 * 16
        ref = base.run_request(prompt, max_new_tokens=4, keep_logits=True, use_cache=False, store=False)
        assert r.tokens == ref.tokens
        assert r.step_logits is not None and ref.step_logits is not None  # keep_logits
        for a, b in zip(r.step_logits, ref.step_logits):
            assert torch.allclose(a, b, atol=1e-4, rtol=1e-4)
    finally:
        dec.close()
        base.close()


def test_write_back_writes_the_whole_group_of_an_evicted_block(tmp_path):
    st, _ = make_stack(tmp_path, faulty=False, host_slots=8, write="write_back",
                       storage={"block_tokens": K * BLOCK})
    try:
        hs = chain(st, 8)
        rows = fill(st, list(range(8)), seed=6)
        st.store(hs, list(range(8))).wait(TIMEOUT)
        assert st.flush(TIMEOUT) and _disk_values(st) == []  # write-back: nothing written yet
        # 4 more blocks need room: the 4 least recently used (group 0-3) are written back as one value
        other = chain(st, 4, start=500)
        fill(st, [8, 9, 10, 11], seed=7)
        assert st.store(other, [8, 9, 10, 11]).wait(TIMEOUT).num_stored == 4
        assert st.flush(TIMEOUT)
        assert _disk_values(st) == st.namespace.keys([hs[3]])
        assert all(st.index.get(h) is None or cast(BlockEntry, st.index.get(h)).host is None for h in hs[:4])
        _evict_memory(st)
        lr = st.load(hs[:4], [20, 21, 22, 23]).wait(TIMEOUT)
        assert lr.num_loaded == 4 and torch.equal(read(st, [20, 21, 22, 23]), rows[:4])
    finally:
        st.close(timeout=TIMEOUT)


def test_selective_write_writes_the_group_of_a_block_hit_often_enough(tmp_path):
    st, _ = make_stack(tmp_path, faulty=False, host_slots=16, write="write_through_selective",
                       write_options={"threshold": 2}, storage={"block_tokens": K * BLOCK})
    try:
        hs = chain(st, 8)
        fill(st, list(range(8)), seed=8)
        st.store(hs, list(range(8))).wait(TIMEOUT)
        assert st.flush(TIMEOUT) and _disk_values(st) == []
        for _ in range(2):  # the first group's blocks are hit twice (loads from host memory)
            st.on_device_freed(range(32))
            assert st.load(hs[:4], [12, 13, 14, 15]).wait(TIMEOUT).num_loaded == 4
        assert st.flush(TIMEOUT)
        assert _disk_values(st) == st.namespace.keys([hs[3]])
    finally:
        st.close(timeout=TIMEOUT)


def test_sglang_refuses_values_of_several_pages():
    from kvtier.integrations.sglang.store import PageStore

    cfg = config(Path("/nonexistent"), storage={"block_tokens": K * BLOCK})
    with pytest.raises(ValueError, match=rf"storage.block_tokens must be null or model.block_size \(the page size, "
                                         rf"{BLOCK}\) with SGLang, got {K * BLOCK}"):
        PageStore(cfg, None)  # type: ignore[arg-type]


def test_plans_and_stack_refuse_a_negative_chain_position(grouped):
    from kvtier.plans import LoadPlan

    st, _ = grouped
    with pytest.raises(ValueError, match="load plan for 'r': start must be >= 0, got -2"):
        LoadPlan("r", (b"x" * 32,), (1,), -2)
    for call in (lambda: st.load(chain(st, 1), [0], start=-1), lambda: st.store(chain(st, 1), [0], start=True),
                 lambda: st.prefetch(chain(st, 1), start="0")):
        with pytest.raises(ValueError, match="start: expected the chain position of hashes"):
            call()


def test_engine_refuses_more_hashes_than_full_blocks(tmp_path):
    from kvtier.config import parse_config

    cfg = parse_config(dict(model={"id": "t", "kv_dtype": "float32", "num_layers": 1, "num_kv_heads": 1,
                                   "head_dim": 16, "block_size": 16},
                            device={"kind": "cpu", "num_blocks": 16}, host={"capacity": "0"}))
    eng = CachedEngine.from_config(cfg)
    try:
        with pytest.raises(ValueError, match="3 block hashes for a prompt of 40 tokens \\(at most 2 full blocks of 16\\)"):
            eng.run_request([1] * 40, hashes=[b"h" * 32] * 3, max_new_tokens=1)
    finally:
        eng.close()


def test_backend_faults_in_grouped_reads_and_writes_are_misses_and_skipped_stores(grouped):
    st, fb = grouped
    hs = chain(st, 8)
    rows = fill(st, list(range(8)), seed=9)
    fb.fail("put")
    res = st.store(hs, list(range(8))).wait(TIMEOUT)  # host memory takes them; the backend refuses
    assert res.num_stored == 8 and st.flush(TIMEOUT)
    assert _disk_values(st) == [] and st.metrics.snapshot()["tiers"]["disk"]["failures"] >= 1
    fb.clear()
    # The stack goes on: the next store of the same blocks (host copies gone) reaches the disk.
    _evict_memory(st)
    fill(st, list(range(8)), seed=9)
    assert st.store(hs, list(range(8))).wait(TIMEOUT).num_stored == 8 and st.flush(TIMEOUT)
    assert _disk_values(st) == sorted(st.namespace.keys([hs[3], hs[7]]))
    _evict_memory(st)
    fb.fail("get")
    lr = st.load(hs, list(range(10, 18))).wait(TIMEOUT)  # every read fails: all recomputed, no exception
    assert lr.num_loaded == 0 and lr.recompute == list(range(10, 18))
    fb.clear()
    lr = st.load(hs, list(range(10, 18))).wait(TIMEOUT)
    assert lr.num_loaded == 8 and torch.equal(read(st, list(range(10, 18))), rows)


def test_grouped_write_back_with_a_failing_backend_keeps_the_stack_going(tmp_path):
    st, fb = make_stack(tmp_path, host_slots=8, write="write_back", storage={"block_tokens": K * BLOCK})
    try:
        hs = chain(st, 8)
        fill(st, list(range(8)), seed=10)
        st.store(hs, list(range(8))).wait(TIMEOUT)
        fb.fail("put")
        other = chain(st, 4, start=700)
        fill(st, [8, 9, 10, 11], seed=11)
        res = st.store(other, [8, 9, 10, 11]).wait(TIMEOUT)  # eviction needs a write-back that fails
        assert st.flush(TIMEOUT) and res.num_stored + res.num_skipped == 4
        assert _disk_values(st) == []
        fb.clear()
        assert st.lookup(hs).num_blocks >= 4  # nothing lost: the unwritten blocks are still in host memory
    finally:
        fb.clear()
        st.close(timeout=TIMEOUT)


def test_bench_prefix_reads_one_value_per_group_beside_its_raw_ceiling(tmp_path, capsys):
    from kvtier.tools.cli import main

    out = tmp_path / "prefix.json"
    assert main(["bench", "prefix", "--backends", "disk", "--tokens", "256", "--repeats", "1", "--layers", "1",
                 "--kv-heads", "1", "--head-dim", "16", "--block-tokens", "16,64", "--json", str(out)]) == 0
    rows = json.loads(out.read_text())["rows"]
    assert [(r["block_tokens"], r["values_read"]) for r in rows] == [(16, 16), (64, 4)]
    assert all(r["raw_ms"] > 0 and r["load_vs_raw"] > 0 for r in rows)
    assert "load_vs_raw" in capsys.readouterr().out


@pytest.mark.parametrize("segments", [True, False], ids=["segments", "one-buffer"])
def test_values_load_exactly_when_host_memory_holds_few_of_their_blocks(tmp_path, segments):
    """3 values of 4 blocks and room for 4 in host memory: the blocks without a slot are read into
    temporary rows and still land exactly; no slot is left reserved.  A value whose read fails gives the
    slots reserved for its blocks back."""
    st, fb = make_stack(tmp_path, host_slots=4, storage={"block_tokens": K * BLOCK}, segments=segments)
    try:
        hs = chain(st, 12)
        rows = fill(st, list(range(12)), seed=5)
        for a in (0, 4, 8):  # one value at a time: host memory holds one value's blocks
            st.store(hs[a:a + 4], list(range(a, a + 4)), start=a).wait(TIMEOUT)
            assert st.flush(TIMEOUT)
            _evict_memory(st)
        assert _disk_values(st) == sorted(st.namespace.keys([hs[3], hs[7], hs[11]]))
        host = st.host_tier()
        lr = st.load(hs, list(range(12, 24))).wait(TIMEOUT)
        assert lr.num_loaded == 12 and torch.equal(read(st, list(range(12, 24))), rows)
        assert all(host.state(s).value != "writing" for s in range(host.num_slots))
        _evict_memory(st)
        fb.corrupt(keys=[st.namespace.key(hs[3])])  # the first value (the one given slots) fails its checksum
        lr = st.load(hs, list(range(12, 24))).wait(TIMEOUT)
        assert lr.num_loaded == 0
        assert all(host.state(s).value != "writing" for s in range(host.num_slots))
    finally:
        fb.clear()
        st.close(timeout=TIMEOUT)


def test_a_cpu_load_reads_each_value_straight_into_the_kv_tensors(tmp_path):
    """host.promote_loads false with values of several blocks: a load into CPU KV tensors reads each value
    into the tensor rows of its blocks (a block of it the load does not want, into a temporary row),
    verified whole there and never in host memory.  A corrupt value is never served: its blocks and every
    one after them are recomputed, and the values before it hold their exact bytes."""
    from kvtier.format.blockformat import HEADER_SIZE

    st, _ = make_stack(tmp_path, faulty=False, host_slots=16, storage={"block_tokens": K * BLOCK})
    hs = chain(st, 12)
    rows = fill(st, list(range(12)), seed=41)
    assert st.store(hs, list(range(12))).wait(TIMEOUT).num_stored == 12 and st.flush(TIMEOUT)
    st.close(timeout=TIMEOUT)
    decode, _ = make_stack(tmp_path, faulty=False, num_blocks=48, storage={"block_tokens": K * BLOCK},
                           host={"capacity": 16 * st.layout.block_nbytes, "promote_loads": False})
    try:
        assert decode.direct_loads == [True]
        # From block 5: the value of blocks 4-7 is read whole, block 4 into a temporary row.
        lr = decode.load(hs[5:], list(range(20, 27)), start=5).wait(TIMEOUT)
        assert lr.num_loaded == 7 and set(lr.tiers) == {Tier.backend(0)}
        assert torch.equal(read(decode, list(range(20, 27))), rows[5:])
        assert all(e is None or e.host is None for e in map(decode.index.get, hs))  # never in host memory
        decode.on_device_freed(list(range(20, 27)))
        key = decode.namespace.key(hs[11])  # the value of blocks 8-11
        path = tmp_path / "disk" / key[:32] / key[33:35] / key[33:]
        data = bytearray(path.read_bytes())
        data[HEADER_SIZE + 3 * decode.layout.block_nbytes + 5] ^= 0xFF  # one payload byte of block 11
        path.write_bytes(bytes(data))
        lr = decode.load(hs, list(range(30, 42))).wait(TIMEOUT)
        assert lr.num_loaded == 8 and lr.recompute == list(range(38, 42))
        assert torch.equal(read(decode, list(range(30, 38))), rows[:8])
        assert decode.backends[0].stats().corrupt == 1 and not path.exists()
    finally:
        decode.close(timeout=TIMEOUT)
