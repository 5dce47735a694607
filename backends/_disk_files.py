"""``local_disk``'s files: the names in its directory, one value's file written and read, and the listing of
the directory at start-up.  No state: the backend (``local_disk.py``) owns the index, the shared ledger and
the capacity, and calls these with its root and options.

A block's file is ``<root>/<namespace>/<hash[:2]>/<hash>``; a temp file is
``.<hash>.<host tag>.<pid>.<n>.tmp`` beside it (a dot first: never read as a block).  A value's file is
its header (88 bytes, or 4096 for an aligned value) and payload, written by ``write_tmp`` in ``writev``
calls straight from the caller's buffers (a payload in segments included: never joined first);
``read_file`` tells which from the size
and reads an aligned cold one with ``O_DIRECT`` (``DirectReads``: off once the filesystem refuses it).  The listing of the
whole directory (``shards`` / ``scan_shard``) serves only an index rebuild.
"""

from __future__ import annotations

import contextlib
import ctypes
import errno
import fcntl
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


def write_tmp(d: str, tmp: str, header: bytes, payload: memoryview | blockformat.Segments, fsync: bool) -> str:
    """Write the value to the new temp file ``tmp`` in directory ``d`` (``tmp_name``; with ``fsync``,
    synced before it is closed); its name (removed again on any error).  ``payload`` may be segments (a
    value of several blocks, each in its own host slot): header and parts go down in one ``writev``,
    never joined in memory first."""
    try:
        fd = os.open(tmp, WFLAGS, 0o666)
    except FileNotFoundError:  # first block of this shard: create it, once, lazily
        os.makedirs(d, exist_ok=True)
        fd = os.open(tmp, WFLAGS, 0o666)
    try:
        try:
            _write_all(fd, [memoryview(header), *(payload.parts if isinstance(payload, blockformat.Segments)
                                                   else [payload])])
            if fsync:
                os.fsync(fd)
        finally:
            os.close(fd)
    except BaseException:
        unlink(tmp)
        raise
    return tmp


_IOV_MAX = os.sysconf("SC_IOV_MAX") if hasattr(os, "sysconf") else 1024  # writev's limit per call


def _write_all(fd: int, bufs: list[memoryview]) -> None:
    """Write ``bufs`` in order at the file's offset: one ``writev`` (of at most ``_IOV_MAX`` buffers) for
    what the kernel takes whole, the rest of a short write (rare on files) finished from where it ended."""
    while bufs:
        batch = bufs[:_IOV_MAX]
        n = os.writev(fd, batch)
        rest = bufs[len(batch):]
        for i, b in enumerate(batch):  # short: keep the rest of the buffer it stopped in and all after it
            if n < b.nbytes:
                rest = [b[n:], *batch[i + 1:], *rest]
                break
            n -= b.nbytes
        bufs = rest


class DirectReads:
    """Whether this directory's reads may use ``O_DIRECT`` (a backend holds one): on until the filesystem
    refuses it (``EINVAL``: tmpfs on older kernels, some network and FUSE filesystems), then buffered for
    the rest of the backend's life.  Reads are never lost to it: a refused direct read is done again
    buffered."""

    __slots__ = ("enabled",)

    def __init__(self, enabled: bool = True):
        self.enabled = enabled and _O_DIRECT != 0 and _RWF_NOWAIT != 0

    def refused(self, path: str, e: OSError) -> None:
        if self.enabled:
            self.enabled = False
            log.info("local_disk: %s: O_DIRECT refused (%s); reading through the page cache", path, e)


_O_DIRECT = getattr(os, "O_DIRECT", 0)
_RWF_NOWAIT = getattr(os, "RWF_NOWAIT", 0)
PAGE = blockformat.ALIGNED_HEADER_SIZE  # the alignment O_DIRECT is given: buffer address, length, offset


