"""``kvtier gc --config FILE [--dry-run]``: evict blocks until each backend is within its configured capacity.

A backend bounded by kvtier has a ``capacity`` option (``local_disk``); gc removes its least recently used
blocks first (the order the backend itself evicts in: for ``local_disk``, each file's last use as recorded
in its times) until the blocks left total at most the capacity, and reports what it removed per namespace
(``-v``: every key).  Useful after lowering the capacity, or on a directory no running instance trims.
Only this deployment's namespaces' blocks are evicted (see ``kvtier inspect``) unless ``--all-namespaces``:
in a directory shared with other deployments, its own least recently used blocks go first, and it may
stay over when theirs fill it.
Backends without a capacity option (``redis``: bounded by the server's ``maxmemory``; ``s3``: unbounded or
bucket lifecycle rules) are skipped.  Exit status 0, or 1 when a backend could not be trimmed, 2 for a bad
config or flag."""

from __future__ import annotations

import argparse
from collections import defaultdict
from typing import Any

from ...backend_api import BackendError, StoredBlock
from ...units import format_size
from . import _storage_tools as st


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("gc", help="evict least recently used blocks down to each backend's capacity",
                       description=__doc__)
    st.add_common_arguments(p)
    p.add_argument("--dry-run", action="store_true", help="only report what would be evicted")
    p.add_argument("-v", "--verbose", action="store_true", help="list every evicted key")
    p.set_defaults(func=run)


def _per_namespace(blocks: list[StoredBlock]) -> dict[str, dict[str, int]]:
    out: dict[str, dict[str, int]] = defaultdict(lambda: {"blocks": 0, "bytes": 0})
    for blk in blocks:
        d = out[blk.key.partition("/")[0]]
        d["blocks"] += 1
        d["bytes"] += blk.size
    return dict(out)


def _usage(ob: st.OpenedBackend) -> tuple[int, int]:
    assert ob.backend is not None
    n = nbytes = 0
    for blk in ob.backend.scan():
        n += 1
        nbytes += blk.size
    return n, nbytes


def gc_backend(ob: st.OpenedBackend, args: argparse.Namespace, scope: st.Scope) -> dict[str, Any]:
    entry = ob.header()
    if ob.backend is None:
        return entry
    if ob.capacity is None:
        entry["skipped"] = f"no capacity option: {ob.conf.type} is not bounded by kvtier"
        if not args.json:
            print(f"backend {ob.name} ({ob.conf.type}): skipped, {entry['skipped']}")
        return entry
    cap = ob.capacity
    try:
        blocks_before, before = _usage(ob)
        entry.update(blocks_before=blocks_before, bytes_before=before)
        if not args.json:
            state = "within it" if before <= cap else \
                f"{format_size(before - cap)} over: evicting least recently used first"
            print(f"backend {ob.name} ({ob.conf.type}, {ob.location}): {blocks_before} blocks, "
                  f"{format_size(before)} of capacity {format_size(cap)}; {state}")
        removed: list[StoredBlock] = []
        if before > cap:
            with st.progress(args, total=before - cap, unit="B", unit_scale=True, unit_divisor=1024,
                             desc=f"gc {ob.name}") as bar:
                mine = None if scope.all else set(scope.ids(ob.backend)[0])
                removed = ob.backend.evict_to(cap, dry_run=args.dry_run, namespaces=mine,
                                              on_evict=lambda batch: bar.update(sum(b.size for b in batch)))
        blocks_after, after = (blocks_before - len(removed), before - sum(b.size for b in removed)) \
            if args.dry_run else _usage(ob)
    except BackendError as e:
        entry["error"] = st.error_text(e)
        if not args.json:
            print(f"backend {ob.name}: ERROR: {entry['error']}")
        return entry
    entry.update(evicted_blocks=len(removed), evicted_bytes=sum(b.size for b in removed),
                 evicted_by_namespace=_per_namespace(removed), evicted=[b.key for b in removed],
                 blocks_after=blocks_after, bytes_after=after, dry_run=args.dry_run)
    if not args.json and not removed and before > cap:
        print("  nothing evicted: still over (blocks written meanwhile by another process, or other "
              "deployments' blocks, which only --all-namespaces evicts)")
    if not args.json and removed:
        verb = "would evict" if args.dry_run else "evicted"
        print(f"  {verb} {len(removed)} blocks, {format_size(entry['evicted_bytes'])}:")
        for ns, d in entry["evicted_by_namespace"].items():
            print(f"    namespace {ns}: {d['blocks']} blocks, {format_size(d['bytes'])}")
        if args.verbose:
            for b in removed:
                print(f"    {b.key} ({b.size} bytes)")
        print(f"  {'would leave' if args.dry_run else 'now'} {blocks_after} blocks, {format_size(after)} "
              f"of {format_size(cap)}" + ("" if after <= cap else
                                          " (still over: blocks written meanwhile by another process, or other "
                                          "deployments' blocks, which only --all-namespaces evicts)"))
    return entry


def run(args: argparse.Namespace) -> int:
    loaded = st.load(args)
    cfg = loaded.cfg
    if loaded.filled is not None and not args.json:
        print(loaded.across_namespaces(args.config, "trimming each backend to its capacity, least recently "
                                                    "used first, across"))
    with st.open_backends(cfg, args.backend, keys=False) as opened:
        entries = []
        for ob in opened:
            if ob.error and not args.json:
                print(f"backend {ob.name} ({ob.conf.type}): ERROR: {ob.error}")
            entries.append(gc_backend(ob, args, loaded.scope))
    if args.json:
        st.emit_json({"config": args.config, "dry_run": args.dry_run, "backends": entries})
    return 1 if any(e["error"] for e in entries) else 0
