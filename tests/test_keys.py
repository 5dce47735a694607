"""Block keys: vLLM byte-compatibility, extra keys, incremental hashing, input errors, stability."""

from __future__ import annotations

import hashlib
import json
import os
import subprocess
import sys
from typing import Any

import cbor2
import numpy as np
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvtier.keys import BlockHasher, LoRA, MMItem, Namespace, SequenceHasher, sha256_cbor, split_key


def vllm_reference(tokens, B, extras=lambda i: None, seed="vllm-none-hash"):
    """vLLM's construction, spelled out: sha256(cbor2.dumps((parent, tuple(block), extra), canonical))."""
    parent = hashlib.sha256(cbor2.dumps(seed, canonical=True)).digest()
    out = []
    for i in range(len(tokens) // B):
        x = (parent, tuple(tokens[i * B : (i + 1) * B]), extras(i))
        parent = hashlib.sha256(cbor2.dumps(x, canonical=True)).digest()
        out.append(parent)
    return out


@pytest.fixture(autouse=True)
def _no_hashseed(monkeypatch):
    monkeypatch.delenv("PYTHONHASHSEED", raising=False)


# Token values straddling every CBOR integer width boundary.
EDGES = [0, 1, 23, 24, 255, 256, 65535, 65536, 2**32 - 1, 2**32, 2**63 - 1]


@pytest.mark.parametrize("block_size", [1, 2, 16, 23, 24, 255, 256, 300])
def test_sha256_cbor_is_byte_identical_to_vllm(block_size):
    rng = np.random.default_rng(block_size)
    for hi in (24, 256, 65536, 2**32, 2**40):
        toks = rng.integers(0, hi, size=block_size * 5 + 3).tolist()
        assert BlockHasher(block_size).hash_blocks(toks) == vllm_reference(toks, block_size)


@settings(max_examples=150, deadline=None)
@given(st.lists(st.sampled_from(EDGES) | st.integers(0, 200_000), min_size=0, max_size=200),
       st.integers(1, 40))
def test_sha256_cbor_property(tokens, block_size):
    assert BlockHasher(block_size).hash_blocks(tokens) == vllm_reference(tokens, block_size)


def test_golden_vectors_never_change():
    # Keys outlive code: these bytes are persisted by deployments.  A change here is a format break.
    t = list(range(100, 164))
    assert BlockHasher(16).hash_blocks(t)[1].hex() == \
        "ce46e4cdf9f7c965a59bd3429627f27c1400980fc64be5e6706e1a9c55f39878"
    assert BlockHasher(16, "xxh3_128").hash_blocks(t)[1].hex() == "6e6b80f8d73142c99a70285906f6531e"
    assert BlockHasher(16).hash_blocks(t, mm=[("img", 10, 20)], lora=("l", "/p"), cache_salt="s")[-1].hex() \
        == "32a1193a6906c1fb241aad92aaa44acf8595afda74b46086b9de7a32c5885e65"
    # Block format 2 (vLLM CPU's payload made canonical): the namespace of format 1 was
    # 5f1e3845f8aa74b2327f8339e59630a8, and stays that for a manifest that says format_version 1.
    assert Namespace("m", "bfloat16", 2, 2, 64, 16).id == "ae3d5c79b0ec0cd85d967b0f706a8aa7"
    assert Namespace("m", "bfloat16", 2, 2, 64, 16, format_version=1).id == "5f1e3845f8aa74b2327f8339e59630a8"


def test_seed_from_pythonhashseed(monkeypatch):
    t = list(range(64))
    default = BlockHasher(16).hash_blocks(t)
    monkeypatch.setenv("PYTHONHASHSEED", "1234")
    seeded = BlockHasher(16).hash_blocks(t)
    assert seeded == vllm_reference(t, 16, seed="1234")
    assert seeded[0] != default[0]
    assert BlockHasher(16, seed="vllm-none-hash").hash_blocks(t) == default


def test_extra_keys_order_and_overlap():
    B = 4
    toks = list(range(20))
    # image covers tokens 2..9: blocks 0, 1 and 2 -> offsets 2, -2, -6
    items = [MMItem("img-a", 2, 8), MMItem("img-b", 12, 1)]
    h = BlockHasher(B)
    assert h.extra_keys(0, items, ("lora", "ad", "/x"), ("cache_salt", "t1")) == (
        ("lora", "ad", "/x"), ("mm", "img-a", 2), ("cache_salt", "t1"))
    assert h.extra_keys(1, items, None, ("cache_salt", "t1")) == (("mm", "img-a", -2),)
    assert h.extra_keys(2, items, None, None) == (("mm", "img-a", -6),)
    assert h.extra_keys(3, items, None, None) == (("mm", "img-b", 0),)
    assert h.extra_keys(4, items, None, None) is None

    def extras(i):
        return h.extra_keys(i, items, ("lora", "ad", "/x"), ("cache_salt", "t1"))

    got = h.hash_blocks(toks, mm=[{"identifier": "img-a", "offset": 2, "length": 8}, ("img-b", 12, 1)],
                        lora=LoRA("ad", "/x"), cache_salt="t1")
    assert got == vllm_reference(toks, B, extras)


def test_extra_keys_change_exactly_the_overlapped_blocks():
    B = 4
    toks = list(range(24))
    h = BlockHasher(B)
    a = h.hash_blocks(toks, mm=[("img-1", 9, 4)])   # blocks 2 and 3
    b = h.hash_blocks(toks, mm=[("img-2", 9, 4)])
    assert a[:2] == b[:2] and all(x != y for x, y in zip(a[2:], b[2:]))
    s1, s2 = h.hash_blocks(toks, cache_salt="t1"), h.hash_blocks(toks, cache_salt="t2")
    assert all(x != y for x, y in zip(s1, s2))  # salt on block 0 changes the whole chain
    assert h.hash_blocks(toks, lora=("a", ""))[0] != h.hash_blocks(toks)[0]


@pytest.mark.parametrize("algo", ["sha256_cbor", "xxh3_128"])
def test_incremental_hashes_only_new_blocks(algo):
    h = BlockHasher(8, algo)
    rng = np.random.default_rng(7)
    toks = rng.integers(0, 100_000, size=203).tolist()
    mm = [("im", 3, 20)]
    seq = SequenceHasher(h, toks[:50], mm=mm, cache_salt="s")
    assert len(seq.hashes) == 6
    pos = 50
    for step in (1, 7, 8, 9, 0, 128):
        new = seq.extend(toks[pos : pos + step])
        pos += step
        assert len(new) == pos // 8 - (pos - step) // 8  # only the blocks that became full
    seq.extend(toks[pos:])
    assert seq.hashes == h.hash_blocks(toks, mm=mm, cache_salt="s")


def test_input_types_agree():
    toks = list(range(1000, 1064))
    want = BlockHasher(16).hash_blocks(toks)
    for form in (tuple(toks), np.array(toks, dtype=np.int32), np.array(toks, dtype=np.uint64),
                 torch.tensor(toks), range(1000, 1064)):
        assert BlockHasher(16).hash_blocks(form) == want


@pytest.mark.parametrize("tokens, message", [
    ([1, 2, -3], "tokens[2] = -3: token ids must be non-negative"),
    ([1, 2.5], "tokens[1] = 2.5: token ids must be integers, got float"),
    ([1, "7"], "tokens[1] = '7': token ids must be integers, got str"),
    ([True, False, True, True], "tokens[0] = True: token ids must be integers, got bool"),
    ((5, 6, False, 7), "tokens[2] = False: token ids must be integers, got bool"),
    ([2**40, True], "tokens[1] = True: token ids must be integers, got bool"),  # the int64 path
    (np.array([True, False]), "expected integer token ids, got dtype bool"),
    ([0, 2**64], "tokens[1] = 18446744073709551616: token ids must be in [0, 2**63)"),
    (np.array([0.5]), "expected integer token ids, got dtype float64"),
    (np.array([4, -1]), "tokens[1] = -1: token ids must be non-negative"),
    (torch.tensor([0.5]), "expected integer token ids, got a torch.float32 tensor"),
    ("hello", "expected a list, tuple, numpy array or torch tensor"),
])
def test_bad_tokens_name_the_position(tokens, message):
    with pytest.raises(ValueError) as e:
        BlockHasher(4).hash_blocks(tokens)
    assert message in str(e.value)


@pytest.mark.parametrize("mm, message", [
    ([("img", 10, 8)], "mm[0] ('img') covers tokens [10, 18) but the sequence has 16 tokens"),
    ([("a", 8, 2), ("b", 2, 2)], "mm[1].offset = 2: items must be sorted by offset"),
    ([("a", 2, 4), ("b", 5, 2)], "mm[1] starts at token 5, inside mm[0] [2, 6): items must not overlap"),
    ([("", 0, 1)], "mm[0].identifier: expected a non-empty string"),
    ([("a", -1, 1)], "mm[0].offset = -1: must be >= 0"),
    ([("a", 0, 0)], "mm[0].length = 0: must be >= 1"),
    ([{"identifier": "a", "offset": 0}], "mm[0]: missing field(s) ['length']"),
    ({"identifier": "a", "offset": 0, "length": 1}, "mm: expected a list of {identifier, offset, length} items"),
])
def test_bad_mm_items(mm, message):
    with pytest.raises(ValueError) as e:
        BlockHasher(4).hash_blocks(list(range(16)), mm=mm)
    assert message in str(e.value)


@pytest.mark.parametrize("lora, message", [
    ("adapter", "lora: expected {name, path} or [name, path], got 'adapter'"),
    (("a", "/p", "x"), "lora: expected {name, path} or [name, path], got ('a', '/p', 'x')"),
    ({"path": "/p"}, "lora: expected {name, path}, got {'path': '/p'}"),
    ({"name": ""}, "lora.name: expected a non-empty string, got ''"),
    (("a", 3), "lora.path: expected a string, got 3"),
])
def test_bad_lora_names_the_field(lora, message):
    """A LoRA of any wrong shape is a ValueError naming the field (a bare string was an AttributeError)."""
    with pytest.raises(ValueError) as e:
        BlockHasher(4).hash_blocks(list(range(16)), lora=lora)
    assert message in str(e.value)


@pytest.mark.parametrize("bs", [0, -1, 1.5, True])
def test_bad_block_size(bs):
    with pytest.raises(ValueError, match="block_size: expected an integer >= 1"):
        BlockHasher(bs)


@pytest.mark.parametrize("seed", [[1], 1.5, True, b"s"])
def test_bad_seed(seed):
    """A seed is a string, an int or None, as keys.seed in a config (a list or a float was accepted and
    hashed)."""
    with pytest.raises(ValueError, match="seed: expected a string, an integer or None, got "):
        BlockHasher(16, seed=seed)


def test_bad_algo():
    with pytest.raises(ValueError, match="algo: expected one of sha256_cbor, xxh3_128, got 'md5'"):
        BlockHasher(16, "md5")


def test_partial_block_ignored_and_empty():
    h = BlockHasher(16)
    assert h.hash_blocks([]) == []
    assert h.hash_blocks(list(range(15))) == []
    assert len(h.hash_blocks(list(range(33)))) == 2


_SNIPPET = """
import json, sys
from kvtier.keys import BlockHasher
req = json.loads(sys.argv[1])
h = BlockHasher(16, req["algo"])
print(json.dumps([x.hex() for x in h.hash_blocks(req["tokens"], mm=req["mm"], cache_salt="tenant")]))
"""


@pytest.mark.parametrize("algo", ["sha256_cbor", "xxh3_128"])
def test_same_keys_in_separate_processes(algo):
    req = json.dumps({"algo": algo, "tokens": list(range(5000, 5100)), "mm": [["img", 20, 30]]})
    # No PYTHONHASHSEED: Python's own hash() is randomised per process; our keys must not be.
    env = {k: v for k, v in os.environ.items() if k != "PYTHONHASHSEED"}
    outs = [json.loads(subprocess.run([sys.executable, "-c", _SNIPPET, req], capture_output=True,
                                      text=True, env=env, check=True).stdout) for _ in range(2)]
    assert outs[0] == outs[1]
    assert outs[0] == [x.hex() for x in BlockHasher(16, algo).hash_blocks(
        list(range(5000, 5100)), mm=[["img", 20, 30]], cache_salt="tenant")]


def test_namespace_digest_covers_every_field():
    base = Namespace("llama", "bfloat16", 32, 8, 128, 16)
    variants: list[dict[str, Any]] = [
        dict(model="llama2"), dict(kv_dtype="float8_e4m3fn"), dict(num_layers=31), dict(num_kv_heads=4),
        dict(head_dim=64), dict(block_size=32), dict(attention="mla"), dict(tp_rank=1, tp_size=2),
        dict(tp_size=2), dict(pp_rank=1, pp_size=2), dict(hash_algo="xxh3_128"), dict(hash_seed="x"),
        dict(format_version=1), dict(format_version=3), dict(payload="cpu_attn_amx"), dict(payload="cpu_attn"),
    ]
    ids = {base.id}
    for v in variants:
        ns = Namespace(**{**base.manifest(), **v})
        assert ns.id not in ids, v
        ids.add(ns.id)
    assert Namespace.from_manifest(base.manifest()) == base
    key = base.key(b"\x01" * 32)
    assert split_key(key) == (base.digest, b"\x01" * 32)


@pytest.mark.parametrize("bad", ["nohex", "ab/cd", "../../etc/passwd", "0" * 32 + "/" + "z" * 32,
                                 "0" * 32 + "/" + "A" * 32, " " + "0" * 32 + "/" + "0" * 32, "0" * 32 + "/" + "00 " * 11,
                                 "0" * 32 + "/" + "0" * 32 + "\n", ""])
def test_split_key_rejects_bad_keys(bad):
    with pytest.raises(ValueError, match="expected '<32 hex namespace>/<32 or 64 hex hash>'"):
        split_key(bad)


def test_a_canonical_payload_keeps_the_digest_and_an_engine_payload_gets_its_own():
    """storage.payload: engine namespaces name the layout whose arrangement their values keep; the field
    is left out of a canonical namespace's manifest, so no key that existed before it changes."""
    base = Namespace("m", "bfloat16", 2, 2, 64, 16)
    assert "payload" not in base.manifest() and base.id == "ae3d5c79b0ec0cd85d967b0f706a8aa7"
    amx = Namespace("m", "bfloat16", 2, 2, 64, 16, payload="cpu_attn_amx")
    assert amx.manifest()["payload"] == "cpu_attn_amx" and Namespace.from_manifest(amx.manifest()) == amx
    assert amx.id != base.id and amx.layout_id != base.layout_id  # the header's second check differs too
    with pytest.raises(ValueError, match="payload: expected 'canonical' or an engine layout name, got 'a b'"):
        Namespace("m", "bfloat16", 1, 1, 1, 16, payload="a b")


def test_namespace_validation():
    with pytest.raises(ValueError, match="tp_rank: expected 0 <= tp_rank < tp_size=2, got 2"):
        Namespace("m", "bfloat16", 1, 1, 1, 16, tp_rank=2, tp_size=2)
    with pytest.raises(ValueError, match="attention: expected 'mha' or 'mla'"):
        Namespace("m", "bfloat16", 1, 1, 1, 16, attention="gqa")


def test_keys_cli(tmp_path, capsys):
    from kvtier.tools.cli import main

    req: dict[str, Any] = {"tokens": list(range(40)), "block_size": 8, "algo": "sha256_cbor", "seed": None,
           "mm": [{"identifier": "x", "offset": 0, "length": 3}], "lora": {"name": "a", "path": "/a"},
           "cache_salt": "s"}
    f = tmp_path / "req.json"
    f.write_text(json.dumps(req))
    assert main(["keys", str(f)]) == 0
    lines = capsys.readouterr().out.split()
    assert lines == [h.hex() for h in BlockHasher(8).hash_blocks(
        req["tokens"], mm=req["mm"], lora=("a", "/a"), cache_salt="s")]
    f.write_text(json.dumps({"tokens": [1, -1]}))
    assert main(["keys", str(f)]) == 2
    assert "tokens[1] = -1: token ids must be non-negative" in capsys.readouterr().err
    f.write_text(json.dumps({"tokens": [1], "colour": 1}))
    assert main(["keys", str(f)]) == 2
    assert "unknown field(s) ['colour']" in capsys.readouterr().err
    f.write_text("{nope")
    assert main(["keys", str(f)]) == 2
    assert "invalid JSON at line 1" in capsys.readouterr().err


def test_reference_helper_matches_module_function():
    assert sha256_cbor("vllm-none-hash") == hashlib.sha256(cbor2.dumps("vllm-none-hash")).digest()
