"""KV layouts and the canonical block payload: bit-exact round trips for every kind and dtype, the
documented byte order, cross-layout identity, and validation messages."""

from __future__ import annotations

import numpy as np
import pytest
import torch

import kvtier.memory.blockids as blockids_mod
from kvtier.format.layout import KVLayout, LayoutError, parse_dtype
from kvtier.keys import Namespace
from kvtier.memory.blockids import contiguous_runs
from kvtier.memory.rows import gather, scatter, to_payload

DTYPES = [torch.bfloat16, torch.float16, torch.float32, torch.float8_e4m3fn, torch.float8_e5m2]
KINDS = [("flash_attn", None), ("flashinfer", None), ("mla", None), ("cpu_attn", None), ("cpu_attn_amx", None),
         ("stacked", None),
         ("stacked", "flashinfer"), ("stacked", "mla"),
         # "+engine": storage.payload engine, values in the engine's own arrangement
         ("cpu_attn+engine", None), ("cpu_attn_amx+engine", None)]


def make_layout(kind, inner=None, dtype=torch.bfloat16, L=3, N=12, B=4, H=2, D=8) -> KVLayout:
    kind, _, payload = kind.partition("+")
    mla = "mla" in (kind, inner)
    if kind == "cpu_attn_amx":  # tiles of 16 tokens and 16 dims
        B, D = 32, 32
    return KVLayout(kind, L, N, B, 1 if mla else H, D, dtype, inner, payload or "canonical")


def random_tensors(layout: KVLayout, device="cpu", seed=0) -> list[torch.Tensor]:
    """Random bytes (NaN and denormal patterns included, never all zeros) in the layout's dtype."""
    g = torch.Generator().manual_seed(seed)
    out = []
    for shape in layout.tensor_shapes():
        n = layout.itemsize * torch.Size(shape).numel()
        raw = torch.randint(0, 256, (n,), dtype=torch.uint8, generator=g)
        raw[0] = 0x7F  # a NaN-ish leading byte, so float reinterpretation cannot go unnoticed
        out.append(raw.view(layout.dtype).view(shape).to(device))
    return out


def expected_payload(layout: KVLayout, tensors, block_ids) -> torch.Tensor:
    """The documented order, built the slow obvious way: layer, component (K, V), tokens, heads, dim; for
    an engine payload, layer, then the block's bytes as the engine keeps them."""
    per_layer = list(tensors[0]) if layout.kind == "stacked" else list(tensors)
    kind = "engine" if layout.engine_payload else layout.inner or layout.kind
    rows = []
    for b in block_ids:
        parts = []
        for t in per_layer:
            comps = {"flash_attn": lambda t, b: [t[0, b], t[1, b]],
                     "flashinfer": lambda t, b: [t[b, 0], t[b, 1]],
                     "mla": lambda t, b: [t[b]],
                     "cpu_attn": _vllm_cpu_vec, "cpu_attn_amx": _vllm_cpu_amx,
                     "engine": lambda t, b: [t[b]]}[kind](t, b)
            parts += [c.contiguous().view(torch.uint8).reshape(-1) for c in comps]
        rows.append(torch.cat(parts))
    return torch.stack(rows)


