"""The storage backend conformance suite: every behaviour the stack relies on, for any backend.

A third party proves its backend by inheriting the suite and providing one fixture::

    from kvtier.testing import BackendConformance
    class TestMyBackend(BackendConformance):
        @pytest.fixture
        def backend(self, tmp_path): return MyBackend({"path": str(tmp_path)})

``backend`` must build a fresh, empty backend for each test (function scope); the suite closes it.
The class itself is not collected (its name does not start with ``Test``).

Corruption is injected through the backend's own hooks, so no backend-specific code is needed:
``read_raw`` / ``write_raw`` default to ``_read_small`` / ``_write([key], [(b"", value)])``, which store
a value's bytes as given.  Override them if your backend stores values differently.

Invariants checked: a value is returned only if every header field and the checksum match what was
asked for; a bad value is a miss, counted in ``stats().corrupt`` and deleted; an absent key leaves the
caller's buffer untouched; namespaces never see each other's blocks; concurrent callers never get
wrong bytes; a malformed key or namespace id (path parts, NUL, case or whitespace variants, non-strings)
is refused with ``InvalidKey`` by every public method and never reaches one of the backend's hooks.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Iterator
from typing import Any

import numpy as np
import pytest

from kvtier.backend_api import BackendError, InvalidKey, StorageBackend
from kvtier.format import blockformat
from kvtier.keys import Namespace

NS_A = Namespace("conformance/model-a", "bfloat16", 2, 2, 64, 16)
NS_B = Namespace("conformance/model-a", "float8_e4m3fn", 2, 2, 64, 16)  # differs only in dtype
SIZE = 4096
H = blockformat.HEADER_SIZE

# Each header field (offset inside the stored value) and two payload bytes; see kvtier.format.blockformat.
FIELDS = {"magic": 0, "version": 4, "header_length": 6, "payload_length": 8, "namespace": 16,
          "hash_length": 32, "hash": 33, "reserved": 65, "layout_id": 68, "payload_checksum": 72,
          "header_checksum": 80, "payload_first": H, "payload_last": H + SIZE - 1}


# Keys no backend hook may ever see (see kvtier.keys.invalid_key): path tricks, NUL, empty, extra parts,
# case and whitespace variants of a valid key, non-strings.
_K = f"{NS_A.id}/{'ab' * 16}"
MALFORMED_KEYS = [
    "../x", "../" * 4 + "etc/passwd", f"{NS_A.id}/../{'0' * 32}", f"/{_K}", "/etc/passwd", "",
    f"{NS_A.id}/{'0' * 16}\x00{'0' * 15}", f"{_K}/x", f"{NS_A.id}//{'ab' * 16}", f"{NS_A.id}/{'ab' * 16}/",
    _K.upper(), f"{NS_A.id}/{'AB' * 16}", f" {_K}", f"{_K} ", f"{_K}\n", f"\t{_K}", f"{NS_A.id}\\{'ab' * 16}",
    f"./{_K}", f"{NS_A.id}/{'ab' * 15}a", f"{NS_A.id}/{'ab' * 17}", f"{NS_A.id}/manifest.json", "x" * 10_000,
    f"{NS_A.id}/{'ａｂ' * 16}", None, b"0" * 65, 7,
]
#: The hooks a public method may call; a malformed key must reach none of them.
HOOKS = ("_write", "_read_into", "_exists", "_delete", "_scan", "_put_blocks", "_get_blocks", "_read_small",
         "_write_small")


def rand(n: int) -> bytes:
    """Random bytes (never a run of zeros that a backend could get right by accident)."""
    return os.urandom(n)


def keys(ns: Namespace, n: int, hash_bytes: int = 16) -> list[str]:
    return ns.keys([os.urandom(hash_bytes) for _ in range(n)])


class BackendConformance:
    """Inherit and override the ``backend`` fixture; see the module docstring."""

    @pytest.fixture
    def backend(self) -> StorageBackend:
        raise NotImplementedError("override the `backend` fixture: return a fresh, empty backend")

    @pytest.fixture
    def kv(self, backend: StorageBackend) -> Iterator[StorageBackend]:
        yield backend
        backend.close()

    # ---------------------------------------------------------------- hooks a backend may override

    def read_raw(self, backend: StorageBackend, key: str) -> bytes | None:
        """The stored value's bytes (header + payload)."""
        return backend._read_small(key)

    def write_raw(self, backend: StorageBackend, key: str, value: bytes) -> None:
        """Store ``value`` under ``key`` as is, bypassing framing."""
        assert backend._write([key], [(b"", memoryview(value))]) == [True]

    def corrupt(self, backend: StorageBackend, key: str, offset: int) -> None:
        raw = bytearray(self._stored(backend, key))
        raw[offset] ^= 0x5A
        self.write_raw(backend, key, bytes(raw))

    def truncate(self, backend: StorageBackend, key: str, length: int) -> None:
        self.write_raw(backend, key, self._stored(backend, key)[:length])

    def _stored(self, backend: StorageBackend, key: str) -> bytes:
        raw = self.read_raw(backend, key)
        if raw is None:
            raise KeyError(f"{backend.name}: nothing stored under {key!r} to damage")
        return raw

    # ---------------------------------------------------------------- helpers

    def put1(self, kv: StorageBackend, key: str, data: bytes, ns: Namespace = NS_A) -> None:
        assert kv.put([key], [data], ns.layout_id) == [True]

    def get1(self, kv: StorageBackend, key: str, size: int, ns: Namespace = NS_A) -> bytes | None:
        buf = bytearray(size)
        return bytes(buf) if kv.get_into([key], [buf], ns.layout_id) == [True] else None

    # ---------------------------------------------------------------- round trips

    def test_round_trip(self, kv: StorageBackend) -> None:
        k, data = keys(NS_A, 1)[0], rand(SIZE)
        self.put1(kv, k, data)
        assert self.get1(kv, k, SIZE) == data

    def test_batch_round_trip(self, kv: StorageBackend) -> None:
        ks = keys(NS_A, 24) + keys(NS_A, 8, hash_bytes=32)
        data = [rand(SIZE) for _ in ks]
        assert kv.put(ks, data, NS_A.layout_id) == [True] * len(ks)
        order = list(range(len(ks)))[::-1]
        bufs = [bytearray(SIZE) for _ in order]
        assert kv.get_into([ks[i] for i in order], bufs, NS_A.layout_id) == [True] * len(ks)
        assert [bytes(b) for b in bufs] == [data[i] for i in order]

    @pytest.mark.parametrize("size", [1, 4096, 2 * 2**20, 8 * 2**20 + 3])
    def test_block_sizes(self, kv: StorageBackend, size: int) -> None:
        k, data = keys(NS_A, 1)[0], rand(size)
        self.put1(kv, k, data)
        assert self.get1(kv, k, size) == data

    def test_buffer_types(self, kv: StorageBackend) -> None:
        ks = keys(NS_A, 3)
        arr = np.frombuffer(rand(SIZE), dtype=np.uint16).copy()  # a typed, non-byte buffer
        payloads = [rand(SIZE), bytearray(rand(SIZE)), arr]
        assert kv.put(ks, payloads, NS_A.layout_id) == [True] * 3
        into = np.zeros(SIZE // 2, dtype=np.uint16)
        out = [bytearray(SIZE), memoryview(bytearray(SIZE)), into]
        assert kv.get_into(ks, out, NS_A.layout_id) == [True] * 3
        assert bytes(out[0]) == bytes(payloads[0]) and bytes(out[1]) == bytes(payloads[1])
        assert np.array_equal(into, arr)

    def test_empty_batches(self, kv: StorageBackend) -> None:
        assert kv.put([], [], NS_A.layout_id) == []
        assert kv.get_into([], [], NS_A.layout_id) == []
        assert kv.contains_prefix([]) == 0 and kv.delete([]) == 0

    def test_overwrite(self, kv: StorageBackend) -> None:
        k = keys(NS_A, 1)[0]
        self.put1(kv, k, rand(SIZE))
        newer = rand(SIZE)
        self.put1(kv, k, newer)
        assert self.get1(kv, k, SIZE) == newer
        bigger = rand(2 * SIZE)  # a new size replaces the old value too
        self.put1(kv, k, bigger)
        assert self.get1(kv, k, 2 * SIZE) == bigger

    # ---------------------------------------------------------------- misses and lookups

    def test_missing_keys(self, kv: StorageBackend) -> None:
        present, absent = keys(NS_A, 2)
        data = rand(SIZE)
        self.put1(kv, present, data)
        sentinel = rand(SIZE)
        bufs = [bytearray(SIZE), bytearray(sentinel)]
        assert kv.get_into([present, absent], bufs, NS_A.layout_id) == [True, False]
        assert bytes(bufs[0]) == data
        assert bytes(bufs[1]) == sentinel, "a miss must leave the caller's buffer untouched"
        s = kv.stats()
        assert (s.gets, s.hits, s.misses, s.corrupt) == (2, 1, 1, 0)

    def test_on_verified_reports_exactly_the_verified_keys(self, kv: StorageBackend) -> None:
        """``get_into(..., on_verified=)`` reports each key whose buffer holds its verified bytes once, by
        the time ``get_into`` returns, with the bytes already in the buffer; a missing or corrupt key never."""
        ks = keys(NS_A, 6)
        data = [rand(SIZE) for _ in ks]
        assert kv.put(ks[:5], data[:5], NS_A.layout_id) == [True] * 5  # ks[5]: never stored
        self.corrupt(kv, ks[2], FIELDS["payload_checksum"])
        bufs = [bytearray(SIZE) for _ in ks]
        told: list[tuple[int, bool]] = []  # list.append is atomic: a backend may report from its threads
        ok = kv.get_into(ks, bufs, NS_A.layout_id, on_verified=lambda i: told.append((i, bytes(bufs[i]) == data[i])))
        assert ok == [True, True, False, True, True, False]
        assert sorted(told) == [(0, True), (1, True), (3, True), (4, True)]

    def test_segments_when_the_backend_reads_them(self, kv: StorageBackend) -> None:
        """A backend that says ``reads_segments`` fills a payload given as :class:`~kvtier.format.blockformat.
        Segments` in order and verifies it there: the parts hold the value's bytes back to back; a corrupt
        value is a miss.  A backend that does not say so is never handed segments (nothing to test)."""
        if not type(kv).reads_segments:
            return
        ks = keys(NS_A, 2)
        data = [rand(SIZE) for _ in ks]
        assert kv.put(ks, data, NS_A.layout_id) == [True, True]
        self.corrupt(kv, ks[1], FIELDS["payload_checksum"])
        cuts = [0, 7, SIZE // 3, SIZE // 3 + 1, SIZE]
        parts = [[bytearray(b - a) for a, b in zip(cuts, cuts[1:])] for _ in ks]
        segs = [blockformat.Segments([memoryview(p) for p in ps]) for ps in parts]
        assert kv.get_into(ks, segs, NS_A.layout_id) == [True, False]
        assert b"".join(parts[0]) == data[0]
        assert kv.stats().corrupt == 1

    @pytest.mark.parametrize("size", [SIZE, 256 << 10])
    def test_segmented_put_stores_the_value_of_the_joined_payload(self, kv: StorageBackend, size: int) -> None:
        """A payload put as :class:`~kvtier.format.blockformat.Segments` (one payload in several buffers:
        a value of several engine blocks) is stored byte for byte as the same payload in one buffer: same
        header, same checksum, read back whole.  Any backend: one that does not say ``writes_segments``
        gets the parts joined by the base class."""
        k, other = keys(NS_A, 2)
        data = rand(size)
        cuts = [0, 0, 7, size // 4, size // 4, size // 2 + 1, size]  # an empty part, odd lengths
        segs = blockformat.Segments([memoryview(data)[a:b] for a, b in zip(cuts, cuts[1:])])
        assert kv.put([k, other], [segs, blockformat.Segments([memoryview(data)])], NS_A.layout_id) == [True] * 2
        assert self.get1(kv, k, size) == data and self.get1(kv, other, size) == data
        as_segments = self.read_raw(kv, k)
        self.put1(kv, k, data)
        assert as_segments is not None and as_segments == self.read_raw(kv, k)
        assert kv.stats().put_bytes == 3 * size

    def test_contains_prefix_and_exists(self, kv: StorageBackend) -> None:
        chain = keys(NS_A, 6)
        assert kv.put(chain[:3] + chain[4:], [rand(64) for _ in range(5)], NS_A.layout_id) == [True] * 5
        assert kv.contains_prefix(chain) == 3
        assert kv.contains_prefix(chain[:2]) == 2
        assert kv.contains_prefix(chain[3:]) == 0
        assert kv.exists(chain) == [True, True, True, False, True, True]

    def test_wrong_buffer_size_is_a_miss(self, kv: StorageBackend) -> None:
        k = keys(NS_A, 1)[0]
        self.put1(kv, k, rand(SIZE))
        assert self.get1(kv, k, SIZE - 1) is None

    def test_wrong_layout_id_is_a_miss(self, kv: StorageBackend) -> None:
        k = keys(NS_A, 1)[0]
        self.put1(kv, k, rand(SIZE), ns=NS_A)
        assert self.get1(kv, k, SIZE, ns=NS_B) is None
        assert kv.stats().corrupt == 1

    # ---------------------------------------------------------------- corruption

    @pytest.mark.parametrize("field", list(FIELDS))
    def test_corrupted_value(self, kv: StorageBackend, field: str) -> None:
        k, other = keys(NS_A, 2)
        data = rand(SIZE)
        self.put1(kv, k, data)
        self.put1(kv, other, data)
        self.corrupt(kv, k, FIELDS[field])
        assert self.get1(kv, k, SIZE) is None, f"a value with a corrupted {field} was returned"
        s = kv.stats()
        assert s.corrupt == 1 and s.misses == 1
        assert kv.exists([k, other]) == [False, True], "a corrupt value must be deleted, only it"
        assert self.get1(kv, other, SIZE) == data

    @pytest.mark.parametrize("length", [0, 1, H - 1, H, H + SIZE // 2, H + SIZE - 1])
    def test_truncated_value(self, kv: StorageBackend, length: int) -> None:
        k = keys(NS_A, 1)[0]
        self.put1(kv, k, rand(SIZE))
        self.truncate(kv, k, length)
        assert self.get1(kv, k, SIZE) is None
        assert kv.stats().corrupt == 1
        assert kv.exists([k]) == [False]

    def test_value_with_trailing_bytes(self, kv: StorageBackend) -> None:
        k = keys(NS_A, 1)[0]
        self.put1(kv, k, rand(SIZE))
        self.write_raw(kv, k, self._stored(kv, k) + b"\x01")
        assert self.get1(kv, k, SIZE) is None and kv.stats().corrupt == 1

    def test_value_of_another_key(self, kv: StorageBackend) -> None:
        a, b = keys(NS_A, 2)
        self.put1(kv, a, rand(SIZE))
        self.write_raw(kv, b, self._stored(kv, a))  # a misplaced value, intact but not b's
        assert self.get1(kv, b, SIZE) is None and kv.stats().corrupt == 1

    # ---------------------------------------------------------------- namespaces, scan, delete

    def test_namespace_isolation(self, kv: StorageBackend) -> None:
        h = os.urandom(16)
        ka, kb = NS_A.key(h), NS_B.key(h)
        da, db = rand(SIZE), rand(SIZE)
        self.put1(kv, ka, da, NS_A)
        self.put1(kv, kb, db, NS_B)
        assert self.get1(kv, ka, SIZE, NS_A) == da
        assert self.get1(kv, kb, SIZE, NS_B) == db
        assert [b.key for b in kv.scan(NS_A.id)] == [ka]
        assert [b.key for b in kv.scan(NS_B.id)] == [kb]
        assert kv.delete([ka]) == 1
        assert self.get1(kv, kb, SIZE, NS_B) == db

    def test_scan(self, kv: StorageBackend) -> None:
        ks = keys(NS_A, 5)
        sizes = [1, 10, 100, 1000, SIZE]
        assert kv.put(ks, [rand(n) for n in sizes], NS_A.layout_id) == [True] * 5
        kb = keys(NS_B, 2)
        kv.put(kb, [rand(8), rand(8)], NS_B.layout_id)
        kv.put_manifest(NS_A)
        got = {b.key: b.size for b in kv.scan(NS_A.id)}
        assert got == {k: H + n for k, n in zip(ks, sizes)}, "scan lists blocks (not manifests) with sizes"
        assert {b.key for b in kv.scan()} == set(ks) | set(kb)
        assert list(kv.scan("f" * 32)) == []
        assert set(kv.namespaces()) >= {NS_A.id, NS_B.id}

    def test_delete(self, kv: StorageBackend) -> None:
        ks = keys(NS_A, 4)
        kv.put(ks, [rand(64) for _ in ks], NS_A.layout_id)
        assert kv.delete(ks[:2] + keys(NS_A, 1)) == 2
        assert kv.exists(ks) == [False, False, True, True]
        assert kv.delete(ks[:2]) == 0
        assert kv.stats().deletes == 2
        assert self.get1(kv, ks[0], 64) is None

    def test_hold_and_release_change_no_block(self, kv: StorageBackend) -> None:
        """A load holds the keys it will read (stored or not), then releases them: neither call fails,
        and every block reads back as stored, overwritten while held or not."""
        ks = keys(NS_A, 4)
        data = [rand(64) for _ in ks]
        kv.put(ks[:3], data[:3], NS_A.layout_id)
        kv.hold(ks)
        kv.hold(ks[:1])
        kv.put(ks[2:], data[2:], NS_A.layout_id)
        assert [self.get1(kv, k, 64) for k in ks] == data
        kv.release(ks[:1])
        kv.release(ks)
        assert kv.delete(ks[:1]) == 1 and kv.exists(ks) == [False, True, True, True]

    def test_manifest_round_trip(self, kv: StorageBackend) -> None:
        assert kv.get_manifest(NS_A.id) is None
        kv.put_manifest(NS_A)
        got = kv.get_manifest(NS_A.id)
        assert got == NS_A.manifest()
        assert Namespace.from_manifest(got).id == NS_A.id
        assert NS_A.id in kv.namespaces()
        assert kv.get_manifest(NS_B.id) is None

    def test_malformed_keys_are_refused(self, kv: StorageBackend) -> None:
        for bad in ["", "nope", "../" * 4 + "etc/passwd", f"{NS_A.id}/../{'0' * 32}"]:
            with pytest.raises((ValueError, BackendError), match="key"):
                kv.put([bad], [rand(8)], NS_A.layout_id)

    @pytest.mark.parametrize("bad", MALFORMED_KEYS, ids=range(len(MALFORMED_KEYS)))
    def test_malformed_keys_never_reach_a_hook(self, kv: StorageBackend, bad: Any) -> None:
        """Every public method refuses a non-canonical key (anywhere in the batch) with InvalidKey naming
        the backend and the key, before any hook runs: nothing stored, read, deleted or counted."""
        good = keys(NS_A, 1)[0]
        self.put1(kv, good, rand(SIZE))
        before = kv.stats()
        calls: list[str] = []
        for hook in HOOKS:
            real = getattr(kv, hook)

            def spy(*args: Any, _hook: str = hook, _real: Any = real, **kw: Any) -> Any:
                calls.append(_hook)
                return _real(*args, **kw)

            setattr(kv, hook, spy)  # an instance attribute: the base class's calls go through it
        batch = [good, bad]
        for name, call in [
            ("put", lambda: kv.put(batch, [rand(SIZE), rand(SIZE)], NS_A.layout_id)),
            ("get_into", lambda: kv.get_into(batch, [bytearray(SIZE), bytearray(SIZE)], NS_A.layout_id)),
            ("exists", lambda: kv.exists(batch)),
            ("contains_prefix", lambda: kv.contains_prefix(batch)),
            ("delete", lambda: kv.delete(batch)),
        ]:
            with pytest.raises(InvalidKey) as e:
                call()
            msg = str(e.value)
            assert isinstance(e.value, ValueError) and e.value.key == bad, (name, msg)
            assert repr(kv.name) in msg and repr(bad)[:100] in msg, (name, msg)
        assert calls == [], f"hooks reached with a malformed key: {calls}"
        after = kv.stats()
        assert (after.puts, after.put_failures, after.gets, after.misses, after.deletes) == \
            (before.puts, before.put_failures, before.gets, before.misses, before.deletes)
        for hook in HOOKS:
            delattr(kv, hook)
        assert self.get1(kv, good, SIZE) is not None, "the refused calls left the good key alone"

    @pytest.mark.parametrize("bad_ns", ["../..", NS_A.id.upper(), NS_A.id + "/x", f" {NS_A.id}", "*",
                                        NS_A.id[:31] + "\x00"])
    def test_malformed_namespace_ids_never_reach_a_hook(self, kv: StorageBackend, bad_ns: str) -> None:
        calls: list[str] = []
        for hook in HOOKS:
            setattr(kv, hook, lambda *a, _h=hook, **k: calls.append(_h))
        with pytest.raises(InvalidKey):
            kv.get_manifest(bad_ns)
        with pytest.raises(InvalidKey):
            list(kv.scan(bad_ns))
        assert calls == []

    # ---------------------------------------------------------------- counters, health, close

    def test_stats_counters(self, kv: StorageBackend) -> None:
        ks = keys(NS_A, 3)
        kv.put(ks, [rand(SIZE) for _ in ks], NS_A.layout_id)
        bufs = [bytearray(SIZE) for _ in range(4)]
        kv.get_into(ks + keys(NS_A, 1), bufs, NS_A.layout_id)
        s = kv.stats()
        assert (s.puts, s.put_bytes, s.put_failures) == (3, 3 * SIZE, 0)
        assert (s.gets, s.hits, s.misses, s.get_bytes, s.corrupt) == (4, 3, 1, 3 * SIZE, 0)
        assert s.put_seconds >= 0 and s.get_seconds >= 0

    def test_health(self, kv: StorageBackend) -> None:
        assert kv.health() is True

    def test_close_is_idempotent(self, backend: StorageBackend) -> None:
        backend.close()
        backend.close()

    # ---------------------------------------------------------------- concurrency

    def test_concurrent_threads(self, kv: StorageBackend) -> None:
        """8 threads put and get their own blocks and fight over shared keys: never a wrong byte."""
        shared = keys(NS_A, 4)
        versions = {k: [rand(SIZE) for _ in range(8)] for k in shared}
        allowed = {k: set(v) for k, v in versions.items()}
        errors: list[str] = []

        def worker(t: int) -> None:
            try:
                own = keys(NS_A, 16)
                data = [rand(SIZE) for _ in own]
                for rnd in range(4):
                    assert kv.put(own, data, NS_A.layout_id) == [True] * 16
                    kv.put(shared, [versions[k][t] for k in shared], NS_A.layout_id)
                    bufs = [bytearray(SIZE) for _ in own + shared]
                    ok = kv.get_into(own + shared, bufs, NS_A.layout_id)
                    if ok[:16] != [True] * 16 or [bytes(b) for b in bufs[:16]] != data:
                        errors.append(f"thread {t} round {rnd}: own blocks wrong")
                    for k, good, b in zip(shared, ok[16:], bufs[16:]):
                        if good and bytes(b) not in allowed[k]:
                            errors.append(f"thread {t}: shared key {k} returned bytes no one wrote")
            except Exception as e:  # noqa: BLE001 - reported below with the thread
                errors.append(f"thread {t}: {type(e).__name__}: {e}")

        threads = [threading.Thread(target=worker, args=(t,)) for t in range(8)]
        for th in threads:
            th.start()
        for th in threads:
            th.join(120)
        assert not errors, errors[:5]
        assert kv.stats().corrupt == 0
