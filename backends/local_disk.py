"""``local_disk``: one file per stored block under a directory that several processes may share.

Layout: ``<path>/<namespace id>/<hash[:2]>/<hash>`` holds one block (header + payload, see
``kvtier.format.blockformat``); ``<path>/<namespace id>/manifest.json`` is the namespace's manifest.  256 shard
directories per namespace keep directories small without a second level of ``mkdir``/``scandir`` work.

Invariants:
* A file under a block's name is always a complete value: a writer fills a temp file
  ``.<hash>.<host tag>.<pid>.<n>.tmp`` in the same directory and ``os.replace``s it.  Temp names start with
  a dot, block names are hex, so a temp file is never read as a block; start-up removes those whose writer
  is dead (same host) or that are older than ``tmp_max_age_s``.
* A payload of whole pages, 64 KiB or more, is stored aligned in mode ``none`` (``aligned_values``):
  block format 1 with a 4096-byte header (``kvtier.blockformat``), the payload on a page of the file.  A
  read tells the layout from the file's size, so values of the 88-byte layout keep loading; a cold
  aligned value goes with ``O_DIRECT`` straight into the caller's page-aligned buffers and is checked
  there, header page included, before it is reported (``_disk_files.read_file``).
* No key can name a path outside the root: every key must be canonical (``kvtier.keys.invalid_key``:
  ``<32 hex>/<32|64 hex>`` or ``<32 hex>/manifest.json``, lower case) before a path is formed from it (the
  base class refuses such keys before any hook; the hooks check again, as tools call them directly), and
  files are opened with ``O_NOFOLLOW``.
* ``capacity`` bounds the directory, whatever number of processes share it: the bytes of its block files
  plus the bytes reserved by every writer's in-flight temp files never exceed it.  The account is the
  directory's index (``_disk_index``: one SQLite database per directory and host, outside the directory),
  changed only under the directory's lock (an exclusive ``flock`` on ``<path>/.kvtier-usage.json``, which
  is rewritten after each session as a mirror of the account) and always together with the filesystem
  change it describes: a put reserves room for its batch first (evicting least recently used blocks if
  needed), writes its temp files, then renames them into place under the lock and records them in the
  same session.  A put that cannot get room (the room is held by in-flight writes) is refused, never
  waits.
* kill -9 at any point leaves an account that is right or names what to re-read: every file change
  (a put's rename, an eviction's or a delete's unlink) is announced as an intent of its writer, committed
  before the change, and dropped in the transaction that records its effect.  A writer found dead (at
  start-up, or when a put needs room) is recovered from its intents alone: its temp files removed, the
  blocks it named re-read with one ``lstat`` each.  No operation scans the directory under the lock.
* The index is shared by every process on the host and opened, not rebuilt, at start-up (a few
  milliseconds at any size).  It is rebuilt from the files only when it is missing, damaged, or not the one
  the ledger names (another directory once at this path): the only full scan, logged with its time, one
  shard per locked session (puts are refused until it is complete; reads never need it).  LRU order is
  the index's clock: puts and verified reads make a block the most recent (reads are recorded in batches,
  at this process's next session or within a second).  A verified read of a block the index does not
  know adopts it; a read or an ``exists`` that finds a known block's file gone drops it, after checking
  again under the lock; ``exists`` always asks the directory, ``lookup`` only the index (through its
  lookup snapshot, ``_disk_snapshot``, plus the changes logged since, when it serves the index's state).  The blocks a put
  evicts are told to ``on_evicted`` (the stack using this backend) after the lock is released.
  Manifests are not blocks: never evicted, not counted.
* Every block file unlinked (evicted, deleted: by any process, ``kvtier gc`` and ``verify --fix``
  included) is noted in the directory's removal journal (``_disk_removals``) with the backend instance
  that unlinked it, in the same lock session, once the index transaction that dropped it has committed (a
  writer killed before that is recovered from its intents, and its recoverer notes its unlinks).  Each
  backend reads the lines other instances wrote every ``removals_poll_s`` and tells ``on_evicted`` those
  keys the index does not list again (stored again since: loadable); its own lines are skipped, told when
  made (a put's evictions) or asked for (deletes).  So another process's eviction reaches this process's stack (and the
  KV events routers read) within about ``removals_poll_s``, without waiting for a read to miss.  With one
  shared index no process keeps a set of the keys it knew: every other instance's removal is told, and the
  listener (the stack, the KV event stream) forgets only what it knew.  A poll costs the journal lines
  written since the last one and one index lookup of their keys: it walks neither the directory nor the
  index.
* A share with a quota (``backends[i].quota``, ``kvtier.quota``: a namespace's untenanted blocks, or one
  ``cache_salt`` tenant's blocks in it) is recorded in the index by its writers, in every put session,
  and each block's row names the tenant its put charged it to (``blocks.tenant``, in the session that
  records the block; NULL: its namespace's); a capacity eviction, by any process, skips the blocks of a
  share within its quota (counting the bytes the put brings it; its bytes as the index had them at most
  ``NS_BYTES_TTL_S`` ago), so a deployment's or tenant's puts never evict another's blocks within its
  share.  A share over its quota is trimmed, its own least recently used first, after the put (the base
  class), except blocks held for a load.  The tenant lives in the index only: a rebuild from the files
  makes every block untenanted (its namespace's).
* A held block (``hold``: a load will read it) is evicted by no process sharing the directory until its
  holder releases it or dies: this process counts its holds, other processes see them as hard links
  (``_disk_holds``); a put that finds only held blocks in its way is refused.
"""

from __future__ import annotations

