"""local_disk specifics: atomic files, capacity + LRU, restart, shared directories, path safety."""

import contextlib
import os
import socket
import subprocess
import sys
import textwrap
import threading
import time
from collections.abc import Iterator
from typing import Any

import pytest

from kvtier import plugins
from kvtier.backend_api import BackendError
from kvtier.backends._disk_ledger import HOST_TAG
from kvtier.backends.local_disk import LocalDiskBackend
from kvtier.config import parse_config
from kvtier.format import blockformat
from kvtier.keys import MANIFEST_NAME, Namespace

NS = Namespace("m", "bfloat16", 2, 2, 64, 16)
LID = NS.layout_id
H = blockformat.HEADER_SIZE


def mk(tmp_path, **opts):
    opts.setdefault("capacity", "1GiB")
    return LocalDiskBackend({"path": str(tmp_path / "d"), **opts})


def newkeys(n):
    return NS.keys([os.urandom(16) for _ in range(n)])


def get(b, key, size):
    buf = bytearray(size)
    return bytes(buf) if b.get_into([key], [buf], LID) == [True] else None


def disk_bytes(root):
    return sum(os.path.getsize(os.path.join(d, f)) for d, _, fs in os.walk(root) for f in fs
               if not (f.startswith(".kvtier-") or f.endswith(".json")))  # ledger, journal, manifests


# ------------------------------------------------------------------ options and registry


def test_registered_as_entry_point():
    assert plugins.load("backend", "local_disk") is LocalDiskBackend


def test_options(tmp_path, monkeypatch):
    monkeypatch.setenv("KVT_DIR", str(tmp_path))
    b = LocalDiskBackend({"path": "$KVT_DIR/x", "capacity": "2GiB", "threads": 2})
    assert b.root == str(tmp_path / "x") and b.capacity == 2 * 2**30 and os.path.isdir(b.root)
    assert LocalDiskBackend.Options(path="~/y").path == os.path.expanduser("~/y")
    with pytest.raises(ValueError, match="size"):
        LocalDiskBackend.Options(path=str(tmp_path), capacity="2 gallons")
    with pytest.raises(ValueError, match="extra"):
        LocalDiskBackend.Options(path=str(tmp_path), capcity=1)


# ------------------------------------------------------------------ layout and atomicity


def test_layout_is_sharded(tmp_path):
    b = mk(tmp_path)
    k = newkeys(1)[0]
    b.put([k], [b"x" * 10], LID)
    ns, h = k.split("/")
    assert os.path.getsize(os.path.join(b.root, ns, h[:2], h)) == H + 10


def test_temp_files_are_never_blocks_and_are_cleaned_by_a_rebuild(tmp_path):
    """Temp files no writer announced (planted, or left by an older kvtier) are never blocks; the index
    rebuild (the one full scan: here the ledger file is lost) removes those of dead writers.  A killed
    writer's own temp files go at the next start-up without a scan (test_killed_writer_leaves_no_block)."""
    b = mk(tmp_path)
    k = newkeys(1)[0]
    ns, h = k.split("/")
    shard = os.path.join(b.root, ns, h[:2])
    os.makedirs(shard)
    dead = os.path.join(shard, f".{h}.{HOST_TAG}.999999999.0.tmp")  # no such pid
    alive = os.path.join(shard, f".{h}.{HOST_TAG}.{os.getpid()}.0.tmp")
    stale = os.path.join(shard, f".{h}.0badf00d.1.0.tmp")  # another host's, old
    for p in (dead, alive, stale):
        with open(p, "wb") as f:
            f.write(b"half a block")
    os.utime(stale, (time.time() - 7200, time.time() - 7200))
    assert b.exists([k]) == [False] and get(b, k, 10) is None and list(b.scan()) == []
    os.unlink(os.path.join(b.root, ".kvtier-usage.json"))
    b2 = mk(tmp_path)
    assert not os.path.exists(dead) and not os.path.exists(stale)
    assert os.path.exists(alive), "a live writer's temp file must survive another instance's start-up"
    assert b2.stats().extra["blocks"] == 0


def test_killed_writer_leaves_no_block(tmp_path):
    """A writer killed between writing its temp file and renaming it: nothing visible, temp cleaned."""
    root = str(tmp_path / "d")
    k = newkeys(1)[0]
    code = textwrap.dedent(f"""
        import os, signal
        from kvtier.backends.local_disk import LocalDiskBackend
        b = LocalDiskBackend({{"path": {root!r}}})
        os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)
        b.put([{k!r}], [os.urandom(1 << 20)], {LID})
    """)
    r = subprocess.run([sys.executable, "-c", code], timeout=60)
    assert r.returncode == -9
    ns, h = k.split("/")
    assert [f for f in os.listdir(os.path.join(root, ns, h[:2])) if f.endswith(".tmp")]
    b = LocalDiskBackend({"path": root})
    assert b.exists([k]) == [False] and get(b, k, 1 << 20) is None
    assert os.listdir(os.path.join(root, ns, h[:2])) == []


# ------------------------------------------------------------------ capacity and LRU


def test_capacity_evicts_lru(tmp_path):
    size = 1000
    b = mk(tmp_path, capacity=10 * (H + size))
    ks = newkeys(30)
    for i, k in enumerate(ks):
        assert b.put([k], [os.urandom(size)], LID) == [True]
        if i == 24:
            assert get(b, ks[15], size) is not None  # the oldest of ks[15..24] becomes the most recent
        u = b.stats().extra
        assert u["bytes"] <= b.capacity and disk_bytes(b.root) <= b.capacity
    present = b.exists(ks)
    assert sum(present) == 10 and present[-9:] == [True] * 9
    assert present[15] and not present[20], "a block read recently outlives older unread ones"


