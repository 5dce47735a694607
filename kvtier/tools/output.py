"""Output the tools share: a uniform result table, and JSON written where ``--json`` says."""

from __future__ import annotations

import json
from typing import Any

from .args import write_out


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
