"""The tier stack on a real local_disk backend: store / lookup / prefetch / load, pinning, promotion,
failures that never reach the engine (FaultyBackend), a full host tier, concurrency, manifests."""

from __future__ import annotations

import copy
import os
import random
import threading
import time

import pytest
import torch
from _stack_helpers import BLOCK_NBYTES, TIMEOUT, chain, config, fill, make_stack, read, where

from kvtier.backend_api import BackendTimeout, BackendUnavailable
from kvtier.backends.local_disk import LocalDiskBackend
from kvtier.format.blockformat import HEADER_SIZE
from kvtier.format.groups import load_chunks
from kvtier.format.layout import LayoutError
from kvtier.index import Tier
from kvtier.simulate.ledger_stack import SimulatedStack
from kvtier.stack import StoreStatus, TierStack
from kvtier.testing.faults import FaultyBackend
from kvtier.tiering.results import FAILED, STORED


@pytest.fixture
def stack_fb(tmp_path):
    st, fb = make_stack(tmp_path)
    yield st, fb
    fb.clear()
    st.close(timeout=TIMEOUT)


@pytest.fixture
def stack_fb8(tmp_path):
    """``stack_fb`` with 8 host slots: room for a whole 6-block load."""
    st, fb = make_stack(tmp_path, host_slots=8)
    yield st, fb
    fb.clear()
    st.close(timeout=TIMEOUT)


def test_store_lookup_load_round_trip(stack_fb):
    st, _ = stack_fb
    hs = chain(st, 4)
    rows = fill(st, [0, 1, 2, 3], seed=1)
    res = st.store(hs, [0, 1, 2, 3]).wait(TIMEOUT)
    assert res.num_stored == 4
    assert st.flush(TIMEOUT)
    lk = st.lookup(hs)
    assert lk.num_blocks == 4 and lk.tiers == (Tier.DEVICE,) * 4 and lk.num_tokens == 16
    assert lk.counts == {"device": 4}  # by the deployment's names, for people
    st.on_device_freed([0, 1, 2, 3])
    assert st.lookup(hs).counts == {"host": 4}
    lr = st.load(hs, [10, 11, 12, 13]).wait(TIMEOUT)
    assert lr.ok == (True,) * 4 and lr.num_loaded == 4 and lr.recompute == [] and lr.tiers == (Tier.HOST,) * 4
    assert torch.equal(read(st, [10, 11, 12, 13]), rows)
    assert where(st, hs) == ["HD"] * 4
    # The index now says the blocks are in device blocks 10..13.
    assert [st.index.get(h).device for h in hs] == [10, 11, 12, 13]


def test_lookup_is_a_prefix_and_unknown_blocks_miss(stack_fb):
    st, _ = stack_fb
    hs = chain(st, 6)
    fill(st, [0, 1, 2], seed=2)
    st.store(hs[:3], [0, 1, 2]).wait(TIMEOUT)
    st.flush(TIMEOUT)
    st.on_device_freed(range(32))
    assert st.lookup(hs).num_blocks == 3
    other = chain(st, 3, start=1000)
    assert st.lookup(other).num_blocks == 0
    lr = st.load(other, [5, 6, 7]).wait(TIMEOUT)
    assert lr.num_loaded == 0 and lr.recompute == [5, 6, 7] and lr.tiers == (None,) * 3


def test_load_bigger_than_host_memory_goes_through_temporary_rows(stack_fb):
    # 4 host slots hold blocks 2..5; blocks 0 and 1 are only on disk.  Loading all 6 pins 2..5, so 0 and 1
    # find no host slot: they are read into temporary rows and written to the device from there, and say
    # they came from the disk.  Nothing fails for lack of host room.
    st, _ = stack_fb
    hs = chain(st, 6)
    rows = fill(st, list(range(6)), seed=7)
    st.store(hs[:4], [0, 1, 2, 3]).wait(TIMEOUT)
    st.flush(TIMEOUT)
    st.store(hs[4:], [4, 5], start=4).wait(TIMEOUT)
    st.flush(TIMEOUT)
    st.on_device_freed(range(32))
    assert where(st, hs) == ["D", "D", "HD", "HD", "HD", "HD"]
    lr = st.load(hs, [20, 21, 22, 23, 24, 25]).wait(TIMEOUT)
    assert lr.num_loaded == 6 and lr.tiers == (Tier.backend(0),) * 2 + (Tier.HOST,) * 4
    assert torch.equal(read(st, [20, 21, 22, 23, 24, 25]), rows)
    assert where(st, hs)[:2] == ["D", "D"]  # read through temporary rows, not kept in host memory


def test_load_promotes_backend_blocks_into_host(stack_fb):
    st, _ = stack_fb
    hs = chain(st, 3)
    rows = fill(st, [0, 1, 2], seed=3)
    st.store(hs, [0, 1, 2]).wait(TIMEOUT)
    st.flush(TIMEOUT)
    # Push them out of host memory (4 slots) with 4 other blocks.
    fill(st, [4, 5, 6, 7], seed=4)
    st.store(chain(st, 4, start=500), [4, 5, 6, 7]).wait(TIMEOUT)
    st.flush(TIMEOUT)
    st.on_device_freed(range(32))
    assert where(st, hs) == ["D"] * 3
    assert st.lookup(hs).counts == {"disk": 3}
    lr = st.load(hs, [20, 21, 22]).wait(TIMEOUT)
    assert lr.num_loaded == 3 and lr.tiers == (Tier.backend(0),) * 3
    assert torch.equal(read(st, [20, 21, 22]), rows)
    assert where(st, hs) == ["HD"] * 3  # promoted: now also in host
    st.on_device_freed(range(32))
    assert st.lookup(hs).counts == {"host": 3}


def prefilled(tmp_path, n: int, seed: int) -> tuple[list[bytes], torch.Tensor]:
    """A prefill stack stored ``n`` random blocks on the disk in tmp_path and closed: their keys, payloads."""
    prefill = TierStack(config(tmp_path, host_slots=8))
    hs = chain(prefill, n)
    rows = fill(prefill, list(range(n)), seed=seed)
    prefill.store(hs, list(range(n))).wait(TIMEOUT)
    assert prefill.flush(TIMEOUT)
    prefill.close()
    return hs, rows