def _head_regions(t, b):
    """One block of vLLM CPU's cache: per head, B*D elements of K then B*D of V (``[H, 2, B*D]``)."""
    n, h, bs, d2 = t.shape
    return t.view(n, h, 2, bs * d2 // 2)[b]


def _vllm_cpu_vec(t, b):
    """[K, V] as [B, H, D] by explicit indexing: vLLM CPU's vec kernels keep K [D, B] and V [B, D] per
    head (tests/test_vllm_cpu_kv_arrangement.py)."""
    bs, d = t.shape[2], t.shape[3] // 2
    k, v = _head_regions(t, b).unbind(1)
    tt, dd = torch.meshgrid(torch.arange(bs), torch.arange(d), indexing="ij")
    return [k[:, dd * bs + tt].permute(1, 0, 2), v[:, tt * d + dd].permute(1, 0, 2)]


def _vllm_cpu_amx(t, b):
    """[K, V] as [B, H, D]: vLLM CPU's amx kernel keeps K [B/16, D/2, 16, 2] and V [D/16, B/2, 16, 2]."""
    bs, d = t.shape[2], t.shape[3] // 2
    k, v = _head_regions(t, b).unbind(1)
    tt, dd = torch.meshgrid(torch.arange(bs), torch.arange(d), indexing="ij")
    k_at = ((tt // 16) * (d // 2) + dd // 2) * 32 + (tt % 16) * 2 + dd % 2
    v_at = ((dd // 16) * (bs // 2) + tt // 2) * 32 + (dd % 16) * 2 + tt % 2
    return [k[:, k_at].permute(1, 0, 2), v[:, v_at].permute(1, 0, 2)]


@pytest.mark.parametrize("dtype", DTYPES, ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kind,inner", KINDS, ids=lambda k: str(k))
def test_round_trip_bit_exact(kind, inner, dtype):
    layout = make_layout(kind, inner, dtype)
    src = random_tensors(layout)
    layout.validate(src)
    ids = [7, 0, 11, 3]
    payload = to_payload(layout, src, ids)
    assert payload.shape == (4, layout.block_nbytes)
    assert torch.equal(payload, expected_payload(layout, src, ids))
    assert payload.any()
    dst = random_tensors(layout, seed=1)
    scatter(layout, dst, payload, [1, 2, 5, 9])
    assert torch.equal(to_payload(layout, dst, [1, 2, 5, 9]), payload)
    # Untouched blocks keep their bytes.
    before = random_tensors(layout, seed=1)
    assert torch.equal(to_payload(layout, dst, [0, 4, 10]), to_payload(layout, before, [0, 4, 10]))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float8_e4m3fn, torch.float32],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("kind,inner", KINDS, ids=lambda k: str(k))
def test_write_payload_writes_one_block_as_scatter_does(kind, inner, dtype):
    """The per-block copy a load makes in its reading thread (``DeviceTier.write_payload``) writes the
    same bytes as the batch scatter, into that block only, from any buffer (a memoryview, a numpy row)."""
    from kvtier.memory.device import DeviceTier

    layout = make_layout(kind, inner, dtype)
    payload = expected_payload(layout, random_tensors(layout, seed=2), [5, 6])
    dst = random_tensors(layout, seed=1)
    dev = DeviceTier(layout, dst)
    dev.write_payload(memoryview(payload[0].numpy()), 9)  # type: ignore[arg-type]  # numpy: a Buffer on 3.12+
    dev.write_payload(payload[1].numpy(), 0)
    assert torch.equal(to_payload(layout, dst, [9, 0]), payload)
    before = random_tensors(layout, seed=1)
    others = [b for b in range(layout.num_blocks) if b not in (0, 9)]
    assert torch.equal(to_payload(layout, dst, others), to_payload(layout, before, others))
    with pytest.raises(IndexError, match=r"block id 12 out of range \[0, 12\)"):
        dev.write_payload(payload[0].numpy(), 12)
    with pytest.raises(LayoutError, match=f"payload of {layout.block_nbytes - 1} B for a block of"):
        dev.write_payload(payload[0, 1:].numpy(), 1)


@pytest.mark.parametrize("kind,inner", KINDS, ids=lambda k: str(k))
def test_scattered_slots_and_layer_subsets(kind, inner):
    layout = make_layout(kind, inner)
    src = random_tensors(layout)
    ids = [4, 8, 1]
    want = to_payload(layout, src, ids)
    buf = torch.zeros((10, layout.block_nbytes), dtype=torch.uint8)
    gather(layout, src, ids, buf, slots=[9, 2, 5])
    assert torch.equal(buf[[9, 2, 5]], want)
    assert not buf[[0, 1, 3, 4, 6, 7, 8]].any()
    dst = random_tensors(layout, seed=3)
    scatter(layout, dst, buf, [0, 6, 7], slots=[9, 2, 5])
    assert torch.equal(to_payload(layout, dst, [0, 6, 7]), want)
    # One layer at a time moves exactly that layer's byte range.
    ln = layout.layer_nbytes
    part = torch.zeros_like(want)
    gather(layout, src, ids, part, layers=[1])
    assert torch.equal(part[:, ln:2 * ln], want[:, ln:2 * ln])
    assert not part[:, :ln].any() and not part[:, 2 * ln:].any()
    dst = random_tensors(layout, seed=4)
    for layer in range(layout.num_layers):
        scatter(layout, dst, want, [3, 2, 0], layers=[layer])
    assert torch.equal(to_payload(layout, dst, [3, 2, 0]), want)


def test_flash_attn_and_flashinfer_share_payload_bytes():
    fa = make_layout("flash_attn")
    fi = make_layout("flashinfer")
    st = make_layout("stacked")
    assert fa.compatible(fi) and fa.compatible(st) and fa.block_nbytes == fi.block_nbytes
    src = random_tensors(fa)
    same_kv_fi = [t.transpose(0, 1).contiguous() for t in src]  # the same K/V, FlashInfer order
    same_kv_st = [torch.stack(src)]
    ids = [2, 9, 5]
    p = to_payload(fa, src, ids)
    assert torch.equal(p, to_payload(fi, same_kv_fi, ids))
    assert torch.equal(p, to_payload(st, same_kv_st, ids))
    # A flash_attn "prefill" payload loads into a flashinfer "decode" cache as the same K and V.
    dec = random_tensors(fi, seed=5)
    scatter(fi, dec, p, [0, 1, 2])
    for layer in range(fa.num_layers):
        for kv in range(2):
            assert torch.equal(dec[layer][[0, 1, 2], kv].view(torch.int16),
                               src[layer][kv, ids].view(torch.int16))
    assert not fa.compatible(make_layout("flash_attn", dtype=torch.float8_e4m3fn))
    assert not fa.compatible(make_layout("mla"))


def test_block_nbytes_and_copy_dtype():
    bench = KVLayout("flash_attn", 32, 4, 16, 8, 128, torch.bfloat16)
    assert bench.block_nbytes == 2 * 1024 * 1024
    mla = KVLayout("mla", 61, 4, 64, 1, 576, "bfloat16")  # type: ignore[arg-type]  # a dtype's name works too
    assert mla.block_nbytes == 61 * 64 * 576 * 2
    odd = KVLayout("flash_attn", 2, 5, 3, 1, 5, torch.float8_e5m2)  # 15-byte rows
    ts = random_tensors(odd)
    assert odd.copy_dtype(ts) == torch.uint8
    p = to_payload(odd, ts, [4, 0])
    assert torch.equal(p, expected_payload(odd, ts, [4, 0]))
    assert bench.copy_dtype(random_tensors(KVLayout("flash_attn", 1, 2, 16, 8, 128))) == torch.int64
    narrow = KVLayout("flashinfer", 2, 6, 16, 2, 4, torch.float8_e4m3fn)  # 4-byte last dim, 128-byte rows
    ts = random_tensors(narrow)
    assert narrow.copy_dtype(ts) == torch.int64
    assert torch.equal(to_payload(narrow, ts, [5, 1]), expected_payload(narrow, ts, [5, 1]))
    lay = KVLayout("flash_attn", 2, 6, 16, 2, 4, torch.float8_e5m2)
    n = torch.Size(lay.layer_shape()).numel()
    offset = [torch.randint(1, 256, (n + 4,), dtype=torch.uint8)[4:].view(lay.dtype).view(lay.layer_shape())
              for _ in range(2)]  # storage offset 4 bytes: rows move as int32
    assert lay.copy_dtype(offset) == torch.int32
    assert torch.equal(to_payload(lay, offset, [0, 5]), expected_payload(lay, offset, [0, 5]))


def test_from_namespace_and_infer():
    ns = Namespace(model="m", kv_dtype="float8_e4m3fn", num_layers=4, num_kv_heads=2, head_dim=16,
                   block_size=8)
    lay = KVLayout.from_namespace(ns, num_blocks=32)
    assert (lay.kind, lay.num_layers, lay.num_blocks, lay.block_size, lay.num_kv_heads, lay.head_dim) == \
        ("flash_attn", 4, 32, 8, 2, 16)
    assert lay.dtype == torch.float8_e4m3fn
    assert KVLayout.from_namespace(ns, 32, "flashinfer").compatible(lay)
    mla_ns = Namespace(model="m", kv_dtype="bfloat16", num_layers=2, num_kv_heads=1, head_dim=576,
                       block_size=16, attention="mla")
    assert KVLayout.from_namespace(mla_ns, 8).kind == "mla"
    with pytest.raises(LayoutError, match="MHA KV but the namespace's attention is 'mla'"):
        KVLayout.from_namespace(mla_ns, 8, "flash_attn")
    for kind, inner in KINDS:
        if "+" in kind:
            continue  # infer() reads a kind off tensors; the payload is the deployment's choice
        want = make_layout(kind, inner)
        assert KVLayout.infer(kind, random_tensors(want), inner=inner) == want


def test_an_engine_payload_is_the_engines_block_and_its_namespace_names_the_layout():
    """storage.payload: engine.  A head-major block's value is its bytes as the engine keeps them (K and V
    of each head in the kernel's arrangement: an AMX and a vec cache's values differ for the same KV),
    copied as one row per layer; the namespace names the layout, so only that layout loads it."""
    amx = make_layout("cpu_attn_amx+engine")
    canonical = make_layout("cpu_attn_amx")
    assert amx.engine_payload and not amx.rearranges and amx.copy_components == 1
    assert amx.block_nbytes == canonical.block_nbytes and not amx.compatible(canonical)
    src = random_tensors(amx)
    raw = torch.stack([torch.cat([t[b].reshape(-1) for t in src]) for b in (3, 5)]).view(torch.uint8)
    assert torch.equal(to_payload(amx, src, [3, 5]), raw.reshape(2, -1))
    assert not torch.equal(to_payload(canonical, src, [3, 5]), raw.reshape(2, -1))
    # Layouts whose block is the canonical payload: "engine" is the same bytes, the same signature.
    assert make_layout("flash_attn").compatible(KVLayout("flash_attn", 3, 12, 4, 2, 8, payload="engine"))
    ns = Namespace(model="m", kv_dtype="bfloat16", num_layers=3, num_kv_heads=2, head_dim=32, block_size=32,
                   payload="cpu_attn_amx")
    assert KVLayout.from_namespace(ns, 12, "cpu_attn_amx") == amx
    with pytest.raises(LayoutError, match="the namespace's values hold cpu_attn_amx's own arrangement of a "
                                          "block .storage.payload: engine., but this engine's layout is cpu_attn"):
        KVLayout.from_namespace(ns, 12, "cpu_attn")
    with pytest.raises(LayoutError, match="payload: expected 'canonical' or 'engine', got 'native'"):
        KVLayout("cpu_attn", 3, 12, 4, 2, 8, payload="native")


def test_dtype_names():
    assert parse_dtype("bf16") is torch.bfloat16
    assert parse_dtype("fp8_e5m2") is torch.float8_e5m2
    assert parse_dtype("torch.float16") is torch.float16
    with pytest.raises(LayoutError, match="dtype: expected a torch dtype or one of"):
        parse_dtype("auto")


def test_bad_layout_fields():
    with pytest.raises(LayoutError,
                       match="kind: expected one of flash_attn, flashinfer, mla, cpu_attn, cpu_attn_amx, stacked"):
        KVLayout("paged", 1, 1, 1, 1, 1)
    with pytest.raises(LayoutError, match="cpu_attn_amx packs tiles of 16 tokens and 16 dims: block_size and "
                                          "head_dim must be multiples of 16, got 32 and 8"):
        KVLayout("cpu_attn_amx", 1, 1, 32, 1, 8)
    with pytest.raises(LayoutError, match="num_blocks: expected an integer >= 1, got 0"):
        KVLayout("flash_attn", 1, 0, 1, 1, 1)
    with pytest.raises(LayoutError, match="num_kv_heads must be 1"):
        KVLayout("mla", 1, 1, 1, 4, 8)
    with pytest.raises(LayoutError, match="only a stacked layout has an inner kind"):
        KVLayout("flash_attn", 1, 1, 1, 1, 1, inner="mla")


def test_validation_messages():
    lay = KVLayout("flash_attn", 4, 1024, 16, 8, 128, torch.bfloat16)
    good = [torch.empty(lay.layer_shape(), dtype=torch.bfloat16, device="meta") for _ in range(4)]
    lay.validate(good)
    bad = list(good)
    bad[3] = torch.empty((2, 512, 16, 8, 128), dtype=torch.bfloat16, device="meta")
    with pytest.raises(LayoutError) as e:
        lay.validate(bad)
    assert str(e.value) == ("layer 3: expected shape (2, 1024, 16, 8, 128) (flash_attn: [2, num_blocks, "
                            "block_size, kv_heads, head_dim]), got (2, 512, 16, 8, 128): 512 blocks, "
                            "expected 1024")
    with pytest.raises(LayoutError, match=r"expected 4 layer tensors \(flash_attn: one per layer\), got 3"):
        lay.validate(good[:3])
    bad = list(good)
    bad[1] = good[1].to(torch.float16)
    with pytest.raises(LayoutError, match="layer 1: expected dtype bfloat16, got float16"):
        lay.validate(bad)
    with pytest.raises(LayoutError, match="layer 0: expected device cuda, found meta"):
        lay.validate(good, device="cuda")
    small = KVLayout("flashinfer", 2, 4, 4, 2, 8, torch.float16)
    ts = [torch.zeros(small.layer_shape(), dtype=torch.float16) for _ in range(2)]
    ts[1] = torch.zeros((4, 2, 4, 8, 2), dtype=torch.float16).transpose(3, 4)  # heads/dim swapped in memory
    with pytest.raises(LayoutError, match=r"layer 1: not contiguous within a block: the last 3 dims must "
                                          r"have strides \(16, 8, 1\), found strides"):
        small.validate(ts)
    ts[1] = "not a tensor"  # type: ignore[call-overload]
    with pytest.raises(LayoutError, match="layer 1: expected a torch.Tensor, got str"):
        small.validate(ts)
    st = KVLayout("stacked", 3, 4, 4, 2, 8, torch.float16)
    with pytest.raises(LayoutError, match=r"stacked tensor: expected shape \(3, 2, 4, 4, 2, 8\) .* got "
                                          r"\(2, 2, 4, 4, 2, 8\): 2 layers, expected 3"):
        st.validate(torch.zeros((2, 2, 4, 4, 2, 8), dtype=torch.float16))
    with pytest.raises(LayoutError, match="expected 1 stacked tensor, got 2"):
        st.validate([torch.zeros(1), torch.zeros(1)])
    with pytest.raises(LayoutError, match=r"layer 0: expected shape \(4, 4, 16\) \(mla: \[num_blocks, "
                                          r"block_size, latent_dim\]\), got \(4, 4, 2, 8\): 4 dims, expected 3"):
        KVLayout("mla", 1, 4, 4, 1, 16, torch.float16).validate([torch.zeros((4, 4, 2, 8), dtype=torch.float16)])


def test_payload_buffer_checks():
    lay = make_layout("flash_attn")
    ts = random_tensors(lay)
    with pytest.raises(LayoutError, match=rf"payload buffer: expected a \[n, {lay.block_nbytes}\] uint8 tensor"):
        gather(lay, ts, [0], torch.zeros((1, 10), dtype=torch.uint8))
    with pytest.raises(LayoutError, match="payload buffer has 1 rows, 2 blocks given"):
        gather(lay, ts, [0, 1], torch.zeros((1, lay.block_nbytes), dtype=torch.uint8))


def test_contiguous_runs():
    assert contiguous_runs([]) == []
    assert contiguous_runs([5]) == [(0, 5, 1)]
    assert contiguous_runs([3, 4, 5, 9, 10, 2]) == [(0, 3, 3), (3, 9, 2), (5, 2, 1)]
    assert contiguous_runs(torch.tensor([0, 1, 2, 3])) == [(0, 0, 4)]
    assert contiguous_runs(np.array([[7, 8], [9, 1]])) == [(0, 7, 3), (3, 1, 1)]


@pytest.mark.parametrize("n", [1, 2, 5, 63, 64, 65, 300])
def test_contiguous_runs_short_walk_equals_the_vectorised_split(n, monkeypatch):
    """Up to _SHORT_RUNS values are walked in Python, more split by numpy: both give the same runs, as
    plain ints, for lists, arrays and tensors (runs of random lengths, a gap or a step back between)."""
    rng = np.random.default_rng(n)
    vals: list[int] = []
    v = int(rng.integers(0, 50))
    while len(vals) < n:
        k = int(rng.integers(1, 6))
        vals += range(v, v + k)
        v += k + int(rng.choice([-30, 1, 2, 7]))
    vals = vals[:n]
    got = {kind: contiguous_runs(x) for kind, x in
           (("list", vals), ("array", np.array(vals)), ("tensor", torch.tensor(vals)))}
    monkeypatch.setattr(blockids_mod, "_SHORT_RUNS", -1)  # the numpy split for every length
    want = contiguous_runs(np.array(vals))
    assert all(r == want for r in got.values()) and sum(k for _, _, k in want) == n
    assert all(type(x) is int for r in got.values() for run in r for x in run)
    assert [f + i for _, f, k in want for i in range(k)] == vals  # the runs spell the values out
    assert [p for p, _, _ in want] == list(np.cumsum([0] + [k for _, _, k in want])[:-1])
    assert all(f2 != f1 + k1 for (_, f1, k1), (_, f2, _) in zip(want, want[1:]))  # maximal runs
