"""SGLang host-pool pages <-> kvtier's canonical block payload.

An SGLang page (``page_size`` tokens) is one kvtier block.  Its stored payload is kvtier's canonical one
(:mod:`kvtier.format.layout`): per layer, K then V (MLA: the one latent component), each ``page_size x heads x
head_dim`` elements row-major, in the KV dtype's own bytes.  So a page stored from any host layout (and a
block stored by the vLLM connector, with the same model / dtype / page size) reads back into any other.

The host pool's ``kv_buffer`` is addressed by named dimensions: ``c`` (K / V), ``l`` (layer), ``n``
(page), ``t`` (token in the page), ``h`` (head), ``d`` (head dim); ``S`` is a token-slot dimension that
splits into ``(n, t)``:

======================  ==========================  ==========================
layout                  MHA ``kv_buffer``           MLA ``kv_buffer``
======================  ==========================  ==========================
``layer_first``         ``[c, l, S, h, d]``         ``[l, S, h=1, d]``
``page_first``          ``[c, S, l, h, d]``         ``[S, l, h=1, d]``
``page_first_direct``   ``[c, n, l, t, h, d]``      ``[n, l, t, h=1, d]``
``page_head``           ``[c, n, h, t, l, d]``      (none)
======================  ==========================  ==========================

Each becomes a strided view ``[n, l, c, t, h, d]`` of the buffer (no copy), so a batch of pages moves
with one ``index_select`` (host -> payload rows) or one strided copy per page (rows -> host), whatever
the layout (measured here, 8 MiB pages of a 32-layer model: 14-34 GB/s out, 22-32 GB/s in).  SGLang's flat pages (``get_data_page(flat=True)``, the non-``interface_v1`` API) are one page
of the same buffer, ``n`` dropped, flattened: the same names give their order.  Elements move as
same-width integers (a reinterpretation of the bytes, never a conversion), so every dtype, fp8 included,
round-trips bit-exactly.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from ...format.layout import dtype_name

CANONICAL = ("n", "l", "c", "t", "h", "d")

MHA_LAYOUTS: dict[str, tuple[str, ...]] = {
    "layer_first": ("c", "l", "S", "h", "d"),
    "page_first": ("c", "S", "l", "h", "d"),
    "page_first_direct": ("c", "n", "l", "t", "h", "d"),
    "page_head": ("c", "n", "h", "t", "l", "d"),
}
MLA_LAYOUTS: dict[str, tuple[str, ...]] = {
    "layer_first": ("l", "S", "h", "d"),
    "page_first": ("S", "l", "h", "d"),
    "page_first_direct": ("n", "l", "t", "h", "d"),
}
_INT_OF_WIDTH = {1: torch.uint8, 2: torch.int16, 4: torch.int32, 8: torch.int64}


class PageLayoutError(ValueError):
    """The host pool is not one kvtier can move pages of; the message says what is supported."""


@dataclass(frozen=True)
class PageGeometry:
    """What one page holds, as kvtier's ``model`` section sees it."""

    dtype: torch.dtype
    num_layers: int
    num_kv_heads: int
    head_dim: int
    page_size: int
    mla: bool

    @property
    def num_components(self) -> int:
        return 1 if self.mla else 2

    @property
    def page_nbytes(self) -> int:
        return (self.num_layers * self.num_components * self.page_size * self.num_kv_heads * self.head_dim
                * self.dtype.itemsize)


def geometry(pool: Any, mla: bool) -> PageGeometry:
    """The page geometry of an SGLang host pool (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost``)."""
    name = type(pool).__name__
    layouts = MLA_LAYOUTS if mla else MHA_LAYOUTS
    layout = getattr(pool, "layout", None)
    if layout not in layouts:
        raise PageLayoutError(f"kvtier: SGLang host layout {layout!r} ({name}) is not supported for "
                              f"{'MLA' if mla else 'MHA'} models; use --hicache-mem-layout "
                              f"{' / '.join(layouts)}")
    if getattr(pool, "dcp_size", 1) != 1:
        raise PageLayoutError("kvtier: decode context parallelism (dcp_size > 1) is not supported")
    if mla:
        heads, dim = 1, int(pool.kv_cache_dim)
    else:
        v_dim = getattr(pool, "v_head_dim", pool.head_dim)
        if v_dim != pool.head_dim:
            raise PageLayoutError(f"kvtier: K head dim {pool.head_dim} != V head dim {v_dim} ({name}): "
                                  "the canonical payload needs K and V of one shape")
        heads, dim = int(pool.head_num), int(pool.head_dim)
    geo = PageGeometry(pool.dtype, int(pool.layer_num), heads, dim, int(pool.page_size), mla)
    buf = getattr(pool, "kv_buffer", None)
    if not isinstance(buf, torch.Tensor):
        raise PageLayoutError(f"kvtier: {name} has no kv_buffer tensor (layout {layout!r} is not supported)")
    want = _buffer_shape(layouts[layout], geo, _slots(buf, layouts[layout], geo))
    if tuple(buf.shape) != want or not buf.is_contiguous():
        raise PageLayoutError(f"kvtier: {name} kv_buffer has shape {tuple(buf.shape)} (contiguous: "
                              f"{buf.is_contiguous()}), expected a contiguous {want} for layout {layout!r}")
    return geo


def _sizes(geo: PageGeometry) -> dict[str, int]:
    return {"c": 2, "l": geo.num_layers, "t": geo.page_size, "h": geo.num_kv_heads, "d": geo.head_dim}


