"""Puts of a payload in segments (``blockformat.Segments``: a value of several engine blocks, put from the
host slots that hold them): the stored value is byte for byte the one of the joined payload, in every mode
and on every real store; backends that write segments get them as they are (no joined copy), any other
gets one joined buffer; the stack's grouped writes hand segments down."""

from __future__ import annotations

import os

import numpy as np
import pytest
from _stack_helpers import BLOCK, TIMEOUT, chain, fill, make_stack

from kvtier.backend_api import StorageBackend, frame
from kvtier.backends import _disk_files
from kvtier.backends.local_disk import LocalDiskBackend
from kvtier.backends.redis import RedisBackend
from kvtier.backends.s3 import S3Backend, _ReadGuard, _TwoPartBody
from kvtier.format import blockformat as bf
from kvtier.keys import Namespace
from kvtier.security import KeyRing, Seal

NS = Namespace("segments/model", "bfloat16", 2, 2, 64, 16)
LID = NS.layout_id
MODES = (None, "authenticate", "encrypt")


def keys(n: int) -> list[str]:
    return NS.keys([os.urandom(16) for _ in range(n)])


def cut(data: bytes, n: int) -> bf.Segments:
    """``data`` as ``n`` segments of uneven lengths (and an empty one)."""
    mv = memoryview(data)
    cuts = sorted({0, len(data), *(len(data) * i // n + i for i in range(1, n))})
    return bf.Segments([mv[:0], *(mv[a:b] for a, b in zip(cuts, cuts[1:]))])


def fixed_nonce(monkeypatch: pytest.MonkeyPatch) -> None:
    """Nonces are random per value; fixed here so two seals of one payload can be compared byte for byte."""
    import types

    import kvtier.security as sec

    # The seal's own name for the module only (the process's os.urandom stays random).
    monkeypatch.setattr(sec, "os", types.SimpleNamespace(urandom=lambda n: bytes(range(n)), path=os.path,
                                                         environ=os.environ))


def seal_of(mode: str | None) -> Seal | None:
    return None if mode is None else Seal(mode, KeyRing({1: bytes(range(32))}, 1, None, False))


@pytest.mark.parametrize("mode", ["authenticate", "encrypt"])
def test_a_sealed_payload_in_segments_is_sealed_as_the_joined_one(mode, monkeypatch):
    fixed_nonce(monkeypatch)
    seal = seal_of(mode)
    assert seal is not None
    key = keys(1)[0]
    data = np.random.default_rng(1).integers(0, 256, 300_001, dtype=np.uint8).tobytes()
    h1, s1 = seal.seal(key, memoryview(data), LID)
    h2, s2 = seal.seal(key, cut(data, 5), LID)
    stored = bytes(s2) if isinstance(s2, memoryview) else b"".join(s2.parts)
    assert h1 == h2 and bytes(s1) == stored
    assert isinstance(s2, memoryview) == (mode == "encrypt")  # authenticate stores the parts as they are
    assert seal.open(key, len(h2) + len(stored), h2, memoryview(bytearray(stored)), LID) is None


def test_frame_of_segments_is_the_frame_of_the_joined_payload():
    key = keys(1)[0]
    data = os.urandom(70_000)
    assert frame(key, cut(data, 4), LID) == frame(key, memoryview(data), LID)
    assert bf.encode_header(b"\1" * 16, b"\2" * 16, 3, cut(data, 3), aligned=True) == \
        bf.encode_header(b"\1" * 16, b"\2" * 16, 3, data, aligned=True)


@pytest.fixture(params=["local_disk", "redis", "s3"])
def store(request, tmp_path):
    """``(make(seal) -> backend, raw(key) -> stored bytes)`` over one real store."""
    kind, made = request.param, []
    if kind == "local_disk":
        def new(): return LocalDiskBackend({"path": str(tmp_path / "kv"), "capacity": 1 << 30})

        def raw(key): return (tmp_path / "kv" / key[:32] / key[33:35] / key[33:]).read_bytes()
    elif kind == "redis":
        server = request.getfixturevalue("redis_server")

        def new(): return RedisBackend({"url": server.url, "eviction_events": "off"})

        def raw(key): return server.client().get(b"kvtier:" + key.encode())
    else:
        moto, bucket = request.getfixturevalue("moto_server"), request.getfixturevalue("s3_bucket")

        def new(): return S3Backend({"bucket": bucket, "endpoint_url": moto.endpoint_url})

        def raw(key): return moto.client().get_object(Bucket=bucket, Key=key)["Body"].read()

    def make(seal):
        b = new()
        b.secure(seal)
        made.append(b)
        return b
    yield make, raw
    for b in made:
        b.close()


@pytest.mark.parametrize("mode", MODES)
def test_every_store_keeps_a_segmented_put_as_the_joined_one_in_every_mode(store, mode, monkeypatch):
    """4 blocks of 64 KiB as segments (a grouped value; aligned on local_disk in mode none) against the
    same bytes in one buffer: the same stored value, and it loads."""
    fixed_nonce(monkeypatch)
    make, raw = store
    b = make(seal_of(mode))
    assert type(b).writes_segments
    key = keys(1)[0]
    blocks = [os.urandom(64 << 10) for _ in range(4)]
    data = b"".join(blocks)
    assert b.put([key], [bf.Segments([memoryview(x) for x in blocks])], LID) == [True]
    as_segments = raw(key)
    buf = bytearray(len(data))
    assert b.get_into([key], [buf], LID) == [True] and bytes(buf) == data
    assert b.put([key], [data], LID) == [True]
    assert raw(key) == as_segments


class _OneBuffer(StorageBackend):
    """A backend that does not say ``writes_segments`` (as a third party's): records what its hooks get."""

    def __init__(self):
        super().__init__(name="one")
        self.values: dict[str, bytes] = {}
        self.seen: list[type] = []

    def _write(self, keys, values):
        for k, (h, p) in zip(keys, values):
            self.seen.append(type(p))
            self.values[k] = bytes(h) + bytes(p)
        return [True] * len(keys)

    def _read_into(self, keys, headers, payloads):
        out = []
        for k, h, p in zip(keys, headers, payloads):
            v = self.values.get(k)
            if v is not None:
                n = min(len(v), h.nbytes)
                h[:n] = v[:n]
                rest = v[n:n + p.nbytes]
                p[:len(rest)] = rest
            out.append(None if v is None else len(v))
        return out

    def _exists(self, keys):
        return [k in self.values for k in keys]

    def _delete(self, keys):
        return sum(self.values.pop(k, None) is not None for k in keys)

    def _scan(self, prefix):
        return iter(())


def test_a_backend_that_does_not_write_segments_gets_one_joined_buffer():
    b = _OneBuffer()
    k1, k2 = keys(2)
    data = os.urandom(10_000)
    assert b.put([k1, k2], [cut(data, 3), bf.Segments([memoryview(data)])], LID) == [True, True]
    assert b.seen == [memoryview, memoryview]
    assert b.values[k1] == frame(k1, memoryview(data), LID) + data
    assert b.values[k2] == frame(k2, memoryview(data), LID) + data
    buf = bytearray(len(data))
    assert b.get_into([k1], [buf], LID) == [True] and bytes(buf) == data


def test_write_tmp_finishes_short_writes_and_more_buffers_than_iov_max(tmp_path, monkeypatch):
    """local_disk writes header and parts with ``writev``: more parts than one call takes, and calls that
    write only part of what they were given (a network filesystem may), still store every byte in order."""
    parts = [os.urandom(1 + i % 13) for i in range(2500)]
    real = os.writev

    def short(fd, bufs):
        bufs = list(bufs)
        assert len(bufs) <= _disk_files._IOV_MAX
        return real(fd, bufs[:3]) if sum(len(memoryview(x)) for x in bufs[:3]) > 2 else real(fd, bufs[:1])

    monkeypatch.setattr(_disk_files.os, "writev", short)
    tmp = str(tmp_path / "t")
    _disk_files.write_tmp(str(tmp_path), tmp, b"HEADER", bf.Segments([memoryview(p) for p in parts]), False)
    with open(tmp, "rb") as f:
        assert f.read() == b"HEADER" + b"".join(parts)


def test_the_s3_body_streams_segments_in_order():
    parts = [b"abc", b"", b"defgh", b"i"]
    body = _TwoPartBody(b"HH", bf.Segments([memoryview(p) for p in parts]), _ReadGuard())
    assert len(body) == 11
    got = b""
    while chunk := body.read(2):
        got += bytes(chunk)
    assert got == b"HHabcdefghi"
    body.seek(4)  # inside "abc": the rest of that part, then the next non-empty one
    assert [bytes(body.read(1)) for _ in range(4)] == [b"c", b"defgh", b"i", b""]
    body.seek(0)
    out = bytearray(11)
    assert body.readinto(out) == 11 and bytes(out) == b"HHabcdefghi"


def test_a_grouped_write_from_host_memory_goes_down_as_segments(tmp_path, monkeypatch):
    """A stack with values of 4 blocks over local_disk: each value reaches the backend's put hook as the
    segments of its 4 host slots (no joined copy on the way), and is stored as their bytes back to back."""
    st, fb = make_stack(tmp_path, host_slots=16, storage={"block_tokens": 4 * BLOCK})
    disk = fb.inner
    seen: list[object] = []
    real = disk._put_blocks

    def spy(keys, payloads, layout_id):
        seen.extend(payloads)
        return real(keys, payloads, layout_id)

    monkeypatch.setattr(disk, "_put_blocks", spy)
    try:
        hs = chain(st, 8)
        rows = fill(st, list(range(8)), seed=3)
        assert st.store(hs, list(range(8))).wait(TIMEOUT).num_stored == 8
        assert st.flush(TIMEOUT)
        assert len(seen) == 2 and all(isinstance(p, bf.Segments) and len(p.parts) == 4 for p in seen)
        for g, last in enumerate((3, 7)):
            buf = bytearray(4 * st.layout.block_nbytes)
            assert disk.get_into(st.namespace.keys([hs[last]]), [buf], st.namespace.layout_id) == [True]
            assert bytes(buf) == rows[4 * g:4 * g + 4].numpy().tobytes()
    finally:
        fb.clear()
        st.close(timeout=TIMEOUT)
