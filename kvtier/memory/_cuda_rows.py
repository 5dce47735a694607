"""Row copies between an engine's KV tensors and payload rows on one CUDA device in one kernel launch.

A block's canonical payload is ``[L, C, row]``: one row per layer and component, each a row of its own
``[num_blocks, row]`` view of the KV tensors (:meth:`~kvtier.format.layout.KVLayout.component_views`).  Engines
allocate a tensor per layer, so torch can only gather those rows with an ``index_select`` (and scatter
them with an ``index_copy_``) per layer-component: 64 launches for a Llama-8B-shaped cache.  Their
Python and dispatcher cost is fixed per batch: on an H100, issuing the gather of one 2 MiB block took
2.7 ms of the calling thread, for 0.05 ms of bytes.  Here one Triton kernel reads a table of (base
address, row stride) per view and copies every row of a batch, in words as wide as every address,
stride and row allows (``kvtier bench tiers --device cuda``, H100: a one-block gather 3.1 -> 1.4 ms,
scatter 3.4 -> 2.0 ms; 256 blocks unchanged, the bus is the limit there).

Without Triton (or with ``KVTIER_NO_TRITON=1``) torch's per-view ops copy; :func:`row_kernel` says which.
Layer-wise loads keep torch's two ``index_copy_`` per layer: one launch saves little there, and a
64-block layer-wise scatter measured slower through the kernel.  The kernel does not range-check block
ids on the host (callers have, in ``DeviceTier.plan``), but it masks an id outside ``[0, num_blocks)``:
such a row is neither read nor written, never someone else's memory.
"""

from __future__ import annotations

import contextlib
import functools
import os
from collections.abc import Sequence
from typing import Any

import torch

# Words per program: 8 KiB in int64 words, a row of a Llama-8B-shaped block (32 KiB) in four programs.
_BLOCK = 1024
_WORDS = (torch.int64, torch.int32, torch.int16, torch.uint8)


@functools.lru_cache(maxsize=1)
def _kernel() -> Any | None:
    """The Triton kernel, compiled on first launch (once per direction); None where Triton does not
    import (or is switched off with ``KVTIER_NO_TRITON=1``)."""
    if os.environ.get("KVTIER_NO_TRITON", "") not in ("", "0"):
        return None
    try:
        import triton
        import triton.language as tl
    except Exception:  # noqa: BLE001 - an absent or broken Triton means torch's per-view copies
        return None

    # Unannotated: Triton reads a parameter's annotation as its type (only tl.constexpr is one).
    @triton.jit
    def copy_rows(  # type: ignore[no-untyped-def]
            table, views, ids, buf, num_blocks, row_words, buf_row_words, first_row, chunks,
            BLOCK: tl.constexpr, GATHER: tl.constexpr):
        # Program (i * chunks + c, j): words [c * BLOCK, (c + 1) * BLOCK) of view views[j]'s row ids[i]
        # <-> payload row first_row + i, at the view's place in it (-> with GATHER, <- without).
        pid = tl.program_id(0)
        i, c = pid // chunks, pid % chunks
        v = tl.load(views + tl.program_id(1))
        base = tl.load(table + 2 * v).to(buf.dtype)
        stride = tl.load(table + 2 * v + 1)
        b = tl.load(ids + i)
        offs = c * BLOCK + tl.arange(0, BLOCK)
        m = offs < tl.where((b >= 0) & (b < num_blocks), row_words, 0)  # an id out of range: no word
        kv = base + b * stride + offs
        rows = buf + (first_row + i).to(tl.int64) * buf_row_words + v.to(tl.int64) * row_words + offs
        if GATHER:
            tl.store(rows, tl.load(kv, mask=m), mask=m)
        else:
            tl.store(kv, tl.load(rows, mask=m), mask=m)

    return copy_rows


