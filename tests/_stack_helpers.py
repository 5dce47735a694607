"""Shared by test_stack.py, test_policies.py and test_metrics.py: a small stack on a real local_disk
backend in tmp_path, random device blocks (never zeros), and a view of which tier holds which block."""

from __future__ import annotations

from typing import Any, Literal, overload

import torch

from kvtier.backends.local_disk import LocalDiskBackend
from kvtier.config import parse_config
from kvtier.stack import TierStack
from kvtier.testing.faults import FaultyBackend

LAYERS, HEADS, HEAD_DIM, BLOCK = 2, 2, 16, 4
BLOCK_NBYTES = LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 4  # float32
TIMEOUT = 10.0  # every wait in the tests is bounded


def config(tmp_path, *, write: str = "write_through", write_options: dict[str, Any] | None = None,
           prefetch: str = "best_effort", prefetch_options: dict[str, Any] | None = None, threshold_tokens: int = 0,
           host_slots: int = 4, num_blocks: int = 32, threads: int = 2, layout: str = "flash_attn",
           backends: list[dict[str, Any]] | None = None, **extra: Any):
    data = {
        "model": {"id": "test/tiny", "kv_dtype": "float32", "num_layers": LAYERS, "num_kv_heads": HEADS,
                  "head_dim": HEAD_DIM, "block_size": BLOCK},
        "device": {"kind": "cpu", "num_blocks": num_blocks, "layout": layout},
        "host": {"capacity": host_slots * BLOCK_NBYTES, "pinned": False},
        "backends": backends if backends is not None else
        [{"name": "disk", "type": "local_disk", "options": {"path": str(tmp_path / "disk")}}],
        "policies": {"write": {"name": write, "options": write_options or {}},
                     "prefetch": {"name": prefetch, "options": prefetch_options or {},
                                  "threshold_tokens": threshold_tokens}},
        "transfer": {"threads": threads},
        **extra,
    }
    return parse_config(data)


@overload
def make_stack(tmp_path: Any, *, faulty: Literal[True] = ..., disk_path: Any = ..., segments: bool = ...,
               **kw: Any) -> tuple[TierStack, FaultyBackend]: ...


@overload
def make_stack(tmp_path: Any, *, faulty: Literal[False], disk_path: Any = ..., segments: bool = ...,
               **kw: Any) -> tuple[TierStack, None]: ...


def make_stack(tmp_path, *, faulty: bool = True, disk_path=None, segments: bool = True,
               **kw) -> tuple[TierStack, FaultyBackend | None]:
    """A stack over local_disk in tmp_path, wrapped in a FaultyBackend (returned) unless ``faulty=False``.
    ``segments=False``: the wrapper says it does not read segments (as S3), so reads take the one-buffer
    path."""
    cfg = config(tmp_path, **kw)
    if not faulty:
        return TierStack(cfg), None
    disk = LocalDiskBackend({"path": str(disk_path or tmp_path / "disk")}, name="disk")
    fb = FaultyBackend(disk)
    fb.reads_segments = segments  # type: ignore[misc]
    return TierStack(cfg, backends=[fb]), fb


def fill(stack: TierStack, block_ids: list[int], seed: int) -> torch.Tensor:
    """Write random bytes into device blocks; returns their payloads ([n, block_nbytes] uint8)."""
    g = torch.Generator().manual_seed(seed)
    rows = torch.randint(1, 256, (len(block_ids), stack.layout.block_nbytes), dtype=torch.uint8, generator=g)
    stack.device.write_blocks(rows, block_ids)
    return rows


def read(stack: TierStack, block_ids: list[int]) -> torch.Tensor:
    return stack.device.read_blocks(block_ids)


def chain(stack: TierStack, n: int, start: int = 0) -> list[bytes]:
    """Hashes of an n-block prompt of tokens start, start+1, ... (different starts: different chains)."""
    return stack.namespace.hasher().hash_blocks(list(range(start, start + n * stack.block_size)))


def where(stack: TierStack, hashes: list[bytes]) -> list[str]:
    """Per block, the tiers holding it as a short string: "H" host, "D" the disk backend (asked for
    real), "-" nowhere.  Device residency is left out (tests free device blocks after each step)."""
    out = []
    on_disk = stack.backends[0].exists(stack.namespace.keys(hashes))
    for h, d in zip(hashes, on_disk):
        e = stack.index.get(h)
        s = ("H" if e is not None and e.host is not None else "") + ("D" if d else "")
        out.append(s or "-")
    return out