def test_decode_instance_loads_what_a_prefill_instance_stored(tmp_path):
    """P/D: two stacks share a disk; the second knows nothing but the keys."""
    hs, rows = prefilled(tmp_path, 5, seed=5)
    decode = TierStack(config(tmp_path, backends=[
        {"name": "disk", "type": "local_disk", "write": False, "options": {"path": str(tmp_path / "disk")}}]))
    try:
        assert decode.lookup(hs).counts == {"disk": 5}
        lr = decode.load(hs, [9, 8, 7, 6, 5]).wait(TIMEOUT)
        assert lr.num_loaded == 5
        assert torch.equal(read(decode, [9, 8, 7, 6, 5]), rows)
        # A read-only backend is never written to (host has 4 slots: one block did not fit, no write-back).
        assert decode.stats()["tiers"]["disk"]["bytes_in"] == 0
    finally:
        decode.close()


def test_host_full_of_pinned_blocks_skips_and_counts_never_waits(stack_fb):
    st, fb = stack_fb
    gate = fb.gate("put")  # write-through puts hang: the 4 stored blocks stay pinned (in flight)
    hs = chain(st, 4)
    rows = fill(st, [0, 1, 2, 3], seed=6)
    assert st.store(hs, [0, 1, 2, 3]).wait(TIMEOUT).num_stored == 4
    assert gate.entered.wait(TIMEOUT)
    more = chain(st, 2, start=300)
    fill(st, [4, 5], seed=7)
    t0 = time.monotonic()
    res = st.store(more, [4, 5]).wait(TIMEOUT)
    assert time.monotonic() - t0 < 2.0
    assert res.status == ("skipped", "skipped")
    assert st.metrics.snapshot()["tiers"]["host"]["stores_skipped"] == 2
    assert not st.flush(0.05)  # the gated writes are still pending
    # The pinned blocks were not evicted and their bytes are intact.
    assert where(st, hs) == ["H"] * 4
    st.on_device_freed([0, 1, 2, 3])
    assert st.load(hs, [10, 11, 12, 13]).wait(TIMEOUT).num_loaded == 4
    assert torch.equal(read(st, [10, 11, 12, 13]), rows)
    gate.release()
    assert st.flush(TIMEOUT)
    # Unpinned now: a new store evicts the least recently used instead of skipping.
    res = st.store(more, [4, 5]).wait(TIMEOUT)
    assert res.num_stored == 2
    assert st.metrics.snapshot()["tiers"]["host"]["evictions"] == 2


def test_blocks_being_loaded_are_not_evicted(stack_fb):
    st, _ = stack_fb
    hs = chain(st, 4)
    rows = fill(st, [0, 1, 2, 3], seed=8)
    st.store(hs, [0, 1, 2, 3]).wait(TIMEOUT)
    st.flush(TIMEOUT)
    st.on_device_freed(range(32))
    release = threading.Event()
    st.transfers().layer_hook = lambda direction, layer: release.wait(TIMEOUT) if direction == "load" else None
    h = st.load(hs, [10, 11, 12, 13], layerwise=True)
    assert h.wait_layer(0, timeout=TIMEOUT)  # layer 0 landed while layer 1 is held
    assert not h.done()
    # The host slots are pinned by the load: a store finds nothing to evict.
    fill(st, [4, 5], seed=9)
    res = st.store(chain(st, 2, start=77), [4, 5]).wait(TIMEOUT)
    assert res.num_skipped == 2
    release.set()
    lr = h.wait(TIMEOUT)
    assert lr.num_loaded == 4 and h.wait_layer(1, timeout=TIMEOUT)
    assert torch.equal(read(st, [10, 11, 12, 13]), rows)


def test_a_full_disk_never_evicts_what_a_load_is_about_to_read(tmp_path):
    """A load holds the keys it will read in the backends: a store meanwhile, on a full local_disk, is
    refused rather than evicting them under the load (before: the blocks went, the load failed at block
    0 and the engine recomputed the whole prefix); once the load has read them, they can go."""
    disk = LocalDiskBackend({"path": str(tmp_path / "disk"), "capacity": 4 * (HEADER_SIZE + BLOCK_NBYTES)},
                            name="disk")
    fb = FaultyBackend(disk)
    st = TierStack(config(tmp_path, host_slots=0), backends=[fb])  # no host tier: stores go to the disk
    try:
        hs = chain(st, 4)
        rows = fill(st, [0, 1, 2, 3], seed=21)
        assert st.store(hs, [0, 1, 2, 3]).wait(TIMEOUT).num_stored == 4
        st.on_device_freed(range(32))
        gate = fb.gate("get", times=1)
        h = st.load(hs, [10, 11, 12, 13])
        assert gate.entered.wait(TIMEOUT)  # the load's read has begun and waits
        fill(st, [4, 5], seed=22)
        other = chain(st, 2, start=77)
        assert st.store(other, [4, 5]).wait(TIMEOUT).num_stored == 0  # no room but the held blocks
        assert disk.exists(st.namespace.keys(hs)) == [True] * 4
        gate.release()
        lr = h.wait(TIMEOUT)
        assert lr.num_loaded == 4 and torch.equal(read(st, [10, 11, 12, 13]), rows)
        assert st.store(other, [4, 5]).wait(TIMEOUT).num_stored == 2  # the load is done: LRU as usual
        assert disk.exists(st.namespace.keys(hs)) == [False, False, True, True]
    finally:
        fb.clear()
        st.close(timeout=TIMEOUT)


def test_corrupt_read_cuts_the_prefix_and_names_blocks_to_recompute(stack_fb):
    st, fb = stack_fb
    hs, rows = _on_disk_only(st, 4, seed=10)
    fb.corrupt(keys=[st.namespace.key(hs[2])])
    lr = st.load(hs, [10, 11, 12, 13]).wait(TIMEOUT)
    assert lr.ok == (True, True, False, False) and lr.num_loaded == 2
    assert lr.recompute == [12, 13] and lr.recompute_indices == [2, 3]
    # Block 3 chains through block 2: it is not reported copied (its verified bytes went into host memory,
    # and into its device block as they were read; the engine recomputes that block).
    assert lr.copied == (True, True, False, False) and where(st, hs)[3] == "HD"
    assert torch.equal(read(st, [10, 11]), rows[:2])
    assert st.index.get(hs[3]).device is None  # never recorded as loaded
    assert fb.stats().corrupt >= 1


