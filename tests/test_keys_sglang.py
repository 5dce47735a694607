"""``sglang_sha256``: byte-identical to SGLang 0.5.23's HiCache page keys (its own native hash, called here),
with its request namespace seeding (``extra_key`` / ``cache_salt``), through every kvtier entry point."""

from __future__ import annotations

import hashlib
import json
import struct
import subprocess
import sys
from array import array
from pathlib import Path

import numpy as np
import pytest

from kvtier.keys import SGLANG_SHA256, BlockHasher, Namespace, SequenceHasher, sglang_namespace_seed

sys.path.insert(0, str(Path(__file__).parent / "sglang"))


@pytest.fixture(scope="module")
def sglang_keys():
    """SGLang's ``get_storage_hash_str`` over a ``RadixKey``, exactly what its HiCache controller calls."""
    import sgl_harness  # noqa: F401 - SGLang importable without torchvision
    from sglang.srt.mem_cache.radix_cache import RadixKey
    from sglang.srt.mem_cache.utils import get_storage_hash_str

    def keys(tokens, page_size, extra_key=None, cache_salt=None):
        key = RadixKey(array("q", tokens), extra_key=extra_key, cache_salt=cache_salt)
        return [bytes.fromhex(h) for h in get_storage_hash_str(key, None, page_size=page_size)]

    return keys


def reference(tokens, P, prior=b""):
    """The construction spelled out: sha256(prev || uint32-LE page tokens), 0xff + uint64 for wide pages."""
    out, h = [], prior
    for i in range(len(tokens) // P):
        page = tokens[i * P:(i + 1) * P]
        data = (b"\xff" + struct.pack(f"<{P}Q", *page)) if max(page) > 0xFFFFFFFF else struct.pack(f"<{P}I", *page)
        h = hashlib.sha256(h + data).digest()
        out.append(h)
    return out


@pytest.mark.parametrize("page_size", [1, 3, 16, 64])
@pytest.mark.parametrize("hi", [200, 2**16, 2**32, 2**40])
def test_equals_sglang_native_hash(sglang_keys, page_size, hi):
    rng = np.random.default_rng(page_size + hi)
    tokens = rng.integers(0, hi, size=page_size * 7).tolist()
    want = sglang_keys(tokens, page_size)
    assert BlockHasher(page_size, SGLANG_SHA256).hash_blocks(tokens) == want
    assert reference(tokens, page_size) == want


@pytest.mark.parametrize("extra_key, cache_salt", [("lora-7", None), (None, "tenant-42"), ("", "x"),
                                                    ("ünï", "côdé"), ("a", "")])
def test_namespace_seeding_equals_sglang(sglang_keys, extra_key, cache_salt):
    tokens = list(range(1000, 1040))
    want = sglang_keys(tokens, 8, extra_key, cache_salt)
    got = BlockHasher(8, SGLANG_SHA256, seed=extra_key).hash_blocks(tokens, cache_salt=cache_salt or None)
    assert got == want
    assert got != sglang_keys(tokens, 8)  # a seeded chain is another chain


def test_wide_page_in_a_narrow_chain(sglang_keys):
    tokens = [5] * 8 + [2**33] + [6] * 7 + [7] * 8
    assert BlockHasher(8, SGLANG_SHA256).hash_blocks(tokens) == sglang_keys(tokens, 8)


def test_golden_vectors_never_change():
    # Stored keys outlive code; these are SGLang's page keys for range(8), page 4 (checked above against
    # its native hash), and with a cache salt.
    h = BlockHasher(4, SGLANG_SHA256).hash_blocks(list(range(8)))
    assert [x.hex() for x in h] == ["baed642339816affb3fe8719792d0e4ce82f12db72b7373d244eaa65445800fe",
                                    "01414b052706d93bd0f1f1646c0e8ca2fa8ef5efd7bcc99f7a1cee8eb11ad052"]
    assert sglang_namespace_seed(None, None) is None
    assert sglang_namespace_seed(None, "s") == hashlib.sha256(
        b"sglang-cache-namespace-v1" + b"\x00" + b"\x01" + (1).to_bytes(8, "little") + b"s").digest()


def test_incremental_equals_whole(sglang_keys):
    tokens = list(range(50, 150))
    seq = SequenceHasher(BlockHasher(8, SGLANG_SHA256, seed="ek"), tokens[:13], cache_salt="salt")
    for a in range(13, 100, 9):
        seq.extend(tokens[a:a + 9])
    # SGLang also hashes the trailing partial page (100 = 12 pages + 4 tokens); kvtier names full pages only.
    assert seq.hashes == sglang_keys(tokens, 8, "ek", "salt")[:12]
    assert len(seq.hashes) == 12


def test_partial_page_ignored_and_pythonhashseed_unused(monkeypatch):
    monkeypatch.setenv("PYTHONHASHSEED", "123")
    h = BlockHasher(4, SGLANG_SHA256)
    assert h.seed is None
    assert h.hash_blocks(list(range(10))) == reference(list(range(8)), 4)


def test_refuses_what_sglang_keys_cannot_carry():
    h = BlockHasher(4, SGLANG_SHA256)
    with pytest.raises(ValueError, match="mm: sglang_sha256 page keys carry no multimodal items"):
        h.hash_blocks(list(range(8)), mm=[{"identifier": "img", "offset": 0, "length": 2}])
    with pytest.raises(ValueError, match="lora: sglang_sha256 page keys carry no LoRA"):
        h.hash_blocks(list(range(8)), lora={"name": "a"})
    with pytest.raises(ValueError, match="seed: sglang_sha256 takes SGLang's extra_key"):
        BlockHasher(4, SGLANG_SHA256, seed=3)


def test_namespace_and_error_message():
    ns = Namespace(model="m", kv_dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=8, block_size=4,
                   hash_algo=SGLANG_SHA256)
    assert ns.hash_seed is None
    assert ns.id != Namespace(model="m", kv_dtype="bfloat16", num_layers=2, num_kv_heads=2, head_dim=8,
                              block_size=4).id
    assert ns.hasher().hash_blocks(list(range(8))) == reference(list(range(8)), 4)
    with pytest.raises(ValueError, match="or 'sglang_sha256': SGLang's HiCache page keys"):
        BlockHasher(4, "md5")


def test_kvtier_keys_cli(sglang_keys):
    req = {"tokens": list(range(300, 340)), "block_size": 8, "algo": "sglang_sha256", "seed": "lora-1",
           "cache_salt": "t"}
    out = subprocess.run([sys.executable, "-m", "kvtier", "keys"], input=json.dumps(req), text=True,
                         capture_output=True, check=True).stdout
    assert out.split() == [h.hex() for h in sglang_keys(req["tokens"], 8, "lora-1", "t")]
