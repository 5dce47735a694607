"""``redis`` put / get throughput beside the Redis wire ceiling, on the same payloads, same server.

The ceiling is the faster of two raw-socket loops (no framing, no checksums, no routing), timed in the
same rounds as the backend:

* ``Wire``, one connection: ``SET`` / ``GET`` commands pipelined one window ahead (1 MiB: window k+1 is
  sent before window k's replies are read), sent with scatter-gather ``sendmsg`` from the payloads (no
  concatenation), each value received straight into its buffer with ``recv_into`` (the previous CRLF
  and the reply line with one exact-length ``recv_into``);
* ``WireThreads``, four connections on four threads, one command in flight on each: LMCache's
  ``resp://`` client does this (in C++, eight connections), and on a loaded machine it can win.

Measured on loopback (one redis-server, 2 cores): Redis is single-threaded and is what bounds a batch,
and how much of its core a byte costs depends on the client.  Keeping more in flight than the socket
buffers hold (the old ceiling sent a whole 64 MiB batch of SETs at once) makes the kernel deliver the
client's queue in Redis's time: 512 x 256 KiB, 8 MiB windows 1.46 / 2.53 GiB/s put / get (Redis 0.67 /
0.37 CPU-s per GiB), 1 MiB windows 1.71 / 4.07 (0.57 / 0.22).  LMCache 0.5.6 beat the old ceiling; if a
peer (``kvtier bench peers``) beats this one, the ceiling is wrong again.  The backend additionally frames
and checksums every block, verifies every field and the checksum on read, and routes by key: that is the
overhead the ratio measures.  redis-py (pipeline SET / MGET, no copy into the caller's buffers) is
measured too, for context only.

The server is started here (``redis-server``, no persistence), so the figures are loopback figures; the
Redis server process and the client share the machine's cores.  Every contender runs in every round, in
a rotating order (flush, put, get its own blocks); the first round is a warm-up; medians.
"""

from __future__ import annotations

import argparse
import os
import socket
import statistics
import threading
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import TYPE_CHECKING, Any

import numpy as np

if TYPE_CHECKING:
    from kvtier.testing.redis_server import RedisServer

HELP = "redis put/get GiB/s beside the raw RESP wire loop (same as `bench backends --backends redis`)"
BATCH_BYTES = 64 << 20  # bytes per put/get_into call: a long prompt's worth of blocks


def add_arguments(p: argparse.ArgumentParser) -> None:
    from .backends import add_arguments as common

    common(p)


def run(args: argparse.Namespace) -> int:
    from .backends import run as run_all

    args.backends = "redis"
    return run_all(args)


def run_cases(block_sizes: list[int], total_bytes: int, repeats: int) -> list[dict[str, Any]]:
    from kvtier.testing.redis_server import redis_available, start_redis

    why = redis_available()
    if why:
        raise RuntimeError(why)
    srv = start_redis()
    try:
        return [row for block in block_sizes for row in _case(srv, block, total_bytes, repeats)]
    finally:
        srv.cleanup()


def _payloads(n: int, block: int) -> tuple[np.ndarray, list[memoryview]]:
    raw = np.random.default_rng(int.from_bytes(os.urandom(4), "little")).integers(
        0, 256, n * block, dtype=np.uint8)
    mv = raw.data
    return raw, [mv[i * block:(i + 1) * block] for i in range(n)]


