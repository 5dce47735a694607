"""``kvtier bench prefix``: load a stored 4k-token prefix from each backend into the model's paged cache,
beside recomputing it with the same model, in the same run.

For each backend a prefill engine computes and stores the prefix; then a fresh engine (empty device and
host tiers, as a decode instance on another host) times ``lookup + load`` of the whole prefix, and the
same engine times the forward pass that would recompute it.  Ratio = recompute time / load time (> 1
means loading wins).  The raw ceiling of the same run reads the very values the load read, with the
ceilings of ``bench backends`` (disk: open / readv into page-aligned buffers; Redis: the raw-socket loops;
S3: boto3 ``get_object`` on the backend's own client and pool width), into buffers, nothing else:
``load_vs_raw`` = raw time / load time is what the stack's lookup, verification and copies into the
engine's cache cost on top."""

from __future__ import annotations

import argparse
import statistics
import tempfile
import time
from contextlib import ExitStack
from typing import TYPE_CHECKING, Any

import numpy as np

from ..args import out_file, positive_int
from ..output import print_table, write_json

if TYPE_CHECKING:
    from ...config import KvtierConfig
    from ...stack import TierStack

HELP = "load a 4k-token prefix from each backend vs recomputing it with the same model"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--tokens", type=positive_int, default=4096)
    p.add_argument("--backends", default="disk,redis,s3")
    p.add_argument("--layers", type=positive_int, default=4)
    p.add_argument("--kv-heads", type=positive_int, default=4)
    p.add_argument("--head-dim", type=positive_int, default=32)
    p.add_argument("--repeats", type=positive_int, default=5)
    p.add_argument("--block-tokens", default="16,256",
                   help="storage.block_tokens values to compare (tokens per stored value; default 16,256)")
    p.add_argument("--json", type=out_file, metavar="PATH")


def backend_section(name: str, stack: ExitStack, tmp: str, *, capacity: str = "4GiB",
                    bucket_prefix: str = "prefix") -> dict[str, Any]:
    """A backend's config section, starting its server (redis-server, moto in a child process) on
    ``stack``: the benchmarks that drive a whole engine share it."""
    if name == "disk":
        return {"name": "disk", "type": "local_disk", "options": {"path": f"{tmp}/kv", "capacity": capacity}}
    if name == "redis":
        from ...testing.redis_server import start_redis

        srv = start_redis()
        stack.callback(srv.stop)
        return {"name": "redis", "type": "redis", "options": {"url": srv.url}}
    if name == "s3":
        import uuid

        from ...testing.moto_server import dummy_credentials
        from .backend_s3 import ChildMoto

        # moto in a child process, so the server does not compete with the model for this process's GIL.
        stack.enter_context(dummy_credentials())
        endpoint = stack.enter_context(ChildMoto())
        return {"name": "s3", "type": "s3", "options": {"bucket": f"{bucket_prefix}-{uuid.uuid4().hex[:8]}",
                                                        "create_bucket": True, "endpoint_url": endpoint,
                                                        "region": "us-east-1", "max_workers": 8}}
    raise ValueError(f"--backends: unknown backend {name!r}; expected disk, redis, s3")


def _config(args: argparse.Namespace, backend: dict[str, Any], block_tokens: int = 16) -> KvtierConfig:
    from ...config import parse_config

    blocks = args.tokens // 16 + 8
    return parse_config({
        "storage": {"block_tokens": block_tokens},
        "model": {"id": "kvtier/bench-prefix", "kv_dtype": "float32", "num_layers": args.layers,
                  "num_kv_heads": args.kv_heads, "head_dim": args.head_dim, "block_size": 16},
        "device": {"kind": "auto", "num_blocks": blocks},
        "host": {"capacity": 2 * blocks * 2 * args.layers * 16 * args.kv_heads * args.head_dim * 4},
        "backends": [backend], "policies": {"prefetch": {"name": "wait_complete", "threshold_tokens": 0}},
    })


