"""A small RESP2 client built for moving large values without copies.

Why our own client: redis-py builds a ``bytes`` object per value and copies it again into the caller's
buffer, which caps reads of 2 MiB values at a fraction of what the socket can do.  Here SET commands go
out with ``socket.sendmsg`` over memoryviews of the caller's header and payload (no concatenation), and
GET replies are received with ``recv_into`` straight into the caller's header and payload buffers.  The
same connection type serves the control plane (CLUSTER SLOTS, SCAN, INFO, AUTH), so there is one
timeout model, one reconnect model and one place that ever sees the password.

Invariants:
* A ``Connection`` is used by one thread at a time (the ``Pool`` hands it out exclusively).
* After any exception a connection's protocol state is unknown: the pool closes it, never reuses it.
* Every blocking socket operation waits at most ``timeout`` seconds for progress.  Plain TCP sockets stay
  in blocking mode with kernel timeouts (SO_RCVTIMEO / SO_SNDTIMEO): Python's own timeout mode would add
  a poll() before every recv and send; an expired kernel timeout surfaces as ``NoProgress``, a
  TimeoutError.  TLS sockets use ``settimeout``.
* Error replies are returned as ``ReplyError`` values inside pipelines, never raised mid-pipeline, so the
  connection stays in sync with the server.
* No message built here contains a password.
"""

from __future__ import annotations

import binascii
import contextlib
import socket
import ssl
import struct
import threading
from collections.abc import Callable, Iterator, Sequence
from typing import Any, TypeAlias, TypeVar

from kvtier.format.blockformat import Segments

CRLF = b"\r\n"
_SEND_CHUNK_BYTES = 64 << 20  # bytes handed to one sendmsg call
_SEND_CHUNK_BUFS = 512        # below IOV_MAX (1024) on Linux
_IOV_BATCH = 1024  # buffers handed to one recvmsg_into call (Linux's IOV_MAX)
_BUF_SIZE = 256 << 10

# Replies that mean "this node cannot serve now" rather than "this key failed".
NODE_ERRORS = ("LOADING", "CLUSTERDOWN", "TRYAGAIN", "MASTERDOWN", "BUSY", "NOAUTH", "NOPERM")


class ReplyError:
    """An error reply (``-ERR ...``), kept as a value so a pipeline can go on reading."""

    __slots__ = ("message",)

    def __init__(self, message: str):
        self.message = message

    @property
    def kind(self) -> str:
        return self.message.split(" ", 1)[0]

    def redirect(self) -> tuple[str, int, tuple[str, int]] | None:
        """("MOVED"|"ASK", slot, (host, port)) for a cluster redirect, else None."""
        parts = self.message.split()
        if len(parts) == 3 and parts[0] in ("MOVED", "ASK"):
            host, _, port = parts[2].rpartition(":")
            return parts[0], int(parts[1]), (host, int(port))
        return None

    def __repr__(self) -> str:
        return f"ReplyError({self.message!r})"


# One RESP2 reply as ``Connection.read_reply`` returns it (simple strings as bytes, nil as None).
Reply: TypeAlias = "bytes | int | list[Reply] | None | ReplyError"
# A buffer handed to ``Connection.sendv`` (a command's framing, or a view of the caller's value).
Buf: TypeAlias = bytes | memoryview
_T = TypeVar("_T")
_R = TypeVar("_R")


class RedisReplyError(Exception):
    """A command the caller needed failed with an error reply."""


class RedisNodeError(ConnectionError):
    """A node answered, but cannot serve (loading, cluster down, ...): treated as unavailable."""


class NoProgress(TimeoutError):
    """The server sent or accepted nothing for ``timeout`` seconds."""


class RedisAuthError(ConnectionError):
    """The server rejected the credentials (the message never contains them)."""


def command(*args: bytes | str | int) -> bytes:
    """Encode one small command (control plane; values go through ``Connection.sendv``)."""
    out = [b"*%d\r\n" % len(args)]
    for a in args:
        b = a if isinstance(a, bytes) else str(a).encode()
        out.append(b"$%d\r\n%s\r\n" % (len(b), b))
    return b"".join(out)


def key_slot(key: bytes) -> int:
    """Redis Cluster hash slot: CRC16/XMODEM (``binascii.crc_hqx``, in C) of the key or its {hash tag}."""
    start = key.find(b"{")
    if start >= 0:
        end = key.find(b"}", start + 1)
        if end > start + 1:
            key = key[start + 1:end]
    return binascii.crc_hqx(key, 0) & 16383


