"""CUDA: the same round trips as on CPU with a page-locked host slab, streams and events, ordering after the
caller's compute, and layer-wise loads whose first layer is usable before the last arrives.

Skipped only when CUDA is absent."""

from __future__ import annotations

import time

import pytest
import torch

import kvtier.memory.copy2d as copy2d_mod
import kvtier.memory.device as device_mod
from kvtier.format.layout import KVLayout
from kvtier.memory.copy2d import memcpy2d_available
from kvtier.memory.device import DeviceTier
from kvtier.memory.host import HostTier
from kvtier.memory.host_slots import READY
from kvtier.memory.rows import to_payload
from kvtier.memory.transfer import TransferEngine

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")]

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
KINDS = [("flash_attn", None), ("flashinfer", None), ("mla", None), ("stacked", None),
         ("stacked", "flashinfer"), ("stacked", "mla")]


def make_layout(kind, inner=None, dtype=torch.bfloat16, L=3, N=24, B=16, H=2, D=64) -> KVLayout:
    mla = "mla" in (kind, inner)
    return KVLayout(kind, L, N, B, 1 if mla else H, D, dtype, inner)


def random_tensors(layout: KVLayout, seed: int = 0, device: str = "cuda") -> list[torch.Tensor]:
    """Random bytes (never zeros, NaN patterns included) in the layout's dtype and shapes."""
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(1, 256, (layout.itemsize * torch.Size(s).numel(),), dtype=torch.uint8, generator=g)
            .view(layout.dtype).view(s).to(device) for s in layout.tensor_shapes()]


def pinned_host(layout: KVLayout, slots: int) -> HostTier:
    host = HostTier(layout.block_nbytes, num_slots=slots, pinned=True)
    assert host.pin_memory and host.slab.is_pinned()
    return host


@pytest.mark.parametrize("path", ["kernel", "torch"])
@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kind,inner", KINDS, ids=lambda k: str(k))
def test_cuda_round_trip_bit_exact_through_pinned_host(kind, inner, dtype, path):
    """``path``: the rows of a batch in one Triton launch (kvtier.memory._cuda_rows), or torch's op per
    layer-component (where Triton does not import)."""
    layout = make_layout(kind, inner, dtype)
    cpu = random_tensors(layout, device="cpu")
    dev = DeviceTier(layout, [t.cuda() for t in cpu], device="cuda")
    if path == "kernel":
        pytest.importorskip("triton")
        assert dev._codec.row_kernel() is not None
    else:
        dev._codec._kernel = None
    ids = [17, 3, 22, 8]
    want = to_payload(layout, cpu, ids)  # the CPU codec is the reference
    host = pinned_host(layout, 10)
    dev.gather(ids, host.slab, [9, 0, 4, 5])  # scattered + contiguous host rows
    torch.cuda.synchronize()
    assert torch.equal(host.slab[[9, 0, 4, 5]], want)
    dev.scatter(host.slab, [0, 1, 2, 23], [9, 0, 4, 5])
    torch.cuda.synchronize()
    assert torch.equal(dev.read_blocks([0, 1, 2, 23]), want)
    # Layer by layer (2-D copies) lands the same bytes.
    for t in dev.tensors:
        t.view(torch.uint8).fill_(0)
    for layer in range(layout.num_layers):
        dev.scatter(host.slab, [5, 6, 7, 11], [9, 0, 4, 5], layers=[layer])
    assert torch.equal(dev.read_blocks([5, 6, 7, 11]), want)
    # Same-device buffers take the direct path.
    buf = torch.zeros((6, layout.block_nbytes), dtype=torch.uint8, device="cuda")
    dev.gather([5, 6, 7, 11], buf, [5, 1, 3, 0])  # the blocks the layer-wise loads just filled
    assert torch.equal(buf[[5, 1, 3, 0]].cpu(), want)
    host.close()
    assert (dev._codec.row_kernel() is not None) == (path == "kernel")  # never a silent fallback


@pytest.mark.parametrize("force_torch", [False, True], ids=["memcpy2d", "torch-copy"])
def test_layerwise_paths_agree(monkeypatch, force_torch):
    monkeypatch.setattr(copy2d_mod, "FORCE_TORCH_2D", force_torch)
    print("cudaMemcpy2DAsync available:", memcpy2d_available())
    layout = make_layout("flash_attn", N=40)
    dev = DeviceTier(layout, random_tensors(layout))
    host = pinned_host(layout, 16)
    ids = list(range(0, 40, 3))[:12]
    slots = [15, 14, 2, 3, 4, 5, 9, 10, 0, 1, 12, 7]
    want = dev.read_blocks(ids)
    host.slab[slots] = want
    out = DeviceTier(layout, random_tensors(layout, seed=7))
    for layer in range(layout.num_layers):
        out.scatter(host.slab, ids, slots, layers=[layer])
    assert torch.equal(out.read_blocks(ids), want)
    # A layer-wise gather (D2H 2-D copies) too.
    host.slab.zero_()
    for layer in range(layout.num_layers):
        dev.gather(ids, host.slab, slots, layers=[layer])
    torch.cuda.synchronize()
    assert torch.equal(host.slab[slots], want)