def test_capacity_evictions_are_told_to_the_owner(tmp_path):
    """The keys a put evicts reach ``on_evicted``, oldest first, once they are gone, and after the
    directory's lock is released (the listener may use the backend); a put that evicts nothing tells
    nothing."""
    size = 1000
    b = mk(tmp_path, capacity=4 * (H + size))
    told: list[list[str]] = []
    extra = newkeys(1)

    def listener(keys):
        told.append(keys)
        assert b.exists(keys) == [False] * len(keys)
        if len(told) == 1:  # no deadlock: this put evicts again, and is told again
            assert b.put(extra, [os.urandom(size)], LID) == [True]

    ks = newkeys(6)
    assert b.put(ks[:3], [os.urandom(size)] * 3, LID) == [True] * 3
    b.on_evicted = listener
    assert b.put(ks[3:4], [os.urandom(size)], LID) == [True]  # fits: nothing evicted
    assert told == []
    assert b.put(ks[4:6], [os.urandom(size)] * 2, LID) == [True] * 2
    assert told == [[ks[0], ks[1]], [ks[2]]]
    assert b.exists([*ks, *extra]) == [False, False, False, True, True, True, True]


def test_a_failing_eviction_listener_never_fails_the_put(tmp_path, caplog):
    size = 1000
    b = mk(tmp_path, capacity=2 * (H + size))

    def listener(keys):
        raise RuntimeError("listener broke")

    b.on_evicted = listener
    ks = newkeys(3)
    assert b.put(ks[:2], [os.urandom(size)] * 2, LID) == [True] * 2
    assert b.put(ks[2:], [os.urandom(size)], LID) == [True]  # evicts the first; the listener raises
    assert b.exists(ks) == [False, True, True]
    assert "the eviction listener failed: listener broke" in caplog.text


def test_held_keys_are_never_evicted_until_released(tmp_path):
    """A load holds the keys it will read: puts evict around them (the next least recently used), a put
    that could only make room by evicting held keys is refused, and each hold needs its release."""
    size = 1000
    b = mk(tmp_path, capacity=3 * (H + size))
    ks = newkeys(7)
    assert b.put(ks[:3], [os.urandom(size)] * 3, LID) == [True] * 3
    b.hold(ks[:2])
    b.hold(ks[:1])  # a second load of the first block
    assert b.put(ks[3:4], [os.urandom(size)], LID) == [True]
    assert b.exists(ks[:4]) == [True, True, False, True]  # ks[2], not the held ks[0], ks[1]
    b.hold(ks[3:4])
    assert b.put(ks[4:5], [os.urandom(size)], LID) == [False]  # all three held: no room, nothing lost
    assert b.exists(ks[:5]) == [True, True, False, True, False]
    b.release(ks[:2])
    assert b.put(ks[4:5], [os.urandom(size)], LID) == [True]  # ks[1] is free again; ks[0] still held once
    assert b.exists(ks[:5]) == [True, False, False, True, True]
    b.release(ks[:1])
    b.release(ks[3:4])
    assert b.put(ks[5:7], [os.urandom(size)] * 2, LID) == [True] * 2
    assert b.exists(ks) == [False, False, False, False, True, True, True]


def test_a_put_refused_because_all_room_is_held_scans_no_directory(tmp_path, monkeypatch):
    """Every block held by loads: a put is refused without a directory scan (before the shared index, each
    refused put recounted the whole directory); once another process's blocks are on disk, the next put
    evicts those, known from the shared index, again without a scan."""
    size = 1000
    b = mk(tmp_path, capacity=3 * (H + size))
    ks = newkeys(6)
    assert b.put(ks[:3], [os.urandom(size)] * 3, LID) == [True] * 3
    # A start-up scan orders blocks by file times, which a loaded machine gives in coarse ticks (three
    # writes in one tick tie, in directory order): ks[0] is made the oldest by hand.
    t = time.time() - 60
    for i, k in enumerate(ks[:3]):
        os.utime(b._where(k)[1], (t + i, t + i))
    b.hold(ks[:3])
    from kvtier.backends import local_disk as ld

    scans = []
    real = ld.scan_shard
    monkeypatch.setattr(ld, "scan_shard", lambda *a: scans.append(1) or real(*a))  # type: ignore[func-returns-value]
    for k in ks[3:5]:
        assert b.put([k], [os.urandom(size)], LID) == [False]
    assert scans == []
    b.release(ks[:1])
    other = mk(tmp_path, capacity=3 * (H + size))  # another process's writer over the same directory
    assert other.put(ks[5:6], [os.urandom(size)], LID) == [True]  # it evicts ks[0], the one not held
    other.close()
    assert b.exists(ks) == [False, True, True, False, False, True]
    assert b.put(ks[3:4], [os.urandom(size)], LID) == [True]  # ks[5]: from the shared index
    assert scans == []
    assert b.exists(ks) == [False, True, True, True, False, False]
    b.release(ks[1:3])


def test_block_bigger_than_capacity_is_refused(tmp_path):
    b = mk(tmp_path, capacity=1000)
    assert b.put(newkeys(1), [os.urandom(2000)], LID) == [False]
    assert b.stats().put_failures == 1 and b.stats().extra["bytes"] == 0


def test_capacity_holds_under_concurrent_puts(tmp_path):
    size = 4096
    b = mk(tmp_path, capacity=20 * (H + size), threads=4)
    stop = threading.Event()
    over: list[int] = []

    def monitor():
        while not stop.is_set():
            used = b.stats().extra["bytes"]
            if used > b.capacity:
                over.append(used)

    def writer():
        for _ in range(20):
            ks = newkeys(8)
            b.put(ks, [os.urandom(size) for _ in ks], LID)

    m = threading.Thread(target=monitor)
    m.start()
    ws = [threading.Thread(target=writer) for _ in range(8)]
    for w in ws:
        w.start()
    for w in ws:
        w.join()
    stop.set()
    m.join()
    assert not over and disk_bytes(b.root) <= b.capacity
    assert b.stats().extra["bytes"] == disk_bytes(b.root)


def test_manifests_are_not_evicted(tmp_path):
    b = mk(tmp_path, capacity=3 * (H + 100))
    b.put_manifest(NS)
    for _ in range(10):
        b.put(newkeys(1), [os.urandom(100)], LID)
    assert b.get_manifest(NS.id) == NS.manifest()


