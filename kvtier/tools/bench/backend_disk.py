"""``local_disk`` put / get throughput beside the raw file ceiling, on the same payloads, same filesystem.

Two modes per block size: ``page cache`` (ops ``put`` / ``get``, and ``put full``: every put into a
directory at its capacity, so each block written first evicts the least recently used one) and ``fsync +
cold`` (ops ``put fsync`` / ``get cold``: every put fsyncs its files and directories, and before each get
batch its files are dropped from the page cache with ``posix_fadvise(DONTNEED)``, untimed, so every read
comes from the disk).
Contenders move the same blocks, in the same batches, with the same number of threads as the backend:

* ``raw`` (the ceiling): the least work that moves the bytes: per block ``open`` / ``write`` [``fsync``] /
  ``close`` into the same sharded directory layout as the backend (256 shard directories: one flat
  directory serialises file creation), and ``open`` / ``readv`` into the same preallocated, page-aligned
  buffers / ``close`` (no file object, no ``fstat``).  For cold gets it is the best of two strategies,
  buffered reads and ``O_DIRECT`` (which reads a cold 2 MiB file about twice as fast here); per batch the
  faster one counts, so a peer that reads with ``O_DIRECT`` cannot beat the ceiling.  For ``put full`` it
  unlinks the oldest file (a filler, then the blocks in the order they were written) before each write;
* ``raw+xxh3``: the same, plus xxh3-64 of each payload in the same thread right after its read (before
  its write): the floor for any store that checksums what it writes and verifies what it reads, as the
  block format requires;
* the backend: framing, checksum, temp file + rename, verification of every header field and the
  checksum, LRU index; for ``put full``, choosing each victim, unlinking it and accounting its bytes in
  the directory's shared ledger, under the directory's lock (``put full`` checks afterwards that exactly
  the newest blocks that fit are kept).

Rows carry ``gib_s`` (the backend), ``ceiling_gib_s`` / ``ratio`` (raw; backend / raw) and
``ceiling_xxh3_gib_s`` / ``ratio_vs_ceiling_xxh3`` (raw+xxh3; backend / raw+xxh3).  Before every put round
all files are deleted (untimed), so every contender creates fresh files.  Contenders take turns batch by
batch in a rotating order, so writeback, neighbours' load and drift hit all of them alike; a contender's
time is the sum over batches of its median per batch.  ``KVTIER_BENCH_DIR`` picks the filesystem
(default: the system temp directory).
"""

from __future__ import annotations

import contextlib
import mmap
import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np
import xxhash

from kvtier.backends.local_disk import LocalDiskBackend

STARTUP_BLOCKS = 100_000  # start-up (index rebuild) is measured with this many blocks on disk
BATCH_BYTES = 64 << 20  # bytes per put/get_into call (32 x 2 MiB, 256 x 256 KiB): a long prompt's worth
THREADS = 4  # = LocalDiskBackend.Options().threads, the default a deployment gets
MODES = (False, True)  # cold: put with fsync, get from the disk (page cache dropped before each batch)
_WFLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC
_O_DIRECT = getattr(os, "O_DIRECT", 0)


