"""``kvtier bench disk-scale``: ``local_disk`` over directories of 100 thousand to 5 million small blocks.

Builds (or reuses) one directory per size under ``--dir`` (default ``$KVTIER_BENCH_DIR`` or the system
temp directory): ``<dir>/disk-scale-<n>``, ``n`` valid stored blocks of ``--payload`` bytes, written raw
(header + payload, the backend's file layout) and marked built with a ``.disk-scale-built`` file; the
first open of a fresh directory finds no index and rebuilds it from the files (the one full scan; its time
is printed as ``index rebuild``).  Then, per size, each row beside the ceiling of the same run:

* ``open warm`` / ``open cold``: constructing the backend, page cache warm, and after dropping every file
  of the index from the page cache (``posix_fadvise(DONTNEED)``); ceiling: a bare ``os.scandir`` walk of
  the directory (every shard listed, no stat), warm.
* ``rss per block``: resident memory a fresh process adds by opening the backend and answering one batch
  lookup, divided by the blocks in the directory, for a first and a second process open at once (the
  index is one file shared through the page cache, so neither holds a copy).
* ``lookup 1000``: ``LocalDiskBackend.lookup`` of a batch of 1,000 keys (half stored, half not) in the
  index, ``first``: keys no lookup asked about before (a fresh batch each run: the SQLite query), and
  ``again``: the same batch once more, the index unchanged (answered from the process's memory, which a
  change by any connection clears); ceilings: the bare search of the lookup snapshot (``_disk_snapshot``:
  a sorted key file every process maps) for another fresh batch, the bare SQLite ``IN (...)`` query of
  another on a connection of its own (the least SQLite can do), a bare LMDB probe per key of another in a
  copy of the keys (the previous design's structure; when ``lmdb`` is installed), and the keys in a
  Python ``set`` (up to 1 M).
  ``--index-only``: just these rows, over an index of ``n`` rows filled directly (no block files: the
  lookup reads only the index), for sizes whose directory is not built.
* ``exists 1000``: ``exists`` of the same batch (asks the filesystem); ceiling: one ``os.lstat`` per key.
* ``put`` / ``get``: throughput of new blocks into the big directory, batches of 256, beside raw
  ``open``/``write``/``close`` and ``open``/``readv``/``close`` of the same number of files.

Timings are medians over ``--repeat`` runs, with their spread (min-max).  The machine may be shared:
ceilings run interleaved with the backend in the same run, so load hits both.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import resource
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import xxhash

from kvtier.format import blockformat
from kvtier.keys import Namespace

from ..args import out_file
from ..output import print_table, write_json

HELP = "local_disk over 100k-5M small blocks: open time, RSS per block, lookup/exists, put/get vs ceilings"
SIZES = (100_000, 1_000_000, 5_000_000)
BUILT = ".disk-scale-built"
NS = Namespace("disk-scale", "bfloat16", 1, 1, 8, 4)
BATCH = 1000
_WFLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC


def block_hash(i: int) -> bytes:
    """The i-th block's hash: 16 bytes spread over the 256 shards."""
    return xxhash.xxh3_128_digest(i.to_bytes(8, "little"))