def test_engine_store_and_layerwise_load_on_streams():
    layout = make_layout("flashinfer", L=6, N=64)
    dev = DeviceTier(layout, random_tensors(layout))
    host = pinned_host(layout, 32)
    ids = [5, 60, 33, 2, 17, 40, 41, 42]
    want = dev.read_blocks(ids)
    with TransferEngine(dev, host, max_staging_bytes=3 * layout.block_nbytes) as eng:  # 3 chunks
        slots = host.allocate(len(ids)).slots
        r = eng.store(ids, slots, keys=[f"k{i}" for i in ids]).wait(30)
        assert r.all_ok, r.errors
        assert torch.equal(host.slab[slots], want)
        dst = [0, 1, 3, 4, 6, 7, 8, 9]
        h = eng.load(slots, dst, layerwise=True)
        copies = []
        for layer in range(layout.num_layers):
            assert h.wait_layer(layer, timeout=30) is True
            # Enqueued after wait_layer on the current stream: ordered after that layer's copies.
            copies.append(dev.tensors[layer][dst].clone())
        r = h.wait(30)
        assert r.all_ok, r.errors
        torch.cuda.synchronize()
        assert torch.equal(dev.read_blocks(dst), want)
        for layer, c in enumerate(copies):  # bytes, not floats: random bits hold NaNs
            assert torch.equal(c.view(torch.uint8), dev.tensors[layer][dst].view(torch.uint8))
        assert all(host.state(s) == READY for s in slots)


def test_store_is_ordered_after_compute_on_the_current_stream():
    layout = make_layout("flash_attn", N=16)
    dev = DeviceTier(layout, random_tensors(layout))
    host = pinned_host(layout, 4)
    fresh = random_tensors(layout, seed=99)
    with TransferEngine(dev, host) as eng:
        if hasattr(torch.cuda, "_sleep"):
            torch.cuda._sleep(50_000_000)  # keep the current stream busy so a racing copy would win
        for t, f in zip(dev.tensors, fresh):
            t.copy_(f)  # the "compute" writing the KV, queued on the current stream
        slots = host.allocate(2).slots
        r = eng.store([3, 9], slots).wait(30)
        assert r.all_ok
        assert torch.equal(host.slab[slots], to_payload(layout, [f.cpu() for f in fresh], [3, 9]))


def test_layerwise_first_layer_usable_before_last():
    layout = make_layout("flash_attn", L=8, N=64)
    dev = DeviceTier(layout, random_tensors(layout))
    host = pinned_host(layout, 32)
    host.commit(host.allocate(32).slots)
    # The hook spaces the layers' issue out, as a big model's per-layer copies would be.
    with TransferEngine(dev, host, layer_hook=lambda d, layer: time.sleep(0.02)) as eng:
        t0 = time.perf_counter()
        h = eng.load(list(range(32)), list(range(32)), layerwise=True)
        assert h.wait_layer(0, timeout=30, sync=True)
        t_first = time.perf_counter() - t0
        assert h.layers_done < layout.num_layers  # later layers are still on their way
        assert h.wait_layer(layout.num_layers - 1, timeout=30, sync=True)
        t_last = time.perf_counter() - t0
        assert h.wait(30).all_ok
    assert t_first < t_last
    print(f"layer 0 usable after {t_first * 1e3:.1f} ms, last layer after {t_last * 1e3:.1f} ms")


def test_cuda_per_block_failures():
    layout = make_layout("mla", N=8)
    dev = DeviceTier(layout, random_tensors(layout))
    host = pinned_host(layout, 4)
    with TransferEngine(dev, host) as eng:
        slots = host.allocate(3).slots
        r = eng.store([1, 8, 2], slots, keys=["a", "b", "c"]).wait(30)
        assert r.ok == (True, False, True) and r.failed_block_ids == [8]
        h = eng.load([slots[0], slots[1], slots[2]], [4, 5, -1])
        r = h.wait(30)
        assert r.ok == (True, False, False) and r.failed_block_ids == [5, -1]
        assert torch.equal(dev.read_blocks([4]), dev.read_blocks([1]))


def test_whole_block_copies_in_layer_groups_stay_ordered_on_the_current_stream(monkeypatch):
    """Whole-block copies between the KV and pinned host rows run a group of layers at a time on two
    streams (kernels on the current one, DMA on the tier's copy stream).  They still start after the work
    queued on the caller's stream, and the caller's stream is ordered after all of their bytes."""
    layout = make_layout("flash_attn", L=20, N=64)
    dev = DeviceTier(layout, random_tensors(layout))
    monkeypatch.setattr(device_mod, "PIPELINE_MIN_GROUP_BYTES", 0)  # 32 blocks of 160 KiB: a small batch
    assert len(dev._layer_groups(None, 32, 1)) == 7  # 20 layers in groups of 3: the pipelined path
    host = pinned_host(layout, 40)
    ids, slots = list(range(40, 8, -1)), list(range(4, 36))  # 32 blocks, one run of host rows
    fresh = random_tensors(layout, seed=7)
    torch.cuda._sleep(50_000_000)  # a busy current stream: a copy that did not wait for it would win
    for t, f in zip(dev.tensors, fresh):
        t.copy_(f)
    dev.gather(ids, host.slab, slots)
    torch.cuda.current_stream().synchronize()  # only the caller's stream: it must cover the DMA
    want = to_payload(layout, [f.cpu() for f in fresh], ids)
    assert torch.equal(host.slab[slots], want)
    dst = list(range(32))
    torch.cuda._sleep(50_000_000)
    dev.scatter(torch.zeros((len(dst), layout.block_nbytes), dtype=torch.uint8, device="cuda"), dst)
    dev.scatter(host.slab, dst, slots)
    assert torch.equal(dev.read_blocks(dst), want)  # read on the current stream, right after