import contextlib
import itertools
import logging
import mmap
import os
import sqlite3
import threading
import time
import uuid
import weakref
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
    DirectReads,
    entry_kind,
    read_file,
    regular_size,
    scan_shard,
    shards,
    tmp_name,
    write_tmp,
)
from kvtier.backends._disk_files import scandir as _scandir
from kvtier.backends._disk_files import unlink as _unlink
from kvtier.backends._disk_files import unlink_sized as _unlink_sized  # (a test replaces it here)
from kvtier.backends._disk_holds import DiskHolds, drop_dead_holders, held_elsewhere
from kvtier.backends._disk_index import DiskIndex as DiskIndex  # public: bench disk-scale times it alone
from kvtier.backends._disk_index import index_path, prune_indexes
from kvtier.backends._disk_ledger import HOST_TAG, locked, writer_alive
from kvtier.backends._disk_ledger import LEDGER_NAME as LEDGER_NAME  # its public name, where tools import it
from kvtier.backends._disk_removals import JOURNAL_NAME as JOURNAL_NAME  # public, as LEDGER_NAME
from kvtier.backends._disk_removals import RemovalFeed, append_removals
from kvtier.format import blockformat
from kvtier.keys import MANIFEST_NAME, invalid_key, show_key, split_key
from kvtier.quota import Share
from kvtier.units import ByteSize

log = logging.getLogger("kvtier.backends.local_disk")
_T = TypeVar("_T")

_MIN_CHUNK_BYTES = 512 * 1024  # a batch is split across workers only in pieces at least this large
# Verified reads are recorded in the index (LRU) at the next session, or once this many wait or _FLUSH_S
# passed: recording a batch of 1,000 costs about as much as a lookup of them (a few ms), too much per get.
_FLUSH_READS = 16384
_ALIGN_MIN_BYTES = 64 << 10  # smaller payloads keep the 88-byte header (a page of it would cost > 1/16)


def _stores_aligned(options: Any, nbytes: int, sealed: bool) -> bool:
    """Whether a payload of ``nbytes`` is stored aligned (``aligned_values``): mode ``none`` (a sealed value
    keeps its format), whole pages (what O_DIRECT can read into a caller's buffer), and at least
    ``_ALIGN_MIN_BYTES`` (the page of header costs at most 1/16 more disk)."""
    return (not sealed and bool(options.aligned_values) and nbytes >= _ALIGN_MIN_BYTES
            and nbytes % blockformat.ALIGNED_HEADER_SIZE == 0)


_PAGE = blockformat.ALIGNED_HEADER_SIZE
_FLUSH_S = 5.0
# How old a share's byte count may be when a capacity eviction checks it against its quota.
NS_BYTES_TTL_S = 1.0


