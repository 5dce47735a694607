"""Device tier: the engine's KV tensors, registered once, and the copies between them and payload rows.

The engine owns the tensors; kvtier never allocates or frees them.  Everything here is worker-side and
synchronous *with respect to the current stream*: on CPU a call returns when the bytes are there; on CUDA
it enqueues its copies on ``torch.cuda.current_stream()`` and returns (the caller - normally
:class:`kvtier.transfer.TransferEngine` - picks the stream and records the events).

Invariant: a payload written by :meth:`DeviceTier.gather` and read back by :meth:`DeviceTier.scatter`
restores every byte of the blocks, whatever the layout kind (see :mod:`kvtier.layout`).
"""

from __future__ import annotations

import ctypes
import functools
import logging
import os
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass
from enum import StrEnum
from typing import Any, TypeVar

import numpy as np
import torch

from . import threads as kvthreads
from ._cuda_rows import RowKernel, row_kernel
from .blockformat import Segments
from .layout import HeadView, KVLayout, LayoutError, _as_list, _layers

log = logging.getLogger(__name__)

#: Block ids or host slots as callers hold them: a list or range, a 1-D numpy array, a tensor.
BlockIds = Sequence[int] | np.ndarray | torch.Tensor


class Direction(StrEnum):
    """Which way blocks are copied.  A ``str`` enum: members equal ``"store"`` / ``"load"``, the strings
    ``TransferEngine`` gave before the enum (``layer_hook``, ``TransferResult.direction``)."""

    STORE = "store"  # device -> host
    LOAD = "load"    # host -> device


@dataclass
class CopyPlan:
    """A checked batch: ``ids`` on the KV device; ``rows`` = where the payloads sit in a same-device
    buffer (runs of rows, or an index tensor); ``runs`` = (position, first host row, length) for
    host <-> CUDA copies."""

    n: int
    ids: torch.Tensor
    rows: list[tuple[int, int, int]] | torch.Tensor | None
    runs: list[tuple[int, int, int]]


