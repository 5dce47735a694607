"""Issue 6 item 6, first half: two processes writing and reading the same keys at the same time, on one
disk directory and on one Redis server.

Each process (``tests/_reliability/worker.py mix``) has its own backend instance and, for a few seconds,
alternates random batches of puts (its own versions) and gets over one shared set of 32 keys, so the
two constantly overwrite each other's blocks and read blocks the other is replacing.  Every hit is
checked byte for byte (``common.check``: the payload must be exactly the one derived from the key and
the version it carries, which must be one its writer really wrote).  Wrong reads must be 0, and each
process must have read blocks written by the other, or the test proved nothing.  The disk case runs
twice: with room for every key, and with a capacity of a third of them, so both processes evict files
the other is about to read or has just written.

Four processes churning one small directory check that ``capacity`` bounds the directory as a whole:
a sampler measures the real bytes on disk while they write, and one writer is killed with SIGKILL.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import pytest

WORKER = Path(__file__).parent / "_reliability" / "worker.py"
SECONDS = 2.5
NKEYS = 32
SIZE = 64 << 10


def _race(kind: str, target: str, capacity: str | None = None) -> list[dict[str, Any]]:
    args = [sys.executable, str(WORKER), "mix", kind, target, "--keys", str(NKEYS), "--size", str(SIZE),
            "--batch", "8", "--seconds", str(SECONDS)]
    if capacity:
        args += ["--capacity", capacity]
    procs = [subprocess.Popen([*args, "--id", str(i)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for i in (1, 2)]
    try:
        for p in procs:
            assert p.stdout is not None and p.stdin is not None  # Popen'd with PIPEs
            assert p.stdout.readline().strip() == "ready", "worker failed to start"
        for p in procs:
            assert p.stdin is not None  # both start together
            p.stdin.write("go\n")
            p.stdin.flush()
        out = [p.communicate(timeout=60)[0] for p in procs]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert [p.returncode for p in procs] == [0, 0]
    return [json.loads(o.strip().splitlines()[-1]) for o in out]


def _check(results: list[dict[str, Any]], label: str, figures) -> None:
    reads = sum(r["reads"] for r in results)
    hits = sum(r["hits"] for r in results)
    wrong = sum(r["wrong"] for r in results)
    cross = sum(r["hits_from"].get(str(3 - r["id"]), 0) for r in results)
    figures(f"wrong reads, 2 processes ({label})", wrong)
    figures(f"reads / hits / hits of the other process's writes ({label})", f"{reads}/{hits}/{cross}")
    figures(f"puts stored / refused ({label})",
            f"{sum(r['puts_ok'] for r in results)}/{sum(r['puts_refused'] for r in results)}")
    assert wrong == 0
    assert [r["errors"] for r in results] == [0, 0], [r["first_error"] for r in results]
    assert all(r["corrupt"] == 0 for r in results), "atomic replacement: no torn value is ever seen"
    by_id = {r["id"]: r for r in results}
    for r in results:  # every version read was really written by its writer
        for w, n in r["max_seen"].items():
            assert n <= by_id[int(w)]["last_version"]
        assert r["hits_from"].get(str(3 - r["id"]), 0) > 0, "each process must read the other's blocks"
    assert hits > 100


def test_two_processes_share_a_disk_directory(tmp_path, figures):
    _check(_race("disk", str(tmp_path / "shared")), "disk", figures)


def test_two_processes_share_a_small_disk_directory(tmp_path, figures):
    """Capacity for ~10 of the 32 keys: each process evicts files the other wrote or is reading."""
    results = _race("disk", str(tmp_path / "shared"), capacity=str(10 * (SIZE + 88)))
    _check(results, "disk, evicting", figures)
    files = [f for f in (tmp_path / "shared").rglob("*")  # blocks: not manifests, the ledger or the journal
             if f.is_file() and f.suffix != ".json" and not f.name.startswith(".kvtier-")]
    assert len(files) <= 10, "the capacity bounds the directory, both processes together"


WRITERS = 4
CHURN_SIZE = 64 << 10
CHURN_BLOCK = CHURN_SIZE + 88  # bytes of one stored block (header + payload)
CHURN_CAPACITY = 32 * CHURN_BLOCK


def _shard_bytes(shard: Path) -> int:
    """Bytes of every file in one shard directory (blocks and in-flight temp files), as they are now."""
    total = 0
    try:
        with os.scandir(shard) as it:
            for f in it:
                with contextlib.suppress(FileNotFoundError):  # evicted since the listing
                    total += f.stat(follow_symlinks=False).st_size
    except FileNotFoundError:
        pass
    return total


@pytest.mark.timeout(120)
def test_capacity_holds_for_a_directory_shared_by_four_writers(tmp_path, figures):
    """4 processes, each with the same capacity, churn new blocks into one directory; a sampler measures
    the real bytes on disk every ~2 ms.  The capacity bounds the directory, not each process's share:
    the peak may exceed it by at most one in-flight block per writer.  Halfway, one writer is killed with
    SIGKILL (holding reservations, maybe mid-rename): the others keep the bound, and the shared account
    ends equal to the bytes on disk."""
    from _reliability.common import NS  # the worker's namespace

    root = tmp_path / "shared"
    shard = root / NS.id / "00"  # every churned key's hash starts with byte 0: one directory holds them all
    args = [sys.executable, str(WORKER), "churn", "disk", str(root), "--capacity", str(CHURN_CAPACITY),
            "--size", str(CHURN_SIZE), "--batch", "4", "--threads", "2", "--seconds", "3"]
    procs = [subprocess.Popen([*args, "--id", str(i)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for i in range(WRITERS)]
    peak, samples = 0, 0
    try:
        for p in procs:
            assert p.stdout is not None and p.stdin is not None  # Popen'd with PIPEs
            assert p.stdout.readline().strip() == "ready", "worker failed to start"
        for p in procs:
            assert p.stdin is not None
            p.stdin.write("go\n")
            p.stdin.flush()
        start = time.monotonic()
        while any(p.poll() is None for p in procs):
            peak = max(peak, _shard_bytes(shard))
            samples += 1
            if procs[0].poll() is None and time.monotonic() - start > 1.5:
                procs[0].send_signal(signal.SIGKILL)
            time.sleep(0.002)
        out = [p.communicate(timeout=60)[0] for p in procs[1:]]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
    assert procs[0].returncode == -signal.SIGKILL
    results = [json.loads(o.strip().splitlines()[-1]) for o in out]
    stored = sum(r["stored"] for r in results)
    bound = CHURN_CAPACITY + WRITERS * CHURN_BLOCK
    figures("peak bytes on disk / capacity, 4 writers sharing a directory",
            f"{peak} / {CHURN_CAPACITY} bytes ({peak / CHURN_CAPACITY:.3f}x; bound capacity + 4 blocks = "
            f"{bound}; {samples} samples)")
    figures("blocks stored / refused by 4 writers sharing a directory",
            f"{stored}/{sum(r['refused'] for r in results)}")
    assert [r["errors"] for r in results] == [0] * (WRITERS - 1), [r["first_error"] for r in results]
    assert stored > 20 * CHURN_CAPACITY // CHURN_BLOCK, "the writers must really churn (evict many times over)"
    assert peak <= bound, f"peak {peak} bytes on disk > capacity {CHURN_CAPACITY} + {WRITERS} in-flight blocks"
    assert _shard_bytes(shard) <= CHURN_CAPACITY
    ledger = json.loads((root / ".kvtier-usage.json").read_text())
    assert ledger["held"] == {}, "the killed writer's reservation was dropped"
    assert ledger["bytes"] == _shard_bytes(shard), "the shared account matches the disk after the kill"


def test_two_processes_share_redis(redis_server, figures):
    _check(_race("redis", redis_server.url), "redis", figures)


if sys.platform == "win32":  # pragma: no cover
    pytestmark = pytest.mark.skip(reason="POSIX only")
