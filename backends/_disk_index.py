"""The index of a ``local_disk`` directory: one SQLite database per directory and host, shared by every
process on the host that opens the directory, so no process scans the directory or keeps a copy of it.

Why SQLite (it ships with Python): a B-tree on disk that a process opens in milliseconds whatever its size,
whose pages live once in the page cache for all processes (resident memory per process is its page cache
budget, not per block), with transactions that survive kill -9 (WAL: an uncommitted transaction is rolled
back by the next opener).  A hand-written file would have to re-earn all three.  Its query engine is
slow for a batch of lookups (about 3-10 us a key at 5 million rows), so lookups search a sorted snapshot
of the keys that every process maps (``_disk_snapshot``) and apply the changes logged since it (the
``changes`` table), SQLite staying the index of record.

It lives outside the directory, ``<index_dir>/<sha256(root)[:24]>.sqlite``: the directory holds blocks,
manifests and the usage ledger only, as tools and operators expect.  The ledger file names the index
generation it goes with (``index``), so an index left from an earlier directory at the same path is never
trusted.

Tables: ``blocks(key, size, used, mtime, tenant)`` (key: namespace digest + block hash, bytes; ``used``: a
clock in microseconds, the LRU order; ``mtime``: the file's modification time as written, in
microseconds, so a tool can tell a file whose times were set by hand since, NULL when unknown;
``tenant``: the ``cache_salt`` tenant tag the put charged the block to, ``kvtier.quota``, NULL for its
namespace), ``intents(writer, key, size, tmp)`` (what each writer is about to change on disk: a put's
reservation with its temp file, or an unlink), ``meta`` (``id``, ``bytes``, ``blocks``, ``clock``,
``complete``, ``rebuilder``, ``ctrim``, ``schema``, and ``quota:<namespace id>`` per namespace a writer
gave a quota, ``quota:<namespace id>:<tenant tag>`` per tenant), ``changes(id, key, listed)`` (the change log: one row per insert into or delete from ``blocks`` of a
complete index, written by SQLite triggers whoever the writer; ``id`` from AUTOINCREMENT, so in commit
order and never reused).

Invariants:
* every change is made by the backend under the directory's lock (the ledger's flock), so at most one
  write transaction is open at a time; readers (``lookup``) never wait (WAL);
* an intent is committed before the file change it announces, and dropped in the same transaction that
  records the change's effect: after a kill -9, a writer's intents name every file it may have changed
  without accounting, and ``recover`` re-reads just those (time proportional to its in-flight work);
* ``bytes`` / ``blocks`` are the sums over ``blocks``, kept by deltas (counting 5 million rows is not
  free); ``complete`` is 1 once a rebuild from the files finished: until then puts are refused;
* a connection is never used across ``fork``: a child opens its own;
* schema ``SCHEMA`` (``meta.schema``): 2 added ``blocks.tenant``, by ``ALTER TABLE`` at the first open by
  a build that knows it, so an index of an earlier build keeps opening with every row untenanted (NULL);
  a writer of an earlier build names its columns, so its rows are untenanted too, as they are.  A rebuild
  from the files records no tenant (nothing stored says it: keys and values are the same whoever's);
* ``lookup``'s answers are remembered per process (``_known``) only as of one ``PRAGMA data_version`` of
  the read connection, taken in the same read transaction as the query that filled them: any commit by
  any other connection (this process's writer, another process) changes it, and the next lookup forgets
  them all before answering.  So a remembered answer is always the index's answer as of that lookup's
  snapshot, never older;
* ``meta.mseq`` counts every insert into and delete from ``blocks`` (SQLite triggers: whoever writes), as
  the LMDB lookup mirror of earlier builds needs (a process of such a build may share the index);
* every change to ``blocks`` while the index is complete is in ``changes`` (``complete`` goes from 0 to 1
  once per generation and back only with a new generation, ``reset``); rows are trimmed only up to a
  published snapshot's ``upto``, and ``ctrim`` says up to where, in the same transaction;
* a lookup trusts a snapshot (``_disk_snapshot``) only if, in the read transaction that answers it, the
  index is complete, its generation is the snapshot's, and ``ctrim <= upto`` (every change since is still
  logged); it then answers ``snapshot + changes with id > upto`` (the process keeps those it read, as of
  the ``data_version`` it read them at), exact as of that transaction.  Otherwise it asks SQLite and a
  build is asked for (``on_snapshot_wanted``), also when the changes since the snapshot pass
  ``_REBUILD_MIN`` / ``_REBUILD_FRACTION``; a write transaction asks for one at the same bound, so the
  log stays short where nobody looks up.
"""

