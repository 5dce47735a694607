"""What every process removes from a shared ``local_disk`` directory, told to every other process using it.

Several processes share one directory (vLLM's scheduler and its workers, several instances, ``kvtier gc``,
``kvtier verify --fix``).  A block one of them evicts or deletes is gone for all of them, but the others
only find out when a read or an existence check misses it: meanwhile the routers that learn from their KV
events, and their stacks, still count it as loadable.  So every removal is also written down here, and
each backend that uses the directory reads what the others wrote.

``<root>/.kvtier-removed.log``: one line per removed block, appended by the process that removed it, in
the same ``flock`` session of the directory's lock as the unlink itself (``local_disk``'s ``_shared``,
after the index transaction that dropped the block committed), so lines are never interleaved and a line
is written only for a file really unlinked.  When the file passes ``ROTATE_BYTES`` the appender renames
it to ``.kvtier-removed.log.1`` (replacing the previous one) and starts a new one.

Line format (a stored format: readers of either version meet lines of both):

* version 1, ``<namespace>/<hash>\\n``: written before the directory's index was shared; the writer is
  unknown, so every reader takes it as another's removal.
* version 2, ``<namespace>/<hash> <writer>\\n``, ``<writer>`` = ``<host tag>:<pid>:<instance>``: the backend
  instance that unlinked the block (``<instance>`` is random per ``LocalDiskBackend``, so two backends in
  one process, such as vLLM's scheduler and worker sides in a one-process engine, are two writers; the pid
  is read per line, so a forked child is a writer of its own).  ``RemovalFeed.poll(skip=...)`` leaves out
  the lines of the instance asking.  A version-1 reader splits on whitespace and takes ``<writer>`` for one
  more key, which is never a key of its index, so it is passed over there.

Why a writer field in this journal rather than a removals table with a sequence number in the shared index
(``_disk_index``): each process once filtered the journal with its own in-memory index (the keys it had
indexed, its own removals already gone from it); the shared index leaves no per-process set to filter
with, so the filter is now the writer, which costs nothing per poll.  The journal stays in the directory
(what every sharer, and every tool, opens; the index is one per host, under ``index_dir``), keeps its
readers working across an index rebuild (which empties the index and would restart a sequence), bounds
itself by rotation (a table would be pruned inside the lock's write transactions), and stays readable by
processes running the version-1 code.

Invariants:

* **Nothing written is lost to a reader that keeps up.**  A reader (``RemovalFeed``) keeps the file it
  reads open; when the name points to a new file it first reads the old one to its end (a rotated file
  gets no more lines: rotation happens under the flock every appender takes), then starts the new one at
  offset 0.  A reader that falls a whole file behind (``ROTATE_BYTES`` of removals, about 135 thousand
  version-2 lines, between two polls) loses those lines: its stack then learns of them the old way, when
  a read or an ``exists`` misses.
* **Only complete lines are passed on**: a line being appended while a reader reads is kept until its
  newline arrives.
* **A reader's cost is the lines written since its last poll**: it never reads the directory or the index.
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


def append_removals(root: str, keys: Sequence[str], writer: str | None = None) -> None:
    """Write ``keys`` down as removed by ``writer`` (``<host tag>:<pid>:<instance>``; None: a version-1
    line, writer unknown).  The caller holds the directory's lock."""
    if not keys:
        return
    path = f"{root}/{JOURNAL_NAME}"
    end = "\n" if writer is None else f" {writer}\n"
    data = "".join(f"{k}{end}" for k in keys).encode()
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

    def _drain(self, skip: str | None) -> list[str]:
        if self._fd is None:
            return []
        chunks = [self._tail]
        while chunk := os.read(self._fd, 1 << 20):
            chunks.append(chunk)
        data = b"".join(chunks)
        cut = data.rfind(b"\n") + 1
        self._tail = data[cut:]
        keys = []
        for line in data[:cut].decode(errors="replace").splitlines():
            fields = line.split()
            if fields and not (skip is not None and len(fields) > 1 and fields[1] == skip):
                keys.append(fields[0])
        return keys

    def poll(self, skip: str | None = None) -> list[str]:
        """The keys removed since the last poll, oldest first, but for those whose line names ``skip`` as
        its writer (the asking backend's own removals)."""
        keys = self._drain(skip)
        try:
            ino: int | None = os.stat(self.path).st_ino
        except FileNotFoundError:
            ino = None  # rotated, and no removal since: the old file stays ours until a new one appears
        if ino is not None and ino != self._ino:
            keys += self._drain(skip)  # the rotated file's last lines
            self.close()
            self._open(at_end=False)  # everything in a file that appeared since is new
            keys += self._drain(skip)
        return keys

    def close(self) -> None:
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


__all__ = ["JOURNAL_NAME", "ROTATE_BYTES", "RemovalFeed", "append_removals"]
