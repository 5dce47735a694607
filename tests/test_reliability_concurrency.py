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
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

WORKER = Path(__file__).parent / "_reliability" / "worker.py"
SECONDS = 2.5
NKEYS = 32
SIZE = 64 << 10


def _race(kind: str, target: str, capacity: str | None = None) -> list[dict]:
    args = [sys.executable, str(WORKER), "mix", kind, target, "--keys", str(NKEYS), "--size", str(SIZE),
            "--batch", "8", "--seconds", str(SECONDS)]
    if capacity:
        args += ["--capacity", capacity]
    procs = [subprocess.Popen([*args, "--id", str(i)], stdin=subprocess.PIPE, stdout=subprocess.PIPE,
                              text=True) for i in (1, 2)]
    try:
        for p in procs:
            assert p.stdout.readline().strip() == "ready", "worker failed to start"
        for p in procs:  # both start together
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


def _check(results: list[dict], label: str, figures) -> None:
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
    files = [f for f in (tmp_path / "shared").rglob("*") if f.is_file() and f.suffix != ".json"]
    assert len(files) <= 2 * 10, "each process keeps its own account under its capacity"


def test_two_processes_share_redis(redis_server, figures):
    _check(_race("redis", redis_server.url), "redis", figures)


if sys.platform == "win32":  # pragma: no cover
    pytestmark = pytest.mark.skip(reason="POSIX only")
