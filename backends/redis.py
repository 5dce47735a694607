"""``redis`` backend: blocks in Redis or Redis Cluster, one key per block holding header + payload.

The data path is kvtier's own RESP client (``kvtier.backends._resp``): pipelined SETs sent with
scatter-gather from the caller's buffers and GET replies received straight into them, so a get costs
one kernel copy per byte, as a raw socket loop does.  Each block is checksummed just before it is sent
and verified just after it arrived, so that work overlaps with the server draining / filling the socket
buffers instead of being a pass over the whole batch.  Routing, slot maps, redirects and partial
failures live in ``_router``.  redis-py is not used at run time (one client, one timeout model, one
place that sees the password; redis-py's MGET builds a bytes object per value and copies it again).

Invariants:
* One value per block, written by one SET: Redis replaces a key atomically, so a reader sees the old
  value, the new value or nothing, never a mix; header and payload can never be evicted separately.  A
  payload in segments (a grouped value, ``writes_segments``) is still one bulk string of one SET, its
  length stated up front and its bytes sent from the parts in order, never joined in memory.
* Every socket wait is bounded by ``timeout_s`` (connect, each send / receive without progress, a free
  pooled connection): a hung server fails a call after about ``timeout_s`` with TimeoutError
  (-> BackendTimeout), a dead one at once with ConnectionError (-> BackendUnavailable).  A batch that
  keeps making progress is not cut short, however large.
* A connection that failed is closed; a pooled connection that fails before any reply (the server
  restarted since) is retried once on a fresh one, so the first call after a restart succeeds.
* Cluster: keys are routed by hash slot; MOVED refreshes the slot map and ASK is followed once.  When
  some nodes of a batch fail and others answer, the failed nodes' keys are misses / failed puts and the
  rest succeed; when all fail, the call raises.
* A node that answers a new connection with another ``run_id`` than before has restarted since: it may
  have come back empty, even when no call failed in between (a restart between two calls), so the
  backend says so (``note_restarted``) and the stack writes again what it still holds.
* The password never appears in ``repr``, logs or exception messages: it is moved out of the URL into
  a ``SecretStr`` at validation time, and only ``Connection`` ever sends it.
* Quotas per ``cache_salt`` tenant (``kvtier.quota``): a writer with a quota records each tenant's blocks
  after its put, as block hashes in a sorted set ``<key_prefix>tenants/<namespace id>/<tenant tag>``
  scored by the put's time (in ms: ties of ``OBJECT IDLETIME``, which counts seconds, go oldest written
  first), and the tenant's tag in a set ``<key_prefix>tenants/<namespace id>``; a key, a value and the
  namespace are the same with or without a tenant.  A quota's trim removes the members of the blocks it
  deletes; a tenant's listing is its sorted set, less the members no longer stored (evicted, deleted
  otherwise, expired: removed as the listing finds them); a namespace's listing
  leaves out every block in one of its tenants' sets.  With ``ttl_s`` a set expires ``ttl_s`` after its last put.
  Neither is a block (no tool lists them); a set evicted by ``maxmemory`` makes its tenant's blocks
  count as the namespace's until they are written again, as does a record that failed after its put (the
  put stands; logged and counted in ``stats().tenants_unrecorded``, and counted as keys ``unavailable``
  only when a node did not answer, not when it refused a command).
"""

from __future__ import annotations

import logging
import ssl
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import Any, cast
from urllib.parse import quote, unquote, urlsplit

from pydantic import Field, SecretStr, model_validator

from kvtier.backend_api import BackendOptions, StorageBackend, StoredBlock
from kvtier.format.blockformat import Segments
from kvtier.keys import invalid_key
from kvtier.quota import Share

from ._redis_events import EvictionEvents, EvictionListener
from ._resp import (
    NODE_ERRORS,
    Buf,
    Connection,
    RedisNodeError,
    RedisReplyError,
    Reply,
    ReplyError,
    command,
    pipeline,
)
from ._router import Addr, Router

_ASKING = command("ASKING")
log = logging.getLogger("kvtier.backends.redis")


