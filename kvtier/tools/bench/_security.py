"""``kvtier bench backends --security authenticate,encrypt``: what each security mode costs on every backend.

Per backend and block size, in the same rounds (rotating order, the first round dropped, medians): put and
get of the same payloads in mode ``none`` and in each mode asked for, on one backend instance per mode over
the same store; and the raw primitive the mode runs (AES-256-GCM through ``cryptography``: the GMAC-style
tag of ``authenticate``, the encryption / decryption of ``encrypt``, each the one-shot call on a reused
``AESGCM`` object, the fastest way ``cryptography`` runs it) over the same payloads on as
many threads as the backend's batches use (local_disk ``threads``, redis ``stripes``, s3 ``max_workers``).
A row's ``ratio`` is the mode's speed over ``none``'s; ``ratio_vs_primitive`` its speed over the
primitive's alone (the ceiling where the store is faster than the primitive: files in the page cache).

local_disk gets also carry the machine's own ceiling for a sealed read, measured bare in the same rounds
(no kvtier): ``bare_read_gib_s``, files of the sealed values' size (112-byte header, the payload) read on
the backend's threads with ``open`` / ``preadv`` / ``close`` into the buffers the backend reads into (mode
encrypt: a landing buffer per thread; authenticate: the caller's buffer), and ``bare_ceiling_gib_s``, that
same read followed on the same thread by the mode's primitive with its check (``decrypt_into`` from the
landing buffer into the caller's buffer; the GMAC over the caller's buffer compared with the stored tag).
``ratio_vs_bare`` is the backend's speed over that ceiling.  Where a page-cache read costs as much as the
primitive and the primitive holds the GIL, the bare ceiling, not the primitive alone, is what a sealed get
can reach (docs/performance.md, "Sealed reads: the machine's ceiling").

``primitive`` rows: the candidates' raw speed over the same payloads on one thread and on two (keyed
BLAKE2b, keyed BLAKE3 where installed, HMAC-SHA256, Poly1305, AES-GMAC, AES-256-GCM, ChaCha20-Poly1305):
what the MAC and the cipher were chosen by (docs/performance.md).
"""

from __future__ import annotations

import contextlib
import functools
import hashlib
import hmac
import importlib
import os
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

MAX_TOTAL = {"disk": 256 << 20, "redis": 256 << 20, "s3": 32 << 20}  # moto moves ~0.1-0.5 GiB/s
BATCH_BYTES = 64 << 20
_GIB = float(1 << 30)


def _payloads(n: int, block: int) -> list[memoryview]:
    rng = np.random.default_rng(block)
    return [memoryview(rng.integers(0, 256, block, dtype=np.uint8).tobytes()) for _ in range(n)]


@contextlib.contextmanager
def _store(name: str) -> Iterator[tuple[Callable[[Any], Any], int]]:
    """``(make(seal) -> backend, threads its batches use)`` over one store of backend ``name``."""
    made: list[Any] = []
    try:
        if name == "disk":
            from kvtier.backends.local_disk import LocalDiskBackend

            with tempfile.TemporaryDirectory(prefix="kvtier-bench-sec-") as d:
                def make_disk(seal: Any) -> Any:
                    b = LocalDiskBackend({"path": d, "capacity": 1 << 40})
                    b.secure(seal)
                    made.append(b)
                    return b
                yield make_disk, int(LocalDiskBackend.Options.model_fields["threads"].default)
        elif name == "redis":
            from kvtier.backends.redis import RedisBackend
            from kvtier.testing.redis_server import start_redis

            srv = start_redis()
            try:
                def make_redis(seal: Any) -> Any:
                    b = RedisBackend({"url": srv.url, "eviction_events": "off"})
                    b.secure(seal)
                    made.append(b)
                    return b
                yield make_redis, int(RedisBackend.Options.model_fields["stripes"].default)
            finally:
                srv.stop()
                srv.cleanup()
        elif name == "s3":
            from kvtier.backends.s3 import S3Backend
            from kvtier.testing.moto_server import dummy_credentials

            from .backend_s3 import ChildMoto

            with dummy_credentials(), ChildMoto() as url:
                bucket = f"kvtier-bench-sec-{os.getpid()}"

                def make_s3(seal: Any) -> Any:
                    b = S3Backend({"bucket": bucket, "endpoint_url": url, "create_bucket": True})
                    b.secure(seal)
                    made.append(b)
                    return b
                yield make_s3, int(S3Backend.Options.model_fields["max_workers"].default)
        else:
            raise ValueError(f"no security bench for backend {name!r}")
    finally:
        for b in made:
            with contextlib.suppress(Exception):
                b.close()