class Connection:
    """One socket to one Redis node, authenticated and with a database selected."""

    def __init__(self, addr: tuple[str, int], *, timeout: float, connect_timeout: float,
                 tls: ssl.SSLContext | None = None, server_hostname: str | None = None,
                 username: str | None = None, password: str | None = None, db: int = 0):
        self.addr = addr
        where = f"redis {addr[0]}:{addr[1]}"
        try:
            sock = socket.create_connection(addr, timeout=connect_timeout)
        except TimeoutError as e:
            raise TimeoutError(f"{where}: connect timed out after {connect_timeout}s") from e
        except OSError as e:
            raise ConnectionError(f"{where}: cannot connect: {e.strerror or e}") from e
        try:
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            if tls is not None:
                sock = tls.wrap_socket(sock, server_hostname=server_hostname or addr[0])
                sock.settimeout(timeout)
            else:
                sock.settimeout(None)
                t = max(timeout, 0.001)  # a zero kernel timeout would mean "wait forever"
                tv = struct.pack("ll", int(t), int((t % 1) * 1e6))
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_RCVTIMEO, tv)
                sock.setsockopt(socket.SOL_SOCKET, socket.SO_SNDTIMEO, tv)
        except BaseException:
            sock.close()
            raise
        self.sock = sock
        self.tls = tls is not None
        self._buf = bytearray(_BUF_SIZE)
        self._mv = memoryview(self._buf)
        self._r = self._w = 0
        self._crlf = False  # the CRLF after the last bulk value read by read_bulk_into is still unread
        self.closed = False
        try:
            self._handshake(where, username, password, db)
        except BaseException:
            self.close()
            raise

    def _handshake(self, where: str, username: str | None, password: str | None, db: int) -> None:
        cmds = []
        if password is not None:
            cmds.append(command("AUTH", username, password) if username else command("AUTH", password))
        if db:
            cmds.append(command("SELECT", db))
        cmds.append(command("PING"))
        self.sock.sendall(b"".join(cmds))
        replies = [self.read_reply() for _ in cmds]
        for r in replies:
            if isinstance(r, ReplyError):
                if r.kind in ("WRONGPASS", "NOAUTH", "NOPERM") or "AUTH" in r.message:
                    raise RedisAuthError(f"{where} rejected the connection: {r.message}")
                raise RedisReplyError(f"{where}: {r.message}")

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            with contextlib.suppress(OSError):
                self.sock.close()

    # ------------------------------------------------------------------ sending

    def sendv(self, bufs: list[Buf]) -> None:
        """Send every buffer in order without joining them (sendmsg scatter-gather; TLS: sendall each)."""
        sock = self.sock
        if self.tls:  # SSLSocket has no sendmsg
            for b in bufs:
                sock.sendall(b)
            return
        i, n = 0, len(bufs)
        while i < n:
            j, size = i, 0
            while j < n and j - i < _SEND_CHUNK_BUFS and size < _SEND_CHUNK_BYTES:
                size += len(bufs[j])
                j += 1
            sent = sock.sendmsg(bufs[i:j])
            while sent:  # advance past what went out; a short send leaves a tail of bufs[i]
                ln = len(bufs[i])
                if sent >= ln:
                    sent -= ln
                    i += 1
                else:
                    bufs[i] = memoryview(bufs[i])[sent:]
                    sent = 0

    # ------------------------------------------------------------------ receiving

    def _fill(self, limit: int = _BUF_SIZE) -> None:
        """Receive at most ``limit`` more bytes into the read buffer (at least one)."""
        if self._r == self._w:
            self._r = self._w = 0
        elif self._w + limit > len(self._buf):
            self._buf[: self._w - self._r] = self._mv[self._r:self._w]
            self._w -= self._r
            self._r = 0
        room = min(limit, len(self._buf) - self._w)
        if not room:
            raise ConnectionError(f"redis {self.addr[0]}:{self.addr[1]}: reply line longer than {_BUF_SIZE} bytes")
        n = self.sock.recv_into(self._mv[self._w:self._w + room])
        if not n:
            raise ConnectionError(f"redis {self.addr[0]}:{self.addr[1]}: connection closed by server")
        self._w += n

    def _line(self, hint: int = _BUF_SIZE) -> bytes:
        if self._crlf:  # fetched together with the next line: one recv instead of two
            while self._w - self._r < 2:
                self._fill(hint + 2)
            if self._mv[self._r:self._r + 2] != CRLF:
                raise ConnectionError(f"redis {self.addr[0]}:{self.addr[1]}: protocol error after a value")
            self._r += 2
            self._crlf = False
        while True:
            i = self._buf.find(CRLF, self._r, self._w)
            if i >= 0:
                line = bytes(self._mv[self._r:i])
                self._r = i + 2
                return line
            self._fill(hint)

    def _into(self, mv: memoryview) -> None:
        """Fill ``mv`` exactly: first from the read buffer, then straight from the socket."""
        n = len(mv)
        got = min(self._w - self._r, n)
        if got:
            mv[:got] = self._mv[self._r:self._r + got]
            self._r += got
        recv_into = self.sock.recv_into
        while got < n:
            k = recv_into(mv[got:])
            if not k:
                raise ConnectionError(f"redis {self.addr[0]}:{self.addr[1]}: connection closed by server")
            got += k

    def _into2(self, a: memoryview, b: memoryview) -> None:
        """Fill ``a`` then ``b`` from the socket with scatter reads (the read buffer is empty)."""
        k = self.sock.recvmsg_into([a, b])[0]
        if not k:
            raise ConnectionError(f"redis {self.addr[0]}:{self.addr[1]}: connection closed by server")
        if k < len(a):
            self._into(a[k:])
            k = len(a)
        self._into(b[k - len(a):])

    def _skip(self, n: int) -> None:
        scratch = memoryview(bytearray(min(n, 1 << 20)))
        while n:
            k = min(n, len(scratch))
            self._into(scratch[:k])
            n -= k

    def _into_parts(self, views: list[memoryview]) -> None:
        """Fill ``views`` in order (a payload in segments): one scatter read per syscall where the read
        buffer is empty and the socket takes them (not TLS), else one view at a time."""
        views = [v for v in views if len(v)]
        while views and self._r < self._w:  # first what the read buffer already holds
            got = min(self._w - self._r, len(views[0]))
            views[0][:got] = self._mv[self._r:self._r + got]
            self._r += got
            views[0] = views[0][got:]
            if not len(views[0]):
                views.pop(0)
        if self.tls:  # an SSL socket has no recvmsg_into
            for v in views:
                self._into(v)
            return
        while views:
            k = self.sock.recvmsg_into(views[:_IOV_BATCH])[0]
            if not k:
                raise ConnectionError(f"redis {self.addr[0]}:{self.addr[1]}: connection closed by server")
            while views and k >= len(views[0]):
                k -= len(views[0])
                views.pop(0)
            if k:
                views[0] = views[0][k:]

    def read_bulk_into(self, header: memoryview, payload: memoryview | Segments,
                       hint: int = 64) -> int | ReplyError | None:
        """Read one GET reply into ``header`` then ``payload`` (a buffer, or segments: its parts in
        order).  Returns the value's length (bytes past the buffers are read and dropped), None for nil,
        or a ReplyError.  ``hint`` is how many bytes to ask the socket for when looking for the reply
        line: the expected line length, so a reply is normally not pre-read into the internal buffer and
        then copied."""
        line = self._line(hint)
        t = line[:1]
        if t != b"$":
            if t == b"-":
                return ReplyError(line[1:].decode(errors="replace"))
            raise ConnectionError(f"redis {self.addr[0]}:{self.addr[1]}: unexpected reply to GET: {line[:40]!r}")
        size = int(line[1:])
        if size < 0:
            return None
        h = min(size, len(header))
        if isinstance(payload, Segments):
            p = min(size - h, payload.nbytes)
            self._into_parts([header[:h], *payload.head(p)])
            if size - h - p:
                self._skip(size - h - p)
            self._crlf = True
            return size
        p = min(size - h, len(payload))
        if p and not self.tls and self._r == self._w:  # the usual case: one syscall fills both
            self._into2(header[:h], payload[:p])
        else:
            self._into(header[:h])
            if p:
                self._into(payload[:p])
        if size - h - p:
            self._skip(size - h - p)
        self._crlf = True
        return size

    def read_reply(self) -> Reply:
        """One reply of any type: bytes / int / list / None / ReplyError (simple strings as bytes)."""
        line = self._line()
        t, rest = line[:1], line[1:]
        if t == b"+":
            return rest
        if t == b":":
            return int(rest)
        if t == b"$":
            n = int(rest)
            if n < 0:
                return None
            buf = bytearray(n)
            self._into(memoryview(buf))
            self._skip(2)
            return bytes(buf)
        if t == b"*":
            n = int(rest)
            return None if n < 0 else [self.read_reply() for _ in range(n)]
        if t == b"-":
            return ReplyError(rest.decode(errors="replace"))
        raise ConnectionError(f"redis {self.addr[0]}:{self.addr[1]}: bad reply line {line[:40]!r}")

    def call(self, *args: bytes | str | int) -> Any:
        """Send one command and return its reply, raising on an error reply.  Typed ``Any``: which
        ``Reply`` comes back depends on the command, which the caller knows."""
        self.sock.sendall(command(*args))
        r = self.read_reply()
        if isinstance(r, ReplyError):
            if r.kind in NODE_ERRORS:
                raise RedisNodeError(f"redis {self.addr[0]}:{self.addr[1]}: {r.message}")
            raise RedisReplyError(f"redis {self.addr[0]}:{self.addr[1]}: {args[0]!s}: {r.message}")
        return r


