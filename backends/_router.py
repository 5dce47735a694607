"""Which Redis node serves a key, and running a batch over the nodes: single server or Redis Cluster.

Invariants:
* A single server is a cluster of one node with no slot map; everything below works for both.
* A pooled connection that fails with a connection error before the caller's time is spent (the server
  restarted since it was pooled) is retried once on a fresh connection; a timeout is never retried.
* The slot map is reloaded when a redirect (MOVED) says it is wrong, and at most once a second after a
  node failed, so a dead node costs fast failures, not a refresh storm.
* A batch whose nodes partly fail reports the failed nodes' keys as ``failed`` and the rest normally;
  a batch where every node failed raises the first error.
"""

from __future__ import annotations

import logging
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from concurrent.futures import ThreadPoolExecutor
from typing import TypeVar

from kvtier import threads as kvthreads

from ._resp import Connection, NoProgress, Pool, ReplyError, key_slot

log = logging.getLogger("kvtier.backends.redis")
Addr = tuple[str, int]
# run(conn, idxs, asking) -> replies aligned with idxs; asking: the idxs to send with ASKING first.
Run = Callable[[Connection, list[int], "set[int] | tuple[()]"], list[object]]
_T = TypeVar("_T")


class Router:
    def __init__(self, connect: Callable[[Addr, bool], Connection], seeds: Sequence[Addr],
                 cluster: bool | None, max_connections: int, wait_s: float, name: str):
        self._connect, self._seeds, self.cluster = connect, list(seeds), cluster
        self._max_connections, self._wait_s, self._name = max_connections, wait_s, name
        self._pools: dict[Addr, Pool] = {}
        self._topo_lock = threading.Lock()   # slot map and cluster detection
        self._pools_lock = threading.Lock()  # taken inside _topo_lock, never around it
        self._slots: list[Addr] | None = None
        self.masters: list[Addr] = [self._seeds[0]]
        self._stale_since: float | None = None
        self._refreshed_at = 0.0
        self._last_failed: Addr | None = None
        self._executor: ThreadPoolExecutor | None = None
        self.partial_failures = 0
        self.on_lost: Callable[[int], None] | None = None  # told how many keys a partial failure lost

    # ------------------------------------------------------------------ connections

    def _pool(self, addr: Addr) -> Pool:
        pool = self._pools.get(addr)
        if pool is None:
            with self._pools_lock:
                pool = self._pools.get(addr)
                if pool is None:
                    pool = Pool(lambda a: self._connect(a, bool(self.cluster)), addr,
                                self._max_connections, self._wait_s)
                    self._pools[addr] = pool
        return pool

    def on_node(self, addr: Addr, fn: Callable[[Connection], _T]) -> _T:
        """``fn(conn)`` on a pooled connection to ``addr``."""
        pool = self._pool(addr)
        for attempt in (0, 1):
            fresh = True
            try:
                with pool.connection() as (conn, fresh):
                    return fn(conn)
            except BlockingIOError as e:  # a kernel socket timeout (SO_RCVTIMEO / SO_SNDTIMEO) expired
                self._mark_failed(addr)
                raise NoProgress(f"redis {addr[0]}:{addr[1]}: no answer within {self._wait_s}s") from e
            except ConnectionError:
                if fresh or attempt:
                    self._mark_failed(addr)
                    raise
                pool.clear()  # the server restarted or dropped us: every idle connection is dead too
            except OSError:  # timeouts: the caller's time is spent
                self._mark_failed(addr)
                raise
        raise AssertionError("unreachable: the second attempt returns or raises")  # for the type checker

    def _mark_failed(self, addr: Addr) -> None:
        self._last_failed = addr
        if self.cluster and self._stale_since is None:
            self._stale_since = time.monotonic()

    def close(self) -> None:
        for pool in list(self._pools.values()):
            pool.clear()
        if self._executor is not None:
            self._executor.shutdown(wait=False)
            self._executor = None

    # ------------------------------------------------------------------ topology

    def ensure(self, force: bool = False) -> None:
        """Decide cluster mode on first use (INFO cluster); (re)load the slot map when needed."""
        if self._fresh(force):
            return
        seen = self._refreshed_at
        with self._topo_lock:
            if self._fresh(force) or (force and self._refreshed_at != seen):
                return  # another thread did it while we waited
            if self.cluster is None:
                self.cluster = self._detect()
                if not self.cluster:
                    return
            # The node that failed last is asked last: if it hangs, asking it first would cost timeout_s.
            candidates = sorted(dict.fromkeys(self.masters + self._seeds), key=lambda a: a == self._last_failed)
            last_error: Exception | None = None
            for addr in candidates:
                try:
                    reply = self.on_node(addr, lambda c: c.call("CLUSTER", "SLOTS"))
                except (OSError, RuntimeError) as e:
                    last_error = e
                    continue
                slots: list[Addr] = [addr] * 16384
                masters: dict[Addr, None] = {}
                for start, end, master, *_replicas in reply:
                    host = master[0].decode()
                    node = (addr[0] if host in ("", "?") else host, int(master[1]))
                    masters[node] = None
                    slots[start:end + 1] = [node] * (end - start + 1)
                self._slots, self.masters = slots, list(masters)
                self._stale_since, self._refreshed_at = None, time.monotonic()
                return
            if self._slots is None:
                raise last_error or ConnectionError("no cluster node answered CLUSTER SLOTS")

    def _detect(self) -> bool:
        """Cluster mode or not, asked of the first seed that answers."""
        error: Exception | None = None
        for addr in self._seeds:
            try:
                return b"cluster_enabled:1" in self.on_node(addr, lambda c: c.call("INFO", "cluster"))
            except OSError as e:
                error = error or e
        raise error  # type: ignore[misc]

    def _fresh(self, force: bool) -> bool:
        if self.cluster is False:
            return True
        return self.cluster is not None and self._slots is not None and not force and (
            self._stale_since is None or time.monotonic() - self._refreshed_at < 1.0)

    def node_of(self, rkey: bytes) -> Addr:
        slots = self._slots
        return slots[key_slot(rkey)] if slots else self._seeds[0]

    # ------------------------------------------------------------------ batches

    def batch(self, rkeys: Sequence[bytes], run: Run, failed: object, stripes: int = 1) -> list[object]:
        """Route ``rkeys`` to their nodes and ``run`` each node's share (in parallel threads when there
        are several), following MOVED / ASK redirects for a few rounds.  One reply per key.

        ``stripes`` > 1 splits a node's share over that many pooled connections, run in parallel
        (keys dealt round-robin, so each connection has one of every ``stripes`` blocks in flight).
        A node's share fails as a whole when any of its stripes fails."""
        self.ensure()
        results: dict[int, object] = {}
        lost: set[int] = set()
        todo: list[tuple[int, Addr | None]] = [(i, None) for i in range(len(rkeys))]
        errors: list[BaseException] = []
        for _round in range(4):
            groups: dict[Addr, list[int]] = defaultdict(list)
            asking: dict[Addr, set[int]] = defaultdict(set)
            slots = self._slots
            for i, ask in todo:
                addr = ask or (slots[key_slot(rkeys[i])] if slots else self._seeds[0])
                groups[addr].append(i)
                if ask:
                    asking[addr].add(i)
            todo, moved = [], False
            for addr, out in self._fan_out(groups, asking, run, stripes):
                if isinstance(out, BaseException):
                    errors.append(out)
                    lost.update(groups[addr])
                    continue
                for i, r in zip(groups[addr], out):
                    redirect = r.redirect() if isinstance(r, ReplyError) else None
                    if redirect is None:
                        results[i] = r
                    else:
                        moved |= redirect[0] == "MOVED"
                        todo.append((i, redirect[2] if redirect[0] == "ASK" else None))
            if not todo:
                break
            if moved:
                self.ensure(force=True)
        for i, _ in todo:
            results[i] = ReplyError("TRYAGAIN too many redirects")
        if errors:
            if len(lost) == len(rkeys):
                raise errors[0]
            self.partial_failures += 1
            if self.on_lost is not None:
                self.on_lost(len(lost))
            # The stack turns these into its 'unavailable' metric and a rate-limited warning.
            log.debug("redis backend %r: %d node(s) failed in a batch (%s); their %d keys are misses",
                        self._name, len(errors), errors[0], len(lost))
        return [failed if i in lost else results[i] for i in range(len(rkeys))]

    def _fan_out(self, groups: dict[Addr, list[int]], asking: dict[Addr, set[int]], run: Run,
                 stripes: int = 1) -> list[tuple[Addr, list[object] | BaseException]]:
        """``[(addr, replies aligned with groups[addr] | the exception)]``, one per node."""
        tasks = [(addr, j, idxs[j::stripes]) for addr, idxs in groups.items()
                 for j in range(max(1, min(stripes, len(idxs))))]

        def one(task: tuple[Addr, int, list[int]]) -> list[object] | Exception:
            addr, _, idxs = task
            try:
                return self.on_node(addr, lambda c: run(c, idxs, asking.get(addr, ())))
            except Exception as e:  # noqa: BLE001 - reported per node by batch()
                return e
        if len(tasks) == 1:
            outs = [one(tasks[0])]
        else:
            if self._executor is None:
                with self._pools_lock:
                    if self._executor is None:
                        self._executor = kvthreads.pool(16, "kvtier-redis")
            outs = list(self._executor.map(one, tasks))
        merged: dict[Addr, list[object] | BaseException] = {}
        for (addr, j, _), out in zip(tasks, outs):
            got = merged.setdefault(addr, [None] * len(groups[addr]))
            if isinstance(got, BaseException):
                continue
            if isinstance(out, BaseException):
                merged[addr] = out
            else:
                got[j::stripes] = out  # stripe j held positions j, j + stripes, ... of the node's share
        return list(merged.items())