def page_aligned(payload: memoryview | blockformat.Segments) -> bool:
    """Whether every buffer of ``payload`` starts on a page and is whole pages (what O_DIRECT needs)."""
    parts = payload.parts if isinstance(payload, blockformat.Segments) else [payload]
    for p in parts:
        if p.nbytes == 0 or p.nbytes % PAGE or p.readonly:
            return False
        try:
            if ctypes.addressof(ctypes.c_char.from_buffer(p)) % PAGE:
                return False
        except (TypeError, ValueError):  # not a plain writable buffer
            return False
    return True


def _cached(fd: int, size: int) -> bool:
    """Whether the value's last byte is in the page cache (``RWF_NOWAIT``: answered without I/O), taken
    for the whole value: a value just written or read is cached whole, a cold one not at all."""
    try:
        return os.preadv(fd, [_TAIL], size - 1, _RWF_NOWAIT) == 1
    except BlockingIOError:
        return False
    except OSError:  # RWF_NOWAIT unsupported here: read through the page cache as before
        return True


_TAIL = memoryview(bytearray(1))


def read_file(path: str, header: memoryview, payload: memoryview | blockformat.Segments,
              aligned: DirectReads | None = None, hashed: bool = True) -> tuple[int | str | None, int | None, int]:
    """Read a value into (header, payload), hashing the payload as it lands (``blockformat.read_hashed``:
    segments in ``preadv`` calls of ``HASH_GROUP_BYTES``, a buffer in one).  Returns the value's full
    size (None if absent, or why the entry under the name is no value at all: a FIFO, socket, device or
    directory, never read), the payload's xxh3-64 when every read came back whole (else None: the
    caller takes it), and the length of the header read (the first that many bytes of ``header``).
    ``payload`` may be segments (``reads_segments``): the reads fill the parts in order.  ``hashed``
    False (a sealed value: its tag covers the payload): no checksum is taken, the second item is None.

    Raw (``aligned`` None): the first ``header.nbytes`` bytes into ``header``, the rest into ``payload``,
    with no ``fstat`` when the read comes back whole with nothing past it (its size is then what was
    read).  A special file is named after its read fails (a FIFO, a directory) or comes back short or
    long (a character device); a block device of exactly a value's size would be read as one and refused
    by the caller's check (header, checksum or tag) like any planted file, counted and deleted.
    With ``aligned`` (``header`` is then a page-aligned 4096-byte buffer): a value of the aligned layout
    (``blockformat.ALIGNED_HEADER_SIZE``, told by its size: 4096 + the payload's) is read whole page into
    ``header``, payload into ``payload``; when it is not in the page cache and the buffers are page
    aligned, with ``O_DIRECT`` (the device straight into them), else buffered.  A value of the 88-byte
    layout (every value written before) is read into ``header[:88]`` and ``payload`` as always."""
    try:
        fd = os.open(path, RFLAGS)
    except FileNotFoundError:
        return None, None, header.nbytes
    except OSError as e:
        if e.errno == errno.ELOOP:  # a symlink planted under a block's name is never followed
            return None, None, header.nbytes
        if e.errno == errno.ENXIO:  # open() of a socket, or of a device with no driver behind it
            return "not a regular file but a socket or device", None, header.nbytes
        raise
    try:
        if aligned is None:
            # Raw: no fstat.  The read tells the size itself (whole, and nothing in the probe byte past it:
            # exactly the expected length), and one fstat fewer is one GIL release fewer per value, each
            # a wait behind another thread's decryption when a batch's threads share the GIL.  What is
            # not a regular file shows in the read: pread fails on a FIFO (ESPIPE) or a directory
            # (EISDIR), a character device reads short or long; only then is it fstat-ed and named.
            try:
                if not hashed and isinstance(payload, memoryview) and payload.format == "B" and payload.ndim == 1:
                    # A sealed value into one buffer (every local_disk get in a sealed mode): one preadv
                    # here, without read_hashed's frames (about 1 us a value under the GIL).  Anything
                    # but whole goes the general way below, from offset 0 again.
                    n = os.preadv(fd, [header, payload, _PROBE], 0)
                    if n == header.nbytes + payload.nbytes:
                        return n, None, header.nbytes
                return (*_read_buffered(fd, header, payload, probe=True, hashed=hashed), header.nbytes)
            except OSError:
                st = os.fstat(fd)
                if stat.S_ISREG(st.st_mode):
                    raise
                return _not_regular(st.st_mode), None, header.nbytes
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            return _not_regular(st.st_mode), None, header.nbytes
        if st.st_size == PAGE + payload.nbytes:
            return _read_aligned(fd, path, st.st_size, header, payload, aligned)
        head = header[:blockformat.HEADER_SIZE]
        return (*_read_buffered(fd, head, payload, probe=True, hashed=hashed), head.nbytes)
    finally:
        os.close(fd)


