"""Transfers between the device and host tiers on CPU: bit-exact stores and loads, per-block success and
failure reporting, layer-by-layer completion, timeouts, cancellation, faults inside workers."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from kvtier.format.layout import KVLayout
from kvtier.memory.device import DeviceTier
from kvtier.memory.host import HostTier
from kvtier.memory.host_slots import FREE, READY, WRITING
from kvtier.memory.transfer import Direction, LayerDoneCounter, TransferEngine, TransferResult


def random_tensors(layout: KVLayout, seed: int = 0) -> list[torch.Tensor]:
    """Random bytes (never zeros) in the layout's dtype and shapes."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (layout.itemsize * torch.Size(s).numel(),), dtype=torch.uint8, generator=g)
            .view(layout.dtype).view(s) for s in layout.tensor_shapes()]


LAYOUT = KVLayout("flash_attn", 4, 16, 4, 2, 8, torch.bfloat16)


@pytest.fixture
def tiers():
    dev = DeviceTier(LAYOUT, random_tensors(LAYOUT))
    host = HostTier(LAYOUT.block_nbytes, num_slots=12, pinned=False)
    return dev, host


def stored(host: HostTier, dev: DeviceTier, block_ids, keys=None) -> tuple[list[int], TransferEngine]:
    eng = TransferEngine(dev, host)
    slots = host.allocate(len(block_ids)).slots
    r = eng.store(block_ids, slots, keys=keys or [f"k{b}" for b in block_ids]).wait(10)
    assert r.all_ok
    return slots, eng


def test_store_then_load_round_trip_bit_exact(tiers):
    dev, host = tiers
    want = dev.read_blocks([3, 7, 1, 12])
    with TransferEngine(dev, host) as eng:
        slots = host.allocate(4).slots
        r = eng.store([3, 7, 1, 12], slots).wait(10)
        assert (r.all_ok and r.direction is Direction.STORE
                and r.direction == "store"  # type: ignore[comparison-overlap]  # a StrEnum member equals its value
                and r.nbytes == 4 * LAYOUT.block_nbytes)
        assert [host.state(s) for s in slots] == [WRITING] * 4  # no keys: the caller commits
        host.commit(r.ok_slots, ["a", "b", "c", "d"])
        assert torch.equal(host.slab[slots], want)
        for t in dev.tensors:
            t.view(torch.uint8).fill_(0xEE)
        h = eng.load(slots, [0, 5, 6, 15], layerwise=False)
        assert h.wait_layer(2, timeout=10) is True  # a whole-block load lands every layer at once
        r = h.wait(10)
        assert r.all_ok and r.failed_block_ids == [] and h.layers_done == LAYOUT.num_layers
        assert torch.equal(dev.read_blocks([0, 5, 6, 15]), want)
        assert all(host.state(s) == READY for s in slots)  # a load leaves its slots as they were
        assert eng.stats()["blocks_ok"] == 8


def test_store_from_flash_attn_load_into_flashinfer(tiers):
    dev, host = tiers  # a "prefill" instance with flash_attn tensors ...
    fi = KVLayout("flashinfer", 4, 16, 4, 2, 8, torch.bfloat16)
    dec = DeviceTier(fi, random_tensors(fi, seed=9))  # ... and a "decode" one with flashinfer tensors
    slots, eng = stored(host, dev, [2, 4])
    with TransferEngine(dec, host) as eng2:
        assert eng2.load(slots, [10, 11]).wait(10).all_ok
    for layer in range(4):
        for kv in range(2):
            assert torch.equal(dec.tensors[layer][[10, 11], kv].view(torch.int16),
                               dev.tensors[layer][kv, [2, 4]].view(torch.int16))
    eng.close()