def random_payloads(total: int, block: int, seed: int = 0) -> tuple[np.ndarray, list[memoryview]]:
    """``total // block`` distinct random payloads in one buffer (never zeros: xor of random words)."""
    n = total // block
    words = np.empty((n * block + 7) // 8, dtype=np.uint64)
    base = np.frombuffer(os.urandom(min(words.nbytes, 8 << 20)), dtype=np.uint64)
    rng = np.random.default_rng(seed)
    for i in range(0, words.size, base.size):
        chunk = words[i : i + base.size]
        np.bitwise_xor(base[: chunk.size], np.uint64(rng.integers(1, 2**63)), out=chunk)
    raw = words.view(np.uint8)[: n * block]
    mv = raw.data  # memoryview(raw): numpy types ndarray as a Buffer only for Python >= 3.12
    return raw, [mv[i * block : (i + 1) * block] for i in range(n)]


class RawFiles:
    """The raw file ceiling over ``paths`` (one file per block, parent directories created here), moved by
    ``pool`` (``threads`` workers, each a strided share of a batch, as the backend splits one)."""

    def __init__(self, paths: list[str], pool: ThreadPoolExecutor, threads: int, *, fsync: bool = False):
        self.paths, self.pool, self.threads, self.fsync = paths, pool, threads, fsync
        self.dirs = sorted({os.path.dirname(p) for p in paths})
        for d in self.dirs:
            os.makedirs(d, exist_ok=True)

    def _each(self, sl: slice, fn: Callable[[int], object]) -> None:
        idx = range(len(self.paths))[sl]
        list(self.pool.map(lambda j: [fn(i) for i in idx[j :: self.threads]], range(self.threads)))

    def put(self, sl: slice, payloads: list[memoryview], checksum: bool = False,
            evict: list[str] | None = None) -> None:
        """``evict[i]``: a file to unlink before block ``i`` is written (a directory kept at its capacity)."""
        paths, fsync = self.paths, self.fsync

        def one(i: int) -> None:
            if evict is not None:
                os.unlink(evict[i])
            if checksum:
                xxhash.xxh3_64_intdigest(payloads[i])
            fd = os.open(paths[i], _WFLAGS, 0o644)
            try:
                os.write(fd, payloads[i])
                if fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)

        self._each(sl, one)
        if fsync:  # the new names are durable too (the backend fsyncs its shard directories)
            for d in {os.path.dirname(p) for p in paths[sl]}:
                fd = os.open(d, os.O_RDONLY)
                try:
                    os.fsync(fd)
                finally:
                    os.close(fd)

    def get(self, sl: slice, bufs: list[memoryview], checksum: bool = False, direct: bool = False) -> None:
        paths, flags = self.paths, os.O_RDONLY | (_O_DIRECT if direct else 0)

        def one(i: int) -> None:
            fd = os.open(paths[i], flags)
            try:
                os.readv(fd, [bufs[i]])
            finally:
                os.close(fd)
            if checksum:
                xxhash.xxh3_64_intdigest(bufs[i])

        self._each(sl, one)

    def delete(self) -> None:
        for p in self.paths:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(p)


def drop_cached(paths: list[str]) -> None:
    """Drop ``paths`` from the page cache (written back first, so every page can go)."""
    for p in paths:
        try:
            fd = os.open(p, os.O_RDONLY)
        except FileNotFoundError:
            continue
        try:
            os.fdatasync(fd)
            os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
        finally:
            os.close(fd)


def direct_io_works(path: str, block: int) -> bool:
    """Whether ``O_DIRECT`` reads of ``block``-byte files work here (the filesystem supports it, the size is
    whole pages)."""
    if not _O_DIRECT or block % 4096:
        return False
    buf = mmap.mmap(-1, block)
    try:
        fd = os.open(path, os.O_RDONLY | _O_DIRECT)
        try:
            return os.readv(fd, [buf]) == block
        finally:
            os.close(fd)
    except OSError:
        return False
    finally:
        buf.close()


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_cases(block_sizes: list[int], total_bytes: int, repeats: int) -> list[dict[str, Any]]:
    root = tempfile.mkdtemp(prefix="kvtier-bench-disk-", dir=os.environ.get("KVTIER_BENCH_DIR"))
    try:
        rows = [row for block in block_sizes for cold in MODES
                for row in _case(root, block, total_bytes, repeats, cold)]
        if rows and STARTUP_BLOCKS:
            rows[-1][f"startup_{STARTUP_BLOCKS // 1000}k_blocks_s"] = startup_seconds(root, STARTUP_BLOCKS)
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)


def startup_seconds(root: str, blocks: int) -> float:
    """Seconds a new LocalDiskBackend takes to index ``blocks`` files (page cache warm, median of 3).

    The files are small: start-up reads directory entries and inodes, never block contents."""
    from kvtier.keys import Namespace

    ns = Namespace("bench/disk-startup", "bfloat16", 32, 8, 128, 16)
    path = os.path.join(root, "startup")
    b = LocalDiskBackend({"path": path, "capacity": 2**40})
    for i in range(0, blocks, 1000):
        n = min(1000, blocks - i)
        if not all(b.put(ns.keys([os.urandom(16) for _ in range(n)]), [os.urandom(64)] * n, ns.layout_id)):
            raise RuntimeError("local_disk refused a put")
    b.close()
    times = []
    for _ in range(3):
        b = LocalDiskBackend({"path": path, "capacity": 2**40})
        if b.stats().extra["blocks"] != blocks:
            raise RuntimeError(f"start-up indexed {b.stats().extra['blocks']} of {blocks} blocks")
        times.append(b.startup_seconds)
        b.close()
    shutil.rmtree(path, ignore_errors=True)
    return float(statistics.median(times))