def payload(i: int, size: int) -> bytes:
    return (i.to_bytes(8, "little") * (size // 8 + 1))[:size]


def build(root: str, n: int, size: int, threads: int = 4, log: Callable[[str], None] = print) -> float:
    """Write ``n`` valid stored blocks under ``root`` (the backend's layout, no index); seconds taken.
    Reused when already built with the same ``n`` and ``size``."""
    mark = f"{root}/{BUILT}"
    with contextlib.suppress(OSError, ValueError), open(mark) as f:
        if json.load(f) == {"n": n, "payload": size}:
            return 0.0
    t0 = time.perf_counter()
    base = f"{root}/{NS.id}"
    for s in range(256):
        os.makedirs(f"{base}/{s:02x}", exist_ok=True)
    digest, lid = NS.digest, NS.layout_id

    def part(lo: int, hi: int) -> None:
        for i in range(lo, hi):
            h = block_hash(i)
            p = payload(i, size)
            name = h.hex()
            try:
                fd = os.open(f"{base}/{name[:2]}/{name}", _WFLAGS, 0o666)
            except FileExistsError:
                continue  # an interrupted build, resumed
            try:
                os.write(fd, blockformat.encode_header(digest, h, lid, p) + p)
            finally:
                os.close(fd)

    step = 50_000
    with ThreadPoolExecutor(threads) as pool:
        futures = [pool.submit(part, lo, min(n, lo + step)) for lo in range(0, n, step)]
        for j, fut in enumerate(futures):
            fut.result()
            if j % 20 == 19:
                log(f"  built {min(n, (j + 1) * step):,} of {n:,} blocks ({time.perf_counter() - t0:.0f} s)")
    with open(mark, "w") as f:
        json.dump({"n": n, "payload": size}, f)
    return time.perf_counter() - t0


def _median(xs: Sequence[float]) -> tuple[float, float, float]:
    return statistics.median(xs), min(xs), max(xs)


def _key(i: int) -> str:
    return NS.key(block_hash(i))


def _path(root: str, key: str) -> str:
    h = key[33:]
    return f"{root}/{key[:32]}/{h[:2]}/{h}"


def _drop_cache(paths: Sequence[str]) -> None:
    """Drop files from the page cache (``posix_fadvise(DONTNEED)``; dirty pages are written first)."""
    for p in paths:
        with contextlib.suppress(OSError):
            fd = os.open(p, os.O_RDONLY)
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
            finally:
                os.close(fd)


def _walk(root: str) -> int:
    """The raw ceiling of a listing: a bare ``os.scandir`` of every shard, no stat."""
    n = 0
    for ns in os.scandir(root):
        if ns.is_dir() and not ns.name.startswith("."):
            for shard in os.scandir(ns.path):
                if shard.is_dir():
                    with os.scandir(shard.path) as it:
                        n += sum(1 for _ in it)
    return n


_RSS_CHILD = """
import os, sys, time
def rss():
    with open("/proc/self/statm") as f:
        resident, shared = (int(x) for x in f.read().split()[1:3])
    return resident * os.sysconf("SC_PAGE_SIZE"), (resident - shared) * os.sysconf("SC_PAGE_SIZE")
from kvtier.backends.local_disk import LocalDiskBackend
from kvtier.tools.bench import disk_scale as d
keys = [d._key(i) for i in range(0, 2 * {n}, 2 * {n} // 1000)][:1000]
before = rss()
b = LocalDiskBackend({{"path": {root!r}, "index_dir": {index_dir!r}, "capacity": "1TiB"}})
b.lookup(keys)
after = rss()
print(after[0] - before[0], after[1] - before[1], flush=True)
sys.stdin.readline()
b.close()
"""


def rss_per_block(root: str, index_dir: str, n: int) -> tuple[tuple[int, int], tuple[int, int]]:
    """Resident bytes a first and a second process (both open at once) add by opening the directory and
    answering one lookup of 1,000 keys: (all, its own: not file pages shared with other processes)."""
    code = _RSS_CHILD.format(n=n, root=root, index_dir=index_dir)
    procs = []
    out = []
    try:
        for _ in range(2):
            p = subprocess.Popen([sys.executable, "-c", code], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                                 text=True)
            procs.append(p)
            assert p.stdout is not None
            total, own = (int(x) for x in p.stdout.readline().split())
            out.append((total, own))
    finally:
        for p in procs:
            with contextlib.suppress(Exception):
                p.communicate("\n", timeout=60)
    return out[0], out[1]


def _raw_put(base: str, keys: Sequence[str], data: Sequence[bytes], threads: int) -> None:
    def one(j: int) -> None:
        fd = os.open(_path(base, keys[j]), _WFLAGS, 0o666)
        try:
            os.write(fd, data[j])
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(keys)), chunksize=256))


def _raw_get(base: str, keys: Sequence[str], bufs: Sequence[memoryview], threads: int) -> None:
    def one(j: int) -> None:
        fd = os.open(_path(base, keys[j]), os.O_RDONLY | os.O_CLOEXEC)
        try:
            os.readv(fd, [bufs[j]])
        finally:
            os.close(fd)

    with ThreadPoolExecutor(threads) as pool:
        list(pool.map(one, range(len(keys)), chunksize=256))


