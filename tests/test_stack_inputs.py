"""The stack refuses hashes it could never store or find, and loads into duplicate blocks, naming the
position and what was expected (issue: "the stack accepts hashes it cannot store")."""

from __future__ import annotations

import pytest

from kvtier.config import parse_config
from kvtier.stack import TierStack


def _stack(tmp_path, algo: str) -> TierStack:
    return TierStack(parse_config({
        "model": {"id": "m", "kv_dtype": "float32", "num_layers": 1, "num_kv_heads": 1, "head_dim": 4,
                  "block_size": 4},
        "keys": {"algo": algo}, "device": {"kind": "cpu", "num_blocks": 8}, "host": {"capacity": "64KiB"},
        "backends": [{"name": "disk", "type": "local_disk", "options": {"path": str(tmp_path / "d")}}]}, env={}))


@pytest.mark.parametrize("algo,size", [("sha256_cbor", 32), ("xxh3_128", 16)])
def test_wrong_length_hashes_are_refused_everywhere(tmp_path, algo, size):
    with _stack(tmp_path, algo) as s:
        good = s.namespace.hasher().hash_blocks(list(range(8)))
        assert len(good[0]) == size
        for bad in (b"", good[0][:-1], good[0] + b"x"):
            want = f"hashes\\[1\\]: expected {size} bytes for keys.algo {algo}, got {len(bad)}"
            for call in (lambda h: s.lookup(h), lambda h: s.load(h, [0, 1]), lambda h: s.store(h, [0, 1]),
                         lambda h: s.prefetch(h)):
                with pytest.raises(ValueError, match=want):
                    call([good[0], bad])
        assert s.flush(5) and s.stats()["index"]["entries"] == 0  # nothing half-stored


def test_non_bytes_hashes_are_type_errors(tmp_path):
    with _stack(tmp_path, "sha256_cbor") as s:
        for bad in ("ab" * 16, 7, None):
            with pytest.raises(TypeError, match=r"hashes\[0\]: expected bytes .* got "):
                s.lookup([bad])  # type: ignore[list-item]
        h = s.namespace.hasher().hash_blocks(list(range(4)))
        assert s.lookup([bytearray(h[0])]).num_blocks == 0  # type: ignore[list-item]  # bytes-like is fine


def test_load_into_duplicate_blocks_is_refused(tmp_path):
    with _stack(tmp_path, "sha256_cbor") as s:
        h = s.namespace.hasher().hash_blocks(list(range(12)))
        assert s.store(h[:2], [0, 1]).wait(5).num_stored == 2
        with pytest.raises(ValueError, match=r"distinct destination blocks, got duplicates \[3\]"):
            s.load(h[:3], [3, 4, 3])
        assert s.stats()["index"]["pinned"] == 0  # refused before anything was planned or pinned
