"""The lookup mirror of a ``local_disk`` directory's index: the set of block keys the SQLite index lists,
kept beside it in an LMDB file (``<index>.lmdb``), so that a batch of lookups is one B+tree probe per key
in a shared memory map instead of SQLite's query engine (measured at 5 million blocks: 1,000 fresh keys
in 3.1 ms against the bare SQLite ``IN`` query's 10.4 ms in the same run, docs/performance.md).

Why LMDB (``lmdb`` on PyPI, a well-kept library): reads are a memory-mapped B+tree walk with no syscall
and no copy, shared by every process on the host through the page cache, and a reader never waits for a
writer; its copy-on-write commits survive kill -9 whole or not at all.  SQLite stays the index of record
(sizes, LRU, intents, quotas); this file holds keys only and can always be rebuilt from it.

Invariants:
* the mirror is trusted by a lookup only when its stamp agrees with the SQLite snapshot the lookup reads:
  same index generation (``meta.id``), same change count (``meta.mseq``, which SQLite triggers on
  ``blocks`` bump at every insert or delete, whoever the writer), the stamp's ``valid`` flag set, and the
  same boot of the host (``/proc/sys/kernel/random/boot_id``: commits are not synced, so after a power cut
  the file is rebuilt, never trusted).  Otherwise the lookup asks SQLite, as before the mirror.
* a writer (holding the directory's lock, so writers are ordered) commits its SQLite transaction first,
  then applies the keys it added and dropped in one LMDB transaction and stamps the new change count; it
  keeps ``valid`` only if the stamp was exactly its transaction's starting count (no writer before it died
  between its two commits) and it knew every change it made (a rebuild's bulk rows are not tracked: they
  clear ``valid``).  So between the two commits, and after a kill -9 there, lookups fall back to SQLite.
* ``rebuild`` (a background thread at start-up, when the stamp is not valid) copies SQLite's keys in
  key-range pages, each read from SQLite inside the LMDB write transaction that writes it (a writer's
  later delta then lands after it, so pages and deltas compose to SQLite's state), and sets ``valid`` under
  the directory's lock, where no writer is between its two commits.
* an environment is never used across ``fork``, nor closed in the child (LMDB's close would clear the
  parent's reader slots); ``lmdb`` refuses a second open of the files in a forked child too (its registry
  of open files is inherited), so a child of a process that had the mirror open asks SQLite, and its
  writes leave the stamp behind the change count (no lookup trusts it until a start-up copies it again).
  Files are removed only when LMDB says they are damaged, never because they are open.
"""

from __future__ import annotations

import contextlib
import importlib
import logging
import os
import threading
import time
from collections.abc import Callable
from typing import Any

lmdb: Any
try:
    lmdb = importlib.import_module("lmdb")
except ImportError:  # the mirror is an accelerator: without the library, lookups ask SQLite
    lmdb = None

log = logging.getLogger("kvtier.backends.local_disk")

META = b"\x00"  # the stamp's key: one byte, never a block key (those are 32 or 48 bytes)
_MAP_SIZE = 64 << 30  # address space reserved, not disk: about a billion keys
_PAGE_ROWS = 50_000  # keys copied per LMDB transaction by a rebuild (writers wait at most one page)
STALE_S = 5.0  # a stamp behind the index this long is no writer between its two commits
DELTA_MAX = 100_000  # a transaction changing more keys than this clears ``valid`` instead (a rebuild's)


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


BOOT = _boot_id()


class Stamp:
    """What the mirror is as of: (index generation, change count, valid, boot)."""

    __slots__ = ("gen", "seq", "valid", "boot", "bulk")

    def __init__(self, gen: str, seq: int, valid: bool, boot: str, bulk: int = 0):
        # bulk: how many transactions changed keys the mirror was not told (a rebuild in flight is
        # sealed only if none came since it began)
        self.gen, self.seq, self.valid, self.boot, self.bulk = gen, seq, valid, boot, bulk

    def encode(self) -> bytes:
        return f"{self.gen} {self.seq} {int(self.valid)} {self.boot} {self.bulk}".encode()

    @classmethod
    def decode(cls, b: bytes | None) -> Stamp | None:
        if b is None:
            return None
        try:
            gen, seq, valid, boot, bulk = bytes(b).decode().split(" ")
            return cls(gen, int(seq), valid == "1", boot, int(bulk))
        except ValueError:
            return None

    def serves(self, gen: str | None, seq: int | None) -> bool:
        return self.valid and self.gen == gen and self.seq == seq and self.boot == BOOT


