"""The shared account of a ``local_disk`` directory: one small file, ``<root>/.kvtier-usage.json``, that
every process writing the directory reads and rewrites under an exclusive ``flock``.

It holds the bytes of the block files (``bytes``) and each live writer's reservations for its in-flight
temp files (``held``: ``"<host tag>:<pid>" -> [bytes, time]``).  A writer's entry exists only while it
has something in flight, or for the moment it unlinks files (``unlinking``): so an entry
of a writer that is gone (a dead pid on this host, or silent for long on another) means the file may
disagree with the disk, and the backend recounts the directory.  Which file changes go with which
ledger change is the backend's business (``backends/local_disk.py``); this module is the file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field

from kvtier.backends._disk_removals import append_removals

HOST_TAG = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
LEDGER_NAME = ".kvtier-usage.json"  # at the root: a dot name, never a namespace, never a block
_PAGE = 4096  # the ledger is rewritten in place, padded to whole pages: never truncated, never shrunk


@dataclass
class Ledger:
    """The directory's usage, shared by every process using it (see the module docstring)."""

    bytes: int = 0  # sum of the sizes of the block files
    held: dict[str, list[float]] = field(default_factory=dict)  # "<host tag>:<pid>" -> [reserved bytes, time]
    file_size: int = 0
    changed: bool = False
    fd: int = -1  # the descriptor of the session that read it (the flock holder)
    filed: frozenset[str] = frozenset()  # the writers whose entries are in the file as last read or written
    removed: list[str] = field(default_factory=list)  # block keys unlinked in this session (``_disk_removals``)

    @property
    def total(self) -> int:
        return self.bytes + sum(int(h[0]) for h in self.held.values())

    def hold(self, writer: str, nbytes: int) -> None:
        """Reserve (``nbytes`` > 0) or release (< 0) room for a writer's temp files."""
        h = self.held.setdefault(writer, [0, 0.0])
        h[0] += nbytes
        h[1] = time.time()
        if h[0] <= 0:  # nothing in flight: no entry, so a dead writer's entry always means lost bytes
            del self.held[writer]
        self.changed = True

    @contextlib.contextmanager
    def unlinking(self, writer: str) -> Iterator[int]:
        """Around unlinks of block files in this session: the file names ``writer`` before the first one.
        A kill between an unlink and the session's write-back leaves the file counting bytes no longer on
        disk; only a dead writer's entry makes the next session recount, and a writer with nothing in
        flight has none, so one of 1 byte is written first and taken back after the unlinks (the
        session's write-back then drops it).  Yields the bytes that entry adds to ``total`` (0 or 1)."""
        entered = writer not in self.filed
        if entered:
            self.hold(writer, 1)
            self.write()
        try:
            yield int(entered)
        finally:
            if entered:
                self.hold(writer, -1)

    def drop_dead_writers(self, max_age_s: float) -> bool:
        """Forget reservations of writers that are gone (dead pid on this host; silent for ``max_age_s``
        on another); True if any was dropped."""
        now = time.time()
        dead = [w for w, (_, t) in self.held.items()
                if (not pid_alive(int(w.partition(":")[2])) if w.partition(":")[0] == HOST_TAG
                    else now - t > max_age_s)]
        for w in dead:
            del self.held[w]
        self.changed |= bool(dead)
        return bool(dead)

    @classmethod
    def read(cls, fd: int) -> Ledger | None:
        """The ledger in ``fd``; None if it is empty or unreadable (then it is recounted)."""
        size = os.fstat(fd).st_size
        if not size:
            return None
        try:
            doc = json.loads(os.pread(fd, size, 0))
            led = cls(int(doc["bytes"]), {str(w): [int(n), float(t)] for w, (n, t) in doc["held"].items()},
                      size, fd=fd)
            led.filed = frozenset(led.held)
        except (ValueError, TypeError, KeyError, AttributeError):
            return None
        return led if led.bytes >= 0 and all(h[0] > 0 for h in led.held.values()) else None

    def write(self) -> None:
        data = json.dumps({"bytes": self.bytes, "held": self.held}).encode()
        # Padded in place (JSON allows trailing spaces): no truncate, so a rewrite on a full disk reuses
        # the pages it has instead of needing new ones.
        self.file_size = max(self.file_size, -(-len(data) // _PAGE) * _PAGE)
        os.pwrite(self.fd, data.ljust(self.file_size), 0)
        self.filed = frozenset(self.held)
        self.changed = False


@contextlib.contextmanager
def shared_ledger(root: str, count: Callable[[Ledger], None]) -> Iterator[Ledger]:
    """The ledger of the directory ``root``, held exclusively (an flock), written back on the way out,
    also after an error: every change made to it stands for a filesystem change already done; so are the
    block keys the session unlinked (``Ledger.removed``), appended to the removal journal.  A new,
    empty or unreadable file is first filled by ``count`` (a scan of the directory).

    Opened per session, on a descriptor of its own: flocks on two descriptors exclude each other even
    within one process, so this also orders a process's threads.  (A kept descriptor would be shared by
    threads and forked children, whose flocks would then not exclude each other, and, open for writing,
    would keep the filesystem from being remounted read-only.)"""
    fd = os.open(f"{root}/{LEDGER_NAME}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0),
                 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd is closed
        led = Ledger.read(fd)
        if led is None:  # first use of the directory, or a torn / foreign file: count it
            led = Ledger(file_size=os.fstat(fd).st_size, fd=fd)
            count(led)
        try:
            yield led
        finally:
            if led.changed:
                led.write()
            append_removals(root, led.removed)  # still under the flock: in the order of the unlinks
    finally:
        os.close(fd)


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # PermissionError: it exists, owned by someone else
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


__all__ = ["HOST_TAG", "LEDGER_NAME", "Ledger", "pid_alive", "shared_ledger"]
