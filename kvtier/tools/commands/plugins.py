"""``kvtier plugins``: every installed plugin with its group, name, distribution and version."""

from __future__ import annotations

import argparse

from ... import plugins
from ..output import print_table


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("plugins", help="list installed backends and policies (entry points)",
                       description=__doc__)
    p.add_argument("--check", action="store_true", help="also import each plugin and report failures")
    p.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    rows = []
    failed = 0
    for info in plugins.available():
        row = {"group": info.group, "name": info.name, "distribution": info.distribution,
               "version": info.version, "object": info.value}
        if args.check:
            kind = next(k for k, g in plugins.GROUPS.items() if g == info.group)
            try:
                plugins.load(kind, info.name)
                row["status"] = "ok"
            except plugins.PluginError as e:
                row["status"] = f"error: {e.__cause__ or e}"
                failed += 1
        rows.append(row)
    cols = ["group", "name", "distribution", "version", "object"] + (["status"] if args.check else [])
    print_table(rows, cols)
    return 1 if failed else 0
