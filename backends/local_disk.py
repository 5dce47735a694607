"""``local_disk``: one file per stored block under a directory that several processes may share.

Layout: ``<path>/<namespace id>/<hash[:2]>/<hash>`` holds one block (header + payload, see
``kvtier.blockformat``); ``<path>/<namespace id>/manifest.json`` is the namespace's manifest.  256 shard
directories per namespace keep directories small without a second level of ``mkdir``/``scandir`` work.

Invariants:
* A file under a block's name is always a complete value: a writer fills a temp file
  ``.<hash>.<host tag>.<pid>.<n>.tmp`` in the same directory and ``os.replace``s it.  Temp names start with
  a dot, block names are hex, so a temp file is never read as a block; start-up removes those whose writer
  is dead (same host) or that are older than ``tmp_max_age_s``.
* No key can name a path outside the root: every key must be canonical (``kvtier.keys.invalid_key``:
  ``<32 hex>/<32|64 hex>`` or ``<32 hex>/manifest.json``, lower case) before a path is formed from it (the
  base class refuses such keys before any hook; the hooks check again, as tools call them directly), and
  files are opened with ``O_NOFOLLOW``.
* Accounted usage (bytes of the blocks this process knows + bytes reserved by its in-flight writes) never
  exceeds ``capacity``: a put reserves its bytes first, evicting least-recently-used blocks (unlinked
  under the index lock, so bytes on disk never run ahead of the account); a put that cannot get room
  (the room is held by in-flight writes) is refused, never waits.
* The in-memory index is a cache of the directory, rebuilt at start-up (LRU order from each file's
  max(atime, mtime)).  A key it does not know is looked up on disk (another process may have written it)
  and adopted on a verified read; a known key whose file vanished (evicted by another process) is dropped.
  Manifests are not blocks: never evicted, not counted.
"""

from __future__ import annotations

import contextlib
import errno
import hashlib
import itertools
import logging
import os
import re
import socket
import stat
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from operator import itemgetter

from pydantic import Field, field_validator

from kvtier import blockformat
from kvtier.backend import MANIFEST_NAME, BackendOptions, StorageBackend, StoredBlock, frame, verify
from kvtier.keys import invalid_key, show_key
from kvtier.units import ByteSize

log = logging.getLogger("kvtier.backends.local_disk")

_NS = re.compile(r"[0-9a-f]{32}")
_SHARD = re.compile(r"[0-9a-f]{2}")
_HASH = re.compile(r"[0-9a-f]{32}|[0-9a-f]{64}")
_TMP = re.compile(r"\.(?:[0-9a-f]+|manifest\.json)\.(?P<host>[0-9a-f]{8})\.(?P<pid>[0-9]+)\.[0-9]+\.tmp")
# O_NONBLOCK: opening a FIFO planted under a block's name returns at once instead of waiting for a writer
# forever (it changes nothing for regular files, which are never read "non-blocking").
_RFLAGS = os.O_RDONLY | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0) | getattr(os, "O_NONBLOCK", 0)
_WFLAGS = os.O_WRONLY | os.O_CREAT | os.O_EXCL | os.O_CLOEXEC | getattr(os, "O_NOFOLLOW", 0)
_PROBE = bytearray(1)  # one byte past the expected end: tells "longer than expected" without an fstat
_MIN_CHUNK_BYTES = 512 * 1024  # a batch is split across workers only in pieces at least this large
_HOST_TAG = hashlib.sha256(socket.gethostname().encode()).hexdigest()[:8]


