"""``kvtier bench peers``: kvtier's backends beside LMCache's own storage backends, same payloads, same run.

LMCache (``lmcache==0.5.6``, installed next to kvtier, never a dependency of it) is driven only through
its public constructors and methods: ``LMCacheEngineConfig.from_defaults``, ``LMCacheMetadata``,
``LocalCPUBackend`` (its allocator: every LMCache get lands in a ``MemoryObj`` from it),
``RemoteBackend`` (``resp://``: its native C++ client, 8 worker threads; ``redis://``: redis-py asyncio;
``s3://``: awscrt, when it runs against the moto server) and ``LocalDiskBackend``.  Each store is one
call per batch on both sides, waited for: kvtier's ``put`` / ``get_into``; LMCache's
``batched_submit_put_task`` until its per-key completion callbacks fired and ``batched_get_blocking``.

Rows (per block size, 2 MiB and 256 KiB by default):

* ``redis``: kvtier's ``redis`` backend (checksummed framing, verification of every field on read) vs
  LMCache's ``resp://`` and ``redis://`` (no checksums), beside the raw wire ceiling of
  ``bench backends`` (``backend_redis.Wire``); one ``redis-server``, flushed before each contender.
* ``disk`` (page cache): ``local_disk`` vs ``LocalDiskBackend`` (plain buffered files), beside a raw
  loop (4 threads: open / write / close, ``readinto``).
* ``disk-cold`` (durable, cold reads): ``local_disk`` with ``fsync`` vs ``LocalDiskBackend`` with
  ``use_odirect`` (its only durable mode: it never fsyncs), raw loop with fsync; before every get the
  contender's files are dropped from the page cache (``posix_fadvise(DONTNEED)``) and everything written
  is synced (``os.sync``), so no get competes with a put's writeback.
* ``s3`` (when LMCache's S3 connector runs against moto here; otherwise a SKIP line says why).

Every contender of a row runs in every round, in a rotating order (put, then get, then the next one), so
drift and neighbours' load hit all alike; round 0 is a warm-up; figures are medians.  ``ratio`` =
kvtier / LMCache throughput (> 1: kvtier is faster), ``ratio_spread`` the lowest and highest of the
rounds' own ratios; ``vs_ceiling`` = each one / the raw loop.  Every
contender's bytes are compared with the payloads after the warm-up round.

Without lmcache this prints how to install it (a venv that sees kvtier) and exits 2.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import importlib.util
import mmap
import os
import shutil
import statistics
import sys
import tempfile
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

from ..args import out_file, positive_int, positive_size, positive_sizes
from ..output import print_table, write_json

if TYPE_CHECKING:
    from kvtier.testing.redis_server import RedisServer

HELP = "kvtier vs LMCache's own storage backends (lmcache==0.5.6), same payloads, same run"
BATCH_BYTES = 64 << 20  # bytes per put / get call, as in `bench backends`
THREADS = 4  # local_disk's default threads = LMCache's default disk_io_threads
STORES = ("redis", "disk", "disk-cold", "s3")
INSTALL_HINT = (
    "lmcache is not importable from {python}; kvtier bench peers needs lmcache==0.5.6 in a venv that also "
    "sees kvtier: python3 -m venv --system-site-packages .venv-lmcache && echo torch==2.13.0 > "
    "/tmp/torch-pin.txt && .venv-lmcache/bin/pip install lmcache==0.5.6 -c /tmp/torch-pin.txt && "
    ".venv-lmcache/bin/python -m kvtier bench peers")
COLUMNS = ["store", "op", "block", "kvtier_gib_s", "peer", "peer_gib_s", "ratio", "ratio_spread", "ceiling_gib_s",
           "kvtier_vs_ceiling", "peer_vs_ceiling", "ceiling"]


def lmcache_missing() -> str | None:
    """None when lmcache can be imported here, else the one line that says how to install it."""
    try:
        found = importlib.util.find_spec("lmcache") is not None
    except (ImportError, ValueError):
        found = False
    return None if found else INSTALL_HINT.format(python=sys.executable)


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--stores", default=",".join(STORES), help=f"comma-separated (default: {','.join(STORES)})")
    p.add_argument("--block-sizes", type=positive_sizes, default="2MiB,256KiB", help='comma-separated (default "2MiB,256KiB")')
    p.add_argument("--total", type=positive_size, default="1GiB", help='bytes moved per contender and round (default "1GiB")')
    p.add_argument("--repeats", type=positive_int, default=3, help="timed rounds after a warm-up; medians (default 3)")
    p.add_argument("--json", type=out_file, metavar="PATH", help="write the figures as JSON")


def run(args: argparse.Namespace) -> int:

    missing = lmcache_missing()
    if missing:
        print(missing)
        return 2
    stores = [s.strip() for s in args.stores.split(",") if s.strip()]
    unknown = [s for s in stores if s not in STORES]
    if unknown:
        print(f"--stores: unknown {', '.join(unknown)}; choose from {', '.join(STORES)}")
        return 2
    if args.repeats < 1:
        print("--repeats: must be at least 1")
        return 2
    sizes = args.block_sizes  # parsed and checked already (positive_sizes)
    total = args.total  # a size already (positive_size)
    os.environ.setdefault("LMCACHE_LOG_LEVEL", "WARNING")
    rows: list[dict[str, Any]] = []
    skipped: dict[str, str] = {}
    for store in stores:
        for block in sizes:
            t0 = time.perf_counter()
            try:
                got = _case(store, block, total, args.repeats)
            except Exception as e:  # noqa: BLE001 - one store's set-up failure must not stop the others
                skipped[f"{store}/{fmt_block(block)}"] = f"{type(e).__name__}: {e}"
                print(f"SKIP {store} {fmt_block(block)}: {type(e).__name__}: {e}", flush=True)
                continue
            rows.extend(got)
            print(f"{store} {fmt_block(block)}: {time.perf_counter() - t0:.0f}s", file=sys.stderr, flush=True)
    if rows:
        print_table([{**r, "block": fmt_block(r["block_bytes"])} for r in rows], COLUMNS)
        below = [r for r in rows if r["ratio"] < 1.0]
        print(f"kvtier / LMCache: median {statistics.median(r['ratio'] for r in rows):.2f}x over {len(rows)} "
              f"rows; below 1.0: {', '.join(_row_name(r) for r in below) or 'none'}")
    write_json(args.json, {"rows": rows, "skipped": skipped, "block_sizes": sizes, "total_bytes": total,
                           "repeats": args.repeats, "lmcache_version": _lmcache_version()})
    return 0 if rows else 1


# ---------------------------------------------------------------------- pure helpers (tested)


def fmt_block(n: int) -> str:
    for unit, scale in (("MiB", 2**20), ("KiB", 2**10)):
        if n >= scale and n % scale == 0:
            return f"{n // scale}{unit}"
    return f"{n}B"


def rotation(names: list[str], round_no: int) -> list[str]:
    """The order contenders run in round ``round_no``: each goes first equally often."""
    k = round_no % len(names) if names else 0
    return names[k:] + names[:k]


def kv_shape(block_bytes: int, *, heads: int = 8, head_dim: int = 128, tokens: int = 16,
             elem: int = 2) -> tuple[int, int, int, int, int]:
    """LMCache's (layers, 2, tokens, kv heads, head dim) whose bf16 chunk is ``block_bytes`` long."""
    per_layer = 2 * tokens * heads * head_dim * elem
    if block_bytes % per_layer:
        raise ValueError(f"block size {block_bytes} is not a whole number of {per_layer}-byte layers")
    return (block_bytes // per_layer, 2, tokens, heads, head_dim)


def summarize(store: str, op: str, block: int, gib: float, times: dict[str, list[float]],
              kvtier: str, peers: list[str], ceilings: list[str]) -> list[dict[str, Any]]:
    """One row per peer: medians over the timed rounds (round 0, the warm-up, dropped); the ceiling is
    the fastest of ``ceilings`` (none: no ceiling columns)."""
    med = {k: statistics.median(v[1:] if len(v) > 1 else v) for k, v in times.items()}
    rows = []
    for peer in peers:
        row: dict[str, Any] = {"store": store, "op": op, "block_bytes": block, "kvtier_gib_s": gib / med[kvtier],
                               "peer": peer, "peer_gib_s": gib / med[peer], "ratio": med[peer] / med[kvtier]}
        # The same round's two times (interleaved, so one round's load hits both): the ratio's spread.
        timed = slice(1, None) if len(times[kvtier]) > 1 else slice(None)
        per_round = [p / k for k, p in zip(times[kvtier][timed], times[peer][timed])]
        row.update(ratio_rounds=per_round, ratio_spread=f"{min(per_round):.2f}-{max(per_round):.2f}")
        if ceilings:
            best = min(ceilings, key=lambda c: med[c])
            row.update(ceiling_gib_s=gib / med[best], kvtier_vs_ceiling=med[best] / med[kvtier],
                       peer_vs_ceiling=med[best] / med[peer], ceiling=best)
        rows.append(row)
    return rows


def _row_name(r: dict[str, Any]) -> str:
    return f"{r['store']} {r['op']} {fmt_block(r['block_bytes'])} vs {r['peer']} ({r['ratio']:.2f}x)"


def _lmcache_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("lmcache")
    except Exception:  # noqa: BLE001
        return None


# ---------------------------------------------------------------------- the run


class _Loop:
    """An asyncio loop on a daemon thread: what an LMCache backend submits its work to.  Each LMCache
    backend gets its own, because LMCache 0.5.6's ``RemoteBackend.close()`` for ``redis://`` blocks its
    loop for good (the connector's close waits, on the loop thread, for a future only that loop can
    complete): closing is then given a few seconds and the loop is abandoned."""

    def __init__(self) -> None:
        self.loop = asyncio.new_event_loop()
        self.thread = threading.Thread(target=self.loop.run_forever, name="lmcache-loop", daemon=True)
        self.thread.start()

    def close(self, closer: Callable[[], Any], wait_s: float = 5.0) -> None:
        t = threading.Thread(target=closer, name="lmcache-close", daemon=True)
        t.start()
        t.join(wait_s)
        if not t.is_alive():
            self.loop.call_soon_threadsafe(self.loop.stop)


class Contender:
    """One side of a row: ``reset`` (untimed, before its put), ``put`` / ``get`` (timed, every block in
    batches), ``cool`` (untimed, before its get), ``check`` (untimed: the bytes that came back)."""

    name = ""

    def reset(self) -> None: ...

    def put(self) -> None: ...

    def cool(self) -> None: ...

    def get(self) -> None: ...

    def check(self) -> None: ...

    def close(self) -> None: ...


class _Payloads:
    def __init__(self, n: int, block: int):
        self.n, self.block = n, block
        rng = np.random.default_rng(int.from_bytes(os.urandom(4), "little"))
        self.raw = rng.integers(0, 2**63, (n * block) // 8, dtype=np.uint64).view(np.uint8)
        mv = self.raw.data
        self.views = [mv[i * block:(i + 1) * block] for i in range(n)]
        per = max(1, min(n, BATCH_BYTES // block))
        self.batches = [(lo, min(n, lo + per)) for lo in range(0, n, per)]
        self.sample = list(range(0, n, max(1, n // 16)))


def _case(store: str, block: int, total: int, repeats: int) -> list[dict[str, Any]]:
    n = max(1, total // block)
    data = _Payloads(n, block)
    gib = n * block / 2**30
    with contextlib.ExitStack() as stack:
        contenders, kvtier, peers, ceilings = _contenders(store, data, stack)
        for c in contenders.values():
            stack.callback(c.close)
        names = list(contenders)
        times: dict[str, dict[str, list[float]]] = {"put": {k: [] for k in names}, "get": {k: [] for k in names}}
        for r in range(repeats + 1):
            for name in rotation(names, r):
                c = contenders[name]
                c.reset()
                times["put"][name].append(_timed(c.put))
                c.cool()
                if store == "disk-cold":
                    # Every contender's writes on the device before any get (LMCache's O_DIRECT puts are
                    # never synced): a get then competes with no put's writeback, its own or another's.
                    os.sync()
                times["get"][name].append(_timed(c.get))
                if r == 0:
                    c.check()
        return [row for op in ("put", "get")
                for row in summarize(store, op, block, gib, times[op], kvtier, peers, ceilings)]


def _timed(fn: Callable[[], Any]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _contenders(store: str, data: _Payloads,
                stack: contextlib.ExitStack) -> tuple[dict[str, Contender], str, list[str], list[str]]:
    """({name: contender}, kvtier's name, the peers' names, the ceilings' names)."""
    if store == "redis":
        from kvtier.testing.redis_server import redis_available, start_redis

        why = redis_available()
        if why:
            raise RuntimeError(why)
        srv = start_redis()
        stack.callback(srv.cleanup)
        cs: dict[str, Contender] = {
            "kvtier redis": _KvtierBackend("kvtier redis", data, "redis",
                                           {"url": srv.url, "key_prefix": "kvtier:"}, reset=srv.flushall),
            "lmcache resp://": _LMCacheBackend("lmcache resp://", data, "remote",
                                               f"resp://127.0.0.1:{srv.port}", reset=srv.flushall),
            "lmcache redis://": _LMCacheBackend("lmcache redis://", data, "remote",
                                                f"redis://127.0.0.1:{srv.port}", reset=srv.flushall),
        }
        from .backend_redis import Ceiling

        wires = [_RedisWire(data, srv, v) for v in range(len(Ceiling.VARIANTS))]
        cs.update((w.name, w) for w in wires)
        return cs, "kvtier redis", ["lmcache resp://", "lmcache redis://"], [w.name for w in wires]
    if store in ("disk", "disk-cold"):
        cold = store == "disk-cold"
        root = tempfile.mkdtemp(prefix="kvtier-bench-peers-", dir=os.environ.get("KVTIER_BENCH_DIR"))
        stack.callback(shutil.rmtree, root, True)
        cs = {
            "kvtier local_disk": _KvtierBackend(
                "kvtier local_disk", data, "local_disk",
                {"path": f"{root}/kvtier", "capacity": 2 * data.n * (data.block + 4096), "threads": THREADS,
                 "fsync": cold}, files=f"{root}/kvtier" if cold else None),
            "lmcache LocalDiskBackend": _LMCacheBackend(
                "lmcache LocalDiskBackend", data, "disk", f"{root}/lmcache/", odirect=cold,
                files=f"{root}/lmcache" if cold else None),
            "raw files": _RawFiles(data, f"{root}/raw", fsync=cold, cold=cold),
        }
        return cs, "kvtier local_disk", ["lmcache LocalDiskBackend"], ["raw files"]
    if store == "s3":
        return _s3_contenders(data, stack)
    raise ValueError(store)


def _s3_contenders(data: _Payloads,
                   stack: contextlib.ExitStack) -> tuple[dict[str, Contender], str, list[str], list[str]]:
    from kvtier.testing.moto_server import dummy_credentials, start_moto

    stack.enter_context(dummy_credentials())
    moto = start_moto()
    stack.callback(moto.stop)
    bucket = moto.new_bucket("peers")
    # LMCache's S3 connector addresses objects as "/<key>" on the host it is given (virtual-hosted
    # style: the bucket is part of the host name), with awscrt; moto answers that only if the host
    # resolves, so the peer may fail to start here: then the whole row is skipped with the reason.
    peer = _LMCacheBackend("lmcache s3://", data, "remote", f"s3://{bucket}.localhost:{moto.port}",
                           extra={"s3_region": "us-east-1", "disable_tls": True, "s3_prefer_http2": False,
                                  "aws_access_key_id": "testing", "aws_secret_access_key": "testing"})
    cs: dict[str, Contender] = {
        "kvtier s3": _KvtierBackend("kvtier s3", data, "s3", {"bucket": bucket, "endpoint_url": moto.endpoint_url,
                                                             "region": "us-east-1"}),
        "lmcache s3://": peer,
    }
    return cs, "kvtier s3", ["lmcache s3://"], []


# ---------------------------------------------------------------------- contenders


class _KvtierBackend(Contender):
    def __init__(self, name: str, data: _Payloads, plugin: str, options: dict[str, Any], *,
                 reset: Callable[[], None] | None = None, files: str | None = None):
        from kvtier.keys import Namespace
        from kvtier.plugins import load

        self.name, self.data, self._reset, self._files = name, data, reset, files
        self.ns = Namespace(f"bench/peers/{data.block}", "bfloat16", 32, 8, 128, 16)
        self.backend = load("backend", plugin)(options)
        # Page-aligned get buffers, as LMCache's allocator and the raw loop have (and a host tier's slots):
        # local_disk reads a cold aligned value into them with O_DIRECT.
        self._mem = mmap.mmap(-1, data.n * data.block)
        mv = memoryview(self._mem)
        self.bufs = [mv[i * data.block:(i + 1) * data.block] for i in range(data.n)]
        self.keys: list[str] = []

    def reset(self) -> None:
        if self.keys:
            self.backend.delete(self.keys)
        if self._reset is not None:
            self._reset()
        self.keys = self.ns.keys([os.urandom(16) for _ in range(self.data.n)])

    def put(self) -> None:
        lid, keys, views = self.ns.layout_id, self.keys, self.data.views
        for lo, hi in self.data.batches:
            if not all(self.backend.put(keys[lo:hi], views[lo:hi], lid)):
                raise RuntimeError(f"{self.name}: put refused a block")

    def cool(self) -> None:
        if self._files:
            drop_page_cache(self._files)

    def get(self) -> None:
        lid, keys, bufs = self.ns.layout_id, self.keys, self.bufs
        for lo, hi in self.data.batches:
            if not all(self.backend.get_into(keys[lo:hi], bufs[lo:hi], lid)):
                raise RuntimeError(f"{self.name}: get missed a block")

    def check(self) -> None:
        for i in self.data.sample:
            if self.bufs[i] != self.data.views[i]:
                raise RuntimeError(f"{self.name}: wrong bytes for block {i}")

    def close(self) -> None:
        with contextlib.suppress(Exception):
            if self.keys:
                self.backend.delete(self.keys)
        self.backend.close()


class _LMCacheBackend(Contender):
    """LMCache's RemoteBackend (``remote``: resp:// redis:// s3://) or LocalDiskBackend (``disk``)."""

    def __init__(self, name: str, data: _Payloads, kind: str, url: str, *,
                 reset: Callable[[], None] | None = None, odirect: bool = False, files: str | None = None,
                 extra: dict[str, Any] | None = None):
        import torch
        from lmcache.v1.config import LMCacheEngineConfig
        from lmcache.v1.memory_management import MemoryFormat
        from lmcache.v1.metadata import LMCacheMetadata
        from lmcache.v1.storage_backend.local_cpu_backend import LocalCPUBackend

        self.name, self.data, self._reset, self._files = name, data, reset, files
        self._disk = kind == "disk"
        shape = kv_shape(data.block)
        batch = data.batches[0][1] - data.batches[0][0]
        # Room for every block (the put source) plus get buffers, with slack: LMCache's allocator gives a
        # miss, not an error, when it is short (measured: n + 2 batches + 0.25 GiB missed at 512 MiB).
        cpu_gib = (data.n + 4 * batch) * data.block / 2**30 + 1.0
        extra_config = dict(extra or {})
        kw: dict[str, Any] = {"chunk_size": shape[2], "local_cpu": False, "max_local_cpu_size": cpu_gib,
                              "remote_serde": "naive", "save_unfull_chunk": False}
        if kind == "disk":
            extra_config.update(use_odirect=odirect, disk_io_threads=THREADS)
            # A bound for its accounting only: LMCache 0.5.6's batched_remove() deletes the files but does not
            # give their bytes back to current_cache_size, so a tight bound makes later rounds evict the
            # blocks they just stored.  The files of each round are removed before the next.
            kw.update(local_disk=url, max_local_disk_size=4096.0)
        else:
            kw.update(remote_url=url)
        kw["extra_config"] = extra_config
        self.config = LMCacheEngineConfig.from_defaults(**kw)
        self.meta = LMCacheMetadata(model_name="kvtier-bench", world_size=1, local_world_size=1, worker_id=0,
                                    local_worker_id=0, kv_dtype=torch.bfloat16, kv_shape=shape,
                                    chunk_size=shape[2])
        self.cpu = LocalCPUBackend(self.config, self.meta, "cpu")
        self._loop = _Loop()
        loop = self._loop.loop
        if kind == "disk":
            from lmcache.v1.storage_backend.local_disk_backend import LocalDiskBackend

            self.backend: Any = LocalDiskBackend(self.config, loop, self.cpu, "cpu", None, self.meta)
        else:
            from lmcache.v1.storage_backend.remote_backend import RemoteBackend

            self.backend = RemoteBackend(self.config, self.meta, loop, self.cpu, "cpu")
            if self.backend.connection is None:
                raise RuntimeError(f"{name}: LMCache could not connect to {url} (see its log above)")
        shapes, dtypes = self.meta.get_shapes(), self.meta.get_dtypes()
        self._alloc = lambda: self.cpu.allocate(shapes, dtypes, MemoryFormat.KV_2LTD)
        self.objs = []
        for view in data.views:  # the put source: LMCache stores MemoryObjs from its allocator
            obj = self._alloc()
            if obj is None:
                raise RuntimeError(f"{name}: LMCache's allocator is full")
            obj.byte_array.cast("B")[:] = view
            self.objs.append(obj)
        self.keys: list[Any] = []  # LMCache's CacheEngineKeys
        self.got: list[Any] = []  # its MemoryObjs
        self._round = 0

    def _key(self, i: int) -> Any:
        import torch
        from lmcache.utils import CacheEngineKey

        return CacheEngineKey("kvtier-bench", 1, 0, (self._round << 32) | i, torch.bfloat16)

    def reset(self) -> None:
        if self.keys and self._disk:
            self.backend.batched_remove(self.keys, force=True)
        if self._reset is not None:
            self._reset()
        self._round += 1
        self.keys = [self._key(i) for i in range(self.data.n)]

    def put(self) -> None:
        for lo, hi in self.data.batches:
            done = _Countdown(hi - lo)
            self.backend.batched_submit_put_task(self.keys[lo:hi], self.objs[lo:hi], on_complete_callback=done)
            if not done.wait(120):
                raise RuntimeError(f"{self.name}: a put batch did not complete within 120 s")

    def cool(self) -> None:
        if self._files:
            drop_page_cache(self._files)

    def get(self) -> None:
        self._release()
        for lo, hi in self.data.batches:
            objs = self.backend.batched_get_blocking(self.keys[lo:hi])
            if any(o is None for o in objs):
                raise RuntimeError(f"{self.name}: get missed a block")
            if lo == 0:
                self.got = objs  # kept for check(); every later batch goes back to the allocator at once
            else:
                for o in objs:
                    o.ref_count_down()

    def _release(self) -> None:
        for o in self.got:
            o.ref_count_down()
        self.got = []

    def check(self) -> None:
        for i, o in enumerate(self.got):
            if o.byte_array.cast("B") != self.data.views[i]:
                raise RuntimeError(f"{self.name}: wrong bytes for block {i}")

    def close(self) -> None:
        self._release()
        with contextlib.suppress(Exception):
            if self.keys and self._disk:
                self.backend.batched_remove(self.keys, force=True)
        self._loop.close(self.backend.close)


class _Countdown:
    """Called once per completed key; ``wait`` returns True once all ``n`` were."""

    def __init__(self, n: int):
        self.left, self.lock, self.done = n, threading.Lock(), threading.Event()

    def __call__(self, _key: Any) -> None:
        with self.lock:
            self.left -= 1
            if self.left <= 0:
                self.done.set()

    def wait(self, timeout: float) -> bool:
        return self.done.wait(timeout)


class _RedisWire(Contender):
    """One of ``bench backends``' raw wire loops (``backend_redis.Ceiling``) on the same server."""

    def __init__(self, data: _Payloads, srv: RedisServer, variant: int):
        from .backend_redis import Ceiling

        self.data, self.srv, self.variant = data, srv, variant
        self.name = f"wire: {Ceiling.VARIANTS[variant]}"
        self.ceiling = Ceiling(srv.port)
        self.bufs = [memoryview(bytearray(data.block)) for _ in range(data.n)]
        self.keys = [b"kvwire:%064x" % i for i in range(data.n)]

    def reset(self) -> None:
        self.srv.flushall()

    def put(self) -> None:
        for lo, hi in self.data.batches:
            self.ceiling.put(self.variant, self.keys[lo:hi], self.data.views[lo:hi])

    def get(self) -> None:
        for lo, hi in self.data.batches:
            self.ceiling.get(self.variant, self.keys[lo:hi], self.bufs[lo:hi])

    def check(self) -> None:
        for i in self.data.sample:
            if self.bufs[i] != self.data.views[i]:
                raise RuntimeError(f"redis {self.name}: wrong bytes for block {i}")

    def close(self) -> None:
        self.ceiling.close()


class _RawFiles(Contender):
    """The disk ceiling, the one ``kvtier bench backends`` measures (:class:`.backend_disk.RawFiles`): THREADS
    threads, one file per block in 256 shard directories, open / write [/ fsync] / close and open / readv /
    close into page-aligned buffers, no file objects; cold gets read with O_DIRECT where it works (LMCache's
    durable mode does, and beat the buffered ceiling)."""

    name = "raw files"

    def __init__(self, data: _Payloads, root: str, *, fsync: bool, cold: bool):
        import mmap

        from .backend_disk import RawFiles, direct_io_works

        self.data, self.root, self.cold = data, root, cold
        os.makedirs(root)
        paths = [os.path.join(root, f"{i % 256:02x}", f"{i:08d}") for i in range(data.n)]
        self.pool = ThreadPoolExecutor(THREADS, thread_name_prefix="raw-files")
        self.raw = RawFiles(paths, self.pool, THREADS, fsync=fsync)
        self._mem = mmap.mmap(-1, data.n * data.block)  # page aligned: O_DIRECT reads land here
        mv = memoryview(self._mem)
        self.bufs = [mv[i * data.block:(i + 1) * data.block] for i in range(data.n)]
        self._direct_io_works = direct_io_works
        self.direct: bool | None = None if cold else False  # known once a file exists

    def reset(self) -> None:
        self.raw.delete()

    def put(self) -> None:
        for lo, hi in self.data.batches:
            self.raw.put(slice(lo, hi), self.data.views)

    def cool(self) -> None:
        if self.cold:
            from .backend_disk import drop_cached

            drop_cached(self.raw.paths)

    def get(self) -> None:
        if self.direct is None:
            self.direct = self._direct_io_works(self.raw.paths[0], self.data.block)
        for lo, hi in self.data.batches:
            self.raw.get(slice(lo, hi), self.bufs, direct=self.direct)

    def check(self) -> None:
        for i in self.data.sample:
            if self.bufs[i] != self.data.views[i]:
                raise RuntimeError(f"raw files: wrong bytes for block {i}")

    def close(self) -> None:
        self.pool.shutdown()


def drop_page_cache(root: str) -> int:
    """Write back and drop every file under ``root`` from the page cache (fdatasync, then
    ``POSIX_FADV_DONTNEED``); how many files."""
    count = 0
    for d, _, files in os.walk(root):
        for f in files:
            try:
                fd = os.open(os.path.join(d, f), os.O_RDONLY)
            except OSError:
                continue
            try:
                os.fdatasync(fd)
                os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
                count += 1
            finally:
                os.close(fd)
    return count