@pytest.mark.parametrize("raw", [b"[1, 2]", b'"model"', b"{not json"])
def test_a_stored_manifest_that_is_not_a_json_object_is_no_manifest(tmp_path, raw):
    b = mk(tmp_path)
    b._write_small(f"{NS.id}/{MANIFEST_NAME}", raw)  # what another writer, or a torn copy, left
    assert b.get_manifest(NS.id) is None
    b.put_manifest(NS)
    assert b.get_manifest(NS.id) == NS.manifest()


# ------------------------------------------------------------------ restart


def test_restart_keeps_hits_and_lru_order(tmp_path):
    size = 500
    b = mk(tmp_path, capacity=10 * (H + size))
    ks = newkeys(10)
    data = [os.urandom(size) for _ in ks]
    for i, (k, d) in enumerate(zip(ks, data)):
        b.put([k], [d], LID)
        t = 1_000_000 + i  # an explicit order, immune to coarse timestamps
        os.utime(b._where(k)[1], (t, t))
    b.close()
    b2 = mk(tmp_path, capacity=10 * (H + size))
    assert b2.stats().extra["blocks"] == 10 and b2.stats().extra["bytes"] == 10 * (H + size)
    b2.close()
    b3 = mk(tmp_path, capacity=5 * (H + size))  # shrunk: the oldest go first, at start-up
    assert b3.exists(ks) == [False] * 5 + [True] * 5
    assert all(get(b3, k, size) == d for k, d in zip(ks[5:], data[5:]))


def test_startup_with_20k_blocks(tmp_path):
    b = mk(tmp_path)
    n = 20_000
    for _ in range(0, n, 1000):
        assert all(b.put(newkeys(1000), [os.urandom(64) for _ in range(1000)], LID))
    b.close()
    b2 = mk(tmp_path)
    print(f"\nlocal_disk start-up with {n} blocks: {b2.startup_seconds * 1000:.0f} ms")
    assert b2.stats().extra["blocks"] == n
    assert b2.startup_seconds < 20


# ------------------------------------------------------------------ sharing a directory


def test_two_instances_share_a_directory(tmp_path):
    a, b = mk(tmp_path), mk(tmp_path)  # b starts before a writes anything
    ks = newkeys(3)
    data = [os.urandom(300) for _ in ks]
    a.put(ks, data, LID)
    assert b.contains_prefix(ks) == 3
    assert all(get(b, k, 300) == d for k, d in zip(ks, data))
    assert b.stats().extra["blocks"] == 3, "blocks read from another writer are adopted"
    assert b.delete([ks[0]]) == 1
    assert get(a, ks[0], 300) is None and a.stats().extra["blocks"] == 2, "vanished files are forgotten"
    assert a.stats().corrupt == 0


def test_evicting_files_another_process_removed(tmp_path):
    size = 100
    a = mk(tmp_path, capacity=3 * (H + size))
    ks = newkeys(3)
    a.put(ks, [os.urandom(size) for _ in ks], LID)
    for k in ks:
        os.unlink(a._where(k)[1])  # gone behind a's back
    assert a.put(newkeys(2), [os.urandom(size), os.urandom(size)], LID) == [True, True]
    assert a.stats().extra["bytes"] <= a.capacity


# ------------------------------------------------------------------ path safety

BAD_KEYS = [
    "../../etc/passwd",
    f"{NS.id}/../../{'0' * 32}",
    f"/{NS.id}/{'0' * 32}",
    f"{NS.id}/{'A' * 32}",  # upper case would alias on case-insensitive filesystems
    f"{NS.id}/{'0' * 32}/x",
    f"{NS.id}/{'0' * 31}",
    f"{NS.id}/{'0' * 32}\n",
    f"{NS.id}/{'0' * 16}\x00{'0' * 15}",
    f"{NS.id}/.{'0' * 31}",
]


@pytest.mark.parametrize("key", BAD_KEYS)
def test_keys_cannot_escape_the_root(tmp_path, key):
    b = mk(tmp_path)
    for op in (lambda: b.exists([key]), lambda: b.get_into([key], [bytearray(8)], LID),
               lambda: b.delete([key]), lambda: b.put([key], [b"x" * 8], LID)):
        with pytest.raises((ValueError, BackendError)) as e:
            op()
        assert repr(key) in str(e.value), str(e.value)
    assert not os.path.exists(tmp_path / "etc")


def test_symlinks_are_not_followed(tmp_path):
    b = mk(tmp_path)
    k = newkeys(1)[0]
    secret = tmp_path / "secret"
    secret.write_bytes(b"s" * (H + 8))
    path = b._where(k)[1]
    os.makedirs(os.path.dirname(path))
    os.symlink(secret, path)
    assert get(b, k, 8) is None
    assert secret.read_bytes() == b"s" * (H + 8)


def test_use_after_close_is_a_typed_error(tmp_path):
    b = mk(tmp_path)
    b.close()
    with pytest.raises(BackendError, match="closed"):
        b.exists(newkeys(1))
    assert b.health() is False


def test_two_processes_writing_and_evicting_one_directory(tmp_path):
    """A prefill-like writer process and this process share a small directory: both evict, neither
    ever reads a torn or foreign value (corrupt stays 0), and reads of the other's blocks succeed."""
    root, size = str(tmp_path / "d"), 64 * 1024
    cap = 40 * (H + size)
    code = textwrap.dedent(f"""
        import os, sys
        from kvtier.backends.local_disk import LocalDiskBackend
        from kvtier.keys import Namespace
        ns = Namespace("m", "bfloat16", 2, 2, 64, 16)
        b = LocalDiskBackend({{"path": {root!r}, "capacity": {cap}}})
        for i in range(60):
            h = i.to_bytes(16, "big")
            assert b.put([ns.key(h)], [bytes([i % 251 + 1]) * {size}], ns.layout_id) == [True]
        print(b.stats().corrupt)
    """)
    b = LocalDiskBackend({"path": root, "capacity": cap})
    child = subprocess.Popen([sys.executable, "-c", code], stdout=subprocess.PIPE, text=True)
    seen = 0
    while child.poll() is None or seen == 0:
        for i in range(60):
            k = NS.key(i.to_bytes(16, "big"))
            got = get(b, k, size)
            if got is not None:
                assert got == bytes([i % 251 + 1]) * size
                seen += 1
        mine = newkeys(4)
        b.put(mine, [os.urandom(size) for _ in mine], LID)
    out, _ = child.communicate(timeout=60)
    assert child.returncode == 0 and out.strip() == "0"
    assert seen > 0 and b.stats().corrupt == 0
    assert b.stats().extra["bytes"] <= cap