class Wire:
    """The ceiling's single-connection loop: raw RESP over one socket, values received with recv_into.

    Commands go out one window ahead (``window`` bytes of commands + expected replies, at least one
    block): window k+1 is sent before window k's replies are read, as the backend does, with the
    same scatter-gather sends and exact-length receives and none of its framing, checksums or routing."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.small = memoryview(bytearray(64))
        self.crlf = 0  # bytes of the last value's CRLF still unread

    def _recv_exact(self, mv: memoryview) -> None:
        got, n = 0, len(mv)
        while got < n:
            k = self.sock.recv_into(mv[got:])
            if not k:
                raise ConnectionError("redis closed the connection")
            got += k

    def _sendv(self, parts: list[bytes | memoryview]) -> None:
        i = 0
        while i < len(parts):  # scatter-gather, up to 510 buffers per call
            sent = self.sock.sendmsg(parts[i:i + 510])
            while sent:
                if sent >= len(parts[i]):
                    sent -= len(parts[i])
                    i += 1
                else:
                    parts[i] = memoryview(parts[i])[sent:]
                    sent = 0

    @staticmethod
    def _windows(n: int, block: int, window: int | None) -> list[tuple[int, int]]:
        per = n if window is None else max(1, window // (block + 64))
        return [(i, min(n, i + per)) for i in range(0, n, per)]

    def put(self, keys: list[bytes], payloads: list[memoryview], window: int | None = 1 << 20) -> None:
        wins = self._windows(len(keys), len(payloads[0]) if payloads else 0, window)

        def send(lo: int, hi: int) -> None:
            parts: list[bytes | memoryview] = []
            for k, p in zip(keys[lo:hi], payloads[lo:hi]):
                parts += [b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(k), k, len(p)), p, b"\r\n"]
            self._sendv(parts)

        replies = memoryview(bytearray(5 * len(keys)))
        if wins:
            send(*wins[0])
        for w, (lo, hi) in enumerate(wins):
            if w + 1 < len(wins):
                send(*wins[w + 1])  # the next window goes out before this one's replies are read
            self._recv_exact(replies[5 * lo:5 * hi])
        if len(keys) and bytes(replies[:5]) != b"+OK\r\n":
            raise RuntimeError(f"SET failed: {bytes(replies[:64])!r}")

    def get(self, keys: list[bytes], bufs: list[memoryview], window: int | None = 1 << 20) -> None:
        """GET ``keys`` into ``bufs``, one window of commands ahead (None: every command at once)."""
        wins = self._windows(len(keys), len(bufs[0]) if bufs else 0, window)
        cmds = [b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys[lo:hi])
                for lo, hi in wins]
        if cmds:
            self.sock.sendall(cmds[0])
        for w, (lo, hi) in enumerate(wins):
            if w + 1 < len(cmds):
                self.sock.sendall(cmds[w + 1])  # the next window goes out before this one is read
            for b in bufs[lo:hi]:
                line = b"$%d\r\n" % len(b)
                head = self.small[:self.crlf + len(line)]
                self._recv_exact(head)  # the previous value's CRLF and this reply's line, exactly
                if head[self.crlf:] != line:
                    raise RuntimeError(f"unexpected GET reply {bytes(head)!r}")
                self._recv_exact(b)
                self.crlf = 2
        if self.crlf:
            self._recv_exact(self.small[:2])
            self.crlf = 0

    def close(self) -> None:
        self.sock.close()


class WireThreads:
    """The ceiling's multi-connection loop, LMCache's ``resp://`` pattern in raw form: ``conns`` threads,
    each with its own socket, one command in flight per socket (send, read the reply, next key)."""

    def __init__(self, port: int, conns: int = 4):
        self.wires = [Wire(port) for _ in range(conns)]
        self.pool = ThreadPoolExecutor(conns, thread_name_prefix="wire")

    def _each(self, n: int, fn: Callable[[Wire, int], object]) -> None:
        it = iter(range(n))
        lock = threading.Lock()

        def work(w: Wire) -> None:
            while True:
                with lock:
                    i = next(it, None)
                if i is None:
                    return
                fn(w, i)
        list(self.pool.map(work, self.wires))

    def put(self, keys: list[bytes], payloads: list[memoryview]) -> None:
        self._each(len(keys), lambda w, i: w.put([keys[i]], [payloads[i]]))

    def get(self, keys: list[bytes], bufs: list[memoryview]) -> None:
        self._each(len(keys), lambda w, i: w.get([keys[i]], [bufs[i]]))

    def close(self) -> None:
        self.pool.shutdown()
        for w in self.wires:
            w.close()


class Ceiling:
    """Both raw loops on the same keys; ``bench backends`` and ``bench peers`` time each and take the
    faster one's median as the ceiling (which one won is in the row's note)."""

    VARIANTS = ("1 conn, 1 MiB windows", "4 conns, 1 in flight each")

    def __init__(self, port: int):
        self.loops: list[Wire | WireThreads] = [Wire(port), WireThreads(port, 4)]

    def put(self, v: int, keys: list[bytes], payloads: list[memoryview]) -> None:
        self.loops[v].put(keys, payloads)

    def get(self, v: int, keys: list[bytes], bufs: list[memoryview]) -> None:
        self.loops[v].get(keys, bufs)

    def close(self) -> None:
        for loop in self.loops:
            loop.close()


def _timed(fn: Callable[[], object]) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _case(srv: RedisServer, block: int, total_bytes: int, repeats: int) -> list[dict[str, Any]]:
    redis_py: Any
    try:  # context rows only; the backend itself does not use redis-py
        import redis as redis_py
    except ImportError:
        redis_py = None
    from kvtier.backends.redis import RedisBackend
    from kvtier.keys import Namespace

    ns = Namespace("bench/redis", "bfloat16", 32, 8, 128, 16)
    n = max(1, total_bytes // block)
    per = max(1, min(n, BATCH_BYTES // block))
    _, payloads = _payloads(n, block)
    bufs = [memoryview(bytearray(block)) for _ in range(n)]
    gib = n * block / 2**30
    keys = ns.keys([os.urandom(16) for _ in range(n)])
    backend = RedisBackend({"url": srv.url, "key_prefix": "kvtier:"})
    wire_keys = [b"kvwire:" + k.encode() for k in keys]  # as long as the backend's keys
    ceiling = Ceiling(srv.port)
    rp = redis_py.Redis(host="127.0.0.1", port=srv.port) if redis_py else None
    spans = [(i, min(n, i + per)) for i in range(0, n, per)]

    def b_put() -> None:
        for lo, hi in spans:
            if not all(backend.put(keys[lo:hi], payloads[lo:hi], ns.layout_id)):
                raise RuntimeError("redis put refused a block")

    def b_get() -> None:
        for lo, hi in spans:
            if not all(backend.get_into(keys[lo:hi], bufs[lo:hi], ns.layout_id)):
                raise RuntimeError("redis get missed a block")

    def wire(v: int) -> tuple[Callable[[], None], Callable[[], None]]:
        def w_put() -> None:
            for lo, hi in spans:
                ceiling.put(v, wire_keys[lo:hi], payloads[lo:hi])

        def w_get() -> None:
            for lo, hi in spans:
                ceiling.get(v, wire_keys[lo:hi], bufs[lo:hi])
        return w_put, w_get

    contenders = {"backend": (b_put, b_get), **{f"wire{v}": wire(v) for v in range(len(Ceiling.VARIANTS))}}
    if rp is not None:
        client = rp

        def r_put() -> None:
            for lo, hi in spans:
                p = client.pipeline(transaction=False)
                for k, v in zip(wire_keys[lo:hi], payloads[lo:hi]):
                    p.set(k, v)
                p.execute()

        def r_get() -> None:
            for lo, hi in spans:
                if any(v is None for v in client.mget(wire_keys[lo:hi])):
                    raise RuntimeError("redis-py MGET missed")

        contenders["redis-py"] = (r_put, r_get)
    names = list(contenders)
    times: dict[tuple[str, str], list[float]] = {(c, op): [] for c in names for op in ("put", "get")}
    for r in range(repeats + 1):  # the first round warms up and is dropped
        # Each contender in turn, in a rotating order: flush, put, get its own blocks.
        for c in names[r % len(names):] + names[:r % len(names)]:
            srv.flushall()
            put, get = contenders[c]
            times[c, "put"].append(_timed(put))
            times[c, "get"].append(_timed(get))
            if c != "redis-py":
                for i in range(0, n, max(1, n // 16)):
                    if bufs[i] != payloads[i]:
                        raise RuntimeError(f"redis {c} returned wrong bytes for block {i}")
                for b in bufs[::max(1, n // 16)]:
                    b[:8] = b"\0" * 8  # so the next contender's get must really write them
    backend.close()
    ceiling.close()
    if rp is not None:
        rp.close()
    srv.flushall()
    med = {k: statistics.median(v[1:]) for k, v in times.items()}
    rows = []
    for op in ("put", "get"):
        v = min(range(len(Ceiling.VARIANTS)), key=lambda v: med[f"wire{v}", op])
        w = med[f"wire{v}", op]
        rows.append({"backend": "redis", "op": op, "block_bytes": block, "gib_s": gib / med["backend", op],
                     "ceiling_gib_s": gib / w, "ratio": w / med["backend", op],
                     "note": f"ceiling: raw loop, {Ceiling.VARIANTS[v]} (the faster of {len(Ceiling.VARIANTS)}); "
                             f"backend: {backend._stripes} connection(s), {per}-block batches, loopback"})
        if rp is not None:
            rows.append({"backend": "redis-py (context)", "op": op, "block_bytes": block,
                         "gib_s": gib / med["redis-py", op], "ceiling_gib_s": gib / w, "ratio": w / med["redis-py", op],
                         "note": "context only: redis-py " + ("pipeline SET" if op == "put" else
                                                             "MGET, no copy into buffers") + f", {per}-block batches"})
    return rows