class Pool:
    """Idle connections to one node, at most ``max_connections`` in use at once.

    ``clear()`` (after a server restart) closes the idle ones and bumps a generation, so connections
    handed out before it are closed when they come back instead of being reused."""

    def __init__(self, factory: Callable[[tuple[str, int]], Connection], addr: tuple[str, int],
                 max_connections: int, wait_s: float):
        self._factory, self.addr, self._wait_s = factory, addr, wait_s
        self._idle: list[Connection] = []
        self._lock = threading.Lock()
        self._slots = threading.BoundedSemaphore(max_connections)
        self._gen = 0

    @contextlib.contextmanager
    def connection(self) -> Iterator[tuple[Connection, bool]]:
        """Yield ``(conn, fresh)``; on any exception the connection is closed, never pooled."""
        if not self._slots.acquire(timeout=self._wait_s):
            raise TimeoutError(f"redis {self.addr[0]}:{self.addr[1]}: no free connection within "
                               f"{self._wait_s}s (max_connections in use)")
        try:
            with self._lock:
                conn, gen = (self._idle.pop() if self._idle else None), self._gen
            fresh = conn is None
            if conn is None:
                conn = self._factory(self.addr)
            try:
                yield conn, fresh
            except BaseException:
                conn.close()
                raise
            with self._lock:
                if gen == self._gen and not conn.closed:
                    self._idle.append(conn)
                    conn = None
            if conn is not None:
                conn.close()
        finally:
            self._slots.release()

    def clear(self) -> None:
        with self._lock:
            idle, self._idle = self._idle, []
            self._gen += 1
        for c in idle:
            c.close()


