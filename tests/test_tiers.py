"""Device tier, the standalone block pool and the host tier: allocation, LRU, pins, ref counts, the
never-waits rule, thread safety."""

from __future__ import annotations

import random
import threading
import time
from typing import Any

import pytest
import torch

import kvtier.memory.device as device_mod
import kvtier.memory.rows as rows_mod
from kvtier.format.layout import KVLayout, LayoutError
from kvtier.memory.blockpool import BlockPool, PoolExhausted
from kvtier.memory.device import DeviceTier
from kvtier.memory.host import HostTier, resolve_pin_memory
from kvtier.memory.host_slots import FREE, READY, WRITING, SlotTable
from kvtier.memory.rows import to_payload


def random_tensors(layout: KVLayout, seed: int = 0) -> list[torch.Tensor]:
    """Random bytes (never zeros) in the layout's dtype and shapes."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (layout.itemsize * torch.Size(s).numel(),), dtype=torch.uint8, generator=g)
            .view(layout.dtype).view(s) for s in layout.tensor_shapes()]

# ---------------------------------------------------------------------- BlockPool


def test_pool_allocates_in_order_and_reuses_least_recently_freed():
    pool = BlockPool(6)
    a = pool.allocate(3)
    assert a == [0, 1, 2] and pool.num_free == 3
    assert [pool.ref_count(b) for b in a] == [1, 1, 1]
    pool.free([2, 0])  # freed in this order: 2 is the least recently freed of them
    assert pool.allocate(4) == [3, 4, 5, 2]
    assert pool.allocate(1) == [0]
    pool.check()


def test_pool_cached_blocks_survive_free_until_reallocated():
    evicted = []
    pool = BlockPool(4, on_evict=lambda ks, bs: evicted.append((ks, bs)))
    blocks = pool.allocate(3)
    for b, k in zip(blocks, [b"k0", b"k1", b"k2"]):
        assert pool.cache(b, k)
    pool.free(list(reversed(blocks)))  # tail first, as vLLM frees a request
    assert pool.num_free == 4 and pool.num_cached == 3
    # A new request with the same prefix revives the cached blocks.
    hit = pool.lookup_prefix([b"k0", b"k1", b"zz", b"k2"])
    assert hit == [0, 1]
    pool.touch(hit)
    assert pool.ref_count(0) == 1 and pool.num_free == 2
    # Allocation takes the never-cached block 3 first, then the LRU cached one (k2), evicting its key.
    assert pool.allocate(2) == [3, 2]
    assert evicted == [([b"k2"], [2])] and pool.lookup(b"k2") is None and pool.lookup(b"k0") == 0
    assert pool.evictions == 1
    pool.check()


def test_pool_ref_counts_shared_blocks():
    pool = BlockPool(2)
    (b,) = pool.allocate(1)
    pool.cache(b, "key")
    pool.touch([b, b])
    assert pool.ref_count(b) == 3
    pool.free([b, b])
    assert pool.num_free == 1  # still referenced once
    pool.free([b])
    assert pool.num_free == 2 and pool.lookup("key") == b
    with pytest.raises(ValueError, match="free: block 0 has ref count 0, freed 1 time"):
        pool.free([b])
    pool.check()


def test_pool_cache_many_answers_per_block_and_refuses_bad_input_whole():
    pool = BlockPool(4)
    a, b = pool.allocate(2)
    assert pool.cache_many([a, b], ["x", "y"]) == [True, True]
    assert pool.cache_many([b, a], ["x", "z"]) == [False, True]  # x stays in a; a is re-keyed to z
    assert pool.lookup("x") is None and pool.lookup("z") == a and pool.lookup("y") == b
    with pytest.raises(ValueError, match="cache_many: 2 block ids for 1 keys"):
        pool.cache_many([a, b], ["w"])
    with pytest.raises(ValueError, match="cache: block 3 is not allocated"):
        pool.cache_many([a, 3], ["w", "v"])
    assert pool.lookup("w") is None and pool.lookup("z") == a  # nothing recorded
    pool.check()


def test_pool_free_is_all_or_nothing():
    """A free that names a block it cannot free (over-freed, out of range) changes nothing: the blocks
    before it in the call keep their counts and stay out of the free queue, in queue order."""
    pool = BlockPool(4)
    a, b, c = pool.allocate(3)
    pool.touch([b])
    order = list(pool._free)
    with pytest.raises(ValueError, match=f"free: block {c} has ref count 1, freed 2 time"):
        pool.free([a, b, c, b, c])
    with pytest.raises(IndexError, match="block id 9 out of range"):
        pool.free([a, c, 9])
    assert [pool.ref_count(x) for x in (a, b, c)] == [1, 2, 1] and list(pool._free) == order
    pool.free([c, b, a, b])  # tail first; b reaches 0 at its second mention
    assert list(pool._free) == [*order, c, a, b]
    pool.check()


def test_pool_exhaustion_raises_at_once_and_takes_nothing():
    pool = BlockPool(3)
    pool.allocate(2)
    t0 = time.monotonic()
    with pytest.raises(PoolExhausted, match=r"block pool exhausted: 2 blocks wanted, 1 free of 3"):
        pool.allocate(2)
    assert time.monotonic() - t0 < 0.5
    assert pool.num_free == 1
    pool.check()


def test_pool_cache_rules():
    pool = BlockPool(3)
    a, b = pool.allocate(2)
    assert pool.cache(a, "x")
    assert not pool.cache(b, "x")  # already cached elsewhere: block tables stay append-only
    assert pool.cache(a, "x")
    assert pool.cache(a, "y") and pool.lookup("x") is None  # re-keying drops the old key
    assert pool.uncache(a) == "y" and pool.key_of(a) is None
    with pytest.raises(ValueError, match="cache: block 2 is not allocated"):
        pool.cache(2, "z")
    with pytest.raises(IndexError, match=r"block id 9 out of range \[0, 3\)"):
        pool.touch([0, 9])
    assert pool.ref_count(0) == 1  # all or nothing
    pool.check()


def test_pool_random_operations_keep_invariants():
    rng = random.Random(0)
    pool = BlockPool(16)
    held: list[int] = []
    for step in range(2000):
        op = rng.random()
        if op < 0.4:
            n = rng.randint(0, 5)
            if n > pool.num_free:
                with pytest.raises(PoolExhausted):
                    pool.allocate(n)
            else:
                got = pool.allocate(n)
                for b in got:
                    pool.cache(b, rng.randrange(40))
                held += got
        elif op < 0.7 and held:
            b = held.pop(rng.randrange(len(held)))
            pool.free([b])
        else:
            hit = pool.lookup_prefix([rng.randrange(40)])
            pool.touch(hit)
            held += hit
        if step % 100 == 0:
            pool.check()
    pool.check()


# ---------------------------------------------------------------------- HostTier


def test_host_capacity_and_pinned_resolution():
    h = HostTier(1000, capacity_bytes=10_500, pinned="auto")
    assert h.num_slots == 10 and h.capacity_bytes == 10_000
    assert h.pin_memory == torch.cuda.is_available()
    assert h.slab.shape == (10, 1000) and h.slab.dtype == torch.uint8
    # The slab starts on a page, so slots of whole pages can take O_DIRECT reads (local_disk).
    paged = HostTier(8192, num_slots=3, pinned=False)
    assert [paged.slab[i].data_ptr() % 4096 for i in range(3)] == [0, 0, 0] and h.slab.data_ptr() % 4096 == 0
    with pytest.raises(ValueError, match="host capacity 999 B holds no block of 1000 B"):
        HostTier(1000, capacity_bytes=999)
    cases: tuple[dict[str, Any], ...] = ({}, {"capacity_bytes": 10_000, "num_slots": 10})
    for neither_or_both in cases:
        with pytest.raises(ValueError, match="give exactly one of capacity_bytes and num_slots"):
            HostTier(1000, **neither_or_both)
    assert resolve_pin_memory(False) is False
    with pytest.raises(ValueError, match='expected "auto", true or false'):
        resolve_pin_memory("yes")
    if not torch.cuda.is_available():
        with pytest.raises(ValueError, match="host.pinned: true needs CUDA"):
            HostTier(10, num_slots=1, pinned=True)


def test_host_memory_the_machine_cannot_give_is_an_error_naming_host_capacity(monkeypatch):
    """More than the machine's memory is refused before allocating (where the kernel overcommits, the
    prefault would get the process killed); an allocation that fails is the same error, not torch's."""
    import kvtier.memory.host as host_mod

    total = host_mod.memory_total()
    assert total is not None and total > 0
    with pytest.raises(host_mod.HostMemoryUnavailable,
                       match=r"host\.capacity: .* of host memory \(\d+ slots of 1048576 B\) is more than "
                             r"this machine has"):
        HostTier(1 << 20, capacity_bytes=2 * total)

    def refuse(num_slots, block_nbytes, pin):
        raise RuntimeError("DefaultCPUAllocator: can't allocate memory\nmore detail")

    monkeypatch.setattr(host_mod, "_alloc_slab", refuse)
    with pytest.raises(ValueError, match=r"^host\.capacity: 4MiB of host memory \(4 slots of 1048576 B\) could "
                                         r"not be allocated: DefaultCPUAllocator: can't allocate memory$"):
        HostTier(1 << 20, capacity_bytes=4 << 20)