def test_store_reports_each_failed_block_and_cleans_up_with_keys(tiers):
    dev, host = tiers
    eng = TransferEngine(dev, host)
    slots = host.allocate(5).slots  # 0..4, WRITING
    host.commit([4], ["old"])  # slot 4 is READY: not ours to overwrite
    r = eng.store([1, 99, 2, 3, 5], [0, 1, 2, 4, 2], keys=["a", "b", "c", "d", "e"]).wait(10)
    assert r.ok == (True, False, True, False, False)
    assert r.failed_block_ids == [99, 3, 5] and r.ok_slots == [0, 2]
    assert any("out of range" in e for e in r.errors)
    assert any("slots not writing: [4]" in e for e in r.errors)
    assert any("duplicate destinations: [2]" in e for e in r.errors)
    assert host.state(0) == READY and host.key(0) == "a" and host.key(2) == "c"
    assert host.state(1) == FREE  # a failed store is freed, never visible
    assert host.state(4) == READY and host.key(4) == "old"
    assert slots[3] == 3 and host.state(3) == WRITING  # untouched by this batch: still the caller's
    eng.close()


def test_load_reports_exactly_the_blocks_to_recompute(tiers):
    dev, host = tiers
    slots, eng = stored(host, dev, [1, 2, 3])
    want = dev.read_blocks([1, 2, 3])
    evicted = slots[0]
    host.free([evicted])  # block 1's slot was evicted (freed): not readable any more
    wip = host.allocate(1).slots[0]  # a slot still being written
    h = eng.load([slots[1], evicted, 999, wip, slots[2], slots[2]], [4, 5, 6, 7, 8, 4])
    r = h.wait(10)
    assert r.ok == (True, False, False, False, True, False)
    assert r.failed_block_ids == [5, 6, 7, 4]
    assert r.ok_block_ids == [4, 8]
    assert torch.equal(dev.read_blocks([4, 8]), want[1:])
    assert eng.stats()["blocks_failed"] == 4
    eng.close()


def test_layer_by_layer_first_layer_usable_before_last(tiers):
    dev, host = tiers
    slots, _ = stored(host, dev, [0, 1, 2])
    want = dev.read_blocks([0, 1, 2])
    release = threading.Event()
    seen: list[int] = []

    def hook(direction: Direction, layer: int) -> None:
        seen.append(layer)
        if direction is Direction.LOAD and layer == 0:
            release.wait(10)  # hold the worker after layer 0 has landed

    eng = TransferEngine(dev, host, layer_hook=hook)
    h = eng.load(slots, [9, 10, 11])
    assert h.wait_layer(0, timeout=5) is True
    ln = LAYOUT.layer_nbytes
    got = dev.read_blocks([9, 10, 11])
    assert torch.equal(got[:, :ln], want[:, :ln])  # layer 0 is in device memory ...
    assert not torch.equal(got[:, -ln:], want[:, -ln:])  # ... the last layer is not yet
    assert h.layers_done == 1 and not h.done()
    with pytest.raises(TimeoutError, match="layer 3 not done after 0.05 s"):
        h.wait_layer(3, timeout=0.05)
    with pytest.raises(TimeoutError, match="load of 3 blocks not done after 0.05 s"):
        h.wait(timeout=0.05)
    release.set()
    for layer in range(4):
        assert h.wait_layer(layer, timeout=5) is True
    assert h.wait(5).all_ok and seen == [0, 1, 2, 3]
    assert torch.equal(dev.read_blocks([9, 10, 11]), want)
    eng.close()


def test_fault_inside_worker_fails_blocks_and_releases_waiters(tiers):
    dev, host = tiers
    slots, _ = stored(host, dev, [0, 1])

    def hook(direction: str, layer: int) -> None:
        if layer == 1:
            raise RuntimeError("injected fault")

    eng = TransferEngine(dev, host, layer_hook=hook)
    h = eng.load(slots, [5, 6])
    assert h.wait_layer(0, timeout=5) is True  # landed before the fault
    assert h.wait_layer(3, timeout=5) is False  # never landed: returns (no hang), says so
    r = h.wait(5)
    assert r.ok == (False, False) and r.failed_block_ids == [5, 6]
    assert any("injected fault" in e for e in r.errors)
    assert all(host.state(s) == READY for s in slots)
    calls: list[TransferResult] = []
    h.add_done_callback(calls.append)  # after the fact: called at once
    assert calls == [r]
    eng.close()


