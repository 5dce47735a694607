"""``kvtier inspect --config FILE``: what the config's backends hold.

For each backend: where it is, its configured capacity, and per namespace of this deployment the fields its
manifest records (model, dtype, shape, TP/PP rank, hash algorithm and seed) with the number of blocks and
their bytes; where the backend counts ``cache_salt`` tenants (``local_disk``, ``redis``, ``s3``), also each
tenant's blocks and bytes in that namespace (by tag, never the salt) and the untenanted rest: the shares a
quota bounds one by one.  Other deployments' namespaces in a shared store are only counted, never named, unless
``--all-namespaces``.  A YAML whose model section an engine fills (``--engine``) has no namespace id of
its own: the namespaces whose manifest matches the model fields it sets are shown.  Read-only: nothing is evicted, verified or deleted.  It needs no key: a backend in
security mode authenticate or encrypt is listed and counted as any other (``kvtier verify`` checks tags).  Exit status 0, or 1 when a
backend could not be read (the others are still shown), 2 for a bad config or flag."""

from __future__ import annotations

import argparse
from collections import defaultdict
from typing import Any

from ...backend_api import BackendError, StorageBackend
from ...keys import Namespace
from ...units import format_size
from . import _storage_tools as st


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("inspect", help="namespaces, block counts and bytes per backend",
                       description=__doc__)
    st.add_common_arguments(p)
    p.set_defaults(func=run)


def inspect_backend(ob: st.OpenedBackend, own_ns: str | None, scope: st.Scope) -> dict[str, Any]:
    entry = ob.header()
    entry["security"] = ob.conf.security
    entry["quota_bytes"] = ob.conf.quota
    if ob.backend is None:
        return entry
    b = ob.backend
    try:
        # Counted over the whole store (its capacity is shared); only the namespaces in scope are named.
        counts: dict[str, list[int]] = defaultdict(lambda: [0, 0])
        for blk in b.scan():
            c = counts[blk.key.partition("/")[0]]
            c[0] += 1
            c[1] += blk.size
        ids, others = scope.ids(b, counts)
        namespaces = []
        for ns_id in sorted(ids, key=lambda i: (i != own_ns, i)):
            info = st.namespace_info(b, ns_id)
            n, nbytes = counts.get(ns_id, (0, 0))
            namespaces.append({"id": ns_id, "this_config": ns_id == own_ns, "blocks": n, "bytes": nbytes,
                               "manifest": info.manifest, "manifest_problem": info.problem,
                               "layout_id": info.layout_id, "block_payload_bytes": info.payload_nbytes,
                               **_tenants(b, ns_id, n, nbytes)})
    except BackendError as e:
        entry["error"] = st.error_text(e)
        return entry
    entry["blocks"] = sum(ns["blocks"] for ns in namespaces)
    entry["bytes"] = sum(ns["bytes"] for ns in namespaces)
    entry["namespaces"] = namespaces
    entry["other_namespaces"] = others
    entry["store_blocks"] = sum(c[0] for c in counts.values())
    entry["store_bytes"] = sum(c[1] for c in counts.values())
    return entry


def _tenants(b: StorageBackend, ns_id: str, blocks: int, nbytes: int) -> dict[str, Any]:
    """A namespace's blocks and bytes per tenant tag (``tenants``, by tag) and the untenanted rest
    (``untenanted``); both None where the backend counts no tenants.  Its records joined with a listing of the namespace (a stale record counts nothing),
    listed again only when it has records."""
    if not b.counts_tenants:
        return {"tenants": None, "untenanted": None}
    records = b.tenant_records(ns_id)
    per: dict[str, list[int]] = defaultdict(lambda: [0, 0])
    if records:
        for blk in b.scan(ns_id):
            if (tag := records.get(blk.key)) is not None:
                per[tag][0] += 1
                per[tag][1] += blk.size
    tenants: list[dict[str, Any]] = [{"tenant": tag, "blocks": c[0], "bytes": c[1]} for tag, c in sorted(per.items())]
    return {"tenants": tenants, "untenanted": {"blocks": blocks - sum(c[0] for c in per.values()),
                                              "bytes": nbytes - sum(c[1] for c in per.values())}}