def test_host_full_allocate_returns_fewer_and_never_blocks():
    h = HostTier(64, num_slots=4, pinned=False)
    a = h.allocate(3)
    assert a.slots == [0, 1, 2] and a.skipped == 0
    t0 = time.monotonic()
    b = h.allocate(3)
    assert b.slots == [3] and b.skipped == 2
    c = h.allocate(5)
    assert c.slots == [] and c.skipped == 5
    assert time.monotonic() - t0 < 0.5
    st = h.stats()
    assert (st.free, st.writing, st.allocated, st.skipped) == (0, 4, 4, 7)


def test_host_keeps_slot_states_only_no_second_lru_and_no_pin_count():
    """The slab keeps states (and keys) only: eviction order and pins are the index's (one owner each)."""
    h = HostTier(8, num_slots=4, pinned=False)
    slots = h.allocate(4).slots
    h.commit(slots, ["a", "b", "c", "d"])
    assert not any(hasattr(h, name) for name in ("evict_lru", "touch", "lru_order", "restore", "pin", "unpin",
                                                "pins"))
    assert h.allocate(1) == type(h.allocate(0))([], 1)  # full: nothing is evicted behind the caller's back
    assert h.holds([1, 2]) == [True, True]
    assert h.holds([0, 1], ["a", "x"]) == [True, False]  # slot 1 holds "b", not "x"
    h.free([3])
    assert h.state(3) == FREE and h.key(3) is None and h.holds([3]) == [False]
    with pytest.raises(ValueError, match="holds: 1 slots but 2 keys"):
        h.holds([0], ["a", "b"])
    st = h.stats()
    assert (st.free, st.ready) == (1, 3)


