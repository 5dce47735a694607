"""What Redis evicts (``maxmemory``) or expires (``ttl_s``) on its own, told to the backend's owner.

Redis drops keys by itself when it reaches ``maxmemory`` under an ``allkeys-*`` policy, and when a key's
TTL ends.  Nobody asks kvtier first, so without this the stack and vLLM's scheduler would keep offering
those blocks as hits whose load then fails (a real-vLLM soak against a full Redis: 27-40 failed blocks
a run).  Redis publishes such drops as keyevent notifications (``__keyevent@<db>__:evicted`` /
``expired``) when ``notify-keyspace-events`` enables them: one subscriber thread per master node (a
cluster node publishes only its own keys) turns them into ``StorageBackend._evicted(keys)`` calls.
Deletes by other clients (``kvtier verify --fix`` in another process, an operator's ``DEL``) are the same
news for the owner: ``__keyevent@<db>__:del`` too, where the server publishes generic commands' events
(flag ``g``; switched on with the others in ``auto`` mode, optional in ``listen`` mode).

Invariants:

* **Never in the data path.**  The listener has its own connection per node; a failure there (node
  down, notifications refused) is logged and retried with back-off, and costs only the hints it would
  have corrected.
* **Only kvtier's keys.**  A key outside ``key_prefix`` (another application's data) is not passed on;
  what is not a block key (a manifest) the owner drops (``TierManager._backend_evicted``).
* **Batched.**  The keys of the notifications already received are passed on together, once the socket
  has nothing more to read (a full Redis evicts on every SET).
"""

from __future__ import annotations

import contextlib
import enum
import logging
import select
import socket
import threading
from collections.abc import Callable, Sequence

from ._resp import Connection, RedisReplyError, command

log = logging.getLogger("kvtier.backends.redis")

Addr = tuple[str, int]
_WANTED = "Eex"  # keyevent channel, evicted, expired: needed
_DELETES = "g"  # generic commands' events (del): wanted, not needed


class EvictionEvents(str, enum.Enum):
    """``options.eviction_events``: whether the backend listens for the keys Redis drops by itself."""

    AUTO = "auto"  # listen; switch the notifications on (CONFIG SET) where the server has them off
    LISTEN = "listen"  # listen; never change the server's configuration
    OFF = "off"


def _with_flags(current: str, deletes: bool = True) -> str | None:
    """``notify-keyspace-events`` value that also publishes evicted / expired (and with ``deletes``, del)
    keyevents; None when the current one does already ("A" is every class of events, "e" evicted, "x"
    expired, "g" generic commands such as DEL)."""
    has = set(current)
    need = {"e", "x", "g"} if deletes else {"e", "x"}
    if "E" in has and ("A" in has or need <= has):
        return None
    return "".join(sorted(has | {"E"} | need))


