"""S3 backend put/get throughput beside raw boto3 on the same endpoint, same payloads, same concurrency.

The endpoint is a moto server in a child process (so the server does not share this process's GIL with
the client being measured).  The ceiling is plain boto3 ``put_object(Body=bytes)`` / ``get_object``
``["Body"].read()`` on a thread pool of the backend's ``max_workers``, with the same botocore ``Config``
(timeouts, retries, pool size, transport checksums off) so the comparison isolates what the backend adds:
framing, verification, metrics and its own batching (it even shares the client object).  moto is the
bottleneck in absolute terms; the ratio is the figure that transfers to a real S3 endpoint.  Each row also
has ``cpu_ratio``: this process's CPU per byte, ceiling / backend (moto's CPU is not in it), a figure the
machine's other load does not move the way it moves wall-clock throughput.

Run standalone: ``python -m kvtier.tools.bench.backend_s3`` or
``python -c "from kvtier.tools.bench.backend_s3 import run_cases; print(run_cases([2<<20, 256<<10], 128<<20, 3))"``.
"""

from __future__ import annotations

import os
import statistics
import subprocess
import sys
import time
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import numpy as np

MAX_WORKERS = 8
# moto moves ~0.1-0.5 GiB/s and keeps every object in this machine's memory/temp files: more bytes per
# case only lengthen the run (the ratio is stable well below this), so larger requests are capped.
MAX_TOTAL = 128 << 20
BATCH = 32  # keys per backend call, as the stack would pass a chain of blocks
_GIB = float(1 << 30)


_CHILD = """
import sys
from kvtier.testing.moto_server import dummy_credentials, start_moto
with dummy_credentials(), start_moto() as server:
    print(server.port, flush=True)
    sys.stdin.read()  # serve until the parent closes our stdin (or dies)
"""


class ChildMoto:
    """A moto server in a child interpreter; ``with`` gives its endpoint URL."""

    def __enter__(self) -> str:
        self._proc = subprocess.Popen([sys.executable, "-c", _CHILD], stdin=subprocess.PIPE,
                                      stdout=subprocess.PIPE, text=True)
        assert self._proc.stdout is not None  # stdout=PIPE
        line = self._proc.stdout.readline().strip()
        if not line.isdigit():
            self._proc.kill()
            raise RuntimeError(f"moto server did not start (said {line!r})")
        return f"http://127.0.0.1:{line}"

    def __exit__(self, *exc: Any) -> None:
        assert self._proc.stdin is not None  # stdin=PIPE
        self._proc.stdin.close()
        try:
            self._proc.wait(10)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait()


def _rate(fn: Any, nbytes: int) -> tuple[float, float]:
    """(GiB/s, this process's CPU seconds): moto runs elsewhere, so the CPU is the client's alone."""
    t0, c0 = time.perf_counter(), time.process_time()
    fn()
    return nbytes / (time.perf_counter() - t0) / _GIB, time.process_time() - c0


def run_cases(block_sizes: list[int], total_bytes: int, repeats: int) -> list[dict[str, Any]]:
    """One put row and one get row per block size: the backend's GiB/s, raw boto3's, and the ratio.
    ``total_bytes`` is capped at ``MAX_TOTAL`` (said in each row's note)."""
    from kvtier.backends.s3 import S3Backend
    from kvtier.keys import Namespace
    from kvtier.testing.moto_server import dummy_credentials

    rows: list[dict[str, Any]] = []
    with dummy_credentials(), ChildMoto() as endpoint:
        bucket = f"kvtier-bench-{uuid.uuid4().hex[:8]}"
        backend = S3Backend({"bucket": bucket, "endpoint_url": endpoint, "create_bucket": True,
                             "max_workers": MAX_WORKERS, "timeout_s": 30}, name="bench-s3")
        raw = backend._client  # the same client and Config: only the backend's own work differs
        pool = ThreadPoolExecutor(MAX_WORKERS)
        try:
            for bs in block_sizes:
                rows += _case(backend, raw, pool, bucket, bs, total_bytes, repeats, Namespace)
        finally:
            pool.shutdown()
            backend.close()
    return rows