from __future__ import annotations

import contextlib
import hashlib
import logging
import os
import sqlite3
import threading
import time
import uuid
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import AbstractContextManager
from typing import Any

from kvtier.backends import _disk_snapshot as snapshots
from kvtier.quota import Share

_SCHEMA = """
CREATE TABLE IF NOT EXISTS meta(k TEXT PRIMARY KEY, v) WITHOUT ROWID;
CREATE TABLE IF NOT EXISTS blocks(key BLOB PRIMARY KEY, size INTEGER NOT NULL, used INTEGER NOT NULL,
                                  mtime INTEGER) WITHOUT ROWID;
CREATE INDEX IF NOT EXISTS blocks_used ON blocks(used);
CREATE TABLE IF NOT EXISTS intents(writer TEXT NOT NULL, key BLOB NOT NULL, size INTEGER NOT NULL,
                                   tmp TEXT, t REAL NOT NULL);
CREATE INDEX IF NOT EXISTS intents_writer ON intents(writer, key);
INSERT OR IGNORE INTO meta(k, v) VALUES ('mseq', 0);
CREATE TABLE IF NOT EXISTS changes(id INTEGER PRIMARY KEY AUTOINCREMENT, key BLOB NOT NULL, listed INTEGER NOT NULL);
INSERT OR IGNORE INTO meta(k, v) VALUES ('ctrim', 0);
"""
# Every change to the set of keys bumps ``mseq``, also one made by a writer that predates the mirror.
_ADDED = """CREATE TRIGGER IF NOT EXISTS blocks_added AFTER INSERT ON blocks BEGIN
  UPDATE meta SET v = v + 1 WHERE k = 'mseq'; END"""
_DROPPED = """CREATE TRIGGER IF NOT EXISTS blocks_dropped AFTER DELETE ON blocks BEGIN
  UPDATE meta SET v = v + 1 WHERE k = 'mseq'; END"""
# The change log, for the lookup snapshot: not while a rebuild fills the table (no snapshot serves an
# incomplete index, and a rebuild's millions of rows would double its writes).
_LOGGED = "WHEN (SELECT v FROM meta WHERE k = 'complete') = 1"
_LOG_ADDED = f"""CREATE TRIGGER IF NOT EXISTS changes_added AFTER INSERT ON blocks {_LOGGED} BEGIN
  INSERT INTO changes(key, listed) VALUES (NEW.key, 1); END"""
_LOG_DROPPED = f"""CREATE TRIGGER IF NOT EXISTS changes_dropped AFTER DELETE ON blocks {_LOGGED} BEGIN
  INSERT INTO changes(key, listed) VALUES (OLD.key, 0); END"""
log = logging.getLogger("kvtier.backends.local_disk")
_CACHE_KIB = 8192  # SQLite's page cache per connection: the index's resident memory in a process
# Lookup answers remembered while the index is unchanged (a scheduler asks about a waiting request's keys
# at every step): at most this many, about 100 bytes each.
_KNOWN_MAX = 1 << 16
_IN_MAX = 30_000  # keys bound in one IN (...) query (SQLite's limit on parameters is 32,766)
# A new snapshot is asked for once this many changes followed the one in use: each process keeps those
# (about 100 bytes each), and a 5-million-key build costs a few seconds of one core.
_REBUILD_MIN = 65_536
_REBUILD_FRACTION = 16  # ... or a sixteenth of the snapshot's keys, if more
_WANT_EVERY_S = 1.0  # a process asks for a build at most this often


SCHEMA = 2  # 2: blocks.tenant (see the invariants)


def _add_column(c: sqlite3.Connection, column: str, kind: str) -> None:
    """Add a nullable column to ``blocks``; another process opening the index may have added it first."""
    try:
        c.execute(f"ALTER TABLE blocks ADD COLUMN {column} {kind}")
    except sqlite3.OperationalError as e:
        if "duplicate column" not in str(e):
            raise


def blob(key: str) -> bytes:
    """A canonical key (``<32 hex>/<32|64 hex>``) as the index stores it."""
    return bytes.fromhex(key[:32] + key[33:])


def unblob(b: bytes) -> str:
    h = b.hex()
    return f"{h[:32]}/{h[32:]}"


def index_path(index_dir: str, root: str) -> str:
    return f"{index_dir}/{hashlib.sha256(os.path.realpath(root).encode()).hexdigest()[:24]}.sqlite"