def test_bench_backends_disk_smoke(tmp_path, monkeypatch, capsys):
    import json

    from kvtier.tools.bench import backend_disk
    from kvtier.tools.cli import main

    monkeypatch.setattr(backend_disk, "STARTUP_BLOCKS", 2000)
    out = tmp_path / "b.json"
    assert main(["bench", "backends", "--backends", "disk,nosuch", "--block-sizes", "256KiB",
                 "--total", "4MiB", "--repeats", "1", "--json", str(out)]) == 0
    text = capsys.readouterr().out
    assert "SKIP nosuch" in text and "disk" in text
    res = json.loads(out.read_text())
    rows = res["rows"]
    assert {(r["op"], r["block_bytes"]) for r in rows} == {(op, 262144) for op in
                                                           ("put", "get", "put full", "put fsync", "get cold")}
    assert all(r["ratio"] > 0 and r["gib_s"] > 0 and r["ceiling_gib_s"] > 0 for r in rows)
    # get rows: beside raw readv and raw readv + xxh3, each with its ratio
    assert all(r["ceiling_xxh3_gib_s"] > 0 and r["ratio_vs_ceiling_xxh3"] > 0 for r in rows)
    assert res["summary"]["disk_get_median_ratio"] > 0 and "startup_2k_blocks_s" in rows[-1]
    assert res["summary"]["disk_put_full_median_ratio"] > 0
    full = next(r for r in rows if r["op"] == "put full")
    assert "every put evicts one" in full["note"] and "unlink the oldest" in full["note"]


def test_symlinked_shard_directory_is_refused(tmp_path):
    import numpy as np

    root, outside = tmp_path / "root", tmp_path / "outside"
    outside.mkdir()
    be = LocalDiskBackend({"path": str(root)})
    h = bytes(range(32))
    key = NS.key(h)
    shard = root / NS.id / h.hex()[:2]
    shard.parent.mkdir(parents=True)
    shard.symlink_to(outside, target_is_directory=True)
    with pytest.raises(BackendError, match="a symbolic link inside the root"):
        be.put([key], [np.arange(64, dtype=np.uint8)], 7)
    assert list(outside.iterdir()) == []  # nothing was written through the link
    be.close()


# ------------------------------------------------------------------ special files under a block's name


def _plant_special(path: str, kind: str, keep: list[socket.socket]) -> None:
    """A FIFO, a listening unix socket or an empty directory at ``path`` (its directory made first)."""
    os.makedirs(os.path.dirname(path), exist_ok=True)
    if kind == "fifo":
        os.mkfifo(path)
    elif kind == "socket":  # bound by its short name: a socket path is limited to ~100 bytes
        cwd = os.getcwd()
        os.chdir(os.path.dirname(path))
        try:
            s = socket.socket(socket.AF_UNIX)
            s.bind(os.path.basename(path))
            s.listen()
            keep.append(s)
        finally:
            os.chdir(cwd)
    else:
        os.mkdir(path)


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["fifo", "socket", "directory"])
def test_special_file_under_a_block_name_is_corrupt_not_a_hang(tmp_path, kind):
    """open() of a FIFO blocks until a writer comes: a load must never wait on one.  Whatever is not a
    regular file is a corrupt entry: a miss, counted, removed; the other keys of the batch are served."""
    b = mk(tmp_path)
    good, bad = newkeys(2)
    data = os.urandom(64)
    assert b.put([good], [data], LID) == [True]
    path = b._where(bad)[1]
    sockets: list[socket.socket] = []
    _plant_special(path, kind, sockets)
    try:
        bufs = [bytearray(64), bytearray(64)]
        assert b.get_into([bad, good], bufs, LID) == [False, True] and bytes(bufs[1]) == data
        s = b.stats()
        assert (s.corrupt, s.misses, s.hits) == (1, 1, 1)
        assert not os.path.lexists(path), f"the {kind} was not removed"
        assert b.put([bad], [data], LID) == [True] and get(b, bad, 64) == data  # the name is usable again
    finally:
        for s in sockets:
            s.close()
    b.close()


@pytest.mark.timeout(30)
@pytest.mark.parametrize("kind", ["fifo", "socket", "directory"])
def test_special_file_under_a_block_name_is_counted_and_removed_by_a_lookup(tmp_path, kind):
    """A lookup (``exists`` / ``contains_prefix``, what the stack and the scheduler ask) that meets a
    special file under a block's name counts it as corrupt and removes it, as a read would: a lookup says
    the block is absent, so no read would ever come to find it."""
    b = mk(tmp_path)
    good, bad = newkeys(2)
    assert b.put([good], [os.urandom(64)], LID) == [True]
    path = b._where(bad)[1]
    sockets: list[socket.socket] = []
    _plant_special(path, kind, sockets)
    try:
        assert b.exists([good, bad]) == [True, False]
        assert b.stats().corrupt == 1 and not os.path.lexists(path), f"the {kind} was not removed"
        _plant_special(path, kind, sockets)
        assert b.contains_prefix([good, bad]) == 1
        assert b.stats().corrupt == 2 and not os.path.lexists(path)
    finally:
        for s in sockets:
            s.close()
    b.close()


