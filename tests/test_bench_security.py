"""``kvtier bench backends --security``: local_disk's sealed gets carry the machine's bare ceiling (a raw
read plus the mode's primitive and its check, on the same threads, no kvtier), and that bare contender
does the check it stands for (a file that does not verify is refused, never counted as read)."""

from __future__ import annotations

import math
import os
from concurrent.futures import ThreadPoolExecutor

import pytest
from cryptography.exceptions import InvalidTag

from kvtier.format import blockformat as bf
from kvtier.tools.bench import _security as security


def test_disk_gets_carry_the_bare_ceiling_beside_the_primitive():
    rows = security.mode_rows("disk", 64 << 10, 1 << 20, 1, ["authenticate", "encrypt"])
    gets = [r for r in rows if r["op"] == "get"]
    assert sorted(r["backend"] for r in gets) == ["disk authenticate", "disk encrypt"]
    for r in gets:
        assert r["bare_read_gib_s"] > 0 and r["bare_ceiling_gib_s"] > 0
        assert math.isclose(r["ratio_vs_bare"], r["gib_s"] / r["bare_ceiling_gib_s"], rel_tol=1e-9)
        assert "bare: open/preadv/close + the primitive" in r["note"]
    assert all("bare_ceiling_gib_s" not in r for r in rows if r["op"] == "put")


@pytest.mark.parametrize("mode, error", [("encrypt", InvalidTag), ("authenticate", RuntimeError)])
def test_bare_reader_checks_every_tag(tmp_path, mode, error):
    payloads = [memoryview(os.urandom(8192)) for _ in range(6)]
    bufs = [memoryview(bytearray(8192)) for _ in payloads]
    with ThreadPoolExecutor(2) as pool:
        bare = security.BareReads(str(tmp_path), mode, payloads, pool, 2)
        for p in bare.paths:  # files of the sealed values' size
            assert os.path.getsize(p) == bf.SEALED_HEADER_SIZE + 8192
        bare.get(0, len(payloads), bufs, check=True)
        assert [bytes(b) for b in bufs] == [bytes(p) for p in payloads]
        with open(bare.paths[4], "r+b") as f:  # one payload byte changed
            f.seek(bf.SEALED_HEADER_SIZE + 100)
            byte = f.read(1)
            f.seek(bf.SEALED_HEADER_SIZE + 100)
            f.write(bytes([byte[0] ^ 1]))
        bare.get(0, 4, bufs, check=True)  # the others still verify
        with pytest.raises(error):
            bare.get(0, len(payloads), bufs, check=True)