def test_cancel_stops_at_the_next_layer(tiers):
    dev, host = tiers
    slots, _ = stored(host, dev, [0])
    gate = threading.Event()
    eng = TransferEngine(dev, host, layer_hook=lambda d, layer: gate.wait(10))
    h = eng.load(slots, [3])
    h.wait_layer(0, timeout=5)
    h.cancel()
    gate.set()
    r = h.wait(5)
    assert r.ok == (False,) and any("cancelled" in e for e in r.errors)
    assert h.wait_layer(2, timeout=1) is False
    eng.close()


def test_empty_and_mismatched_batches(tiers):
    dev, host = tiers
    eng = TransferEngine(dev, host)
    r = eng.load([], []).wait(5)
    assert r.ok == () and r.all_ok
    with pytest.raises(ValueError, match="load: 2 block ids but 1 slots"):
        eng.load([0], [1, 2])
    with pytest.raises(ValueError, match="store: 1 block ids but 2 keys"):
        eng.store([1], [0], keys=["a", "b"])
    with pytest.raises(ValueError, match="device blocks are .* host slots are 7 B"):
        TransferEngine(dev, HostTier(7, num_slots=1, pinned=False))
    eng.close()
    with pytest.raises(RuntimeError, match="TransferEngine is closed"):
        eng.load([0], [0])


def test_concurrent_transfers_from_many_threads(tiers):
    dev, host = tiers
    want = dev.read_blocks(range(16))
    eng = TransferEngine(dev, host, num_workers=2)
    errors: list[str] = []

    def client(tid: int) -> None:
        for i in range(20):
            a = host.allocate(2)
            blocks = [(tid * 4 + i) % 8, (tid * 4 + i + 1) % 8]
            blocks = blocks[:len(a.slots)]
            keys = [(tid, i, j) for j in range(len(blocks))]
            r = eng.store(blocks, a.slots, keys=keys).wait(10)
            if not r.all_ok:
                errors.append(f"store {r.errors}")
                continue
            # Loaded by key, as the stack does: a slot refilled since would fail its block.
            h = eng.load(a.slots, [8 + 2 * tid + j for j in range(len(blocks))], keys=keys)
            r2 = h.wait(10)
            host.free(a.slots)
            if not r2.all_ok:
                errors.append(f"load {r2.errors}")
            elif not torch.equal(dev.read_blocks(r2.block_ids), want[blocks]):
                errors.append("bytes differ")

    threads = [threading.Thread(target=client, args=(t,)) for t in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[:3]
    eng.close()


def test_layer_done_counter():
    c = LayerDoneCounter(3)
    with pytest.raises(TimeoutError):
        c.wait_layer(0, timeout=0.01)
    c.mark_layer_done(0)
    assert c.wait_layer(0, timeout=0) == (True, None)
    with pytest.raises(RuntimeError, match="layer 2 marked done after 1 layers"):
        c.mark_layer_done(2)
    t0 = time.monotonic()
    threading.Timer(0.05, c.finish).start()
    assert c.wait_layer(2, timeout=5) == (False, None)
    assert time.monotonic() - t0 < 4
    with pytest.raises(IndexError):
        c.wait_layer(3)


def test_load_by_key_fails_a_refilled_slot(tiers):
    dev, host = tiers
    slots, eng = stored(host, dev, [1, 2])  # keys k1, k2
    r = eng.load(slots, [5, 6], keys=["k1", "k9"]).wait(10)
    assert r.ok == (True, False) and r.failed_block_ids == [6]
    assert any("not ready with their keys" in e for e in r.errors)
    assert host.state(slots[0]) == READY and host.key(slots[0]) == "k1"
    eng.close()
