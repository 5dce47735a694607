"""``kvtier bench backends --grouped K``: puts of values of ``K`` engine blocks (``storage.block_tokens``), each
block in its own buffer as in host memory, three ways on the same backend in the same run, interleaved:

* ``put grouped``: the value as ``blockformat.Segments`` over its blocks' buffers (how ``BackendWriter`` puts
  a group: local_disk, Redis and S3 write the parts as they are);
* ``put grouped joined``: the blocks joined by ``np.concatenate`` first, then put (how a group went down
  before the put took segments: one extra copy of every grouped value);
* the ceiling: the same values already in one buffer each, put as they are (no join at all).

Rows as ``backend_<name>.run_cases`` returns them; ``ratio`` is against the ceiling.  Keys are fresh per
timed put and deleted after it (not timed), so every put writes new values.
"""

from __future__ import annotations

import os
import shutil
import statistics
import tempfile
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import numpy as np

from kvtier.backend_api import StorageBackend
from kvtier.format.blockformat import Segments
from kvtier.keys import Namespace

BACKENDS = ("disk", "redis")  # S3's puts are bound by requests, not by a copy: not measured here
_BATCH = 16  # values per put, as a write job of the stack hands them over


@contextmanager
def _backend(name: str) -> Iterator[StorageBackend]:
    if name == "disk":
        from kvtier.backends.local_disk import LocalDiskBackend

        root = tempfile.mkdtemp(prefix="kvtier-bench-grouped-", dir=os.environ.get("KVTIER_BENCH_DIR"))
        b = LocalDiskBackend({"path": f"{root}/blocks", "index_dir": f"{root}/index", "capacity": 1 << 40})
        try:
            yield b
        finally:
            b.close()
            shutil.rmtree(root, ignore_errors=True)
        return
    from kvtier.backends.redis import RedisBackend
    from kvtier.testing.redis_server import redis_available, start_redis

    why = redis_available()
    if why:
        raise RuntimeError(why)
    srv = start_redis()
    rb = RedisBackend({"url": srv.url, "eviction_events": "off"})
    try:
        yield rb
    finally:
        rb.close()
        srv.cleanup()


def run_cases(wanted: list[str], group: int, block_sizes: list[int], total_bytes: int, repeats: int,
              skipped: dict[str, str]) -> list[dict[str, Any]]:
    rows: list[dict[str, Any]] = []
    for name in [w for w in wanted if w in BACKENDS]:
        try:
            with _backend(name) as b:
                for block in block_sizes:
                    rows.extend(_case(name, b, group, block, total_bytes, repeats))
        except Exception as e:  # noqa: BLE001 - one backend's set-up failure must not stop the others
            skipped[f"{name} grouped"] = f"{type(e).__name__}: {e}"
            print(f"SKIP {name} grouped: {skipped[f'{name} grouped']}")
    return rows


def _case(name: str, b: StorageBackend, group: int, block: int, total_bytes: int,
          repeats: int) -> list[dict[str, Any]]:
    ns = Namespace("bench/grouped", "bfloat16", 32, 8, 128, 16)
    n = max(1, total_bytes // (group * block))
    rng = np.random.default_rng(block)
    # Blocks in separate buffers, a value's blocks apart (interleaved), as host slots hold them.
    blocks = rng.integers(1, 256, (group * n, block), dtype=np.uint8)
    of = [[blocks[j * n + i] for j in range(group)] for i in range(n)]
    whole = [np.concatenate(v) for v in of]  # the ceiling's values: one buffer each, built untimed

    def putter(make: Callable[[int], Any]) -> Callable[[], float]:
        def one() -> float:
            keys = ns.keys([os.urandom(16) for _ in range(n)])
            t0 = time.perf_counter()
            ok = []
            for a in range(0, n, _BATCH):
                ok += b.put(keys[a:a + _BATCH], [make(i) for i in range(a, min(n, a + _BATCH))], ns.layout_id)
            dt = time.perf_counter() - t0
            b.delete(keys)
            if not all(ok):
                raise RuntimeError(f"{name}: {len(ok) - sum(ok)} of {n} grouped puts failed")
            return dt
        return one

    contenders = {
        "put grouped": putter(lambda i: Segments([memoryview(x) for x in of[i]])),
        "put grouped joined": putter(lambda i: np.concatenate(of[i])),
        "ceiling": putter(lambda i: whole[i]),
    }
    for fn in contenders.values():  # warm-up: files, connections, page cache
        fn()
    times: dict[str, list[float]] = {k: [] for k in contenders}
    for _ in range(repeats):  # interleaved: a drift in the machine hits every contender alike
        for k, fn in contenders.items():
            times[k].append(fn())
    gib = n * group * block / 2**30
    ceiling = gib / statistics.median(times["ceiling"])
    return [{"backend": name, "op": op, "block_bytes": block, "gib_s": round(gib / statistics.median(times[op]), 3),
             "ceiling_gib_s": round(ceiling, 3),
             "ratio": round(gib / statistics.median(times[op]) / ceiling, 3),
             "spread_gib_s": f"{gib / max(times[op]):.2f}-{gib / min(times[op]):.2f}",
             "note": f"values of {group} blocks; ceiling: the same values already in one buffer each"}
            for op in ("put grouped", "put grouped joined")]