class RowKernel:
    """Every row view of one KV cache, as a device table the kernel reads.  Views are numbered layer by
    layer, component by component (view ``l * C + c``), which is also their order in a payload row."""

    def __init__(self, views: Sequence[Sequence[torch.Tensor]], dtype: torch.dtype, kernel: Any):
        flat = _flat(views)
        self.device = flat[0].device
        self.components = len(views[0])
        self.num_blocks = flat[0].shape[0]
        self.dtype = dtype  # the word the kernel copies at a time (word_dtype)
        word = dtype.itemsize
        self.row_words = flat[0].shape[1] * flat[0].element_size() // word
        # (base address in bytes, row stride in words) per view; addresses are cast to pointers in-kernel.
        pairs = [x for v in flat for x in (v.data_ptr(), v.stride(0) * v.element_size() // word)]
        self.table = torch.tensor(pairs, dtype=torch.int64).to(self.device)
        self._kernel = kernel
        self._groups: dict[tuple[int, ...], torch.Tensor] = {}

    def _views(self, layers: Sequence[int]) -> torch.Tensor:
        """The view numbers of ``layers``' components, on the device (cached: every batch of a size cuts
        the layers into the same groups)."""
        key = tuple(layers)
        t = self._groups.get(key)
        if t is None:
            C = self.components
            t = self._groups[key] = torch.tensor([li * C + c for li in key for c in range(C)],
                                                 dtype=torch.int32).to(self.device)
        return t

    def _launch(self, ids: torch.Tensor, buf: torch.Tensor, first_row: int, layers: Sequence[int],
                gather: bool) -> None:
        n = ids.numel()
        if n == 0 or not layers:
            return
        words = buf.view(self.dtype)
        chunks = -(-self.row_words // _BLOCK)
        views = self._views(layers)
        # Triton launches on the current device's current stream; torch's ops would follow the tensors'
        # device, so the KV's device is made current (a caller's stream context on it stays in force).
        # (CPU tensors: Triton's interpreter, in tests.)
        with torch.cuda.device(self.device) if self.device.type == "cuda" else contextlib.nullcontext():
            self._kernel[(n * chunks, views.numel())](
                self.table, views, ids, words, self.num_blocks, self.row_words, words.stride(0), first_row,
                chunks, BLOCK=_BLOCK, GATHER=gather)

    def fits(self, buf: torch.Tensor) -> bool:
        """Whether payload rows in ``buf`` (uint8 ``[n, bytes]``, rows contiguous) are words of this
        table's width on its device (an odd slice of a buffer may not be)."""
        w = self.dtype.itemsize
        return (buf.device == self.device and buf.dtype == torch.uint8 and buf.dim() == 2
                and buf.stride(1) == 1 and buf.data_ptr() % w == 0 and buf.stride(0) % w == 0
                and buf.shape[1] % w == 0)

    def gather(self, ids: torch.Tensor, buf: torch.Tensor, first_row: int, layers: Sequence[int]) -> None:
        """``layers`` of blocks ``ids`` -> payload rows ``first_row``.. of ``buf`` (whole payload rows:
        each layer-component at its place in the row), on the current stream."""
        self._launch(ids, buf, first_row, layers, True)

    def scatter(self, ids: torch.Tensor, buf: torch.Tensor, first_row: int, layers: Sequence[int]) -> None:
        """Payload rows ``first_row``.. of ``buf`` -> ``layers`` of blocks ``ids``, on the current stream."""
        self._launch(ids, buf, first_row, layers, False)


def row_kernel(views: Sequence[Sequence[torch.Tensor]]) -> RowKernel | None:
    """A :class:`RowKernel` over ``views`` (each ``[num_blocks, row]`` with contiguous rows, all on one
    CUDA device with equal row bytes), or None where the per-view torch ops must do: no CUDA, no
    Triton, no views, or views of unequal shapes."""
    flat = _flat(views)
    if not flat or flat[0].device.type != "cuda" or any(len(c) != len(views[0]) for c in views):
        return None
    nbytes = flat[0].shape[1] * flat[0].element_size()
    for v in flat:
        if (v.device != flat[0].device or v.dim() != 2 or v.stride(1) != 1 or v.shape[0] != flat[0].shape[0]
                or v.shape[1] * v.element_size() != nbytes):
            return None
    kernel = _kernel()
    if kernel is None:
        return None
    return RowKernel(views, word_dtype(views), kernel)


def word_dtype(views: Sequence[Sequence[torch.Tensor]]) -> torch.dtype:
    """The integer dtype of the widest word dividing every view's address, row stride and row bytes: what
    the kernel copies at a time (a byte at worst)."""
    flat = _flat(views)
    for dtype in _WORDS:
        word = dtype.itemsize
        if all(v.data_ptr() % word == 0 and (v.stride(0) * v.element_size()) % word == 0
               and (v.shape[1] * v.element_size()) % word == 0 for v in flat):
            return dtype
    raise AssertionError("a byte divides everything")  # _WORDS ends with uint8


def _flat(views: Sequence[Sequence[torch.Tensor]]) -> list[torch.Tensor]:
    """The views in kernel order: layer by layer, component by component (view ``l * C + c``)."""
    return [v for comps in views for v in comps]


__all__ = ["RowKernel", "row_kernel", "word_dtype"]