def putget(root: str, index_dir: str | None, scratch: str, count: int, size: int, rounds: int,
           first: int = 10**9) -> dict[str, Any]:
    """Put then get ``count`` new blocks (batches of 256, 4 threads) into the directory at ``root``, beside
    the raw ceiling writing / reading as many files under ``scratch``; each round deletes them again
    (untimed).  Blocks per second, median and spread over ``rounds``."""
    from kvtier.backends.local_disk import LocalDiskBackend

    opts: dict[str, Any] = {"path": root, "capacity": "1TiB", "threads": 4}
    if index_dir is not None:
        opts["index_dir"] = index_dir
    b = LocalDiskBackend(opts)
    keys = [_key(first + i) for i in range(count)]
    data = [payload(first + i, size) for i in range(count)]
    framed = [blockformat.encode_header(NS.digest, bytes.fromhex(k[33:]), NS.layout_id, p) + p
              for k, p in zip(keys, data)]
    for s in range(256):
        os.makedirs(f"{scratch}/{NS.id}/{s:02x}", exist_ok=True)
    bufs = [memoryview(bytearray(size)) for _ in keys]
    rbufs = [memoryview(bytearray(len(f))) for f in framed]
    res: dict[str, list[float]] = {"put": [], "raw_put": [], "get": [], "raw_get": []}
    try:
        for _ in range(rounds):
            t0 = time.perf_counter()
            for i in range(0, count, 256):
                b.put(keys[i:i + 256], data[i:i + 256], NS.layout_id)
            res["put"].append(count / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            _raw_put(scratch, keys, framed, 4)
            res["raw_put"].append(count / (time.perf_counter() - t0))
            t0 = time.perf_counter()
            ok = 0
            for i in range(0, count, 256):
                ok += sum(1 for r in b.get_into(keys[i:i + 256], bufs[i:i + 256], NS.layout_id) if r is True)
            res["get"].append(count / (time.perf_counter() - t0))
            if ok != count:
                raise RuntimeError(f"disk-scale: {count - ok} of {count} blocks did not read back")
            t0 = time.perf_counter()
            _raw_get(scratch, keys, rbufs, 4)
            res["raw_get"].append(count / (time.perf_counter() - t0))
            for i in range(0, count, 256):  # untimed: the directory back to its size
                b.delete(keys[i:i + 256])
            for k in keys:
                os.unlink(_path(scratch, k))
    finally:
        b.close()
    return {k: _median(v) for k, v in res.items()}


def _timed(fn: Callable[[], Any], repeat: int, before: Callable[[], None] | None = None) -> tuple[float, float, float]:
    xs = []
    for _ in range(repeat):
        if before is not None:
            before()
        t0 = time.perf_counter()
        fn()
        xs.append(time.perf_counter() - t0)
    return _median(xs)


def _batch(n: int, offset: int) -> list[str]:
    """1,000 keys spread over ``2 n`` block numbers starting at ``offset``: about half stored (below n);
    batches of other offsets (below ``2 n // 1000``) share no key."""
    step = max(1, 2 * n // BATCH)
    return [_key(i + offset) for i in range(0, 2 * n, step)][:BATCH]


def _lmdb_copy(index: str, log: Callable[[str], None]) -> Any:
    """An LMDB environment holding the index's keys (``<index>.bench-lmdb``, copied when missing or of
    another count), or None without ``lmdb``."""
    import sqlite3

    try:
        import lmdb  # type: ignore[import-not-found,unused-ignore]
    except ImportError:
        return None
    c = sqlite3.connect(f"file:{index}?mode=ro", uri=True, isolation_level=None)
    try:
        n = c.execute("SELECT count(*) FROM blocks").fetchone()[0]
        env = lmdb.open(index + ".bench-lmdb", subdir=False, map_size=64 << 30, sync=False, metasync=False,
                        readahead=False, meminit=False)
        if env.stat()["entries"] != n:
            t0 = time.perf_counter()
            cur = c.execute("SELECT key FROM blocks")
            while page := cur.fetchmany(50_000):
                with env.begin(write=True) as t:
                    for (k,) in page:
                        t.put(k, b"")
            log(f"  LMDB copy of {n:,} keys made in {time.perf_counter() - t0:.1f} s")
        return env
    finally:
        c.close()


def lookup_rows(lookup: Callable[[list[str]], list[bool]], index: str, n: int, repeat: int,
                row: Callable[..., None], snapshot: Any, log: Callable[[str], None]) -> None:
    """Time ``lookup`` of fresh batches and of the same batch again, beside the bare search of the lookup
    snapshot (``snapshot``: a mapped ``_disk_snapshot.Snapshot``) and the bare SQLite query of other
    fresh batches on a connection of its own (same page cache size), the bare LMDB probe of yet other
    fresh batches in a copy of the keys, and a Python ``set``."""
    import sqlite3

    c = sqlite3.connect(f"file:{index}?mode=ro", uri=True, isolation_level=None)
    c.execute("PRAGMA cache_size=-8192")
    sql = f"SELECT key FROM blocks WHERE key IN ({','.join('?' * BATCH)})"
    runs = repeat * 10
    batches = [_batch(n, 4 * r) for r in range(runs)]
    bare_batches = [[bytes.fromhex(k[:32] + k[33:]) for k in _batch(n, 4 * r + 1)] for r in range(runs)]
    lmdb_batches = [[bytes.fromhex(k[:32] + k[33:]) for k in _batch(n, 4 * r + 2)] for r in range(runs)]
    snap_batches = [_batch(n, 4 * r + 3) for r in range(runs)]
    if snapshot is None:
        raise RuntimeError(f"disk-scale: no lookup snapshot serves the index {index}")
    env = _lmdb_copy(index, log)
    first: list[float] = []
    again: list[float] = []
    bare: list[float] = []
    bare_lmdb: list[float] = []
    bare_snap: list[float] = []
    for r in range(runs):  # interleaved: load on the machine hits all of them alike
        def mine(r: int = r) -> None:
            t0 = time.perf_counter()
            got = lookup(batches[r])
            first.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            if lookup(batches[r]) != got:
                raise RuntimeError("disk-scale: a repeated lookup answered otherwise")
            again.append(time.perf_counter() - t0)

        def bares(r: int = r) -> None:
            t0 = time.perf_counter()
            snapshot.contains([bytes.fromhex(k[:32] + k[33:]) for k in snap_batches[r]])  # (as a lookup does)
            bare_snap.append(time.perf_counter() - t0)
            t0 = time.perf_counter()
            c.execute(sql, bare_batches[r]).fetchall()
            bare.append(time.perf_counter() - t0)
            if env is not None:
                t0 = time.perf_counter()
                with env.begin(buffers=True) as t:
                    g = t.get
                    [g(b) is not None for b in lmdb_batches[r]]
                bare_lmdb.append(time.perf_counter() - t0)

        for step in ((mine, bares) if r % 2 == 0 else (bares, mine)):  # the first of a round runs slower
            step()
    c.close()
    if env is not None:
        env.close()
    ceiling = _median(bare)
    row("lookup 1,000 keys, first (index query)", _median(first), "ms", _median(bare_snap),
        "bare snapshot search (+ hex decode), fresh keys", 1000)
    row("lookup 1,000 keys, first, beside bare SQLite", _median(first), "ms", ceiling,
        "bare SQLite IN query, fresh keys", 1000)
    row("lookup 1,000 keys, again (index unchanged)", _median(again), "ms", ceiling,
        "bare SQLite IN query, fresh keys", 1000)
    if bare_lmdb:
        row("lookup 1,000 keys, first, beside bare LMDB", _median(first), "ms", _median(bare_lmdb),
            "bare LMDB get per key, fresh keys", 1000)
    if n <= 1_000_000:  # the old design's in-memory index, as a floor (5 M of them: GBs of RAM)
        hashes = {block_hash(i) for i in range(n)}
        keys = batches[0]
        row("lookup 1,000 keys: Python set (floor)", _timed(lambda: [bytes.fromhex(k[33:]) in hashes for k in keys],
                                                            runs), "ms", None, "", 1000)


def index_only(base: str, n: int, repeat: int, log: Callable[[str], None]) -> list[dict[str, Any]]:
    """The lookup rows over an index of ``n`` rows filled directly (``<base>/disk-scale-index-only``,
    reused when it has ``n`` rows)."""
    from kvtier.backends.local_disk import DiskIndex

    d = f"{base}/disk-scale-index-only"
    root = f"{d}/root-{n}"
    os.makedirs(root, exist_ok=True)
    idx = DiskIndex(f"{d}/{n}.sqlite", root)
    rows: list[dict[str, Any]] = []
    if idx.counts()[0] != n:
        t0 = time.perf_counter()
        idx.cache(1 << 20)
        with idx.transaction() as c:
            idx.reset(c, "bench disk-scale --index-only")
            for lo in range(0, n, 500_000):
                idx.adopt(c, [(_key(i), _ROW_BYTES, i) for i in range(lo, min(n, lo + 500_000))])
            idx.recount(c)
        idx.cache()
        log(f"  index of {n:,} rows filled in {time.perf_counter() - t0:.0f} s")
    if not idx.state()[1]:  # the bench's own index: no rebuild from the files to wait for
        with idx.transaction() as c:
            idx.set_meta(c, "complete", 1)
    if not idx.snapshot_serves():  # as a backend's start-up does (in a thread there)
        t0 = time.perf_counter()
        idx.build_snapshot(contextlib.nullcontext)
        log(f"  lookup snapshot of {n:,} keys built in {time.perf_counter() - t0:.1f} s "
            f"(serves: {idx.snapshot_serves()})")

    def row(what: str, value: tuple[float, float, float], unit: str, ceiling: tuple[float, float, float] | None,
            ceiling_name: str, scale: float = 1.0) -> None:
        _row(rows, log, f"{n:,} (index only)", what, value, unit, ceiling, ceiling_name, scale)

    try:
        lookup_rows(idx.lookup, idx.path, n, repeat, row, idx.serving_snapshot(), log)
    finally:
        idx.close()
    return rows


_ROW_BYTES = blockformat.HEADER_SIZE + 64  # what a row says of its block (unused by lookups)


def _row(rows: list[dict[str, Any]], log: Callable[[str], None], blocks: str, what: str,
         value: tuple[float, float, float], unit: str, ceiling: tuple[float, float, float] | None,
         ceiling_name: str, scale: float = 1.0) -> None:
    r: dict[str, Any] = {"blocks": blocks, "measure": what, "median": value[0] * scale,
                         "spread": f"{value[1] * scale:.3g}-{value[2] * scale:.3g}", "unit": unit}
    if ceiling is not None:
        r.update(ceiling=ceiling[0] * scale, ceiling_spread=f"{ceiling[1] * scale:.3g}-{ceiling[2] * scale:.3g}",
                 ratio=value[0] / ceiling[0] if ceiling[0] else float("nan"), ceiling_is=ceiling_name)
    rows.append(r)
    log("  " + "  ".join(f"{k}={v}" for k, v in r.items()))


def measure(base: str, n: int, size: int, repeat: int, log: Callable[[str], None]) -> list[dict[str, Any]]:
    from kvtier.backends.local_disk import LocalDiskBackend

    root = f"{base}/disk-scale-{n}"
    index_dir = f"{base}/disk-scale-index"
    built = build(root, n, size, log=log)
    if built:
        log(f"  built {n:,} blocks in {built:.0f} s")
    opts = {"path": root, "index_dir": index_dir, "capacity": "1TiB"}
    rows: list[dict[str, Any]] = []

    def row(what: str, value: tuple[float, float, float], unit: str, ceiling: tuple[float, float, float] | None,
            ceiling_name: str, scale: float = 1.0) -> None:
        _row(rows, log, f"{n:,}", what, value, unit, ceiling, ceiling_name, scale)

    t0 = time.perf_counter()
    b = LocalDiskBackend(opts)
    first = time.perf_counter() - t0
    index = str(b.stats().extra["index"])
    blocks = int(b.stats().extra["blocks"])
    b.close()
    if blocks != n:
        raise RuntimeError(f"disk-scale: {root} indexes {blocks:,} blocks, expected {n:,}")
    row("first open (index rebuild if none)", (first, first, first), "s", None, "")
    files = [index, index + "-wal", index + "-shm", index[: -len(".sqlite")] + ".keys", f"{root}/.kvtier-usage.json"]

    def open_close() -> None:
        LocalDiskBackend(opts).close()

    walk = _timed(lambda: _walk(root), repeat)
    row("open, warm", _timed(open_close, repeat), "ms", walk, "scandir walk, warm", 1000)
    row("open, index dropped from page cache", _timed(open_close, repeat, lambda: _drop_cache(files)), "ms",
        walk, "scandir walk, warm", 1000)
    (first_rss, first_own), (second_rss, second_own) = rss_per_block(root, index_dir, n)
    rows.append({"blocks": f"{n:,}", "measure": "RSS per block, first / second process",
                 "median": f"{first_rss / n:.2f} / {second_rss / n:.2f}", "unit": "B",
                 "spread": f"{first_rss >> 10} / {second_rss >> 10} KiB in all"})
    rows.append({"blocks": f"{n:,}", "measure": "RSS per block not in shared file pages, first / second",
                 "median": f"{first_own / n:.2f} / {second_own / n:.2f}", "unit": "B",
                 "spread": f"{first_own >> 10} / {second_own >> 10} KiB in all"})
    log(f"  rss: first {first_rss} B ({first_own} its own), second {second_rss} B ({second_own} its own)")
    b = LocalDiskBackend(opts)
    try:
        keys = [_key(i) for i in range(0, 2 * n, 2 * n // 1000)][:1000]  # half stored (i < n), half not
        assert sum(b.lookup(keys)) == sum(1 for i in range(0, 2 * n, 2 * n // 1000)[:1000] if i < n)
        paths = [_path(root, k) for k in keys]

        def lstats() -> None:
            lstat = os.lstat
            for p in paths:
                # (not contextlib.suppress: its call per key cost about a third of the loop here)
                try:  # noqa: SIM105
                    lstat(p)
                except FileNotFoundError:
                    pass

        for _ in range(600):  # the lookup snapshot is built in a thread at the first start-up
            if b.index.snapshot_serves():
                break
            time.sleep(0.5)
        lookup_rows(b.lookup, index, n, repeat, row, b.index.serving_snapshot(), log)
        row("exists 1,000 keys (files)", _timed(lambda: b.exists(keys), repeat * 10), "ms",
            _timed(lstats, repeat * 10), "lstat per key", 1000)
    finally:
        b.close()
    pg = putget(root, index_dir, f"{base}/disk-scale-raw", 10_000, size, max(3, repeat // 2))
    row("put 10,000 new blocks", pg["put"], "blocks/s", pg["raw_put"], "open/write/close")
    row("get 10,000 blocks", pg["get"], "blocks/s", pg["raw_get"], "open/readv/close")
    return rows


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--dir", default=os.environ.get("KVTIER_BENCH_DIR", tempfile.gettempdir()),
                   help="where the directories are built or reused (default: $KVTIER_BENCH_DIR or the temp dir)")
    p.add_argument("--sizes", default="100000,1000000,5000000", help="blocks per directory, comma-separated")
    p.add_argument("--payload", type=int, default=64, help="payload bytes per block (default 64)")
    p.add_argument("--repeat", type=int, default=7, help="runs per timing (lookups and exists: 10x)")
    p.add_argument("--json", type=out_file, default=None, help="also write the rows here")
    p.add_argument("--index-only", action="store_true", help="only the lookup rows, over an index filled "
                   "directly with the sizes' rows (no block files)")


COLUMNS = ["blocks", "measure", "median", "spread", "unit", "ceiling", "ceiling_spread", "ratio", "ceiling_is"]


def run(args: argparse.Namespace) -> int:
    rows: list[dict[str, Any]] = []
    for n in (int(x) for x in str(args.sizes).split(",") if x):
        print(f"disk-scale: {n:,} blocks under {args.dir}", flush=True)
        log = lambda m: print(m, file=sys.stderr, flush=True)  # noqa: E731
        rows += (index_only(os.path.abspath(args.dir), n, args.repeat, log) if args.index_only
                 else measure(os.path.abspath(args.dir), n, args.payload, args.repeat, log))
    print_table(rows, COLUMNS)
    write_json(args.json, {"rows": rows, "maxrss_kib": resource.getrusage(resource.RUSAGE_SELF).ru_maxrss})
    return 0


if __name__ == "__main__":  # the build alone, for a long build in the background; "ab": put/get only
    if sys.argv[1] == "ab":
        root = sys.argv[2]
        build(root, 100_000, 64)
        print(json.dumps(putget(root, None, root + "-raw", 10_000, 64, int(sys.argv[3]))))
    else:
        build(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]) if len(sys.argv) > 3 else 64)