def _not_regular(mode: int) -> str:
    return f"not a regular file but a {_FILE_KINDS.get(stat.S_IFMT(mode), 'special file')}"


def _read_buffered(fd: int, header: memoryview, payload: memoryview | blockformat.Segments,
                   probe: bool, hashed: bool = True) -> tuple[int | str, int | None]:
    """(the value's size, or why it is not a regular file; its payload's xxh3-64 or None).  Whole and
    nothing past it (the probe byte found no more): the size is what was read, no fstat."""
    want = header.nbytes + payload.nbytes
    # The probe byte past the expected end tells "longer than expected" (a value that grew since the
    # fstat, or that was never fstat-ed: a raw read).  Segments are read a group at a time, hashed while
    # in cache; one buffer in one read (why: HASH_GROUP_BYTES).
    group = blockformat.HASH_GROUP_BYTES if isinstance(payload, blockformat.Segments) else want
    n, checksum = blockformat.read_hashed(lambda bufs, off: os.preadv(fd, bufs, off), header, payload,
                                          (_PROBE,) if probe else (), group, hashed)
    if n == want:
        return n, checksum
    st = os.fstat(fd)
    if not stat.S_ISREG(st.st_mode):  # a raw read of a character device (a null one reads nothing)
        return _not_regular(st.st_mode), None
    size = st.st_size
    while 0 < n < min(want, size):  # a short read (network filesystems): go on from there
        rest = (payload.tail(max(0, n - header.nbytes)) if isinstance(payload, blockformat.Segments)
                else [payload[max(0, n - header.nbytes):]])
        got = os.preadv(fd, [header[min(n, header.nbytes):], *rest], n)
        n = n + got if got else 0
    return size, None


def _read_aligned(fd: int, path: str, size: int, page: memoryview, payload: memoryview | blockformat.Segments,
                  direct: DirectReads) -> tuple[int | str | None, int | None, int]:
    """An aligned value (4096-byte header): with O_DIRECT when it is cold and the buffers allow, else
    buffered; the whole page and the payload in the same reads, hashed as they land."""
    if direct.enabled and not _cached(fd, size) and page_aligned(payload) and page_aligned(page):
        try:
            fcntl.fcntl(fd, fcntl.F_SETFL, os.O_NONBLOCK | _O_DIRECT)  # this descriptor only
            # One read for a buffer (the device's best request size; its bytes are not in a core's
            # cache either way), HASH_GROUP_BYTES for segments (at most IOV_MAX buffers a call).
            group = blockformat.HASH_GROUP_BYTES if isinstance(payload, blockformat.Segments) else size
            n, checksum = blockformat.read_hashed(lambda bufs, off: os.preadv(fd, bufs, off), page, payload,
                                                  (), group)
            if n == size:
                return n, checksum, PAGE
        except OSError as e:
            if e.errno != errno.EINVAL:
                raise
            direct.refused(path, e)
        fcntl.fcntl(fd, fcntl.F_SETFL, os.O_NONBLOCK)  # what O_DIRECT did not read whole: buffered
    return (*_read_buffered(fd, page, payload, probe=False), PAGE)


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
    return _not_regular(mode)


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