def test_host_state_errors():
    h = HostTier(8, num_slots=3, pinned=False)
    with pytest.raises(ValueError, match="commit: slot 0 is free, expected writing"):
        h.commit([0])
    s = h.allocate(2).slots
    with pytest.raises(ValueError, match="commit: slot 0 given twice"):
        h.commit([0, 0])
    with pytest.raises(ValueError, match="commit: 2 slots but 1 keys"):
        h.commit(s, ["x"])
    assert h.holds(s) == [False, False]  # WRITING slots are not readable
    h.free(s)
    with pytest.raises(ValueError, match="free: slot 0 is free"):
        h.free([0])
    with pytest.raises(IndexError, match=r"slot 7 out of range \[0, 3\)"):
        h.slot_view(7)


def test_host_slot_view_is_a_writable_window_on_the_slab():
    h = HostTier(16, num_slots=2, pinned=False)
    mv = h.slot_view(1)
    assert mv.nbytes == 16 and not mv.readonly
    mv[:4] = b"abcd"
    assert bytes(h.slab[1, :4].tolist()) == b"abcd"
    h.slab[1, 4] = 0x41
    assert h.slot_view(1)[4] == 0x41
    assert h.rows(0, 2).data_ptr() == h.slab.data_ptr()


def test_host_thread_safety_smoke():
    h = HostTier(8, num_slots=64, pinned=False)
    owned: set[int] = set()  # slots some thread allocated and has not freed: allocate must never hand them out
    lock = threading.Lock()
    errors: list[str] = []

    def worker(tid: int) -> None:
        rng = random.Random(tid)
        mine: list[int] = []
        for _ in range(300):
            a = h.allocate(rng.randint(1, 6))
            with lock:
                errors.extend(f"slot {s} allocated twice" for s in a.slots if s in owned)
                owned.update(a.slots)
            h.commit(a.slots, [(tid, s) for s in a.slots])
            if not all(h.holds(a.slots, [(tid, s) for s in a.slots])):
                errors.append(f"thread {tid}: a committed slot lost its key")
            mine += a.slots
            # Free some of this thread's own blocks, as the stack frees what its index evicts.
            rng.shuffle(mine)
            k = rng.randint(0, 4)
            drop, mine = mine[:k], mine[k:]
            with lock:
                owned.difference_update(drop)
            h.free(drop)
        with lock:
            owned.difference_update(mine)
        h.free(mine)

    threads = [threading.Thread(target=worker, args=(i,)) for i in range(4)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not any(t.is_alive() for t in threads)
    assert not errors, errors[:5]
    st = h.stats()
    assert st.free + st.writing + st.ready == 64
    assert st.writing == 0
    assert st.ready == sum(h.state(s) == READY for s in range(64))


# ---------------------------------------------------------------------- DeviceTier


def test_device_tier_registers_and_copies_into_host_slots():
    lay = KVLayout("flashinfer", 3, 10, 4, 2, 8, torch.float16)
    dev = DeviceTier(lay, random_tensors(lay))
    host = HostTier(lay.block_nbytes, num_slots=6, pinned=False)
    want = to_payload(lay, dev.tensors, [9, 2, 4])
    dev.gather([9, 2, 4], host.slab, [5, 0, 3])
    assert torch.equal(host.slab[[5, 0, 3]], want)
    assert torch.equal(torch.frombuffer(host.slot_view(5), dtype=torch.uint8), want[0])
    dev.scatter(host.slab, [1, 0, 7], [5, 0, 3])
    assert torch.equal(dev.read_blocks([1, 0, 7]), want)
    plan = dev.plan([6, 5], host.slab, [5, 0])
    for layer in range(lay.num_layers):
        dev.scatter_layer(layer, host.slab, None, plan=plan)
    assert torch.equal(dev.read_blocks([6, 5]), want[:2])
    out = torch.zeros_like(want[:2])
    for layer in range(lay.num_layers):
        dev.gather_layer(layer, [6, 5], out)
    assert torch.equal(out, want[:2])
    dev.write_blocks(want[:1], [8])
    assert torch.equal(dev.read_blocks([8]), want[:1])
    with pytest.raises(IndexError, match=r"block ids \[10, -1\] out of range \[0, 10\)"):
        dev.gather([1, 10, -1], host.slab, [0, 1, 2])
    with pytest.raises(IndexError, match=r"slots out of range \[0, 6\)"):
        dev.gather([1], host.slab, [6])
    with pytest.raises(ValueError, match="2 block ids but 1 slots"):
        dev.scatter(host.slab, [1, 2], [0])
    with pytest.raises(TypeError, match="block_ids is None and no plan was given"):
        dev.gather(None, host.slab)


def test_device_tier_rejects_mismatched_tensors():
    lay = KVLayout("flash_attn", 2, 8, 4, 2, 8, torch.bfloat16)
    ts = random_tensors(lay)
    ts[1] = ts[1][:, :4]
    with pytest.raises(LayoutError, match=r"layer 1: expected shape \(2, 8, 4, 2, 8\) .* got \(2, 4, 4, 2, 8\): "
                                          r"4 blocks, expected 8"):
        DeviceTier(lay, ts)
    with pytest.raises(LayoutError, match="expected device cuda"):
        DeviceTier(lay, random_tensors(lay), device="cuda")
    dev = DeviceTier.allocate(lay)
    assert dev.num_blocks == 8 and dev.block_nbytes == lay.block_nbytes and not dev.is_cuda


@pytest.mark.parametrize("groups", [1, 2, 8])
@pytest.mark.parametrize("kind,inner", [("flash_attn", None), ("flashinfer", None), ("stacked", "mla")])
def test_staged_copy_path_matches_direct(kind, inner, groups, monkeypatch):
    """The host <-> CUDA path (staging buffer, one copy per run of host rows and group of layers, per-layer
    2-D copies) run on a CPU cache must move exactly the bytes the direct path moves, however the layers
    are grouped (5 layers: one group, groups of 3 + 2, one layer each)."""
    monkeypatch.setattr(device_mod, "PIPELINE_GROUPS", groups)
    monkeypatch.setattr(device_mod, "PIPELINE_MIN_GROUP_BYTES", 0)  # these blocks are tiny
    lay = KVLayout(kind, 5, 12, 4, 1 if "mla" in (kind, inner) else 2, 8, torch.bfloat16, inner)
    assert len(DeviceTier(lay, random_tensors(lay))._layer_groups(None, 5, 3)) == min(groups, 5)
    src = DeviceTier(lay, random_tensors(lay))
    staged = DeviceTier(lay, random_tensors(lay, seed=2))
    staged._force_staging = True
    ids, slots = [11, 2, 7, 0, 5], [6, 7, 0, 3, 4]  # three runs of host rows
    want = src.read_blocks(ids)
    host = torch.zeros((8, lay.block_nbytes), dtype=torch.uint8)
    src._force_staging = True
    src.gather(ids, host, slots)
    assert torch.equal(host[slots], want)
    host2 = torch.zeros_like(host)
    for layer in range(lay.num_layers):
        src.gather(ids, host2, slots, layers=[layer])
    assert torch.equal(host2, host)
    # Layers that are not consecutive: only their byte ranges move, the rest of each row is left alone.
    host3 = torch.zeros_like(host)
    src.gather(ids, host3, slots, layers=[0, 2, 3])
    ln = lay.layer_nbytes
    for li in range(lay.num_layers):
        part = host3[slots, li * ln:(li + 1) * ln]
        assert torch.equal(part, host[slots, li * ln:(li + 1) * ln]) if li in (0, 2, 3) else not part.any()
    staged.scatter(host, [1, 3, 4, 6, 8], slots)
    assert torch.equal(staged.read_blocks([1, 3, 4, 6, 8]), want)
    for layer in range(lay.num_layers):
        staged.scatter(host, [0, 9, 10, 2, 11], slots, layers=[layer])
    assert torch.equal(staged.read_blocks([0, 9, 10, 2, 11]), want)


def test_small_batches_are_copied_in_fewer_layer_groups(monkeypatch):
    """No group of layers moves less than PIPELINE_MIN_GROUP_BYTES: a batch of a few blocks is one group
    (each group costs its launches and a DMA call), a large one the full PIPELINE_GROUPS."""
    monkeypatch.setattr(device_mod, "PIPELINE_GROUPS", 8)
    lay = KVLayout("flash_attn", 16, 12, 4, 2, 8, torch.bfloat16)  # 512 B per layer, 8 KiB per block
    monkeypatch.setattr(device_mod, "PIPELINE_MIN_GROUP_BYTES", 4 * lay.layer_nbytes * 3)
    dev = DeviceTier(lay, random_tensors(lay))
    sizes = {n: [len(g) for g in dev._layer_groups(None, n, 1)] for n in (1, 3, 6, 12, 64)}
    assert sizes == {1: [16], 3: [4, 4, 4, 4], 6: [2] * 8, 12: [2] * 8, 64: [2] * 8}
    assert [len(g) for g in dev._layer_groups([0, 1, 2, 3], 3, 1)] == [4]  # 4 layers of 3 blocks: one group
    assert dev._layer_groups([5, 9], 1000, 1) == [[5], [9]]


def test_host_holds_by_key_refuses_a_refilled_slot():
    h = HostTier(8, num_slots=1, pinned=False)
    (s,) = h.allocate(1).slots
    h.commit([s], ["old"])
    h.free([s])  # the owner of recency evicted it
    h.commit(h.allocate(1).slots, ["new"])  # same slot, another block
    assert h.holds([s], ["old"]) == [False]
    assert h.holds([s], ["new"]) == [True]


def test_host_in_state_answers_per_slot_and_false_out_of_range():
    h = HostTier(8, num_slots=4, pinned=False)
    ready, writing = h.allocate(2).slots
    h.commit([ready], ["k"])
    free = next(s for s in range(4) if s not in (ready, writing))
    assert h.in_state([writing, ready, free, -1, 4], WRITING) == [True, False, False, False, False]
    assert h.in_state([writing, ready, free], READY) == [False, True, False]
    assert h.in_state([free], FREE) == [True]


def test_cpu_copy_threads_are_serial_and_leave_torch_setting_alone():
    before = torch.get_num_threads()
    seen = []
    rows_mod._parallel(lambda chunk: seen.append((torch.get_num_threads(), chunk)), [1, 2, 3, 4], 64 << 20)
    assert sorted(x for _, c in seen for x in c) == [1, 2, 3, 4]
    assert torch.get_num_threads() == before
    if before > 1 and rows_mod._omp_set_num_threads() is not None:
        assert all(n == 1 for n, _ in seen)  # copies run single-threaded in kvtier's pool


def test_slot_reuse_hands_a_ready_slot_to_the_next_block_without_freeing_it():
    """An evicted block's slot goes straight to the block planned to take its place: between the two it is
    never free, so no other caller's allocation can take it."""
    t = SlotTable(3)
    slots = t.allocate(3).slots
    t.commit(slots, ["a", "b", "c"])
    t.reuse([1])
    assert t.state(1) == WRITING and t.key(1) is None and t.num_free == 0
    assert t.allocate(1).slots == []  # not on the free list
    t.commit([1], ["d"])
    assert t.holds([1], ["d"]) == [True]
    c = t.counts()
    assert (c.free, c.writing, c.ready, c.allocated) == (0, 0, 3, 4)
    t.allocate(0)
    t.free([2])
    t.allocate(1)  # slot 2, WRITING
    with pytest.raises(ValueError, match="reuse: slot 2 is writing, expected ready"):
        t.reuse([0, 2])
    assert t.state(0) == READY  # all or nothing


def test_slot_take_claims_named_free_slots_and_allocate_never_hands_them_out_again():
    """A planner following another's plan takes the slots it names: those leave the free list (taken out
    of the middle of its sorted list), and allocation goes on from the others, lowest first."""
    t = SlotTable(6)
    t.take([2, 0])
    assert [t.state(s) for s in (0, 1, 2)] == [WRITING, FREE, WRITING] and t.num_free == 4
    with pytest.raises(ValueError, match="take: slot 2 is writing, expected free"):
        t.take([3, 2])
    assert t.state(3) == FREE  # all or nothing
    assert t.allocate(2).slots == [1, 3]
    t.free([0])
    t.take([0])
    t.free([0, 2])
    for _ in range(10):  # take and free over and over: the free list stays the FREE slots, once each
        t.take([4])
        t.free([4])
        t.check()
    assert t.allocate(6).slots == [0, 2, 4, 5] and t.num_free == 0
    c = t.counts()
    assert (c.free, c.writing, c.ready) == (0, 6, 0)
    t.check()


def test_slot_table_random_operations_allocate_lowest_free_first_and_keep_invariants():
    """Any mix of allocate / take / commit / reuse / free: every allocation hands out the lowest FREE
    slots in ascending order (fresh stores copy in contiguous runs), and ``check`` holds throughout."""
    rng = random.Random(7)
    t = SlotTable(40)
    for _ in range(2000):
        op = rng.randrange(5)
        free = [s for s in range(40) if t.state(s) == FREE]
        writing = [s for s in range(40) if t.state(s) == WRITING]
        ready = [s for s in range(40) if t.state(s) == READY]
        if op == 0:
            n = rng.randint(0, 6)
            got = t.allocate(n)
            assert got.slots == free[:n] and got.skipped == n - len(got.slots)
        elif op == 1 and free:
            t.take(rng.sample(free, rng.randint(1, min(3, len(free)))))
        elif op == 2 and writing:
            t.commit(rng.sample(writing, rng.randint(1, min(4, len(writing)))))
        elif op == 3 and ready:
            t.reuse(rng.sample(ready, rng.randint(1, min(3, len(ready)))))
        elif op == 4 and (writing or ready):
            pool = writing + ready
            t.free(rng.sample(pool, rng.randint(1, min(4, len(pool)))))
        t.check()