class LocalDiskBackend(StorageBackend):
    """Blocks as files in a (possibly shared) directory, bounded by ``capacity`` bytes with LRU eviction."""

    class Options(BackendOptions):
        path: str = Field("~/.cache/kvtier/blocks", description="root directory; ~ and $VARS are expanded")
        capacity: ByteSize = Field(10 * 2**30, description='bytes of blocks kept, e.g. "200GiB"')
        threads: int = Field(4, ge=1, le=256, description="I/O threads per batch")
        fsync: bool = Field(False, description="fsync each file and its directory before a put returns")
        tmp_max_age_s: float = Field(3600.0, gt=0, description="temp files of other hosts older than "
                                     "this are removed at start-up")

        @field_validator("path")
        @classmethod
        def _expand(cls, v: str) -> str:
            if not v or not v.strip():
                raise ValueError("path must not be empty")
            return os.path.abspath(os.path.expandvars(os.path.expanduser(v)))

    options: Options

    def __init__(self, options: Options | dict | None = None, *, name: str | None = None):
        super().__init__(options, name=name or "local_disk")
        o = self.options
        self.root = o.path
        self.capacity = o.capacity
        self._idx_lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> stored bytes, LRU first
        self._used = 0  # sum(index sizes) + in-flight reservations
        self._inflight: dict[str, int] = {}  # keys being written by this process: never evicted
        self._tmp_seq = itertools.count()  # next() on itertools.count is atomic under the GIL
        self._pool: ThreadPoolExecutor | None = None
        self._closed = False
        self._verified_dirs: set[str] = set()  # shard directories checked not to be symlinks
        os.makedirs(self.root, exist_ok=True)
        t0 = time.perf_counter()
        self._rebuild()
        self.startup_seconds = time.perf_counter() - t0

    # ------------------------------------------------------------------ paths

    def _where(self, key: str, checked: bool = False) -> tuple[str, str]:
        """(directory, file) for a key; ValueError naming the key unless it is canonical (``checked``: the
        caller has just checked it)."""
        if not checked:
            self._refuse_invalid_paths([key])
        ns, name = key[:32], key[33:]
        d = f"{self.root}/{ns}" if name == MANIFEST_NAME else f"{self.root}/{ns}/{name[:2]}"
        if d not in self._verified_dirs:
            self._verify_dir(d, ns)
        return d, f"{d}/{name}"

    def _verify_dir(self, d: str, ns: str) -> None:
        """Refuse a namespace or shard directory that is a symbolic link: O_NOFOLLOW only guards the last
        path component, and a planted link would send writes outside the root.  Checked once per
        directory (they are few: 256 per namespace), remembered once it exists."""
        for path in (f"{self.root}/{ns}", d):
            if os.path.islink(path):
                raise ValueError(f"local_disk: refusing {path}: a symbolic link inside the root "
                                 "(blocks never leave the root)")
        if os.path.isdir(d):
            self._verified_dirs.add(d)

    @staticmethod
    def _refuse_invalid_paths(keys: Sequence[str]) -> None:
        bad = invalid_key(keys, manifest=True)
        if bad is not None:
            raise ValueError(f"local_disk: refusing key {show_key(keys[bad[0]])}: {bad[1]}")

    def _check_keys(self, keys: Sequence[str]) -> list[tuple[str, str]]:
        if self._closed:
            raise RuntimeError(f"local_disk at {self.root} is closed")
        self._refuse_invalid_paths(keys)  # one pass over the batch, then paths without a check per key
        return [self._where(k, checked=True) for k in keys]

    # ------------------------------------------------------------------ start-up

    def _rebuild(self) -> None:
        """Index every block file under the root, oldest use first; remove dead writers' temp files."""
        now = time.time()
        shards: list[tuple[str, os.DirEntry]] = []
        for ns in _scandir(self.root):
            if not (_NS.fullmatch(ns.name) and ns.is_dir(follow_symlinks=False)):
                continue
            for shard in _scandir(ns.path):
                if _TMP.fullmatch(shard.name):  # a manifest's temp file
                    self._maybe_remove_tmp(shard, now)
                elif _SHARD.fullmatch(shard.name) and shard.is_dir(follow_symlinks=False):
                    shards.append((ns.name, shard))
        # stat() releases the GIL: shards are listed in parallel (a cold cache makes this I/O bound).
        with ThreadPoolExecutor(self.options.threads) as pool:
            parts = list(pool.map(lambda s: self._scan_shard(*s, now), shards))
        found = [e for part in parts for e in part]
        found.sort(key=itemgetter(0))
        with self._idx_lock:
            for _, key, size in found:
                self._index[key] = size
                self._used += size
            self._evict_locked(0, keep=None)  # the capacity may have shrunk since the last run

    def _scan_shard(self, ns: str, shard: os.DirEntry, now: float) -> list[tuple[float, str, int]]:
        found = []
        prefix = shard.name
        for f in _scandir(shard.path):
            name = f.name
            if name[0] == "." and _TMP.fullmatch(name):
                self._maybe_remove_tmp(f, now)
            elif _HASH.fullmatch(name) and name.startswith(prefix):
                try:
                    st = f.stat(follow_symlinks=False)
                except FileNotFoundError:
                    continue  # evicted by another process meanwhile
                if stat.S_ISREG(st.st_mode):
                    # Last use ~ max(atime, mtime): with relatime, atime moves on the first read after a
                    # write; timestamps are coarse (a few ms), so ties keep an arbitrary order.
                    found.append((max(st.st_atime, st.st_mtime), f"{ns}/{name}", st.st_size))
        return found

    def _maybe_remove_tmp(self, entry: os.DirEntry, now: float) -> None:
        m = _TMP.fullmatch(entry.name)
        try:
            age = now - entry.stat(follow_symlinks=False).st_mtime
        except FileNotFoundError:
            return
        if (m["host"] == _HOST_TAG and not _pid_alive(int(m["pid"]))) or age > self.options.tmp_max_age_s:
            _unlink(entry.path)
            log.info("local_disk: removed leftover temp file %s", entry.path)

    # ------------------------------------------------------------------ index and capacity

    def _evict_locked(self, need: int, keep: str | None) -> bool:
        """Unlink LRU blocks until ``need`` more bytes fit; False if in-flight writes hold the room."""
        while self._used + need > self.capacity:
            victim = next((k for k in self._index if k not in self._inflight and k != keep), None)
            if victim is None:
                return False
            self._used -= self._index.pop(victim)
            _unlink(self._where(victim)[1])
        return True

    def _reserve(self, key: str, size: int) -> bool:
        with self._idx_lock:
            if size > self.capacity or not self._evict_locked(size, keep=None):
                return False
            self._used += size
            self._inflight[key] = self._inflight.get(key, 0) + 1
            return True

    def _settle(self, key: str, size: int, committed: bool) -> None:
        """End a reservation: on success the reserved bytes become the key's (replacing any old entry)."""
        with self._idx_lock:
            n = self._inflight.pop(key) - 1
            if n:
                self._inflight[key] = n
            if committed:
                old = self._index.pop(key, None)
                if old is not None:
                    self._used -= old
                self._index[key] = size
            else:
                self._used -= size

    def _touch(self, key: str, size: int) -> None:
        """A verified read: make ``key`` most recent, adopting it if another process wrote it."""
        with self._idx_lock:
            old = self._index.get(key)
            if old is not None:
                self._index.move_to_end(key)
                return
            self._index[key] = size
            self._used += size
            self._evict_locked(0, keep=key)

    def _forget(self, key: str) -> None:
        with self._idx_lock:
            size = self._index.pop(key, None)
            if size is not None:
                self._used -= size

    # ------------------------------------------------------------------ one file

    def _store(self, key: str, where: tuple[str, str], header: bytes | None, payload: memoryview,
               layout_id: int) -> bool:
        """Frame (if ``header`` is None) and atomically write one value; False if refused for room."""
        manifest = key.endswith(MANIFEST_NAME)
        size = (blockformat.HEADER_SIZE if header is None else len(header)) + payload.nbytes
        if not manifest and not self._reserve(key, size):
            return False
        ok = False
        try:
            if header is None:
                header = frame(key, payload, layout_id)  # checksummed here, in this worker
            self._write_file(where, header, payload)
            ok = True
        finally:
            if not manifest:
                self._settle(key, size, ok)
        return True

    def _write_file(self, where: tuple[str, str], header: bytes, payload: memoryview) -> None:
        d, path = where
        # The pid is read per write, not cached: a forked child must not reuse its parent's temp names.
        tmp = f"{d}/.{path[len(d) + 1:]}.{_HOST_TAG}.{os.getpid()}.{next(self._tmp_seq)}.tmp"
        try:
            fd = os.open(tmp, _WFLAGS, 0o666)
        except FileNotFoundError:  # first block of this shard: create it, once, lazily
            os.makedirs(d, exist_ok=True)
            fd = os.open(tmp, _WFLAGS, 0o666)
        try:
            try:
                n = os.writev(fd, [header, payload])
                if n < len(header) + payload.nbytes:  # a short write (rare on files): finish it
                    for rest in (memoryview(header)[min(n, len(header)):], payload[max(0, n - len(header)):]):
                        while rest.nbytes:
                            rest = rest[os.write(fd, rest):]
                if self.options.fsync:
                    os.fsync(fd)
            finally:
                os.close(fd)
            os.replace(tmp, path)
        except BaseException:
            _unlink(tmp)
            raise
        if self.options.fsync:
            dfd = os.open(d, os.O_RDONLY | os.O_CLOEXEC)
            try:
                os.fsync(dfd)
            finally:
                os.close(dfd)

    @staticmethod
    def _read_file(path: str, header: memoryview, payload: memoryview) -> int | str | None:
        """Read a value into (header, payload) with one ``preadv``; its full size, None if absent, or why
        the entry under the name is no value at all (a FIFO, socket, device or directory: never read)."""
        try:
            fd = os.open(path, _RFLAGS)
        except FileNotFoundError:
            return None
        except OSError as e:
            if e.errno == errno.ELOOP:  # a symlink planted under a block's name is never followed
                return None
            if e.errno == errno.ENXIO:  # open() of a socket, or of a device with no driver behind it
                return "not a regular file but a socket or device"
            raise
        try:
            mode = os.fstat(fd).st_mode
            if not stat.S_ISREG(mode):
                return f"not a regular file but a {_FILE_KINDS.get(stat.S_IFMT(mode), 'special file')}"
            want = header.nbytes + payload.nbytes
            n = os.preadv(fd, [header, payload, _PROBE], 0)
            if n == want:
                return n
            size = os.fstat(fd).st_size
            while 0 < n < min(want, size):  # a short read (network filesystems): go on from there
                got = os.preadv(fd, [header[min(n, header.nbytes):], payload[max(0, n - header.nbytes):]], n)
                n = n + got if got else 0
            return size
        finally:
            os.close(fd)

    # ------------------------------------------------------------------ batches

    def _batch(self, n: int, nbytes: int, work: Callable[[range], list]) -> list:
        """Run ``work`` over index ranges: inline for small batches, else split across the pool's threads
        (one task per thread, not per block, so per-block overhead stays a few microseconds)."""
        k = min(self.options.threads, n, max(1, nbytes // _MIN_CHUNK_BYTES))
        if k <= 1:
            return work(range(n))
        if self._pool is None:
            with self._idx_lock:
                if self._pool is None:
                    self._pool = ThreadPoolExecutor(self.options.threads, thread_name_prefix="kvtier-disk")
        futures = [self._pool.submit(work, range(j, n, k)) for j in range(1, k)]
        out: list = [None] * n
        out[0::k] = work(range(0, n, k))  # the caller's thread does one share itself
        for j, f in enumerate(futures, 1):
            out[j::k] = f.result()
        return out

    def _per_key(self, keys: Sequence[str], nbytes: int, one: Callable, what: str) -> list:
        """Apply ``one(i, header scratch buffer)`` to every key; an OSError is that key's failure (logged), unless every key
        failed, in which case the first error is raised (the disk, not one file, is at fault)."""
        errors: list[OSError] = []

        def work(idx: range) -> list:
            res = []
            scratch = memoryview(bytearray(blockformat.HEADER_SIZE))  # reused: verified before next read
            for i in idx:
                try:
                    res.append(one(i, scratch))
                except OSError as e:
                    errors.append(e)
                    res.append(False)
            return res

        out = self._batch(len(keys), nbytes, work)
        if errors:
            # Disk full / access denied are counted per failed key; a raised error is counted when typed.
            for e in errors[1:] if len(errors) == len(keys) else errors:
                self._count_fault(e)
            if len(errors) == len(keys):
                raise errors[0]
            log.warning("local_disk %s: %d of %d keys failed, first: %s", what, len(errors), len(keys),
                        errors[0])
        return out

    def _put_blocks(self, keys, payloads, layout_id):
        where = self._check_keys(keys)
        return self._per_key(keys, sum(p.nbytes for p in payloads),
                             lambda i, _: self._store(keys[i], where[i], None, payloads[i], layout_id), "put")

    def _write(self, keys, values):
        where = self._check_keys(keys)
        return self._per_key(keys, sum(v[1].nbytes for v in values),
                             lambda i, _: self._store(keys[i], where[i], values[i][0], values[i][1], 0), "write")

    def _get_blocks(self, keys, payloads, layout_id):
        where = self._check_keys(keys)

        def one(i: int, header: memoryview) -> bool | str:
            key, payload = keys[i], payloads[i]
            size = self._read_file(where[i][1], header, payload)
            if size is None:
                self._forget(key)
                return False
            if isinstance(size, str):
                return f"{where[i][1]} is {size}"  # corrupt: counted and deleted by get_into
            why = verify(key, size, header, payload, layout_id)
            if why is None:
                self._touch(key, size)
            return why or True

        return self._per_key(keys, sum(p.nbytes for p in payloads), one, "get")

    def _read_into(self, keys, headers, payloads):
        where = self._check_keys(keys)
        sizes = [self._read_file(w[1], h, p) for w, h, p in zip(where, headers, payloads)]
        for (_, path), size in zip(where, sizes):
            if isinstance(size, str):
                log.warning("local_disk: %s is %s; it reads as an empty, corrupt value", path, size)
        # A special file is a value of no bytes: every reader (kvtier verify) sees it fail its checks.
        return [0 if isinstance(size, str) else size for size in sizes]

    def _exists(self, keys):
        where = self._check_keys(keys)
        index = self._index
        # Known keys answer from memory; unknown ones may have been written by another process.
        return [k in index or os.path.isfile(w[1]) for k, w in zip(keys, where)]

    def _delete(self, keys) -> int:
        where = self._check_keys(keys)
        n = 0
        with self._idx_lock:  # unlinked under the lock: a put cannot reuse room not yet freed
            for key, (_, path) in zip(keys, where):
                size = self._index.pop(key, None)
                if size is not None:
                    self._used -= size
                n += _unlink(path)
        return n

    def _scan(self, prefix: str) -> Iterator[StoredBlock]:
        for ns in _scandir(self.root):
            if not (_NS.fullmatch(ns.name) and ns.name.startswith(prefix[:32])):
                continue
            for shard in _scandir(ns.path):
                if shard.name == MANIFEST_NAME:
                    entries = [shard]
                elif _SHARD.fullmatch(shard.name) and shard.is_dir(follow_symlinks=False):
                    entries = [f for f in _scandir(shard.path) if _HASH.fullmatch(f.name)]
                else:
                    continue
                for f in entries:
                    key = f"{ns.name}/{f.name}"
                    with contextlib.suppress(FileNotFoundError):  # evicted since the listing
                        if key.startswith(prefix):
                            yield StoredBlock(key, f.stat(follow_symlinks=False).st_size)

    def _health(self) -> None:
        if self._closed:
            raise RuntimeError(f"local_disk at {self.root} is closed")
        if not os.path.isdir(self.root):
            raise FileNotFoundError(f"local_disk root {self.root} is gone")
        if not os.access(self.root, os.W_OK | os.X_OK):
            raise PermissionError(f"local_disk root {self.root} is not writable")

    def _location(self) -> str:
        return self.root

    def _eviction_order(self) -> list[StoredBlock]:
        """The index's LRU order (the order a put evicts in), in-flight writes excluded."""
        with self._idx_lock:
            return [StoredBlock(k, n) for k, n in self._index.items() if k not in self._inflight]

    def _usage(self) -> dict:
        with self._idx_lock:
            return {"blocks": len(self._index), "bytes": self._used, "capacity_bytes": self.capacity,
                    "path": self.root, "startup_seconds": self.startup_seconds}

    def _close(self) -> None:
        self._closed = True
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


_FILE_KINDS = {stat.S_IFIFO: "FIFO", stat.S_IFSOCK: "socket", stat.S_IFCHR: "character device",
               stat.S_IFBLK: "block device", stat.S_IFDIR: "directory"}


def _scandir(path: str) -> list[os.DirEntry]:
    """Entries of ``path``; empty if it vanished (another process may prune it)."""
    try:
        with os.scandir(path) as it:
            return list(it)
    except (FileNotFoundError, NotADirectoryError):
        return []


def _unlink(path: str) -> int:
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


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)  # PermissionError: it exists, owned by someone else
    except ProcessLookupError:
        return False
    except PermissionError:
        pass
    return True
