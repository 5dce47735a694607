"""The manager: the scheduler half of the tier stack.  Torch-free by import, never blocks on I/O.

It answers "how much of this chain can be loaded?" from what it knows (the block index: blocks in the
worker's host memory as the worker reported them, blocks found in backends) and, for the rest, starts an
existence probe of the shared backends in a background thread and answers PENDING until that probe has
finished, the way vLLM's ``OffloadingManager.lookup`` answers None.  It turns scheduler decisions into
plain plan objects (:mod:`kvtier.plans`) for the worker, and folds the worker's reports back in.

Invariants:

* **Hints, never promises.**  What the index says about a block is a hint; the worker verifies every
  byte it loads and reports what it could not load (``WorkerReport.lost``), which the manager forgets.
* **No I/O on the caller's thread.**  ``lookup`` only reads the index and completed probe results;
  backend calls run in the probe pool, bounded by each backend's own timeouts.
* **Failures are misses.**  A backend that raises during a probe counts as 0 blocks found (and a
  metric), never an exception to the engine.
* **Bounded.**  Probe results are kept ``probe_ttl_s`` and at most ``max_probes`` at once; backend hints
  beyond ``max_hints`` entries are forgotten oldest first.
* **What a backend evicts, it says.**  A backend that evicts blocks itself to stay within its capacity
  (local_disk) calls its ``on_evicted`` hook, which the manager sets: the manager forgets those blocks
  there (``on_forgotten`` hears of each, so a worker can report them to a manager in another process).
  Blocks another process evicted stay hints until a load or a probe finds them gone.
* **A value of several blocks is one unit.**  With ``storage.block_tokens`` a backend holds a group's
  blocks in one value under the group's last block's key: a block only in a backend is offered only
  with that last block marked there and inside the lookup (``_servable_locked``).
"""

from __future__ import annotations

import logging
import threading
import time
from collections import OrderedDict, deque
from collections.abc import Callable, Collection, Iterable, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from functools import partial
from typing import Any

from .. import threads
from ..backend_api import StorageBackend
from ..config import KvtierConfig
from ..format.groups import group_ends, group_of
from ..index import BlockIndex, Tier, TierNames
from ..keys import Namespace, invalid_key
from ..metrics import StackMetrics
from ..plans import Lookup, LookupState, WorkerReport
from .backend_set import BackendSet

log = logging.getLogger("kvtier.manager")


