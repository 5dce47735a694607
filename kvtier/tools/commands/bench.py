"""``kvtier bench NAME``: every module in ``kvtier/tools/bench/`` with ``HELP``, ``add_arguments(parser)`` and
``run(args) -> int`` is a benchmark.  ``_*`` modules are helpers and ``backend_*`` modules are the
per-backend cases of ``kvtier bench backends``, so neither is a command of its own."""

from __future__ import annotations

import argparse
import importlib
import pkgutil


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    from .. import bench

    p = sub.add_parser("bench", help="benchmarks: throughput beside the raw ceiling of the same run")
    bsub = p.add_subparsers(dest="bench", metavar="NAME", required=True)
    for mod in sorted(pkgutil.iter_modules(bench.__path__), key=lambda m: m.name):
        if mod.name.startswith(("_", "backend_")):
            continue
        m = importlib.import_module(f"{bench.__name__}.{mod.name}")
        # disk_scale is spelt disk-scale on the command line (the issue's and the docs' name)
        bp = bsub.add_parser(mod.name.replace("_", "-"), help=m.HELP, description=m.HELP)
        m.add_arguments(bp)
        bp.set_defaults(func=m.run)
