"""Block ids and host slots as callers hold them (lists, ranges, numpy arrays, tensors), normalised and
checked once: the one place that turns them into numpy arrays or index tensors, and splits them into runs
of consecutive values (one copy per run instead of one per block)."""

from __future__ import annotations

from collections.abc import Sequence

import numpy as np
import torch

#: Block ids or host slots as callers hold them: a list or range, a 1-D numpy array, a tensor.
BlockIds = Sequence[int] | np.ndarray | torch.Tensor


def int_array(values: BlockIds, what: str) -> np.ndarray:
    """Block ids / slots (list, range, numpy array or tensor) as a 1-D int64 numpy array; anything else
    (floats, bools, nested lists) is a ``ValueError`` naming ``what``.  The one normaliser of ids on the
    host side (``as_index`` is its tensor twin)."""
    if isinstance(values, torch.Tensor):
        values = values.cpu().numpy()
    arr = np.asarray(list(values) if isinstance(values, range) else values)
    if arr.size == 0:
        return np.zeros(0, dtype=np.int64)
    if arr.ndim != 1 or arr.dtype.kind not in "iu":
        raise ValueError(f"{what}: expected a 1-D sequence of integers, got {arr.dtype} shape {arr.shape}")
    return arr.astype(np.int64)


def as_index(ids: BlockIds, device: torch.device | str) -> torch.Tensor:
    """Block ids / slots (list, range, numpy array or tensor) as a 1-D int64 tensor on ``device``."""
    if isinstance(ids, torch.Tensor):
        t = ids.reshape(-1)
    else:
        t = torch.as_tensor(list(ids) if isinstance(ids, range) else ids).reshape(-1)
    if t.dtype != torch.int64:
        # A float or bool id is a caller's bug: never truncate it to some other block.
        if t.numel() and (t.dtype.is_floating_point or t.dtype.is_complex or t.dtype == torch.bool):
            raise TypeError(f"block ids / slots must be integers, got {t.dtype}")
        t = t.to(torch.int64)
    return t.to(device, non_blocking=True) if t.device != torch.device(device) else t


def check_range(idx: np.ndarray, n: int, what: str) -> None:
    """IndexError unless every index is in [0, n) (numpy would wrap a negative one around)."""
    if idx.size and (int(idx.min()) < 0 or int(idx.max()) >= n):
        bad = int(idx[(idx < 0) | (idx >= n)][0])
        raise IndexError(f"{what} {bad} out of range [0, {n})")


_SHORT_RUNS = 64  # below this many values, contiguous_runs walks them in Python


def contiguous_runs(values: BlockIds) -> list[tuple[int, int, int]]:
    """``values`` split into maximal runs ``v, v+1, ...``: a list of (position, first value, length)."""
    if isinstance(values, torch.Tensor):
        values = values.cpu().numpy()
    if isinstance(values, np.ndarray):
        values = values.reshape(-1)
    if len(values) <= _SHORT_RUNS:
        # A batch's slots or a group's layers: a Python walk over a few values costs 0.5-3 us where
        # numpy's calls cost 8 (a small transfer computes runs twice).
        v = values.tolist() if isinstance(values, np.ndarray) else list(values)
        out, a = [], 0
        for i in range(1, len(v) + 1):
            if i == len(v) or v[i] != v[i - 1] + 1:
                out.append((a, int(v[a]), i - a))
                a = i
        return out
    v = np.asarray(values, dtype=np.int64).reshape(-1)
    starts = np.flatnonzero(np.diff(v) != 1) + 1  # vectorised: no Python loop per block
    bounds = np.concatenate(([0], starts, [v.size])).tolist()
    firsts = v[bounds[:-1]].tolist()
    return [(a, f, b - a) for a, b, f in zip(bounds[:-1], bounds[1:], firsts)]
