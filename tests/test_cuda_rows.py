"""The one-launch row kernel (``kvtier.memory._cuda_rows``), run by Triton's interpreter on CPU tensors: the
same kernel source the GPU compiles, so its addressing (view table, row strides, a payload row's
layout, layer groups, masked ids, word widths) is checked on every machine.  ``tests/test_gpu.py``
runs it compiled, against the CPU codec."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from kvtier.format.layout import KVLayout
from kvtier.memory._cuda_rows import RowKernel, _kernel, word_dtype
from kvtier.memory.rows import to_payload

pytest.importorskip("triton")

KINDS = [("flash_attn", None), ("flashinfer", None), ("mla", None), ("stacked", "flashinfer")]


@pytest.fixture(scope="module")
def kernel(tmp_path_factory: pytest.TempPathFactory) -> Any:
    """The kernel as the interpreter runs it (``TRITON_INTERPRET`` is read when it is defined)."""
    mp = pytest.MonkeyPatch()
    mp.setenv("TRITON_INTERPRET", "1")
    mp.setenv("TRITON_CACHE_DIR", str(tmp_path_factory.mktemp("triton")))
    try:
        ks = _kernel.__wrapped__()
    finally:
        mp.undo()
    assert ks is not None
    return ks


def make(kind: str, inner: str | None, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
         L: int = 3, N: int = 12, D: int = 8) -> tuple[KVLayout, list[torch.Tensor]]:
    mla = "mla" in (kind, inner)
    layout = KVLayout(kind, L, N, 4, 1 if mla else 2, D, dtype, inner)
    g = torch.Generator().manual_seed(seed)
    ts = [torch.randint(1, 256, (layout.itemsize * torch.Size(s).numel(),), dtype=torch.uint8, generator=g)
          .view(dtype).view(s) for s in layout.tensor_shapes()]
    return layout, ts


def kernel_over(layout: KVLayout, ts: list[torch.Tensor], kernel: Any) -> RowKernel:
    views = layout.component_views(ts)
    return RowKernel(views, word_dtype(views), kernel)


@pytest.mark.parametrize("kind,inner", KINDS, ids=str)
def test_gather_writes_each_block_as_its_payload_at_the_given_rows(kernel, kind, inner):
    layout, ts = make(kind, inner)
    ids = [7, 0, 11, 3]
    want = to_payload(layout, ts, ids)  # the CPU codec's payloads
    buf = torch.zeros(len(ids) + 3, layout.block_nbytes, dtype=torch.uint8)
    kernel_over(layout, ts, kernel).gather(torch.tensor(ids), buf, 2, range(layout.num_layers))
    assert torch.equal(buf[2:2 + len(ids)], want)
    assert not buf[:2].any() and not buf[2 + len(ids):].any()  # rows outside the batch untouched


@pytest.mark.parametrize("kind,inner", KINDS, ids=str)
def test_scatter_puts_payload_rows_back_into_the_blocks_named(kernel, kind, inner):
    layout, src = make(kind, inner, seed=1)
    payload = to_payload(layout, src, [5, 9, 2])
    _, dst = make(kind, inner, seed=2)
    before = [t.clone() for t in dst]
    kernel_over(layout, dst, kernel).scatter(torch.tensor([1, 10, 4]), payload, 0, range(layout.num_layers))
    assert torch.equal(to_payload(layout, dst, [1, 10, 4]), payload)
    others = [b for b in range(layout.num_blocks) if b not in (1, 10, 4)]
    assert torch.equal(to_payload(layout, dst, others), to_payload(layout, before, others))


def test_a_layer_group_moves_only_its_layers_bytes(kernel):
    layout, ts = make("flash_attn", None, L=4)
    ids = torch.tensor([6, 1])
    buf = torch.zeros(2, layout.block_nbytes, dtype=torch.uint8)
    kernel_over(layout, ts, kernel).gather(ids, buf, 0, [1, 2])
    want = to_payload(layout, ts, [6, 1])
    ln = layout.layer_nbytes
    assert torch.equal(buf[:, ln:3 * ln], want[:, ln:3 * ln])
    assert not buf[:, :ln].any() and not buf[:, 3 * ln:].any()


def test_an_id_out_of_range_is_neither_read_nor_written(kernel):
    layout, src = make("flash_attn", None, seed=5)
    payload = to_payload(layout, src, [2, 3, 4, 5])
    _, dst = make("flash_attn", None, seed=6)
    before = [t.clone() for t in dst]
    k = kernel_over(layout, dst, kernel)
    k.scatter(torch.tensor([3, layout.num_blocks, -1, 7]), payload, 0, range(layout.num_layers))
    assert torch.equal(to_payload(layout, dst, [3, 7]), payload[[0, 3]])
    untouched = [b for b in range(layout.num_blocks) if b not in (3, 7)]
    assert torch.equal(to_payload(layout, dst, untouched), to_payload(layout, before, untouched))
    buf = torch.zeros(2, layout.block_nbytes, dtype=torch.uint8)
    k.gather(torch.tensor([-1, 3]), buf, 0, range(layout.num_layers))
    assert not buf[0].any() and torch.equal(buf[1], payload[0])


def test_words_are_as_wide_as_every_address_stride_and_row_allows():
    layout, ts = make("flash_attn", None, dtype=torch.bfloat16, D=8)  # rows of 4 x 2 x 8 x 2 B = 128 B
    assert word_dtype(layout.component_views(ts)) == torch.int64
    layout, ts = make("mla", None, dtype=torch.float8_e4m3fn, D=3)  # rows of 4 x 3 x 1 B = 12 B
    assert word_dtype(layout.component_views(ts)) == torch.int32
    odd = torch.zeros(2 * 12 * 5 + 1, dtype=torch.uint8)[1:].view(2, 12, 5)  # odd address, 5 B rows
    assert word_dtype([[odd[0], odd[1]]]) == torch.uint8


def test_odd_widths_copy_exactly(kernel):
    layout, src = make("mla", None, dtype=torch.float8_e4m3fn, D=3, seed=7)
    _, dst = make("mla", None, dtype=torch.float8_e4m3fn, D=3, seed=8)
    buf = torch.zeros(3, layout.block_nbytes, dtype=torch.uint8)
    kernel_over(layout, src, kernel).gather(torch.tensor([1, 5, 2]), buf, 0, range(layout.num_layers))
    kernel_over(layout, dst, kernel).scatter(torch.tensor([0, 6, 11]), buf, 0, range(layout.num_layers))
    assert torch.equal(to_payload(layout, dst, [0, 6, 11]), to_payload(layout, src, [1, 5, 2]))


def test_fits_wants_whole_word_rows_on_the_kernels_device(kernel):
    layout, ts = make("flash_attn", None)
    k = kernel_over(layout, ts, kernel)
    buf = torch.zeros(4, layout.block_nbytes + 8, dtype=torch.uint8)
    assert k.fits(buf[:, :layout.block_nbytes])
    assert not k.fits(buf[:, 1:layout.block_nbytes + 1])  # misaligned rows
    assert not k.fits(buf.view(torch.int64))  # not bytes


class _Uncompilable:
    """A Triton kernel as one that cannot compile it behaves: launching raises."""

    def __getitem__(self, grid: Any) -> Any:
        def launch(*args: Any, **kwargs: Any) -> None:
            raise RuntimeError("CompilationError: a Triton too old for this kernel")
        return launch


def test_a_kernel_that_cannot_launch_leaves_the_copy_to_torch_and_is_not_tried_again(kernel, caplog):
    from kvtier.memory.rows import RowCodec

    layout, ts = make("flash_attn", None, seed=9)
    codec = RowCodec(layout, ts)
    views = layout.component_views(ts)
    codec._kernel = RowKernel(views, word_dtype(views), _Uncompilable())
    ids = [4, 8, 1]
    buf = torch.zeros(len(ids), layout.block_nbytes, dtype=torch.uint8)
    with caplog.at_level("WARNING", logger="kvtier.rows"):
        codec.gather(ids, buf, None, None)
    assert torch.equal(buf, to_payload(layout, ts, ids))  # copied all the same, by torch's ops
    assert codec.row_kernel() is None
    assert "row kernel unusable" in caplog.text and "a Triton too old" in caplog.text
    # A working kernel is used: its copy lands, the same bytes.
    codec._kernel = kernel_over(layout, ts, kernel)
    buf.zero_()
    codec.gather(ids, buf, None, None)
    assert torch.equal(buf, to_payload(layout, ts, ids)) and codec.row_kernel() is not None


def test_a_kernel_that_cannot_be_defined_leaves_the_copy_to_torch(monkeypatch, caplog):
    import kvtier.memory.rows as rows_mod

    def broken(views: Any) -> None:
        raise RuntimeError("triton.jit: unsupported Python")

    monkeypatch.setattr(rows_mod, "row_kernel", broken)
    layout, ts = make("flashinfer", None, seed=10)
    codec = rows_mod.RowCodec(layout, ts)
    codec._kernel = True  # as on CUDA: built on first use
    buf = torch.zeros(2, layout.block_nbytes, dtype=torch.uint8)
    with caplog.at_level("WARNING", logger="kvtier.rows"):
        codec.gather([3, 0], buf, None, None)
    assert torch.equal(buf, to_payload(layout, ts, [3, 0]))
    assert codec.row_kernel() is None and "unsupported Python" in caplog.text
