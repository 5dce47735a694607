"""Holds on a ``local_disk`` directory's blocks that every process sharing the directory sees.

A process about to read blocks (a load the stack planned) holds them, so that no put, in this process or in
another one, evicts them meanwhile.  A hold is a hard link to the block file in a directory of the holder's
own, ``<root>/.kvtier-holds/<host tag>-<pid>-<n>/<namespace>-<hash>`` (a dot name at the root: never a
namespace, never scanned as blocks).

Invariants:
* a block file with more than one link is held by some process: eviction skips it (``held_elsewhere``: one
  ``lstat``); a process's own holds are also in its in-memory counts, so the link is made once per block;
* a block whose name a put unlinked between its check and the hold's link (the one race a check cannot
  close) is read through the holder's link instead: the bytes live on until the hold ends;
* a holder that died leaves its directory behind: a dead pid on this host, or a directory of another host
  untouched for ``max_age_s``, is removed by the next process that looks (``drop_dead_holders``: at
  start-up, and when a put finds held blocks in its way), so a crash never pins blocks for good;
* a hold that cannot be made (the block is already gone, a full or read-only disk) is no error: the load
  then finds the block gone, a miss, as it would have without holds.
"""

from __future__ import annotations

import contextlib
import itertools
import os
import shutil
import time

from kvtier.backends._disk_ledger import HOST_TAG, pid_alive

HOLDS_DIR = ".kvtier-holds"
_seq = itertools.count()


class DiskHolds:
    """One backend instance's holds (its own directory: two instances in one process hold apart)."""

    def __init__(self, root: str):
        self.root = root
        self._dir: str | None = None  # made at the first hold

    def _holder_dir(self) -> str:
        if self._dir is None:
            d = f"{self.root}/{HOLDS_DIR}/{HOST_TAG}-{os.getpid()}-{next(_seq)}"
            os.makedirs(d, exist_ok=True)
            self._dir = d
        return self._dir

    @staticmethod
    def _name(key: str) -> str:
        return key.replace("/", "-")  # a canonical key: <32 hex>/<hex>

    def hold(self, key: str, path: str) -> None:
        """Link the block file of ``key`` (at ``path``) into this holder's directory; best effort."""
        with contextlib.suppress(OSError):  # gone already, or the disk refuses: see the invariants
            os.link(path, f"{self._holder_dir()}/{self._name(key)}", follow_symlinks=False)

    def release(self, key: str) -> None:
        if self._dir is not None:
            with contextlib.suppress(FileNotFoundError):
                os.unlink(f"{self._dir}/{self._name(key)}")

    def path(self, key: str) -> str | None:
        """Where this holder's link to ``key`` is, if it has one (a read's fallback)."""
        if self._dir is None:
            return None
        p = f"{self._dir}/{self._name(key)}"
        return p if os.path.lexists(p) else None

    def close(self) -> None:
        """End every hold of this instance."""
        if self._dir is not None:
            shutil.rmtree(self._dir, ignore_errors=True)
            self._dir = None


def held_elsewhere(path: str) -> bool:
    """Whether some holder links the block file at ``path`` (False if it is gone)."""
    try:
        return os.lstat(path).st_nlink > 1
    except FileNotFoundError:
        return False


def drop_dead_holders(root: str, max_age_s: float) -> int:
    """Remove the hold directories of holders that are gone; how many."""
    base = f"{root}/{HOLDS_DIR}"
    try:
        entries = list(os.scandir(base))
    except FileNotFoundError:
        return 0
    now, n = time.time(), 0
    for e in entries:
        host, _, rest = e.name.partition("-")
        pid = rest.partition("-")[0]
        try:
            dead = (not pid_alive(int(pid))) if host == HOST_TAG else now - e.stat().st_mtime > max_age_s
        except (ValueError, OSError):
            continue  # not a holder's directory, or it went away meanwhile
        if dead:
            shutil.rmtree(e.path, ignore_errors=True)
            n += 1
    return n


__all__ = ["HOLDS_DIR", "DiskHolds", "drop_dead_holders", "held_elsewhere"]