def _case(backend: Any, raw: Any, pool: ThreadPoolExecutor, bucket: str, bs: int, total_bytes: int,
          repeats: int, Namespace: Any) -> list[dict[str, Any]]:
    from kvtier.format import blockformat

    n = max(min(total_bytes, MAX_TOTAL) // bs, BATCH)
    ns = Namespace("bench", "bf16", 1, 1, bs // 32, 16)
    rng = np.random.default_rng(bs)
    payloads = [rng.integers(0, 256, bs, dtype=np.uint8) for _ in range(n)]
    keys = ns.keys([os.urandom(32) for _ in range(n)])
    raw_keys = [f"raw/{k}" for k in keys]
    # The ceiling uploads objects of the same size (header + payload), prepared outside the timing.
    blobs = [bytes(blockformat.HEADER_SIZE) + p.tobytes() for p in payloads]
    outs = [np.empty(bs, dtype=np.uint8) for _ in range(n)]
    nbytes = n * bs
    batches = [slice(i, i + BATCH) for i in range(0, n, BATCH)]

    def put_backend() -> None:
        for sl in batches:
            assert all(backend.put(keys[sl], payloads[sl], ns.layout_id))

    def get_backend() -> None:
        for sl in batches:
            assert all(backend.get_into(keys[sl], outs[sl], ns.layout_id))

    def put_raw() -> None:
        for sl in batches:
            list(pool.map(lambda k, b: raw.put_object(Bucket=bucket, Key=k, Body=b), raw_keys[sl], blobs[sl]))

    def get_raw() -> None:
        for sl in batches:
            list(pool.map(lambda k: raw.get_object(Bucket=bucket, Key=k)["Body"].read(), raw_keys[sl]))

    for warm_up in (put_backend, put_raw, get_backend, get_raw):  # warm up connections and moto's buckets
        warm_up()
    rows = []
    for op, mine, ceiling in (("put", put_backend, put_raw), ("get", get_backend, get_raw)):
        # Paired and interleaved (alternating which goes first), so drift on a noisy, shared machine hits
        # both alike; the ratio is the median of the per-repeat ratios.
        ours, theirs, cpu_ratios = [], [], []
        for r in range(repeats):
            if r % 2 == 0:
                (a, ca), (b, cb) = _rate(mine, nbytes), _rate(ceiling, nbytes)
            else:
                (b, cb), (a, ca) = _rate(ceiling, nbytes), _rate(mine, nbytes)
            ours.append(a)
            theirs.append(b)
            cpu_ratios.append(cb / ca if ca else 0.0)
        rows.append({"backend": "s3", "op": op, "block_bytes": bs, "gib_s": statistics.median(ours),
                     "ceiling_gib_s": statistics.median(theirs),
                     "ratio": statistics.median(o / t for o, t in zip(ours, theirs)),
                     # Client CPU per byte, ceiling / backend: immune to the machine's other load.
                     "cpu_ratio": statistics.median(cpu_ratios),
                     "note": f"moto in a child process, {MAX_WORKERS} threads, {n} blocks ({nbytes >> 20} MiB) "
                             f"in batches of {BATCH}; ceiling: raw boto3 put_object(bytes) / "
                             "get_object().read(), same client config; ratio: median of paired repeats"})
    assert all(np.array_equal(a, b) for a, b in zip(payloads, outs))
    backend.delete(keys)
    for i in range(0, n, 1000):
        raw.delete_objects(Bucket=bucket, Delete={"Objects": [{"Key": k} for k in raw_keys[i:i + 1000]]})
    return rows


def main() -> None:
    from kvtier.tools.output import print_table

    rows = run_cases([2 << 20, 256 << 10], 128 << 20, 5)
    print_table(rows, ["backend", "op", "block_bytes", "gib_s", "ceiling_gib_s", "ratio", "cpu_ratio"])


if __name__ == "__main__":
    main()