class EvictionListener:
    """Subscribes to every master node's evicted / expired keyevents; calls ``tell(keys)`` with kvtier's
    keys (``key_prefix`` removed).  ``nodes()`` gives the master addresses (asked again at every
    reconnect, so a cluster's new topology is picked up); ``connect(addr)`` opens a connection."""

    def __init__(self, name: str, mode: EvictionEvents, db: int, prefix: bytes,
                 nodes: Callable[[], Sequence[Addr]], connect: Callable[[Addr], Connection],
                 tell: Callable[[list[str]], None], *, poll_s: float = 0.5, retry_s: float = 1.0):
        self.name, self.mode, self.prefix = name, mode, prefix
        self._channels = [f"__keyevent@{db}__:evicted", f"__keyevent@{db}__:expired", f"__keyevent@{db}__:del"]
        self._nodes, self._connect, self._tell = nodes, connect, tell
        self._poll_s, self._retry_s = poll_s, retry_s
        self._stop = threading.Event()
        self._threads: dict[Addr, threading.Thread] = {}
        self._conns: dict[Addr, Connection] = {}
        self._lock = threading.Lock()
        self._warned: set[Addr] = set()
        self.subscribed = threading.Event()  # set once a node's subscription is confirmed (for tests)
        self.subscribed_nodes: set[Addr] = set()
        self._watcher = threading.Thread(target=self._watch, name=f"kvtier-{name}-evictions", daemon=True)
        self._watcher.start()

    def close(self) -> None:
        self._stop.set()
        with self._lock:
            for conn in self._conns.values():
                with contextlib.suppress(OSError):  # wakes the thread waiting in select() at once
                    conn.sock.shutdown(socket.SHUT_RDWR)
                conn.close()
        for t in [self._watcher, *self._threads.values()]:
            if t is not threading.current_thread():
                t.join(timeout=5)

    # ------------------------------------------------------------------ one thread per master node

    def _watch(self) -> None:
        """Start a subscriber per master node, and again for nodes that appear (cluster changes)."""
        while not self._stop.is_set():
            try:
                for addr in self._nodes():
                    t = self._threads.get(addr)
                    if t is None or not t.is_alive():
                        t = threading.Thread(target=self._run, args=(addr,), daemon=True,
                                             name=f"kvtier-{self.name}-evictions-{addr[0]}:{addr[1]}")
                        self._threads[addr] = t
                        t.start()
            except Exception as e:  # noqa: BLE001 - the node list comes from the server: it may be down
                log.debug("redis %r: eviction listener: cannot list nodes: %s", self.name, e)
            self._stop.wait(self._retry_s * 10)

    def _run(self, addr: Addr) -> None:
        while not self._stop.is_set():
            try:
                self._listen(addr)
            except Exception as e:  # noqa: BLE001 - retried: only hints are lost meanwhile
                if not self._stop.is_set():
                    log.debug("redis %r: eviction listener on %s:%d: %s (retrying)", self.name, *addr, e)
            finally:
                with self._lock:
                    conn = self._conns.pop(addr, None)
                if conn is not None:
                    conn.close()
            self._stop.wait(self._retry_s)

    def _listen(self, addr: Addr) -> None:
        conn = self._connect(addr)
        with self._lock:
            if self._stop.is_set():
                conn.close()
                return
            self._conns[addr] = conn
        if not self._enable(conn, addr):
            self._stop.wait(self._retry_s * 30)  # asked again later: an operator may switch them on
            return
        conn.sendv([command("SUBSCRIBE", *self._channels)])
        keys: list[str] = []
        while not self._stop.is_set():
            if conn._r == conn._w:  # nothing buffered: pass on what came, then wait for the socket
                if keys:
                    self._pass_on(keys)
                    keys = []
                if not select.select([conn.sock], [], [], self._poll_s)[0]:
                    continue
            msg = conn.read_reply()
            if not isinstance(msg, list) or len(msg) != 3:
                raise ConnectionError(f"unexpected message {str(msg)[:80]}")
            kind, _, data = msg
            if kind == b"subscribe":
                self.subscribed_nodes.add(addr)
                self.subscribed.set()
            elif kind == b"message" and isinstance(data, bytes) and data.startswith(self.prefix):
                keys.append(data[len(self.prefix):].decode(errors="replace"))

    def _enable(self, conn: Connection, addr: Addr) -> bool:
        """Whether the node publishes the events (switched on first in ``auto`` mode where allowed)."""
        try:
            got = conn.call("CONFIG", "GET", "notify-keyspace-events")
        except RedisReplyError:
            return True  # CONFIG refused (a managed Redis): listen, and trust the operator's settings
        current = got[1].decode() if isinstance(got, list) and len(got) == 2 and isinstance(got[1], bytes) else ""
        want = _with_flags(current)
        if want is None:
            return True
        if self.mode is EvictionEvents.AUTO:
            try:
                conn.call("CONFIG", "SET", "notify-keyspace-events", want)
                log.info("redis %r: %s:%d now publishes the keys it evicts or expires (notify-keyspace-events "
                         "%s)", self.name, *addr, want)
                return True
            except RedisReplyError:
                pass
        if _with_flags(current, deletes=False) is None:
            if addr not in self._warned:  # evictions and expiries heard; other clients' deletes are not
                self._warned.add(addr)
                log.info("redis %r: %s:%d publishes evicted / expired keys but not deletes (add 'g' to "
                         "notify-keyspace-events): a block another client deletes stays a hint until a load "
                         "finds it gone", self.name, *addr)
            return True
        if addr not in self._warned:
            self._warned.add(addr)
            log.warning("redis %r: %s:%d does not publish the keys it evicts or expires (set "
                        "notify-keyspace-events to include 'Eex'): blocks it drops stay hints until a "
                        "load finds them gone", self.name, *addr)
        return False

    def _pass_on(self, keys: list[str]) -> None:
        with contextlib.suppress(Exception):  # _evicted logs a listener's failure itself
            self._tell(keys)


__all__ = ["EvictionEvents", "EvictionListener"]