def test_a_fifo_under_a_block_name_is_counted_and_removed_by_the_stacks_lookup(tmp_path):
    from kvtier.stack import TierStack

    cfg = parse_config({"model": {"id": "t", "kv_dtype": "float32", "num_layers": 1, "num_kv_heads": 1,
                                  "head_dim": 4, "block_size": 2},
                        "device": {"kind": "cpu", "num_blocks": 4}, "host": {"capacity": 0},
                        "backends": [{"name": "disk", "type": "local_disk", "options": {"path": str(tmp_path)}}]})
    disk = LocalDiskBackend({"path": str(tmp_path)}, name="disk")
    with TierStack(cfg, backends=[disk]) as st:
        hashes = st.namespace.hasher().hash_blocks([1, 2, 3, 4])
        path = disk._where(st.namespace.keys(hashes[:1])[0])[1]
        _plant_special(path, "fifo", [])
        assert st.lookup(hashes).num_blocks == 0
        assert st.stats()["backends"]["disk"]["corrupt"] == 1 and not os.path.lexists(path)
    disk.close()


# ------------------------------------------------------------------ holds across processes

_PUTTER = """
import os, sys
from kvtier.backends.local_disk import LocalDiskBackend
from kvtier.keys import Namespace
ns = Namespace("m", "bfloat16", 2, 2, 64, 16)
b = LocalDiskBackend({"path": sys.argv[1], "capacity": int(sys.argv[2])})
took = [b.put([k], [os.urandom(64)], ns.layout_id)[0] for k in ns.keys([os.urandom(16) for _ in range(int(sys.argv[3]))])]
print(sum(took))
b.close()
"""


def _put_elsewhere(root, capacity: int, n: int) -> int:
    """Another process puts ``n`` new blocks into the directory; how many it stored."""
    out = subprocess.run([sys.executable, "-c", _PUTTER, str(root), str(capacity), str(n)], check=True,
                         capture_output=True, text=True, timeout=120)
    return int(out.stdout.strip())


def test_a_hold_keeps_another_processes_puts_from_evicting_the_blocks(tmp_path):
    """Process A holds 4 blocks for a read; process B fills the shared directory: B evicts other blocks, or
    is refused when only held ones are left, never a held one.  Once A releases them, B may evict them."""
    cap = 8 * (H + 64)
    a = mk(tmp_path, capacity=cap)
    mine = newkeys(4)
    data = [os.urandom(64) for _ in mine]
    assert a.put(mine, data, LID) == [True] * 4
    a.hold(mine)
    try:
        assert _put_elsewhere(tmp_path / "d", cap, 12) == 12  # 4 of the room are B's, evicted in turn
        assert [get(a, k, 64) for k in mine] == data
        assert _put_elsewhere(tmp_path / "d", cap, 0) == 0
        # Only held blocks and B's own left: B evicts its own; a directory of held blocks only refuses.
        full = LocalDiskBackend({"path": str(tmp_path / "d"), "capacity": 4 * (H + 64)})
        assert full.put(newkeys(1), [os.urandom(64)], LID) == [False]
        full.close()
    finally:
        a.release(mine)
    assert _put_elsewhere(tmp_path / "d", cap, 8) == 8
    assert [get(a, k, 64) for k in mine] == [None] * 4  # released: evicted like any block
    a.close()


def test_a_dead_holders_blocks_are_evictable(tmp_path):
    cap = 4 * (H + 64)
    root = tmp_path / "d"
    code = ("import os, sys\nfrom kvtier.backends.local_disk import LocalDiskBackend\n"
            "from kvtier.keys import Namespace\nns = Namespace('m', 'bfloat16', 2, 2, 64, 16)\n"
            f"b = LocalDiskBackend({{'path': {str(root)!r}, 'capacity': {cap}}})\n"
            "ks = ns.keys([os.urandom(16) for _ in range(4)])\n"
            "b.put(ks, [os.urandom(64) for _ in ks], ns.layout_id)\nb.hold(ks)\nos._exit(0)\n")
    subprocess.run([sys.executable, "-c", code], check=True, timeout=120)  # dies holding 4 blocks
    assert _put_elsewhere(root, cap, 4) == 4  # its holds are dropped: its blocks evicted
    assert not any((root / ".kvtier-holds").iterdir())


# ------------------------------------------------------------------ the shared ledger (capacity of a directory)


def test_capacity_bounds_the_directory_not_each_instance(tmp_path):
    """Two instances (as two processes would) share one capacity: the second one's writes evict the first
    one's blocks instead of adding a second capacity's worth."""
    size = 1000
    a, b = mk(tmp_path, capacity=10 * (H + size)), mk(tmp_path, capacity=10 * (H + size))
    ka, kb = newkeys(8), newkeys(8)
    assert a.put(ka, [os.urandom(size) for _ in ka], LID) == [True] * 8
    assert b.put(kb, [os.urandom(size) for _ in kb], LID) == [True] * 8
    assert disk_bytes(a.root) == 10 * (H + size) == b.stats().extra["bytes"] == a.stats().extra["bytes"]
    assert sum(b.exists(ka)) == 2 and b.exists(kb) == [True] * 8, "b evicted a's oldest blocks"


def test_exists_answers_from_the_directory_not_from_what_this_instance_wrote(tmp_path):
    """A block this instance wrote and another one (another process on the directory: vLLM's worker beside
    its scheduler) deleted as corrupt or evicted is reported missing, and dropped from this instance's
    eviction order; one the other wrote is reported present."""
    a, b = mk(tmp_path), mk(tmp_path)
    ks = newkeys(4)
    assert a.put(ks[:3], [os.urandom(1000) for _ in range(3)], LID) == [True] * 3
    assert b.delete([ks[1]]) == 1
    assert b.put([ks[3]], [os.urandom(1000)], LID) == [True]
    assert a.exists(ks) == [True, False, True, True]
    assert ks[1] not in {s.key for s in a._eviction_order()}
    a.close()
    b.close()


def _ledger(root) -> dict[str, Any]:
    import json

    ledger: dict[str, Any] = json.loads((root / ".kvtier-usage.json").read_text())
    return ledger


