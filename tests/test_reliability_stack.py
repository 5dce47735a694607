"""Issue 6, items 5 and 6, stack parts: a full disk under a serving stack, and the stack under many
concurrent requests.

Real parts only: an 8 MiB tmpfs the test mounts (root only; otherwise skipped with the reason) filled by a
foreign file so ENOSPC comes for real; real engines (``_reliability_stack_helpers``: a P/D pair of tiny
transformers Llamas); real redis-server; real files.

What must hold:

* **Disk full under the stack**: requests keep being served (no exception reaches the engine, decodes
  equal a no-cache baseline); every store the disk refused is counted (the stack's ``stores_skipped`` of
  the disk tier equals the backend's ``put_failures``); no temp file is left, every block file is whole
  and holds exactly the bytes that were stored under its key, so nothing half-written is readable; blocks
  stored before the disk filled keep being served; once room is made, stores succeed and hit again.
* **Many concurrent requests**: 8 threads run lookup / prefetch / load / store / flush on one stack over
  overlapping prompts with the host tier full (write-through over disk; write-back over disk + Redis,
  where making room means writing victims back; no host tier at all).  Every wait has a timeout (a
  deadlock fails the test), no loaded block ever holds wrong bytes, and at the end nothing is pinned, no
  write is pending, no host slot leaked, and every block in the backends is exact.
"""

from __future__ import annotations

import os
import random
import threading
import time
from typing import Any

import numpy as np
import pytest
import torch
from _reliability_stack_helpers import PD, Prompts, Step, bounded, counters, delta, hits, reusable

from kvtier.backends.local_disk import LocalDiskBackend
from kvtier.config import parse_config
from kvtier.format.blockformat import HEADER_SIZE
from kvtier.integrations.engine import CachedEngine
from kvtier.stack import TierStack

STEP_TIMEOUT = 30.0


def _fill_fs(root, leave: int) -> str:
    """A foreign file taking all but ``leave`` bytes of the filesystem; returns its path."""
    st = os.statvfs(root)
    free = st.f_bavail * st.f_frsize
    path = os.path.join(root, "filler")
    with open(path, "wb") as f:
        f.write(b"\xff" * max(0, free - leave))
    return path


def _disk_files(root) -> list[tuple[str, int]]:
    return [(os.path.join(d, f), os.path.getsize(os.path.join(d, f))) for d, _, fs in os.walk(root) for f in fs]