class RedisOptions(BackendOptions):
    """Options of the ``redis`` backend (YAML ``options:``)."""

    url: str = "redis://127.0.0.1:6379/0"
    """redis://[user[:password]@]host[:port][/db] or rediss:// for TLS.  A password found here is moved
    to ``password`` when the options are validated, so the stored URL never holds it."""
    password: SecretStr | None = None
    username: str | None = None
    cluster: bool | None = None
    """True / False, or None to ask the server (INFO cluster) on first use."""
    startup_nodes: list[str] = Field(default_factory=list)
    """More cluster seed nodes as "host:port", tried when the URL's node does not answer."""
    ttl_s: float | None = Field(default=None, gt=0)
    """Expire each block this long after it was written (SET ... PX); None keeps blocks until evicted."""
    connect_timeout_s: float | None = Field(default=None, gt=0)
    """Connect timeout; defaults to ``timeout_s``."""
    max_connections: int = Field(default=16, ge=1)
    """Per node; a call waits at most ``timeout_s`` for a free one."""
    key_prefix: str = "kvtier:"
    """Prepended to every Redis key, so kvtier shares a database safely; must contain no '{'."""
    tls_ca_file: str | None = None
    tls_cert_file: str | None = None
    tls_key_file: str | None = None
    tls_verify: bool = True
    eviction_events: EvictionEvents = EvictionEvents.AUTO
    """Listen for the keys Redis drops by itself (``maxmemory`` evictions, ``ttl_s`` expiry), so kvtier
    stops offering them as hits: ``auto`` switches the server's keyevent notifications on where they are
    off (``CONFIG SET notify-keyspace-events``, adding ``Eex``), ``listen`` only listens (configure the
    server yourself), ``off`` never subscribes.  One extra connection per master node."""
    window_bytes: int = Field(default=1 << 16, ge=1 << 16)
    """Bytes per pipelined window (at least one block); at most two windows are in flight per
    connection.  Small on purpose: what is in flight should fit the socket buffers, or the kernel
    queues, collapses and delivers it in the *server's* time (on loopback the receiver's ACKs push the
    sender's queue), and Redis, single-threaded, is what bounds a batch.  Measured on one local
    redis-server, 512 x 256 KiB on one connection: 8 MiB windows put 1.46 / get 2.53 GiB/s with Redis
    spending 0.67 / 0.37 CPU-s per GiB; 1 MiB windows 1.71 / 4.07 GiB/s at 0.57 / 0.22."""
    stripes: int = Field(default=4, ge=1, le=64)
    """Pooled connections a put / get batch is spread over, per node, in parallel (keys dealt
    round-robin; at most ``max_connections``).  Redis spends less of its one core per byte when a few
    connections each have a block or two in flight than when one connection streams a long pipeline
    (measured, 256 KiB blocks: 0.54 vs 0.58-0.64 CPU-s per GiB on puts), and framing / checksums on
    one connection's thread overlap the others' socket waits."""

    @model_validator(mode="after")
    def _split_password(self) -> RedisOptions:
        u = urlsplit(self.url)
        if u.scheme not in ("redis", "rediss"):
            raise ValueError(f"url must start with redis:// or rediss://, not {u.scheme!r}://")
        if not u.hostname:
            raise ValueError("url has no host")
        if u.query or u.fragment:
            raise ValueError("url query parameters are not supported; use options instead")
        db = u.path.strip("/")
        if db and not db.isdigit():
            raise ValueError("url path must be a database number")
        if u.password is not None:
            if self.password is not None:
                raise ValueError("password given both in url and in the password option")
            self.password = SecretStr(unquote(u.password))
        if u.username and self.username is None:
            self.username = unquote(u.username)
        host = f"[{u.hostname}]" if ":" in u.hostname else u.hostname
        user = f"{quote(self.username, safe='')}@" if self.username else ""
        self.url = f"{u.scheme}://{user}{host}:{u.port or 6379}/{db or 0}"
        if "{" in self.key_prefix:
            raise ValueError("key_prefix must not contain '{' (a hash tag would put every block in one slot)")
        if self.cluster and db not in ("", "0"):
            raise ValueError("Redis Cluster has only database 0; drop the /N from the url")
        for node in self.startup_nodes:
            _parse_addr(node)
        return self


