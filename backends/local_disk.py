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
* ``capacity`` bounds the directory, whatever number of processes share it: the bytes of its block files
  plus the bytes reserved by every writer's in-flight temp files never exceed it.  All of them keep that
  account in one ledger, ``<path>/.kvtier-usage.json``, changed only under an exclusive ``flock`` on it
  and always together with the filesystem change it describes: a put reserves room for its batch first
  (evicting least recently used blocks if needed), writes its temp files, then renames them into place
  under the lock, which frees the replaced files' bytes in the same step; deletes and evictions unlink
  under it.  So bytes on disk never run ahead of the ledger.  A put that cannot get room (the room is held
  by in-flight writes) is refused, never waits.  The ledger is recounted from a scan of the directory
  when it is missing or unreadable, when a writer that held bytes in it is found dead (kill -9: it may
  have renamed or unlinked without accounting), and when a process must evict but knows no block to
  evict.  A writer with nothing in flight enters itself (1 byte) before it unlinks, so a kill among its
  unlinks is found too.
* The in-memory index is a cache of the directory, rebuilt at start-up (LRU order from each file's
  max(atime, mtime)) and refreshed whenever the ledger is recounted (blocks it did not know go first,
  oldest first).  A key it does not know is looked up on disk (another process may have written it) and
  adopted on a verified read; a known key whose file vanished (evicted or deleted as corrupt by another
  process) is dropped when a read or an ``exists`` finds it gone, and ``exists`` always asks the directory.
  Each process evicts in its own LRU order, so across processes eviction is only roughly LRU.  The
  blocks a put evicts are told to ``on_evicted`` (the stack using this backend) after the lock is released.
* Every block unlinked (evicted, deleted: by any process, ``kvtier gc`` and ``verify --fix`` included) is
  noted in the directory's removal journal in the same lock session (``_disk_removals``); each backend
  polls it every ``removals_poll_s`` and tells ``on_evicted`` the keys it had indexed that another process
  removed.  So another process's eviction reaches this process's stack (and the KV events routers read)
  within about ``removals_poll_s``, without waiting for a read to miss.
  Manifests are not blocks: never evicted, not counted.
* A held block (``hold``: a load will read it) is evicted by no process sharing the directory until its
  holder releases it or dies: this process counts its holds, other processes see them as hard links
  (``_disk_holds``); a put that finds only held blocks in its way is refused.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import os
import threading
import time
import weakref
from collections import OrderedDict
from collections.abc import Callable, Iterator, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, cast

from pydantic import Field, field_validator

from kvtier import threads as kvthreads
from kvtier.backend_api import BackendOptions, StorageBackend, StoredBlock
from kvtier.backends._disk_files import (
    HASH,
    NS,
    SHARD,
    entry_kind,
    list_blocks,
    read_file,
    regular_size,
    write_tmp,
)
from kvtier.backends._disk_files import scandir as _scandir
from kvtier.backends._disk_files import unlink as _unlink
from kvtier.backends._disk_files import unlink_sized as _unlink_sized  # (a test replaces it here)
from kvtier.backends._disk_holds import DiskHolds, drop_dead_holders, held_elsewhere
from kvtier.backends._disk_ledger import HOST_TAG, Ledger, shared_ledger
from kvtier.backends._disk_ledger import LEDGER_NAME as LEDGER_NAME  # its public name, where tools import it
from kvtier.backends._disk_removals import JOURNAL_NAME as JOURNAL_NAME  # public, as LEDGER_NAME
from kvtier.backends._disk_removals import RemovalFeed
from kvtier.keys import MANIFEST_NAME, invalid_key, show_key
from kvtier.units import ByteSize

log = logging.getLogger("kvtier.backends.local_disk")
_T = TypeVar("_T")