def test_load_copies_each_chunk_to_the_device_while_the_next_is_read(stack_fb8):
    st, fb = stack_fb8
    hs, rows = _on_disk_only(st, 6, seed=12)
    st.load_chunk_bytes = 8 * BLOCK_NBYTES  # reads start at a quarter of it and double: 0-1, then 2-5
    assert load_chunks(6, BLOCK_NBYTES, st.load_chunk_bytes) == [(0, 2), (2, 6)]
    gate = fb.gate("get", after=1, times=1)  # the second chunk's read waits
    h = st.load(hs, [10, 11, 12, 13, 14, 15])
    assert gate.entered.wait(TIMEOUT)
    # The first chunk is on the device while the second is still being read.
    deadline = time.monotonic() + TIMEOUT
    while not torch.equal(read(st, [10, 11]), rows[:2]) and time.monotonic() < deadline:
        time.sleep(0.01)
    assert torch.equal(read(st, [10, 11]), rows[:2]) and not h.done()
    gate.release()
    lr = h.wait(TIMEOUT)
    assert lr.num_loaded == 6 and lr.copied == (True,) * 6
    assert torch.equal(read(st, list(range(10, 16))), rows)


def test_a_chunked_loads_blocks_go_to_the_slots_named_before_its_first_read(tmp_path):
    """Write-back, 5 host slots: 4 dirty blocks (least recently used first) and a fifth.  A load of 4
    blocks from the disk, read in 3 chunks, names its room before its first read: the dirty blocks'
    slots, each copied down only when its chunk needs it.  A slot freed while the second chunk is read
    (the fifth block evicted) does not change where the third chunk's block goes."""
    writer, _ = make_stack(tmp_path / "w", disk_path=tmp_path / "disk")
    hs, rows = _on_disk_only(writer, 4, seed=31)
    writer.close(timeout=TIMEOUT)
    st, fb = make_stack(tmp_path, host_slots=5, write="write_back", disk_path=tmp_path / "disk")
    try:
        dirty, fifth = chain(st, 4, start=1000), chain(st, 1, start=5000)
        fill(st, [0, 1, 2, 3, 4], seed=32)
        assert st.store(dirty, [0, 1, 2, 3]).wait(TIMEOUT).num_stored == 4
        assert st.store(fifth, [4]).wait(TIMEOUT).num_stored == 1
        st.on_device_freed(range(st.device.num_blocks))
        slot_of = [st.index.host_slot(h) for h in dirty]
        assert where(st, dirty + fifth) == ["H"] * 5  # write-back: nothing written yet
        st.load_chunk_bytes = 4 * BLOCK_NBYTES
        assert load_chunks(4, BLOCK_NBYTES, st.load_chunk_bytes) == [(0, 1), (1, 3), (3, 4)]
        gate = fb.gate("get", after=1, times=1)  # the second chunk's read waits
        h = st.load(hs, [10, 11, 12, 13])
        assert gate.entered.wait(TIMEOUT)
        # The first two chunks' victims are written back and gone from host memory; the third's is not.
        assert where(st, dirty) == ["D", "D", "D", "H"]
        assert st.evict_host(fifth) == 1  # a free slot now, which the plan did not name
        gate.release()
        lr = h.wait(TIMEOUT)
        assert lr.num_loaded == 4 and torch.equal(read(st, [10, 11, 12, 13]), rows)
        assert [st.index.host_slot(h) for h in hs] == slot_of  # the slots named before the first read
        assert where(st, dirty) == ["D"] * 4
        with st.planner.lock:
            st.planner.check_locked()
        assert st.host_tier().num_free == 1  # the fifth block's
    finally:
        fb.clear()
        st.close(timeout=TIMEOUT)


@pytest.mark.parametrize("layout,batches", [("cpu_attn", 0), ("flash_attn", 1)])
def test_a_load_into_head_major_cpu_memory_copies_each_block_in_the_thread_that_read_it(tmp_path, layout, batches):
    """Into head-major CPU KV (a rearranging copy), a block read from a backend is copied to its device
    block as soon as its read is verified (no host -> device transfer afterwards); into a layout whose
    blocks are whole rows, the load's one batched copy moves them.  Either way each block also lands in
    host memory, and a block the wrapper fails (corrupt) is neither reported copied nor served."""
    st, fb = make_stack(tmp_path, host_slots=8, layout=layout)
    try:
        _reads_then_corrupt(st, fb, batches)
    finally:
        fb.clear()
        st.close(timeout=TIMEOUT)


def _reads_then_corrupt(st, fb, batches: int) -> None:
    hs, rows = _on_disk_only(st, 6, seed=14)
    before = st.transfers().stats()["loads"]
    lr = st.load(hs, [10, 11, 12, 13, 14, 15]).wait(TIMEOUT)
    assert lr.num_loaded == 6 and lr.copied == (True,) * 6
    assert torch.equal(read(st, list(range(10, 16))), rows)
    assert st.transfers().stats()["loads"] == before + batches  # none: every block landed as read
    assert where(st, hs) == ["HD"] * 6
    _evict_host(st)
    fb.corrupt(keys=[st.namespace.key(hs[4])])
    lr = st.load(hs, [20, 21, 22, 23, 24, 25]).wait(TIMEOUT)
    assert lr.ok == (True,) * 4 + (False,) * 2 and lr.copied == (True,) * 4 + (False,) * 2
    assert torch.equal(read(st, [20, 21, 22, 23]), rows[:4])


