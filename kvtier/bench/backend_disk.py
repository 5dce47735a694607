"""``local_disk`` put / get throughput beside the raw file ceiling, on the same payloads, same filesystem.

Three contenders move the same blocks with the same number of threads as the backend:

* ``raw`` (the ceiling): each thread writes its share of a batch as one file per block (``open`` /
  ``write`` / ``close``) and reads them back with ``readinto`` into the same preallocated buffers;
* ``xxh3``: the same, plus xxh3-64 of each payload in the same thread: the floor for any store that
  checksums what it writes and verifies what it reads, as the block format requires;
* the backend: framing, checksum, temp file + rename, verification of every header field and the
  checksum, LRU index.

Page cache only (the backend offers no O_DIRECT mode).  Before every put round all files are deleted
(untimed), so every contender creates fresh files.  Contenders take turns batch by batch in a rotating
order, so writeback, neighbours' load and drift hit all of them alike.  ``KVTIER_BENCH_DIR`` picks the
filesystem (default: the system temp directory).
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from concurrent.futures import ThreadPoolExecutor

import numpy as np
import xxhash

STARTUP_BLOCKS = 100_000  # start-up (index rebuild) is measured with this many blocks on disk
BATCH_BYTES = 64 << 20  # bytes per put/get_into call (32 x 2 MiB, 256 x 256 KiB): a long prompt's worth
THREADS = 4  # = LocalDiskBackend.Options().threads, the default a deployment gets


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
    mv = memoryview(raw)
    return raw, [mv[i * block : (i + 1) * block] for i in range(n)]


def _ceiling_put(pool: ThreadPoolExecutor, paths: list[str], payloads: list[memoryview],
                 checksum: bool = False) -> None:
    def work(j: int) -> None:
        for i in range(j, len(paths), THREADS):
            if checksum:
                xxhash.xxh3_64_intdigest(payloads[i])
            fd = os.open(paths[i], os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o644)
            try:
                os.write(fd, payloads[i])
            finally:
                os.close(fd)

    list(pool.map(work, range(THREADS)))


def _ceiling_get(pool: ThreadPoolExecutor, paths: list[str], bufs: list[memoryview],
                 checksum: bool = False) -> None:
    def work(j: int) -> None:
        for i in range(j, len(paths), THREADS):
            with open(paths[i], "rb", buffering=0) as f:
                f.readinto(bufs[i])
            if checksum:
                xxhash.xxh3_64_intdigest(bufs[i])

    list(pool.map(work, range(THREADS)))


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def run_cases(block_sizes: list[int], total_bytes: int, repeats: int) -> list[dict]:
    root = tempfile.mkdtemp(prefix="kvtier-bench-disk-", dir=os.environ.get("KVTIER_BENCH_DIR"))
    try:
        rows = [row for block in block_sizes for row in _case(root, block, total_bytes, repeats)]
        if rows and STARTUP_BLOCKS:
            rows[-1][f"startup_{STARTUP_BLOCKS // 1000}k_blocks_s"] = startup_seconds(root, STARTUP_BLOCKS)
        return rows
    finally:
        shutil.rmtree(root, ignore_errors=True)


def startup_seconds(root: str, blocks: int) -> float:
    """Seconds a new LocalDiskBackend takes to index ``blocks`` files (page cache warm, median of 3).

    The files are small: start-up reads directory entries and inodes, never block contents."""
    from kvtier.backends.local_disk import LocalDiskBackend
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
    return statistics.median(times)


def _case(root: str, block: int, total_bytes: int, repeats: int) -> list[dict]:
    from kvtier.backends.local_disk import LocalDiskBackend
    from kvtier.keys import Namespace

    ns = Namespace("bench/disk", "bfloat16", 32, 8, 128, 16)
    n = max(1, total_bytes // block)
    _, payloads = random_payloads(n * block, block)
    bufs = [memoryview(bytearray(block)) for _ in range(n)]
    gib = n * block / 2**30
    keys = ns.keys([os.urandom(16) for _ in range(n)])
    backend = LocalDiskBackend({"path": os.path.join(root, f"backend-{block}"),
                                "capacity": 2 * n * (block + 4096), "threads": THREADS})
    dirs = {c: os.path.join(root, f"{c}-{block}") for c in ("raw", "xxh3")}
    paths = {c: [os.path.join(d, f"{i:08d}") for i in range(n)] for c, d in dirs.items()}
    for d in dirs.values():
        os.makedirs(d)
    per = max(1, BATCH_BYTES // block)
    batches = [slice(i, i + per) for i in range(0, n, per)]
    lid = ns.layout_id

    def contenders(op: str, pool: ThreadPoolExecutor, sl: slice) -> dict:
        if op == "put":
            def b() -> None:
                if not all(backend.put(keys[sl], payloads[sl], lid)):
                    raise RuntimeError("local_disk refused a put")
            return {"backend": b,
                    "raw": lambda: _ceiling_put(pool, paths["raw"][sl], payloads[sl]),
                    "xxh3": lambda: _ceiling_put(pool, paths["xxh3"][sl], payloads[sl], True)}

        def g() -> None:
            if not all(backend.get_into(keys[sl], bufs[sl], lid)):
                raise RuntimeError("local_disk missed a block it stored")
        return {"backend": g,
                "raw": lambda: _ceiling_get(pool, paths["raw"][sl], bufs[sl]),
                "xxh3": lambda: _ceiling_get(pool, paths["xxh3"][sl], bufs[sl], True)}

    # times[op][contender][batch] = one time per repeat.  Contenders take turns batch by batch, in a
    # rotating order, so writeback stalls, neighbours' load and drift fall on all of them alike; a
    # contender's time is the sum over batches of its median per batch, robust to a stall in one round.
    times = {op: {c: [[] for _ in batches] for c in ("backend", "raw", "xxh3")} for op in ("put", "get")}
    with ThreadPoolExecutor(THREADS) as pool:
        for rep in range(repeats + 1):  # round 0 warms up and is dropped
            for ps in paths.values():
                for p in ps:
                    if os.path.exists(p):
                        os.unlink(p)
            backend.delete(keys)
            for op in ("put", "get"):
                for j, sl in enumerate(batches):
                    fns = list(contenders(op, pool, sl).items())
                    r = (j + rep) % len(fns)
                    for name, fn in fns[r:] + fns[:r]:
                        t = _timed(fn)
                        if rep:
                            times[op][name][j].append(t)
    for i in range(0, n, max(1, n // 16)):  # the bytes read back are the bytes written
        backend.get_into([keys[i]], [bufs[i]], lid)
        if bufs[i] != payloads[i]:
            raise RuntimeError(f"local_disk returned wrong bytes for block {i}")
    backend.close()
    for d in (*dirs.values(), backend.root):
        shutil.rmtree(d, ignore_errors=True)
    note = f"{THREADS} threads, {per}-block batches, page cache"
    rows = []
    for op, t in times.items():
        med = {c: sum(statistics.median(b) for b in per_batch) for c, per_batch in t.items()}
        rows.append({"backend": "disk", "op": op, "block_bytes": block, "gib_s": gib / med["backend"],
                     "ceiling_gib_s": gib / med["raw"], "ratio": med["raw"] / med["backend"],
                     "ceiling_xxh3_gib_s": gib / med["xxh3"], "ratio_vs_ceiling_xxh3":
                     med["xxh3"] / med["backend"], "note": note})
    return rows
