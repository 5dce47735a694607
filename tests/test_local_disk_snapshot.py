"""local_disk's lookup snapshot (a sorted key file beside the SQLite index, ``_disk_snapshot``): lookups
answer from it plus the index's change log only while it is whole, of this boot and generation, and every
change since it is still logged; other processes' puts and deletes after it are seen; a kill -9 during a
build leaves the published file (or none) and a temp file the next build removes; a damaged file is
ignored and built again; an index of the build before the change log opens and gets one."""

from __future__ import annotations

import contextlib
import os
import struct
import subprocess
import sys
import textwrap

from kvtier.backends import _disk_snapshot as snapshots
from kvtier.backends.local_disk import DiskIndex, LocalDiskBackend
from kvtier.keys import Namespace

NS = Namespace("s", "bfloat16", 2, 2, 64, 16)
LID = NS.layout_id


def mk(tmp_path):
    return LocalDiskBackend({"path": str(tmp_path / "d"), "index_dir": str(tmp_path / "idx"), "capacity": "1GiB"})


def newkeys(n, hash_bytes=16):
    return NS.keys([os.urandom(hash_bytes) for _ in range(n)])


def build(b):
    return b._idx.build_snapshot(contextlib.nullcontext)


def test_snapshot_serves_and_sees_another_process_puts_and_deletes(tmp_path):
    a = mk(tmp_path)
    ks = newkeys(4)
    assert a.put(ks[:2], [b"x" * 64] * 2, LID) == [True, True]
    assert build(a) == 2 and a._idx.snapshot_serves()
    code = textwrap.dedent(f"""
        from kvtier.backends.local_disk import DiskIndex, LocalDiskBackend
        b = LocalDiskBackend({{"path": {str(tmp_path / "d")!r}, "index_dir": {str(tmp_path / "idx")!r},
                              "capacity": "1GiB"}})
        assert b.put([{ks[2]!r}], [b"y" * 64], {LID}) == [True]
        assert b.delete([{ks[0]!r}]) == 1
        b.close()
    """)
    subprocess.run([sys.executable, "-c", code], env=os.environ.copy(), timeout=120, check=True)
    assert a.lookup(ks) == [False, True, True, False]
    assert a._idx.snapshot_serves()  # the answer came from it and the change log
    a.close()


def test_keys_of_both_lengths_are_exact(tmp_path):
    a = mk(tmp_path)
    short, long_ = newkeys(3), newkeys(3, hash_bytes=32)
    assert a.put(short[:2] + long_[:2], [b"x" * 64] * 4, LID) == [True] * 4
    assert build(a) == 4 and a._idx.snapshot_serves() and a._idx._snap is not None
    assert a._idx._snap.width == 49
    assert a.lookup(short + long_) == [True, True, False, True, True, False]
    a.close()


def test_a_snapshot_behind_the_trimmed_log_is_left_for_the_new_one(tmp_path):
    """A's snapshot predates B's build, which trimmed the change log past it: A must not apply a partial
    log to it; it maps B's file and stays exact."""
    a, b = mk(tmp_path), mk(tmp_path)
    ks = newkeys(3)
    assert a.put([ks[0]], [b"x" * 64], LID) == [True]
    assert build(a) == 1 and a.lookup(ks) == [True, False, False]
    old = a._idx._snap
    assert b.put([ks[1]], [b"y" * 64], LID) == [True] and b.delete([ks[0]]) == 1
    assert build(b) == 1  # trims the log up to its snapshot
    assert b.put([ks[2]], [b"z" * 64], LID) == [True]
    assert a.lookup(ks) == [False, True, True]
    assert a._idx._snap is not old and a._idx.snapshot_serves()
    a.close()
    b.close()


def _damage(path, offset, data):
    with open(path, "r+b") as f:
        f.seek(offset)
        f.write(data)


def test_a_damaged_or_foreign_snapshot_is_never_trusted(tmp_path):
    a = mk(tmp_path)
    ks = newkeys(3)
    assert a.put(ks[:2], [b"x" * 64] * 2, LID) == [True, True]
    assert build(a) == 2
    path = a._idx.snapshot_path
    rec = snapshots.HEADER_BYTES
    for damage in (
        lambda: _damage(path, rec, b"\x00" * 33),  # a record (the body's checksum)
        lambda: os.truncate(path, rec + 33),  # torn
        lambda: _damage(path, 60, b"another-boot-id"),  # the header's boot field (its checksum)
    ):
        assert build(a) == 2
        os.utime(path, ns=(1, 1))  # a file changed in place is told by its stat (here: same size)
        damage()
        c = DiskIndex(a._idx.path, a.root)  # a fresh process's index (nobody builds): must refuse the file
        assert c.lookup(ks) == [True, True, False]  # SQLite's answer
        assert not c.snapshot_serves()
        c.close()
    # A whole file of another boot (the header rewritten with its checksum): not trusted either.
    assert build(a) == 2
    with open(path, "rb") as f:
        head = bytearray(f.read(snapshots.HEADER_BYTES))
    fields = list(snapshots._FIELDS.unpack_from(head))
    fields[6] = b"0" * 36
    packed = snapshots._FIELDS.pack(*fields)
    import xxhash

    _damage(path, 0, packed + xxhash.xxh3_64_intdigest(packed).to_bytes(8, "little"))
    assert snapshots.load(path) is None
    assert build(a) == 2 and snapshots.load(path) is not None  # built again, trusted again
    a.close()