class RedisBackend(StorageBackend):
    """Redis / Redis Cluster backend.  Thread-safe: each call takes its own pooled connection per node."""

    streams_verified = True  # _get_blocks reports each block as it verifies it (StorageBackend.get_into)
    reads_segments = True  # a payload may be Segments: its GET reply is received into the parts in order
    writes_segments = True  # and a SET's value is sent from the parts as they are (scatter-gather)

    Options = RedisOptions

    options: RedisOptions
    counts_tenants = True  # a sorted set of block hashes per tenant (see the module docstring)

    def __init__(self, options: RedisOptions | dict[str, Any] | None = None, *, name: str | None = None):
        super().__init__(options, name=name or "redis")
        o = self.options
        u = urlsplit(o.url)
        seed: Addr = (cast(str, u.hostname), u.port or 6379)  # the validated url always has a host
        self._db = int(u.path.strip("/") or 0)
        self._run_ids: dict[Addr, str] = {}  # per node, the run_id its last new connection reported
        self._run_ids_lock = threading.Lock()
        self._prefix = o.key_prefix.encode()
        self._tls = _tls_context(o) if u.scheme == "rediss" else None
        ms = None if o.ttl_s is None else b"%d" % max(1, round(o.ttl_s * 1000))
        self._set_tail = b"\r\n" if ms is None else b"\r\n$2\r\nPX\r\n$%d\r\n%s\r\n" % (len(ms), ms)
        self._set_argc = 3 if ms is None else 5
        self._router = Router(self._connect, [seed] + [_parse_addr(a) for a in o.startup_nodes],
                              o.cluster, o.max_connections, o.timeout_s, self.name)
        self._stripes = min(o.stripes, o.max_connections)
        self._router.on_lost = self.note_unavailable  # a node down: its keys are outage, not misses
        self._events = None if o.eviction_events is EvictionEvents.OFF else EvictionListener(
            self.name, o.eviction_events, 0 if o.cluster else self._db, self._prefix, self._masters,
            lambda addr: self._connect(addr, bool(self._router.cluster)), self._evicted)

    def _masters(self) -> list[Addr]:
        self._router.ensure()
        return list(self._router.masters)

    def __repr__(self) -> str:
        return f"RedisBackend(name={self.name!r}, url={self.options.url!r}, cluster={self._router.cluster})"

    def _connect(self, addr: Addr, cluster: bool) -> Connection:
        o = self.options
        conn = Connection(addr, timeout=o.timeout_s, connect_timeout=o.connect_timeout_s or o.timeout_s,
                          tls=self._tls, username=o.username,
                          password=o.password.get_secret_value() if o.password else None,
                          db=0 if cluster else self._db)
        self._check_run_id(conn)
        return conn

    def _check_run_id(self, conn: Connection) -> None:
        """Every new connection asks the node's ``run_id`` (one round trip, only when the pool grows or
        after a connection died): a pooled connection dies when its server restarts, so a restart is
        seen at the first call after it, whether or not a call failed meanwhile."""
        try:
            raw = conn.call("INFO", "server")
        except RedisReplyError:  # a proxy or managed Redis that refuses INFO: restarts go unnoticed here
            return
        run_id = _info(raw if isinstance(raw, bytes) else b"").get("run_id")
        if not run_id:
            return
        with self._run_ids_lock:
            before = self._run_ids.get(conn.addr)
            self._run_ids[conn.addr] = run_id
        if before is not None and before != run_id:
            log.warning("backend %r: redis %s:%d restarted (run_id %s -> %s): it may have come back empty",
                        self.name, conn.addr[0], conn.addr[1], before[:8], run_id[:8])
            self.note_restarted()

    def _rkeys(self, keys: Sequence[str]) -> list[bytes]:
        p = self._prefix
        return [p + k.encode() for k in keys]

    def _pipelined(self, rkeys: list[bytes], build: Callable[[int], tuple[list[Buf], int]],
                   read: Callable[[Connection, int], object], failed: object, stripes: int = 1) -> list[object]:
        """One pipelined command per key over the nodes that own the keys; replies in key order.
        ``stripes``: connections per node the keys are spread over (data path only)."""
        window = self.options.window_bytes

        def run(conn: Connection, idxs: list[int], asking: set[int] | tuple[()]) -> list[object]:
            if asking:
                def b(i: int) -> tuple[list[Buf], int]:
                    bufs, n = build(i)
                    return ([_ASKING, *bufs], n + 5) if i in asking else (bufs, n)

                def r(c: Connection, i: int) -> object:
                    if i in asking:
                        c.read_reply()
                    return read(c, i)
                return _checked(pipeline(conn, idxs, b, r, window), conn)
            return _checked(pipeline(conn, idxs, build, read, window), conn)
        return self._router.batch(rkeys, run, failed, stripes)

    def _simple(self, keys: Sequence[str], name: bytes, failed: object) -> list[object]:
        """A one-key command (EXISTS / UNLINK / GET) per key, pipelined."""
        rkeys = self._rkeys(keys)
        return self._pipelined(
            rkeys, lambda i: ([b"*2\r\n$%d\r\n%s\r\n$%d\r\n%s\r\n" % (len(name), name, len(rkeys[i]), rkeys[i])], 16),
            lambda c, i: c.read_reply(), failed)

    # ------------------------------------------------------------------ the data path

    def _set(self, keys: Sequence[str], value_of: Callable[[int], tuple[bytes, memoryview | Segments]]) -> list[bool]:
        """SET each key to ``value_of(i)`` (header, payload), built just before it is sent.  A payload in
        segments is one bulk string too: RESP states its whole length up front, and its bytes go out from
        the parts in order (``sendv``), never joined."""
        rkeys, argc, tail = self._rkeys(keys), self._set_argc, self._set_tail

        def build(i: int) -> tuple[list[Buf], int]:
            k, (header, payload) = rkeys[i], value_of(i)
            n = len(header) + payload.nbytes
            head = b"*%d\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (argc, len(k), k, n) + header
            parts: list[Buf] = [p for p in payload.parts if p.nbytes] if isinstance(payload, Segments) else (
                [payload] if payload.nbytes else [])
            return [head, *parts, tail], 5
        return [r == b"OK" for r in self._pipelined(rkeys, build, lambda c, i: c.read_reply(), False, self._stripes)]

    def _get(self, keys: Sequence[str], headers: Sequence[memoryview], payloads: Sequence[memoryview | Segments],
             on_value: Callable[[int, int, memoryview | None], None] | None = None,
             landing: Callable[[memoryview | Segments], memoryview | None] | None = None) -> list[int | None]:
        """GET each key into (header, payload); ``on_value(i, size, land)`` right after value ``i`` arrived,
        in the reading thread.  ``landing`` (``Seal.landing``): where a payload goes instead of ``payload``
        (mode encrypt: the ciphertext, decrypted from there by ``on_value``), passed on as ``land``."""
        rkeys = self._rkeys(keys)

        def build(i: int) -> tuple[list[Buf], int]:
            k = rkeys[i]
            return [b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k)], len(headers[i]) + payloads[i].nbytes + 16

        def read(c: Connection, i: int) -> int | ReplyError | None:
            h, p = headers[i], payloads[i]
            land = landing(p) if landing is not None else None
            size = c.read_bulk_into(h, p if land is None else land[:p.nbytes], len(b"$%d\r\n" % (len(h) + p.nbytes)))
            if on_value is not None and isinstance(size, int):
                on_value(i, size, land)
            return size
        return [r if isinstance(r, int) else None for r in self._pipelined(rkeys, build, read, None, self._stripes)]

    def _write(self, keys: Sequence[str], values: Sequence[tuple[bytes, memoryview | Segments]]) -> list[bool]:
        return self._set(keys, lambda i: (values[i][0], v if isinstance(v := values[i][1], Segments)
                                          else memoryview(v).cast("B")))

    def _read_into(self, keys: Sequence[str], headers: Sequence[memoryview],
                   payloads: Sequence[memoryview]) -> list[int | None]:
        return self._get(keys, headers, payloads)

    def _put_blocks(self, keys: Sequence[str], payloads: Sequence[memoryview | Segments],
                    layout_id: int) -> list[bool]:
        """Frame each block just before its SET is sent, not the whole batch up front: the server is
        still draining the socket buffer while the next checksum runs, and the payload is then in
        cache for the kernel's copy."""
        return self._set(keys, lambda i: self._frame(keys[i], payloads[i], layout_id))

    def _get_blocks(self, keys: Sequence[str], payloads: Sequence[memoryview], layout_id: int,
                    on_verified: Callable[[int], None] | None = None) -> list[bool | str]:
        """Verify each block right after it arrived (hot in cache), while the server keeps filling the
        socket buffer with the next ones; no verification pass over the whole batch at the end.  A
        verified block is reported at once (``on_verified``), still hot for the caller's copy."""
        headers = [memoryview(bytearray(self.header_size)) for _ in keys]
        results: list[bool | str] = [False] * len(keys)
        told = bytearray(len(keys))  # a key read again (a retried stripe) is reported once

        def on_value(i: int, size: int, land: memoryview | None) -> None:
            results[i] = self._verify(keys[i], size, headers[i], payloads[i], layout_id, None, land) or True
            if results[i] is True and on_verified is not None and not told[i]:
                told[i] = 1
                on_verified(i)
        # Mode encrypt: each ciphertext lands in the stripe thread's buffer and is decrypted from there
        # into the caller's buffer in one call (``Seal.landing``).
        landing = self.seal.landing if self.seal is not None else None
        sizes = self._get(keys, headers, payloads, on_value, landing)
        return [False if s is None else r for s, r in zip(sizes, results)]

    # ------------------------------------------------------------------ the rest of the contract

    def _exists(self, keys: Sequence[str]) -> list[bool]:
        return [r == 1 for r in self._simple(keys, b"EXISTS", 0)]

    def _delete(self, keys: Sequence[str]) -> int:
        n = sum(r for r in self._simple(keys, b"UNLINK", 0) if isinstance(r, int))
        trimmed: dict[Share, list[str]] = {}  # a quota's trim of a tenant's share: its records go too
        for k in keys:
            if (t := self._put_tenant(k)) is not None:
                trimmed.setdefault(Share(k.partition("/")[0], t), []).append(k.partition("/")[2])
        if trimmed:
            rkeys = [self._tenant_rkey(share) for share in trimmed]
            try:
                self._commands(rkeys, [("ZREM", rk, *hashes) for rk, hashes in zip(rkeys, trimmed.values())])
            except Exception as e:  # noqa: BLE001 - the blocks are gone: a stale member is dropped at the next count
                log.info("redis %r: dropping %d trimmed tenant record(s) failed (%s); the next count drops them",
                         self.name, sum(map(len, trimmed.values())), type(e).__name__)
        return n

    def _read_small(self, key: str) -> bytes | None:
        r = self._simple([key], b"GET", None)[0]
        return r if isinstance(r, bytes) else None

    def _scan(self, prefix: str) -> Iterator[StoredBlock]:
        """SCAN MATCH over every master, sizes by pipelined STRLEN; one page at a time, so no
        connection is held while the caller consumes."""
        self._router.ensure()
        pattern = _glob_escape(self._prefix + prefix.encode()) + b"*"
        cut = len(self._prefix)
        for addr in list(self._router.masters):
            cursor = b"0"
            while True:
                def page(c: Connection, cursor: bytes = cursor) -> tuple[bytes, list[tuple[bytes, Reply]]]:
                    nxt, found = c.call("SCAN", cursor, "MATCH", pattern, "COUNT", 1000)
                    c.sendv([command("STRLEN", k) for k in found])
                    return nxt, [(k, c.read_reply()) for k in found]
                cursor, found = self._router.on_node(addr, page)
                for k, size in found:
                    if isinstance(size, int) and size:  # 0: expired or deleted since SCAN saw it
                        yield StoredBlock(k[cut:].decode(errors="replace"), size)
                if cursor == b"0":
                    break

    def _namespace_blocks(self, namespace_id: str) -> list[StoredBlock]:
        """One namespace's blocks (its tenants' included), least recently used first."""
        return self._by_use(list(self.scan(namespace_id)))

    def _by_use(self, blocks: list[StoredBlock]) -> list[StoredBlock]:
        """``blocks``, least recently used first (``kvtier.quota``): OBJECT IDLETIME per key, pipelined; a
        server whose maxmemory-policy is LFU answers it with an error, and then the keys keep their order
        (as do keys idle for as many seconds)."""
        rkeys = self._rkeys([b.key for b in blocks])
        idle = self._pipelined(
            rkeys, lambda i: ([b"*3\r\n$6\r\nOBJECT\r\n$8\r\nIDLETIME\r\n$%d\r\n%s\r\n" % (len(rkeys[i]), rkeys[i])],
                              32),
            lambda c, i: c.read_reply(), None)
        order = [(-(t if isinstance(t, int) else 0), i) for i, t in enumerate(idle)]
        return [blocks[i] for _, i in sorted(order)]

    # ------------------------------------------------------------------ tenants (kvtier.quota)

    def _tenant_rkey(self, share: Share) -> bytes:
        """The set of a tenant share's block hashes; with no tenant, the set of the namespace's tenant tags."""
        tail = "" if share.tenant is None else f"/{share.tenant}"
        return self._prefix + f"tenants/{share.namespace}{tail}".encode()

    def _commands(self, rkeys: list[bytes], argvs: list[tuple[bytes | str | int, ...]]) -> list[object]:
        """One small command per entry, routed by its key ``rkeys[i]``, pipelined; replies in order (None:
        its node did not answer)."""
        return self._pipelined(rkeys, lambda i: ([command(*argvs[i])], 16), lambda c, i: c.read_reply(), None)

    def _members(self, rkey: bytes, written_order: bool = False) -> list[bytes]:
        """A tenant record's members: a namespace's tenant tags, or (``written_order``) a tenant's block
        hashes, oldest put first."""
        argv: tuple[bytes | str | int, ...] = ("ZRANGE", rkey, 0, -1) if written_order else ("SMEMBERS", rkey)
        reply = self._commands([rkey], [argv])[0]
        if not isinstance(reply, list):
            raise ConnectionError(f"redis: {argv[0]!r} of a tenant record answered {type(reply).__name__}")
        return [m for m in reply if isinstance(m, bytes)]

    def _record_tenants(self, stored: Mapping[Share, list[str]]) -> None:
        rkeys: list[bytes] = []
        argvs: list[tuple[bytes | str | int, ...]] = []
        ttl = self.options.ttl_s
        now = time.time_ns() // 1_000_000  # a score per put (ms): the order of a tenant's blocks by age
        for share, keys in stored.items():
            rk, tags = self._tenant_rkey(share), self._tenant_rkey(Share(share.namespace))
            rkeys += [rk, tags]
            scored = [x for k in keys for x in (now, k.partition("/")[2])]
            argvs += [("ZADD", rk, *scored), ("SADD", tags, str(share.tenant))]
            if ttl is not None:  # the record lives as long as the last block put under it
                rkeys.append(rk)
                argvs.append(("PEXPIRE", rk, max(1, round(ttl * 1000))))
        replies = self._commands(rkeys, argvs)
        if any(r is None for r in replies):  # a node did not answer (the router counted its keys unavailable)
            raise ConnectionError(f"redis: {sum(r is None for r in replies)} of {len(argvs)} tenant record "
                                  "commands unanswered")
        refused = [r for r in replies if not isinstance(r, int)]
        if refused:  # answered with an error (a renamed or refused command, OOM): no outage
            first = refused[0].kind if isinstance(refused[0], ReplyError) else type(refused[0]).__name__
            raise RuntimeError(f"redis: {len(refused)} of {len(argvs)} tenant record commands refused (first: "
                               f"{first}; the reply names keys, so it is not repeated here)")

    def _share_blocks(self, share: Share) -> list[StoredBlock]:
        """A tenant's blocks (its set's members still stored; the others are dropped from it), or a
        namespace's untenanted blocks (its listing less every tenant set's members), least recently used
        first."""
        ns = share.namespace
        if share.tenant is None:
            tagged: set[str] = set()
            for tag in self._members(self._tenant_rkey(share)):
                tenant = Share(ns, tag.decode(errors="replace"))
                tagged.update(f"{ns}/{h.decode(errors='replace')}" for h in self._members(self._tenant_rkey(tenant), True))
            return self._by_use([b for b in self.scan(ns) if b.key not in tagged])
        rk = self._tenant_rkey(share)
        keys = [f"{ns}/{h.decode(errors='replace')}" for h in self._members(rk, True)]
        keys = [k for k in keys if invalid_key([k]) is None]
        sizes = self._simple(keys, b"STRLEN", None) if keys else []  # (None: its node did not answer)
        gone = [k for k, n in zip(keys, sizes) if n == 0]
        if gone:  # stale members (evicted, deleted, expired, trimmed): the set shrinks as it is listed
            self._commands([rk], [("ZREM", rk, *(k.partition("/")[2] for k in gone))])
        return self._by_use([StoredBlock(k, n) for k, n in zip(keys, sizes) if isinstance(n, int) and n])

    def _tenant_records(self, namespace_id: str) -> dict[str, str]:
        """Every tenant set's members of the namespace (read only: stale members stay)."""
        out: dict[str, str] = {}
        for tag in self._members(self._tenant_rkey(Share(namespace_id))):
            tenant = tag.decode(errors="replace")
            for h in self._members(self._tenant_rkey(Share(namespace_id, tenant)), True):
                out[f"{namespace_id}/{h.decode(errors='replace')}"] = tenant
        return out

    def _usage(self) -> dict[str, int]:
        """Keys (all of the database, not only kvtier's) and used memory summed over the masters."""
        self._router.ensure()
        keys = used = cap = down = 0
        for addr in list(self._router.masters):
            try:
                keys += self._router.on_node(addr, lambda c: c.call("DBSIZE"))
                info = _info(self._router.on_node(addr, lambda c: c.call("INFO", "memory")))
            except OSError:
                down += 1
                continue
            used += int(info.get("used_memory", 0))
            cap += int(info.get("maxmemory", 0))
        out = {"keys": keys, "bytes": used, "nodes": len(self._router.masters), "nodes_down": down,
               "partial_failures": self._router.partial_failures}
        if cap:
            out["capacity_bytes"] = cap
        return out

    def _health(self) -> None:
        """Usable when at least one node answers PING (a degraded cluster still serves its other slots)."""
        self._router.ensure()
        errors = []
        for addr in list(self._router.masters):
            try:
                self._router.on_node(addr, lambda c: c.call("PING"))
                return
            except OSError as e:
                errors.append(e)
        raise errors[0]

    def _close(self) -> None:
        if self._events is not None:
            self._events.close()
        self._router.close()


