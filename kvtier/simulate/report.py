"""What ``kvtier simulate`` prints and writes: a table, a Parquet row per grid point, a plot of hit rate
against capacity per tier (one curve per combination of the other grid axes, e.g. per write policy)."""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

import numpy as np

from ..units import parse_size
from .grid import GridAxis
from .replay import SimResult


def _gib(blocks: int, nbytes: int) -> float:
    return blocks * nbytes / 2**30


def rows(points: Sequence[dict[str, str]], results: Sequence[SimResult]) -> list[dict[str, Any]]:
    """One flat record per grid point (the Parquet rows, and what the table shows)."""
    out = []
    for values, r in zip(points, results):
        row: dict[str, Any] = dict(values)
        row.update(requests=r.requests, prompt_blocks=r.prompt_blocks, prompt_tokens=r.prompt_tokens,
                   saved_tokens=r.saved_tokens, saved_pct=100 * r.saved_tokens / max(r.prompt_tokens, 1),
                   block_nbytes=r.block_nbytes, block_ops_per_s=r.ops_per_s)
        for t in r.tiers:
            row[f"hit_pct_{t}"] = 100 * r.hit_rate(t)
        for t in r.tiers[1:]:
            size = r.block_nbytes if t == "host" else r.value_nbytes
            row[f"written_gib_{t}"] = _gib(r.written.get(t, 0), size)
            row[f"read_gib_{t}"] = _gib(r.read.get(t, 0), size)
            row[f"evicted_blocks_{t}"] = r.evicted.get(t, 0)
            row[f"skipped_blocks_{t}"] = r.skipped.get(t, 0)
        for t, series in r.writes_per_s.items():
            row[f"puts_per_s_mean_{t}"] = float(np.mean(series)) if series else 0.0
            row[f"puts_per_s_peak_{t}"] = int(max(series, default=0))
        out.append(row)
    return out


def table(axes: Sequence[GridAxis], recs: Sequence[dict[str, Any]], results: Sequence[SimResult]) -> str:
    """The terminal table: grid values, hit % per tier, tokens saved, traffic and evictions."""
    if not recs:
        return "(no grid points)"
    tiers = results[0].tiers
    backends = tiers[2:] if "host" in tiers else tiers[1:]
    head = [a.path for a in axes] + [f"hit% {t}" for t in tiers] + ["saved%"]
    if "host" in tiers:
        head += ["host evict"]
    for b in backends:
        head += [f"{b} GiB w/r", f"{b} evict", f"{b} puts/s mean/peak"]
    body = []
    for rec in recs:
        line = [str(rec[a.path]) for a in axes] + [f"{rec[f'hit_pct_{t}']:.1f}" for t in tiers]
        line.append(f"{rec['saved_pct']:.1f}")
        if "host" in tiers:
            line.append(str(rec["evicted_blocks_host"]))
        for b in backends:
            line += [f"{rec[f'written_gib_{b}']:.2f}/{rec[f'read_gib_{b}']:.2f}", str(rec[f"evicted_blocks_{b}"]),
                     f"{rec[f'puts_per_s_mean_{b}']:.1f}/{rec[f'puts_per_s_peak_{b}']}"]
        body.append(line)
    widths = [max(len(h), *(len(r[i]) for r in body)) for i, h in enumerate(head)]
    fmt = "  ".join(f"{{:>{w}}}" for w in widths)
    return "\n".join([fmt.format(*head), fmt.format(*("-" * w for w in widths)), *(fmt.format(*r) for r in body)])


def write_parquet(recs: Sequence[dict[str, Any]], path: Path) -> None:
    import pyarrow as pa
    import pyarrow.parquet as pq

    cols = list(dict.fromkeys(k for r in recs for k in r))
    pq.write_table(pa.table({c: [r.get(c) for r in recs] for c in cols}), path)


def _size_axis(axes: Sequence[GridAxis]) -> int | None:
    """The first axis whose values are all byte sizes (a capacity): the plot's x axis."""
    for i, a in enumerate(axes):
        try:
            [parse_size(v) for v in a.values]
        except ValueError:
            continue
        if len(a.values) > 1:
            return i
    return None


def plot(axes: Sequence[GridAxis], recs: Sequence[dict[str, Any]], results: Sequence[SimResult],
         path: Path) -> None:
    """Hit rate vs capacity, one panel per tier, one curve per combination of the other axes."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    tiers = results[0].tiers
    xi = _size_axis(axes)
    others = [a for i, a in enumerate(axes) if i != xi]
    curves: dict[str, list[tuple[float, dict[str, Any]]]] = {}
    for n, rec in enumerate(recs):
        name = ", ".join(f"{a.path}={rec[a.path]}" for a in others) or "as configured"
        x = parse_size(rec[axes[xi].path]) / 2**30 if xi is not None else float(n)
        curves.setdefault(name, []).append((x, rec))
    # The legend goes under the panels, two names a row: inside a panel it hid curves or spilled out.
    ncol = min(2, len(curves))
    legend_h = 0.25 * -(-len(curves) // ncol) + 0.15
    height = 3.6 + legend_h
    fig, panels = plt.subplots(1, len(tiers) + 1, figsize=(4 * (len(tiers) + 1), height), sharey=True)
    columns = [(f"hit_pct_{t}", t) for t in tiers] + [("saved_pct", "all tiers (tokens saved)")]
    styles = [("o", "-"), ("s", "--"), ("^", ":"), ("D", "-.")]  # curves that coincide stay visible
    for ax, (col, title) in zip(panels, columns):
        for k, (name, pts) in enumerate(curves.items()):
            pts.sort(key=lambda p: p[0])
            marker, line = styles[k % len(styles)]
            ax.plot([p[0] for p in pts], [p[1][col] for p in pts], marker=marker, linestyle=line, label=name,
                    markersize=7 - 1.5 * (k % 3), alpha=0.85)
        ax.set_title(title)
        ax.set_xlabel(f"{axes[xi].path} (GiB)" if xi is not None else "grid point")
        xs = {p[0] for pts in curves.values() for p in pts}
        if xi is not None and len(xs) > 2 and min(xs) > 0:
            ax.set_xscale("log", base=2)
        ax.grid(alpha=0.3)
    panels[0].set_ylabel("hit rate, % of prompt blocks")
    handles, labels = panels[-1].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=ncol, fontsize="small", frameon=False)
    fig.suptitle("kvtier simulate: hit rate per tier")
    fig.tight_layout(rect=(0, legend_h / height, 1, 1))
    fig.savefig(path, dpi=100)
    plt.close(fig)


__all__ = ["plot", "rows", "table", "write_parquet"]