def _primitive(mode: str, op: str, payloads: list[memoryview], threads: int) -> Callable[[], None]:
    """The raw primitive of ``mode`` / ``op`` over ``payloads`` on ``threads`` threads (a block each)."""
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM

    key = os.urandom(32)
    aead = AESGCM(key)
    nonce, aad = os.urandom(12), os.urandom(88)
    if mode == "authenticate":
        def one(i: int) -> None:
            aead.encrypt(nonce, aad, payloads[i])
    elif op == "put":
        outs = [bytearray(p.nbytes + 16) for p in payloads]

        def one(i: int) -> None:
            aead.encrypt_into(nonce, payloads[i], aad, outs[i])
    else:
        # The fastest way to run it: one call, the key object reused, ciphertext || tag into a buffer.
        sealed = [aead.encrypt(nonce, p, aad) for p in payloads]
        plain = [bytearray(p.nbytes) for p in payloads]

        def one(i: int) -> None:
            aead.decrypt_into(nonce, sealed[i], aad, plain[i])
    pool = ThreadPoolExecutor(threads) if threads > 1 else None

    def run() -> None:
        if pool is None:
            for i in range(len(payloads)):
                one(i)
        else:
            list(pool.map(one, range(len(payloads))))
    return run


class BareReads:
    """The bare ceiling of a sealed local_disk get (module docstring): ``payloads`` sealed by the primitive
    into files of the backend's value size under ``root`` (two-level, like the backend's shards), read back
    by ``pool``'s ``threads`` workers, each a strided share of a batch, as the backend splits one."""

    def __init__(self, root: str, mode: str, payloads: list[memoryview], pool: ThreadPoolExecutor, threads: int):
        import threading

        from cryptography.hazmat.primitives.ciphers.aead import AESGCM

        from kvtier.format import blockformat as bf

        self.mode, self.pool, self.threads = mode, pool, threads
        self.aead, self.aad = AESGCM(os.urandom(32)), os.urandom(bf.SEALED_AAD_SIZE)
        self.hsize, self.tag_at = bf.SEALED_HEADER_SIZE, bf.SEALED_AAD_SIZE
        self.nonces = [os.urandom(12) for _ in payloads]
        self.paths = [os.path.join(root, f"{i % 256:02x}", str(i)) for i in range(len(payloads))]
        for d in {os.path.dirname(p) for p in self.paths}:
            os.makedirs(d, exist_ok=True)
        for p, nonce, payload in zip(self.paths, self.nonces, payloads):
            if mode == "encrypt":
                sealed = self.aead.encrypt(nonce, payload, self.aad)
                body, tag = sealed[:-bf.TAG_SIZE], sealed[-bf.TAG_SIZE:]
            else:
                body, tag = bytes(payload), self.aead.encrypt(nonce, self.aad, payload)[-bf.TAG_SIZE:]
            header = bytearray(self.hsize)
            header[self.tag_at:self.tag_at + bf.TAG_SIZE] = tag
            with open(p, "wb") as f:
                f.write(header + body)
        self._local = threading.local()

    def _buffers(self, nbytes: int) -> tuple[memoryview, memoryview]:
        """This thread's header buffer and landing buffer (payload + tag), as ``Seal.landing`` keeps one."""
        got: tuple[memoryview, memoryview] | None = getattr(self._local, "bufs", None)
        if got is None or got[1].nbytes != nbytes + 16:
            got = self._local.bufs = (memoryview(bytearray(self.hsize)), memoryview(bytearray(nbytes + 16)))
        return got

    def get(self, lo: int, hi: int, bufs: list[memoryview], check: bool) -> None:
        """Read blocks ``lo:hi`` into ``bufs`` (mode encrypt: the ciphertext into the landing buffer, then,
        with ``check``, decrypted from there into ``bufs``; authenticate: the payload into ``bufs``, then,
        with ``check``, its GMAC compared with the stored tag); raises if a tag does not verify."""
        paths, nonces, aead, aad, encrypt, at = self.paths, self.nonces, self.aead, self.aad, \
            self.mode == "encrypt", self.tag_at

        def share(j: int) -> None:
            for i in range(lo + j, hi, self.threads):
                out = bufs[i]
                header, landing = self._buffers(out.nbytes)
                n = out.nbytes
                fd = os.open(paths[i], os.O_RDONLY)
                try:
                    os.preadv(fd, [header, landing[:n] if encrypt else out], 0)
                finally:
                    os.close(fd)
                if not check:
                    continue
                if encrypt:
                    landing[n:] = header[at:at + 16]
                    aead.decrypt_into(nonces[i], landing, aad, out)  # raises InvalidTag if it does not verify
                elif not hmac.compare_digest(aead.encrypt(nonces[i], aad, out)[-16:], header[at:at + 16]):
                    raise RuntimeError(f"bare {self.mode} read: block {i}'s tag does not verify")

        list(self.pool.map(share, range(self.threads)))