def _best(times: dict[str, list[list[float]]], *names: str) -> float:
    """A contender's time: the sum over batches of, per batch, the fastest of its strategies' medians."""
    batches = len(times[names[0]])
    return sum(min(statistics.median(times[c][j]) for c in names if c in times) for j in range(batches))


def _check_full(full: LocalDiskBackend, keys: list[str], filler_keys: list[str]) -> None:
    """After a round of ``put full``: the directory keeps exactly the newest blocks that fit (LRU)."""
    fill, n = len(filler_keys), len(keys)
    kept = keys[max(0, n - fill):] + filler_keys[min(n, fill):]
    gone = keys[:max(0, n - fill)] + filler_keys[:min(n, fill)]
    if not all(full.exists(kept)) or any(full.exists(gone)):
        raise RuntimeError(f"local_disk at its capacity kept {sum(full.exists(keys + filler_keys))} blocks, not "
                           f"the newest {fill}")


def _case(root: str, block: int, total_bytes: int, repeats: int, cold: bool = False) -> list[dict[str, Any]]:
    from kvtier.keys import Namespace

    ns = Namespace("bench/disk", "bfloat16", 32, 8, 128, 16)
    n = max(1, total_bytes // block)
    _, payloads = random_payloads(n * block, block)
    arena = mmap.mmap(-1, n * block)  # page-aligned read buffers (O_DIRECT needs them), shared by all
    bufs = [memoryview(arena)[i * block : (i + 1) * block] for i in range(n)]
    gib = n * block / 2**30
    keys = ns.keys([os.urandom(16) for _ in range(n)])
    mode = "cold" if cold else "warm"
    backend = LocalDiskBackend({"path": os.path.join(root, f"backend-{block}-{mode}"), "fsync": cold,
                                "capacity": 2 * n * (block + 4096), "threads": THREADS})
    backend_paths = [backend._where(k, checked=True)[1] for k in keys]
    per = max(1, BATCH_BYTES // block)
    batches = [slice(i, i + per) for i in range(0, n, per)]
    lid = ns.layout_id
    # ``put full``: a directory that holds ``fill`` values, filled (untimed) with as many other blocks, so
    # that every block put evicts one: the fillers first, then the blocks in the order they were put.  At
    # least a batch, so that the raw contenders' victims were written by an earlier batch.
    fill = max(n // 2, per)
    filler_keys = ns.keys([os.urandom(16) for _ in range(fill)])
    fillers = [payloads[i % n] for i in range(fill)]
    full = None if cold else LocalDiskBackend({"path": os.path.join(root, f"backend-{block}-full"),
                                               "capacity": fill * backend.stored_size(block), "threads": THREADS})
    ops = ("put", "get") if cold else ("put", "get", "put full")
    with ThreadPoolExecutor(THREADS) as pool:
        def layout(d: str, ks: list[str]) -> list[str]:
            """The backend's own layout, <namespace>/<hash[:2]>/<hash>, for the raw contenders' files."""
            return [os.path.join(root, d, k[:32], k[33:35], k[33:]) for k in ks]

        raw = {c: RawFiles(layout(f"{c}-{block}-{mode}", keys), pool, THREADS, fsync=cold) for c in ("raw", "xxh3")}
        raw_full = {} if cold else {c: (RawFiles(layout(f"{c}-{block}-full", keys), pool, THREADS),
                                        RawFiles(layout(f"{c}-{block}-full", filler_keys), pool, THREADS)) for c in raw}
        victims = {c: fl.paths + r.paths[:max(0, n - fill)] for c, (r, fl) in raw_full.items()}
        direct = False
        if cold:
            raw["raw"].put(slice(0, 1), payloads)
            direct = direct_io_works(raw["raw"].paths[0], block)

        def contenders(op: str, sl: slice) -> dict[str, Callable[[], None]]:
            if op == "put full":
                def bf() -> None:
                    if full is None or not all(full.put(keys[sl], payloads[sl], lid)):
                        raise RuntimeError("local_disk refused a put into its full directory")
                return {"backend": bf, "raw": lambda: raw_full["raw"][0].put(sl, payloads, evict=victims["raw"]),
                        "xxh3": lambda: raw_full["xxh3"][0].put(sl, payloads, True, evict=victims["xxh3"])}
            if op == "put":
                def b() -> None:
                    if not all(backend.put(keys[sl], payloads[sl], lid)):
                        raise RuntimeError("local_disk refused a put")
                return {"backend": b, "raw": lambda: raw["raw"].put(sl, payloads),
                        "xxh3": lambda: raw["xxh3"].put(sl, payloads, True)}

            def g() -> None:
                if not all(backend.get_into(keys[sl], bufs[sl], lid)):
                    raise RuntimeError("local_disk missed a block it stored")
            fns = {"backend": g, "raw": lambda: raw["raw"].get(sl, bufs),
                   "xxh3": lambda: raw["xxh3"].get(sl, bufs, True)}
            if direct:
                fns["raw O_DIRECT"] = lambda: raw["raw"].get(sl, bufs, direct=True)
                fns["xxh3 O_DIRECT"] = lambda: raw["xxh3"].get(sl, bufs, True, direct=True)
            return fns

        def files(name: str, sl: slice) -> list[str]:
            return backend_paths[sl] if name == "backend" else raw[name.split()[0]].paths[sl]

        # times[op][contender][batch] = one time per repeat.  Contenders take turns batch by batch, in a
        # rotating order, so writeback stalls, neighbours' load and drift fall on all of them alike; a
        # contender's time is the sum over batches of its median per batch, robust to a stall in one round.
        times: dict[str, dict[str, list[list[float]]]] = {op: {} for op in ops}
        for rep in range(repeats + 1):  # round 0 warms up and is dropped
            for r in raw.values():
                r.delete()
            backend.delete(keys)
            if full is not None:  # fill the full directories again
                full.delete(keys + filler_keys)
                if not all(full.put(filler_keys, fillers, lid)):
                    raise RuntimeError("local_disk refused a filler block")
                for r, fl in raw_full.values():
                    r.delete()
                    fl.delete()
                    fl.put(slice(None), fillers)
            for op in ops:
                for j, sl in enumerate(batches):
                    fns = list(contenders(op, sl).items())
                    rot = (j + rep) % len(fns)
                    for name, fn in fns[rot:] + fns[:rot]:
                        if cold and op == "get":
                            drop_cached(files(name, sl))
                        t = _timed(fn)
                        if rep:
                            times[op].setdefault(name, [[] for _ in batches])[j].append(t)
            for i in range(0, n, max(1, n // 16)):  # the bytes read back are the bytes written
                if not backend.get_into([keys[i]], [bufs[i]], lid) or bufs[i] != payloads[i]:
                    raise RuntimeError(f"local_disk returned wrong bytes for block {i}")
            if full is not None:
                _check_full(full, keys, filler_keys)
    backend.close()
    dirs = [os.path.join(root, f"{c}-{block}-{m}") for c in raw for m in (mode, "full")] + [backend.root]
    if full is not None:
        full.close()
        dirs.append(full.root)
    for d in dirs:
        shutil.rmtree(d, ignore_errors=True)
    rows = []
    for op, op_times in times.items():
        med = {"backend": _best(op_times, "backend"), "raw": _best(op_times, "raw", "raw O_DIRECT"),
               "xxh3": _best(op_times, "xxh3", "xxh3 O_DIRECT")}
        how = "open/readv/close" if op == "get" else "open/write/close"
        if op == "get" and direct:
            how += ", best of buffered and O_DIRECT per batch"
        if op == "put full":
            how = "unlink the oldest, open/write/close"
        note = (f"{THREADS} threads, {per}-block batches, "
                + ("fsync; cold: page cache dropped before each get batch" if cold else "page cache")
                + (f"; a directory at its capacity ({fill} blocks): every put evicts one" if op == "put full" else "")
                + f"; raw: {how}")
        rows.append({"backend": "disk", "op": op if not cold else ("put fsync" if op == "put" else "get cold"),
                     "block_bytes": block, "gib_s": gib / med["backend"],
                     "ceiling_gib_s": gib / med["raw"], "ratio": med["raw"] / med["backend"],
                     "ceiling_xxh3_gib_s": gib / med["xxh3"], "ratio_vs_ceiling_xxh3":
                     med["xxh3"] / med["backend"], "note": note})
    return rows
