"""Issue 6 item 2: corruption of stored values on local disk, Redis and S3.

For each backend, 40 blocks are stored; then K of them are damaged behind the backend's back, with the
real medium's own tools (the file rewritten in place, ``SETRANGE``/``SET`` through another Redis client,
an object re-uploaded through another boto3 client):

* byte flips in every header field (magic, version, lengths, namespace, key, layout, both checksums) and
  in the payload (first, middle, last byte, a single bit);
* truncations (to 0, 1, 87, 88 = header only, header + 1, half, all but one byte, all but 4 KiB);
* bytes appended (1, 4 KiB);
* another key's intact value stored under this key (a misplaced block).

Then one batched read of all 40: every damaged block must be a miss (none served), every intact one a
hit with exact bytes; ``stats().corrupt`` must be K; every damaged value must be gone from the medium
(checked with the raw tool, not the backend); a second read counts nothing new; rewriting the K keys
makes them hits again.
"""

from __future__ import annotations

import os
from typing import Any, Protocol, cast

import numpy as np
import pytest
from _reliability.common import BLOCK, LID, check, key_of, payload

from kvtier.backends.local_disk import LocalDiskBackend
from kvtier.format.blockformat import HEADER_SIZE

N = 40
FULL = HEADER_SIZE + BLOCK
FLIPS = [(0, 0xFF), (4, 0x01), (6, 0x80), (8, 0x01), (16, 0x10), (32, 0x01), (40, 0x02), (66, 0x01),
         (68, 0x40), (72, 0x01), (80, 0x01), (87, 0x80),  # header fields, reserved bytes, checksums
         (HEADER_SIZE, 0xFF), (HEADER_SIZE + BLOCK // 2, 0x01), (FULL - 1, 0x80), (HEADER_SIZE + 1234, 0x08)]
TRUNCS = [0, 1, HEADER_SIZE - 1, HEADER_SIZE, HEADER_SIZE + 1, HEADER_SIZE + BLOCK // 2, FULL - 1, FULL - 4096]
EXTENDS = [1, 4096]  # bytes appended: a value longer than a block is not a block either
SWAPS = 2
K = len(FLIPS) + len(TRUNCS) + len(EXTENDS) + SWAPS


class Medium(Protocol):
    """Raw access to where a backend keeps a key's value."""

    def read(self, key: str) -> bytes: ...  # of a key that is there
    def write(self, key: str, value: bytes) -> None: ...
    def exists(self, key: str) -> bool: ...


class DiskMedium(Medium):
    def __init__(self, root: str):
        self.root = root

    def path(self, key: str) -> str:
        ns, h = key.split("/")
        return os.path.join(self.root, ns, h[:2], h)

    def read(self, key):
        with open(self.path(key), "rb") as f:
            return f.read()

    def write(self, key, value):  # in place, as a bad disk or a stray writer would
        with open(self.path(key), "r+b") as f:
            f.write(value)
            f.truncate(len(value))

    def exists(self, key):
        return os.path.lexists(self.path(key))


class RedisMedium(Medium):
    def __init__(self, client):
        self.c = client

    def read(self, key):
        return self.c.get(b"kvtier:" + key.encode())

    def write(self, key, value):
        old = self.read(key)
        if len(value) == len(old):  # a flip: change only the differing byte(s), in place
            for i in np.flatnonzero(np.frombuffer(old, np.uint8) != np.frombuffer(value, np.uint8)):
                self.c.setrange(b"kvtier:" + key.encode(), int(i), value[i:i + 1])
        else:
            self.c.set(b"kvtier:" + key.encode(), value)

    def exists(self, key):
        return self.c.exists(b"kvtier:" + key.encode()) == 1


class S3Medium(Medium):
    def __init__(self, client, bucket):
        self.c, self.bucket = client, bucket

    def read(self, key):
        return self.c.get_object(Bucket=self.bucket, Key=key)["Body"].read()

    def write(self, key, value):
        self.c.put_object(Bucket=self.bucket, Key=key, Body=value)

    def exists(self, key):
        try:
            self.c.head_object(Bucket=self.bucket, Key=key)
            return True
        except Exception as e:  # noqa: BLE001 - botocore ClientError
            if cast(Any, e).response["Error"]["Code"] in ("404", "NoSuchKey", "NotFound"):
                return False
            raise


def _corrupt_and_read(backend, medium: Medium, label: str, figures) -> None:
    keys = [key_of(i, tag=f"corrupt-{label}") for i in range(N)]
    data = [payload(k, 0, BLOCK) for k in keys]
    assert backend.put(keys, data, LID) == [True] * N
    assert all(len(medium.read(k)) == FULL for k in keys)
    rng = np.random.default_rng(2)
    damaged = [int(i) for i in rng.choice(N, size=K, replace=False)]
    kinds = {}
    it = iter(damaged)
    for (off, mask), i in zip(FLIPS, it):
        raw = bytearray(medium.read(keys[i]))
        raw[off] ^= mask
        medium.write(keys[i], bytes(raw))
        kinds[i] = f"flip@{off}"
    for n, i in zip(TRUNCS, it):
        medium.write(keys[i], medium.read(keys[i])[:n])
        kinds[i] = f"truncate@{n}"
    for n, i in zip(EXTENDS, it):
        medium.write(keys[i], medium.read(keys[i]) + os.urandom(n))
        kinds[i] = f"extend+{n}"
    intact = [i for i in range(N) if i not in damaged]
    for j, i in enumerate(it):
        medium.write(keys[i], medium.read(keys[intact[j]]))  # a whole, valid block of another key
        kinds[i] = "misplaced"
    assert len(kinds) == K

    before = backend.stats().corrupt
    bufs = [bytearray(BLOCK) for _ in keys]
    ok = backend.get_into(keys, bufs, LID)
    served = [kinds[i] for i in kinds if ok[i]]
    detected = backend.stats().corrupt - before
    still_there = [kinds[i] for i in kinds if medium.exists(keys[i])]
    wrong_intact = [i for i in intact if not ok[i] or check(keys[i], bufs[i]) != 0]
    figures(f"corrupt detected/served/deleted ({label})", f"{detected}/{len(served)}/{K - len(still_there)}")
    assert served == [], f"damaged blocks served: {served}"
    assert wrong_intact == [], "intact blocks must still be hits with their exact bytes"
    assert detected == K
    assert still_there == [], f"damaged values left on the medium: {still_there}"
    assert backend.exists([keys[i] for i in kinds]) == [False] * K

    ok2 = backend.get_into(keys, [bytearray(BLOCK) for _ in keys], LID)
    assert [i for i in range(N) if ok2[i]] == intact
    assert backend.stats().corrupt - before == K, "a deleted value is a plain miss, not counted again"

    again = [keys[i] for i in kinds]
    assert backend.put(again, [payload(k, 1, BLOCK) for k in again], LID) == [True] * K
    bufs = [bytearray(BLOCK) for _ in again]
    assert backend.get_into(again, bufs, LID) == [True] * K
    assert [check(k, b) for k, b in zip(again, bufs)] == [1] * K


def test_corruption_local_disk(tmp_path, figures, caplog):
    b = LocalDiskBackend({"path": str(tmp_path / "d"), "capacity": "1GiB"})
    _corrupt_and_read(b, DiskMedium(b.root), "disk", figures)
    assert sum("corrupt block" in r.getMessage() for r in caplog.records) == K, "each one is logged"
    b.close()
    # restart: the index is rebuilt from the files, so the deleted values stay gone
    b2 = LocalDiskBackend({"path": str(tmp_path / "d"), "capacity": "1GiB"})
    assert b2.stats().extra["blocks"] == N
    b2.close()


def test_corruption_redis(redis_server, figures):
    from kvtier.backends.redis import RedisBackend

    b = RedisBackend({"url": redis_server.url})
    _corrupt_and_read(b, RedisMedium(redis_server.client()), "redis", figures)
    b.close()


def test_corruption_s3(moto_server, s3_bucket, figures):
    pytest.importorskip("boto3")
    from kvtier.backends.s3 import S3Backend

    b = S3Backend({"bucket": s3_bucket, "endpoint_url": moto_server.endpoint_url})
    _corrupt_and_read(b, S3Medium(moto_server.client(), s3_bucket), "s3", figures)
    b.close()