def _intents(b) -> int:
    """Intents in the directory's index (each names a file change a writer announced)."""
    import sqlite3

    with contextlib.closing(sqlite3.connect(b.stats().extra["index"])) as c:
        n: int = c.execute("SELECT count(*) FROM intents").fetchone()[0]
    return n


def _no_scans(monkeypatch):
    from kvtier.backends import local_disk as ld

    def scan(*a):
        raise AssertionError("a directory scan")

    monkeypatch.setattr(ld, "scan_shard", scan)


@pytest.mark.timeout(60)
def test_ledger_survives_a_writer_killed_between_rename_and_account(tmp_path, monkeypatch):
    """kill -9 of a writer after its batch's renames and before the index records them: its reservation
    stays (its intents name the four blocks and their temp files) and its blocks are not counted.  The
    next process that needs room finds that writer dead, re-reads just those four files (no scan of the
    directory), and the account matches the disk again; the whole capacity stays usable."""
    size = 1000
    cap = 10 * (H + size)
    root = tmp_path / "d"
    a = LocalDiskBackend({"path": str(root), "capacity": cap})  # running before and after the kill
    code = textwrap.dedent(f"""
        import os, signal
        from kvtier.backends import _disk_index, local_disk
        from kvtier.keys import Namespace
        ns = Namespace("m", "bfloat16", 2, 2, 64, 16)
        b = local_disk.LocalDiskBackend({{"path": {str(root)!r}, "capacity": {cap}}})
        def put(self, c, entries, *a, **k):  # the batch's second session: renames done, not yet recorded
            os.kill(os.getpid(), signal.SIGKILL)
        _disk_index.DiskIndex.put = put
        b.put([ns.key(bytes([i]) * 16) for i in range(4)], [os.urandom({size})] * 4, ns.layout_id)
    """)
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == -9
    led = _ledger(root)
    assert led["bytes"] == 0 and sum(n for n, _ in led["held"].values()) == 4 * (H + size)
    assert disk_bytes(root) == 4 * (H + size), "the killed writer's blocks are on disk, unaccounted"
    assert _intents(a) == 4
    _no_scans(monkeypatch)
    ks = newkeys(10)
    for k in ks:  # a whole capacity of new blocks: needs the dead writer's room and its blocks' room
        assert a.put([k], [os.urandom(size)], LID) == [True]
        assert disk_bytes(root) <= cap
    assert _ledger(root)["held"] == {} and _intents(a) == 0
    assert a.stats().extra["bytes"] == disk_bytes(root) == cap
    assert a.exists(ks) == [True] * 10


@pytest.mark.timeout(60)
@pytest.mark.parametrize("how", ["evicting", "deleting"])
def test_ledger_survives_a_writer_killed_between_unlink_and_account(tmp_path, how, monkeypatch):
    """kill -9 of a writer, with nothing else in flight, right after it unlinked a block (evicting for a
    put, or deleting) and before the index records it: its intent names the block (committed before the
    unlink), or the index would count the freed bytes for ever.  The next process that needs room
    re-reads that one file, and the account matches the disk again."""
    size = 1000
    cap = 4 * (H + size)
    root = tmp_path / "d"
    a = LocalDiskBackend({"path": str(root), "capacity": cap, "removals_poll_s": 0.05})
    told: list[str] = []
    a.on_evicted = told.extend
    full = newkeys(4)
    assert a.put(full, [os.urandom(size)] * 4, LID) == [True] * 4
    assert {k: v for k, v in _ledger(root).items() if k != "index"} == {"bytes": cap, "held": {}}
    code = textwrap.dedent(f"""
        import os, signal
        from kvtier.backends import local_disk
        from kvtier.keys import Namespace
        ns = Namespace("m", "bfloat16", 2, 2, 64, 16)
        b = local_disk.LocalDiskBackend({{"path": {str(root)!r}, "capacity": {cap}}})
        real = local_disk._unlink_sized
        def unlink_then_die(path):
            out = real(path)
            os.kill(os.getpid(), signal.SIGKILL)
            return out
        local_disk._unlink_sized = unlink_then_die
        if {how!r} == "evicting":
            b.put([ns.key(bytes([7]) * 16)], [os.urandom({size})], ns.layout_id)
        else:
            b.delete([{str(full[0])!r}])
    """)
    assert subprocess.run([sys.executable, "-c", code], timeout=60).returncode == -9
    assert disk_bytes(root) == 3 * (H + size), "the killed writer unlinked one block"
    assert _intents(a) == 1, "the writer named the block before unlinking it"
    _no_scans(monkeypatch)
    ks = newkeys(2)
    assert a.put(ks, [os.urandom(size)] * 2, LID) == [True, True]
    assert _ledger(root)["held"] == {} and _intents(a) == 0
    assert _ledger(root)["bytes"] == disk_bytes(root) <= cap
    # The dead writer's unlink never reached the removal journal: the recoverer notes it there, and tells
    # its own listener (with its own eviction), once.
    from kvtier.backends.local_disk import JOURNAL_NAME

    assert (root / JOURNAL_NAME).read_text().count(full[0]) == 1
    time.sleep(0.2)
    assert sorted(told) == sorted(full[:2])
    a.close()


@pytest.mark.timeout(60)
def test_ledger_missing_or_torn_is_recounted(tmp_path):
    size = 1000
    a = mk(tmp_path, capacity=10 * (H + size))
    ks = newkeys(6)
    a.put(ks, [os.urandom(size) for _ in ks], LID)
    ledger = tmp_path / "d" / ".kvtier-usage.json"
    for damage in (lambda: ledger.unlink(), lambda: ledger.write_text('{"bytes": 12, "he'),
                   lambda: ledger.write_text('{"bytes": -5, "held": {}}')):
        damage()
        assert a.stats().extra["bytes"] == 6 * (H + size) == _ledger(tmp_path / "d")["bytes"]


