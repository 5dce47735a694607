"""The lock and the account of a ``local_disk`` directory: one small file, ``<root>/.kvtier-usage.json``.

Every process changing the directory does so under an exclusive ``flock`` on this file (``locked``): that
orders all writers of all processes, and their transactions on the directory's index
(``_disk_index``), which holds the account itself.  After each session the file is rewritten with the
committed account, a mirror for operators and tools: ``bytes`` (the block files), ``held`` (each live
writer's in-flight reservations, ``"<host tag>:<pid>" -> [bytes, time]``) and ``index`` (the index
generation that goes with this directory: an index whose generation differs, or a file that is missing or
torn, makes the next opener rebuild the index from the files).  Which file changes go with which account
change is the backend's business (``backends/local_disk.py``); this module is the file.
"""

from __future__ import annotations

import contextlib
import fcntl
import hashlib
import json
import os
import socket
import time
from collections.abc import Iterator
from typing import Any

HOST_TAG = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]
LEDGER_NAME = ".kvtier-usage.json"  # at the root: a dot name, never a namespace, never a block
_PAGE = 4096  # the ledger is rewritten in place, padded to whole pages: never truncated, never shrunk


class Mirror:
    """The ledger file of one locked session: what it said when the session began (``doc``, None when
    missing or torn) and its rewrite."""

    def __init__(self, fd: int):
        self.fd = fd
        self.file_size = os.fstat(fd).st_size
        self.doc = self._read()

    def _read(self) -> dict[str, Any] | None:
        if not self.file_size:
            return None
        try:
            doc = json.loads(os.pread(self.fd, self.file_size, 0))
            ok = (isinstance(doc, dict) and isinstance(doc.get("bytes"), int) and doc["bytes"] >= 0
                  and isinstance(doc.get("held"), dict))
        except ValueError:
            return None
        return doc if ok else None

    def write(self, doc: dict[str, Any]) -> None:
        """Rewrite the file with ``doc`` unless it says that already."""
        if doc == self.doc:
            return
        data = json.dumps(doc).encode()
        # Padded in place (JSON allows trailing spaces): no truncate, so a rewrite on a full disk reuses
        # the pages it has instead of needing new ones.
        self.file_size = max(self.file_size, -(-len(data) // _PAGE) * _PAGE)
        os.pwrite(self.fd, data.ljust(self.file_size), 0)
        self.doc = doc


@contextlib.contextmanager
def locked(root: str) -> Iterator[Mirror]:
    """The directory's lock (an flock on its ledger file) and the file's mirror.

    Opened per session, on a descriptor of its own: flocks on two descriptors exclude each other even
    within one process, so this also orders a process's threads.  (A kept descriptor would be shared by
    threads and forked children, whose flocks would then not exclude each other, and, open for writing,
    would keep the filesystem from being remounted read-only.)"""
    fd = os.open(f"{root}/{LEDGER_NAME}", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0),
                 0o666)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)  # released when fd is closed
        yield Mirror(fd)
    finally:
        os.close(fd)


def writer_alive(writer: str, last: float, max_age_s: float) -> bool:
    """Whether a writer (``"<host tag>:<pid>"``) may still be running: its pid on this host, or on
    another host one heard from within ``max_age_s``."""
    host, _, pid = writer.partition(":")
    return pid_alive(int(pid)) if host == HOST_TAG else time.time() - last <= max_age_s


def pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # PermissionError: it exists, owned by someone else
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True


__all__ = ["HOST_TAG", "LEDGER_NAME", "Mirror", "locked", "pid_alive", "writer_alive"]