def pipeline(conn: Connection, items: Sequence[_T], build: Callable[[_T], tuple[list[Buf], int]],
             read: Callable[[Connection, _T], _R], window_bytes: int) -> list[_R]:
    """Send the commands of ``items`` and read one reply each, keeping about ``window_bytes`` in flight.

    ``build(item) -> (list of buffers, expected reply bytes)`` is called lazily, window by window, so a
    caller can still be preparing later items (checksums) while earlier ones are on the wire;
    ``read(conn, item) -> result``.  Window k+1 is sent before window k's replies are read, so the server
    never waits for the client between windows, and neither side buffers more than about two windows."""
    n = len(items)
    pos = 0

    def window() -> tuple[list[Buf], int, int]:
        nonlocal pos
        lo, size, bufs = pos, 0, []
        while pos < n and (size < window_bytes or pos == lo):
            b, reply = build(items[pos])
            bufs.extend(b)
            size += reply + sum(len(x) for x in b)
            pos += 1
        return bufs, lo, pos

    out: list[_R] = []
    bufs, lo, hi = window()
    if hi > lo:
        conn.sendv(bufs)
    while hi > lo:
        bufs, nlo, nhi = window()
        if nhi > nlo:
            conn.sendv(bufs)
        out.extend(read(conn, items[j]) for j in range(lo, hi))
        lo, hi = nlo, nhi
    return out
