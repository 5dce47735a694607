"""Issue 6 item 5, backend part: the local disk fills up.

Each test mounts its own 8 MiB tmpfs (``mount -t tmpfs -o size=8m``, so it needs root; otherwise the
test is skipped with the reason) and unmounts it afterwards.  Real ENOSPC, no mocks:

* with a capacity larger than the filesystem, stores past the end fail with ENOSPC: each failed key is a
  ``False`` from ``put`` (or, when a whole batch failed, a ``BackendError``), every one is counted in
  ``stats().put_failures``, none leaves a temp file or a readable block behind, the accounted usage
  equals the bytes on disk, every block stored before keeps reading back exactly, and once room is
  made (deleting blocks, removing a foreign file that filled the disk) stores succeed again;
* with ``capacity`` below the filesystem's size, writing 2.5x the capacity never hits ENOSPC: LRU
  eviction keeps the bytes on disk under the bound after every batch, and the newest blocks read back.
"""

from __future__ import annotations

import errno
import os

import pytest
from _reliability.common import LID, check, key_of, payload

from kvtier.backend_api import BackendDiskFull, BackendError, BackendPermissionDenied
from kvtier.backends.local_disk import LocalDiskBackend

FS_SIZE = 8 << 20  # the size of the small_tmpfs fixture (tests/conftest.py)
SIZE = 256 << 10  # payload bytes per block
BATCH = 4


def _files(root) -> list[tuple[str, int]]:
    return [(os.path.join(d, f), os.path.getsize(os.path.join(d, f)))
            for d, _, fs in os.walk(root) for f in fs]


def _block_bytes(root) -> int:
    return sum(size for path, size in _files(root)  # not temp files, the ledger or the removal journal
               if not path.endswith(".tmp") and not os.path.basename(path).startswith(".kvtier-"))


def _temp_files(root) -> list[str]:
    return [path for path, _ in _files(root) if path.endswith(".tmp")]


def _put(b, keys, version=0):
    """Per key: True stored, False refused (a batch-wide failure counts every key as refused)."""
    try:
        return b.put(keys, [payload(k, version, SIZE) for k in keys], LID)
    except BackendError as e:
        assert isinstance(e.__cause__, OSError) and e.__cause__.errno == errno.ENOSPC, e
        assert isinstance(e, BackendDiskFull) and b.root in str(e) and "free space there" in str(e), e
        return [False] * len(keys)


def _read_all(b, keys):
    bufs = [bytearray(SIZE) for _ in keys]
    ok = b.get_into(keys, bufs, LID)
    return [check(k, buf) if hit else None for k, buf, hit in zip(keys, bufs, ok)]


def test_disk_full_stores_fail_cleanly(small_tmpfs, figures):
    root = small_tmpfs / "blocks"
    b = LocalDiskBackend({"path": str(root), "capacity": "1GiB", "threads": 4})
    stored: list[str] = []
    refused: list[str] = []
    n = 0
    while len(refused) < 3 * BATCH:  # go on well past the first ENOSPC
        keys = [key_of(n + j, tag="full") for j in range(BATCH)]
        n += BATCH
        for k, ok in zip(keys, _put(b, keys)):
            (stored if ok else refused).append(k)
        assert n < 200, "the 8 MiB filesystem never filled up"
    s = b.stats()
    capacity_blocks = FS_SIZE // b.stored_size(SIZE)  # its file: header (88, or 4096 aligned) + payload
    figures("stores refused with ENOSPC / attempted (disk full)", f"{len(refused)}/{n}")
    figures("put_failures counted (disk full)", s.put_failures)
    figures("disk_full errors counted (disk full)", s.disk_full)
    assert len(stored) >= capacity_blocks - 3, "the filesystem should hold about FS_SIZE of blocks"
    assert s.put_failures == len(refused) and s.puts == len(stored)
    assert s.disk_full == len(refused) and s.permission_denied == 0, "each key refused for want of space"
    assert _temp_files(root) == [], "a failed write removes its temp file"
    assert s.extra["bytes"] == _block_bytes(root) == len(stored) * b.stored_size(SIZE), \
        "accounted usage matches the bytes on disk; refused writes released their reservation"

    # Reads keep working on the full disk; nothing refused is readable (not even as a corrupt value).
    got = _read_all(b, stored + refused)
    half_written = sum(v is not None for v in got[len(stored):])
    figures("half-written blocks readable (disk full)", half_written)
    figures("blocks read back on the full disk", f"{sum(v == 0 for v in got[:len(stored)])}/{len(stored)}")
    assert got[:len(stored)] == [0] * len(stored)
    assert half_written == 0
    assert b.exists(refused) == [False] * len(refused)
    assert b.stats().corrupt == 0

    # Room made by deleting blocks: stores succeed again.
    assert b.delete(stored[:BATCH * 2]) == BATCH * 2
    assert _put(b, refused[:BATCH]) == [True] * BATCH
    assert _read_all(b, refused[:BATCH]) == [0] * BATCH
    b.close()

    # After a restart the index holds exactly the complete blocks.
    b2 = LocalDiskBackend({"path": str(root), "capacity": "1GiB"})
    assert b2.stats().extra["bytes"] == _block_bytes(root)
    assert b2.stats().extra["blocks"] == len(stored) - BATCH * 2 + BATCH
    b2.close()


