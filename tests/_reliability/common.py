"""Deterministic block payloads for the reliability tests: every byte of a stored block derives from its
key and a version number, so a reader can tell, from the bytes alone, whether what it was served is
exactly some block that was written under that key.

``payload(key, version, size)`` = 8 bytes version (LE) + 8 bytes digest of the key + ``size - 16``
bytes of ``numpy.random.default_rng(seed(key, version))``.  ``check(key, buf)`` returns the version
if ``buf`` is exactly ``payload(key, version, len(buf))``, else None: a torn write (parts of two
versions), another key's block, a shifted or truncated copy all fail it.
"""

from __future__ import annotations

import hashlib
import struct

import numpy as np

from kvtier.keys import Namespace

NS = Namespace("kvtier-test/reliability", "bfloat16", 2, 2, 64, 16)
LID = NS.layout_id
BLOCK = 2 * 2 * 2 * 16 * 64 * 2  # the namespace's block payload: 16 KiB


def key_of(i: int, ns: Namespace = NS, tag: str = "rel") -> str:
    return ns.key(hashlib.sha256(f"{tag}-{i}".encode()).digest()[:16])


def _seed(key: str, version: int) -> int:
    return int.from_bytes(hashlib.blake2b(f"{key}|{version}".encode(), digest_size=8).digest(), "little")


def payload(key: str, version: int, size: int) -> np.ndarray:
    assert size >= 32
    buf = np.empty(size, dtype=np.uint8)
    buf[:8] = np.frombuffer(struct.pack("<Q", version), dtype=np.uint8)
    buf[8:16] = np.frombuffer(hashlib.blake2b(key.encode(), digest_size=8).digest(), dtype=np.uint8)
    buf[16:] = np.frombuffer(np.random.default_rng(_seed(key, version)).bytes(size - 16), dtype=np.uint8)
    return buf


def check(key: str, buf) -> int | None:
    """The version ``buf`` holds if it is exactly ``payload(key, version)``; None otherwise."""
    mv = memoryview(buf).cast("B")
    if mv.nbytes < 32:
        return None
    version = struct.unpack_from("<Q", mv, 0)[0]
    want = payload(key, version, mv.nbytes)
    return version if np.array_equal(np.frombuffer(mv, dtype=np.uint8), want) else None


def make_backend(kind: str, target: str, **opts):
    """A backend of ``kind`` ("disk", "redis") on ``target`` (a directory, a redis URL)."""
    if kind == "disk":
        from kvtier.backends.local_disk import LocalDiskBackend

        return LocalDiskBackend({"path": target, **opts})
    if kind == "redis":
        from kvtier.backends.redis import RedisBackend

        return RedisBackend({"url": target, **opts})
    raise ValueError(f"unknown backend kind {kind!r}")


def batch_keys(rnd: int, b: int, nkeys: int, batch: int) -> list[int]:
    """Key indices batch ``b`` of kill round ``rnd`` writes (worker.py's writer and the test agree)."""
    rng = np.random.default_rng([rnd, b])
    return sorted(rng.choice(nkeys, size=batch, replace=False).tolist())


def version(rnd: int, b: int) -> int:
    return (rnd << 20) | b
