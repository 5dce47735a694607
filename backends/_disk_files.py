"""``local_disk``'s files: the names in its directory, one value's file written and read, and the listing of
the directory at start-up.  No state: the backend (``local_disk.py``) owns the index, the shared ledger and
the capacity, and calls these with its root and options.

A block's file is ``<root>/<namespace>/<hash[:2]>/<hash>``; a temp file is
``.<hash>.<host tag>.<pid>.<n>.tmp`` beside it (a dot first: never read as a block).  The listing of the
whole directory (``shards`` / ``scan_shard``) serves only an index rebuild.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import re
import stat

from kvtier.backends._disk_ledger import HOST_TAG, pid_alive
from kvtier.format import blockformat

log = logging.getLogger("kvtier.backends.local_disk")

NS = re.compile(r"[0-9a-f]{32}")
SHARD = re.compile(r"[0-9a-f]{2}")
HASH = re.compile(r"[0-9a-f]{32}|[0-9a-f]{64}")
TMP = re.compile(r"\.(?:[0-9a-f]+|manifest\.json)\.(?P<host>[0-9a-f]{8})\.(?P<pid>[0-9]+)\.[0-9]+\.tmp")
# O_NONBLOCK: opening a FIFO planted under a block's name returns at once instead of waiting for a writer
# forever (it changes nothing for regular files, which are never read "non-blocking").
RFLAGS = os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
WFLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
_PROBE = memoryview(bytearray(1))  # one byte past the expected end: tells "longer than expected" without an fstat


# ------------------------------------------------------------------ one value

def tmp_name(d: str, path: str, seq: int) -> str:
    """The temp file a writer fills for ``path`` (in directory ``d``) with its ``seq``-th temp number."""
    # The pid is read per call, not cached: a forked child must not reuse its parent's temp names.
    return f"{d}/.{path[len(d) + 1:]}.{HOST_TAG}.{os.getpid()}.{seq}.tmp"


def write_tmp(d: str, tmp: str, header: bytes, payload: memoryview, fsync: bool) -> str:
    """Write the value to the new temp file ``tmp`` in directory ``d`` (``tmp_name``; with ``fsync``,
    synced before it is closed); its name (removed again on any error)."""
    try:
        fd = os.open(tmp, WFLAGS, 0o666)
    except FileNotFoundError:  # first block of this shard: create it, once, lazily
        os.makedirs(d, exist_ok=True)
        fd = os.open(tmp, WFLAGS, 0o666)
    try:
        try:
            n = os.writev(fd, [header, payload])
            if n < len(header) + payload.nbytes:  # a short write (rare on files): finish it
                for rest in (memoryview(header)[min(n, len(header)):], payload[max(0, n - len(header)):]):
                    while rest.nbytes:
                        rest = rest[os.write(fd, rest):]
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        unlink(tmp)
        raise
    return tmp


def read_file(path: str, header: memoryview,
               payload: memoryview | blockformat.Segments) -> tuple[int | str | None, int | None]:
    """Read a value into (header, payload), hashing the payload as it lands (``blockformat.read_hashed``:
    segments in ``preadv`` calls of ``HASH_GROUP_BYTES``, a buffer in one).  Returns the value's full
    size (None if absent, or why the entry under the name is no value at all: a FIFO, socket, device or
    directory, never read) and the payload's xxh3-64 when every read came back whole (else None: the
    caller takes it).  ``payload`` may be segments (``reads_segments``): the reads fill the parts in
    order."""
    try:
        fd = os.open(path, RFLAGS)
    except FileNotFoundError:
        return None, None
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symlink planted under a block's name is never followed
            return None, None
        if e.errno == errno.ENXIO:  # open() of a socket, or of a device with no driver behind it
            return "not a regular file but a socket or device", None
        raise
    try:
        mode = os.fstat(fd).st_mode
        if not stat.S_ISREG(mode):
            return f"not a regular file but a {_FILE_KINDS.get(stat.S_IFMT(mode), 'special file')}", None
        want = header.nbytes + payload.nbytes
        # The probe byte past the expected end tells "longer than expected" without an fstat.  Segments
        # are read a group at a time, hashed while in cache; one buffer in one read (why: HASH_GROUP_BYTES).
        group = blockformat.HASH_GROUP_BYTES if isinstance(payload, blockformat.Segments) else want
        n, checksum = blockformat.read_hashed(lambda bufs, off: os.preadv(fd, bufs, off), header, payload,
                                              (_PROBE,), group)
        if n == want:
            return n, checksum
        size = os.fstat(fd).st_size
        while 0 < n < min(want, size):  # a short read (network filesystems): go on from there
            rest = (payload.tail(max(0, n - header.nbytes)) if isinstance(payload, blockformat.Segments)
                    else [payload[max(0, n - header.nbytes):]])
            got = os.preadv(fd, [header[min(n, header.nbytes):], *rest], n)
            n = n + got if got else 0
        return size, None
    finally:
        os.close(fd)


# ------------------------------------------------------------------ the directory at start-up

def shards(root: str, now: float, tmp_max_age_s: float) -> list[tuple[str, os.DirEntry[str]]]:
    """(namespace, shard directory) of every shard under ``root``; dead writers' manifest temp files
    removed on the way."""
    out: list[tuple[str, os.DirEntry[str]]] = []
    for ns in scandir(root):
        if not (NS.fullmatch(ns.name) and ns.is_dir(follow_symlinks=False)):
            continue
        for shard in scandir(ns.path):
            if m := TMP.fullmatch(shard.name):  # a manifest's temp file
                remove_stale_tmp(shard, m, now, tmp_max_age_s)
            elif SHARD.fullmatch(shard.name) and shard.is_dir(follow_symlinks=False):
                out.append((ns.name, shard))
    return out


def scan_shard(ns: str, shard: os.DirEntry[str], now: float,
                tmp_max_age_s: float) -> list[tuple[float, str, int]]:
    found = []
    prefix = shard.name
    for f in scandir(shard.path):
        name = f.name
        if name[0] == "." and (m := TMP.fullmatch(name)):
            remove_stale_tmp(f, m, now, tmp_max_age_s)
        elif HASH.fullmatch(name) and name.startswith(prefix):
            try:
                st = f.stat(follow_symlinks=False)
            except FileNotFoundError:
                continue  # evicted by another process meanwhile
            if stat.S_ISREG(st.st_mode):
                # Last use ~ max(atime, mtime): with relatime, atime moves on the first read after a
                # write; timestamps are coarse (a few ms), so ties keep an arbitrary order.
                found.append((max(st.st_atime, st.st_mtime), f"{ns}/{name}", st.st_size))
    return found

def remove_stale_tmp(entry: os.DirEntry[str], m: re.Match[str], now: float, max_age_s: float) -> None:
    """Remove a temp file (``m``: its name matched by ``TMP``) if its writer is dead (same host) or it is
    older than ``max_age_s``."""
    try:
        age = now - entry.stat(follow_symlinks=False).st_mtime
    except FileNotFoundError:
        return
    if (m["host"] == HOST_TAG and not pid_alive(int(m["pid"]))) or age > max_age_s:
        unlink(entry.path)
        log.info("local_disk: removed leftover temp file %s", entry.path)


# ------------------------------------------------------------------ entries

def entry_kind(path: str) -> bool | str | None:
    """What is under ``path``: True for a regular file (a value), None for nothing (a symlink too: never
    followed, as ``read_file`` does not), or why it is no value at all (a FIFO, socket, device or
    directory).  One ``lstat``; never opens it."""
    try:
        mode = os.lstat(path).st_mode
    except FileNotFoundError:
        return None
    if stat.S_ISREG(mode):
        return True
    if stat.S_ISLNK(mode):
        return None
    return f"not a regular file but a {_FILE_KINDS.get(stat.S_IFMT(mode), 'special file')}"


_FILE_KINDS = {stat.S_IFIFO: "FIFO", stat.S_IFSOCK: "socket", stat.S_IFCHR: "character device",
               stat.S_IFBLK: "block device", stat.S_IFDIR: "directory"}


def scandir(path: str) -> list[os.DirEntry[str]]:
    """Entries of ``path``; empty if it vanished (another process may prune it)."""
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def unlink(path: str) -> int:
    try:
        os.unlink(path)
        return 1
    except FileNotFoundError:  # another process evicted or deleted it first
        return 0
    except IsADirectoryError:  # a directory planted under a block's name: removed if empty, else left
        with contextlib.suppress(OSError):
            os.rmdir(path)
            return 1
        return 0


def regular_size(path: str) -> int:
    """Bytes of the regular file at ``path``; 0 if there is none (absent, or a planted special file)."""
    try:
        st = os.lstat(path)
    except FileNotFoundError:
        return 0
    return st.st_size if stat.S_ISREG(st.st_mode) else 0


def unlink_sized(path: str) -> tuple[int, int]:
    """Remove ``path``: (1 if it was there else 0, bytes of regular file data freed)."""
    size = regular_size(path)
    removed = unlink(path)
    return removed, size if removed else 0