def test_a_failed_chunk_ends_the_prefix_and_later_chunks_are_not_read(stack_fb8):
    st, fb = stack_fb8
    hs, rows = _on_disk_only(st, 6, seed=13)
    st.load_chunk_bytes = 4 * BLOCK_NBYTES
    assert load_chunks(6, BLOCK_NBYTES, st.load_chunk_bytes) == [(0, 1), (1, 3), (3, 6)]
    fb.corrupt(keys=[st.namespace.key(hs[2])])
    lr = st.load(hs, [10, 11, 12, 13, 14, 15]).wait(TIMEOUT)
    assert lr.ok == (True,) * 2 + (False,) * 4 and lr.copied == (True,) * 2 + (False,) * 4
    assert torch.equal(read(st, [10, 11]), rows[:2])
    # The third chunk was never read: its blocks did not come into host memory.
    assert [st.index.get(h) is not None and st.index.get(h).host is not None for h in hs[3:]] == [False] * 3


def test_a_cpu_load_from_local_disk_reads_each_block_straight_into_the_kv_tensors(tmp_path):
    """host.promote_loads false, and local_disk reads segments: a load into CPU KV tensors reads each
    block's value into the tensor rows that hold it (no host-memory copy; the page cache keeps it),
    verifies it there, and reports it loaded from the disk.  A corrupt block in the middle: it and every block after it are recomputed, never
    reported loaded, and the blocks before it hold their exact bytes."""
    hs, rows = prefilled(tmp_path, 5, seed=21)
    default = TierStack(config(tmp_path, host_slots=8))
    assert default.direct_loads == [False]  # the default: loaded blocks land in host memory too
    default.close()
    decode = TierStack(config(tmp_path, host_slots=8, host={"capacity": 8 * BLOCK_NBYTES, "promote_loads": False}))
    try:
        assert decode.direct_loads == [True]
        lr = decode.load(hs, [9, 8, 7, 6, 5]).wait(TIMEOUT)
        assert lr.num_loaded == 5 and set(lr.tiers) == {Tier.backend(0)}
        assert torch.equal(read(decode, [9, 8, 7, 6, 5]), rows)
        assert where(decode, hs) == ["D"] * 5  # not copied into host memory
        assert decode.stats()["tiers"]["device"]["bytes_in"] == 5 * BLOCK_NBYTES
        decode.on_device_freed([9, 8, 7, 6, 5])
        key = decode.namespace.key(hs[2])
        path = tmp_path / "disk" / key[:32] / key[33:35] / key[33:]
        data = bytearray(path.read_bytes())
        data[HEADER_SIZE + 7] ^= 0xFF  # one payload byte
        path.write_bytes(bytes(data))
        lr = decode.load(hs, [20, 21, 22, 23, 24]).wait(TIMEOUT)
        assert lr.num_loaded == 2 and lr.recompute == [22, 23, 24]
        assert torch.equal(read(decode, [20, 21]), rows[:2])
        assert decode.backends[0].stats().corrupt == 1 and not path.exists()
    finally:
        decode.close()


def test_backend_faults_on_a_straight_load_are_misses_never_served(tmp_path):
    """host.promote_loads false: a load reading straight into CPU KV tensors meets a failing backend (a
    miss: the blocks are recomputed, the engine goes on) and a value gone bad after its read checked it
    (never reported loaded); then, the faults cleared, the same load delivers every block exactly."""
    hs, rows = prefilled(tmp_path, 4, seed=31)
    st, fb = make_stack(tmp_path, host={"capacity": 8 * BLOCK_NBYTES, "promote_loads": False})
    assert fb is not None
    try:
        assert st.direct_loads == [True]
        fb.fail("get", BackendUnavailable, times=1)
        lr = st.load(hs, [10, 11, 12, 13]).wait(TIMEOUT)
        assert lr.num_loaded == 0 and lr.recompute == [10, 11, 12, 13]
        st.on_device_freed([10, 11, 12, 13])
        fb.corrupt(keys=st.namespace.keys(hs[1:2]), times=1)
        lr = st.load(hs, [10, 11, 12, 13]).wait(TIMEOUT)
        assert lr.num_loaded == 1 and lr.recompute == [11, 12, 13]
        st.on_device_freed([10, 11, 12, 13])
        fb.clear()
        lr = st.load(hs, [10, 11, 12, 13]).wait(TIMEOUT)
        assert lr.num_loaded == 4 and torch.equal(read(st, [10, 11, 12, 13]), rows)
    finally:
        st.close()


def test_corrupt_file_on_disk_is_a_miss(tmp_path):
    st, _ = make_stack(tmp_path, faulty=False)
    try:
        hs = chain(st, 2)
        fill(st, [0, 1], seed=11)
        st.store(hs, [0, 1]).wait(TIMEOUT)
        st.flush(TIMEOUT)
        _evict_host(st)
        key = st.namespace.key(hs[0])
        path = tmp_path / "disk" / key[:32] / key[33:35] / key[33:]
        data = bytearray(path.read_bytes())
        data[-5] ^= 0xFF  # one payload byte
        path.write_bytes(bytes(data))
        lr = st.load(hs, [5, 6]).wait(TIMEOUT)
        assert lr.num_loaded == 0 and lr.recompute == [5, 6]
        assert st.backends[0].stats().corrupt == 1
    finally:
        st.close()


def test_backend_errors_never_reach_the_engine(stack_fb):
    st, fb = stack_fb
    hs = chain(st, 3)
    fill(st, [0, 1, 2], seed=12)
    # store: write-through put fails -> skipped store + metric; the blocks stay in host.
    fb.fail("put", BackendUnavailable, times=1)
    assert st.store(hs, [0, 1, 2]).wait(TIMEOUT).num_stored == 3
    assert st.flush(TIMEOUT)
    snap = st.metrics.snapshot()["tiers"]["disk"]
    assert snap["failures"] == 1 and snap["stores_skipped"] == 3
    assert where(st, hs) == ["H"] * 3
    # lookup: contains fails -> 0 hits from the backend + metric.
    _evict_host(st)
    fb.fail("contains", BackendTimeout, times=1)
    assert st.lookup(hs).num_blocks == 0
    assert st.metrics.snapshot()["tiers"]["disk"]["failures"] == 2
    # load: get fails -> miss + recompute + metric (the blocks are not on disk here anyway, so store
    # them properly first).
    rows = fill(st, [0, 1, 2], seed=13)
    st.store(hs, [0, 1, 2]).wait(TIMEOUT)
    # (present in host? no: evicted; stored again)
    assert st.flush(TIMEOUT)
    _evict_host(st)
    fb.fail("get", BackendUnavailable, times=1)
    lr = st.load(hs, [4, 5, 6]).wait(TIMEOUT)
    assert lr.num_loaded == 0 and lr.recompute == [4, 5, 6]
    assert st.metrics.snapshot()["tiers"]["disk"]["failures"] == 3
    # and the next load works
    lr = st.load(hs, [4, 5, 6]).wait(TIMEOUT)
    assert lr.num_loaded == 3 and torch.equal(read(st, [4, 5, 6]), rows)