# ---------------------------------------------------------------------- helpers


def _checked(replies: list[object], conn: Connection) -> list[object]:
    """Replies of a pipeline; raise if the node itself refused (loading, cluster down) - after reading
    every reply, so the connection is still in sync."""
    for r in replies:
        if isinstance(r, ReplyError) and r.kind in NODE_ERRORS:
            raise RedisNodeError(f"redis {conn.addr[0]}:{conn.addr[1]}: {r.message}")
    return replies


def _parse_addr(s: str) -> Addr:
    host, _, port = s.rpartition(":")
    if not host or not port.isdigit():
        raise ValueError(f"startup node {s!r}: expected host:port")
    return host.strip("[]"), int(port)


def _glob_escape(b: bytes) -> bytes:
    out = bytearray()
    for ch in b:
        if ch in b"*?[]\\":
            out += b"\\"
        out.append(ch)
    return bytes(out)


def _info(raw: bytes) -> dict[str, str]:
    out = {}
    for line in raw.decode(errors="replace").splitlines():
        k, sep, v = line.partition(":")
        if sep and not k.startswith("#"):
            out[k] = v.strip()
    return out


def _tls_context(o: RedisOptions) -> ssl.SSLContext:
    ctx = ssl.create_default_context(cafile=o.tls_ca_file)
    if o.tls_cert_file:
        ctx.load_cert_chain(o.tls_cert_file, o.tls_key_file)
    if not o.tls_verify:
        ctx.check_hostname = False
        ctx.verify_mode = ssl.CERT_NONE
    return ctx
