"""What every process removes from a shared ``local_disk`` directory, told to every other process using it.

Several processes share one directory (vLLM's scheduler and its workers, several instances, ``kvtier gc``,
``kvtier verify --fix``).  A block one of them evicts or deletes is gone for all of them, but the others
only find out when a read or an existence check misses it: meanwhile their indexes, and the routers that
learn from their KV events, still count it as loadable.  So every removal is also written down here, and
each process that uses the directory reads what the others wrote.

``<root>/.kvtier-removed.log``: one line per removed block key (``<namespace>/<hash>\\n``), appended by
the process that removed it, in the same ``flock`` session of the usage ledger as the unlink itself
(``shared_ledger``), so lines are never interleaved and a line is written only for a file really unlinked.
When the file passes ``ROTATE_BYTES`` the appender renames it to ``.kvtier-removed.log.1`` (replacing the
previous one) and starts a new one.

Invariants:

* **Nothing written is lost to a reader that keeps up.**  A reader (``RemovalFeed``) keeps the file it
  reads open; when the name points to a new file it first reads the old one to its end (a rotated file
  gets no more lines: rotation happens under the flock every appender takes), then starts the new one at
  offset 0.  A reader that falls a whole file behind (``ROTATE_BYTES`` of removals, about 170 thousand
  keys, between two polls) loses those lines: its index then learns of them the old way, when a read or
  an ``exists`` misses.
* **Only complete lines are passed on**: a line being appended while a reader reads is kept until its
  newline arrives.
* **Never in the data path**: a failure to append (disk full, read-only) is logged once and costs only the
  hints; the unlink it describes has happened either way.
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Sequence

log = logging.getLogger("kvtier.backends.local_disk")

JOURNAL_NAME = ".kvtier-removed.log"  # at the root: a dot name, never a namespace, never a block
ROTATE_BYTES = 16 << 20
_FLAGS = os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)


def append_removals(root: str, keys: Sequence[str]) -> None:
    """Write ``keys`` down as removed (the caller holds the directory's ledger flock)."""
    if not keys:
        return
    path = f"{root}/{JOURNAL_NAME}"
    data = "".join(f"{k}\n" for k in keys).encode()
    try:
        with contextlib.suppress(FileNotFoundError):
            if os.stat(path).st_size + len(data) > ROTATE_BYTES:
                os.replace(path, f"{path}.1")
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT | _FLAGS, 0o666)
        try:
            os.write(fd, data)
        finally:
            os.close(fd)
    except OSError as e:
        log.warning("local_disk: %s: cannot note %d removed block(s) for other processes (%s); they will "
                    "find them gone when they read them", root, len(keys), e)


class RemovalFeed:
    """The keys other processes (and this one) removed from ``root`` since this feed was opened, read by
    ``poll``.  Not thread-safe: one poller."""

    def __init__(self, root: str):
        self.path = f"{root}/{JOURNAL_NAME}"
        self._fd: int | None = None
        self._ino: int | None = None
        self._tail = b""  # an incomplete last line
        self._open(at_end=True)

    def _open(self, at_end: bool) -> None:
        try:
            fd = os.open(self.path, os.O_RDONLY | _FLAGS)
        except FileNotFoundError:
            return
        if at_end:
            os.lseek(fd, 0, os.SEEK_END)
        self._fd, self._ino, self._tail = fd, os.fstat(fd).st_ino, b""

    def _drain(self) -> list[str]:
        if self._fd is None:
            return []
        chunks = [self._tail]
        while chunk := os.read(self._fd, 1 << 20):
            chunks.append(chunk)
        data = b"".join(chunks)
        cut = data.rfind(b"\n") + 1
        self._tail = data[cut:]
        return data[:cut].decode(errors="replace").split()

    def poll(self) -> list[str]:
        """The keys removed since the last poll, oldest first."""
        keys = self._drain()
        try:
            ino: int | None = os.stat(self.path).st_ino
        except FileNotFoundError:
            ino = None  # rotated, and no removal since: the old file stays ours until a new one appears
        if ino is not None and ino != self._ino:
            keys += self._drain()  # the rotated file's last lines
            self.close()
            self._open(at_end=False)  # everything in a file that appeared since is new
            keys += self._drain()
        return keys

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


__all__ = ["JOURNAL_NAME", "ROTATE_BYTES", "RemovalFeed", "append_removals"]