def test_a_backend_back_from_an_outage_is_not_trusted_to_hold_its_old_blocks(tmp_path):
    """A server that answers again after an outage may have come back empty (a restarted Redis keeps
    nothing).  The index stops marking it as holding its old blocks at its first full answer: else
    write-back, which writes only blocks the index does not mark as stored, would never write them
    again, and they would be lost to every tier once out of host memory."""
    st, fb = make_stack(tmp_path, write="write_back")  # 4 host slots
    try:
        hs, other = chain(st, 3), chain(st, 4, start=1000)

        def written_back() -> list[str]:
            """Store hs, then push it out of host memory with 4 other blocks (write-back writes it)."""
            fill(st, [0, 1, 2], seed=21)
            st.store(hs, [0, 1, 2]).wait(TIMEOUT)
            fill(st, [3, 4, 5, 6], seed=22)
            st.store(other, [3, 4, 5, 6]).wait(TIMEOUT)
            assert st.flush(TIMEOUT)
            st.on_device_freed(range(7))
            return where(st, hs)

        assert written_back() == ["D"] * 3 and st.index.count(Tier.backend(0)) == 3
        # The outage: calls fail, and the server loses what it held.
        fb.fail("*", BackendUnavailable)
        assert st.lookup(hs).num_blocks == 0
        fb.inner.delete(st.namespace.keys(hs))
        fb.clear()
        assert st.index.count(Tier.backend(0)) == 3  # nothing answered yet: still believed
        assert st.lookup(chain(st, 2, start=5000)).num_blocks == 0  # the first full answer
        assert st.index.count(Tier.backend(0)) == 0
        # The blocks are computed again, and write-back stores them again.
        _evict_host(st)
        assert written_back() == ["D"] * 3
    finally:
        fb.clear()
        st.close(timeout=TIMEOUT)


def test_a_backend_breaking_the_contract_is_contained(stack_fb):
    st, fb = stack_fb
    hs = chain(st, 2)
    fill(st, [0, 1], seed=14)
    fb.fail("*", RuntimeError("not a BackendError"))
    assert st.store(hs, [0, 1]).wait(TIMEOUT).num_stored == 2
    assert st.flush(TIMEOUT)
    assert st.lookup(chain(st, 2, start=99)).num_blocks == 0
    assert st.load(chain(st, 2, start=99), [3, 4]).wait(TIMEOUT).recompute == [3, 4]


def test_transfer_error_fails_the_load(stack_fb):
    st, _ = stack_fb
    hs = chain(st, 2)
    fill(st, [0, 1], seed=15)
    st.store(hs, [0, 1]).wait(TIMEOUT)
    st.flush(TIMEOUT)

    def boom(direction, layer):
        if direction == "load" and layer == 0:
            raise RuntimeError("DMA error")

    st.transfers().layer_hook = boom
    lr = st.load(hs, [8, 9], layerwise=True).wait(TIMEOUT)
    assert lr.num_loaded == 0 and lr.recompute == [8, 9] and any("DMA" in e for e in lr.errors)
    assert st.metrics.snapshot()["tiers"]["host"]["failures"] == 1
    st.transfers().layer_hook = None
    assert st.load(hs, [8, 9]).wait(TIMEOUT).num_loaded == 2


def test_flush_waits_for_pending_writes(stack_fb):
    st, fb = stack_fb
    gate = fb.gate("put")
    hs = chain(st, 2)
    fill(st, [0, 1], seed=16)
    st.store(hs, [0, 1]).wait(TIMEOUT)
    assert not st.flush(0.05)
    assert where(st, hs) == ["H", "H"]
    gate.release()
    assert st.flush(TIMEOUT)
    assert where(st, hs) == ["HD", "HD"]


def test_store_of_a_held_block_is_present_and_a_hit(stack_fb):
    st, _ = stack_fb
    hs = chain(st, 2)
    fill(st, [0, 1], seed=17)
    st.store(hs, [0, 1]).wait(TIMEOUT)
    res = st.store(hs + hs[:1], [2, 3, 4]).wait(TIMEOUT)
    assert res.status == (StoreStatus.PRESENT,) * 3
    assert res.status == ("present", "present", "present")  # the strings statuses were before the enum
    assert all(type(s) is StoreStatus for s in res.status)
    assert st.index.get(hs[0]).hits == 1


def test_manifest_is_written_once_per_writable_backend(tmp_path):
    disk = LocalDiskBackend({"path": str(tmp_path / "a")}, name="a")
    ro = FaultyBackend(LocalDiskBackend({"path": str(tmp_path / "b")}, name="b"))
    fa = FaultyBackend(disk)
    cfg = config(tmp_path, backends=[
        {"name": "a", "type": "local_disk", "options": {"path": str(tmp_path / "a")}},
        {"name": "b", "type": "local_disk", "write": False, "options": {"path": str(tmp_path / "b")}}])
    st = TierStack(cfg, backends=[fa, ro])
    try:
        assert fa.calls["manifest"] == 1 and ro.calls["manifest"] == 0
        assert disk.get_manifest(st.namespace.id)["model"] == "test/tiny"
    finally:
        st.close()
    # A failing manifest write does not stop the stack (best effort, counted).
    bad = FaultyBackend(LocalDiskBackend({"path": str(tmp_path / "c")}, name="disk"))
    bad.fail("manifest")
    st = TierStack(config(tmp_path), backends=[bad])
    try:
        assert st.metrics.snapshot()["tiers"]["disk"]["failures"] == 1
    finally:
        st.close()


