"""local_disk's lookup mirror (LMDB beside the SQLite index): trusted only at the index's change count,
generation and boot it was stamped with; a writer killed between its index commit and its mirror update
leaves lookups exact (they ask SQLite), and the next start-up copies the mirror again."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest

from kvtier.backends._disk_mirror import META, Stamp
from kvtier.backends.local_disk import LocalDiskBackend
from kvtier.keys import Namespace

lmdb = pytest.importorskip("lmdb")

NS = Namespace("m", "bfloat16", 2, 2, 64, 16)
LID = NS.layout_id


def mk(tmp_path, **opts):
    return LocalDiskBackend({"path": str(tmp_path / "d"), "index_dir": str(tmp_path / "idx"), "capacity": "1GiB",
                             **opts})


def newkeys(n):
    return NS.keys([os.urandom(16) for _ in range(n)])


def test_mirror_serves_lookups_and_follows_puts_and_deletes(tmp_path):
    a, b = mk(tmp_path), mk(tmp_path)
    ks = newkeys(3)
    assert a._idx.mirror_serves()
    assert b.put(ks[:2], [b"x" * 64] * 2, LID) == [True, True]
    assert a._idx.mirror_serves()  # the writer's delta kept it sealed
    assert a.lookup(ks) == [True, True, False]
    assert a.delete([ks[0]]) == 1
    assert b.lookup(ks) == [False, True, False] and b._idx.mirror_serves()
    a.close()
    b.close()


def test_a_stamp_of_another_boot_is_not_trusted(tmp_path):
    a = mk(tmp_path)
    ks = newkeys(1)
    assert a.put(ks, [b"x" * 64], LID) == [True]
    env = a._idx.mirror.env()
    with env.begin(write=True) as t:
        s = Stamp.decode(t.get(META))
        assert s is not None
        t.delete(bytes.fromhex(ks[0][:32] + ks[0][33:]))  # the mirror now lies about the key
        t.put(META, Stamp(s.gen, s.seq, True, "another-boot", s.bulk).encode())
    assert not a._idx.mirror_serves()
    assert a.lookup(ks) == [True]  # SQLite's answer
    a.close()


def test_kill9_between_index_commit_and_mirror_update(tmp_path):
    """The child commits a put to the index and is killed before its mirror update: the key is on disk
    and listed; a lookup in another process answers True (the stamp lags the change count), and the
    next start-up seals a mirror that lists it."""
    a = mk(tmp_path)
    ks = newkeys(2)
    assert a.put([ks[0]], [b"x" * 64], LID) == [True]
    assert a._idx.mirror_serves()
    code = textwrap.dedent(f"""
        import os, signal
        from kvtier.backends._disk_mirror import Mirror
        from kvtier.backends.local_disk import LocalDiskBackend
        Mirror.apply = lambda *a, **k: os.kill(os.getpid(), signal.SIGKILL)
        b = LocalDiskBackend({{"path": {str(tmp_path / "d")!r}, "index_dir": {str(tmp_path / "idx")!r},
                              "capacity": "1GiB"}})
        b.put([{ks[1]!r}], [b"y" * 64], {LID})
    """)
    r = subprocess.run([sys.executable, "-c", code], env=os.environ.copy(), timeout=120)
    assert r.returncode == -9
    assert not a._idx.mirror_serves()
    assert a.lookup(ks) == [True, True]
    c = mk(tmp_path)  # a start-up: copies the mirror again
    assert c._idx.mirror_serves() and a._idx.mirror_serves()
    assert c.lookup(ks) == [True, True]
    a.close()
    c.close()


def test_a_forked_child_never_removes_the_mirror_and_a_stale_stamp_is_copied_again(tmp_path, monkeypatch):
    """lmdb refuses an open in a forked child (its registry of open files is inherited): the child asks
    SQLite, its puts leave the stamp behind, the file is never removed for it; the parent's lookups stay
    exact and, once the stamp has lagged STALE_S, copy the mirror again."""
    import time

    from kvtier.backends import _disk_mirror

    monkeypatch.setattr(_disk_mirror, "STALE_S", 0.0)
    a = mk(tmp_path)
    ks = newkeys(2)
    assert a.put([ks[0]], [b"x" * 64], LID) == [True]
    ino = os.stat(a._idx.mirror.path).st_ino
    pid = os.fork()
    if pid == 0:  # the child: exit code says what went wrong
        code = 0
        try:
            if a.lookup(ks) != [True, False] or a._idx.mirror.env() is not None:
                code = 3
            elif a.put([ks[1]], [b"y" * 64], LID) != [True] or a.lookup(ks) != [True, True]:
                code = 4
        except BaseException:
            code = 5
        os._exit(code)
    assert os.waitpid(pid, 0)[1] == 0
    assert os.stat(a._idx.mirror.path).st_ino == ino
    assert not a._idx.mirror_serves()
    deadline = time.monotonic() + 30
    while True:
        a._idx._known_version = None  # each lookup asks the index again
        assert a.lookup(ks) == [True, True]
        if a._idx.mirror_serves() or time.monotonic() > deadline:
            break
        time.sleep(0.05)
    assert a._idx.mirror_serves()
    a.close()