class LocalDiskBackend(StorageBackend):
    """Blocks as files in a (possibly shared) directory, bounded by ``capacity`` bytes with LRU eviction."""

    counts_tenants = True  # the index's blocks.tenant

    streams_verified = True  # _get_blocks reports each block as it verifies it (StorageBackend.get_into)
    reads_segments = True  # a payload may be Segments: preadv takes the parts as they are
    writes_segments = True  # and on a put: one writev of the header and the parts (``_disk_files.write_tmp``)

    class Options(BackendOptions):
        path: str = Field("~/.cache/kvtier/blocks", description="root directory; ~ and $VARS are expanded")
        capacity: ByteSize = Field(10 * 2**30, description='bytes of blocks kept, e.g. "200GiB"')
        threads: int = Field(4, ge=1, le=256, description="I/O threads per batch")
        fsync: bool = Field(False, description="fsync each file and its directory before a put returns")
        tmp_max_age_s: float = Field(3600.0, gt=0, description="temp files of other hosts older than "
                                     "this are removed at start-up")
        removals_poll_s: float = Field(1.0, ge=0, description="how often the blocks other processes "
                                       "removed from the directory are read from its journal (0: never)")
        aligned_values: bool = Field(True, description="store payloads of whole pages (64 KiB and more) at "
                                     "offset 4096 of their file (block format 1, 4096-byte header), so a cold "
                                     "read goes from the device straight into page-aligned memory; false: "
                                     "the 88-byte layout, which kvtier before 2026-11-28 reads too")
        direct_io: bool = Field(True, description="read aligned values that are not in the page cache with "
                                "O_DIRECT into page-aligned buffers (buffered where the filesystem refuses it)")
        index_dir: str = Field("~/.cache/kvtier/disk-index", validate_default=True,
                               description="where the directory's index lives (one SQLite file per "
                               "directory, shared by the host's processes); ~ and $VARS are expanded")

        @field_validator("index_dir")
        @classmethod
        def _expand_index(cls, v: str) -> str:
            return os.path.abspath(os.path.expandvars(os.path.expanduser(v)))

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
        self._idx_lock = threading.Lock()  # guards _inflight and the pending read records
        self._idx = DiskIndex(index_path(o.index_dir, self.root), self.root)
        self._gen: str | None = None  # the index generation this process checked against the ledger
        self._complete = False  # the index lists every block (no rebuild in progress)
        # Keys this process is writing, or holds for a planned read (``hold``): never evicted.
        self._inflight: dict[str, int] = {}
        # Verified reads not yet recorded in the index (LRU order; size for adoption), keys found gone.
        self._read: dict[str, int] = {}
        self._gone: set[str] = set()
        self._flushed = time.monotonic()
        self._holds = DiskHolds(self.root)  # what other processes must not evict either (hard links)
        self._dir_bytes = 0  # the account's total when last seen
        self._tmp_seq = itertools.count()  # next() on itertools.count is atomic under the GIL
        self._pool: ThreadPoolExecutor | None = None
        self._pool_lock = threading.Lock()  # its own: the pool is first needed under other locks
        self._closed = False
        self._verified_dirs: set[str] = set()  # shard directories checked not to be symlinks
        self._quota_cleared: set[Share] = set()  # shares whose quota record this writer (without one) cleared
        self._ns_bytes_seen: dict[Share, tuple[float, int]] = {}  # share -> (when, bytes): see _ns_bytes
        self._direct = DirectReads(o.direct_io)  # off for good once the filesystem refuses O_DIRECT
        self._instance = uuid.uuid4().hex[:8]  # this backend among the removal journal's writers
        os.makedirs(self.root, exist_ok=True)
        self._stop_watch = threading.Event()
        self._building = threading.Lock()  # held while this process builds the lookup snapshot
        # Opened before the index is built: a removal made meanwhile is then read, not missed.
        feed = RemovalFeed(self.root) if o.removals_poll_s > 0 else None
        t0 = time.perf_counter()
        prune_indexes(o.index_dir)
        try:
            self._open()
        except OSError as e:  # read-only, full: reads work, and each write will say why it fails
            log.warning("local_disk: %s: cannot open its index at start-up (%s); reads work, writes will "
                        "fail until it can be", self.root, e)
        self.startup_seconds = time.perf_counter() - t0
        if feed is not None:
            threading.Thread(target=_watch_removals, args=(weakref.ref(self), feed, self._stop_watch,
                             o.removals_poll_s), name="kvtier-local-disk-removals", daemon=True).start()

    @property
    def index(self) -> DiskIndex:
        """The directory's index as this process holds it (tools and ``bench disk-scale`` time it)."""
        return self._idx

    def removed_elsewhere(self, keys: Sequence[str]) -> list[str]:
        """Blocks other backends (other processes, or other instances in this one) removed from the
        directory, as its journal says (the watcher's ``RemovalFeed.poll`` left out this instance's own
        lines: told when made, or asked for): told to ``on_evicted``, except those the index lists again
        (stored again since, so loadable) and lines that are no block key.  Their remover dropped them
        from the shared index already.  One index lookup for the batch.  Returns the keys told."""
        keys = [k for k in dict.fromkeys(keys) if invalid_key([k]) is None]
        if not keys or self._closed:
            return []
        try:
            again = self._idx.lookup(keys)
        except sqlite3.Error:  # the index cannot be read: a block stored again is told once too often
            again = [False] * len(keys)
        told = [k for k, listed in zip(keys, again) if not listed]
        self._evicted(told)
        return told

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

    def _open(self) -> None:
        """Check the index against the ledger (rebuild it from the files if it is not this directory's),
        recover dead writers, evict down to the capacity (it may have shrunk since the last run)."""
        rebuild: str | None = None
        evicted: list[str] = []  # dead writers' unlinks recovered, then this start's evictions
        try:
            rebuild = self._check_index(evicted)
        except sqlite3.DatabaseError as e:  # not a database, malformed: start it again
            log.warning("local_disk: %s: index %s is damaged (%s); rebuilding it", self.root, self._idx.path, e)
            self._idx.remove()
            rebuild = self._check_index(evicted)
        if rebuild is not None:
            self._rebuild(rebuild)
        drop_dead_holders(self.root, self.options.tmp_max_age_s)
        if self._complete:
            unlinked: list[str] = []
            with self._shared(removed=unlinked) as c:
                self._make_room(c, 0, evicted, unlinked)
        self._evicted(evicted)
        me = weakref.ref(self)  # (the index must not keep a backend dropped without close alive)

        def wanted() -> None:
            b = me()
            if b is not None and not b._closed:
                b._build_snapshot()

        self._idx.on_snapshot_wanted = wanted
        if self._complete and not self._idx.snapshot_serves():
            self._build_snapshot(now=self._idx.counts()[0] <= 50_000)

    def _build_snapshot(self, now: bool = False) -> None:
        """Build the lookup snapshot from the index (none yet, another generation's, of another boot, or
        many changes behind): at once when the index is small (start-up), else in a thread, so neither
        start-up nor a lookup waits for millions of keys (lookups ask SQLite meanwhile)."""
        def run() -> None:
            try:
                self._idx.build_snapshot(lambda: locked(self.root), self._stop_watch)
            except (sqlite3.Error, OSError, ValueError) as e:
                log.warning("local_disk: %s: lookup snapshot not built (%s); lookups ask SQLite", self.root, e)
            finally:
                self._building.release()

        if not self._building.acquire(blocking=False):  # one build at a time in this process
            return
        if now:
            run()
        else:
            threading.Thread(target=run, name="kvtier-disk-snapshot", daemon=True).start()

    def _check_index(self, gone: list[str]) -> str | None:
        """Validate the index in one locked session (recovering dead writers: the blocks they had unlinked
        are added to ``gone`` and noted in the removal journal); the generation to rebuild, or None."""
        recovered: list[str] = []
        with locked(self.root) as mirror:
            try:
                with self._idx.transaction() as c:
                    gen, complete = self._idx.meta(c, "id"), self._idx.meta(c, "complete") == 1
                    named = mirror.doc.get("index") if mirror.doc is not None else None
                    if gen is not None and gen == named:
                        self._gen = str(gen)
                        self._complete = complete
                        if complete:
                            self._recover(c, recovered)
                            return None
                        builder = str(self._idx.meta(c, "rebuilder", ""))
                        if (writer_alive(builder, time.time(), self.options.tmp_max_age_s)
                                and builder != self._writer()):
                            return None  # another process is rebuilding it: puts wait for it to finish
                    gen = self._idx.reset(c, self._writer())
                    self._gen, self._complete = str(gen), False
                    mirror.write({"bytes": 0, "held": {}, "index": gen})
                    return str(gen)
            finally:  # after the commit, under the lock (as ``_shared``)
                append_removals(self.root, recovered, self._remover())
                gone.extend(recovered)

    def _rebuild(self, gen: str) -> None:
        """Index every block file under the root (the only full scan), one shard per locked session so
        that no writer waits for the whole scan; remove dead writers' temp files; then mark it complete."""
        t0 = time.perf_counter()
        now = time.time()
        n = 0
        self._idx.cache(256 << 10)  # for the rebuild only: 5 million rows are a few hundred MiB of pages
        try:
            with kvthreads.pool(self.options.threads, "kvtier-disk-scan") as pool:
                parts = pool.map(lambda s: scan_shard(s[0], s[1], now, self.options.tmp_max_age_s),
                                 shards(self.root, now, self.options.tmp_max_age_s))
                for part in parts:
                    with self._shared(check=False) as c:
                        if self._idx.meta(c, "id") != gen:
                            log.warning("local_disk: %s: another process restarted the index rebuild", self.root)
                            return
                        self._idx.adopt(c, [(key, size, int(t * 1e6)) for t, key, size in part])
                    n += len(part)
        finally:
            self._idx.cache()
        with self._shared(check=False) as c:
            if self._idx.meta(c, "id") != gen:
                return
            self._idx.tick(c, 1)  # the clock passes every file time
            self._idx.recount(c)
            self._idx.set_meta(c, "complete", 1)
            self._complete = True
        log.info("local_disk: %s: index rebuilt from the files: %d blocks in %.2f s", self.root, n,
                 time.perf_counter() - t0)

    # ------------------------------------------------------------------ the directory's lock, capacity

    @contextlib.contextmanager
    def _shared(self, check: bool = True, removed: Sequence[str] = ()) -> Iterator[sqlite3.Connection]:
        """One session on the directory: its lock, one index transaction (committed also after an error:
        each change in it stands for a file change already made), this process's pending read records,
        then the ledger file rewritten as the account's mirror and the block keys the session unlinked
        (``removed``: the caller's list, filled in the session) appended to the removal journal, still
        under the lock.  ``_idx_lock`` is taken inside, only around in-memory changes, and never held while
        waiting for the flock or for the pool."""
        with locked(self.root) as mirror:
            try:
                with self._idx.transaction() as c:
                    if check and (gen := self._idx.meta(c, "id")) != self._gen and gen is not None:
                        # Another process rebuilt the index (its ledger file was lost): follow it; puts
                        # wait for it to be complete.
                        log.warning("local_disk: %s: the index was rebuilt by another process", self.root)
                        self._gen, self._complete = str(gen), self._idx.meta(c, "complete") == 1
                    if check:
                        self._record_reads(c)
                    yield c
            finally:
                try:
                    doc = self._idx.doc()
                    self._dir_bytes = int(doc["bytes"]) + sum(int(h[0]) for h in doc["held"].values())
                    mirror.write(doc)
                finally:  # after the commit: a reader that looks a key up finds it dropped already
                    append_removals(self.root, removed, self._remover())

    def _record_reads(self, c: sqlite3.Connection) -> None:
        """Put this process's verified reads into the index's LRU order (adopting blocks it did not know)
        and drop the blocks reads found gone, if they still are (checked under the lock)."""
        with self._idx_lock:
            read, self._read = self._read, {}
            gone, self._gone = self._gone, set()
            self._flushed = time.monotonic()
        if read:
            known = self._idx.sizes(c, list(read))
            self._idx.touch(c, [k for k in read if k in known])
            self._idx.put(c, [(k, n) for k, n in read.items() if k not in known])
        # Only blocks the index knows are checked (a miss on a key never stored costs nothing here).
        gone_now = [k for k in self._idx.sizes(c, list(gone)) if entry_kind(self._where(k, checked=True)[1]) is None]
        if gone_now:
            self._idx.drop(c, gone_now)

    def _recover(self, c: sqlite3.Connection, gone: list[str]) -> bool:
        """Recover every dead writer from its intents: remove its temp files, re-read each block it named
        (one ``lstat``).  The blocks it had unlinked (an eviction's or a delete's intent, the file gone) are
        added to ``gone``: it died before noting them in the removal journal, so the caller notes them, as
        its own, and tells its own listener.  True if any writer was found dead."""
        found = False
        for writer, (_, last) in self._idx.held(c).items():
            if writer_alive(writer, last, self.options.tmp_max_age_s) or writer == self._writer():
                continue
            t0 = time.perf_counter()
            intents = self._idx.intents(c, writer)
            present, absent, unlinked = [], [], []  # unlinked: by the dead writer, never journaled
            for key, _, tmp in intents:
                if tmp is not None:
                    _unlink(tmp)
                path = self._where(key, checked=True)[1]
                size = regular_size(path)
                if size or entry_kind(path) is True:
                    present.append((key, size))
                else:
                    absent.append(key)
                    if tmp is None:  # an eviction's or a delete's: it died before noting it in the journal
                        unlinked.append(key)
            gone.extend(self._idx.sizes(c, unlinked))  # those the index listed: a delete names any key
            self._idx.drop(c, absent)
            if present:
                known = self._idx.sizes(c, [k for k, _ in present])
                self._idx.drop(c, [k for k, n in present if known.get(k, n) != n])  # re-sized: re-entered
                # A dead writer's blocks go first in the LRU order, as blocks of unknown use.
                self._idx.put(c, [(k, n) for k, n in present if known.get(k) != n], first_use=1)
            self._idx.drop_writer(c, writer)
            found = True
            log.info("local_disk: %s: recovered dead writer %s: %d in-flight changes re-read in %.1f ms",
                     self.root, writer, len(intents), (time.perf_counter() - t0) * 1000)
        return found

    def _total(self, c: sqlite3.Connection) -> int:
        nbytes, held = self._idx.totals(c)
        total: int = nbytes + held
        return total

    def _make_room(self, c: sqlite3.Connection, need: int, victims: list[str], unlinked: list[str],
                   incoming: dict[Share, int] | None = None) -> bool:
        """Unlink least recently used blocks until ``need`` more bytes fit in the directory; False if
        in-flight writes, holds and quotas keep the room.  Called in a session; the keys evicted are added
        to ``victims``, those whose file this call unlinked (not found gone already) to ``unlinked`` (the
        session's journal lines).  Victims are announced (one commit) before they are unlinked.  A
        share with a quota recorded (``kvtier.quota``) within it, counting the bytes ``incoming`` to it
        (this put's), loses no block here: only what it holds beyond its quota is evictable."""
        excess = self._total(c) + need - self.capacity
        if excess <= 0:
            return True
        recovered: list[str] = []
        found = self._recover(c, recovered)
        victims.extend(recovered)
        unlinked.extend(recovered)
        if found:
            excess = self._total(c) + need - self.capacity
            if excess <= 0:
                return True
        held: set[str] = set()
        dropped_holders = False
        picked: list[str] = []
        quotas = self._idx.quotas(c)
        beyond: dict[Share, int] = {}  # share with a quota -> its bytes beyond it, as picking goes
        for key, size, tenant in self._idx.lru(c):
            if excess <= 0:
                break
            with self._idx_lock:
                if key in self._inflight:
                    continue
            share = Share(key[:32], tenant)
            if share in quotas:
                if share not in beyond:
                    beyond[share] = self._ns_bytes(c, share) + (incoming or {}).get(share, 0) - quotas[share]
                if beyond[share] <= 0:
                    continue  # within its quota: another share's put does not evict it
                beyond[share] -= size
                seen = self._ns_bytes_seen[share]
                self._ns_bytes_seen[share] = (seen[0], seen[1] - size)
            if held_elsewhere(self._where(key, checked=True)[1]):
                if not dropped_holders:  # a holder that died would pin its blocks for good
                    drop_dead_holders(self.root, self.options.tmp_max_age_s)
                    dropped_holders = True
                if held_elsewhere(self._where(key, checked=True)[1]):
                    held.add(key)
                    continue
            picked.append(key)
            excess -= size
        if picked:
            writer = self._writer()
            self._idx.intend(c, writer, [(k, 0, None) for k in picked])
            self._idx.checkpoint(c)  # announced before unlinked (a kill among the unlinks is recovered)
            for key in picked:
                if _unlink_sized(self._where(key, checked=True)[1])[0]:
                    unlinked.append(key)
            self._idx.drop(c, picked)
            self._idx.done(c, writer, picked)
            victims.extend(picked)
        return excess <= 0

    def _writer(self) -> str:
        return f"{HOST_TAG}:{os.getpid()}"  # read per call: a forked child is a writer of its own

    def _remover(self) -> str:
        """This backend as the removal journal's writer (``_disk_removals``): one process may run several."""
        return f"{self._writer()}:{self._instance}"

    def _reserve(self, keys: Sequence[str], sizes: Sequence[int], tmps: Sequence[str]) -> list[bool]:
        """Reserve room for a batch's blocks, in order, in one session; per key whether granted (not: a
        block bigger than the capacity, once the room is held by in-flight writes, or while the index is
        being rebuilt).  Each grant is an intent naming its temp file.  Manifests are not blocks: always
        granted, never reserved."""
        if self._gen is None:
            self._open()  # start-up could not open the index (read-only, full): try again
        granted = [False] * len(keys)
        evicted: list[str] = []
        unlinked: list[str] = []
        with self._shared(removed=unlinked) as c:
            if not self._complete:
                self._complete = self._idx.meta(c, "complete") == 1
            self._record_quota(c, keys)
            rows: list[tuple[str, int, str | None]] = []
            reserved = 0  # this batch's reservations so far (entered as intents at the end)
            incoming: dict[Share, int] = {}  # per share: this batch's reservations, this key's included
            total = self._total(c)  # the directory's account, kept here while nothing is evicted
            for i, (key, size) in enumerate(zip(keys, sizes)):
                if key.endswith(MANIFEST_NAME):
                    granted[i] = True
                    continue
                if size > self.capacity or not self._complete:
                    continue
                share = Share(key[:32], self._put_tenant(key))
                incoming[share] = incoming.get(share, 0) + size
                if total + reserved + size > self.capacity:
                    if not self._make_room(c, reserved + size, evicted, unlinked, incoming):
                        break  # the room is in flight: the rest of the batch would only look again
                    total = self._total(c)
                rows.append((key, size, tmps[i]))
                reserved += size
                with self._idx_lock:
                    self._inflight[key] = self._inflight.get(key, 0) + 1
                granted[i] = True
            self._idx.intend(c, self._writer(), rows)
            for key, size, _ in rows:  # this writer's own puts keep its counts of shares current
                share = Share(key[:32], self._put_tenant(key))
                seen = self._ns_bytes_seen.get(share)
                if seen is not None:
                    self._ns_bytes_seen[share] = (seen[0], seen[1] + size)
        self._evicted(evicted)  # outside the directory's lock: the listener takes the stack's
        return granted

    def _ns_bytes(self, c: sqlite3.Connection, share: Share) -> int:
        """A share's bytes as the index had them at most ``NS_BYTES_TTL_S`` ago (a sum over its
        namespace's rows: ~60 ms per 100,000 blocks, too slow for every eviction of a full directory)."""
        now = time.monotonic()
        seen = self._ns_bytes_seen.get(share)
        if seen is None or now - seen[0] > NS_BYTES_TTL_S:
            seen = self._ns_bytes_seen[share] = (now, self._idx.ns_bytes(c, share))
        return seen[1]

    def _record_quota(self, c: sqlite3.Connection, keys: Sequence[str]) -> None:
        """Record this writer's quota (``backends[i].quota``) for the shares it puts (their namespaces, or
        their tenants in them), in every session (a rebuild empties the index's records), so every
        process's ``_make_room`` knows it; a writer without one clears its shares' records, once each."""
        shares = {Share(k[:32], self._put_tenant(k)) for k in keys if not k.endswith(MANIFEST_NAME)}
        if self.quota is not None:
            for share in shares:
                self._idx.set_quota(c, share, self.quota.limit)
        else:
            for share in shares - self._quota_cleared:
                self._idx.set_quota(c, share, None)
            self._quota_cleared |= shares

    def _settle(self, keys: Sequence[str], where: Sequence[tuple[str, str]], sizes: Sequence[int],
                granted: Sequence[bool], tmps: Sequence[str | None],
                mtimes: dict[str, int]) -> tuple[list[bool], list[OSError]]:
        """End a batch's reservations: rename each written temp file into place and record it, all in one
        session (the renames were announced by the reservations' intents).  Per key whether it is
        stored, and the rename errors (their temp files removed)."""
        written = {i: tmp for i, tmp in enumerate(tmps) if granted[i] and tmp is not None}  # index -> temp file
        # A key twice in one batch: only its last value is renamed (as if written in order), so that no
        # two threads rename over one path at once.
        last = {keys[i]: i for i in written}
        todo = [i for i in written if last[keys[i]] == i]
        superseded = [i for i in written if last[keys[i]] != i]

        def rename(idx: range) -> list[OSError | None]:
            """replace for todo[idx] (or its error).  In the pool's threads, on the session's behalf:
            replacing a file frees its pages, which is worth spreading."""
            out: list[OSError | None] = []
            for j in idx:
                tmp, path = written[todo[j]], where[todo[j]][1]
                try:
                    os.replace(tmp, path)
                    out.append(None)
                except OSError as e:
                    _unlink(tmp)
                    out.append(e)
            return out

        stored = [False] * len(keys)
        errors: list[OSError] = []
        for i in superseded:
            _unlink(written[i])
            stored[i] = True
        mine = [k for i, k in enumerate(keys) if granted[i] and not k.endswith(MANIFEST_NAME)]
        with self._shared() as c:
            try:
                renamed = dict(zip(todo, self._batch(len(todo), sum(sizes[i] for i in todo), rename)))
            finally:  # the reservations end whatever happened to the renames
                with self._idx_lock:
                    for key in mine:
                        n = self._inflight.pop(key) - 1
                        if n:
                            self._inflight[key] = n
            entries = []
            for i, err in renamed.items():
                if err is not None:
                    errors.append(err)
                    continue
                stored[i] = True
                if not keys[i].endswith(MANIFEST_NAME):
                    entries.append((keys[i], sizes[i]))
            # Each block's tenant in the session that records it: no other process ever sees it untenanted.
            self._idx.put(c, entries, mtimes=mtimes,
                          tenants={k: t for k, _ in entries if (t := self._put_tenant(k)) is not None})
            self._idx.done(c, self._writer(), mine)
        return stored, errors

    # ------------------------------------------------------------------ one file

    def _store(self, keys: Sequence[str], where: Sequence[tuple[str, str]], sizes: Sequence[int],
               value: Callable[[int], tuple[bytes, memoryview | blockformat.Segments]], what: str) -> list[bool]:
        """Store a batch: reserve room for all of it, write each granted ``value(i)`` (header, payload) to a
        temp file (in the pool's threads), then rename them into place under one lock; per key whether
        stored.  Two ledger sessions per batch, not per block."""
        # Temp names chosen first: each reservation names its temp file.
        names = [tmp_name(*w, next(self._tmp_seq)) for w in where]
        granted = self._reserve(keys, sizes, names)
        tmps: list[str | None] = [None] * len(keys)
        mtimes: dict[str, int] = {}  # as written (see _eviction_order); a dict's item set is atomic

        def one(i: int) -> bool:
            if granted[i]:
                tmp = tmps[i] = write_tmp(where[i][0], names[i], *value(i), self.options.fsync)
                mtimes[keys[i]] = os.stat(tmp).st_mtime_ns // 1000
            return True

        try:
            self._per_key(keys, sum(sizes), one, what)  # raises only if every write failed
        finally:
            stored, errors = self._settle(keys, where, sizes, granted, tmps, mtimes)  # whatever happened above
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

    def _put_blocks(self, keys: Sequence[str], payloads: Sequence[memoryview | blockformat.Segments],
                    layout_id: int) -> list[bool]:
        where = self._check_keys(keys)
        sizes = [self.stored_size(p.nbytes) for p in payloads]
        # Framed in the workers: each payload is checksummed right before it is written.
        return self._store(keys, where, sizes, lambda i: self._frame(keys[i], payloads[i], layout_id),
                           "put")

    def _aligned(self, nbytes: int) -> bool:
        return _stores_aligned(self.options, nbytes, self.seal is not None)

    def stored_size(self, nbytes: int) -> int:
        """Bytes a stored payload of ``nbytes`` takes in the directory (its file: header and payload)."""
        return (blockformat.ALIGNED_HEADER_SIZE if self._aligned(nbytes) else self.header_size) + nbytes

    @classmethod
    def stored_value_nbytes(cls, options: Any, payload_nbytes: int, sealed: bool) -> int:
        if _stores_aligned(options, payload_nbytes, sealed):
            return blockformat.ALIGNED_HEADER_SIZE + payload_nbytes
        return super().stored_value_nbytes(options, payload_nbytes, sealed)

    def _frame(self, key: str, payload: memoryview | blockformat.Segments,
               layout_id: int) -> tuple[bytes, memoryview | blockformat.Segments]:
        """The base class's framing, except a payload stored aligned gets the 4096-byte header (the same
        fields, the length field saying 4096, zeros to the page end: ``kvtier.blockformat``)."""
        if not self._aligned(payload.nbytes):
            return super()._frame(key, payload, layout_id)
        ns, h = split_key(key)
        return blockformat.encode_header(ns, h, layout_id, payload, aligned=True), payload

    def _write(self, keys: Sequence[str],
               values: Sequence[tuple[bytes, memoryview | blockformat.Segments]]) -> list[bool]:
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
        one index update at the end.  A sealed value takes no xxh3 (its tag covers the payload); in mode
        encrypt its ciphertext lands in the thread's buffer and is decrypted from there into the caller's
        (``Seal.landing``: one call, no cipher context per value)."""
        where = self._check_keys(keys)
        check, read, hsize = self._verify, read_file, self.header_size
        # Mode none reads either layout: a page-aligned page for the header (an aligned value's whole
        # header; the first 88 bytes of it for the other), which O_DIRECT can fill.  Sealed values are
        # read raw, as written.
        direct = self._direct if self.seal is None else None
        seal = self.seal
        # A sealed value's tag covers its payload: no xxh3 taken as it lands (mode none always takes it).
        hashed = seal is None
        landing = seal.landing if seal is not None else None
        errors: list[OSError] = []
        verified: list[tuple[str, int]] = []  # list.append is atomic: shared by the workers
        forgotten: list[str] = []

        def work(idx: range) -> list[bool | str]:
            # Reused: verified before the next read.  mmap: page aligned, as O_DIRECT needs.
            header = memoryview(mmap.mmap(-1, _PAGE)) if direct is not None else memoryview(bytearray(hsize))
            out: list[bool | str] = []
            land: memoryview | None = None
            landed = -1  # the payload size ``land`` was taken for: reused while sizes repeat (a batch's do)
            for i in idx:
                key, payload, path = keys[i], payloads[i], where[i][1]
                # Mode encrypt: the ciphertext lands in this thread's buffer and is decrypted from there
                # into ``payload`` in one call (``Seal.landing``).  The view is kept across the batch's
                # values of one size: it pins its buffer, private to this thread, whatever the seal does.
                if landing is None:
                    into = payload
                elif payload.nbytes != landed or not isinstance(payload, memoryview):
                    land = landing(payload)
                    into = payload if land is None else land[:payload.nbytes]
                    landed = payload.nbytes if land is not None else -1
                try:
                    size, checksum, hlen = read(path, header, into, direct, hashed)
                    if size is None and (linked := self._holds.path(key)) is not None:
                        # A put elsewhere unlinked it in the instant before our hold: read it through
                        # the hold's link (``_disk_holds``), the same bytes.
                        size, checksum, hlen = read(linked, header, into, direct, hashed)
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
                    why = check(key, size, header if hlen == header.nbytes else header[:hlen], payload, layout_id,
                                checksum, land)  # the size too
                    if why is None:
                        verified.append((key, size))
                        out.append(True)
                        if on_verified is not None:
                            on_verified(i)  # in this thread, while the bytes are still in cache
                    else:
                        out.append(why)
            return out

        out = self._batch(len(keys), sum(p.nbytes for p in payloads), work)
        self._note_reads(verified, forgotten)
        self._report(errors, len(keys), "get")
        return out

    def _note_reads(self, verified: Sequence[tuple[str, int]], gone: Sequence[str]) -> None:
        """Remember verified reads (most recent last) and keys found gone, for the index; recorded at this
        process's next session, or now when many are waiting or a second has passed."""
        if not verified and not gone:
            return
        with self._idx_lock:
            for key, size in verified:
                self._read.pop(key, None)
                self._read[key] = size
            self._gone.update(gone)
            due = len(self._read) >= _FLUSH_READS or time.monotonic() - self._flushed >= _FLUSH_S
        if due and self._gen is not None:
            with contextlib.suppress(OSError, sqlite3.Error), self._shared():
                pass  # a lost LRU update is no fault: the next session records it

    def lookup(self, keys: Sequence[str]) -> list[bool]:
        """Whether the directory's index knows each key (no filesystem access: ``exists`` asks the files)."""
        self._refuse_invalid_paths(keys)
        found: list[bool] = self._idx.lookup(keys)
        return found

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
        if self._closed:
            raise RuntimeError(f"local_disk at {self.root} is closed")
        self._refuse_invalid_paths(keys)
        # The directory is the truth, for keys this process knows too: another process sharing it (vLLM's
        # worker beside its scheduler, a prefill instance) may have evicted the block or deleted it as
        # corrupt, and a key answered from memory would be offered, loaded, fail and be offered again.
        # One lstat per key; lookups probe from their own threads, never the engine's.  The loop is
        # _where and entry_kind inlined: at 1,000 keys their calls were a third of the time beside the
        # lstats themselves (docs/performance.md).
        root, verified, lstat, where = self.root, self._verified_dirs, os.lstat, self._where
        out: list[bool] = []
        odd: list[tuple[str, str]] = []  # (key, path) of entries that are no regular file
        for k in keys:
            h = k[33:]
            if h == MANIFEST_NAME:
                path = where(k, checked=True)[1]
            else:
                d = f"{root}/{k[:32]}/{h[:2]}"
                if d not in verified:
                    self._verify_dir(d, k[:32])
                path = f"{d}/{h}"
            try:
                mode = lstat(path).st_mode
            except FileNotFoundError:
                out.append(False)
                continue
            out.append(mode & 0o170000 == 0o100000)  # S_ISREG
            if mode & 0o170000 not in (0o100000, 0o120000):  # neither a file nor a symlink (never followed)
                odd.append((k, path))
        if odd:
            # A FIFO, socket, device or directory under a block's name is a corrupt entry, as a read finds
            # it: a lookup that met it counts and removes it (else nothing would: it is never offered, so
            # never read).
            kinds = [(k, p, entry_kind(p)) for k, p in odd]
            self._found_corrupt([(k, f"{p} is {kind}") for k, p, kind in kinds if isinstance(kind, str)])
        gone = [k for k, ok in zip(keys, out) if not ok]
        if gone:
            with self._idx_lock:
                self._gone.update(gone)  # dropped from the index at the next session, if still gone
        return out

    def _delete(self, keys: Sequence[str]) -> int:
        where = self._check_keys(keys)
        n = 0
        blocks = [k for k in dict.fromkeys(keys) if not k.endswith(MANIFEST_NAME)]
        writer = self._writer()
        unlinked: list[str] = []  # manifests are not blocks: not in the journal either
        # Announced, then unlinked, then recorded, in one session: a put cannot reuse room not yet freed.
        with self._shared(removed=unlinked) as c:
            self._idx.intend(c, writer, [(k, 0, None) for k in blocks])
            self._idx.checkpoint(c)
            for key, (_, path) in zip(keys, where):
                removed = _unlink_sized(path)[0]
                n += removed
                if removed and not key.endswith(MANIFEST_NAME):
                    unlinked.append(key)
            self._idx.drop(c, blocks)
            self._idx.done(c, writer, blocks)
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

    def _share_blocks(self, share: Share) -> list[StoredBlock]:
        """One share's blocks (a namespace's untenanted ones, or a tenant's), least recently used first, from
        the index (``kvtier.quota``); this process's in-flight writes and holds left out."""
        with self._idx_lock:
            inflight = set(self._inflight)
        return [StoredBlock(k, n) for k, n in self._idx.ns_lru(share) if k not in inflight]

    def _tenant_records(self, namespace_id: str) -> dict[str, str]:
        """From the index's ``blocks.tenant`` (read only)."""
        records: dict[str, str] = self._idx.ns_tenants(namespace_id)
        return records

    def _trim(self, share: Share, keys: list[str]) -> None:
        """A share over its quota loses ``keys``, except those another process holds for a load."""
        free = [k for k in keys if not held_elsewhere(self._where(k, checked=True)[1])]
        if free:
            super()._trim(share, free)

    def _eviction_order(self) -> list[StoredBlock]:
        """Every block, least recently used first (``evict_to``: ``kvtier gc``), this process's in-flight
        writes and holds excluded.  Last use is the index's, except for a file whose modification time is
        no longer the one it was written with: its times were set since (restored from a backup, or by an
        operator), and its own max(atime, mtime) counts.  One ``lstat`` per block: this is a tool's walk
        over every block, never a put's eviction (which takes the index's order as it stands)."""
        with self._shared():
            pass  # this process's reads recorded first
        with self._idx_lock:
            inflight = set(self._inflight)
        order: list[tuple[int, str, int]] = []
        for key, size, used, mtime in self._idx.rows():
            if key in inflight:
                continue
            if mtime is not None:
                try:
                    st = os.lstat(self._where(key, checked=True)[1])
                except FileNotFoundError:
                    continue
                if st.st_mtime_ns // 1000 != mtime:
                    used = max(st.st_atime_ns, st.st_mtime_ns) // 1000
            order.append((used, key, size))
        order.sort()
        return [StoredBlock(k, n) for _, k, n in order]

    def _usage(self) -> dict[str, Any]:
        """``blocks``: the directory's (the index's count); ``bytes``: the directory's, in-flight writes
        included."""
        if not self._closed:  # refresh; if the lock cannot be had (read-only root): the last value seen
            with contextlib.suppress(OSError), self._shared():
                pass
        blocks, _ = self._idx.counts() if self._gen is not None else (0, 0)
        return {"blocks": blocks, "bytes": self._dir_bytes, "capacity_bytes": self.capacity,
                "path": self.root, "startup_seconds": self.startup_seconds, "index": self._idx.path}

    def _close(self) -> None:
        if not self._closed and self._gen is not None:
            with contextlib.suppress(OSError, sqlite3.Error), self._shared():
                pass  # this process's last reads recorded
        self._closed = True
        self._stop_watch.set()
        self._holds.close()
        pool, self._pool = self._pool, None
        if pool is not None:
            pool.shutdown(wait=True)
        self._idx.close()


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
                b.removed_elsewhere(feed.poll(skip=b._remover()))
            except OSError as e:  # a read of the journal failed: retried next period, the data path untouched
                log.debug("local_disk: %s: reading the removal journal: %s", b.root, e)
            del b
    finally:
        feed.close()
