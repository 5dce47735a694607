"""``kvtier run``: the main job.  Replays a workload through the configured tier stack with a real
transformers model (seeded random weights, nothing downloaded) and reports what the tiers saved.

Outputs (in ``--out``): ``requests.parquet`` (one row per request) and ``hit_rate.png`` (hit rate per
tier over the run); the summary is printed."""

from __future__ import annotations

import argparse
import time
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import numpy as np

from ..args import make_out_dir, non_negative_int, out_dir, out_file, positive_int
from ..cli import UserError

if TYPE_CHECKING:
    from ...integrations.engine import RequestResult
    from ...stack import TierStack
    from ...workload import Request


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("run", help="replay a workload through the tier stack with a real model",
                       description=__doc__)
    p.add_argument("--config", metavar="FILE", help="deployment YAML (default: the embedded configs/local.yaml)")
    p.add_argument("--trace", metavar="FILE", help="JSONL or Parquet trace instead of the synthetic chat")
    w = p.add_argument_group("synthetic multi-turn chat (a shared system prompt; each turn extends the "
                             "user's history)")
    w.add_argument("--users", type=int, default=8, help="conversations (default 8)")
    w.add_argument("--turns", type=int, default=4, help="turns per conversation (default 4)")
    w.add_argument("--system-tokens", type=int, default=512, help="shared system prompt length (512)")
    w.add_argument("--question-tokens", type=int, default=64, help="new user tokens per turn (64)")
    w.add_argument("--answer-tokens", type=int, default=32, help="generated tokens per turn (32)")
    w.add_argument("--seed", type=non_negative_int, default=0, help="workload and model seed (0)")
    p.add_argument("--device-blocks", type=positive_int, default=None,
                   help="device block pool size (default: device.num_blocks from the config); smaller "
                        "than the working set to make the host and storage tiers work")
    p.add_argument("--out", type=out_dir, default="kvtier-run", help="output directory (default ./kvtier-run)")
    p.add_argument("--record-trace", type=out_file, metavar="FILE",
                   help="also write the requests served as a JSONL trace (prompts as sent, with the answers "
                        "of earlier turns; arrival times t) that `kvtier simulate --trace` replays")
    p.add_argument("--wait-writes", action="store_true",
                   help="each request's writes to the backends finish before the next request starts, so "
                        "what the backends hold depends on the requests alone (as `kvtier simulate` models "
                        "it); default: writes overlap the next requests, as in a server")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from tqdm import tqdm

    from ...config import load_config
    from ...integrations.engine import CachedEngine
    from ...workload import ChatWorkload, TraceRecorder, load_trace

    cfg = load_config(args.config)
    out = make_out_dir("--out", args.out)
    engine = CachedEngine.from_config(cfg, num_blocks=args.device_blocks, seed=args.seed)
    engine.wait_writes = args.wait_writes
    vocab = engine.model.spec.vocab_size
    results: list[dict[str, float]] = []
    # Every tier below the device has its column, a tier that served nothing too (0, not missing).
    lower = engine.stack.metrics.tiers[1:]  # the stack's tiers in order, device first
    t_start = time.perf_counter()
    try:
        recorder = TraceRecorder(args.record_trace) if args.record_trace else None
    except OSError as e:
        engine.close()
        raise UserError(f"--record-trace {args.record_trace}: {e.strerror or e}") from None

    def serve(req: Request) -> list[int]:
        if req.hashes is not None:
            raise UserError(f"trace row {req.user + 1}: 'hashes' rows can only be simulated (kvtier simulate); "
                            "kvtier run needs token ids")
        if recorder is not None:
            recorder.write(req, time.perf_counter() - t_start)
        try:
            r = engine.run_request(req.tokens, max_new_tokens=req.max_new_tokens, cache_salt=req.cache_salt,
                                   mm=req.mm, lora=req.lora)
        except ValueError as e:
            raise UserError(f"request {len(results) + 1}: {e}") from None
        results.append(_row(len(results), req, r, engine.block_size, lower))
        bar.update(1)
        return r.tokens

    try:
        if args.trace:
            reqs = load_trace(args.trace, vocab_size=vocab, seed=args.seed)
            bar = tqdm(total=len(reqs), unit="req", disable=args.no_progress, desc="kvtier run")
            for req in reqs:
                serve(req)
        else:
            wl = ChatWorkload(args.users, args.turns, args.system_tokens, args.question_tokens,
                              args.answer_tokens, vocab, args.seed)
            bar = tqdm(total=wl.num_requests, unit="req", disable=args.no_progress, desc="kvtier run")
            wl.replay(serve)
        bar.close()
        engine.flush()
        if recorder is not None:
            recorder.close()
        wall = time.perf_counter() - t_start
        stats = engine.stack.stats()
    finally:
        engine.close()
    print(summarize(results, stats, wall, engine.stack))
    _write_parquet(results, out / "requests.parquet")
    _plot(results, out / "hit_rate.png")
    print(f"wrote {out / 'requests.parquet'} and {out / 'hit_rate.png'}"
          + (f"; trace {args.record_trace}" if args.record_trace else ""))
    return 0