def test_a_key_twice_in_one_batch_is_accounted_once(tmp_path):
    b = mk(tmp_path, capacity=10 * (H + 100))
    k, other = newkeys(2)
    first, last = os.urandom(100), os.urandom(100)
    assert b.put([k, other, k], [first, os.urandom(100), last], LID) == [True] * 3
    assert get(b, k, 100) == last
    assert b.stats().extra["bytes"] == disk_bytes(b.root) == 2 * (H + 100)
    assert not [f for _, _, fs in os.walk(b.root) for f in fs if f.endswith(".tmp")]


@pytest.mark.parametrize("segmented", [False, True])
def test_short_reads_are_continued_and_the_value_checked_whole(tmp_path, monkeypatch, segmented):
    """A filesystem that returns short reads (network filesystems do): the value is read on from where the
    read stopped, its checksum taken over the whole payload afterwards, and a flipped byte still fails
    it.  Values span several hashed groups (blockformat.HASH_GROUP_BYTES), read at most 100 KiB a call."""
    import kvtier.backends.local_disk as ld

    b = mk(tmp_path)
    size = 2 * blockformat.HASH_GROUP_BYTES + 12345
    k1, k2 = newkeys(2)
    data = os.urandom(size)
    assert b.put([k1, k2], [data, data], LID) == [True, True]
    real = os.preadv
    calls = []

    def short(fd, bufs, offset):
        left, views = 100 << 10, []
        bufs_viewed: Iterator[memoryview] = map(memoryview, bufs)
        for v in bufs_viewed:
            views.append(v[:left])
            left -= views[-1].nbytes
            if not left:
                break
        calls.append(offset)
        return real(fd, views, offset)

    monkeypatch.setattr(ld.os, "preadv", short)
    if segmented:
        bufs = [bytearray(1000), bytearray(size - 1000)]
        assert b.get_into([k1], [blockformat.Segments([memoryview(x) for x in bufs])], LID) == [True]
        assert b"".join(bufs) == data
    else:
        assert get(b, k1, size) == data
    assert len(calls) > size // (100 << 10)  # it was read in short pieces
    # damage k2's payload on disk: the whole-payload check after short reads still catches it
    where = b._check_keys([k2])[0][1]
    with open(where, "r+b") as f:
        f.seek(H + size - 1)
        last = f.read(1)
        f.seek(H + size - 1)
        f.write(bytes([last[0] ^ 1]))
    assert get(b, k2, size) is None


