"""``kvtier bench index``: longest-prefix lookup of an 8192-block chain and bytes per entry at 1 M entries.

Memory is measured with tracemalloc over the build of the whole index, key ``bytes`` objects included
(the caller's list of keys is dropped before reading, so only what the index keeps alive counts).  The
lookup runs against that same 1 M-entry index, beside its ceiling: the same 8192 probes as a bare
``dict.get`` loop over the index's own dict, in the same run.
"""

from __future__ import annotations

import argparse
import gc
import os
import time
import tracemalloc
from typing import Any

from ...index import BlockIndex, Tier
from ..args import out_file, positive_int
from ..output import print_table, write_json
from ._util import median_time

HELP = "block index: 8192-block prefix lookup (goal <= 2 ms) and bytes/entry at 1M entries (goal <= 250 B)"

GOAL_LOOKUP_MS = 2.0
GOAL_BYTES_PER_ENTRY = 250.0


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--entries", type=positive_int, default=1_000_000, help="index size (default 1000000)")
    parser.add_argument("--chain", type=positive_int, default=8192, help="prefix chain length (default 8192)")
    parser.add_argument("--key-size", type=int, default=32, choices=(16, 32),
                        help="key bytes: 32 = sha256_cbor, 16 = xxh3_128 (default 32)")
    parser.add_argument("--repeats", type=positive_int, default=21, help="timed repeats, median reported")
    parser.add_argument("--strict", action="store_true", help="exit 1 if a goal is missed")
    parser.add_argument("--json", type=out_file, metavar="PATH", help="also write the figures as JSON")


def _build(n: int, key_size: int, chain_len: int) -> tuple[BlockIndex, list[bytes], float, float, float]:
    """Build an n-entry index under tracemalloc; return it, the chain keys, bytes/entry, peak/entry, secs.

    Mix: blocks 0..2047 on device (and host), 2048..262143 on host, every block in backend 0, so the
    chain is device for 2048 blocks, host for the rest up to 8192 (and backend 0 beyond).
    """
    blob = os.urandom(n * key_size)  # allocated before tracing starts: it is scratch, not index memory
    gc.collect()
    tracemalloc.start()
    t0 = time.perf_counter()
    keys = [blob[i:i + key_size] for i in range(0, n * key_size, key_size)]
    ix = BlockIndex()
    insert = ix.insert
    for i, k in enumerate(keys):
        insert(k, device=i if i < 2048 else None, host=i if i < 262_144 else None, backends=(0,))
    secs = time.perf_counter() - t0
    chain = keys[:chain_len]
    del keys
    gc.collect()
    cur, peak = tracemalloc.get_traced_memory()
    tracemalloc.stop()  # (the chain list, 8 B a chain block, is still counted: < 0.1 B/entry at 1 M)
    return ix, chain, cur / n, peak / n, secs


def run(args: argparse.Namespace) -> int:
    n = max(1, args.entries)
    chain_len = min(args.chain, n)
    ix, chain, per_entry, peak_per_entry, build_s = _build(n, args.key_size, chain_len)

    m = ix.lookup_prefix(chain)
    assert m.length == chain_len, f"chain found {m.length} of {chain_len} blocks"
    runs = ", ".join(f"{Tier.label(t)} {b - a}" for t, a, b in m.runs())

    lookup_s = median_time(lambda: ix.lookup_prefix(chain), repeats=args.repeats, warmup=2)
    assert ix.prefix_tiers(chain) == [Tier(t) for t in m.tiers.tolist()]
    tiers_s = median_time(lambda: ix.prefix_tiers(chain), repeats=args.repeats, warmup=2)
    get = ix._slots.get  # the ceiling: the same probes into the same dict, nothing else

    def bare() -> list[int | None]:
        return [get(k) for k in chain]

    ceiling_s = median_time(bare, repeats=args.repeats, warmup=2)

    # single-key operations, per op (informational): touch, pin+unpin, clear+set device
    sample = chain[:2048]

    def touch() -> None:
        for k in sample:
            ix.touch(k, 0.0)

    def pin_unpin() -> None:
        for k in sample:
            ix.pin(k)
            ix.unpin(k)

    def move_device() -> None:
        for i, k in enumerate(sample):
            ix.clear_device(k)
            ix.set_device(k, i)

    per_op = {name: median_time(fn, repeats=5) / len(sample) for name, fn in
              (("touch", touch), ("pin_unpin", pin_unpin), ("clear_set_device", move_device))}

    lookup_ms = lookup_s * 1e3
    ok_lookup = lookup_ms <= GOAL_LOOKUP_MS
    ok_mem = per_entry <= GOAL_BYTES_PER_ENTRY
    rows: list[dict[str, Any]] = [
        {"metric": f"prefix lookup, {chain_len} blocks", "value": lookup_ms, "unit": "ms",
         "goal": f"<= {GOAL_LOOKUP_MS}", "result": "pass" if ok_lookup else "FAIL"},
        {"metric": "  ceiling: bare dict.get loop", "value": ceiling_s * 1e3, "unit": "ms",
         "goal": "", "result": f"lookup/ceiling = {lookup_s / ceiling_s:.2f}x"},
        {"metric": "  tiers only (prefix_tiers: the manager's)", "value": tiers_s * 1e3, "unit": "ms",
         "goal": "", "result": f"tiers/ceiling = {tiers_s / ceiling_s:.2f}x"},
        {"metric": f"memory at {n:,} entries ({args.key_size} B keys)", "value": per_entry,
         "unit": "B/entry", "goal": f"<= {GOAL_BYTES_PER_ENTRY:.0f}", "result": "pass" if ok_mem else "FAIL"},
        {"metric": "  peak during build", "value": peak_per_entry, "unit": "B/entry", "goal": "", "result": ""},
        {"metric": "  build (insert one by one, traced)", "value": build_s / n * 1e9, "unit": "ns/entry",
         "goal": "", "result": ""},
        *({"metric": f"  {name}", "value": s * 1e9, "unit": "ns/op", "goal": "", "result": ""}
          for name, s in per_op.items()),
    ]
    print(f"kvtier bench index: chain = {runs}")
    print_table(rows, ["metric", "value", "unit", "goal", "result"])
    write_json(args.json, {
        "entries": n, "chain": chain_len, "key_size": args.key_size, "repeats": args.repeats,
        "lookup_ms": lookup_ms, "ceiling_dict_get_ms": ceiling_s * 1e3, "ratio_vs_ceiling": lookup_s / ceiling_s,
        "bytes_per_entry": per_entry, "peak_bytes_per_entry": peak_per_entry,
        "build_ns_per_entry": build_s / n * 1e9, "per_op_ns": {k: v * 1e9 for k, v in per_op.items()},
        "goals": {"lookup_ms": GOAL_LOOKUP_MS, "bytes_per_entry": GOAL_BYTES_PER_ENTRY},
        "pass": {"lookup": ok_lookup, "memory": ok_mem},
    })
    return 1 if args.strict and not (ok_lookup and ok_mem) else 0
