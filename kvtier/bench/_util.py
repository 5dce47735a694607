"""Shared helpers for benchmarks: timing with medians, and a uniform result table / JSON output."""

from __future__ import annotations

import json
import statistics
import time
from collections.abc import Callable
from typing import Any

from ..commands._types import write_out


def median_time(fn: Callable[[], Any], repeats: int = 7, warmup: int = 1) -> float:
    """Median wall time of ``fn()`` in seconds."""
    for _ in range(warmup):
        fn()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        fn()
        times.append(time.perf_counter() - t0)
    return statistics.median(times)


def print_table(rows: list[dict[str, Any]], columns: list[str]) -> None:
    def fmt(v: Any) -> str:
        if isinstance(v, float):
            return f"{v:.3g}" if abs(v) < 1000 else f"{v:,.0f}"
        return str(v)

    cells = [[fmt(r.get(c, "")) for c in columns] for r in rows]
    widths = [max(len(c), *(len(row[i]) for row in cells)) for i, c in enumerate(columns)]
    print("  ".join(c.ljust(w) for c, w in zip(columns, widths)))
    for row in cells:
        print("  ".join(v.ljust(w) for v, w in zip(row, widths)))


def write_json(path: str | None, payload: dict[str, Any]) -> None:
    if path:
        write_out("--json", path, lambda p: p.write_text(json.dumps(payload, indent=2, sort_keys=True)))
        print(f"wrote {path}")