def _drain(pool: ThreadPoolExecutor, fn: Callable[[memoryview], object], items: list[memoryview]) -> None:
    list(pool.map(fn, items))  # map only submits: the time is until the last result


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def mode_rows(name: str, block: int, total_bytes: int, repeats: int, modes: list[str]) -> list[dict[str, Any]]:
    from kvtier.keys import Namespace
    from kvtier.security import KeyRing, Seal

    ns = Namespace(f"bench/security/{name}", "bfloat16", 32, 8, 128, 16)
    n = max(1, min(total_bytes, MAX_TOTAL.get(name, total_bytes)) // block)
    per = max(1, min(n, BATCH_BYTES // block))
    payloads = _payloads(n, block)
    bufs = [memoryview(bytearray(block)) for _ in range(n)]
    gib = n * block / _GIB
    ring = KeyRing({1: os.urandom(32)}, 1)
    all_modes = ["none", *modes]
    with _store(name) as (make, threads), tempfile.TemporaryDirectory(prefix="kvtier-bench-bare-") as bare_dir, \
            ThreadPoolExecutor(threads) as bare_pool:
        backends = {m: make(None if m == "none" else Seal(m, ring)) for m in all_modes}
        # local_disk: the bare ceiling of a sealed get (module docstring), one file set per mode.
        bare = {m: BareReads(os.path.join(bare_dir, m), m, payloads, bare_pool, threads)
                for m in modes} if name == "disk" else {}
        keys = {m: ns.keys([os.urandom(16) for _ in range(n)]) for m in all_modes}
        spans = [(i, min(n, i + per)) for i in range(0, n, per)]

        def put(m: str) -> None:
            for lo, hi in spans:
                if not all(backends[m].put(keys[m][lo:hi], payloads[lo:hi], ns.layout_id)):
                    raise RuntimeError(f"{name} {m}: a put was refused")

        def get(m: str) -> None:
            for lo, hi in spans:
                if not all(backends[m].get_into(keys[m][lo:hi], bufs[lo:hi], ns.layout_id)):
                    raise RuntimeError(f"{name} {m}: a get missed")

        prims = {(m, op): _primitive(m, op, payloads, threads) for m in modes for op in ("put", "get")}

        def bare_get(m: str, check: bool) -> None:
            for lo, hi in spans:
                bare[m].get(lo, hi, bufs, check)

        times: dict[tuple[str, str], list[float]] = {(c, op): [] for c in [*all_modes, *(f"raw {m}" for m in modes)]
                                                     for op in ("put", "get")}
        for m in bare:
            times[f"bare read {m}", "get"], times[f"bare {m}", "get"] = [], []
        for r in range(repeats + 1):  # the first round warms up and is dropped
            order = all_modes[r % len(all_modes):] + all_modes[:r % len(all_modes)]
            for m in order:
                times[m, "put"].append(_timed(functools.partial(put, m)))
                times[m, "get"].append(_timed(functools.partial(get, m)))
                for i in range(0, n, max(1, n // 8)):
                    if bufs[i] != payloads[i]:
                        raise RuntimeError(f"{name} {m}: wrong bytes for block {i}")
                    bufs[i][:8] = b"\0" * 8
                if m != "none":
                    for op in ("put", "get"):
                        times[f"raw {m}", op].append(_timed(prims[m, op]))
                if m in bare:  # right after the mode's own gets, in its turn of the rotation
                    times[f"bare read {m}", "get"].append(_timed(functools.partial(bare_get, m, False)))
                    times[f"bare {m}", "get"].append(_timed(functools.partial(bare_get, m, True)))
                    for i in range(0, n, max(1, n // 8)):  # the bare contender returned the block's bytes
                        if bufs[i] != payloads[i]:
                            raise RuntimeError(f"bare {m} read: wrong bytes for block {i}")
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    spread = {k: (min(v[1:]), max(v[1:])) for k, v in times.items()}
    rows = []
    for m in modes:
        for op in ("put", "get"):
            lo, hi = spread[m, op]
            extra: dict[str, Any] = {}
            if op == "get" and m in bare:
                blo, bhi = spread[f"bare {m}", "get"]
                extra = {"bare_read_gib_s": gib / med[f"bare read {m}", "get"],
                         "bare_ceiling_gib_s": gib / med[f"bare {m}", "get"],
                         "ratio_vs_bare": med[f"bare {m}", "get"] / med[m, "get"],
                         "bare_spread": f"{gib / bhi:.2f}-{gib / blo:.2f}"}
            rows.append({"backend": f"{name} {m}", "op": op, "block_bytes": block, "gib_s": gib / med[m, op],
                         "ceiling_gib_s": gib / med["none", op], "ratio": med["none", op] / med[m, op],
                         "primitive_gib_s": gib / med[f"raw {m}", op],
                         "ratio_vs_primitive": med[f"raw {m}", op] / med[m, op],
                         "note": f"ceiling: mode none, same run; {m} {op} spread {gib / hi:.2f}-{gib / lo:.2f} "
                                 f"GiB/s; primitive on {threads} thread(s); {n} blocks"
                                 + ("; bare: open/preadv/close + the primitive, same threads, no kvtier" if extra
                                    else ""), **extra})
    return rows


def _candidates() -> dict[str, Callable[[memoryview], object]]:
    from cryptography.hazmat.primitives import poly1305
    from cryptography.hazmat.primitives.ciphers.aead import AESGCM, ChaCha20Poly1305

    key, nonce, aad = os.urandom(32), os.urandom(12), os.urandom(88)
    gcm, chacha = AESGCM(key), ChaCha20Poly1305(key)
    out: dict[str, Callable[[memoryview], object]] = {
        "BLAKE2b keyed": lambda p: hashlib.blake2b(p, key=key).digest(),
        "HMAC-SHA256": lambda p: hmac.digest(key, p, "sha256"),
        "Poly1305 (one-time key)": lambda p: poly1305.Poly1305.generate_tag(key, p),
        "AES-GMAC (authenticate)": lambda p: gcm.encrypt(nonce, aad, p),
        "AES-256-GCM (encrypt)": lambda p: gcm.encrypt(nonce, p, aad),
        "ChaCha20-Poly1305": lambda p: chacha.encrypt(nonce, p, aad),
    }
    try:
        blake3 = importlib.import_module("blake3")  # optional: only timed where installed

        out["BLAKE3 keyed"] = lambda p: blake3.blake3(p, key=key).digest()
    except ImportError:
        pass
    return out


def primitive_rows(block: int, total_bytes: int, repeats: int) -> list[dict[str, Any]]:
    n = max(1, min(total_bytes, 128 << 20) // block)
    payloads = _payloads(n, block)
    gib = n * block / _GIB
    rows = []
    for name, fn in _candidates().items():
        for threads in (1, 2):
            with ThreadPoolExecutor(threads) as pool:
                ts = [_timed(functools.partial(_drain, pool, fn, payloads)) for _ in range(repeats + 1)][1:]
            rows.append({"backend": "primitive", "op": f"{name}, {threads} thread{'s' if threads > 1 else ''}",
                         "block_bytes": block, "gib_s": gib / statistics.median(ts), "ceiling_gib_s": None,
                         "ratio": None, "note": f"spread {gib / max(ts):.2f}-{gib / min(ts):.2f} GiB/s"})
    return rows


def run_cases(backends: list[str], modes: list[str], block_sizes: list[int], total_bytes: int,
              repeats: int, skipped: dict[str, str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for block in block_sizes:
        rows += primitive_rows(block, total_bytes, repeats)
    for name in backends:
        try:
            for block in block_sizes:
                rows += mode_rows(name, block, total_bytes, repeats, modes)
        except Exception as e:  # noqa: BLE001 - one backend's set-up failure must not stop the others
            skipped[f"{name} security"] = f"{type(e).__name__}: {e}"
            print(f"SKIP {name} security: {skipped[f'{name} security']}")
    return rows