def test_kill9_during_a_build_leaves_lookups_exact_and_a_temp_the_next_build_removes(tmp_path):
    a = mk(tmp_path)
    ks = newkeys(3)
    assert a.put([ks[0]], [b"x" * 64], LID) == [True]
    assert build(a) == 1
    code = textwrap.dedent(f"""
        import contextlib, os, signal
        from kvtier.backends.local_disk import DiskIndex, LocalDiskBackend
        b = LocalDiskBackend({{"path": {str(tmp_path / "d")!r}, "index_dir": {str(tmp_path / "idx")!r},
                              "capacity": "1GiB"}})
        assert b.put([{ks[1]!r}], [b"y" * 64], {LID}) == [True]
        os.replace = lambda *a: os.kill(os.getpid(), signal.SIGKILL)  # killed before the rename
        b._idx.build_snapshot(contextlib.nullcontext)
    """)
    r = subprocess.run([sys.executable, "-c", code], env=os.environ.copy(), timeout=120)
    assert r.returncode == -9
    d = os.path.dirname(a._idx.snapshot_path)
    temps = [n for n in os.listdir(d) if n.endswith(".tmp")]
    assert len(temps) == 1
    assert a.lookup(ks) == [True, True, False] and a._idx.snapshot_serves()  # the old file + the log
    assert build(a) == 2
    assert not [n for n in os.listdir(d) if n.endswith(".tmp")]
    a.close()


def test_an_index_of_the_build_before_the_change_log_opens_and_gets_one(tmp_path):
    """An index written by the previous build (no ``changes`` table, triggers or ``ctrim``): it opens,
    answers exactly, and serves lookups from a snapshot once built."""
    import sqlite3

    a = mk(tmp_path)
    ks = newkeys(2)
    assert a.put([ks[0]], [b"x" * 64], LID) == [True]
    path = a._idx.path
    a.close()
    os.unlink(a._idx.snapshot_path)
    c = sqlite3.connect(path, isolation_level=None)
    c.executescript("DROP TRIGGER changes_added; DROP TRIGGER changes_dropped; DROP TABLE changes;"
                    "DELETE FROM meta WHERE k='ctrim';")
    c.close()
    b = mk(tmp_path)
    assert b.lookup(ks) == [True, False] and b._idx.snapshot_serves()
    assert b.put([ks[1]], [b"y" * 64], LID) == [True]
    assert b.lookup(ks) == [True, True]
    b.close()


def test_the_module_states_its_invariants():
    doc = snapshots.__doc__ or ""
    assert "Invariants:" in doc and "renamed into place" in doc and "boot" in doc
    assert struct.calcsize("<8sIIQq32s36sQ") + 8 <= snapshots.HEADER_BYTES


def test_a_writer_that_never_looks_up_keeps_the_change_log_short(tmp_path, monkeypatch):
    import sqlite3
    import time

    from kvtier.backends import _disk_index

    monkeypatch.setattr(_disk_index, "_REBUILD_MIN", 4)
    monkeypatch.setattr(_disk_index, "_WANT_EVERY_S", 0.0)
    a = mk(tmp_path)
    ks = newkeys(12)
    for i in range(0, 12, 2):
        assert a.put(ks[i:i + 2], [b"x" * 64] * 2, LID) == [True, True]
    c = sqlite3.connect(a._idx.path)
    deadline = time.monotonic() + 60
    while c.execute("SELECT v FROM meta WHERE k='ctrim'").fetchone()[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)  # (the build runs in a thread)
    assert c.execute("SELECT v FROM meta WHERE k='ctrim'").fetchone()[0] > 0
    assert c.execute("SELECT count(*) FROM changes").fetchone()[0] < 12
    c.close()
    assert a.lookup(ks) == [True] * 12
    a.close()


def test_one_build_at_a_time(tmp_path):
    """A build that finds another holding the snapshot's lock leaves it alone (returns 0, file untouched)."""
    a = mk(tmp_path)
    assert a.put(newkeys(2), [b"x" * 64] * 2, LID) == [True, True]
    assert build(a) == 2
    before = snapshots.stat_ident(a._idx.snapshot_path)
    with snapshots.exclusive(a._idx.snapshot_path) as mine:  # (another open file description: another builder)
        assert mine
        assert build(a) == 0
    assert snapshots.stat_ident(a._idx.snapshot_path) == before
    assert build(a) == 2
    a.close()