_MIN_CHUNK_BYTES = 512 * 1024  # a batch is split across workers only in pieces at least this large
class LocalDiskBackend(StorageBackend):
    """Blocks as files in a (possibly shared) directory, bounded by ``capacity`` bytes with LRU eviction."""

    streams_verified = True  # _get_blocks reports each block as it verifies it (StorageBackend.get_into)
    reads_segments = True  # a payload may be Segments: preadv takes the parts as they are

    class Options(BackendOptions):
        path: str = Field("~/.cache/kvtier/blocks", description="root directory; ~ and $VARS are expanded")
        capacity: ByteSize = Field(10 * 2**30, description='bytes of blocks kept, e.g. "200GiB"')
        threads: int = Field(4, ge=1, le=256, description="I/O threads per batch")
        fsync: bool = Field(False, description="fsync each file and its directory before a put returns")
        tmp_max_age_s: float = Field(3600.0, gt=0, description="temp files of other hosts older than "
                                     "this are removed at start-up")
        removals_poll_s: float = Field(1.0, ge=0, description="how often the blocks other processes "
                                       "removed from the directory are read from its journal (0: never)")

        @field_validator("path")
        @classmethod
        def _expand(cls, v: str) -> str:
            if not v or not v.strip():
                raise ValueError("path must not be empty")
            return os.path.abspath(os.path.expandvars(os.path.expanduser(v)))

    options: Options

    def __init__(self, options: Options | dict[str, Any] | None = None, *, name: str | None = None):
        super().__init__(options, name=name or "local_disk")
        o = self.options
        self.root = o.path
        self.capacity = o.capacity
        self._idx_lock = threading.Lock()
        self._index: OrderedDict[str, int] = OrderedDict()  # key -> stored bytes, LRU first
        # Keys this process is writing, or holds for a planned read (``hold``): never evicted.
        self._inflight: dict[str, int] = {}
        self._holds = DiskHolds(self.root)  # what other processes must not evict either (hard links)
        self._dir_bytes = 0  # the ledger's total when last seen
        self._tmp_seq = itertools.count()  # next() on itertools.count is atomic under the GIL
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()  # its own: the pool is first needed under other locks
        self._closed = False
        self._verified_dirs: set[str] = set()  # shard directories checked not to be symlinks
        os.makedirs(self.root, exist_ok=True)
        self._stop_watch = threading.Event()
        # Opened before the index is built: a removal made meanwhile is then read, not missed.
        feed = RemovalFeed(self.root) if o.removals_poll_s > 0 else None
        t0 = time.perf_counter()
        self._rebuild()
        self.startup_seconds = time.perf_counter() - t0
        if feed is not None:
            threading.Thread(target=_watch_removals, args=(weakref.ref(self), feed, self._stop_watch,
                             o.removals_poll_s), name="kvtier-local-disk-removals", daemon=True).start()

    def removed_elsewhere(self, keys: Sequence[str]) -> list[str]:
        """Blocks removed from the directory by some process (its journal says): those this process had
        indexed are dropped from the index and told to ``on_evicted``.  (This process's own removals left
        the index before they were unlinked, so they are not told twice.)  Returns the keys told."""
        if not keys:
            return []
        with self._idx_lock:
            mine = [k for k in keys if self._index.pop(k, None) is not None]
        self._evicted(mine)
        return mine

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
        """Index every block file under the root, oldest use first; remove dead writers' temp files; evict
        down to the capacity."""
        found = self._list_blocks(time.time())
        with self._idx_lock:
            for _, key, size in found:
                self._index[key] = size
        drop_dead_holders(self.root, self.options.tmp_max_age_s)
        try:
            with self._shared() as led:
                if led.drop_dead_writers(self.options.tmp_max_age_s):
                    self._recount(led)
                self._make_room(led, 0)  # the capacity may have shrunk since the last run
        except OSError as e:  # read-only, full: reads work, and each write will say why it fails
            log.warning("local_disk: %s: cannot update the usage ledger at start-up (%s); reads work, "
                        "writes will fail until it can be", self.root, e)

    def _list_blocks(self, now: float) -> list[tuple[float, str, int]]:
        """(last use, key, size) of every block file, oldest first; dead writers' temp files removed."""
        found: list[tuple[float, str, int]] = list_blocks(self.root, now, self.options.threads,
                                                          self.options.tmp_max_age_s)
        return found

    # ------------------------------------------------------------------ the shared ledger, capacity

    @contextlib.contextmanager
    def _shared(self) -> Iterator[Ledger]:
        """The directory's ledger, held exclusively (``shared_ledger``), counted from the directory when it
        is new or unreadable.  The index lock is taken inside, only around index changes, and never held
        while waiting for the flock or for the pool: the pool's read tasks take it."""
        with shared_ledger(self.root, self._recount) as led:
            try:
                yield led
            finally:
                self._dir_bytes = led.total

    def _recount(self, led: Ledger) -> None:
        """Set the ledger's block bytes from a scan of the directory (under the ledger's lock, so no other
        process changes it meanwhile), and refresh the index from it: blocks this process did not know
        (other processes', a dead writer's) go first, oldest first, ahead of its own LRU order."""
        found = self._list_blocks(time.time())
        led.bytes = sum(size for _, _, size in found)
        led.changed = True
        log.info("local_disk: %s recounted: %d blocks, %d bytes", self.root, len(found), led.bytes)
        sizes = {key: size for _, key, size in found}
        with self._idx_lock:
            index = OrderedDict((key, size) for _, key, size in found if key not in self._index)
            index.update((key, sizes[key]) for key in self._index if key in sizes)
            self._index = index

    def _make_room(self, led: Ledger, need: int, victims: list[str] | None = None) -> bool:
        """Unlink least recently used blocks until ``need`` more bytes fit in the directory; False if in-flight
        writes hold the room.  Called under ``_shared``; the keys unlinked are added to ``victims``."""
        if led.total + need <= self.capacity:
            return True
        # A dead writer's entry: it may have renamed without accounting.
        recounted = led.drop_dead_writers(self.options.tmp_max_age_s)
        if recounted:
            self._recount(led)
        held: set[str] = set()  # blocks another process holds for a read: skipped (one eviction at a time:
        # this runs under the directory's flock, so no other thread picks victims meanwhile)
        with led.unlinking(self._writer()) as marker:
            while led.total - marker + need > self.capacity:
                with self._idx_lock:
                    victim = next((k for k in self._index if k not in self._inflight and k not in held), None)
                if victim is None:
                    if recounted or not self._knows_less_than(led):
                        return False  # the room is held by in-flight writes and loads
                    self._recount(led)  # the room is held by blocks other processes wrote
                    recounted = True
                    continue
                path = self._where(victim, checked=True)[1]
                if held_elsewhere(path):
                    if not held:  # a holder that died would pin its blocks for good
                        drop_dead_holders(self.root, self.options.tmp_max_age_s)
                    if held_elsewhere(path):
                        held.add(victim)
                        continue
                with self._idx_lock:
                    self._index.pop(victim, None)
                removed, freed = _unlink_sized(path)
                led.bytes -= freed
                led.changed = True
                if removed:
                    led.removed.append(victim)
                if victims is not None:
                    victims.append(victim)
        return True

    def _knows_less_than(self, led: Ledger) -> bool:
        """Whether the directory holds block bytes this process's index does not know (another process's
        blocks), so that a recount could find something to evict.  When it knows every byte and all of
        it is held, a put is refused without a scan of the directory."""
        with self._idx_lock:
            known: int = sum(self._index.values())
        return bool(led.bytes > known)

    def _writer(self) -> str:
        return f"{HOST_TAG}:{os.getpid()}"  # read per call: a forked child is a writer of its own

    def _reserve(self, keys: Sequence[str], sizes: Sequence[int]) -> list[bool]:
        """Reserve room for a batch's blocks, in order, in one lock session; per key whether granted (not:
        a block bigger than the capacity, or once the room is held by in-flight writes).  Manifests are
        not blocks: always granted, never reserved."""
        granted = [False] * len(keys)
        evicted: list[str] = []
        with self._shared() as led:
            held = 0  # this batch's reservations so far, entered in the ledger once, at the end
            for i, (key, size) in enumerate(zip(keys, sizes)):
                if key.endswith(MANIFEST_NAME):
                    granted[i] = True
                    continue
                if size > self.capacity:
                    continue
                if not self._make_room(led, held + size, evicted):
                    break  # the room is in flight: the rest of the batch would only scan again
                held += size
                with self._idx_lock:
                    self._inflight[key] = self._inflight.get(key, 0) + 1
                granted[i] = True
            if held:
                led.hold(self._writer(), held)
        self._evicted(evicted)  # outside the directory's lock: the listener takes the stack's
        return granted

    def _settle(self, keys: Sequence[str], where: Sequence[tuple[str, str]], sizes: Sequence[int],
                granted: Sequence[bool], tmps: Sequence[str | None]) -> tuple[list[bool], list[OSError]]:
        """End a batch's reservations: rename each written temp file into place and account it, all under
        one lock session, so a replaced file's bytes are freed in the same step.  Per key whether it is
        stored, and the rename errors (their temp files removed)."""
        written = {i: tmp for i, tmp in enumerate(tmps) if granted[i] and tmp is not None}  # index -> temp file
        # A key twice in one batch: only its last value is renamed (as if written in order), so that no
        # two threads rename over one path at once and each rename's replaced size is exact.
        last = {keys[i]: i for i in written}
        todo = [i for i in written if last[keys[i]] == i]
        superseded = [i for i in written if last[keys[i]] != i]

        def rename(idx: range) -> list[int | OSError]:
            """lstat + replace for todo[idx]: the bytes each replaced (or its error).  In the pool's threads,
            on the session's behalf: replacing a file frees its pages, which is worth spreading."""
            out: list[int | OSError] = []
            for j in idx:
                tmp, path = written[todo[j]], where[todo[j]][1]
                try:
                    old = regular_size(path)
                    os.replace(tmp, path)
                    out.append(old)
                except OSError as e:
                    _unlink(tmp)
                    out.append(e)
            return out

        stored = [False] * len(keys)
        errors: list[OSError] = []
        released = 0
        for i in superseded:
            _unlink(written[i])
            stored[i] = True
        with self._shared() as led:
            try:
                replaced = dict(zip(todo, self._batch(len(todo), sum(sizes[i] for i in todo), rename)))
            finally:  # the reservations end whatever happened to the renames
                with self._idx_lock:
                    for i, key in enumerate(keys):
                        if granted[i] and not key.endswith(MANIFEST_NAME):
                            n = self._inflight.pop(key) - 1
                            if n:
                                self._inflight[key] = n
                            released += sizes[i]
                if released:
                    led.hold(self._writer(), -released)
            with self._idx_lock:
                for i, old in replaced.items():
                    if isinstance(old, OSError):
                        errors.append(old)
                        continue
                    stored[i] = True
                    if not keys[i].endswith(MANIFEST_NAME):
                        led.bytes += sizes[i] - old
                        led.changed = True
                        self._index.pop(keys[i], None)
                        self._index[keys[i]] = sizes[i]
        return stored, errors

    # ------------------------------------------------------------------ one file

    def _store(self, keys: Sequence[str], where: Sequence[tuple[str, str]], sizes: Sequence[int],
               value: Callable[[int], tuple[bytes, memoryview]], what: str) -> list[bool]:
        """Store a batch: reserve room for all of it, write each granted ``value(i)`` (header, payload) to a
        temp file (in the pool's threads), then rename them into place under one lock; per key whether
        stored.  Two ledger sessions per batch, not per block."""
        granted = self._reserve(keys, sizes)
        tmps: list[str | None] = [None] * len(keys)

        def one(i: int) -> bool:
            if granted[i]:
                tmps[i] = write_tmp(*where[i], *value(i), next(self._tmp_seq), self.options.fsync)
            return True

        try:
            self._per_key(keys, sum(sizes), one, what)  # raises only if every write failed
        finally:
            stored, errors = self._settle(keys, where, sizes, granted, tmps)  # whatever happened above
        self._report(errors, len(keys), what)
        if self.options.fsync:
            for d in {w[0] for w, ok in zip(where, stored) if ok}:
                dfd = os.open(d, os.O_RDONLY | os.O_CLOEXEC)
                try:
                    os.fsync(dfd)
                finally:
                    os.close(dfd)
        return stored

    # ------------------------------------------------------------------ batches

    def _batch(self, n: int, nbytes: int, work: Callable[[range], list[_T]]) -> list[_T]:
        """Run ``work`` over index ranges: inline for small batches, else split across the pool's threads
        (one task per thread, not per block, so per-block overhead stays a few microseconds)."""
        k = min(self.options.threads, n, max(1, nbytes // _MIN_CHUNK_BYTES))
        if k <= 1:
            return work(range(n))
        if self._pool is None:
            with self._pool_lock:
                if self._pool is None:
                    self._pool = kvthreads.pool(self.options.threads, "kvtier-disk")
        futures = [self._pool.submit(work, range(j, n, k)) for j in range(1, k)]
        out: list[_T | None] = [None] * n
        out[0::k] = work(range(0, n, k))  # the caller's thread does one share itself
        for j, f in enumerate(futures, 1):
            out[j::k] = f.result()
        return cast("list[_T]", out)  # every slot is filled now

    def _per_key(self, keys: Sequence[str], nbytes: int, one: Callable[[int], bool], what: str) -> list[bool]:
        """Apply ``one(i)`` to every key; an OSError is that key's failure (logged), unless every key
        failed, in which case the first error is raised (the disk, not one file, is at fault)."""
        errors: list[OSError] = []

        def work(idx: range) -> list[bool]:
            res = []
            for i in idx:
                try:
                    res.append(one(i))
                except OSError as e:
                    errors.append(e)
                    res.append(False)
            return res

        out = self._batch(len(keys), nbytes, work)
        self._report(errors, len(keys), what)
        return out

    def _report(self, errors: list[OSError], n: int, what: str) -> None:
        """A batch's per-key errors: raised (the first) if all ``n`` keys failed, else logged.  Disk full /
        access denied are counted per failed key (a raised error is counted when the base class types it)."""
        if not errors:
            return
        for e in errors[1:] if len(errors) == n else errors:
            self._count_fault(e)
        if len(errors) == n:
            raise errors[0]
        log.warning("local_disk %s: %d of %d keys failed, first: %s", what, len(errors), n, errors[0])

    def _put_blocks(self, keys: Sequence[str], payloads: Sequence[memoryview], layout_id: int) -> list[bool]:
        where = self._check_keys(keys)
        sizes = [self.header_size + p.nbytes for p in payloads]
        # Framed in the workers: each payload is checksummed right before it is written.
        return self._store(keys, where, sizes, lambda i: self._frame(keys[i], payloads[i], layout_id),
                           "put")

    def _write(self, keys: Sequence[str], values: Sequence[tuple[bytes, memoryview]]) -> list[bool]:
        where = self._check_keys(keys)
        return self._store(keys, where, [len(h) + p.nbytes for h, p in values], values.__getitem__, "write")

    def _get_blocks(self, keys: Sequence[str], payloads: Sequence[memoryview], layout_id: int,
                    on_verified: Callable[[int], None] | None = None) -> list[bool | str]:
        """Read and verify a batch, each payload straight into the caller's buffer (no copy; the header first
        and a one-byte probe last; segments ``blockformat.HASH_GROUP_BYTES`` a ``preadv``), its checksum
        taken right after its read, while its bytes are still in the core's cache (one pass).  Batches
        worth splitting run in the pool's threads; file reads and xxh3 both release the GIL, so one thread's
        hash overlaps another thread's next read.  The work per block in Python is kept to what
        verification needs: keys were checked once for the batch, verified keys are made most recent in
        one index update at the end."""
        where = self._check_keys(keys)
        check, read, hsize = self._verify, read_file, self.header_size
        errors: list[OSError] = []
        verified: list[tuple[str, int]] = []  # list.append is atomic: shared by the workers
        forgotten: list[str] = []

        def work(idx: range) -> list[bool | str]:
            header = memoryview(bytearray(hsize))  # reused: verified before the next read
            out: list[bool | str] = []
            for i in idx:
                key, payload, path = keys[i], payloads[i], where[i][1]
                try:
                    size, checksum = read(path, header, payload)
                    if size is None and (linked := self._holds.path(key)) is not None:
                        # A put elsewhere unlinked it in the instant before our hold: read it through
                        # the hold's link (``_disk_holds``), the same bytes.
                        size, checksum = read(linked, header, payload)
                except OSError as e:
                    errors.append(e)
                    out.append(False)
                    continue
                if size is None:
                    forgotten.append(key)
                    out.append(False)
                elif isinstance(size, str):
                    out.append(f"{path} is {size}")  # corrupt: counted and deleted by get_into
                else:
                    why = check(key, size, header, payload, layout_id, checksum)  # the size too
                    if why is None:
                        verified.append((key, size))
                        out.append(True)
                        if on_verified is not None:
                            on_verified(i)  # in this thread, while the bytes are still in cache
                    else:
                        out.append(why)
            return out

        out = self._batch(len(keys), sum(p.nbytes for p in payloads), work)
        if verified or forgotten:
            with self._idx_lock:
                index = self._index
                for key in forgotten:
                    index.pop(key, None)
                for key, size in verified:  # a verified read: most recent, adopted if another process wrote it
                    if key in index:
                        index.move_to_end(key)
                    else:
                        index[key] = size
        self._report(errors, len(keys), "get")
        return out

    def _read_into(self, keys: Sequence[str], headers: Sequence[memoryview],
                   payloads: Sequence[memoryview]) -> list[int | None]:
        where = self._check_keys(keys)
        sizes = [read_file(w[1], h, p)[0] for w, h, p in zip(where, headers, payloads)]
        for (_, path), size in zip(where, sizes):
            if isinstance(size, str):
                log.warning("local_disk: %s is %s; it reads as an empty, corrupt value", path, size)
        # A special file is a value of no bytes: every reader (kvtier verify) sees it fail its checks.
        return [0 if isinstance(size, str) else size for size in sizes]

    def _exists(self, keys: Sequence[str]) -> list[bool]:
        where = self._check_keys(keys)
        # The directory is the truth, for keys this process knows too: another process sharing it (vLLM's
        # worker beside its scheduler, a prefill instance) may have evicted the block or deleted it as
        # corrupt, and a key answered from memory would be offered, loaded, fail and be offered again.
        # One stat per key; lookups probe from their own threads, never the engine's.
        kinds = [entry_kind(w[1]) for w in where]
        out = [kind is True for kind in kinds]
        # A FIFO, socket, device or directory under a block's name is a corrupt entry, as a read finds it:
        # a lookup that met it counts and removes it (else nothing would: it is never offered, so never read).
        self._found_corrupt([(k, f"{w[1]} is {kind}") for k, w, kind in zip(keys, where, kinds)
                             if isinstance(kind, str)])
        gone = [k for k, ok in zip(keys, out) if not ok]
        if gone:
            with self._idx_lock:
                for k in gone:
                    self._index.pop(k, None)
        return out

    def _delete(self, keys: Sequence[str]) -> int:
        where = self._check_keys(keys)
        n = 0
        # Unlinked under the lock: a put cannot reuse room not yet freed.
        with self._shared() as led, led.unlinking(self._writer()):
            for key, (_, path) in zip(keys, where):
                with self._idx_lock:
                    self._index.pop(key, None)
                removed, freed = _unlink_sized(path)
                if not key.endswith(MANIFEST_NAME):  # manifests are not in the ledger, nor in the journal
                    led.bytes -= freed
                    led.changed = True
                    if removed:
                        led.removed.append(key)
                n += removed
        return n

    def _scan(self, prefix: str) -> Iterator[StoredBlock]:
        for ns in _scandir(self.root):
            if not (NS.fullmatch(ns.name) and ns.name.startswith(prefix[:32])):
                continue
            for shard in _scandir(ns.path):
                if shard.name == MANIFEST_NAME:
                    entries = [shard]
                elif SHARD.fullmatch(shard.name) and shard.is_dir(follow_symlinks=False):
                    entries = [f for f in _scandir(shard.path) if HASH.fullmatch(f.name)]
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

    def hold(self, keys: Sequence[str]) -> None:
        """Keep ``keys`` from every process's evictions until ``release``: counted here (this process's
        puts), and linked once into this instance's hold directory (other processes': ``_disk_holds``)."""
        first: list[str] = []
        with self._idx_lock:
            for key in keys:
                n = self._inflight.get(key, 0)
                self._inflight[key] = n + 1
                if n == 0:
                    first.append(key)
        for key in first:
            self._holds.hold(key, self._where(key)[1])

    def release(self, keys: Sequence[str]) -> None:
        last: list[str] = []
        with self._idx_lock:
            for key in keys:
                n = self._inflight.pop(key, 0) - 1
                if n > 0:
                    self._inflight[key] = n
                else:
                    last.append(key)
        for key in last:
            self._holds.release(key)

    def _eviction_order(self) -> list[StoredBlock]:
        """The index's LRU order (the order a put evicts in), in-flight writes excluded."""
        with self._idx_lock:
            return [StoredBlock(k, n) for k, n in self._index.items() if k not in self._inflight]

    def _usage(self) -> dict[str, Any]:
        """``blocks``: those this process knows; ``bytes``: the directory's (every process's blocks and
        in-flight writes), from the ledger."""
        if not self._closed:  # refresh; if the ledger cannot be read (read-only root): the last value seen
            with contextlib.suppress(OSError), self._shared():
                pass
        with self._idx_lock:
            return {"blocks": len(self._index), "bytes": self._dir_bytes, "capacity_bytes": self.capacity,
                    "path": self.root, "startup_seconds": self.startup_seconds}

    def _close(self) -> None:
        self._closed = True
        self._stop_watch.set()
        self._holds.close()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)


def _watch_removals(backend: weakref.ref[LocalDiskBackend], feed: RemovalFeed, stop: threading.Event,
                    period_s: float) -> None:
    """A backend's journal reader.  It holds the backend only weakly: a backend dropped without ``close``
    (a tool, a test) ends its reader instead of keeping it alive."""
    try:
        while not stop.wait(period_s):
            b = backend()
            if b is None:
                return
            try:
                b.removed_elsewhere(feed.poll())
            except OSError as e:  # a read of the journal failed: retried next period, the data path untouched
                log.debug("local_disk: %s: reading the removal journal: %s", b.root, e)
            del b
    finally:
        feed.close()