def _row(i: int, req: Request, r: RequestResult, block_size: int, lower: Sequence[str]) -> dict[str, float]:
    row = {"request": i, "user": req.user, "turn": req.turn, "prompt_tokens": r.num_prompt_tokens,
           "prompt_blocks": r.num_prompt_blocks, "device_blocks": r.device_blocks,
           "computed_tokens": r.computed_tokens, "saved_tokens": r.saved_tokens,
           "failed_blocks": r.failed_blocks, "stored_blocks": r.stored_blocks,
           "lookup_ms": r.lookup_s * 1e3, "load_ms": r.load_s * 1e3, "compute_ms": r.compute_s * 1e3,
           "store_ms": r.store_s * 1e3, "block_size": block_size}
    for tier in lower:
        row[f"{tier}_blocks"] = 0
    for tier, n in r.loaded_blocks.items():
        row[f"{tier}_blocks"] = n
    return row


def _tiers(results: list[dict[str, float]]) -> list[str]:
    """Columns of per-tier hit blocks, fastest tier first (device, host, then backends in config order)."""
    seen: list[str] = []
    for r in results:
        for k in r:
            if k.endswith("_blocks") and k not in seen and k not in ("prompt_blocks", "failed_blocks",
                                                                     "stored_blocks"):
                seen.append(k)
    first = [t for t in ("device_blocks", "host_blocks") if t in seen or t == "device_blocks"]
    return first + [t for t in seen if t not in first]


def summarize(results: list[dict[str, float]], stats: dict[str, Any], wall: float, stack: TierStack) -> str:
    if not results:
        raise UserError("the workload had no requests")
    tiers = _tiers(results)
    blocks = sum(r["prompt_blocks"] for r in results)
    prompt_tokens = sum(r["prompt_tokens"] for r in results)
    saved = sum(r["saved_tokens"] for r in results)
    lines = [f"{len(results)} requests in {wall:.1f} s; {prompt_tokens} prompt tokens, {blocks} full blocks",
             "hit rate per tier (share of prompt blocks served from it):"]
    for t in tiers:
        n = sum(r.get(t, 0) for r in results)
        lines.append(f"  {t[:-7]:<12} {n:>7} blocks  {100 * n / max(blocks, 1):5.1f}%")
    lines.append(f"prefill tokens saved: {saved} of {prompt_tokens} ({100 * saved / max(prompt_tokens, 1):.1f}%)")
    failed = sum(r["failed_blocks"] for r in results)
    lines.append(f"blocks that failed to load and were recomputed: {failed}")
    lines.append("latency per request, ms (p50 / p90 / p99):")
    for k in ("lookup_ms", "load_ms", "compute_ms", "store_ms"):
        v = np.array([r[k] for r in results])
        lines.append(f"  {k[:-3]:<8} {np.percentile(v, 50):8.2f} {np.percentile(v, 90):8.2f} "
                     f"{np.percentile(v, 99):8.2f}")
    lines.append("tier traffic:")
    lines.extend("  " + ln for ln in stack.summary().splitlines())
    return "\n".join(lines)


def _write_parquet(results: list[dict[str, float]], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = sorted({k for r in results for k in r})
    pq.write_table(pa.table({c: [r.get(c, 0) for r in results] for c in cols}), path)


def _plot(results: list[dict[str, float]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    x = [r["request"] for r in results]
    fig, ax = plt.subplots(figsize=(8, 4))
    bottom = np.zeros(len(results))
    for t in _tiers(results):
        y = np.array([r.get(t, 0) / max(r["prompt_blocks"], 1) for r in results])
        ax.bar(x, y, bottom=bottom, label=t[:-7], width=1.0)
        bottom += y
    ax.set_xlabel("request")
    ax.set_ylabel("share of prompt blocks")
    ax.set_ylim(0, 1)
    ax.set_title("kvtier run: prefix hits per tier")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)
