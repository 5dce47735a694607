"""``kvtier bench tiers``: device <-> host block copies beside the raw copy ceiling of the same run.

Blocks are 2 MiB (32 layers x 2 (K, V) x 16 tokens x 8 kv heads x 128 head dim x bf16) in a
FlashAttention-layout cache (``--layout cpu_attn``: vLLM CPU's head-major cache, whose copies transpose).  Measured, medians over repeats, each copy and its ceiling interleaved so
machine noise hits both alike:

* gather (device -> host slots) and scatter (host slots -> device), through :class:`DeviceTier` and
  through :class:`TransferEngine` (store; load whole and layer by layer);
* the ceiling: one contiguous ``copy_`` of the same number of bytes between the same two memories
  (the KV device and the host slab); goal >= 0.8x;
* for context, a per-layer ``index_select`` of the same blocks (the gather primitive alone).

Without CUDA the "device" is a CPU cache (what CI runs).  With CUDA the host slab is page-locked, the
ceiling is a raw pinned ``copy_`` per direction, and a layer-wise load reports when its first layer is
usable and when its last arrives.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable
from typing import TYPE_CHECKING

from ..args import out_file, positive_int
from ..output import print_table, write_json

if TYPE_CHECKING:
    import torch

    from ...memory.transfer import TransferEngine

HELP = "device <-> host tier block copies (2 MiB blocks) vs raw copy_ of the same bytes (goal >= 0.8x)"
GOAL_RATIO = 0.8
GiB = float(1 << 30)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--device", choices=("auto", "cpu", "cuda"), default="auto",
                        help="where the KV cache lives (auto = cuda when available)")
    parser.add_argument("--num-blocks", type=positive_int, default=None,
                        help="blocks in the KV cache (default 256 on CPU, 1024 on CUDA)")
    parser.add_argument("--batch", type=positive_int, default=64, help="blocks per transfer (default 64 = 128 MiB)")
    parser.add_argument("--layers", type=positive_int, default=32)
    parser.add_argument("--kv-heads", type=positive_int, default=8)
    parser.add_argument("--head-dim", type=positive_int, default=128)
    parser.add_argument("--block-size", type=positive_int, default=16)
    parser.add_argument("--layout", choices=("flash_attn", "cpu_attn", "cpu_attn_amx"), default="flash_attn",
                        help="KV layout of the cache: cpu_attn / cpu_attn_amx (vLLM CPU's head-major cache as "
                             "its vec / amx kernels write it) copies rearrange elements")
    parser.add_argument("--payload", choices=("canonical", "engine"), default="canonical",
                        help="storage.payload: engine moves a cpu_attn / cpu_attn_amx block as the engine keeps it")
    parser.add_argument("--repeats", type=positive_int, default=9, help="timed repeats, median reported")
    parser.add_argument("--threads", type=positive_int, default=None,
                        help="torch intra-op threads (default: torch's); 1 gives steadier figures on a busy host")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a ratio misses the goal")
    parser.add_argument("--json", type=out_file, metavar="PATH", help="also write the figures as JSON")


def _interleaved(fns: dict[str, Callable[[], object]], repeats: int, sync: Callable[[], None]) -> dict[str, float]:
    """Median seconds of each fn, timing them round-robin (one warm-up round first)."""
    times: dict[str, list[float]] = {k: [] for k in fns}
    for r in range(repeats + 1):
        for k, fn in fns.items():
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            if r:
                times[k].append(time.perf_counter() - t0)
    return {k: statistics.median(v) for k, v in times.items()}


def run(args: argparse.Namespace) -> int:
    # torch and the tiers are imported here, not at the top: `kvtier --help` imports every command's
    # module to list it, and must not wait seconds for torch.
    import torch

    from ...format.layout import KVLayout
    from ...memory.copy2d import memcpy2d_available
    from ...memory.device import DeviceTier
    from ...memory.host import HostTier
    from ...memory.transfer import TransferEngine

    if args.threads:
        torch.set_num_threads(args.threads)
    cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    dev_name = "cuda" if cuda else "cpu"
    nblocks = args.num_blocks or (1024 if cuda else 256)
    n = min(args.batch, nblocks)
    if cuda and args.layout.startswith("cpu_attn"):
        raise SystemExit(f"kvtier bench tiers: --layout {args.layout} is vLLM's CPU layout; use --device cpu")
    layout = KVLayout(args.layout, args.layers, nblocks, args.block_size, args.kv_heads, args.head_dim,
                      torch.bfloat16, payload=args.payload)
    bn = layout.block_nbytes
    nbytes = n * bn
    print(f"kvtier bench tiers: {dev_name}, {args.layout} ({args.payload} payload), {bn / 2**20:.2f} MiB blocks, cache {nblocks} blocks "
          f"({nblocks * bn / GiB:.2f} GiB), batches of {n} ({nbytes / 2**20:.0f} MiB), "
          f"torch threads {torch.get_num_threads()}")

    dev = DeviceTier.allocate(layout, dev_name)
    for t in dev.tensors:
        t.view(torch.int16).random_()  # real bytes, not zeros (and not lazily-mapped pages)
    host = HostTier(bn, num_slots=2 * n, pinned="auto" if cuda else False)
    host.slab.random_()
    ids = torch.randperm(nblocks)[:n].sort().values[torch.randperm(n)]  # distinct, unordered
    slots = list(range(n))  # a fresh tier hands out contiguous runs
    scattered = torch.randperm(2 * n)[:n].tolist()  # a fragmented tier
    flat = torch.empty(nbytes, dtype=torch.uint8, device=dev_name)  # ceiling buffer on the KV device
    host_flat = host.slab[:n].view(-1)

    def sync() -> None:
        if cuda:
            torch.cuda.synchronize()

    eng = TransferEngine(dev, host)
    store_slots = list(range(n, 2 * n))
    host.commit(host.allocate(n).slots)  # slots 0..n-1 hold blocks to load
    w = host.allocate(n).slots  # slots n..2n-1 are filled by stores (kept WRITING)
    assert w == store_slots

    def eng_store() -> None:
        r = eng.store(ids, store_slots).wait(60)
        assert r.all_ok, r.errors

    def eng_load(layerwise: bool) -> Callable[[], None]:
        def f() -> None:
            r = eng.load(slots, ids, layerwise=layerwise).wait(60)
            assert r.all_ok, r.errors
        return f

    def index_select_ceiling() -> None:
        for t in dev.tensors:
            torch.index_select(t, 0 if layout.head_major else 1, ids_dev)

    ids_dev = ids.to(dev_name)
    fns: dict[str, Callable[[], object]] = {
        "copy_ d2h": lambda: host_flat.copy_(flat, non_blocking=cuda),
        "gather": lambda: dev.gather(ids, host.slab, slots),
        "gather scattered": lambda: dev.gather(ids, host.slab, scattered),
        "store (engine)": eng_store,
        "copy_ h2d": lambda: flat.copy_(host_flat, non_blocking=cuda),
        "scatter": lambda: dev.scatter(host.slab, ids, slots),
        "scatter scattered": lambda: dev.scatter(host.slab, ids, scattered),
        "load (engine)": eng_load(False),
        "load layerwise (engine)": eng_load(True),
        "index_select/layer": index_select_ceiling,
    }
    if cuda:
        # Layer-wise loads through the host tier compare with per-layer copies, which only a GPU makes
        # different from whole-block ones (2-D DMA per layer).
        def scatter_layerwise() -> None:
            for i in range(layout.num_layers):
                dev.scatter(host.slab, ids, slots, layers=[i])

        fns["scatter layerwise"] = scatter_layerwise
    secs = _interleaved(fns, args.repeats, sync)
    gbps = {k: nbytes / s / GiB for k, s in secs.items()}

    rows = []
    ratios = {}
    for name in fns:
        if name.startswith("copy_") or name == "index_select/layer":
            continue
        ceiling = "copy_ d2h" if name.startswith(("gather", "store")) else "copy_ h2d"
        ratios[name] = gbps[name] / gbps[ceiling]
        rows.append({"op": name, "GiB/s": gbps[name], "ceiling": ceiling, "ceiling GiB/s": gbps[ceiling],
                     "ratio": ratios[name], "ms": secs[name] * 1e3})
    rows.append({"op": "index_select/layer (context)", "GiB/s": gbps["index_select/layer"],
                 "ceiling": "-", "ms": secs["index_select/layer"] * 1e3})
    print_table(rows, ["op", "GiB/s", "ceiling", "ceiling GiB/s", "ratio", "ms"])

    result = {"device": dev_name, "block_nbytes": bn, "num_blocks": nblocks, "batch": n,
              "torch_threads": torch.get_num_threads(), "gib_per_s": gbps, "ratios": ratios,
              "goal_ratio": GOAL_RATIO, "pinned_host": host.pin_memory}
    if cuda:
        result.update(_layerwise_timing(eng, slots, ids, layout.num_layers, args.repeats))
        result["memcpy2d"] = memcpy2d_available()
    eng.close()
    write_json(args.json, result)

    headline = [k for k in ("gather", "scatter", "store (engine)", "load (engine)") if k in ratios]
    missed = [k for k in headline if ratios[k] < GOAL_RATIO]
    verdict = "met" if not missed else "MISSED by " + ", ".join(missed)
    print(f"goal >= {GOAL_RATIO:.1f}x of copy_: {verdict}")
    return 1 if (args.strict and missed) else 0


def _layerwise_timing(eng: TransferEngine, slots: list[int], ids: torch.Tensor, num_layers: int,
                      repeats: int) -> dict[str, float]:
    """Submit a layer-wise load; time until layer 0 is usable and until the last layer has landed."""
    import torch

    first, last = [], []
    for r in range(repeats + 1):
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        h = eng.load(slots, ids, layerwise=True)
        h.wait_layer(0, timeout=60, sync=True)
        t1 = time.perf_counter()
        h.wait_layer(num_layers - 1, timeout=60, sync=True)
        t2 = time.perf_counter()
        assert h.wait(60).all_ok
        if r:
            first.append(t1 - t0)
            last.append(t2 - t0)
    f, la = statistics.median(first) * 1e3, statistics.median(last) * 1e3
    print(f"layer-wise load of {len(slots)} blocks: layer 0 usable after {f:.2f} ms, "
          f"last layer after {la:.2f} ms")
    return {"layerwise_first_layer_ms": f, "layerwise_last_layer_ms": la}