# LMDB refuses a second environment on one file in a process (two backends on one directory): they share
# one, counted, per path and process.
_envs: dict[tuple[str, int], list[Any]] = {}
_envs_lock = threading.Lock()


class Mirror:
    """One process's handle on a directory's lookup mirror (a new environment after ``fork``)."""

    def __init__(self, path: str):
        self.path = path
        self._env: Any = None
        self._pid = -1
        self._broken = lmdb is None  # unusable in this process: lookups ask SQLite
        self._inherited: list[Any] = []
        self._lock = threading.Lock()
        # A stamp that stayed behind the index (a writer killed between its two commits, a forked child's
        # writes): seen since when; ``on_stale`` (the backend's copy) is called once it has lasted
        # STALE_S, so lookups are not left on SQLite until the next start-up.
        self.on_stale: Callable[[], None] | None = None
        self._stale: tuple[bytes, float] | None = None

    def env(self) -> Any:
        """The environment, or None when the mirror cannot be used in this process."""
        if self._broken:
            return None
        if self._env is None or self._pid != os.getpid():
            with self._lock, _envs_lock:
                if self._env is None or self._pid != os.getpid():
                    if self._env is not None or any(k == self.path and p != os.getpid() for k, p in _envs):
                        if self._env is not None:
                            self._inherited.append(self._env)
                        self._broken = True  # a forked child: see the module's invariants
                        return None
                    held = _envs.get((self.path, os.getpid()))
                    if held is None:
                        env = self._open()
                        if env is None:
                            return None
                        held = _envs[(self.path, os.getpid())] = [env, 0]
                    held[1] += 1
                    self._env, self._pid = held[0], os.getpid()
        return self._env

    def _open(self) -> Any:
        assert lmdb is not None
        # sync off: a kill -9 loses nothing (the pages are the kernel's), a power cut changes the boot id
        # (the stamp then serves nothing); readahead off: lookups are random pages
        kw: dict[str, Any] = dict(subdir=False, map_size=_MAP_SIZE, max_readers=4096, sync=False,
                                  metasync=False, readahead=False, meminit=False, lock=True)
        try:
            env = lmdb.open(self.path, **kw)
        except lmdb.Error as e:  # damaged: it holds nothing the index does not, start it again
            if "already open" in str(e):  # open in this process by other means: never removed for that
                log.warning("local_disk: lookup mirror %s: %s; lookups ask SQLite", self.path, e)
                self._broken = True
                return None
            log.warning("local_disk: lookup mirror %s is damaged (%s); starting it again", self.path, e)
            self._unlink()
            try:
                env = lmdb.open(self.path, **kw)
            except lmdb.Error as e2:
                log.warning("local_disk: lookup mirror %s cannot be opened (%s); lookups ask SQLite",
                            self.path, e2)
                self._broken = True
                return None
        with contextlib.suppress(lmdb.Error):
            env.reader_check()  # reader slots of killed processes
        return env

    def disable(self, why: BaseException) -> None:
        if not self._broken:
            log.warning("local_disk: lookup mirror %s failed (%s); lookups ask SQLite in this process",
                        self.path, why)
        self._broken = True

    def remove_files(self) -> None:
        """(Only with no environment open on them in this process.)"""
        self.close()
        with _envs_lock:
            if (self.path, os.getpid()) in _envs:
                return
        self._unlink()

    def _unlink(self) -> None:
        for suffix in ("", "-lock"):
            with contextlib.suppress(FileNotFoundError):
                os.unlink(self.path + suffix)

    def close(self) -> None:
        with self._lock, _envs_lock:
            if self._env is not None and self._pid == os.getpid():
                held = _envs.get((self.path, os.getpid()))
                if held is not None and held[0] is self._env:
                    held[1] -= 1
                    if held[1] <= 0:
                        del _envs[(self.path, os.getpid())]
                        with contextlib.suppress(Exception):
                            held[0].close()
            self._env = None

    # ------------------------------------------------------------------ reads

    def lookup(self, blobs: list[bytes], gen: str | None, seq: int | None, complete: bool = False
               ) -> list[bool] | None:
        """Whether each key is listed, if the mirror's stamp is (gen, seq) and valid; else None.
        ``complete``: the index is (no rebuild from the files in flight), so a stale stamp is copied."""
        env = self.env()
        if env is None:
            return None
        try:
            with env.begin(buffers=True) as t:
                raw = t.get(META)
                stamp = Stamp.decode(raw)
                if stamp is None or not stamp.serves(gen, seq):
                    if complete:
                        self._noticed(bytes(raw) if raw is not None else b"")
                    return None
                g = t.get
                return [g(b) is not None for b in blobs]
        except lmdb.Error as e:
            self.disable(e)
            return None

    def _noticed(self, raw: bytes) -> None:
        now = time.monotonic()
        if self._stale is None or self._stale[0] != raw:
            self._stale = (raw, now)
        elif now - self._stale[1] >= STALE_S and self.on_stale is not None:
            self._stale = (raw, now + 3600.0)  # once: a copy is under way (it changes the stamp)
            self.on_stale()

    def stamp(self) -> Stamp | None:
        env = self.env()
        if env is None:
            return None
        try:
            with env.begin(buffers=True) as t:
                return Stamp.decode(t.get(META))
        except lmdb.Error as e:
            self.disable(e)
            return None

    # ------------------------------------------------------------------ writes

    def apply(self, delta: dict[bytes, bool] | None, gen: str, before: int, after: int) -> None:
        """A committed SQLite transaction's key changes (key -> listed now; None: not known, as a
        rebuild's bulk rows), taking the change count from ``before`` to ``after``."""
        env = self.env()
        if env is None:
            return
        try:
            with env.begin(write=True) as t:
                old = Stamp.decode(t.get(META))
                ok = (delta is not None and old is not None and old.valid and old.gen == gen
                      and old.seq == before and old.boot == BOOT)
                if delta is not None:  # also when not valid: a rebuild in flight composes with it
                    for k, present in delta.items():
                        if present:
                            t.put(k, b"")
                        else:
                            t.delete(k)
                bulk = (old.bulk if old is not None else 0) + (delta is None)
                t.put(META, Stamp(gen, after, ok, BOOT, bulk).encode())
        except lmdb.Error as e:
            self.disable(e)

    def rebuild(self, pages: Callable[[bytes], list[bytes]], seal: Callable[[Callable[[str, int], None]], None]
                ) -> int:
        """Copy the index's keys: ``pages(after)`` gives the next keys above ``after`` in key order (read
        inside the LMDB write transaction that writes them); ``seal(stamp)`` calls ``stamp(gen, seq)``
        under the directory's lock with the index's committed generation and change count.  The keys
        copied."""
        env = self.env()
        if env is None:
            return 0
        n = 0
        after = META
        try:
            with env.begin(write=True) as t:  # no lookup trusts it until sealed
                old = Stamp.decode(t.get(META))
                bulk = old.bulk if old is not None else 0
                t.put(META, Stamp(old.gen if old else "-", old.seq if old else -1, False, BOOT, bulk).encode())
            while True:
                with env.begin(write=True) as t:
                    keys = pages(after)
                    hi = keys[-1] if keys else None
                    c = t.cursor()
                    if c.set_range(after + b"\x00"):  # drop what the mirror has in (after, hi]
                        while c.key() != b"" and (hi is None or bytes(c.key()) <= hi):
                            if not c.delete():
                                break
                    for k in keys:
                        t.put(k, b"")
                    n += len(keys)
                if hi is None:
                    break
                after = hi

            def stamp(gen: str, seq: int) -> None:
                with env.begin(write=True) as t:
                    old = Stamp.decode(t.get(META))
                    if old is None or old.bulk != bulk:  # a change it was not told came since: unsealed
                        return
                    t.put(META, Stamp(gen, seq, True, BOOT, bulk).encode())

            seal(stamp)
        except lmdb.Error as e:
            self.disable(e)
        return n


__all__ = ["BOOT", "DELTA_MAX", "META", "Mirror", "Stamp"]