def bench_one(args: argparse.Namespace, backend: dict[str, Any], block_tokens: int = 16) -> dict[str, Any]:
    import torch

    from ...integrations.engine import CachedEngine

    prompt = torch.randint(0, 2048, (args.tokens + 1,), generator=torch.Generator().manual_seed(0)).tolist()
    cfg = _config(args, backend, block_tokens)
    prefill = CachedEngine.from_config(cfg)
    try:
        prefill.run_request(prompt, max_new_tokens=1)
        prefill.flush()
    finally:
        prefill.close()
    hashes = prefill.hasher.hash_blocks(prompt)[: args.tokens // 16]
    loads, computes, raws, nbytes, reads = [], [], [], 0, 0
    for _ in range(args.repeats):
        dec = CachedEngine.from_config(cfg)  # cold host and device: everything comes from the backend
        try:
            ids = dec.pool.allocate(len(hashes))
            t0 = time.perf_counter()
            found = dec.stack.lookup(hashes)
            res = dec.stack.load(hashes[: found.num_blocks], ids[: found.num_blocks]).wait()
            loads.append(time.perf_counter() - t0)
            reads = sum(b.stats().gets for b in dec.stack.backends)  # values read (S3: GET requests)
            raws.append(_raw_read(dec.stack, hashes))
            if res.num_loaded != len(hashes):
                raise RuntimeError(f"{backend['name']}: loaded {res.num_loaded} of {len(hashes)} blocks")
            nbytes = len(hashes) * dec.stack.layout.block_nbytes
            t1 = time.perf_counter()
            dec.model.forward(prompt[: args.tokens], ids, 0)
            computes.append(time.perf_counter() - t1)
        finally:
            dec.close()
    load, compute, raw = statistics.median(loads), statistics.median(computes), statistics.median(raws)
    return {"backend": backend["name"], "tokens": args.tokens, "block_tokens": block_tokens,
            "values_read": reads, "MiB": nbytes / 2**20,
            "load_ms": load * 1e3, "raw_ms": raw * 1e3, "load_vs_raw": raw / load,
            "recompute_ms": compute * 1e3, "GiB/s": nbytes / load / 2**30,
            "ratio_recompute_over_load": compute / load}


def _raw_read(stack: TierStack, hashes: list[bytes]) -> float:
    """Seconds the raw ceiling takes to read the stored values of ``hashes`` (one per group of
    ``storage_blocks`` blocks, as stored) from the stack's backend into buffers."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor
    from urllib.parse import urlparse

    from ...format.blockformat import HEADER_SIZE

    k = stack.storage_blocks
    be: Any = stack.backends[0]  # each backend type's own internals, picked by its class name below
    keys = stack.namespace.keys(hashes[k - 1::k])
    size = HEADER_SIZE + k * stack.layout.block_nbytes
    mem = mmap.mmap(-1, len(keys) * size)  # page aligned, as the disk ceiling wants
    # Faulted in before the clock starts: the load reads into host slots that exist already, and a
    # ceiling that paid a page fault per 4 KiB ran at half its speed (and below the load it bounds).
    np.frombuffer(mem, dtype=np.uint8)[::mmap.PAGESIZE] = 0
    bufs = [memoryview(mem)[i * size:(i + 1) * size] for i in range(len(keys))]
    kind = type(be).__name__
    try:
        if kind == "LocalDiskBackend":
            from .backend_disk import RawFiles

            with ThreadPoolExecutor(be.options.threads) as pool:
                raw = RawFiles([be._where(key)[1] for key in keys], pool, be.options.threads)
                t0 = time.perf_counter()
                raw.get(slice(None), bufs)
                return time.perf_counter() - t0
        if kind == "RedisBackend":
            from .backend_redis import Ceiling

            ceiling = Ceiling(urlparse(be.options.url).port or 6379)
            try:
                best = float("inf")
                for v in range(len(Ceiling.VARIANTS)):  # the faster raw loop is the ceiling
                    t0 = time.perf_counter()
                    ceiling.get(v, be._rkeys(keys), bufs)
                    best = min(best, time.perf_counter() - t0)
                return best
            finally:
                ceiling.close()
        if kind == "S3Backend":
            client, bucket, prefix = be._client, be._bucket, be._prefix
            with ThreadPoolExecutor(be.options.max_workers) as pool:
                t0 = time.perf_counter()
                list(pool.map(lambda key: client.get_object(Bucket=bucket, Key=prefix + key)["Body"].read(), keys))
                return time.perf_counter() - t0
        raise ValueError(f"no raw ceiling for backend type {kind}")
    finally:
        for b in bufs:
            b.release()
        mem.close()


def run(args: argparse.Namespace) -> int:
    try:
        sizes = [int(x) for x in args.block_tokens.split(",") if x.strip()]
    except ValueError:
        raise ValueError(f"--block-tokens: expected comma-separated token counts, got {args.block_tokens!r}") from None
    if not sizes or min(sizes) < 16 or any(bt % 16 for bt in sizes):
        raise ValueError(f"--block-tokens: each value must be a multiple of the 16-token block, got {args.block_tokens!r}")
    if args.tokens < max(sizes):
        raise ValueError(f"--tokens {args.tokens}: the prefix must hold at least one stored value of the largest "
                         f"--block-tokens ({max(sizes)} tokens)")
    rows = []
    for name in [b.strip() for b in args.backends.split(",") if b.strip()]:
        with ExitStack() as stack, tempfile.TemporaryDirectory() as tmp:
            try:
                backend = backend_section(name, stack, tmp)
            except Exception as e:  # noqa: BLE001 - a missing server is a SKIP, not a crash
                print(f"SKIP {name}: {e}")
                continue
            for bt in sizes:
                rows.append(bench_one(args, backend, bt))
    print(f"prefix of {args.tokens} tokens, model {args.layers} layers x {args.kv_heads} kv heads x "
          f"{args.head_dim} head dim (float32), medians of {args.repeats}")
    print_table(rows, ["backend", "tokens", "block_tokens", "values_read", "MiB", "load_ms", "raw_ms",
                       "load_vs_raw", "recompute_ms", "GiB/s", "ratio_recompute_over_load"])
    write_json(args.json, {"rows": rows})
    return 0
