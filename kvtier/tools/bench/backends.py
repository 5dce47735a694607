"""``kvtier bench backends``: put / get GiB/s of every storage backend beside its ceiling, same run, same
payloads.

Each backend's cases live in ``kvtier/tools/bench/backend_<name>.py``, which exposes
``run_cases(block_sizes: list[int], total_bytes: int, repeats: int) -> list[dict]`` returning rows
``{"backend", "op", "block_bytes", "gib_s", "ceiling_gib_s", "ratio", "note"}`` (``op``: ``put``, ``get``, or
a variant such as ``put full`` or ``get cold``; the summary gives each op's median ratio), medians over
``repeats``; ``ratio`` = backend / ceiling.  A module whose import or set-up fails (no ``redis-server``, no
moto) prints a ``SKIP`` line with the reason and the run goes on.

Default block sizes: 2 MiB = 32 layers x 8 kv heads x 128 head dim x 2 bytes (bf16) x 16 tokens x 2 (K, V),
and 256 KiB.

``--security authenticate,encrypt``: each backend's put / get in those security modes beside mode none and
beside the raw primitive's speed over the same bytes on the same threads, in the same run
(``kvtier.tools.bench._security``), and the candidate MACs' and ciphers' raw speed.

``--grouped K``: puts of values of K blocks (``storage.block_tokens``) on disk and Redis, as segments (the
way down now) and joined first (the way before), beside the same values already in one buffer
(``kvtier.tools.bench._grouped``).
"""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import statistics
import sys
import time
import traceback
from typing import Any

from ..args import int_at_least, out_file, positive_int, positive_size, positive_sizes
from ..output import print_table, write_json

HELP = "storage backends put/get GiB/s beside each one's ceiling (disk: raw files; redis: wire; s3: boto3)"
DEFAULT_BLOCKS = (2 * 2**20, 256 * 2**10)
COLUMNS = ["backend", "op", "block", "gib_s", "ceiling_gib_s", "ratio"]


def discover() -> list[str]:
    """Backend names that have a ``backend_<name>`` bench module."""
    from .. import bench

    return sorted(m.name[len("backend_"):] for m in pkgutil.iter_modules(bench.__path__)
                  if m.name.startswith("backend_"))


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--backends", default=",".join(discover()),
                   help=f"comma-separated (default: all = {','.join(discover())})")
    p.add_argument("--block-sizes", type=positive_sizes, default="2MiB,256KiB",
                   help='comma-separated block sizes (default "2MiB,256KiB")')
    p.add_argument("--total", type=positive_size, default="1GiB",
                   help='bytes moved per case and repeat (default "1GiB"; use less for a quick look)')
    p.add_argument("--repeats", type=positive_int, default=5, help="timed repeats per case; medians (default 5)")
    p.add_argument("--security", default="", metavar="MODES",
                   help="comma-separated security modes (authenticate, encrypt) to measure on every backend "
                        "beside mode none and the raw primitive (default: none)")
    p.add_argument("--grouped", type=int_at_least(2), default=0, metavar="K",
                   help="also put values of K >= 2 blocks each (storage.block_tokens) on disk and redis: as segments, "
                        "joined first, and already in one buffer (default 0: not measured)")
    p.add_argument("--json", type=out_file, metavar="PATH", help="write the figures as JSON")


def run(args: argparse.Namespace) -> int:
    wanted = [b.strip() for b in args.backends.split(",") if b.strip()]
    modes = [m.strip() for m in getattr(args, "security", "").split(",") if m.strip()]
    bad = [m for m in modes if m not in ("authenticate", "encrypt")]
    if bad:
        print(f"--security: expected authenticate and/or encrypt, got {', '.join(bad)}", file=sys.stderr)
        return 2
    sizes = args.block_sizes  # parsed and checked already (positive_sizes)
    total = args.total  # a size already (positive_size)
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for name in wanted:
        t0 = time.perf_counter()
        try:
            mod = importlib.import_module(f"{__package__}.backend_{name}")
            got = mod.run_cases(sizes, total, args.repeats)
        except ModuleNotFoundError as e:
            if e.name == f"{__package__}.backend_{name}":
                skipped[name] = f"no benchmark module backend_{name} (have: {', '.join(discover())})"
            else:
                skipped[name] = f"{type(e).__name__}: {e}"
        except Exception as e:  # noqa: BLE001 - one backend's set-up failure must not stop the others
            skipped[name] = f"{type(e).__name__}: {e}"
            if getattr(args, "verbose", False):
                traceback.print_exc()
        else:
            rows.extend(got)
            print(f"{name}: {len(got)} cases in {time.perf_counter() - t0:.1f}s", file=sys.stderr)
            continue
        print(f"SKIP {name}: {skipped[name]}")
    if getattr(args, "grouped", 0) > 1:
        from . import _grouped as grouped

        rows.extend(grouped.run_cases(wanted, args.grouped, sizes, total, args.repeats, skipped))
    if modes:
        from . import _security as security

        rows.extend(security.run_cases(wanted, modes, sizes, total, args.repeats, skipped))
    if rows:
        table = [{**r, "block": _fmt_block(r["block_bytes"])} for r in rows]
        # A backend may add its own figures (a second ceiling, start-up time): shown after the standard ones.
        extra = [k for r in rows for k in r if k not in (*COLUMNS, "block_bytes", "note")]
        print_table(table, COLUMNS + list(dict.fromkeys(extra)) + ["note"])
    summary = {}
    for name in sorted({r["backend"] for r in rows}):
        for op in dict.fromkeys(r["op"] for r in rows):
            ratios = [r["ratio"] for r in rows if r["backend"] == name and r["op"] == op and r["ratio"] is not None]
            if ratios:
                summary[f"{name}_{op.replace(' ', '_')}_median_ratio"] = statistics.median(ratios)
    if summary:
        print("median ratios: " + ", ".join(f"{k.removesuffix('_median_ratio')} {v:.2f}x"
                                            for k, v in summary.items()))
    write_json(args.json, {"rows": rows, "summary": summary, "skipped": skipped,
                           "block_sizes": sizes, "total_bytes": total, "repeats": args.repeats})
    return 0 if rows or not wanted else 1


def _fmt_block(n: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"