def _fields(manifest: dict[str, Any] | None) -> list[str]:
    """A manifest's fields, one per line, in the order Namespace declares them (unknown ones last)."""
    if not manifest:
        return []
    order = {f: i for i, f in enumerate(Namespace.__dataclass_fields__)}
    return [f"      {k}: {v}" for k, v in sorted(manifest.items(), key=lambda kv: (order.get(kv[0], 99), kv[0]))]


def run(args: argparse.Namespace) -> int:
    loaded = st.load(args)
    cfg, own = loaded.cfg, loaded.namespace_id
    with st.open_backends(cfg, args.backend, keys=False) as opened:
        entries = [inspect_backend(ob, own, loaded.scope) for ob in opened]
    rc = 1 if any(e["error"] for e in entries) else 0
    if args.json:
        st.emit_json({"config": args.config, "namespace": own, "all_namespaces": loaded.scope.all,
                      "engine_fills_model": loaded.filled is not None, "backends": entries})
        return rc
    m = cfg.model
    lines = [loaded.across_namespaces(args.config, "showing") if own is None else
             f"config {args.config}: namespace {own} ({m.id}, {m.kv_dtype}, {m.num_layers} layers, "
             f"tp {m.tp_rank}/{m.tp_size}, pp {m.pp_rank}/{m.pp_size})"]
    for e in entries:
        lines.append("")
        mode = f", security {e['security']}" if e["security"] != "none" else ""
        lines.append(f"backend {e['name']} ({e['type']}{', ' + e['location'] if e['location'] else ''}{mode})")
        if e["error"]:
            lines.append(f"  ERROR: {e['error']}")
            continue
        cap = e["capacity_bytes"]
        used = f"{e['blocks']} blocks, {format_size(e['bytes'])} ({e['bytes']} bytes)"
        if e["other_namespaces"]:
            used += f" (the store: {e['store_blocks']} blocks, {format_size(e['store_bytes'])})"
        if cap is not None:
            pct = 100.0 * e["store_bytes"] / cap if cap else float("inf")
            used += f" of capacity {format_size(cap)} ({pct:.1f}%)"
        scoped = "" if loaded.scope.all else " of this deployment's"
        lines.append(f"  {used} in {len(e['namespaces'])}{scoped} namespace{'s' if len(e['namespaces']) != 1 else ''}")
        for ns in e["namespaces"]:
            mark = "  [this config]" if ns["this_config"] else ""
            quota = e["quota_bytes"]
            share = f" of quota {format_size(quota)} ({100.0 * ns['bytes'] / quota:.1f}%)" \
                if quota and not loaded.scope.all else ""
            lines.append(f"  namespace {ns['id']}{mark}: {ns['blocks']} blocks, {format_size(ns['bytes'])}{share}")
            if ns["tenants"]:  # each share has the whole quota
                def pct(n: int, quota: int | None = quota) -> str:
                    return f" ({100.0 * n / quota:.1f}% of quota)" if quota and not loaded.scope.all else ""

                for t in ns["tenants"]:
                    lines.append(f"    tenant {t['tenant']}: {t['blocks']} blocks, {format_size(t['bytes'])}"
                                 f"{pct(t['bytes'])}")
                rest = ns["untenanted"]
                lines.append(f"    untenanted: {rest['blocks']} blocks, {format_size(rest['bytes'])}{pct(rest['bytes'])}")
            lines += _fields(ns["manifest"])
            if ns["manifest_problem"] is None:
                lines.append(f"      (layout id {ns['layout_id']:#010x}"
                             + (f", {ns['block_payload_bytes']} payload bytes per stored value)"
                                if ns["block_payload_bytes"] else ")"))
            else:
                lines.append(f"      ({ns['manifest_problem']}: what this namespace holds cannot be told)")
        if e["other_namespaces"]:
            lines.append(f"  ({loaded.scope.others_line(e['other_namespaces'])})")
    print(st.mask_secrets("\n".join(lines)))
    return rc
