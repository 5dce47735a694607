"""``kvtier simulate``: size the tiers before buying them.

Replays a workload (a JSONL / Parquet trace, or ``kvtier run``'s synthetic chat) through the engine and a
byte-free twin of the tier stack (the real block index, lookup and policies; nothing is copied) for
every point of a grid of config overrides, and reports per point: hit rate per tier, prefill tokens
saved, bytes written and read per tier, evictions, and the store traffic each backend would see (values
per second at the trace's timestamps).  Writes ``simulate.parquet`` (one row per point) and
``hit_rate.png`` (hit rate vs capacity per tier, one curve per combination of the other axes).

Example:
  kvtier simulate --config deploy.yaml --trace trace.jsonl \\
      --grid host.capacity=1GiB,4GiB,16GiB --grid policies.write.name=write_through,write_back
"""

from __future__ import annotations

import argparse
import os
import tempfile
import time
from concurrent.futures import ProcessPoolExecutor
from pathlib import Path
from typing import TYPE_CHECKING, Any

from ..args import make_out_dir, non_negative_int, out_dir, positive_int
from ..cli import UserError

if TYPE_CHECKING:
    from ...simulate import SimResult


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("simulate", help="replay a trace through the tiers for a grid of configs (no bytes moved)",
                       description=__doc__, formatter_class=_raw())
    p.add_argument("--config", metavar="FILE", help="deployment YAML (default: the embedded configs/local.yaml)")
    p.add_argument("--trace", metavar="FILE",
                   help="JSONL or Parquet trace: rows with t (s), tokens | hashes (hex) | length, and "
                        "optionally cache_salt, mm, lora, max_new_tokens (default: the synthetic chat)")
    p.add_argument("--grid", metavar="PATH=V1,V2", action="append", default=[],
                   help="a config key and the values to try, e.g. host.capacity=1GiB,4GiB or "
                        "backends[0].options.capacity=50GiB,200GiB; repeat for more axes (all combinations)")
    w = p.add_argument_group("synthetic multi-turn chat (as kvtier run)")
    w.add_argument("--users", type=int, default=8)
    w.add_argument("--turns", type=int, default=4)
    w.add_argument("--system-tokens", type=int, default=512)
    w.add_argument("--question-tokens", type=int, default=64)
    w.add_argument("--answer-tokens", type=int, default=32)
    w.add_argument("--seed", type=non_negative_int, default=0)
    p.add_argument("--device-blocks", type=positive_int, default=None,
                   help="device block pool size (default: device.num_blocks), as kvtier run --device-blocks")
    p.add_argument("--rate", type=float, default=10.0,
                   help="arrivals per second for requests without a timestamp (default 10)")
    p.add_argument("--jobs", type=non_negative_int, default=0, help="grid points simulated at once (default: CPU cores)")
    p.add_argument("--out", type=out_dir, default="kvtier-simulate", help="output directory (default ./kvtier-simulate)")
    p.set_defaults(func=run)


def _raw() -> type[argparse.RawDescriptionHelpFormatter]:
    import argparse

    return argparse.RawDescriptionHelpFormatter


def _workload(args: argparse.Namespace) -> Any:
    from ...workload import ChatWorkload, iter_trace

    if args.trace:
        if not Path(args.trace).exists():
            raise UserError(f"--trace {args.trace}: no such file")
        return iter_trace(args.trace, seed=args.seed)
    return ChatWorkload(args.users, args.turns, args.system_tokens, args.question_tokens, args.answer_tokens,
                        seed=args.seed)


def _point(args: argparse.Namespace, i: int, hashed: str | None = None) -> SimResult:
    """Simulate grid point ``i`` (in a worker process: everything is rebuilt from the arguments), from
    the trace hashed once for its keys when there is one."""
    from ...simulate import simulate
    from ...simulate.grid import grid_points, parse_axes
    from ...simulate.hashed import iter_hashed

    point = grid_points(args.config, parse_axes(args.grid))[i]
    workload = iter_hashed(hashed) if hashed else _workload(args)
    # The first point also times the raw ceiling on its prompt keys (one is enough: the keys are the same).
    return simulate(point.config, workload, device_blocks=args.device_blocks, rate=args.rate, seed=args.seed,
                    ceiling=i == 0)


def _hash_once(args: argparse.Namespace, points: list[Any], tmp: Path) -> tuple[list[str | None], float]:
    """With a trace and several grid points: hash the trace once per distinct way of keying blocks (block
    size, algorithm, seed) into ``tmp``; each point's file, and the seconds spent hashing."""
    from ...simulate.hashed import hash_trace

    if not args.trace or len(points) < 2:
        return [None] * len(points), 0.0
    files: dict[tuple[Any, ...], str] = {}
    out: list[str | None] = []
    hash_s = 0.0
    for p in points:
        hasher = p.config.namespace().hasher()
        how = (hasher.block_size, hasher.algo, repr(hasher.seed))
        if how not in files:
            files[how] = str(tmp / f"trace-{len(files)}.bin")
            hash_s += hash_trace(_workload(args), hasher, files[how])[1]
        out.append(files[how])
    return out, hash_s


def run(args: argparse.Namespace) -> int:
    from ...simulate.grid import grid_points, parse_axes
    from ...simulate.report import plot, rows, table, write_parquet

    if args.rate <= 0:
        raise UserError(f"--rate: expected > 0, got {args.rate}")
    axes = parse_axes(args.grid)
    points = grid_points(args.config, axes)  # every point validated before anything runs
    if not args.trace:
        _workload(args)  # the chat's parameters, checked now
    jobs = min(len(points), args.jobs or os.cpu_count() or 1)
    out = make_out_dir("--out", args.out)
    t0 = time.perf_counter()
    with tempfile.TemporaryDirectory(prefix="kvtier-simulate-") as tmp:
        hashed, hash_s = _hash_once(args, points, Path(tmp))
        if jobs > 1:
            with ProcessPoolExecutor(jobs) as pool:
                results = list(pool.map(_point, [args] * len(points), range(len(points)), hashed))
        else:
            results = [_point(args, i, hashed[i]) for i in range(len(points))]
    wall = time.perf_counter() - t0
    recs = rows([p.values for p in points], results)
    r0 = results[0]
    ops = sum(r.block_ops for r in results)
    sim_s = sum(r.sim_s for r in results)
    speed = ops / max(sim_s, 1e-9)
    print(f"{len(points)} grid point(s) x {r0.requests} requests ({r0.prompt_blocks} prompt blocks of "
          f"{r0.block_nbytes} B) in {wall:.1f} s with {jobs} process(es); {speed:,.0f} block "
          f"lookups+updates/s per process (hashing {hash_s + sum(r.hash_s for r in results):.1f} s apart)")
    if r0.ceiling_ops_per_s:  # 0 without a full prompt block: nothing was timed, nothing to divide by
        print(f"raw ceiling, same prompt keys through a bare OrderedDict LRU in this run: "
              f"{r0.ceiling_ops_per_s:,.0f} lookups+updates/s; simulated / ceiling = "
              f"{speed / r0.ceiling_ops_per_s:.3f}")
    print(table(axes, recs, results))
    write_parquet(recs, out / "simulate.parquet")
    plot(axes, recs, results, out / "hit_rate.png")
    print(f"wrote {out / 'simulate.parquet'} and {out / 'hit_rate.png'}")
    return 0