def _slots(buf: torch.Tensor, names: tuple[str, ...], geo: PageGeometry) -> int:
    """Token slots of the buffer (``S``, or ``n * t``)."""
    if "S" in names:
        return int(buf.shape[names.index("S")])
    return int(buf.shape[names.index("n")]) * geo.page_size


def _buffer_shape(names: tuple[str, ...], geo: PageGeometry, slots: int) -> tuple[int, ...]:
    size = {**_sizes(geo), "S": slots, "n": slots // geo.page_size}
    return tuple(size[x] for x in names)


class PageCodec:
    """Moves whole pages between one SGLang host pool and canonical payload rows.

    Invariant: ``gather`` then ``scatter`` of the same rows is the identity on the pool's bytes, and the
    row of a page is the same bytes whatever the pool's layout (for the same KV)."""

    def __init__(self, pool: Any, mla: bool):
        self.pool = pool
        self.geo = geometry(pool, mla)
        self.layout: str = pool.layout
        names = (MLA_LAYOUTS if mla else MHA_LAYOUTS)[self.layout]
        geo = self.geo
        self.int_dtype = _INT_OF_WIDTH[geo.dtype.itemsize]
        buf: torch.Tensor = pool.kv_buffer.view(self.int_dtype)
        slots = _slots(buf, names, geo)
        self.num_pages = slots // geo.page_size
        # Split S into (n, t); MLA gets a size-1 component dimension.
        split: list[str] = []
        for x in names:
            split += ["n", "t"] if x == "S" else [x]
        size = {**_sizes(geo), "n": self.num_pages}
        view = buf.reshape([size[x] for x in split])  # a view: S is contiguous, so it splits
        if mla:
            view, split = view.unsqueeze(0), ["c", *split]
        self.pages = view.permute([split.index(x) for x in CANONICAL])  # [n, l, c, t, h, d], strided
        flat = [x for x in split if x != "n"]
        self._flat_names = flat
        self._flat_shape = [1 if x == "c" and mla else size[x] for x in flat]
        self._flat_perm = [flat.index(x) for x in CANONICAL[1:]]
        self._row_shape = [geo.num_layers, geo.num_components, geo.page_size, geo.num_kv_heads, geo.head_dim]

    @property
    def page_nbytes(self) -> int:
        return self.geo.page_nbytes

    def describe(self) -> str:
        g = self.geo
        return (f"{'MLA' if g.mla else 'MHA'} {self.layout}, {dtype_name(g.dtype)}, {g.num_layers} layers, "
                f"{g.num_kv_heads} heads x {g.head_dim}, page {g.page_size}")

    # ------------------------------------------------------------------ host indices -> pages

    def page_ids(self, host_indices: torch.Tensor, num_pages: int) -> torch.Tensor | None:
        """The page numbers of ``num_pages`` whole pages given as token slots; None when the slots are
        not whole, aligned pages (SGLang's host allocator always hands out whole pages)."""
        P = self.geo.page_size
        idx = host_indices.reshape(-1).to(device="cpu", dtype=torch.int64)
        if idx.numel() != num_pages * P:
            return None
        grid = idx.view(num_pages, P)
        starts = grid[:, 0]
        if bool((starts % P).any()) or not bool((grid - starts[:, None] == torch.arange(P)).all()):
            return None
        ids = starts // P
        if num_pages and (int(ids.min()) < 0 or int(ids.max()) >= self.num_pages):
            return None
        return ids

    def rows_view(self, buf: torch.Tensor) -> torch.Tensor:
        """``buf`` (``[n, page_nbytes]`` uint8, contiguous) as ``[n, l, c, t, h, d]`` elements."""
        return buf.view(self.int_dtype).view(buf.shape[0], *self._row_shape)

    # ------------------------------------------------------------------ interface_v1: pool slots

    def gather(self, page_ids: torch.Tensor, out: torch.Tensor) -> None:
        """Canonical payloads of pages ``page_ids`` into rows of ``out`` (``[n, page_nbytes]`` uint8)."""
        torch.index_select(self.pages, 0, page_ids, out=self.rows_view(out))

    def scatter(self, rows: torch.Tensor, page_ids: torch.Tensor) -> None:
        """Rows of ``rows`` (``[n, page_nbytes]`` uint8) into pages ``page_ids`` of the pool.  One strided
        copy per page (2-4x faster than ``index_copy_`` into a permuted view on CPU)."""
        src = self.rows_view(rows)
        for j, p in enumerate(page_ids.tolist()):
            self.pages[p].copy_(src[j])

    # ------------------------------------------------------------------ SGLang's flat pages (no interface_v1)

    def _flat(self, page: torch.Tensor) -> torch.Tensor:
        n = 1
        for s in self._flat_shape:
            n *= s
        if page.numel() != n or page.dtype != self.geo.dtype:
            raise PageLayoutError(f"kvtier: a flat page of {page.numel()} {page.dtype} elements, expected {n} "
                                  f"{self.geo.dtype} ({self.describe()})")
        return page.reshape(-1).view(self.int_dtype).view(self._flat_shape).permute(self._flat_perm)

    def flat_to_row(self, page: torch.Tensor, row: torch.Tensor) -> None:
        """An SGLang flat page (``get_data_page(i, flat=True)``) into one canonical row (``[page_nbytes]``)."""
        self.rows_view(row.view(1, -1))[0].copy_(self._flat(page))

    def row_to_flat(self, row: torch.Tensor, page: torch.Tensor) -> None:
        """One canonical row into an SGLang flat page buffer (what ``set_from_flat_data_page`` reads)."""
        if not page.is_contiguous():
            raise PageLayoutError("kvtier: the flat page buffer must be contiguous")
        self._flat(page).copy_(self.rows_view(row.view(1, -1))[0])