class TierManager:
    """Scheduler-side state of one kvtier deployment (one namespace).

    ``backends``: instances to probe instead of building ``config.backends`` (tests); the manager closes
    only the backends it built.  In-process (:class:`~kvtier.stack.TierStack`) the stack passes its
    backend set, metrics, index and lock, so one index is the truth for both halves.
    """

    # Past this many evictions recorded for a backend, those no write still in flight can own (folded at
    # or before its oldest ticket) are dropped: a backend always busy writing would otherwise grow the
    # record with every eviction.
    EVICTED_WHILE_WRITING_MAX = 4096

    def __init__(self, config: KvtierConfig, *, backends: Sequence[StorageBackend] | BackendSet | None = None,
                 metrics: StackMetrics | None = None, index: BlockIndex | None = None,
                 lock: threading.Lock | None = None, probe_threads: int = 2, probe_ttl_s: float = 2.0,
                 max_hints: int = 1 << 20):
        self.config = config
        self.namespace: Namespace = config.namespace()
        self.block_size = self.namespace.block_size
        self.storage_blocks = self.namespace.storage_blocks  # engine blocks per stored value
        self.digest_size = self.namespace.hasher().digest_size
        self._owned = backends is None
        if isinstance(backends, BackendSet):
            self.backends = backends
            self.metrics = backends.metrics
        else:
            built = (config.build_backends() if backends is None
                     else list(backends))
            names = [b.name for b in built]
            self.metrics = metrics or StackMetrics(["device", "host", *names], self.block_size)
            cfg_write = {b.name: b.write for b in config.backends}
            self.backends = BackendSet(built, [cfg_write.get(n, True) for n in names], self.metrics,
                                       self.namespace.layout_id, 0)
        self.tier_names = TierNames(tuple(self.backends.names))
        self.index = index if index is not None else BlockIndex(capacity=1024)
        self.max_hints = max_hints
        self.probe_ttl_s = probe_ttl_s
        self.max_probes = 4096
        self._lock = lock or threading.Lock()
        # (first hash, length, its chain position mod the group size) -> (future, finished-at, the hashes
        # probed: an answer is stale once a block it counted is known gone)
        self._probes: OrderedDict[tuple[bytes, int, int],
                                  tuple[Future[tuple[int, int]], float, tuple[bytes, ...]]] = OrderedDict()
        self._probe_threads = probe_threads
        threads.configure(config.transfer.cpus)
        self._pool: ThreadPoolExecutor | None = None  # started by the first asynchronous probe
        self._closed = False
        self.backends.on_recovered = self._backend_back
        # Blocks the backends evicted themselves, not yet folded into the index: (backend, keys).
        self._evictions: deque[tuple[int, list[str]]] = deque()
        # Writes in flight per backend (their tickets: the fold number each started at -> how many), and
        # what that backend said it evicted while one was (hash -> the number of the fold that heard it):
        # a block evicted while its own write was in flight (Redis at maxmemory evicting a batch's first
        # values before the batch returns) must not be marked there when the write returns ok
        # (``begin_writes_locked`` / ``end_writes_locked``).  Numbers, not a record per block written: a
        # write to a backend that evicts nothing meanwhile costs two steps.  An eviction no write in
        # flight started before is nobody's: dropped, so the record stays bounded however busy the
        # backend (``end_writes_locked``).
        self._writes_in_flight: dict[int, dict[int, int]] = {}
        self._evicted_while_writing: dict[int, dict[bytes, int]] = {}
        self._folds = 0
        for i, b in enumerate(self.backends.backends):
            b.on_evicted = partial(self._backend_evicted, i)
        # Called (under the lock) with (hash, backend) for each block forgotten there because that backend
        # evicted it: the worker's report to a manager in another process.
        self.on_forgotten: Callable[[bytes, int], None] | None = None
        # Called (without the lock) once backend i is dealt with after an outage or a restart, with the
        # host-memory blocks it was known to hold: a stack writes them again (and what it owes it).
        self.on_backend_back: Callable[[int, list[bytes]], None] | None = None

    def _backend_back(self, i: int) -> bool:
        """Backend ``i`` answers again after being unreachable: forget which blocks the index and the
        recent probes say it holds (a restarted Redis comes back empty; a block marked there would be
        neither loaded nor written again by write-back).  Called from whatever thread made the backend
        call, which may hold the index lock: so never waits for it; False (asked again at the backend's
        next answer) when the lock is busy."""
        if not self._lock.acquire(blocking=False):
            return False
        try:
            in_host = self.index.host_keys_in_backend(i) if self.on_backend_back is not None else []
            n = self.index.forget_backend(i)
            self._probes.clear()
        finally:
            self._lock.release()
        log.warning("backend %r answers again after an outage or a restart: %d block(s) it was known to hold "
                    "are no longer assumed there (it may have come back empty); lookups ask it again",
                    self.backends.names[i], n)
        if self.on_backend_back is not None:
            self.on_backend_back(i, in_host)
        return True

    def _backend_evicted(self, i: int, keys: list[str]) -> None:
        """Backend ``i`` evicted ``keys`` itself (called from the thread whose write made it evict).  Queued,
        and folded into the index as soon as the lock is free (other holders keep it for microseconds);
        should the caller itself hold it (a backend called under the lock), after a short wait the next
        taker of the lock folds them (``fold_evictions_locked``: lookups, reports, write-downs).

        Values of several blocks (``storage.block_tokens``) are stored under their last block's key: only
        that block is unmarked, which is enough, since what decides for a group reads its last block's
        marks (a write-down rewrites a group whose last block is unmarked; a lookup serves a block only in
        a backend only if its group's last block is marked there: ``_servable_locked``)."""
        if invalid_key(keys) is not None:  # a third-party backend's garbage must not break a lookup
            keys = [k for k in keys if invalid_key([k]) is None]
        self._evictions.append((i, keys))
        if self._lock.acquire(timeout=0.05):
            try:
                self.fold_evictions_locked()
            finally:
                self._lock.release()

    def fold_evictions_locked(self) -> None:
        """Forget the queued backend evictions: unmark each block in that backend (dropping an entry left in
        no tier) and drop probe answers that counted it.  Keys of other namespaces (a store shared by
        other deployments) are not ours.  Called under the lock; cheap when nothing is queued."""
        if not self._evictions:
            return
        prefix = self.namespace.id + "/"
        skip = len(prefix)
        while self._evictions:
            i, keys = self._evictions.popleft()
            gone = [bytes.fromhex(key[skip:]) for key in keys if key.startswith(prefix)]
            if self._writes_in_flight.get(i):
                self._folds += 1
                self._evicted_while_writing.setdefault(i, {}).update(dict.fromkeys(gone, self._folds))
            self._forget_in_backend(gone, i)
            if self.on_forgotten is not None:
                for h in gone:
                    self.on_forgotten(h, i)

    def begin_writes_locked(self, i: int) -> int:
        """Writes to backend ``i`` are about to start (under the lock).  Returns their ticket for
        :meth:`end_writes_locked`: the evictions folded from now on happened during them."""
        self.fold_evictions_locked()  # what was evicted before they started is not theirs
        ticket = self._folds
        flying = self._writes_in_flight.get(i)
        if flying is None:  # (setdefault would build a dict on every call)
            flying = self._writes_in_flight[i] = {}
        flying[ticket] = flying.get(ticket, 0) + 1
        return ticket

    def end_writes_locked(self, i: int, ticket: int, hashes: Iterable[bytes]) -> set[bytes]:
        """The writes of values under ``hashes`` that ``begin_writes_locked`` gave ``ticket`` are over (under
        the lock): those backend ``i`` evicted meanwhile, which must not be marked there even if their
        write said ok.  Folds the evictions queued so far first (a notification that came before the write
        returned)."""
        self.fold_evictions_locked()
        evicted = self._evicted_while_writing.get(i)
        out = {h for h in hashes if evicted.get(h, -1) > ticket} if evicted else set()
        flying = self._writes_in_flight[i]
        left = flying[ticket] - 1
        if left:
            flying[ticket] = left
        else:
            del flying[ticket]
        if not flying:  # no write to it in flight: no eviction can be during one any more
            del self._writes_in_flight[i]
            self._evicted_while_writing.pop(i, None)
        elif evicted is not None and len(evicted) > self.EVICTED_WHILE_WRITING_MAX:
            oldest = min(flying)  # evictions folded at or before it are no write's in flight
            self._evicted_while_writing[i] = {h: n for h, n in evicted.items() if n > oldest}
        return out

    def _forget_in_backend(self, gone: Sequence[bytes], i: int) -> None:
        """Unmark ``gone`` in backend ``i``; an entry left in no tier and unused is dropped.  Probe answers
        that counted such a block are stale too."""
        if gone:
            self.index.leave_backend(gone, i)
            self._drop_probes_through(gone)

    def _drop_probes_through(self, changed: Collection[bytes], *, missed: bool = False) -> None:
        """Drop the probe answers that counted (or, still running, may count) a block in ``changed``, now
        gone: each later lookup would remember it in the backend again.  ``missed``: the blocks were
        written instead, so the answers that stopped short of one are stale."""
        if not changed or not self._probes:
            return
        changed = set(changed)
        stale = []
        for key, (fut, _, probed) in self._probes.items():
            upto = len(probed)
            if fut.done():
                try:
                    upto = fut.result()[0]
                except Exception:  # noqa: BLE001 - _probe never raises; belt and braces
                    upto = 0
            elif missed:
                continue  # still running: it may yet see the write
            if not changed.isdisjoint(probed[upto:] if missed else probed[:upto]):
                stale.append(key)
        for key in stale:
            del self._probes[key]

    # ------------------------------------------------------------------ input checks

    def check_hashes(self, hashes: Sequence[bytes]) -> list[bytes]:
        """``hashes`` as a list, or ``TypeError`` / ``ValueError`` naming the first bad position: every
        block hash is ``bytes`` of the configured algorithm's digest size (what ``hash_blocks`` returns).
        Refused here, so nothing is "stored" that could never be written or found."""
        out = list(hashes)
        size = self.digest_size
        for i, h in enumerate(out):
            if type(h) is not bytes:
                if isinstance(h, bytearray | memoryview):
                    h = out[i] = bytes(h)
                else:
                    raise TypeError(f"hashes[{i}]: expected bytes (a block hash from hash_blocks), got "
                                    f"{type(h).__name__}")
            if len(h) != size:
                raise ValueError(f"hashes[{i}]: expected {size} bytes for keys.algo "
                                 f"{self.namespace.hash_algo}, got {len(h)}")
        return out

    # ------------------------------------------------------------------ lookup (never blocks)

    def lookup(self, hashes: Sequence[bytes], *, wait_s: float = 0.0, start: int = 0) -> Lookup:
        """How many leading blocks of ``hashes`` are available, without waiting: memory and known
        backend blocks from the index; for the rest, a backend probe started now (PENDING) or finished
        earlier (its answer, kept ``probe_ttl_s``).  ``wait_s`` > 0 is for callers on a thread of their
        own that may block (SGLang's prefetch thread): wait up to that long for the probe instead of
        answering PENDING at once (PENDING if it is still running then).  ``start``: the chain position
        of ``hashes[0]`` (it matters when stored values group several blocks: :mod:`kvtier.format.groups`)."""
        found, probe = self._lookup(hashes, start)
        if probe is not None and wait_s > 0:
            wait([probe], timeout=wait_s)
            found, _ = self._lookup(hashes, start)
        return found

    def _lookup(self, hashes: Sequence[bytes], start: int) -> tuple[Lookup, Future[tuple[int, int]] | None]:
        """The answer, and the probe still running when it is PENDING."""
        n = len(hashes)
        with self._lock:
            self.fold_evictions_locked()
            tiers = self.index.prefix_tiers(hashes)
            p = len(tiers)
            if self.storage_blocks > 1:
                p = self._servable_locked(hashes, start, tiers)
                del tiers[p:]
        k = self.storage_blocks
        if p == n or not len(self.backends) or (k > 1 and not group_ends(start, p, n, k)):
            return _answer(p, tiers), None  # (no value ends inside the rest: nothing to ask for)
        got = self._probe_result(hashes[p:], start + p)
        if isinstance(got, Future):
            return Lookup(LookupState.PENDING, 0), got
        found, who = got
        if found:
            with self._lock:
                self._remember_backend(hashes[p:p + found], who)
        return _answer(p + found, tiers + [Tier.backend(who)] * found), None

    def _servable_locked(self, hashes: Sequence[bytes], start: int, tiers: Sequence[Tier]) -> int:
        """How many leading blocks of an index answer (``tiers``, from ``hashes[0]`` at chain position
        ``start``) can be served when stored values hold several blocks.  A block only in a backend comes
        out of its group's value, stored under the group's last block's key: that block must be inside
        the answer and marked in a backend.  Otherwise (the value was evicted, or the group ends beyond
        the hashes asked about) the answer stops at that block, not at a failed load."""
        k, index = self.storage_blocks, self.index
        for j, tier in enumerate(tiers):
            if not tier.is_backend:
                continue
            last = group_of(start, j, k)[1]
            if last >= len(tiers):
                return j
            if not tiers[last].is_backend:  # in memory there: is its value stored too?
                entry = index.get(hashes[last])
                if entry is None or not entry.backends:
                    return j
        return len(tiers)

    def resolve(self, hashes: Sequence[bytes], start: int = 0) -> tuple[Tier, ...]:
        """The in-process lookup (it may wait on I/O): where each block of the longest available prefix
        is best served from.  Memory tiers come from the index; backends are *asked* for the rest
        (never trusted from hints, since another process may have stored or evicted), and within a
        backend's run a block that is also in memory is served from memory.  ``start``: the chain
        position of ``hashes[0]``."""
        n, p = len(hashes), 0
        out: list[Tier] = []
        while p < n:
            with self._lock:
                self.fold_evictions_locked()
                mem = self.index.prefix_tiers(hashes[p:])
                cut = next((i for i, t in enumerate(mem) if t > Tier.HOST), None)
                if cut is not None:
                    del mem[cut:]
            out += mem
            p += len(mem)
            if p == n or not len(self.backends):
                break
            # Keys for the blocks past the memory prefix only (most of a request's hits are in memory).
            best, who = self._backend_prefix(self.namespace.keys(hashes[p:]), 0, start + p)
            if best == 0:
                break
            with self._lock:
                run = self.index.prefix_tiers(hashes[p:p + best])
            stored = Tier.backend(who)
            out += [t if t <= Tier.HOST else stored for t in run]
            out += [stored] * (best - len(run))
            p += best
        return tuple(out)

    def _backend_prefix(self, keys: Sequence[str], p: int, pos: int) -> tuple[int, int]:
        """``(blocks from keys[p] on, backend)`` of the longest run stored in one backend; ``pos`` is the
        chain position of ``keys[p]``.  With several blocks per stored value, only the keys that end a
        group are asked about, and the answer is whole groups (the first may begin before ``p``)."""
        k = self.storage_blocks
        if k == 1:
            return self.backends.longest_prefix(keys[p:])
        ends = group_ends(pos - p, p, len(keys), k)
        if not ends:
            return 0, 0
        groups, who = self.backends.longest_prefix([keys[e] for e in ends])
        return (ends[groups - 1] - p + 1 if groups else 0), who

    def _probe_result(self, hashes: Sequence[bytes], pos: int) -> tuple[int, int] | Future[tuple[int, int]]:
        """The finished probe's (blocks found, backend), or the running probe's future; ``pos`` is the
        chain position of ``hashes[0]``."""
        key = (hashes[0], len(hashes), pos % self.storage_blocks)
        now = time.monotonic()
        with self._lock:
            self._expire_locked(now)
            entry = self._probes.get(key)
            if entry is None:
                if self._closed:
                    return 0, 0
                if self._pool is None:
                    self._pool = threads.pool(self._probe_threads, "kvtier-probe")
                fut = self._pool.submit(self._probe, list(hashes), pos)
                self._probes[key] = (fut, 0.0, tuple(hashes))
                return fut
            fut, done_at, probed = entry
            if not fut.done():
                return fut
            if done_at == 0.0:
                self._probes[key] = (fut, now, probed)
        try:
            return fut.result()
        except Exception:  # noqa: BLE001 - _probe never raises; belt and braces
            return 0, 0

    def _probe(self, hashes: list[bytes], pos: int) -> tuple[int, int]:
        """Longest prefix in any backend (runs in the probe pool; BackendSet turns faults into 0)."""
        return self._backend_prefix(self.namespace.keys(hashes), 0, pos)

    def _expire_locked(self, now: float) -> None:
        while self._probes:
            key, (fut, done_at, _) = next(iter(self._probes.items()))
            stale = done_at and now - done_at > self.probe_ttl_s
            if not stale and len(self._probes) <= self.max_probes:
                break
            if not fut.done() and len(self._probes) <= 2 * self.max_probes:
                break  # never drop a running probe unless the table is far over its bound
            self._probes.popitem(last=False)

    @property
    def lock(self) -> threading.Lock:
        """The lock over :attr:`index` (a planner sharing this manager's index takes it too)."""
        return self._lock

    # ------------------------------------------------------------------ what the worker tells us

    def apply(self, report: WorkerReport) -> None:
        """Fold a worker report into the index: backend marks, and blocks lost.  (Host memory is placed by
        a planner sharing this index, vLLM's scheduler leading: no report says what it holds.)"""
        with self._lock:
            for i, hashes in _by_backend(report.in_backend).items():
                self._remember_backend(hashes, i)
                self._drop_probes_through(hashes, missed=True)  # an answer that missed a block written since
            for i, hashes in _by_backend(report.left_backend).items():
                self._forget_in_backend(hashes, i)
            for h in report.lost:
                if h in self.index:
                    self.index.remove(h)
            self._drop_probes_through(report.lost)

    def forget_probes(self) -> None:
        """Drop every kept probe answer (tests; after an operator changed the backends)."""
        with self._lock:
            self._probes.clear()

    # ------------------------------------------------------------------ internals

    def _remember_backend(self, hashes: Sequence[bytes], who: int) -> None:
        new = [h for h in hashes if h not in self.index]
        if new:
            self.index.insert_many(new, backends=[who])
        for h in hashes:
            self.index.add_backend(h, who)
        excess = len(self.index) - self.max_hints
        if excess > 0:
            for key in self.index.eviction_candidates(Tier.backend(who), excess + self.max_hints // 8):
                e = self.index.get(key)
                if e is not None and e.host is None and e.refs == 0:
                    self.index.remove(key)

    def stats(self) -> dict[str, Any]:
        with self._lock:
            return {"index_entries": len(self.index), "host": self.index.count(Tier.HOST),
                    "probes": len(self._probes)}

    def close(self) -> None:
        with self._lock:
            self._closed = True
            pool = self._pool
        if pool is not None:
            pool.shutdown(wait=True, cancel_futures=True)
        self.backends.close([self._owned] * len(self.backends))


def _by_backend(pairs: Iterable[tuple[bytes, int]]) -> dict[int, list[bytes]]:
    """(block hash, backend index) pairs of a report, grouped by backend."""
    out: dict[int, list[bytes]] = {}
    for h, i in pairs:
        out.setdefault(i, []).append(h)
    return out


def _answer(n: int, tiers: list[Tier]) -> Lookup:
    return Lookup(LookupState.HIT, n, tuple(tiers[:n])) if n else Lookup(LookupState.MISS, 0)


__all__ = ["TierManager"]