@pytest.mark.parametrize("aligned", [True, False])
def test_segments_are_read_a_hashed_group_at_a_time_and_a_buffer_in_one_read(tmp_path, monkeypatch, aligned):
    """Why each: segments (a block read straight into KV tensors) are hashed while in cache, a group of
    blockformat.HASH_GROUP_BYTES a read; one buffer (a host slot) is one read, measured faster here.  An
    aligned value (4096-byte header) is read whole header page and payload, its size known from fstat
    (no probe byte); an 88-byte one header, payload and a probe byte past the end.  (A page-cache read:
    the block was just written.)"""
    import kvtier.backends.local_disk as ld

    b = mk(tmp_path, aligned_values=aligned)
    size = 3 * blockformat.HASH_GROUP_BYTES
    (k,) = newkeys(1)
    data = os.urandom(size)
    assert b.put([k], [data], LID) == [True]
    real, calls = os.preadv, []
    head, probe = (blockformat.ALIGNED_HEADER_SIZE, 0) if aligned else (H, 1)

    def counted(fd, bufs, offset, *flags):
        if not flags:  # (a RWF_NOWAIT look at whether the value is in the page cache is no read of it)
            calls.append(sum(memoryview(x).nbytes for x in bufs))
        return real(fd, bufs, offset, *flags)

    monkeypatch.setattr(ld.os, "preadv", counted)
    assert get(b, k, size) == data and calls == [head + size + probe]
    calls.clear()
    bufs = [bytearray(size // 2), bytearray(size - size // 2)]
    assert b.get_into([k], [blockformat.Segments([memoryview(x) for x in bufs])], LID) == [True]
    assert b"".join(bufs) == data and sum(calls) == head + size + probe
    assert len(calls) >= 3 and max(calls) <= head + blockformat.HASH_GROUP_BYTES + probe


# ------------------------------------------------------------------ removals told to every process sharing the root


def wait_for(pred, timeout=10.0):
    end = time.monotonic() + timeout
    while time.monotonic() < end:
        if pred():
            return True
        time.sleep(0.02)
    return False


def test_another_processes_evictions_and_deletes_reach_this_ones_listener(tmp_path):
    """A writes 4 blocks; B (another process, same directory) evicts 2 of them with its own puts; a tool
    (a third process, as ``kvtier gc`` is) deletes a third.  A's listener hears exactly those 3, each once,
    within its poll period; nothing is told twice.  (Three backends of one process: each is a writer of its
    own in the journal, as vLLM's scheduler and worker sides are in a one-process engine.)"""
    size = 1000
    root = str(tmp_path / "d")
    a = LocalDiskBackend({"path": root, "capacity": 4 * (H + size), "removals_poll_s": 0.05})
    told_a: list[str] = []
    a.on_evicted = told_a.extend
    ks = newkeys(4)
    assert a.put(ks, [os.urandom(size) for _ in ks], LID) == [True] * 4
    b = LocalDiskBackend({"path": root, "capacity": 4 * (H + size), "removals_poll_s": 0.05})
    told_b: list[str] = []
    b.on_evicted = told_b.extend
    theirs = newkeys(2)
    assert b.put(theirs, [os.urandom(size) for _ in theirs], LID) == [True, True]
    tool = LocalDiskBackend({"path": root, "capacity": "1GiB", "removals_poll_s": 0})
    evicted = [k for k, ok in zip(ks, tool.exists(ks)) if not ok]
    assert len(evicted) == 2
    survivor = next(k for k in ks if k not in evicted)
    assert tool.delete([survivor]) == 1
    tool.close()
    assert wait_for(lambda: len(told_a) == 3), told_a
    time.sleep(0.2)  # nothing told twice
    assert sorted(told_a) == sorted([*evicted, survivor])
    # B hears its own evictions once (from the put that made them, not again from the journal) and the
    # tool's delete.
    assert sorted(told_b) == sorted([*evicted, survivor])
    assert a.stats().extra["blocks"] == 3  # the directory's: B's 2 and A's last
    assert a.lookup([*evicted, survivor]) == [False] * 3
    a.close()
    b.close()


def test_the_removal_journal_rotates_without_losing_lines(tmp_path, monkeypatch):
    """Past its size bound the journal is renamed and a new one started; a reader that was on the old file
    reads it to its end, then the new one from its start: every key exactly once."""
    from kvtier.backends import _disk_removals as journal

    monkeypatch.setattr(journal, "ROTATE_BYTES", 1000)
    root = str(tmp_path)
    feed = journal.RemovalFeed(root)
    keys = [f"k{i:04d}" for i in range(200)]
    seen: list[str] = []
    for i in range(0, 200, 7):
        journal.append_removals(root, keys[i:i + 7])
        if i % 21 == 0:
            seen += feed.poll()
    seen += feed.poll()
    assert os.path.exists(f"{root}/{journal.JOURNAL_NAME}.1")
    assert seen[-1] == keys[-1] and sorted(set(seen)) == seen == sorted(seen)
    # Lines appended within one rotation window between polls are all seen; only a whole file missed
    # between two polls would be lost (the documented bound), which this reader never allowed.
    assert seen == keys
    feed.close()


def test_a_line_being_written_is_passed_on_only_once_complete(tmp_path):
    from kvtier.backends import _disk_removals as journal

    root = str(tmp_path)
    journal.append_removals(root, ["before"])
    feed = journal.RemovalFeed(root)  # opened at the end: what was removed before it is not news
    with open(f"{root}/{journal.JOURNAL_NAME}", "ab") as f:
        f.write(b"half")
        f.flush()
        assert feed.poll() == []
        f.write(b"way\nnext\n")
    assert feed.poll() == ["halfway", "next"]
    feed.close()


def test_a_backend_dropped_without_close_stops_reading_the_journal(tmp_path):
    b = mk(tmp_path, removals_poll_s=0.02)
    assert any(t.name == "kvtier-local-disk-removals" for t in threading.enumerate())
    before = sum(t.name == "kvtier-local-disk-removals" for t in threading.enumerate())
    del b
    import gc

    gc.collect()
    assert wait_for(lambda: sum(t.name == "kvtier-local-disk-removals" for t in threading.enumerate()) < before)


def test_journal_lines_name_their_writer_and_a_reader_leaves_out_its_own(tmp_path):
    """A line is the key, then the backend instance that removed it; a reader leaves out the lines of the
    writer it names, and takes a line of the first format (the key alone: no writer known) as another's."""
    from kvtier.backends import _disk_removals as journal

    root = str(tmp_path)
    feed = journal.RemovalFeed(root)
    ks = newkeys(3)
    journal.append_removals(root, [ks[0]], "h:1:aaaa")
    journal.append_removals(root, [ks[1]], "h:1:bbbb")
    journal.append_removals(root, [ks[2]])
    text = (tmp_path / journal.JOURNAL_NAME).read_text()
    assert text == f"{ks[0]} h:1:aaaa\n{ks[1]} h:1:bbbb\n{ks[2]}\n"
    assert feed.poll(skip="h:1:aaaa") == [ks[1], ks[2]]
    feed.close()


def test_a_removal_is_not_told_once_its_block_is_stored_again(tmp_path):
    """What the journal says is checked against the shared index (one lookup per poll): a block stored
    again since its removal is loadable and not told; a line that is no block key is passed over."""
    from kvtier.backends._disk_removals import RemovalFeed

    a = mk(tmp_path, removals_poll_s=0)
    b = mk(tmp_path, removals_poll_s=0)
    told: list[str] = []
    a.on_evicted = told.extend
    ks = newkeys(2)
    assert a.put(ks, [os.urandom(100)] * 2, LID) == [True, True]
    feed = RemovalFeed(a.root)
    assert b.delete(ks) == 2
    assert b.put([ks[1]], [os.urandom(100)], LID) == [True]
    news = feed.poll()
    assert news == ks
    assert a.removed_elsewhere([*news, "h:1:aaaa"]) == [ks[0]] and told == [ks[0]]
    feed.close()
    a.close()
    b.close()


def test_lookup_answers_from_memory_only_while_no_connection_changed_the_index(tmp_path):
    """Two backends on one directory (two connections to its index, as two processes have): A's repeated
    lookup is answered without a query while the index is unchanged, and every put or delete by B, or by
    A itself, is seen by A's next lookup."""
    a, b = mk(tmp_path), mk(tmp_path)
    k1, k2 = newkeys(2)
    queries: list[str] = []  # the index asked: a SQLite query, or a search its lookup snapshot answered
    a._idx.rconn().set_trace_callback(lambda sql: queries.append(sql) if "FROM blocks" in sql else None)
    assert a._idx.snapshot_serves()
    snap = a._idx._snap
    assert snap is not None
    search = snap.contains

    def counted(*x):
        queries.append("snapshot")
        return search(*x)

    snap.contains = counted
    assert a.lookup([k1, k2]) == [False, False] and len(queries) == 1
    assert a.lookup([k2, k1, k1]) == [False, False, False] and len(queries) == 1  # from memory
    assert b.put([k1], [b"x" * 64], LID) == [True]
    assert a.lookup([k1, k2]) == [True, False] and len(queries) == 2
    assert a.lookup([k1]) == [True] and len(queries) == 2
    assert b.delete([k1]) == 1
    assert a.lookup([k1, k2]) == [False, False]
    assert a.put([k2], [b"y" * 64], LID) == [True]  # its own writer is another connection too
    assert a.lookup([k1, k2]) == [False, True] and len(queries) == 4
    assert queries.count("snapshot") == 4  # every ask was the snapshot's (+ the changes), exact after each
    a.close()
    b.close()