def test_without_host_tier_blocks_go_straight_to_backends(tmp_path):
    st = TierStack(config(tmp_path, host_slots=0))
    try:
        assert st.host is None and st.metrics.tiers == ["device", "disk"]
        # The host-only paths say why they cannot run, instead of failing on None.
        with pytest.raises(RuntimeError, match=r"this stack has no host tier \(host.capacity: 0\)"):
            st.host_tier()
        with pytest.raises(RuntimeError, match=r"no host tier \(host.capacity: 0\), so no host <-> device"):
            st.transfers()
        hs = chain(st, 3)
        rows = fill(st, [0, 1, 2], seed=18)
        assert st.store(hs, [0, 1, 2]).wait(TIMEOUT).num_stored == 3
        assert st.flush(TIMEOUT)
        assert st.lookup(hs).counts == {"device": 3}
        # Same block ids: already there, no copy.
        lr = st.load(hs, [0, 1, 2]).wait(TIMEOUT)
        assert lr.num_loaded == 3 and lr.tiers == (Tier.DEVICE,) * 3
        st.on_device_freed([0, 1, 2])
        assert st.lookup(hs).counts == {"disk": 3}
        lr = st.load(hs, [7, 8, 9]).wait(TIMEOUT)
        assert lr.num_loaded == 3 and lr.tiers == (Tier.backend(0),) * 3
        assert torch.equal(read(st, [7, 8, 9]), rows)
        assert not st.prefetch(hs).started
    finally:
        st.close()


def test_registers_engine_tensors_and_rejects_mismatches(tmp_path):
    cfg = config(tmp_path, layout="flashinfer")
    kv = [torch.randn(32, 2, 4, 2, 16) for _ in range(2)]
    st = TierStack(cfg, kv_caches=kv)
    try:
        assert st.device.tensors[0] is kv[0] and st.block_pool is None
        hs = chain(st, 2)
        before = [t[3:5].clone() for t in kv]
        st.store(hs, [3, 4]).wait(TIMEOUT)
        st.on_device_freed([3, 4])
        assert st.load(hs, [20, 21]).wait(TIMEOUT).num_loaded == 2
        for t, b in zip(kv, before):
            assert torch.equal(t[20:22], b)
    finally:
        st.close()
    with pytest.raises(LayoutError, match=r"expected shape \(32, 2, 4, 2, 16\).*got \(32, 2, 4, 2, 8\)"):
        TierStack(cfg, kv_caches=[torch.randn(32, 2, 4, 2, 8) for _ in range(2)])
    with pytest.raises(LayoutError, match="expected 2 layer tensors"):
        TierStack(cfg, kv_caches=[torch.randn(32, 2, 4, 2, 16)])


def test_on_device_freed_and_block_reuse_update_the_index(stack_fb):
    st, _ = stack_fb
    a, b = chain(st, 1), chain(st, 1, start=40)
    fill(st, [0], seed=19)
    st.store(a, [0]).wait(TIMEOUT)
    assert st.index.get(a[0]).device == 0
    fill(st, [0], seed=20)  # the engine reuses block 0 for b without telling us first
    st.store(b, [0]).wait(TIMEOUT)
    assert st.index.get(a[0]).device is None and st.index.get(b[0]).device == 0
    st.on_device_freed([0])
    assert st.index.get(b[0]).device is None
    st.index.validate()


def test_bad_arguments_are_caller_errors(stack_fb):
    st, _ = stack_fb
    hs = chain(st, 2)
    with pytest.raises(ValueError, match="2 hashes but 1 block ids"):
        st.store(hs, [0])
    with pytest.raises(ValueError, match="out of range"):
        st.load(hs, [0, 99])


def test_from_config_and_close_are_idempotent(tmp_path):
    st = TierStack.from_config(config(tmp_path))
    st.close()
    st.close()
    with TierStack.from_config(config(tmp_path)) as st2:
        assert st2.block_pool is not None
        assert isinstance(st2.block_pool.num_free, int)