class DeviceTier:
    """The engine's registered KV tensors (CPU or CUDA) and gather / scatter of whole blocks.

    ``gather(block_ids, dst, slots)``: payload of ``block_ids[i]`` -> row ``slots[i]`` of ``dst``.
    ``scatter(src, block_ids, slots)``: row ``slots[i]`` of ``src`` -> block ``block_ids[i]``.
    ``dst`` / ``src`` are ``[rows, block_nbytes]`` uint8 tensors (a host slab, a staging buffer, or a
    tensor on the KV device); ``slots`` defaults to rows ``0..n-1``.  ``layers=`` restricts a call to
    some layers (layer-wise loading); the other layers' bytes are left alone on both sides.

    Copies are one indexed copy per layer-component, never a Python loop per block (see
    :mod:`kvtier.layout` for which primitive and why).  Between CUDA KV and host memory the bytes go
    through a device staging buffer, a group of layers at a time on two streams (gather kernels on the
    current stream, DMA on the tier's copy stream; see :meth:`_pipelined`): one copy per contiguous
    run of host rows and group (``cudaMemcpy2DAsync`` for a byte range of each row; a plain strided
    ``copy_`` where that is unavailable).  Layer-wise loads stage one layer at a time.
    """

    def __init__(self, layout: KVLayout, tensors: torch.Tensor | Sequence[torch.Tensor], *,
                 device: Any = None):
        layout.validate(tensors, device=device)
        self.layout = layout
        self.tensors = [tensors] if isinstance(tensors, torch.Tensor) else list(tensors)
        self.device = self.tensors[0].device
        self._codec = _Codec(layout, self.tensors)
        self.copy_dtype = self._codec.copy_dtype
        # Tests set this to run the host<->CUDA staging logic (runs, per-layer rows) on a CPU cache.
        self._force_staging = False
        self._copy_streams: dict[Direction, Any] = {}  # per direction: the DMA side of pipelined copies

    @classmethod
    def allocate(cls, layout: KVLayout, device: Any = "cpu") -> DeviceTier:
        """A tier over freshly allocated (uninitialised) tensors: for tests, benchmarks and standalone
        use without an engine."""
        shapes = layout.tensor_shapes()
        return cls(layout, [torch.empty(s, dtype=layout.dtype, device=device) for s in shapes])

    # ------------------------------------------------------------------ facts

    @property
    def num_blocks(self) -> int:
        return self.layout.num_blocks

    @property
    def block_nbytes(self) -> int:
        return self.layout.block_nbytes

    @property
    def is_cuda(self) -> bool:
        return self.device.type == "cuda"

    def valid_block_ids(self, block_ids: BlockIds) -> np.ndarray:
        """A bool array: which ids are in ``[0, num_blocks)``."""
        # An array is compared as it is: list() of one made a numpy scalar per id (a transfer's submission
        # checks every batch here).
        ids = (block_ids if isinstance(block_ids, np.ndarray) else
               np.asarray(block_ids.cpu() if isinstance(block_ids, torch.Tensor) else list(block_ids),
                          dtype=np.int64)).reshape(-1)
        return (ids >= 0) & (ids < self.num_blocks)

    def plan(self, block_ids: BlockIds, buf: torch.Tensor, slots: BlockIds | None = None) -> CopyPlan:
        """Check ``block_ids`` / ``slots`` against this tier and ``buf`` once, and precompute the index
        tensors, so a batch copied layer by layer pays for it once (pass ``plan=`` to gather/scatter)."""
        ids = as_index(block_ids, "cpu")
        bad = ~self.valid_block_ids(ids)
        if bad.any():
            raise IndexError(f"block ids {ids[torch.from_numpy(bad)].tolist()} out of range "
                             f"[0, {self.num_blocks})")
        n = ids.numel()
        if slots is not None:
            sl = as_index(slots, "cpu")
            if sl.numel() != n:
                raise ValueError(f"{n} block ids but {sl.numel()} slots")
            if n and (int(sl.min()) < 0 or int(sl.max()) >= buf.shape[0]):
                raise IndexError(f"slots out of range [0, {buf.shape[0]}): {sl.tolist()}")
        elif n > buf.shape[0]:
            raise ValueError(f"{n} block ids but the buffer has {buf.shape[0]} rows")
        else:
            sl = None
        same = buf.device == self.device and not self._force_staging
        if not same and not (self.is_cuda and buf.device.type == "cpu") and not self._force_staging:
            raise LayoutError(f"buffer on {buf.device}, KV on {self.device}: copies go between the KV "
                              "device and itself or host memory")
        dev_ids = ids.to(self.device, non_blocking=True) if self.is_cuda else ids
        if same:
            return CopyPlan(n, dev_ids, self._codec.rows(n, sl, buf.shape[0]), [])
        runs = contiguous_runs(sl) if sl is not None else [(0, 0, n)]
        return CopyPlan(n, dev_ids, None, runs)

    # ------------------------------------------------------------------ copies

    def _plan_of(self, block_ids: BlockIds | None, buf: torch.Tensor, slots: BlockIds | None,
                 plan: CopyPlan | None) -> CopyPlan:
        if plan is not None:
            return plan
        if block_ids is None:
            raise TypeError("block_ids is None and no plan was given: one of them says which blocks to copy")
        return self.plan(block_ids, buf, slots)

    def gather(self, block_ids: BlockIds | None, dst: torch.Tensor, slots: BlockIds | None = None, *,
               layers: Sequence[int] | None = None, plan: CopyPlan | None = None) -> torch.Tensor:
        """Blocks -> payload rows of ``dst``.  Returns ``dst``.  With ``plan`` (from :meth:`plan`),
        ``block_ids`` and ``slots`` are the plan's and may be None."""
        p = self._plan_of(block_ids, dst, slots, plan)
        if p.n == 0:
            return dst
        if p.rows is not None:
            self._codec.gather(p.ids, dst, None, layers, p.rows)
            return dst
        # CUDA KV -> host rows: gather on the GPU into staging, then DMA per run of host rows, a group
        # of layers at a time (the copy engine moves group g while the GPU gathers group g + 1).
        staging = torch.empty((p.n, self.block_nbytes), dtype=torch.uint8, device=self.device)

        def kernels(group: Sequence[int]) -> None:
            self._codec.gather(p.ids, staging, None, group, [(0, 0, p.n)])

        def dma(group: Sequence[int]) -> None:
            for pos, first, length in p.runs:
                self._rows_copy(dst[first:first + length], staging[pos:pos + length], group)

        self._pipelined(self._layer_groups(layers, p.n, len(p.runs), dst), kernels, dma, Direction.STORE)
        return dst

    def scatter(self, src: torch.Tensor, block_ids: BlockIds | None, slots: BlockIds | None = None, *,
                layers: Sequence[int] | None = None, plan: CopyPlan | None = None) -> None:
        """Payload rows of ``src`` -> blocks.  With ``plan``, ``block_ids`` and ``slots`` may be None."""
        p = self._plan_of(block_ids, src, slots, plan)
        if p.n == 0:
            return
        if p.rows is not None:
            self._codec.scatter(src, p.ids, None, layers, p.rows)
            return
        if layers is None:
            # Host rows -> staging by DMA a group of layers at a time; each group is scattered into the
            # KV while the copy engine brings the next one.
            staging = torch.empty((p.n, self.block_nbytes), dtype=torch.uint8, device=self.device)

            def dma(group: Sequence[int]) -> None:
                for pos, first, length in p.runs:
                    self._rows_copy(staging[pos:pos + length], src[first:first + length], group)

            def kernels(group: Sequence[int]) -> None:
                self._codec.scatter(staging, p.ids, None, group, [(0, 0, p.n)])

            self._pipelined(self._layer_groups(None, p.n, len(p.runs), src), dma, kernels, Direction.LOAD)
            return
        # Layer-wise: only the requested layers cross the bus, each as its own staging rows, so a
        # layer is complete in device memory before the next one's bytes have been sent.
        lay, cd = self.layout, self.copy_dtype
        ln = lay.layer_nbytes
        for li in layers:
            if not 0 <= li < lay.num_layers:
                raise IndexError(f"layer {li} out of range [0, {lay.num_layers})")
            staging = torch.empty((p.n, ln), dtype=torch.uint8, device=self.device)
            for pos, first, length in p.runs:
                copy_2d(staging[pos:pos + length], src[first:first + length, li * ln:(li + 1) * ln])
            rows = staging.view(cd).view(p.n, lay.copy_components, -1)
            for c, view in enumerate(self._codec.views[li]):
                view.index_copy_(0, p.ids, rows[:, c])

    def gather_layer(self, layer: int, block_ids: BlockIds | None, dst: torch.Tensor,
                     slots: BlockIds | None = None, *,
                     plan: CopyPlan | None = None) -> torch.Tensor:
        """Layer ``layer`` of each block -> its byte range in the payload rows (a layer-wise save)."""
        return self.gather(block_ids, dst, slots, layers=[layer], plan=plan)

    def scatter_layer(self, layer: int, src: torch.Tensor, block_ids: BlockIds | None,
                      slots: BlockIds | None = None, *,
                      plan: CopyPlan | None = None) -> None:
        """Layer ``layer``'s byte range of each payload row -> the blocks (a layer-wise load)."""
        self.scatter(src, block_ids, slots, layers=[layer], plan=plan)

    def _rows_copy(self, dst: torch.Tensor, src: torch.Tensor, layers: Sequence[int] | None) -> None:
        """Whole rows, or only the given layers' byte ranges of each row (one 2-D copy per run of
        consecutive layers)."""
        n, ln = self.layout.num_layers, self.layout.layer_nbytes
        for _, first, k in [(0, 0, n)] if layers is None else contiguous_runs(layers):
            if k == n:
                dst.copy_(src, non_blocking=True)  # whole rows
            else:
                copy_2d(dst[:, first * ln:(first + k) * ln], src[:, first * ln:(first + k) * ln])

    def _layer_groups(self, layers: Sequence[int] | None, n_blocks: int, dma_runs: int,
                      host: torch.Tensor | None = None) -> list[Sequence[int]]:
        """``layers`` (default all) of ``n_blocks`` blocks cut into at most ``PIPELINE_GROUPS`` groups of
        consecutive entries; fewer when a group would move under ``PIPELINE_MIN_GROUP_BYTES`` (a small
        batch pays each group's launches and DMA call and gains little overlap), when there are many
        runs of host rows (each group costs one DMA call per run), and one when the ``host`` rows are
        pageable (a byte range of them is no 2-D DMA, but a staged copy)."""
        todo = list(_layers(layers, self.layout.num_layers))
        k = min(PIPELINE_GROUPS, len(todo), PIPELINE_MAX_DMA_CALLS // max(1, dma_runs))
        if PIPELINE_MIN_GROUP_BYTES:
            k = min(k, n_blocks * len(todo) * self.layout.layer_nbytes // PIPELINE_MIN_GROUP_BYTES)
        # (asked last: CUDA's pointer query cost about 50 us a batch, and a small batch is one group anyway)
        if k > 1 and host is not None and not self._force_staging and not host.is_pinned():
            k = 1
        step = -(-len(todo) // max(1, k))
        return [todo[a:a + step] for a in range(0, len(todo), step)]

    def _pipelined(self, groups: list[Sequence[int]], first: Any, second: Any, direction: Direction) -> None:
        """``first(g)`` then ``second(g)`` for each group, two streams deep on CUDA: the KV kernels run
        on the current stream and the DMA on this tier's copy stream for ``direction``, each group's
        second stage waiting only for its own first stage.  Why: on one stream the bus sat idle until
        every layer's gather kernel had been launched (dozens of them), and the GPU idle during the DMA.
        The current stream ends ordered after every copy, so callers (and the staging buffer, freed on
        that stream) see the same ordering as a single-stream copy.  Without CUDA: in order."""
        if not self.is_cuda:
            for g in groups:
                first(g)
                second(g)
            return
        cur = torch.cuda.current_stream(self.device)
        side = self._copy_stream(direction)
        # A store: kernels (current) feed DMA (side); a load: DMA (side) feeds kernels (current).
        s1, s2 = (cur, side) if direction is Direction.STORE else (side, cur)
        if s1 != cur:
            s1.wait_stream(cur)  # the staging buffer and the KV: after the work already queued
        for g in groups:
            with torch.cuda.stream(s1):
                first(g)
            s2.wait_stream(s1)
            with torch.cuda.stream(s2):
                second(g)
        if s2 != cur:
            cur.wait_stream(s2)

    def _copy_stream(self, direction: Direction) -> Any:
        with _STREAMS_LOCK:
            stream = self._copy_streams.get(direction)
            if stream is None:
                stream = self._copy_streams[direction] = torch.cuda.Stream(self.device)
            return stream

    def write_payload(self, payload: Any, block_id: int) -> None:
        """One block's payload (any contiguous buffer of ``block_nbytes`` bytes) into ``block_id``, every
        copy in the calling thread (CPU KV only).

        Why: a load from a backend copies each block the moment its read has verified it, in the thread
        that read it, while its bytes are still in the CPU cache; copying a chunk of blocks afterwards
        reads them from memory again (measured here, 512 MiB from local_disk into vLLM CPU's layout:
        90 ms per block against 119 ms in two passes, on 2 cores)."""
        if self.is_cuda:
            raise LayoutError("write_payload copies within CPU memory; CUDA KV is loaded through staging")
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} out of range [0, {self.num_blocks})")
        self._codec.write_one(payload, block_id)

    @property
    def holds_payload_rows(self) -> bool:
        """Whether the KV tensors are in CPU memory and hold each block as its payload's rows (one per
        layer-component): a backend can then read a block straight into them (:meth:`block_segments`)."""
        return self._codec.np_views is not None

    def block_segments(self, block_id: int) -> Segments | None:
        """Where block ``block_id``'s payload lies in the KV tensors, in payload order (one part per
        layer-component row): a backend that ``reads_segments`` reads a block straight into them, with no
        copy.  None where the tensors do not hold a block as its payload's bytes (a rearranging layout)
        or are not in CPU memory."""
        views = self._codec.np_views
        if views is None or sum(map(len, views)) + 2 > _IOV_MAX:  # + the header and a backend's probe
            return None
        if not 0 <= block_id < self.num_blocks:
            raise IndexError(f"block id {block_id} out of range [0, {self.num_blocks})")
        return Segments([memoryview(v[block_id]) for comps in views for v in comps])

    def read_blocks(self, block_ids: BlockIds) -> torch.Tensor:
        """The payloads of ``block_ids`` as a new CPU ``[n, block_nbytes]`` tensor (synchronous)."""
        ids = as_index(block_ids, "cpu")
        out = torch.empty((ids.numel(), self.block_nbytes), dtype=torch.uint8)
        self.gather(ids, out)
        if self.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()
        return out

    def write_blocks(self, payloads: torch.Tensor, block_ids: BlockIds) -> None:
        """Write CPU payload rows into ``block_ids`` (synchronous)."""
        self.scatter(payloads, block_ids)
        if self.is_cuda:
            torch.cuda.current_stream(self.device).synchronize()


# ---------------------------------------------------------------------- row copies (same device)


Rows = list[tuple[int, int, int]] | torch.Tensor  # see _Codec.rows

# Whole-block copies between CUDA KV and host memory go in up to this many groups of layers, so the copy
# engine starts after one group's gather kernels instead of all of them (DeviceTier._pipelined).
PIPELINE_GROUPS = 8
# ... but no group moves less than this: each group costs its kernel launches and DMA calls, which a small
# batch does not win back by overlap.  H200, 2 MiB blocks, medians: 1 block stored through TransferEngine
# in 8 groups 2.1 ms, in 1 group 1.2 ms; 8 blocks 3.3 vs 1.2 ms; 32 blocks 3.2 (8 groups) vs 2.5 ms (4);
# from 64 blocks (128 MiB) the floor leaves all 8 and the figures are level (floors of 4-32 MiB compared).
PIPELINE_MIN_GROUP_BYTES = 16 << 20
# One DMA per run of host rows and group: with many runs (a fragmented host tier) small DMAs cost more
# than the overlap saves (measured on an H200: 64 runs in 2 groups ran at 0.4x of copy_, in 1 at 0.66x).
PIPELINE_MAX_DMA_CALLS = 64
_STREAMS_LOCK = threading.Lock()


class _Codec:
    """Row copies between registered KV tensors and payload rows on the same device: to gather,
    ``index_select(out=)`` into the strided payload rows; to scatter, numpy fancy assignment on CPU
    (memcpy speed, GIL released) and ``index_copy_`` on CUDA.  Rows are views in ``copy_dtype``."""

    def __init__(self, layout: KVLayout, tensors: torch.Tensor | Sequence[torch.Tensor],
                 copy_dtype: torch.dtype | None = None):
        self.layout = layout
        self.copy_dtype = copy_dtype or layout.copy_dtype(tensors)
        self.device = _as_list(tensors)[0].device
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
        todo = _layers(layers, self.layout.num_layers)
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

    def gather(self, block_ids: BlockIds, out: torch.Tensor, slots: BlockIds | None, layers: Sequence[int] | None,
               rows: Rows | None = None) -> None:
        ids = as_index(block_ids, self.device)
        dst = self.layout.payload_view(out, self.copy_dtype)
        if rows is None:
            rows = self.rows(ids.numel(), slots, out.shape[0])
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
        ids = as_index(block_ids, self.device)
        src = self.layout.payload_view(payload, self.copy_dtype)
        if rows is None:
            rows = self.rows(ids.numel(), slots, payload.shape[0])
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
        _check_range(ids_np, self.layout.num_blocks, "block id")
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
        work = [(li, c) for li in _layers(layers, self.layout.num_layers)
                for c in range(self.layout.copy_components)]
        if self.device.type == "cpu":
            _parallel(run, work, n * len(work) * self.layout.copy_row_nbytes)
        else:
            run(work)  # CUDA: kernels on the current stream


# The most buffers one vectored read fills (Linux: 1024); a block in more parts is not read as segments.
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 1024

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


def _check_range(idx: np.ndarray, n: int, what: str) -> None:
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


# ---------------------------------------------------------------------- 2-D copies host <-> device

_H2D, _D2H = 1, 2  # cudaMemcpyKind
FORCE_TORCH_2D = os.environ.get("KVTIER_NO_MEMCPY2D", "") not in ("", "0")


def copy_2d(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src, non_blocking=True)`` for 2-D uint8 views whose rows are contiguous but whose row
    pitch may differ, on the current CUDA stream.

    torch copies a strided host<->device view through a pageable temporary (a host-side copy that
    blocks); ``cudaMemcpy2DAsync`` lets the DMA engine walk the pitch itself, one call per view.  The
    runtime is the one torch already loaded (found in ``/proc/self/maps``), so streams and pointers are
    shared; without it we fall back to torch's copy, which is correct but slower."""
    if dst.shape != src.shape or dst.dtype != torch.uint8 or src.dtype != torch.uint8:
        raise ValueError(f"copy_2d: {list(dst.shape)} {dst.dtype} <- {list(src.shape)} {src.dtype}")
    if dst.numel() == 0:
        return
    fn = None if FORCE_TORCH_2D else _memcpy2d_fn()
    cross = dst.device.type != src.device.type
    if fn is None or not cross or dst.stride(1) != 1 or src.stride(1) != 1 or (
            src.device.type == "cpu" and not src.is_pinned()) or (
            dst.device.type == "cpu" and not dst.is_pinned()):
        dst.copy_(src, non_blocking=True)
        return
    kind = _H2D if dst.device.type == "cuda" else _D2H
    dev = dst.device if dst.device.type == "cuda" else src.device
    stream = torch.cuda.current_stream(dev).cuda_stream
    height, width = src.shape
    dpitch = dst.stride(0) if height > 1 else width
    spitch = src.stride(0) if height > 1 else width
    err = fn(ctypes.c_void_p(dst.data_ptr()), ctypes.c_size_t(dpitch), ctypes.c_void_p(src.data_ptr()),
             ctypes.c_size_t(spitch), ctypes.c_size_t(width), ctypes.c_size_t(height), ctypes.c_int(kind),
             ctypes.c_void_p(stream))
    if err != 0:
        raise RuntimeError(f"cudaMemcpy2DAsync failed with cudaError {err} "
                           f"({height} rows x {width} B, pitches {dpitch}/{spitch})")


@functools.lru_cache(maxsize=1)
def _memcpy2d_fn() -> Any:
    if not torch.cuda.is_available():
        return None
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            fn = ctypes.CDLL(path).cudaMemcpy2DAsync
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                       ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        return fn
    return None


def memcpy2d_available() -> bool:
    """Whether layer-wise host<->device copies use ``cudaMemcpy2DAsync`` (else a strided ``copy_``)."""
    return not FORCE_TORCH_2D and _memcpy2d_fn() is not None
