"""KV tensor layouts and the canonical block payload: what a block looks like as bytes.

An engine keeps its KV cache in one of these shapes (``N`` = num_blocks, ``B`` = block_size,
``H`` = kv heads, ``D`` = head dim, or the latent dim for MLA):

==============  ===========================================  ==========================
kind            tensors                                      one layer
==============  ===========================================  ==========================
``flash_attn``  one per layer                                ``[2, N, B, H, D]``
``flashinfer``  one per layer                                ``[N, 2, B, H, D]``
``mla``         one per layer                                ``[N, B, D]``
``cpu_attn``    one per layer (vLLM's CPU backend, LBHNC)    ``[N, H, B, 2*D]``
``cpu_attn_amx`` the same, written by vLLM CPU's AMX kernel  ``[N, H, B, 2*D]``
``stacked``     one tensor, layer first                      ``[L, <inner layer shape>]``
==============  ===========================================  ==========================

``cpu_attn`` / ``cpu_attn_amx`` are head-major: within a block, each head holds ``B*D`` elements of K
then ``B*D`` of V (vLLM CPU views a layer as ``[N, H, 2*B, D]`` and splits it in two along dim 2), and
inside those, vLLM CPU's ``cpu_attn_reshape_and_cache`` kernel keeps its own arrangement
(:data:`HEAD_ARRANGEMENTS`; read back from the kernel in ``tests/test_vllm_cpu_kv_arrangement.py``): its
``vec`` / ``vec16`` kernels K dim-major ``[D, B]`` and V token-major ``[B, D]``, its ``amx`` kernel K
``[B/16, D/2, 16, 2]`` and V ``[D/16, B/2, 16, 2]`` (VNNI pairs in tiles of 16).  Copies undo that
arrangement (one strided copy per layer-component), so the payload is the same canonical one.

**The engine payload** (``payload="engine"``, YAML ``storage.payload: engine``): a head-major layout's value
can instead hold each layer's block exactly as the engine keeps it (``[H, 2, B*D]`` in the kernel's
arrangement), so copies are plain row copies (measured here, 128 blocks of 4 MiB into vLLM CPU's AMX cache:
87 ms against 349 ms rearranging, one thread).  Only an instance whose cache has the same kind reads
those values: the namespace names the kind (:attr:`kvtier.keys.Namespace.payload`), so every other one
misses them.  Every other kind's block already is the canonical payload, and ``engine`` changes nothing.

``stacked`` takes an ``inner`` kind (default ``flash_attn``, so ``[L, 2, N, B, H, D]``; ``inner="mla"``
gives ``[L, N, B, D]``).

**The canonical block payload** (what the host tier and every backend store for one block) is, in
this order and with nothing in between::

    for layer in 0 .. L-1:
        for component in (K, V)        # MHA; MLA has the single latent component
            B x H x D elements, row-major (token, head, dim), in the KV dtype's native bytes

so ``block_nbytes = L * (2 or 1) * B * H * D * itemsize``.  It depends only on
:meth:`KVLayout.payload_signature` (dtype, layers, components, B, H, D) and never on the kind: a
flash_attn prefill and a flashinfer decode with the same KV dtype and shape write and read identical
bytes.  Values are treated as raw bytes (never converted), so every dtype, fp8 included, round-trips
bit-exactly.

Copies move whole rows (one layer-component of one block, ``B*H*D*itemsize`` bytes) with one indexed
copy per layer-component, never a Python loop per block: ``index_select(out=)`` to gather, and to
scatter ``index_copy_`` (CUDA) or numpy fancy assignment (CPU: one GIL-free single-threaded pass that
stays at memcpy speed where torch's element-wise CPU ``index_copy_`` reaches ~0.7x and its intra-op
threads stall on a busy host).  Rows are viewed as the widest integer type that divides them
(``copy_dtype``), so no float semantics ever touch the bytes.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..keys import CANONICAL_PAYLOAD, HEAD_MAJOR_KINDS

KINDS = ("flash_attn", "flashinfer", "mla", "cpu_attn", "cpu_attn_amx", "stacked")

_SHAPE_DOC = {
    "flash_attn": "[2, num_blocks, block_size, kv_heads, head_dim]",
    "flashinfer": "[num_blocks, 2, block_size, kv_heads, head_dim]",
    "mla": "[num_blocks, block_size, latent_dim]",
    "cpu_attn": "[num_blocks, kv_heads, block_size, 2 * head_dim]",
    "cpu_attn_amx": "[num_blocks, kv_heads, block_size, 2 * head_dim]",
}


def _arrangement(name: str, b: int, d: int) -> tuple[tuple[int, ...], tuple[int, ...]]:
    """``(split, order)`` of one head-major component: a block's canonical component ``[B, H, D]``
    reshaped to ``split`` (token axes, the head axis, dim axes) and transposed by ``order`` is the
    component as the engine keeps it in memory (head axis first)."""
    if name == "token_major":  # [H, B, D]
        return (b, -1, d), (1, 0, 2)
    if name == "dim_major":  # [H, D, B]
        return (b, -1, d), (1, 2, 0)
    if name == "amx_k":  # [H, B/16, D/2, 16, 2]: axes of split (t/16, t%16, h, d/2, d%2)
        return (b // 16, 16, -1, d // 2, 2), (2, 0, 3, 1, 4)
    if name == "amx_v":  # [H, D/16, B/2, 16, 2]: axes of split (t/2, t%2, h, d/16, d%16)
        return (b // 2, 2, -1, d // 16, 16), (2, 3, 0, 4, 1)
    raise LayoutError(f"unknown head arrangement {name!r}")


#: Per head-major kind, the in-head arrangement of K and of V (see the module docstring).
HEAD_ARRANGEMENTS: dict[str, tuple[str, str]] = {
    "cpu_attn": ("dim_major", "token_major"),  # vLLM CPU's vec / vec16 kernels
    "cpu_attn_amx": ("amx_k", "amx_v"),  # vLLM CPU's amx kernel (bf16, blocks a multiple of 32)
}

_DTYPE_ALIASES: dict[str, torch.dtype] = {
    "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
    "float16": torch.float16, "fp16": torch.float16, "half": torch.float16,
    "float32": torch.float32, "fp32": torch.float32, "float": torch.float32,
    "float8_e4m3fn": torch.float8_e4m3fn, "fp8_e4m3": torch.float8_e4m3fn, "fp8": torch.float8_e4m3fn,
    "float8_e5m2": torch.float8_e5m2, "fp8_e5m2": torch.float8_e5m2,
    "uint8": torch.uint8, "int8": torch.int8,
}
for _name in ("float8_e4m3fnuz", "float8_e5m2fnuz"):
    if hasattr(torch, _name):
        _DTYPE_ALIASES[_name] = getattr(torch, _name)

# Element types used to move rows, by width in bytes (see the module docstring).
_COPY_DTYPES = ((8, torch.int64), (4, torch.int32), (2, torch.int16), (1, torch.uint8))


class LayoutError(ValueError):
    """Tensors (or a buffer) do not match the declared layout; the message says what was expected and
    what was found."""


def parse_dtype(dtype: torch.dtype | str) -> torch.dtype:
    """A torch dtype from a dtype or a name ("bfloat16", "bf16", "fp8_e4m3", "float8_e5m2", ...)."""
    if isinstance(dtype, torch.dtype):
        return dtype
    if isinstance(dtype, str):
        key = dtype.lower().removeprefix("torch.")
        if key in _DTYPE_ALIASES:
            return _DTYPE_ALIASES[key]
    raise LayoutError(f"dtype: expected a torch dtype or one of {', '.join(sorted(_DTYPE_ALIASES))}, "
                      f"got {dtype!r}")


def dtype_name(dtype: torch.dtype) -> str:
    """The canonical name of a dtype, as used in namespaces and configs ("bfloat16", "float8_e4m3fn")."""
    return str(dtype).removeprefix("torch.")


@dataclass(frozen=True)
class KVLayout:
    """How one engine's KV tensors are shaped, and the payload of one block.

    Invariants: every field is validated on construction; ``block_nbytes`` and the payload order depend
    only on ``payload_signature``; ``validate(tensors)`` accepts exactly the tensors ``component_views``
    can address without copying.
    """

    kind: str
    num_layers: int
    num_blocks: int
    block_size: int
    num_kv_heads: int
    head_dim: int
    dtype: torch.dtype = torch.bfloat16
    inner: str | None = None  # per-layer kind of a "stacked" tensor; None otherwise
    payload: str = CANONICAL_PAYLOAD  # "canonical" or "engine" (see the module docstring)
    _rows: int = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if self.kind not in KINDS:
            raise LayoutError(f"kind: expected one of {', '.join(KINDS)}, got {self.kind!r}")
        object.__setattr__(self, "dtype", parse_dtype(self.dtype))
        if self.kind == "stacked":
            inner = self.inner or "flash_attn"
            if inner not in ("flash_attn", "flashinfer", "mla"):
                raise LayoutError(f"inner: a stacked layout's per-layer kind must be flash_attn, "
                                  f"flashinfer or mla, got {inner!r}")
            object.__setattr__(self, "inner", inner)
        elif self.inner is not None:
            raise LayoutError(f"inner: only a stacked layout has an inner kind, got inner={self.inner!r} "
                              f"for kind {self.kind!r}")
        for f in ("num_layers", "num_blocks", "block_size", "num_kv_heads", "head_dim"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise LayoutError(f"{f}: expected an integer >= 1, got {v!r}")
        if self.attention == "mla" and self.num_kv_heads != 1:
            raise LayoutError(f"num_kv_heads: an MLA layout has one latent vector per token, so "
                              f"num_kv_heads must be 1, got {self.num_kv_heads}")
        if self.payload not in (CANONICAL_PAYLOAD, "engine"):
            raise LayoutError(f"payload: expected 'canonical' or 'engine', got {self.payload!r}")
        if self.kind == "cpu_attn_amx" and (self.block_size % 16 or self.head_dim % 16):
            raise LayoutError(f"cpu_attn_amx packs tiles of 16 tokens and 16 dims: block_size and head_dim "
                              f"must be multiples of 16, got {self.block_size} and {self.head_dim}")
        object.__setattr__(self, "_rows", self.block_size * self.num_kv_heads * self.head_dim)

    # ------------------------------------------------------------------ constructors

    @classmethod
    def from_namespace(cls, ns: Any, num_blocks: int, kind: str | None = None, *,
                       inner: str | None = None) -> KVLayout:
        """The layout of a :class:`kvtier.keys.Namespace` with ``num_blocks`` blocks.

        ``kind`` defaults to ``flash_attn`` (``mla`` for an MLA namespace), and a stacked layout's
        ``inner`` kind to the same."""
        if kind is None:
            kind = "mla" if ns.attention == "mla" else "flash_attn"
        if kind == "stacked" and inner is None:
            inner = "mla" if ns.attention == "mla" else "flash_attn"
        engine = ns.payload != CANONICAL_PAYLOAD
        if engine and ns.payload != kind:
            raise LayoutError(f"the namespace's values hold {ns.payload}'s own arrangement of a block "
                              f"(storage.payload: engine), but this engine's layout is {kind}")
        layout = cls(kind, ns.num_layers, num_blocks, ns.block_size, ns.num_kv_heads, ns.head_dim,
                     parse_dtype(ns.kv_dtype), inner, "engine" if engine else CANONICAL_PAYLOAD)
        if layout.attention != ns.attention:
            raise LayoutError(f"kind {kind!r} stores {layout.attention.upper()} KV but the namespace's "
                              f"attention is {ns.attention!r}")
        return layout

    @classmethod
    def infer(cls, kind: str, tensors: torch.Tensor | Sequence[torch.Tensor], *,
              inner: str | None = None) -> KVLayout:
        """The layout of an engine's existing tensors (then checked with :meth:`validate`)."""
        ts = tensor_list(tensors)
        if not ts or not all(isinstance(t, torch.Tensor) for t in ts):
            raise LayoutError("infer: expected a tensor or a non-empty list of tensors")
        t = ts[0]
        per_layer_kind = (inner or "flash_attn") if kind == "stacked" else kind
        want = (3 if per_layer_kind == "mla" else 4 if per_layer_kind in HEAD_MAJOR_KINDS else 5) + (kind == "stacked")
        if t.dim() != want:
            raise LayoutError(f"infer: a {kind} tensor has {want} dims, got shape {tuple(t.shape)}")
        shape = tuple(t.shape[1:]) if kind == "stacked" else tuple(t.shape)
        num_layers = t.shape[0] if kind == "stacked" else len(ts)
        if per_layer_kind == "flash_attn":
            _, n, b, h, d = shape
        elif per_layer_kind == "flashinfer":
            n, _, b, h, d = shape
        elif per_layer_kind in HEAD_MAJOR_KINDS:
            n, h, b, d = shape[0], shape[1], shape[2], shape[3] // 2
        else:
            (n, b, d), h = shape[:3], 1
        layout = cls(kind, num_layers, n, b, h, d, t.dtype, inner)
        layout.validate(tensors)
        return layout

    # ------------------------------------------------------------------ derived facts

    @property
    def attention(self) -> str:
        """"mha" (K and V per token) or "mla" (one latent vector per token)."""
        return "mla" if (self.inner or self.kind) == "mla" else "mha"

    @property
    def head_major(self) -> bool:
        """Whether a block's components are kept head-major (``cpu_attn``, ``cpu_attn_amx``), in an
        arrangement of the engine's own (:meth:`head_views`)."""
        return self.kind in HEAD_MAJOR_KINDS

    @property
    def engine_payload(self) -> bool:
        """Whether values hold the engine's own arrangement of a block (a head-major kind with
        ``payload="engine"``), not the canonical one."""
        return self.head_major and self.payload == "engine"

    @property
    def rearranges(self) -> bool:
        """Whether copies between the tensors and the payload rearrange elements (head-major kinds with
        the canonical payload), rather than move whole rows."""
        return self.head_major and not self.engine_payload

    @property
    def copy_components(self) -> int:
        """Rows per layer that copies move: the payload's components, or one row (the whole layer of a
        block, K and V as the engine interleaves them) for an engine payload."""
        return 1 if self.engine_payload else self.num_components

    @property
    def num_components(self) -> int:
        """Components per layer in the payload: 2 (K, V) for MHA, 1 for MLA."""
        return 1 if self.attention == "mla" else 2

    @property
    def itemsize(self) -> int:
        return self.dtype.itemsize

    @property
    def row_nbytes(self) -> int:
        """Bytes of one component of one layer of one block (``B*H*D*itemsize``)."""
        return self._rows * self.itemsize

    @property
    def copy_row_nbytes(self) -> int:
        """Bytes of one row copies move (:attr:`copy_components` per layer)."""
        return self.layer_nbytes // self.copy_components

    @property
    def layer_nbytes(self) -> int:
        """Bytes of one layer of one block in the payload (all its components)."""
        return self.num_components * self.row_nbytes

    @property
    def block_nbytes(self) -> int:
        """Bytes of one block's payload: all layers."""
        return self.num_layers * self.layer_nbytes

    @property
    def payload_signature(self) -> tuple[str | int, ...]:
        """Two layouts with equal signatures produce identical payload bytes for identical KV."""
        sig: tuple[str | int, ...] = (dtype_name(self.dtype), self.num_layers, self.num_components,
                                      self.block_size, self.num_kv_heads, self.head_dim)
        return (*sig, self.kind) if self.engine_payload else sig

    def compatible(self, other: KVLayout) -> bool:
        """Whether blocks stored through ``other`` can be loaded through this layout."""
        return self.payload_signature == other.payload_signature

    def layer_shape(self) -> tuple[int, ...]:
        """Expected shape of one layer's tensor (for ``stacked``: of ``tensor[layer]``)."""
        k = self.layer_kind
        n, b, h, d = self.num_blocks, self.block_size, self.num_kv_heads, self.head_dim
        if k in HEAD_MAJOR_KINDS:
            return (n, h, b, 2 * d)
        return {"flash_attn": (2, n, b, h, d), "flashinfer": (n, 2, b, h, d), "mla": (n, b, d)}[k]

    @property
    def layer_kind(self) -> str:
        """The kind of one layer's tensor: ``inner`` for ``stacked`` (set by construction), else ``kind``."""
        return (self.inner or "flash_attn") if self.kind == "stacked" else self.kind

    def tensor_shapes(self) -> list[tuple[int, ...]]:
        """Expected shape of every tensor the engine registers."""
        if self.kind == "stacked":
            return [(self.num_layers, *self.layer_shape())]
        return [self.layer_shape()] * self.num_layers

    def describe(self) -> str:
        doc = _SHAPE_DOC[self.layer_kind]
        return f"stacked [num_layers, {doc[1:]}" if self.kind == "stacked" else f"{self.kind}: {doc}"

    # ------------------------------------------------------------------ validation

    def validate(self, tensors: torch.Tensor | Sequence[torch.Tensor], device: Any = None) -> None:
        """Raise :class:`LayoutError` unless ``tensors`` match this layout exactly: count, type, dtype,
        shape (block and layer counts), one device (``device`` if given), and each block's component
        (``[block_size, kv_heads, head_dim]``) contiguous in memory."""
        ts = tensor_list(tensors)
        stacked = self.kind == "stacked"
        want_n = 1 if stacked else self.num_layers
        if len(ts) != want_n:
            what = "1 stacked tensor" if stacked else f"{want_n} layer tensors ({self.kind}: one per layer)"
            raise LayoutError(f"expected {what}, got {len(ts)}")
        want_dev = torch.device(device) if device is not None else None
        first_dev = None
        for i, (t, shape) in enumerate(zip(ts, self.tensor_shapes())):
            where = "stacked tensor" if stacked else f"layer {i}"
            if not isinstance(t, torch.Tensor):
                raise LayoutError(f"{where}: expected a torch.Tensor, got {type(t).__name__}")
            if t.dtype != self.dtype:
                raise LayoutError(f"{where}: expected dtype {dtype_name(self.dtype)}, got {dtype_name(t.dtype)}")
            if tuple(t.shape) != shape:
                raise LayoutError(f"{where}: expected shape {shape} ({self.describe()}), got "
                                  f"{tuple(t.shape)}{self._shape_hint(tuple(t.shape), shape)}")
            if want_dev is not None and not _same_device(t.device, want_dev):
                raise LayoutError(f"{where}: expected device {want_dev}, found {t.device}")
            if first_dev is None:
                first_dev = t.device
            elif t.device != first_dev:
                raise LayoutError(f"{where}: on {t.device} but layer 0 is on {first_dev}; "
                                  "all KV tensors must be on one device")
            inner = t.stride()[-3:] if self.attention == "mha" else t.stride()[-2:]
            want = (self.num_kv_heads * self.head_dim, self.head_dim, 1)[-len(inner):]
            if self.head_major:
                want = (self.block_size * 2 * self.head_dim, 2 * self.head_dim, 1)
            if tuple(inner) != want:
                raise LayoutError(f"{where}: not contiguous within a block: the last {len(want)} dims must "
                                  f"have strides {want}, found strides {tuple(t.stride())} "
                                  "(register a .contiguous() tensor)")

    def _shape_hint(self, got: tuple[int, ...], want: tuple[int, ...]) -> str:
        if len(got) != len(want):
            return f": {len(got)} dims, expected {len(want)}"
        off = 1 if self.kind == "stacked" else 0
        k = self.layer_kind
        blocks_dim = off + (1 if k == "flash_attn" else 0)
        diff = [i for i in range(len(want)) if got[i] != want[i]]
        if diff == [blocks_dim]:
            return f": {got[blocks_dim]} blocks, expected {want[blocks_dim]}"
        if self.kind == "stacked" and diff == [0]:
            return f": {got[0]} layers, expected {want[0]}"
        return ""

    # ------------------------------------------------------------------ copy views (worker side)

    def copy_dtype(self, tensors: torch.Tensor | Sequence[torch.Tensor]) -> torch.dtype:
        """The widest integer type that every row of ``tensors`` (and of any aligned payload buffer)
        can be viewed as: rows are moved as that type, bit for bit."""
        if self.rearranges:
            # Transposed copies move single elements: an integer type of the element's width.
            return next(dt for width, dt in _COPY_DTYPES if width == self.itemsize)
        rows = [r for comps in self._rows_native(tensors) for r in comps]
        for width, dt in _COPY_DTYPES:
            if self.copy_row_nbytes % width == 0 and all(
                    (r.storage_offset() * r.element_size()) % width == 0
                    and (r.stride(0) * r.element_size()) % width == 0 for r in rows):
                return dt
        return torch.uint8

    def component_views(self, tensors: torch.Tensor | Sequence[torch.Tensor],
                        copy_dtype: torch.dtype | None = None) -> list[list[torch.Tensor]]:
        """For each layer, for each payload component, a ``[num_blocks, row]`` view of the KV tensors in
        ``copy_dtype`` (no copy).  Row ``b`` of ``views[l][c]`` is component ``c`` of layer ``l`` of
        block ``b``.  The tensors must pass :meth:`validate`."""
        cd = copy_dtype or self.copy_dtype(tensors)
        # A reinterpretation of the bytes, never a conversion.
        return [[r if r.dtype == cd else r.view(cd) for r in comps] for comps in self._rows_native(tensors)]

    def _rows_native(self, tensors: torch.Tensor | Sequence[torch.Tensor]) -> list[list[torch.Tensor]]:
        """``component_views`` in the KV dtype: each block's component flattened to one row (a view,
        since validate() checked the within-block dims are contiguous)."""
        ts = tensor_list(tensors)
        per_layer = list(ts[0].unbind(0)) if self.kind == "stacked" else ts
        k = self.layer_kind
        if self.engine_payload:
            return [[t.reshape(t.shape[0], -1)] for t in per_layer]  # a block's layer as the engine keeps it
        if k in HEAD_MAJOR_KINDS:
            raise LayoutError(f"{k} components are head-major, not rows: use head_views()")
        out = []
        for t in per_layer:
            comps = [t[0], t[1]] if k == "flash_attn" else [t[:, 0], t[:, 1]] if k == "flashinfer" else [t]
            out.append([c.reshape(c.shape[0], -1) for c in comps])
        return out

    def head_views(self, tensors: torch.Tensor | Sequence[torch.Tensor]) -> list[list[HeadView]]:
        """Head-major kinds: for each layer, for K and V, the component in memory (a ``[num_blocks, H,
        ...]`` view, no copy; strided: a head's K and V alternate) with how to turn a block of it into the
        canonical ``[B, H, D]`` and back.  Where the innermost axis is the same in memory and in the
        payload (V token-major, AMX's pairs of K dims), its elements move together as one wider integer
        (``HeadView.mem``'s dtype): a rearranging copy of 2-byte elements runs at a fraction of one of 8-byte
        units (measured here, numpy: AMX K 0.95 GiB/s by element, 3.75 by pairs)."""
        n, h, b, d = self.num_blocks, self.num_kv_heads, self.block_size, self.head_dim
        out = []
        for t in tensor_list(tensors):
            comps = []
            for c, name in enumerate(HEAD_ARRANGEMENTS[self.kind]):
                split, order = _arrangement(name, b, d)
                split = tuple(h if x == -1 else x for x in split)
                m = 1  # elements per unit
                if order[-1] == len(split) - 1:
                    m = next(k for k in (8, 4, 2, 1) if k * self.itemsize <= 8 and split[-1] % k == 0
                             and any(w == k * self.itemsize for w, _ in _COPY_DTYPES))
                    split = (*split[:-1], split[-1] // m)
                unit = next(dt for w, dt in _COPY_DTYPES if w == m * self.itemsize)
                v = (t if t.dtype == unit else t.view(unit)).view(n, h, 2, b * d // m)
                mem = tuple(split[i] for i in order)  # head axis first
                comps.append(HeadView(v[:, :, c].reshape(n, *mem), split, order))
            out.append(comps)
        return out

    def payload_view(self, buf: torch.Tensor, copy_dtype: torch.dtype) -> torch.Tensor:
        """``buf`` (``[n, block_nbytes]`` uint8 rows, each row contiguous) as ``[n, L, C, row]`` of
        ``copy_dtype``, without copying; raises :class:`LayoutError` when it cannot be viewed so."""
        if buf.dtype != torch.uint8 or buf.dim() != 2 or buf.shape[1] != self.block_nbytes:
            raise LayoutError(f"payload buffer: expected a [n, {self.block_nbytes}] uint8 tensor, got "
                              f"{list(buf.shape)} {dtype_name(buf.dtype)}")
        if buf.stride(1) != 1:
            raise LayoutError(f"payload buffer: each row must be contiguous, found strides {buf.stride()}")
        try:
            v = buf.view(copy_dtype)
        except RuntimeError as e:
            raise LayoutError(f"payload buffer: cannot view its rows as {dtype_name(copy_dtype)} "
                              f"(misaligned, storage offset {buf.storage_offset()}): {e}") from None
        n = buf.shape[0]
        return v.view(n, self.num_layers, self.copy_components, self.copy_row_nbytes // v.element_size())


@dataclass(frozen=True)
class HeadView:
    """One layer-component of a head-major cache: ``mem`` (``[num_blocks, *memory shape]``), and for
    one block, canonical ``[B, H, D]`` ``.reshape(split).transpose(order)`` == ``mem[block]``."""

    mem: torch.Tensor  # in the integer type elements move as (``split``'s last axis counts these)
    split: tuple[int, ...]
    order: tuple[int, ...]

    @property
    def to_canonical(self) -> tuple[int, ...]:
        """The transpose taking ``mem[block]`` (axes in memory order) back to ``split``'s axes."""
        return tuple(self.order.index(i) for i in range(len(self.order)))


# ---------------------------------------------------------------------- helpers


def tensor_list(tensors: Any) -> list[torch.Tensor]:
    """One tensor or several, as a list."""
    if isinstance(tensors, torch.Tensor):
        return [tensors]
    return list(tensors)


def _same_device(a: torch.device, b: torch.device) -> bool:
    if a.type != b.type:
        return False
    if b.index is None or a.index is None:
        return True
    return a.index == b.index


def check_layers(layers: Sequence[int] | None, num_layers: int) -> Sequence[int]:
    """``layers`` (all of them for None), each checked to be in [0, num_layers)."""
    if layers is None:
        return range(num_layers)
    for li in layers:
        if not 0 <= li < num_layers:
            raise IndexError(f"layer {li} out of range [0, {num_layers})")
    return layers


__all__ = ["HEAD_ARRANGEMENTS", "HEAD_MAJOR_KINDS", "KINDS", "HeadView", "KVLayout", "LayoutError", "dtype_name",
           "check_layers", "parse_dtype", "tensor_list"]