@pytest.mark.timeout(120)
@pytest.mark.parametrize("write", ["write_through", "write_back"])
def test_concurrent_requests_on_overlapping_prefixes(tmp_path, write):
    """8 threads store, look up, prefetch and load overlapping prefixes through a 6-slot host tier
    (always full): no deadlock (every wait bounded), no wrong bytes, no leaked pin."""
    st, _ = make_stack(tmp_path, host_slots=6, num_blocks=128, threads=3, write=write)
    st.prefetch_chunk_blocks = 2
    base = st.namespace.hasher()
    bs = st.block_size
    # Block j of prompt family f has fixed content, so any thread storing it stores the same bytes.
    g = torch.Generator().manual_seed(0)
    families = {f: torch.randint(1, 256, (6, BLOCK_NBYTES), dtype=torch.uint8, generator=g) for f in range(3)}
    hashes = {f: base.hash_blocks(list(range(f * 1000, f * 1000 + 6 * bs))) for f in range(3)}
    errors: list[str] = []
    loaded = [0] * 8

    def worker(t: int) -> None:
        rng = random.Random(t)
        mine = list(range(t * 16, t * 16 + 16))  # this thread's device blocks
        try:
            for _ in range(20):
                f = rng.randrange(3)
                n = rng.randint(1, 6)
                hs, content = hashes[f][:n], families[f][:n]
                ids = rng.sample(mine, n)
                st.on_device_freed(ids)
                st.device.write_blocks(content, ids)
                st.store(hs, ids).wait(TIMEOUT)
                st.lookup(hs, record=False)
                if rng.random() < 0.3:
                    st.prefetch(hs).wait(0.05)
                dst = rng.sample([b for b in mine if b not in ids], n)
                st.on_device_freed(dst)
                lr = st.load(hs, dst, layerwise=rng.random() < 0.5).wait(TIMEOUT)
                k = lr.num_loaded
                loaded[t] += k
                if k and not torch.equal(st.device.read_blocks(dst[:k]), content[:k]):
                    errors.append(f"thread {t}: wrong bytes in {k} loaded blocks")
                st.on_device_freed(ids + dst)
        except Exception as e:  # noqa: BLE001
            errors.append(f"thread {t}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
    for th in threads:
        th.start()
    for th in threads:
        th.join(90)
    assert not any(th.is_alive() for th in threads), "deadlock: a worker never finished"
    assert not errors, errors
    assert sum(loaded) > 100
    assert st.flush(TIMEOUT)
    with st.planner.lock:
        st.index.validate()
        assert st.index.pinned == 0
    assert st.host is not None
    hs = st.host.stats()
    assert st.planner.counts()["writing_down"] == 0 and hs.writing == 0
    with st.planner.lock:
        st.planner.check_locked()
    assert st.metrics.snapshot()["tiers"]["host"]["evictions"] > 0
    st.close()


def _on_disk_only(st: TierStack, n: int, seed: int) -> tuple[list[bytes], torch.Tensor]:
    """A chain of ``n`` random blocks stored from device blocks 0..n-1, then in the backend only."""
    hs = chain(st, n)
    rows = fill(st, list(range(n)), seed=seed)
    st.store(hs, list(range(n))).wait(TIMEOUT)
    st.flush(TIMEOUT)
    _evict_host(st)
    return hs, rows


def _evict_host(st: TierStack) -> None:
    """Drop every unpinned block from host memory (as pressure would), keeping backend copies."""
    with st.planner.lock:
        for key in st.index.eviction_candidates(Tier.HOST, 10**6):
            st.planner.drop_host_locked(key)
    st.on_device_freed(range(st.device.num_blocks))


def test_faulty_backend_without_faults_is_transparent(tmp_path):
    inner = LocalDiskBackend({"path": str(tmp_path / "x")}, name="x")
    fb = FaultyBackend(inner)
    assert fb.name == "x"
    key = "0" * 31 + "1/" + "ab" * 16
    payload = os.urandom(256)
    assert fb.put([key], [payload], 7) == [True]
    buf = bytearray(256)
    assert fb.get_into([key], [buf], 7) == [True] and bytes(buf) == payload
    assert fb.contains_prefix([key]) == 1 and fb.exists([key]) == [True]
    fb.drop("get", keys=[key], times=1)
    assert fb.get_into([key], [buf], 7) == [False]
    assert fb.get_into([key], [buf], 7) == [True]
    fb.delay("exists", 0.01, times=1)
    t0 = time.monotonic()
    fb.exists([key])
    assert time.monotonic() - t0 >= 0.01
    fb.fail("delete", BackendTimeout, after=1)
    assert fb.delete(["0" * 32 + "/" + "cd" * 16]) == 0
    with pytest.raises(BackendTimeout, match="injected delete fault"):
        fb.delete([key])
    assert fb.calls["delete"] == 2 and fb.injected["delete:error"] == 1
    fb.close()


def test_index_forgets_old_backend_only_entries_past_its_bound(stack_fb):
    st, _ = stack_fb
    st.max_index_entries = 8
    for r in range(6):
        hs = chain(st, 4, start=1000 * r)
        fill(st, [0, 1, 2, 3], seed=r)
        st.store(hs, [0, 1, 2, 3]).wait(TIMEOUT)
        assert st.flush(TIMEOUT)
        st.on_device_freed([0, 1, 2, 3])
    assert len(st.index) <= 8 + 4  # the bound, plus what was added since the last trim
    # Forgotten hints cost nothing but a backend lookup: the first request is still served from disk.
    first = chain(st, 4)
    assert first[0] not in st.index
    assert st.lookup(first).counts == {"disk": 4}
    assert st.load(first, [8, 9, 10, 11]).wait(TIMEOUT).num_loaded == 4


def _lead_store(lead, hashes, ids):
    """The leader's store (a scheduler's planner: no bytes), started and settled as if every side's copies
    landed and every victim was taken by a backend."""
    with lead.lock:
        plan = lead.start_store_locked(hashes, ids)
        sent = copy.deepcopy(plan.lead(0))  # what crosses to a worker (vLLM pickles it)
        handed = lead.written_back_locked(plan.victims, {v.key: True for v in plan.victims})
        slots = plan.slots + handed
        take = plan.new[:len(slots)]
        lead.stored_locked(plan, take, [hashes[i] for i in take], slots, [True] * len(take))
    lead.end_stores([hashes[i] for i in plan.new[len(take):]])
    return sent


def test_a_stack_runs_a_store_planned_elsewhere_in_the_slots_it_names(tmp_path):
    """A worker's stack follows the stores a scheduler's planner (no bytes) planned: the same blocks land
    in the same host slots, write-back victims are copied to the disk before their slots take new blocks,
    and every block loads back bit for bit, though this stack's own choice of victims would differ (it saw
    a block used again that the leader did not)."""
    lead = SimulatedStack(config(tmp_path / "lead", write="write_back", host_slots=4), BLOCK_NBYTES).planner
    st, _ = make_stack(tmp_path, host_slots=4, write="write_back")
    try:
        hs = chain(st, 6)
        rows = fill(st, [0, 1, 2, 3, 4, 5], seed=41)
        for t, (lo, hi) in enumerate([(0, 4), (4, 6)]):
            lead.now = float(t)
            plan = _lead_store(lead, hs[lo:hi], list(range(lo, hi)))
            assert st.store(hs[lo:hi], list(range(lo, hi)), start=lo, plan=plan).wait(TIMEOUT).num_stored == hi - lo
            if t == 0:
                st.lookup(hs[:1])
                st.load(hs[:1], [0]).wait(TIMEOUT)  # used again here only: this stack's LRU differs
        with lead.lock:
            placed = [lead.index.host_slot(h) for h in hs]
        assert [st.index.host_slot(h) for h in hs] == placed and placed[:2] == [None, None]
        assert where(st, hs[:2]) == ["D", "D"]  # the leader's victims, written back on this stack
        st.on_device_freed(range(st.device.num_blocks))
        fill(st, [10, 11, 12, 13, 14, 15], seed=42)
        assert st.load(hs, [10, 11, 12, 13, 14, 15]).wait(TIMEOUT).num_loaded == 6
        assert torch.equal(read(st, [10, 11, 12, 13, 14, 15]), rows)
        # A block this stack is reading sits in the slot the leader's next store names: refused whole here.
        more = chain(st, 1, start=100)
        fill(st, [6], seed=43)
        with lead.lock:
            victim = lead.eviction_policy.victims(lead.index, Tier.HOST, 1)[0]
        st.planner.pin([victim])
        plan = _lead_store(lead, more, [6])
        res = st.store(more, [6], start=100, plan=plan).wait(TIMEOUT)
        assert res.status == (FAILED,) and st.index.host_slot(more[0]) is None
        st.planner.unpin([victim])
        assert st.flush(TIMEOUT)
        with st.planner.lock:
            st.planner.check_locked()  # nothing of the refused plan is held
    finally:
        st.close(timeout=TIMEOUT)


def test_a_leader_places_a_block_only_where_every_rank_stored_it_in_that_slot(tmp_path):
    """vLLM's shape: one planner (the scheduler's, no bytes) plans each store, two ranks' stacks run it on
    their own shards, and the leader folds both results (``Planner.fold_store_locked``).  Rank 1's disk
    fails some write-backs, so rank 1 keeps a victim rank 0 handed over and the two ranks' hosts differ;
    whatever happens, every block the leader places in a host slot is in that slot on both ranks (a hit
    the scheduler offers from host memory is there on every rank), and nothing stays held."""
    rng = random.Random(7)
    lead = SimulatedStack(config(tmp_path / "lead", write="write_back", host_slots=4), BLOCK_NBYTES).planner
    ranks = [make_stack(tmp_path / f"r{r}", host_slots=4, write="write_back") for r in range(2)]
    failed_folds = stored = 0
    try:
        for t in range(24):
            n = rng.randint(1, 3)
            hs = chain(ranks[0][0], n, start=100 * t)
            if t % 5 == 4:  # some stores find their blocks held already (hits)
                with lead.lock:
                    held = [k for k in list(lead.index) if lead.index.host_slot(k) is not None]
                hs = held[:n] or hs
            ids = list(range(len(hs)))
            lead.now = float(t)
            with lead.lock:
                plan = lead.start_store_locked(hs, ids)
            sent = plan.lead(t)
            if t % 3 == 1:
                ranks[1][1].fail("put", times=1)  # rank 1's next write-back fails
            results = []
            for r, (st, fb) in enumerate(ranks):
                fill(st, ids, seed=1000 * t + r)
                results.append(st.store(hs, ids, start=100 * t, plan=copy.deepcopy(sent)).wait(TIMEOUT))
                fb.clear()
            with lead.lock:
                lead.fold_store_locked(plan, hs, [r.outcome() for r in results], start=100 * t)
                lead.check_locked()
                placed = {k: lead.index.host_slot(k) for k in list(lead.index)}
            stored += plan.status.count(STORED)
            failed_folds += any(r.status[i] is STORED for r in results for i in plan.new) and \
                plan.status.count(STORED) < len(plan.new)
            for r, (st, _) in enumerate(ranks):
                bad = {k.hex()[:8]: (slot, st.index.host_slot(k)) for k, slot in placed.items()
                       if slot is not None and st.index.host_slot(k) != slot}
                assert not bad, (t, r, bad, [x.status for x in results], [x.handed for x in results], plan)
        assert stored >= 20 and failed_folds >= 1  # both paths were taken
        for st, _ in ranks:
            assert st.flush(TIMEOUT)
            with st.planner.lock:
                st.planner.check_locked()
    finally:
        for st, _ in ranks:
            st.close(timeout=TIMEOUT)


def test_a_plan_naming_positions_the_store_does_not_have_is_refused_naming_them(tmp_path):
    lead = SimulatedStack(config(tmp_path / "lead", host_slots=4), BLOCK_NBYTES).planner
    st, _ = make_stack(tmp_path, host_slots=4)
    try:
        hs = chain(st, 3)
        with lead.lock:
            plan = lead.start_store_locked(hs, [0, 1, 2]).lead(0)
        with pytest.raises(ValueError, match=r"store: the plan stores positions \[0, 1, 2\], the store has 2 blocks"):
            st.store(hs[:2], [0, 1], plan=plan)
        fill(st, [0, 1, 2], seed=5)
        assert st.store(hs, [0, 1, 2], plan=plan).wait(TIMEOUT).num_stored == 3  # nothing held by the refusal
    finally:
        st.close(timeout=TIMEOUT)


def test_a_load_plan_naming_positions_the_load_does_not_have_is_refused_and_a_room_in_use_still_loads(
        tmp_path, caplog):
    """A lead load naming positions outside the load is refused with a message naming them, before any
    work.  A room this stack cannot follow (every named slot holds a block pinned here) is logged as
    refused, and the load still delivers every block from the disk, placing none in the named slots."""
    lead = SimulatedStack(config(tmp_path / "lead", host_slots=4), BLOCK_NBYTES).planner
    st, _ = make_stack(tmp_path, host_slots=4)
    try:
        hs = chain(st, 3)
        rows = fill(st, [0, 1, 2], seed=3)
        assert st.store(hs, [0, 1, 2]).wait(TIMEOUT).num_stored == 3
        assert st.flush(TIMEOUT)
        assert st.evict_host(hs) == 3
        with lead.lock:
            start = lead.start_load_locked(hs, into_host=True)
        plan = start.lead(0)
        assert plan.fetch == (0, 1, 2) and len(plan.room.order()) == 3
        with pytest.raises(ValueError, match=r"load: the plan reads positions \[0, 1, 2\], the load has 2 blocks"):
            st.load(hs[:2], [4, 5], plan=plan)
        others = chain(st, 4, start=1000)
        fill(st, [8, 9, 10, 11], seed=4)
        assert st.store(others, [8, 9, 10, 11]).wait(TIMEOUT).num_stored == 4  # every host slot taken here
        st.planner.pin(others)  # and in use
        res = st.load(hs, [4, 5, 6], plan=plan).wait(TIMEOUT)
        assert res.num_loaded == 3 and torch.equal(read(st, [4, 5, 6]), rows)
        assert res.outcome.placed == frozenset() and res.outcome.handed == frozenset()
        assert "is refused here" in caplog.text
        st.planner.unpin(others)
        assert st.flush(TIMEOUT)  # the write-through copies of ``others`` settled: check_locked wants no flight
        with st.planner.lock:
            st.planner.check_locked()
    finally:
        st.close(timeout=TIMEOUT)
