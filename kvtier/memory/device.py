"""Device tier: the engine's KV tensors, registered once, and the copies between them and payload rows.

The engine owns the tensors; kvtier never allocates or frees them.  Everything here is worker-side and
synchronous *with respect to the current stream*: on CPU a call returns when the bytes are there; on CUDA
it enqueues its copies on ``torch.cuda.current_stream()`` and returns (the caller - normally
:class:`kvtier.memory.transfer.TransferEngine` - picks the stream and records the events).

Invariant: a payload written by :meth:`DeviceTier.gather` and read back by :meth:`DeviceTier.scatter`
restores every byte of the blocks, whatever the layout kind (see :mod:`kvtier.format.layout`).
"""

from __future__ import annotations

import os
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from enum import StrEnum
from typing import Any

import numpy as np
import torch

from ..format.blockformat import Segments
from ..format.layout import KVLayout, LayoutError, check_layers
from .blockids import BlockIds, as_index, contiguous_runs, int_array
from .copy2d import copy_2d, memcpy2d_available
from .rows import RowCodec

__all__ = ["BlockIds", "CopyPlan", "DeviceTier", "Direction", "as_index", "contiguous_runs", "copy_2d",
           "int_array", "memcpy2d_available"]

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
    :mod:`kvtier.format.layout` for which primitive and why).  Between CUDA KV and host memory the bytes go
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
        self._codec = RowCodec(layout, self.tensors)
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
        todo = list(check_layers(layers, self.layout.num_layers))
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


# The most buffers one vectored read fills (Linux: 1024); a block in more parts is not read as segments.
_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") and "SC_IOV_MAX" in os.sysconf_names else 1024