class DiskIndex:
    """One process's connection to a directory's index (a new one after ``fork``)."""

    def __init__(self, path: str, root: str):
        self.path = path
        self.root = root
        self._lock = threading.RLock()  # one connection per process, used by its threads in turn
        self._conn: sqlite3.Connection | None = None
        self._pid = -1
        self._rlock = threading.Lock()  # reads on a second connection: never behind a write transaction
        self._r: sqlite3.Connection | None = None
        self._rpid = -1
        self._known: dict[bytes, bool] = {}  # lookup answers as of the read connection's _known_version
        self._known_version: int | None = None
        # Connections inherited across fork: kept, never closed or freed in the child (closing one would
        # drop the child's own POSIX locks on the database file, which SQLite takes per process).
        self._inherited: list[sqlite3.Connection] = []
        self.snapshot_path = (path[: -len(".sqlite")] if path.endswith(".sqlite") else path) + ".keys"
        self._snap: snapshots.Snapshot | None = None  # the file mapped (whether it serves: _serving)
        self._serving = False  # as of _snap_version: the snapshot answers this connection's lookups
        self._snap_version: int | None = None  # the read connection's data_version _delta is as of
        self._delta: dict[bytes, int] = {}  # key -> listed (1 / 0), every logged change after _snap.upto
        self._delta_upto = 0  # the last change-log id in _delta
        self._bad: tuple[int, int, int] | None = None  # the file that failed to load (damaged, other boot)
        self._wanted = -1e9  # when a build was last asked for
        # Called (from a lookup, without locks held) when the snapshot should be built: the backend
        # starts ``build_snapshot`` in a thread.  None: nobody builds (lookups ask SQLite meanwhile).
        self.on_snapshot_wanted: Callable[[], None] | None = None
        self._in_tx = False

    # ------------------------------------------------------------------ connection

    def conn(self) -> sqlite3.Connection:
        if self._conn is None or self._pid != os.getpid():
            if self._conn is not None:
                self._inherited.append(self._conn)
            os.makedirs(os.path.dirname(self.path), exist_ok=True)
            c = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=60)
            c.execute("PRAGMA journal_mode=WAL")
            c.execute("PRAGMA synchronous=NORMAL")  # a kill loses nothing committed; a power cut may lose
            # the last transactions, which the next rebuild-free start treats like a killed writer's
            c.execute(f"PRAGMA cache_size=-{_CACHE_KIB}")
            c.executescript(f"{_SCHEMA}{_ADDED};{_DROPPED};{_LOG_ADDED};{_LOG_DROPPED};")
            columns = {r[1] for r in c.execute("PRAGMA table_info(blocks)")}
            for column, kind in (("mtime", "INTEGER"), ("tenant", "TEXT")):  # an index of an earlier build:
                if column not in columns:  # its rows' mtimes unknown, its blocks untenanted
                    _add_column(c, column, kind)
            if int(self.meta(c, "schema", 1) or 1) < SCHEMA:
                self.set_meta(c, "schema", SCHEMA)
            self._conn, self._pid = c, os.getpid()
            side = self.path[: -len(".sqlite")] + ".root"
            if not os.path.exists(side):  # which directory it indexes: prune_indexes removes orphans
                with open(side, "w") as f:
                    f.write(os.path.realpath(self.root))
        return self._conn

    def rconn(self) -> sqlite3.Connection:
        if self._r is None or self._rpid != os.getpid():
            if self._r is not None:
                self._inherited.append(self._r)
            self.conn()  # the schema
            c = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=60)
            c.execute(f"PRAGMA cache_size=-{_CACHE_KIB}")
            self._r, self._rpid = c, os.getpid()
            self._known, self._known_version = {}, None  # data_version is per connection
            self._snap_version = None
        return self._r

    def close(self) -> None:
        with self._lock, self._rlock:
            for c, pid in ((self._conn, self._pid), (self._r, self._rpid)):
                if c is not None and pid == os.getpid():
                    with contextlib.suppress(sqlite3.Error):
                        c.close()
            self._conn = self._r = None
            if self._snap is not None:
                self._snap.close()
            self._snap, self._serving, self._snap_version = None, False, None

    @contextlib.contextmanager
    def transaction(self) -> Iterator[sqlite3.Connection]:
        """A write transaction (the caller holds the directory's lock), committed on the way out, also
        after an error: every change in it stands for a filesystem change already made."""
        with self._lock:
            c = self.conn()
            if self._in_tx:  # nested: the outer one commits
                yield c
                return
            c.execute("BEGIN IMMEDIATE")
            self._in_tx = True
            due = False
            try:
                yield c
            finally:
                self._in_tx = False
                if c.in_transaction:
                    with contextlib.suppress(sqlite3.Error):
                        due = self._log_due(c)
                    c.execute("COMMIT")
            if due:  # (also where nobody looks up: a writer-only process keeps the log short too)
                self._want()

    @staticmethod
    def _log_due(c: sqlite3.Connection) -> bool:
        """Whether the change log has grown past what a new snapshot should fold in (``_follow``'s bound)."""
        row = c.execute("SELECT seq FROM sqlite_sequence WHERE name = 'changes'").fetchone()
        if row is None:
            return False
        m = dict(c.execute("SELECT k, v FROM meta WHERE k IN ('ctrim', 'blocks', 'complete')").fetchall())
        return bool(m.get("complete") == 1 and int(row[0]) - int(m.get("ctrim") or 0)
                    > max(_REBUILD_MIN, int(m.get("blocks") or 0) // _REBUILD_FRACTION))

    def cache(self, kib: int = _CACHE_KIB) -> None:
        """Set the write connection's page cache (a rebuild fills the B-tree faster with a large one)."""
        with self._lock:
            self.conn().execute(f"PRAGMA cache_size=-{kib}")

    def checkpoint(self, c: sqlite3.Connection) -> None:
        """Commit what the open transaction holds so far (an intent must be durable before its file
        change) and go on in a new one."""
        c.execute("COMMIT")
        c.execute("BEGIN IMMEDIATE")

    # ------------------------------------------------------------------ meta

    @staticmethod
    def meta(c: sqlite3.Connection, k: str, default: Any = None) -> Any:
        row = c.execute("SELECT v FROM meta WHERE k=?", (k,)).fetchone()
        return default if row is None else row[0]

    @staticmethod
    def set_meta(c: sqlite3.Connection, k: str, v: object) -> None:
        c.execute("INSERT OR REPLACE INTO meta(k, v) VALUES (?, ?)", (k, v))

    def state(self) -> tuple[str | None, bool]:
        """(generation id, complete) as committed; (None, False) for a new or unreadable index."""
        c = self.rconn()
        with self._rlock:
            rows = dict(c.execute("SELECT k, v FROM meta WHERE k IN ('id', 'complete')").fetchall())
        return (str(rows["id"]) if "id" in rows else None), rows.get("complete") == 1

    def reset(self, c: sqlite3.Connection, rebuilder: str) -> str:
        """Empty the index for a rebuild (in the caller's transaction); the new generation id."""
        gen = uuid.uuid4().hex
        # Without the triggers, so SQLite empties the table at once (the new generation restarts mseq and
        # logs nothing until complete; no snapshot of another generation serves it).
        for t in ("blocks_dropped", "changes_dropped"):
            c.execute(f"DROP TRIGGER IF EXISTS {t}")
        c.execute("DELETE FROM blocks")
        c.execute(_DROPPED)  # DDL: part of this transaction
        c.execute(_LOG_DROPPED)
        c.execute("DELETE FROM changes")  # (AUTOINCREMENT: later ids stay above every earlier one)
        c.execute("DELETE FROM intents")
        c.execute("DELETE FROM meta")
        for k, v in (("id", gen), ("bytes", 0), ("blocks", 0), ("clock", 0), ("complete", 0), ("mseq", 0),
                     ("ctrim", 0), ("rebuilder", rebuilder), ("root", os.path.realpath(self.root))):
            self.set_meta(c, k, v)
        return gen

    def remove(self) -> None:
        """Delete the index's files (a damaged index, before its rebuild)."""
        self.close()
        for suffix in ("", "-wal", "-shm"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path + suffix)
        snapshots.remove(self.snapshot_path)

    def adopt(self, c: sqlite3.Connection, rows: Sequence[tuple[str, int, int]]) -> None:
        """A rebuild's rows (key, size, last use in microseconds), in key order (B-tree pages filled in
        order); keys already there keep theirs.  ``bytes`` / ``blocks`` are set once at the end
        (``recount``): nothing else writes blocks while a rebuild runs (puts are refused)."""
        c.executemany("INSERT OR IGNORE INTO blocks(key, size, used) VALUES (?, ?, ?)",
                      sorted((blob(k), n, u) for k, n, u in rows))

    def recount(self, c: sqlite3.Connection) -> tuple[int, int]:
        """Set ``blocks`` / ``bytes`` from the rows (a pass over the index, not the directory)."""
        blocks, nbytes = c.execute("SELECT count(*), coalesce(sum(size), 0) FROM blocks").fetchone()
        self.set_meta(c, "blocks", int(blocks))
        self.set_meta(c, "bytes", int(nbytes))
        return int(blocks), int(nbytes)

    def doc(self) -> dict[str, object]:
        """The ledger's mirror of the committed state: block bytes, each writer's reservations, the
        index generation."""
        c = self.rconn()
        with self._rlock:
            rows = dict(c.execute("SELECT k, v FROM meta WHERE k IN ('bytes', 'id')").fetchall())
            held = self.held(c)
        return {"bytes": int(rows.get("bytes", 0)), "held": held, "index": rows.get("id")}

    # ------------------------------------------------------------------ reads (no lock)

    def lookup(self, keys: Sequence[str]) -> list[bool]:
        """Whether the index knows each key.  Keys answered since the index last changed are answered
        from memory (the module's invariants: exact as of this call's snapshot); the others by the lookup
        snapshot plus the changes logged since it, when it serves this read transaction, else by one
        ``IN (...)`` query per ``_IN_MAX`` keys, all in one read transaction with the ``data_version``
        that dates them.  Measured at 5 million blocks (docs/performance.md): SQLite's query is about
        3-10 us a key here (a temp-table join, per-key queries, ``mmap_size`` and a larger page cache
        were no faster); the snapshot's search about 0.2 us."""
        fromhex = bytes.fromhex  # blob(), inline: a call per key is half the snapshot's search
        blobs = [fromhex(k[:32] + k[33:]) for k in keys]
        c = self.rconn()
        want = False
        with self._rlock:
            known = self._known
            c.execute("BEGIN")  # one snapshot for the version and the query (WAL: never waits on writers)
            try:
                version = c.execute("PRAGMA data_version").fetchone()[0]
                if version != self._known_version or len(known) > _KNOWN_MAX:
                    known.clear()
                    self._known_version = version
                # (nothing remembered: a key twice is just probed twice)
                missing = [b for b in dict.fromkeys(blobs) if b not in known] if known else blobs
                if missing:
                    if self._snap_version != version:
                        want = self._follow(c, version)
                    snap = self._snap
                    if self._serving and snap is not None:
                        fast: list[bool] = snap.contains(missing)
                        if self._delta:
                            d = self._delta
                            fast = [d[b] == 1 if b in d else f for b, f in zip(missing, fast)]
                        known.update(zip(missing, fast))
                        if missing is blobs:
                            return fast
                        missing = []
                for i in range(0, len(missing), _IN_MAX):
                    part = missing[i:i + _IN_MAX]
                    found = {r[0] for r in c.execute(
                        f"SELECT key FROM blocks WHERE key IN ({','.join('?' * len(part))})", part)}
                    for b in part:
                        known[b] = b in found
            finally:
                c.execute("COMMIT")
                if want:
                    self._want()
            return [known[b] for b in blobs]

    def _follow(self, c: sqlite3.Connection, version: int) -> bool:
        """In the lookup's read transaction (``_rlock`` held): whether the snapshot serves it (``_serving``),
        after mapping a newer file and reading the changes logged since; whether a build should be asked
        for."""
        self._snap_version = version
        ident = dict(c.execute("SELECT k, v FROM meta WHERE k IN ('id', 'complete', 'ctrim')").fetchall())
        complete = ident.get("complete") == 1
        snap = self._snap
        now = snapshots.stat_ident(self.snapshot_path)
        if (snap is None or now != snap.ident) and now != self._bad:  # a build since (or none yet): map it
            if snap is not None:
                snap.close()
            snap = self._snap = snapshots.load(self.snapshot_path) if now is not None else None
            self._bad = now if snap is None else None  # (a file that failed is not read again, nor logged)
            self._delta, self._delta_upto = {}, snap.upto if snap is not None else 0
        self._serving = (snap is not None and complete and snap.gen == str(ident.get("id"))
                         and int(ident.get("ctrim") or 0) <= snap.upto)
        if not self._serving or snap is None:  # (the changes are read again from its upto if it serves later)
            self._delta, self._delta_upto = {}, snap.upto if snap is not None else 0
            return complete
        upto = self._delta_upto
        last = c.execute("SELECT max(id) FROM changes").fetchone()[0]
        if last is not None and int(last) > upto:
            # dict() over the cursor: built in C (a Python loop over 60,000 rows took 56 ms, the whole of
            # a start-up here); in id order, so a key's last change wins.
            self._delta.update(c.execute("SELECT key, listed FROM changes WHERE id > ? ORDER BY id", (upto,)))
            upto = int(last)
        self._delta_upto = upto
        return bool(upto - snap.upto > max(_REBUILD_MIN, snap.count // _REBUILD_FRACTION))

    def _want(self) -> None:
        now = time.monotonic()
        if self.on_snapshot_wanted is not None and now - self._wanted >= _WANT_EVERY_S:
            self._wanted = now
            self.on_snapshot_wanted()

    def snapshot_serves(self) -> bool:
        """Whether lookups of the committed index are answered by the lookup snapshot."""
        c = self.rconn()
        with self._rlock:
            c.execute("BEGIN")
            try:
                self._follow(c, c.execute("PRAGMA data_version").fetchone()[0])
                return self._serving
            finally:
                c.execute("COMMIT")

    def serving_snapshot(self) -> snapshots.Snapshot | None:
        """The lookup snapshot that answers this process's lookups now, if one does."""
        return self._snap if self.snapshot_serves() else None

    def build_snapshot(self, lock: Callable[[], AbstractContextManager[Any]], stop: threading.Event | None = None) -> int:
        """Write the lookup snapshot from one read transaction of the index (on a connection of its own:
        lookups never wait for it), then trim the change log up to it under ``lock`` (the directory's
        lock: every change to the index is made under it); the keys written, or 0 when another build
        holds the snapshot's lock, the index is incomplete or the backend closed meanwhile."""
        t0 = time.perf_counter()
        with snapshots.exclusive(self.snapshot_path) as mine:
            if not mine:
                return 0
            self.conn()  # the schema
            c = sqlite3.connect(self.path, isolation_level=None, check_same_thread=False, timeout=60)
            try:
                c.execute("BEGIN")
                ident = dict(c.execute("SELECT k, v FROM meta WHERE k IN ('id', 'complete')").fetchall())
                row = c.execute("SELECT seq FROM sqlite_sequence WHERE name = 'changes'").fetchone()
                upto = int(row[0]) if row is not None else 0
                if ident.get("complete") != 1 or ident.get("id") is None:
                    return 0

                def pages() -> Iterator[list[bytes]]:
                    cur = c.execute("SELECT key FROM blocks")
                    while page := cur.fetchmany(65536):
                        if stop is not None and stop.is_set():
                            raise _Stopped
                        yield [r[0] for r in page]

                try:
                    n: int = snapshots.write(self.snapshot_path, str(ident["id"]), upto, pages())
                except _Stopped:
                    return 0
                c.execute("COMMIT")
                if stop is not None and stop.is_set():  # closed: its connections are not opened again
                    return 0
                with lock(), self.transaction() as w:  # (a later build's trim may have gone further)
                    if self.meta(w, "id") == ident["id"] and int(self.meta(w, "ctrim", 0) or 0) < upto:
                        w.execute("DELETE FROM changes WHERE id <= ?", (upto,))
                        self.set_meta(w, "ctrim", upto)
            finally:
                c.close()
        if n > 100_000:
            log.info("local_disk: %s: lookup snapshot of %d keys built in %.2f s", self.root, n,
                     time.perf_counter() - t0)
        return n

    def sizes(self, c: sqlite3.Connection, keys: Sequence[str]) -> dict[str, int]:
        out: dict[str, int] = {}
        for i in range(0, len(keys), 900):
            part = keys[i:i + 900]
            for k, n in c.execute(f"SELECT key, size FROM blocks WHERE key IN ({','.join('?' * len(part))})",
                                  [blob(k) for k in part]):
                out[unblob(k)] = n
        return out

    def lru(self, c: sqlite3.Connection | None = None) -> Iterator[tuple[str, int, str | None]]:
        """Every block as (key, size, tenant), least recently used first, read in pages (a 5-million-row
        answer is never held)."""
        after: tuple[int, bytes] = (-1, b"")
        while True:
            with contextlib.nullcontext() if c is not None else self._rlock:
                cc = c or self.rconn()
                rows = cc.execute("SELECT key, size, used, tenant FROM blocks WHERE (used, key) > (?, ?) "
                                  "ORDER BY used, key LIMIT 512", after).fetchall()
            if not rows:
                return
            for k, n, _, t in rows:
                yield unblob(k), n, t
            after = (rows[-1][2], rows[-1][0])

    def rows(self) -> Iterator[tuple[str, int, int, int | None]]:
        """Every block as (key, size, used, mtime), in key order, read in pages."""
        after = b""
        while True:
            c = self.rconn()
            with self._rlock:
                page = c.execute("SELECT key, size, used, mtime FROM blocks WHERE key > ? ORDER BY key LIMIT 4096",
                                 (after,)).fetchall()
            if not page:
                return
            for k, n, u, m in page:
                yield unblob(k), n, u, m
            after = page[-1][0]

    def counts(self) -> tuple[int, int]:
        """(blocks, bytes) as last committed."""
        c = self.rconn()
        with self._rlock:
            rows = dict(c.execute("SELECT k, v FROM meta WHERE k IN ('blocks', 'bytes')").fetchall())
        return int(rows.get("blocks", 0)), int(rows.get("bytes", 0))

    # ------------------------------------------------------------------ changes (in a transaction)

    @staticmethod
    def held(c: sqlite3.Connection) -> dict[str, list[float]]:
        """Each writer's reserved bytes and the time of its last intent (the ledger's ``held``)."""
        return {w: [int(n), float(t)] for w, n, t in
                c.execute("SELECT writer, sum(size), max(t) FROM intents GROUP BY writer")}

    @staticmethod
    def intend(c: sqlite3.Connection, writer: str, rows: Iterable[tuple[str, int, str | None]]) -> None:
        now = time.time()
        c.executemany("INSERT INTO intents(writer, key, size, tmp, t) VALUES (?, ?, ?, ?, ?)",
                      [(writer, blob(k), n, tmp, now) for k, n, tmp in rows])

    @staticmethod
    def done(c: sqlite3.Connection, writer: str, keys: Iterable[str]) -> None:
        """Drop ``writer``'s intents on ``keys`` (one row each: a key twice in a batch has two)."""
        c.executemany("DELETE FROM intents WHERE rowid = (SELECT rowid FROM intents WHERE writer=? AND key=? "
                      "LIMIT 1)", [(writer, blob(k)) for k in keys])

    @staticmethod
    def intents(c: sqlite3.Connection, writer: str) -> list[tuple[str, int, str | None]]:
        return [(unblob(k), n, tmp) for k, n, tmp in
                c.execute("SELECT key, size, tmp FROM intents WHERE writer=?", (writer,))]

    @staticmethod
    def drop_writer(c: sqlite3.Connection, writer: str) -> None:
        c.execute("DELETE FROM intents WHERE writer=?", (writer,))

    @staticmethod
    def _add(c: sqlite3.Connection, blocks: int, nbytes: int) -> None:
        if blocks or nbytes:
            c.execute("UPDATE meta SET v = v + ? WHERE k='blocks'", (blocks,))
            c.execute("UPDATE meta SET v = v + ? WHERE k='bytes'", (nbytes,))

    def tick(self, c: sqlite3.Connection, n: int) -> int:
        """The first of ``n`` new LRU clock values, all later than every value given before."""
        first: int = max(int(self.meta(c, "clock", 0) or 0) + 1, time.time_ns() // 1000)
        self.set_meta(c, "clock", first + n - 1)
        return first

    def put(self, c: sqlite3.Connection, entries: Sequence[tuple[str, int]], first_use: int | None = None,
            keep_use: bool = False, mtimes: dict[str, int] | None = None,
            tenants: Mapping[str, str] | None = None) -> int:
        """Record blocks (key, size) now on disk, most recent last; the change in bytes.  ``keep_use``: a
        key already known keeps its place (a rebuild's rows never overtake newer puts).  ``tenants``: the
        tenant each tenant's key is charged to (the others: untenanted)."""
        if not entries:
            return 0
        t = self.tick(c, len(entries)) if first_use is None else first_use
        old = self.sizes(c, [k for k, _ in entries])
        m, tt = mtimes or {}, tenants or {}
        rows = [(blob(k), n, t + i, m.get(k), tt.get(k)) for i, (k, n) in enumerate(entries)]
        if keep_use:
            c.executemany("INSERT OR IGNORE INTO blocks(key, size, used, mtime, tenant) VALUES (?, ?, ?, ?, ?)",
                          rows)
            new = [(k, n) for k, n in entries if k not in old]
            delta = sum(n for _, n in new)
            self._add(c, len(new), delta)
            return delta
        c.executemany("INSERT OR REPLACE INTO blocks(key, size, used, mtime, tenant) VALUES (?, ?, ?, ?, ?)",
                      rows)
        last = dict(entries)  # a key twice: its last size counts
        delta = sum(n for n in last.values()) - sum(old.values())
        self._add(c, len(last) - len(old), delta)
        return delta

    def drop(self, c: sqlite3.Connection, keys: Sequence[str]) -> int:
        """Forget blocks no longer on disk; the bytes they had."""
        old = self.sizes(c, keys)
        if old:
            gone = [blob(k) for k in old]
            c.executemany("DELETE FROM blocks WHERE key=?", [(b,) for b in gone])
            self._add(c, -len(old), -sum(old.values()))
        return sum(old.values())

    def touch(self, c: sqlite3.Connection, keys: Sequence[str]) -> None:
        """Make ``keys`` the most recently used, in order (unknown keys are skipped)."""
        if keys:
            t = self.tick(c, len(keys))
            c.executemany("UPDATE blocks SET used=? WHERE key=?", [(t + i, blob(k)) for i, k in enumerate(keys)])

    def totals(self, c: sqlite3.Connection) -> tuple[int, int]:
        """(block bytes, reserved bytes) in this transaction."""
        nbytes = int(self.meta(c, "bytes", 0) or 0)
        held = c.execute("SELECT coalesce(sum(size), 0) FROM intents").fetchone()[0]
        return nbytes, int(held)


    # ------------------------------------------------------------------ quotas per share (kvtier.quota)
    # Recorded in ``meta`` as ``quota:<namespace id>`` (a namespace's untenanted blocks) or
    # ``quota:<namespace id>:<tenant tag>`` by the writers that have one, so every process's capacity
    # eviction knows them; a writer without one clears its shares'.

    @staticmethod
    def quotas(c: sqlite3.Connection) -> dict[Share, int]:
        """Quota bytes of every share some writer recorded one for."""
        out: dict[Share, int] = {}
        for k, v in c.execute("SELECT k, v FROM meta WHERE k >= 'quota:' AND k < 'quota;'"):
            if v is not None:
                ns, _, tenant = str(k)[6:].partition(":")
                out[Share(ns, tenant or None)] = int(v)
        return out

    def set_quota(self, c: sqlite3.Connection, share: Share, quota: int | None) -> None:
        k = f"quota:{share.namespace}" + ("" if share.tenant is None else f":{share.tenant}")
        if quota is None:
            c.execute("DELETE FROM meta WHERE k=?", (k,))
        else:
            self.set_meta(c, k, quota)

    @staticmethod
    def _ns_range(namespace_id: str) -> tuple[bytes, bytes]:
        """Bounds of a namespace's keys: its digest, then a block hash of 16 or 32 bytes (below 33 x ff)."""
        lo = bytes.fromhex(namespace_id)
        return lo, lo + b"\xff" * 33

    def ns_bytes(self, c: sqlite3.Connection, share: Share) -> int:
        """Bytes of one share's blocks (a range of the key B-tree: its namespace's rows only)."""
        lo, hi = self._ns_range(share.namespace)
        return int(c.execute("SELECT coalesce(sum(size), 0) FROM blocks WHERE key >= ? AND key < ? AND tenant IS ?",
                             (lo, hi, share.tenant)).fetchone()[0])

    def ns_tenants(self, namespace_id: str) -> dict[str, str]:
        """key -> tenant tag of a namespace's tenant blocks."""
        lo, hi = self._ns_range(namespace_id)
        c = self.rconn()
        with self._rlock:
            rows = c.execute("SELECT key, tenant FROM blocks WHERE key >= ? AND key < ? AND tenant IS NOT NULL",
                             (lo, hi)).fetchall()
        return {unblob(k): str(t) for k, t in rows}

    def ns_lru(self, share: Share) -> list[tuple[str, int]]:
        """One share's blocks (key, size), least recently used first."""
        lo, hi = self._ns_range(share.namespace)
        c = self.rconn()
        with self._rlock:
            rows = c.execute("SELECT key, size FROM blocks WHERE key >= ? AND key < ? AND tenant IS ? "
                             "ORDER BY used, key", (lo, hi, share.tenant)).fetchall()
        return [(unblob(k), n) for k, n in rows]


class _Stopped(Exception):
    """The backend closed while its lookup snapshot was being built."""


_pruned: set[str] = set()


def prune_indexes(index_dir: str) -> int:
    """Remove the indexes of directories that no longer exist (once per process and ``index_dir``: a
    listing of a few files); how many."""
    if index_dir in _pruned:
        return 0
    _pruned.add(index_dir)
    n = 0
    try:
        names = os.listdir(index_dir)
    except FileNotFoundError:
        return 0
    for name in names:
        if not name.endswith(".root"):
            continue
        base = f"{index_dir}/{name[: -len('.root')]}"
        try:
            with open(f"{base}.root") as f:
                root = f.read()
        except OSError:
            continue
        if root and not os.path.isdir(root):
            for suffix in (".sqlite", ".sqlite-wal", ".sqlite-shm", ".keys", ".keys.lock", ".lmdb", ".lmdb-lock",
                           ".root"):
                with contextlib.suppress(FileNotFoundError):
                    os.unlink(base + suffix)
            n += 1
    return n


__all__ = ["DiskIndex", "blob", "index_path", "prune_indexes", "unblob"]