def test_disk_filled_by_someone_else(small_tmpfs, figures):
    """Another process's file fills the disk below our capacity: stores fail and are counted, reads go on,
    and stores resume when the space comes back."""
    root = small_tmpfs / "blocks"
    b = LocalDiskBackend({"path": str(root), "capacity": "1GiB", "threads": 2})
    mine = [key_of(i, tag="ballast") for i in range(BATCH)]
    assert _put(b, mine) == [True] * BATCH
    ballast = small_tmpfs / "ballast"
    with open(ballast, "wb") as f:  # fill what is left
        chunk = bytes(1 << 16)
        try:
            while True:
                f.write(chunk)
                f.flush()
        except OSError as e:
            assert e.errno == errno.ENOSPC
    more = [key_of(i, tag="ballast") for i in range(BATCH, 3 * BATCH)]
    results = _put(b, more[:BATCH]) + _put(b, more[BATCH:])
    refused = results.count(False)
    figures("stores refused while another file filled the disk", f"{refused}/{len(more)}")
    assert refused == len(more)
    assert b.stats().put_failures == refused
    assert _read_all(b, mine) == [0] * BATCH
    assert _read_all(b, more) == [None] * len(more)
    assert _temp_files(root) == []
    os.unlink(ballast)
    assert _put(b, more) == [True] * len(more)
    assert _read_all(b, more) == [0] * len(more)
    b.close()


def test_capacity_keeps_usage_under_bound(small_tmpfs, figures):
    root = small_tmpfs / "blocks"
    cap = 6 << 20
    b = LocalDiskBackend({"path": str(root), "capacity": cap, "threads": 4})
    per_block = b.stored_size(SIZE)
    total = int(2.5 * cap) // per_block
    keys = [key_of(i, tag="cap") for i in range(total)]
    peak = 0
    for i in range(0, total, BATCH):
        assert _put(b, keys[i:i + BATCH]) == [True] * len(keys[i:i + BATCH]), "eviction makes room"
        on_disk = _block_bytes(root)
        peak = max(peak, on_disk)
        assert on_disk <= cap and b.stats().extra["bytes"] <= cap
    s = b.stats()
    figures("peak block bytes on disk / capacity (capacity 6 MiB on an 8 MiB tmpfs)",
            f"{peak / 2**20:.2f} MiB / {cap / 2**20:.0f} MiB")
    figures("stores refused with a capacity set", s.put_failures)
    assert s.put_failures == 0
    kept = cap // per_block
    newest = keys[-(kept - BATCH):]
    assert _read_all(b, newest) == [0] * len(newest), "the most recent blocks are kept"
    assert _read_all(b, keys[:BATCH]) == [None] * BATCH, "the oldest were evicted"
    b.close()
    # A restart with a smaller capacity evicts down to it at once.
    b2 = LocalDiskBackend({"path": str(root), "capacity": cap // 2})
    assert _block_bytes(root) <= cap // 2 and b2.stats().extra["bytes"] <= cap // 2
    b2.close()


def test_read_only_filesystem_is_permission_denied(small_tmpfs, figures):
    """The filesystem goes read-only (remounted ro, as after an ext4 error): stores fail with
    BackendPermissionDenied saying so and what to do, counted apart from disk full; reads go on."""
    import subprocess

    root = small_tmpfs / "blocks"
    b = LocalDiskBackend({"path": str(root), "capacity": "1GiB", "threads": 2})
    mine = [key_of(i, tag="ro") for i in range(BATCH)]
    assert _put(b, mine) == [True] * BATCH
    r = subprocess.run(["mount", "-o", "remount,ro", str(small_tmpfs)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot remount read-only: {r.stderr.strip()}")
    try:
        more = [key_of(i, tag="ro") for i in range(BATCH, 2 * BATCH)]
        with pytest.raises(BackendPermissionDenied) as e:
            b.put(more, [payload(k, 0, SIZE) for k in more], LID)
        assert f"read-only filesystem on {b.root}" in str(e.value)
        assert "write: false" in str(e.value)
        s = b.stats()
        figures("stores refused on a read-only filesystem / permission_denied counted",
                f"{s.put_failures}/{s.permission_denied}")
        assert s.permission_denied >= 1 and s.put_failures == BATCH and s.disk_full == 0
        assert _read_all(b, mine) == [0] * BATCH
    finally:
        subprocess.run(["mount", "-o", "remount,rw", str(small_tmpfs)], capture_output=True)
    b.close()