def test_disk_full_under_the_stack(small_tmpfs, figures):
    kv = small_tmpfs / "kv"
    disk = {"name": "disk", "type": "local_disk", "options": {"path": str(kv), "capacity": "1GiB"}}
    pd = PD.build(disk)  # capacity above the filesystem's size: ENOSPC, not eviction, ends the room
    filler = _fill_fs(small_tmpfs, leave=160 << 10)  # room for ~2 prompts of 8 blocks of 8 KiB
    prompts = Prompts(seed=51)
    fresh_dec: CachedEngine | None = None
    try:
        # Fill it: requests until the disk refuses stores, then three more on a full disk.
        steps: list[Step] = []
        while counters(pd.pre, "disk")["stores_skipped"] == 0 and len(steps) < 12:
            steps.append(bounded(lambda: pd.step(prompts()), STEP_TIMEOUT, "P/D request"))
        assert counters(pd.pre, "disk")["stores_skipped"] > 0, "the disk never filled up"
        full0 = counters(pd.pre, "disk")
        steps += [bounded(lambda: pd.step(prompts()), STEP_TIMEOUT, "P/D request") for _ in range(3)]
        full_d = delta(counters(pd.pre, "disk"), full0)
        assert all(s.flushed for s in steps)

        # Nothing half-written: no temp file; every block file whole and exactly what was stored.
        block_nbytes = pd.pre.stack.layout.block_nbytes
        files = [(p, n) for p, n in _disk_files(kv)  # blocks only: not manifests, the ledger or the journal
                 if not p.endswith(".json") and not os.path.basename(p).startswith(".kvtier-")]
        tmp_left = [p for p, _ in files if p.endswith(".tmp")]
        bad_size = [p for p, n in files if not p.endswith(".tmp") and n != HEADER_SIZE + block_nbytes]
        ns = pd.pre.stack.namespace
        by_key: dict[str, bytes] = {}
        for s in steps:
            hs = pd.pre.hasher.hash_blocks(s.prompt)
            by_key.update(zip(ns.keys(hs), hs))
        reader = LocalDiskBackend({"path": str(kv), "capacity": "1GiB"}, name="reader")
        try:
            stored = [b.key for b in reader.scan(ns.id)]
            bufs = [np.zeros(block_nbytes, dtype=np.uint8) for _ in stored]
            ok = reader.get_into(stored, bufs, ns.layout_id)
            wrong_bytes = 0
            for key, good, buf in zip(stored, ok, bufs):
                e = pd.pre.stack.index.get(by_key[key])  # the prefill host tier still holds every block
                assert e is not None and e.host is not None
                want = np.frombuffer(pd.pre.stack.host.slot_view(e.host), dtype=np.uint8)
                wrong_bytes += int(not good or not np.array_equal(buf, want))
            corrupt = reader.stats().corrupt
        finally:
            reader.close()

        # Still serving: a fresh decode engine loads every prompt stored before the disk filled, exactly.
        fresh_dec = CachedEngine.from_config(pd.dec.stack.config)
        early = [s for s in steps if s.decode is not None and s.decode.cached_blocks == reusable(s.prompt)]
        assert early, "no prompt was stored in full before the disk filled"
        for s in early:
            r = bounded(lambda s=s: fresh_dec.run_request(s.prompt, max_new_tokens=2, store=False, keep_logits=True),
                        STEP_TIMEOUT, "decode")
            assert r.cached_blocks == reusable(s.prompt) and r.failed_blocks == 0
            assert torch.allclose(torch.stack(r.step_logits), pd.baseline(s.prompt), atol=1e-4, rtol=0)
        # ... and the prefill stack still serves from host memory what the disk refused.
        last = pd.pre.hasher.hash_blocks(steps[-1].prompt)
        assert pd.pre.stack.lookup(last).num_blocks == len(last)

        # Room again (the foreign file goes): stores succeed and decodes hit in full.
        os.unlink(filler)
        room0 = counters(pd.pre, "disk")
        after = [bounded(lambda: pd.step(prompts()), STEP_TIMEOUT, "P/D request") for _ in range(2)]
        room_d = delta(counters(pd.pre, "disk"), room0)

        tot = counters(pd.pre, "disk")
        put_failures = pd.pre.stack.stats()["backends"]["disk"]["put_failures"]
        errors, wrong = pd.errors(), pd.wrong()
        figures("disk full: engine exceptions", len(errors))
        figures("disk full: wrong decodes of decodes that used cached blocks", f"{len(wrong)} of {pd.checked()}")
        figures("disk full: stores refused (stack stores_skipped / backend put_failures / stack failures)",
                f"{tot['stores_skipped']}/{put_failures}/{tot['failures']}")
        figures("disk full: temp files left / block files of the wrong size / unreadable or wrong blocks "
                "(of block files)", f"{len(tmp_left)}/{len(bad_size)}/{wrong_bytes + corrupt} (of {len(stored)})")
        figures("disk full: prompts stored before it filled, still served exactly", len(early))
        figures("disk full: hits after room is made (blocks)",
                f"{sum(h or 0 for h in hits(after))}/{sum(reusable(s.prompt) for s in after)}")
        assert errors == [] and wrong == []
        assert full_d["stores_skipped"] == 3 * 8 and full_d["bytes_in"] == 0, full_d
        assert tot["stores_skipped"] == put_failures > 0
        assert tmp_left == [] and bad_size == [] and wrong_bytes == 0 and corrupt == 0
        assert len(stored) > 0
        assert room_d["stores_skipped"] == 0 and room_d["bytes_in"] > 0, room_d
        assert hits(after) == [reusable(s.prompt) for s in after]
    finally:
        if fresh_dec is not None:
            fresh_dec.close()
        pd.close()


# ------------------------------------------------------------------------------------------ concurrency

LAYERS, HEADS, HEAD_DIM, BLOCK = 2, 2, 16, 4  # 2 KiB blocks
THREADS, PER_THREAD, REQUESTS = 16, 8, 50  # device blocks per thread = the longest prompt
TAIL = 40  # requests per thread after the last fault (hits must resume)
OP_TIMEOUT = 20.0  # every wait of every operation (a deadlock shows up as a TimeoutError)
REDIS_TIMEOUT = 0.5  # timeout_s of the redis backend
DOCS = 16


def _stack_config(tmp_path, *, write: str, host_slots: int, backends: list[dict[str, Any]]):
    block_nbytes = LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 4
    return parse_config({
        "model": {"id": "test/concurrency", "kv_dtype": "float32", "num_layers": LAYERS, "num_kv_heads": HEADS,
                  "head_dim": HEAD_DIM, "block_size": BLOCK},
        "device": {"kind": "cpu", "num_blocks": THREADS * PER_THREAD},
        "host": {"capacity": host_slots * block_nbytes, "pinned": False},
        "backends": backends,
        "policies": {"write": {"name": write},
                     "prefetch": {"name": "best_effort", "threshold_tokens": 0}},
        "transfer": {"threads": 2},
    })


