"""Row copies between an engine's registered KV tensors and payload rows on the same device (the codec of
:class:`~kvtier.memory.device.DeviceTier`), and the CPU threads that run them.

A payload row is one block in the canonical byte order of :mod:`kvtier.format.layout`; the codec moves
whole batches of them with one indexed copy per layer-component (or one Triton launch,
:mod:`kvtier.memory._cuda_rows`), never a Python loop per block.  :func:`gather`, :func:`scatter` and
:func:`to_payload` are the one-call forms (a codec built for one copy).

Invariant: the layout describes bytes and never moves them, so this module imports
:mod:`kvtier.format.layout` and nothing there imports back (the format room sits below memory).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar

import numpy as np
import torch

from .. import threads as kvthreads
from ..format.layout import HeadView, KVLayout, LayoutError, check_layers, tensor_list
from ._cuda_rows import RowKernel, row_kernel
from .blockids import BlockIds, as_index, check_range, contiguous_runs

log = logging.getLogger("kvtier.rows")  # the name users filter on (not the module path)

Rows = list[tuple[int, int, int]] | torch.Tensor  # see RowCodec.rows


class RowCodec:
    """Row copies between registered KV tensors and payload rows on the same device: to gather,
    ``index_select(out=)`` into the strided payload rows; to scatter, numpy fancy assignment on CPU
    (memcpy speed, GIL released) and ``index_copy_`` on CUDA.  Rows are views in ``copy_dtype``."""

    def __init__(self, layout: KVLayout, tensors: torch.Tensor | Sequence[torch.Tensor],
                 copy_dtype: torch.dtype | None = None):
        self.layout = layout
        self.copy_dtype = copy_dtype or layout.copy_dtype(tensors)
        self.device = tensor_list(tensors)[0].device
        self.np_views: list[list[np.ndarray]] | None
        if layout.head_major and self.device.type != "cpu":
            raise LayoutError(f"{layout.kind} is vLLM's CPU layout: its tensors must be on the CPU, found "
                              f"{self.device}")
        if layout.rearranges:
            self.views, self.np_views = [], None  # no flat rows: head_views below
            # numpy aliases of each component in memory ([N, H, ...], in its unit), with its rearrangement
            self.np_heads = [[(v.mem.detach().numpy(), v) for v in comps] for comps in layout.head_views(tensors)]
            return
        self.views = layout.component_views(tensors, self.copy_dtype)
        # numpy aliases of the same rows (CPU only): the scatter's fast path.
        self.np_views = ([[v.detach().numpy() for v in comps] for comps in self.views]
                         if self.device.type == "cpu" else None)
        self._kernel: RowKernel | None | bool = self.device.type == "cuda"  # True: not built yet

    def row_kernel(self) -> RowKernel | None:
        """CUDA: every row of a batch in one launch (:mod:`kvtier._cuda_rows`), built on first use; None
        where torch's per-view ops copy (CPU, no Triton, rows no word width divides)."""
        if self._kernel is True:  # two threads building it at once build two equal ones: harmless
            try:
                self._kernel = row_kernel(self.views)
            except Exception as e:  # noqa: BLE001 - a Triton that cannot even define it: torch's ops
                self._no_kernel(e)
        return self._kernel if isinstance(self._kernel, RowKernel) else None

    def _no_kernel(self, e: Exception) -> None:
        log.warning("CUDA row kernel unusable, copying with torch's per-layer ops from now on: %s: %s",
                    type(e).__name__, e)
        self._kernel = None

    def _by_kernel(self, gather: bool, ids: torch.Tensor, buf: torch.Tensor, rows: Rows,
                   layers: Sequence[int] | None) -> bool:
        """Copy the batch with the row kernel where it serves (CUDA, one run of rows in ``buf``, words
        that fit); False where torch's per-view ops must copy instead.  A kernel that fails to build or
        launch (a Triton that cannot compile it) is logged and not tried again: torch's ops copy from
        then on, so a Triton problem costs speed, never a transfer."""
        rk = self.row_kernel() if isinstance(rows, list) and len(rows) == 1 else None
        if rk is None or not isinstance(rows, list) or not rk.fits(buf):
            return False
        todo = check_layers(layers, self.layout.num_layers)
        try:
            (rk.gather if gather else rk.scatter)(ids, buf, rows[0][1], todo)
        except Exception as e:  # noqa: BLE001 - raised before anything was enqueued: torch's ops instead
            self._no_kernel(e)
            return False
        return True

    def rows(self, n: int, slots: BlockIds | None, nrows: int) -> Rows:
        """Where ``n`` payloads sit in a ``nrows``-row buffer: runs of consecutive rows
        ``[(position in batch, first row, length)]`` when they are long enough to copy in place
        (8 rows on average), else one index tensor of rows."""
        if slots is None:
            if n > nrows:
                raise LayoutError(f"payload buffer has {nrows} rows, {n} blocks given")
            return [(0, 0, n)]
        runs = contiguous_runs(slots)
        if runs and (min(f for _, f, _ in runs) < 0 or max(f + k for _, f, k in runs) > nrows):
            raise IndexError(f"payload rows (slots) out of range [0, {nrows})")
        return runs if len(runs) <= max(1, n // 8) else as_index(slots, self.device)

    def _batch(self, block_ids: BlockIds, buf: torch.Tensor, slots: BlockIds | None,
               rows: Rows | None) -> tuple[torch.Tensor, torch.Tensor, Rows]:
        """What both directions start from: the ids as an index tensor on the tensors' device, the
        payload buffer viewed as rows of ``copy_dtype`` ([n, L, C, ...]), and where the batch sits in it."""
        ids = as_index(block_ids, self.device)
        view = self.layout.payload_view(buf, self.copy_dtype)
        return ids, view, self.rows(ids.numel(), slots, buf.shape[0]) if rows is None else rows

    def gather(self, block_ids: BlockIds, out: torch.Tensor, slots: BlockIds | None, layers: Sequence[int] | None,
               rows: Rows | None = None) -> None:
        ids, dst, rows = self._batch(block_ids, out, slots, rows)
        if self.layout.rearranges:
            self._gather_head_major(ids, dst, rows, layers)
            return
        if isinstance(rows, list):
            if self._by_kernel(True, ids, out, rows, layers):
                return
            parts = [(ids[p:p + k], first, k) for p, first, k in rows]

            def run(chunk: list[tuple[int, int]]) -> None:
                for li, c in chunk:
                    for part, first, k in parts:
                        # One pass: index_select writes straight into the strided payload rows.
                        torch.index_select(self.views[li][c], 0, part, out=dst[first:first + k, li, c])
        else:
            # Scattered rows: through a temporary the size of one layer-component of the batch.
            dst_np, rows_np = (dst.numpy(), rows.numpy()) if self.np_views is not None else (None, None)

            def run(chunk: list[tuple[int, int]]) -> None:
                for li, c in chunk:
                    tmp = self.views[li][c].index_select(0, ids)
                    if dst_np is not None:
                        dst_np[rows_np, li, c] = tmp.numpy()
                    else:
                        dst[:, li, c].index_copy_(0, rows, tmp)

        self._run(run, layers, ids.numel())

    def scatter(self, payload: torch.Tensor, block_ids: BlockIds, slots: BlockIds | None, layers: Sequence[int] | None,
                rows: Rows | None = None) -> None:
        ids, src, rows = self._batch(block_ids, payload, slots, rows)
        if self.layout.rearranges:
            self._scatter_head_major(ids, src, rows, layers)
            return
        if self.np_views is not None:
            np_views, src_np = self.np_views, src.numpy()
            parts = self._row_parts(ids, rows)

            def run(chunk: list[tuple[int, int]]) -> None:
                for li, c in chunk:
                    dst = np_views[li][c]
                    for part, sel in parts:
                        dst[part] = src_np[sel, li, c]
        else:
            if self._by_kernel(False, ids, payload, rows, layers):
                return

            def run(chunk: list[tuple[int, int]]) -> None:
                for li, c in chunk:
                    dst = self.views[li][c]
                    if isinstance(rows, list):
                        for p, first, k in rows:
                            dst.index_copy_(0, ids[p:p + k], src[first:first + k, li, c])
                    else:
                        dst.index_copy_(0, ids, src[:, li, c].index_select(0, rows))

        self._run(run, layers, ids.numel())

    # A head-major (cpu_attn*) component of a block is kept in the engine's own arrangement
    # (layout.HeadView: [H, ...] in memory) where the payload wants [B, H, D]: each copy rearranges
    # (one strided numpy copy per layer-component and run of rows, no loop per block).  Payload rows are
    # viewed as [n, L, C, *split].

    def _np_heads(self) -> list[list[tuple[np.ndarray, HeadView]]]:
        if not self.layout.rearranges:
            raise LayoutError("head views are for head-major layouts with the canonical payload")
        return self.np_heads

    def _row_parts(self, ids: torch.Tensor, rows: Rows) -> list[tuple[np.ndarray, Any]]:
        """(block ids, payload rows: a slice or an index array) per run of rows, ids range-checked (numpy
        wraps negative indices around: -1 would silently overwrite the last block)."""
        ids_np = ids.numpy()
        check_range(ids_np, self.layout.num_blocks, "block id")
        if isinstance(rows, list):
            return [(ids_np[p:p + k], slice(first, first + k)) for p, first, k in rows]
        return [(ids_np, rows.numpy())]

    def _gather_head_major(self, ids: torch.Tensor, dst: torch.Tensor, rows: Rows,
                           layers: Sequence[int] | None) -> None:
        parts, heads = self._row_parts(ids, rows), self._np_heads()
        dst_np = dst.numpy()

        def run(chunk: list[tuple[int, int]]) -> None:
            for li, c in chunk:
                mem, hv = heads[li][c]
                back = (0, *(1 + a for a in hv.to_canonical))
                for part, sel in parts:
                    block = mem[part].transpose(back)  # [k, *split]
                    if isinstance(sel, slice):
                        dst_np[sel, li, c].view(mem.dtype).reshape(-1, *hv.split)[...] = block
                    else:
                        dst_np[sel, li, c] = block.reshape(len(part), -1).view(dst_np.dtype)

        self._run(run, layers, ids.numel())

    def _scatter_head_major(self, ids: torch.Tensor, src: torch.Tensor, rows: Rows,
                            layers: Sequence[int] | None) -> None:
        lay = self.layout
        parts = self._row_parts(ids, rows)
        src_np = src.numpy()
        if layers is None:
            # Whole blocks: one rearranging copy per block, layer and component (write_one's), blocks
            # split across the copy threads.
            pairs = [(int(b), r) for part, sel in parts
                     for b, r in zip(part.tolist(), range(sel.start, sel.stop) if isinstance(sel, slice) else sel.tolist())]

            def run_blocks(chunk: list[tuple[int, int]]) -> None:
                for b, r in chunk:
                    self._put_block(src_np[r], b)

            _parallel(run_blocks, pairs, len(pairs) * lay.block_nbytes)
            return
        heads = self._np_heads()

        def run(chunk: list[tuple[int, int]]) -> None:
            for li, c in chunk:
                mem, hv = heads[li][c]
                fwd = (0, *(1 + a for a in hv.order))
                for part, sel in parts:
                    mem[part] = src_np[sel, li, c].view(mem.dtype).reshape(-1, *hv.split).transpose(fwd)

        self._run(run, layers, ids.numel())

    def write_one(self, payload: Any, block_id: int) -> None:
        """One payload (any buffer) into one block, in this thread (CPU)."""
        src = np.frombuffer(payload, dtype=np.uint8)
        if src.size != self.layout.block_nbytes:
            raise LayoutError(f"payload of {src.size} B for a block of {self.layout.block_nbytes} B")
        self._put_block(src.reshape(self.layout.num_layers, self.layout.copy_components, -1), block_id)

    def _put_block(self, rows: np.ndarray, block_id: int) -> None:
        """Payload ``rows`` (``[L, C, row]``, each row contiguous, any integer type) into block
        ``block_id``: basic indexing by the block id, and for a head-major layout one rearranging copy per
        layer-component; each row is viewed as its destination's type."""
        if self.layout.rearranges:
            for li, comps in enumerate(self._np_heads()):
                for c, (mem, hv) in enumerate(comps):
                    mem[block_id] = rows[li, c].view(mem.dtype).reshape(hv.split).transpose(hv.order)
            return
        for li, views in enumerate(self._cpu_views()):
            for c, view in enumerate(views):
                view[block_id] = rows[li, c].view(view.dtype)

    def _cpu_views(self) -> list[list[np.ndarray]]:
        if self.np_views is None:
            raise LayoutError("numpy views of the KV tensors exist only on the CPU")
        return self.np_views

    def _run(self, run: Any, layers: Sequence[int] | None, n: int) -> None:
        work = [(li, c) for li in check_layers(layers, self.layout.num_layers)
                for c in range(self.layout.copy_components)]
        if self.device.type == "cpu":
            _parallel(run, work, n * len(work) * self.layout.copy_row_nbytes)
        else:
            run(work)  # CUDA: kernels on the current stream


# ---------------------------------------------------------------------- CPU copy threads

_POOL: ThreadPoolExecutor | None = None
_POOL_PID = 0
_POOL_LOCK = threading.Lock()
_POOL_SIZE = 8
_PARALLEL_MIN_BYTES = 1 << 20


_W = TypeVar("_W")


def _parallel(fn: Callable[[list[_W]], object], work: list[_W], nbytes: int) -> None:
    """``fn(chunk)`` over ``work`` (layer-components, or blocks) split across as many threads as torch uses
    for intra-op work, in kvtier's own pool whose threads run torch ops single-threaded.

    Why: dozens of short parallel ops (one per layer-component) each pay an OpenMP fork/join, and on a
    busy host every join waits for the slowest, descheduled thread: measured here, torch's own
    threading fell to 0.1-0.4x of ``copy_`` while this split held 0.7-0.9x.  Independent serial
    copies (numpy and torch both release the GIL) have no barrier between them.  Small batches run
    inline."""
    k = min(torch.get_num_threads(), len(work), _POOL_SIZE)
    if k <= 1 or nbytes < _PARALLEL_MIN_BYTES:
        fn(work)
        return
    global _POOL, _POOL_PID
    with _POOL_LOCK:
        if _POOL is None or os.getpid() != _POOL_PID:  # a forked child has the object but no threads
            _POOL = kvthreads.pool(_POOL_SIZE, "kvtier-copy", _serial_torch_thread)
            _POOL_PID = os.getpid()
    # Leaf tasks only (they never submit more), so a shared pool cannot deadlock.
    futures = [_POOL.submit(fn, work[i::k]) for i in range(k)]
    for f in futures:
        f.result()


def _serial_torch_thread() -> None:
    """Make torch ops in this (pool) thread single-threaded, without touching the process setting.

    torch's ``set_num_threads`` is process-wide, but OpenMP's thread count is a per-thread setting:
    after torch initialised this thread's (``get_num_threads`` does that), ``omp_set_num_threads(1)``
    from the OpenMP runtime torch loaded applies to this thread only."""
    torch.get_num_threads()
    fn = _omp_set_num_threads()
    if fn is not None:
        fn(1)


def gather(layout: KVLayout, tensors: torch.Tensor | Sequence[torch.Tensor], block_ids: Any, out: torch.Tensor,
           slots: Any = None, *, layers: Sequence[int] | None = None) -> torch.Tensor:
    """Write the canonical payload of ``block_ids`` into rows ``slots`` (default ``0..n-1``) of ``out``
    (``[rows, block_nbytes]`` uint8 on the tensors' device).  ``layers`` limits it to some layers (the rest
    of each row is left alone).  Returns ``out``."""
    RowCodec(layout, tensors).gather(block_ids, out, slots, layers)
    return out


def scatter(layout: KVLayout, tensors: torch.Tensor | Sequence[torch.Tensor], payload: torch.Tensor,
            block_ids: Any, slots: Any = None, *, layers: Sequence[int] | None = None) -> None:
    """Write payload rows ``slots`` (default ``0..n-1``) into blocks ``block_ids`` of the tensors."""
    RowCodec(layout, tensors).scatter(payload, block_ids, slots, layers)


def to_payload(layout: KVLayout, tensors: torch.Tensor | Sequence[torch.Tensor], block_ids: Any) -> torch.Tensor:
    """A new ``[n, block_nbytes]`` uint8 tensor (on the tensors' device) holding the payloads."""
    ids = as_index(block_ids, "cpu")
    out = torch.empty((ids.numel(), layout.block_nbytes), dtype=torch.uint8, device=tensor_list(tensors)[0].device)
    return gather(layout, tensors, ids, out)


@functools.lru_cache(maxsize=1)
def _omp_set_num_threads() -> Any:
    try:
        with open("/proc/self/maps") as f:
            paths = sorted({line.split()[-1] for line in f
                            if ("libgomp" in line or "libiomp" in line or "libomp" in line) and "/" in line})
    except OSError:
        return None
    # torch's own runtime first: other packages (vLLM's CPU wheel, SGLang's extensions) may load OpenMP
    # copies of their own, and setting another runtime's thread count would leave torch's untouched.
    torch_dir = os.path.dirname(torch.__file__)
    paths.sort(key=lambda p: not p.startswith(torch_dir))
    for path in paths:
        try:
            fn = ctypes.CDLL(path).omp_set_num_threads
        except (OSError, AttributeError):
            continue
        fn.argtypes, fn.restype = [ctypes.c_int], None
        return fn
    return None
