"""Writes to backends: every put of a stored value goes through :class:`BackendWriter`.

Invariants:
* the planner hears of every put before it starts and after it returns (``begin_put_locked`` /
  ``put_done_locked``), so a value the backend evicted during its own write is never marked there, and a
  value a backend took is marked for each of its blocks;
* no lock is held during the I/O; a backend fault is a refused value (``BackendSet.put`` never raises).
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import torch

from .parts import StackParts


class BackendWriter:
    """Puts stored values (one block, or a group of ``storage.block_tokens`` blocks) into backends."""

    def __init__(self, parts: StackParts):
        self.parts = parts

    def put_values(self, b: int, values: Sequence[tuple[bytes, ...]], payloads: Sequence[Any]) -> list[bool]:
        """Put stored values into backend ``b`` (each under its last block's key) and mark every block of
        the values it took as stored there; per value whether it did."""
        p, planner = self.parts, self.parts.planner
        lasts = [v[-1] for v in values]
        with planner.lock:
            planner.begin_put_locked(b, lasts)
        ok = p.backends.put(b, p.namespace.keys(lasts), payloads)  # never raises: a fault is all False
        with planner.lock:
            planner.put_done_locked(b, values, ok)
        return ok

    def put_rows(self, values: Sequence[tuple[bytes, ...]], rows: torch.Tensor) -> list[bool]:
        """Write stored values whose payloads are ``rows`` (``[values, bytes]``, read from the device) to
        every writable backend; per value whether one took it."""
        views = [rows[j].numpy() for j in range(len(values))]
        took = [False] * len(values)
        for b in self.parts.backends.writable:
            took = [t or good for t, good in zip(took, self.put_values(b, values, views))]
        return took


__all__ = ["BackendWriter"]