def _payload(h: bytes, nbytes: int) -> torch.Tensor:
    rng = np.random.default_rng(int.from_bytes(h[:8], "little"))
    return torch.from_numpy(rng.integers(1, 256, nbytes, dtype=np.uint8))


@pytest.mark.parametrize("case", ["write_through+disk", "write_back+disk+redis", "no_host+disk",
                                  "write_back+redis, redis killed and restarted during the run",
                                  "write_back+redis, redis hung (SIGSTOP) during the run",
                                  "write_back+disk, disk full"])
def test_stack_many_concurrent_requests(tmp_path, request, figures, case):
    disk_root = request.getfixturevalue("small_tmpfs") if "disk full" in case else tmp_path
    backends = [] if case.startswith("write_back+redis") else \
        [{"name": "disk", "type": "local_disk", "options": {"path": str(disk_root / "disk"), "capacity": "1GiB"}}]
    srv = None
    if "redis" in case:
        srv = request.getfixturevalue("redis_server")
        backends.append({"name": "redis", "type": "redis", "options": {"url": srv.url, "timeout_s": REDIS_TIMEOUT}})
    write = case.split("+")[0] if not case.startswith("no_host") else "write_through"
    stack = TierStack(_stack_config(tmp_path, write=write, host_slots=0 if case.startswith("no_host") else 6,
                                    backends=backends))
    nbytes = stack.layout.block_nbytes
    hasher = stack.namespace.hasher()
    if "disk full" in case:
        _fill_fs(disk_root, leave=64 << 10)  # a few dozen blocks, then ENOSPC
    # Overlapping prompts: documents share one of three 2-block system prefixes; requests take 2..8 blocks.
    g = torch.Generator().manual_seed(61)
    systems = [torch.randint(0, 2048, (2 * BLOCK,), generator=g).tolist() for _ in range(3)]
    chains = [hasher.hash_blocks(systems[d % 3] + torch.randint(0, 2048, (6 * BLOCK,), generator=g).tolist())
              for d in range(DOCS)]
    want = {h: _payload(h, nbytes) for c in chains for h in c}
    lock = threading.Lock()
    stats: dict[str, Any] = {"requests": 0, "loaded": 0, "stored": 0, "wrong": 0, "timeouts": 0, "errors": [],
                             "max_wait": 0.0}

    def timed(what: str, fn):
        t0 = time.monotonic()
        try:
            return fn()
        except TimeoutError:
            with lock:
                stats["timeouts"] += 1
            raise
        finally:
            with lock:
                stats["max_wait"] = max(stats["max_wait"], time.monotonic() - t0)

    faults_over = threading.Event()  # the killer is done (at once when nothing is killed)
    faulty = "killed" in case or "hung" in case
    if not faulty:
        faults_over.set()

    def worker(t: int) -> None:
        rng = random.Random(t)
        base = t * PER_THREAD
        done = tail = 0
        try:
            # REQUESTS requests, and at least TAIL of them after the faults are over.
            while done < REQUESTS or tail < TAIL:
                tail += faults_over.is_set()
                done += 1
                chain = chains[rng.randrange(DOCS)][: rng.randint(2, 8)]
                n = len(chain)
                ids = list(range(base, base + n))
                found = stack.lookup(chain)
                if found.num_blocks and rng.random() < 0.3:
                    ph = stack.prefetch(chain, lookup=found)
                    timed("prefetch", lambda ph=ph: ph.wait(timeout=0.05))
                k = found.num_blocks
                loaded = 0
                if k:
                    res = timed("load", lambda c=chain[:k], b=ids[:k]: stack.load(c, b).wait(OP_TIMEOUT))
                    assert list(res.ok) == [True] * res.num_loaded + [False] * (k - res.num_loaded)
                    loaded = res.num_loaded
                    if loaded:
                        got = stack.device.read_blocks(ids[:loaded])
                        bad = sum(not torch.equal(got[i], want[chain[i]]) for i in range(loaded))
                        with lock:
                            stats["wrong"] += bad
                            stats["loaded"] += loaded
                # The engine computes the rest into its blocks (telling the stack they were reused), stores.
                rest = ids[loaded:]
                if rest:
                    stack.on_device_freed(rest)
                    stack.device.write_blocks(torch.stack([want[h] for h in chain[loaded:]]), rest)
                    sr = timed("store", lambda c=chain[loaded:], b=rest: stack.store(c, b).wait(OP_TIMEOUT))
                    assert len(sr.status) == len(rest) and sr.num_failed == 0, sr
                    with lock:
                        stats["stored"] += sr.num_stored
                if rng.random() < 0.1:
                    assert timed("flush", lambda: stack.flush(OP_TIMEOUT)), "flush timed out"
                with lock:
                    stats["requests"] += 1
        except Exception as e:  # noqa: BLE001 - reported by the test
            with lock:
                stats["errors"].append(f"thread {t}: {type(e).__name__}: {e}")

    threads = [threading.Thread(target=worker, args=(t,), daemon=True, name=f"req-{t}") for t in range(THREADS)]
    t0 = time.monotonic()
    try:
        for th in threads:
            th.start()
        kills, hits0 = 0, 0
        if faulty:  # SIGKILL and restart (or SIGSTOP and resume) Redis 3 times while the requests run
            assert srv is not None  # a redis case
            for _ in range(3):
                time.sleep(0.1)
                srv.stop() if "killed" in case else srv.pause()
                kills += 1
                time.sleep(0.15 if "killed" in case else 2 * REDIS_TIMEOUT)
                srv.start() if "killed" in case else srv.resume()
            hits0 = counters(stack, "redis")["hits"]
            faults_over.set()
        for th in threads:
            bounded(lambda th=th: th.join(120), 125, "request threads")
        wall = time.monotonic() - t0
        hung = [th.name for th in threads if th.is_alive()]
        flushed = bounded(lambda: stack.flush(OP_TIMEOUT), OP_TIMEOUT + 5, "final flush")
        st = stack.stats()
        # Every block the backends hold is exact.
        bad_stored = checked = 0
        by_key = dict(zip(stack.namespace.keys(list(want)), want))
        for be in stack.backends:
            keys = [k for k, ok in zip(by_key, be.exists(list(by_key))) if ok]
            bufs = [np.zeros(nbytes, dtype=np.uint8) for _ in keys]
            ok = be.get_into(keys, bufs, stack.namespace.layout_id)
            checked += len(keys)
            bad_stored += sum(not g or not np.array_equal(b, want[by_key[k]].numpy()) for k, g, b in zip(keys, ok, bufs))
    finally:
        stack.close(timeout=10)
    host = counters(stack, "host") if stack.host is not None else None
    figures(f"stack concurrency ({case}): requests / threads / seconds",
            f"{stats['requests']}/{THREADS}/{wall:.2f}")
    figures(f"stack concurrency ({case}): wrong blocks served (of blocks loaded)",
            f"{stats['wrong']} (of {stats['loaded']})")
    figures(f"stack concurrency ({case}): wait timeouts (deadlocks) / max wait seconds",
            f"{stats['timeouts']}/{stats['max_wait']:.3f}")
    figures(f"stack concurrency ({case}): wrong blocks in the backends (of blocks checked)",
            f"{bad_stored} (of {checked})")
    if host is not None:
        figures(f"stack concurrency ({case}): host full: stores skipped / evictions",
                f"{host['stores_skipped']}/{host['evictions']}")
    if "disk full" in case:
        d = counters(stack, "disk")
        tmp_left = [p for p, _ in _disk_files(disk_root / "disk") if p.endswith(".tmp")]
        figures(f"stack concurrency ({case}): disk stores refused / failures / temp files left",
                f"{d['stores_skipped']}/{d['failures']}/{len(tmp_left)}")
        assert d["stores_skipped"] > 0 and tmp_left == [], (d, tmp_left)
    if kills:
        redis = counters(stack, "redis")
        figures(f"stack concurrency ({case}): redis faults / redis failures counted / stores skipped / "
                "hits after the last fault", f"{kills}/{redis['failures']}/{redis['stores_skipped']}/"
                f"{redis['hits'] - hits0}")
        assert kills >= 2 and redis["failures"] > 0, (kills, redis)
        assert redis["hits"] > hits0, "no hits from Redis after the last fault"
    assert hung == [], f"threads still running: {hung}"
    assert stats["errors"] == [], stats["errors"]
    assert stats["requests"] >= THREADS * REQUESTS and stats["timeouts"] == 0
    # A hung Redis costs a call at most a pooled-connection wait plus a reply wait, each timeout_s; a load
    # makes two calls (locate, get).
    assert stats["max_wait"] < 4 * REDIS_TIMEOUT + 1.0, stats["max_wait"]
    assert stats["wrong"] == 0 and stats["loaded"] > 0 and stats["stored"] > 0
    assert flushed and st["pending"] == 0 and st["index"]["pinned"] == 0, st
    assert bad_stored == 0 and checked > 0
    if host is not None:
        h = st["host"]
        assert h["writing"] == 0 and st["index"]["writing_down"] == 0 and h["ready"] + h["free"] == h["num_slots"], h
        assert host["stores_skipped"] + host["evictions"] > 0, "the host tier never filled: not the case tested"
