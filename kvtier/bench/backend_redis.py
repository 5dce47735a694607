"""``redis`` put / get throughput beside the Redis wire ceiling, on the same payloads, same server.

The ceiling is a minimal raw-socket loop on one connection (the backend uses one per node and call).
Put pipelines ``SET key payload`` for a batch, sending the command lines, payloads and CRLFs with
scatter-gather ``sendmsg`` calls (no concatenation), then reads the batch's ``+OK`` replies.  Get sends
``GET`` commands one window ahead (the backend's ``window_bytes``, 8 MiB; measured on loopback, sending
a whole 64 MiB batch of GETs at once makes the raw loop itself ~1.6x slower, as Redis then buffers the
replies) and receives each value straight into a preallocated buffer with ``recv_into`` (the previous
CRLF and the reply line with one exact-length ``recv_into``).  The backend additionally frames and
checksums every block, verifies every field and the checksum on read, and routes by key: that is the
overhead the ratio measures.  redis-py (pipeline SET / MGET, no copy into the caller's buffers) is
measured too, for context only.

The server is started here (``redis-server``, no persistence), so the figures are loopback figures; the
Redis server process and the client share the machine's cores.  Ceiling and backend alternate within
each repeat, so drift and neighbours' load hit both alike; the first round is a warm-up.
"""

from __future__ import annotations

import os
import socket
import statistics
import time

import numpy as np

HELP = "redis put/get GiB/s beside the raw RESP wire loop (same as `bench backends --backends redis`)"
BATCH_BYTES = 64 << 20  # bytes per put/get_into call: a long prompt's worth of blocks


def add_arguments(p) -> None:
    from .backends import add_arguments as common

    common(p, only="redis")


def run(args) -> int:
    from .backends import run as run_all

    args.backends = "redis"
    return run_all(args)


def run_cases(block_sizes: list[int], total_bytes: int, repeats: int) -> list[dict]:
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
    mv = memoryview(raw)
    return raw, [mv[i * block:(i + 1) * block] for i in range(n)]


class _Wire:
    """The ceiling: raw RESP over one socket, values received with recv_into."""

    def __init__(self, port: int):
        self.sock = socket.create_connection(("127.0.0.1", port))
        self.sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
        self.small = memoryview(bytearray(64))

    def _recv_exact(self, mv: memoryview) -> None:
        got, n = 0, len(mv)
        while got < n:
            k = self.sock.recv_into(mv[got:])
            if not k:
                raise ConnectionError("redis closed the connection")
            got += k

    def put(self, keys: list[bytes], payloads: list[memoryview]) -> None:
        parts: list = []
        for k, p in zip(keys, payloads):
            parts += [b"*3\r\n$3\r\nSET\r\n$%d\r\n%s\r\n$%d\r\n" % (len(k), k, len(p)), p, b"\r\n"]
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
        replies = memoryview(bytearray(5 * len(keys)))
        self._recv_exact(replies)
        if bytes(replies[:5]) != b"+OK\r\n":
            raise RuntimeError(f"SET failed: {bytes(replies[:64])!r}")

    def get(self, keys: list[bytes], bufs: list[memoryview], window: int | None = None) -> None:
        """GET ``keys`` into ``bufs``; ``window`` blocks per pipelined window (None: all at once)."""
        per = window or len(keys)
        cmds = [b"".join(b"*2\r\n$3\r\nGET\r\n$%d\r\n%s\r\n" % (len(k), k) for k in keys[i:i + per])
                for i in range(0, len(keys), per)]
        self.sock.sendall(cmds[0])
        crlf = 0
        for w in range(len(cmds)):
            if w + 1 < len(cmds):
                self.sock.sendall(cmds[w + 1])  # the next window goes out before this one is read
            for b in bufs[w * per:(w + 1) * per]:
                line = b"$%d\r\n" % len(b)
                head = self.small[:crlf + len(line)]
                self._recv_exact(head)  # the previous value's CRLF and this reply's line, exactly
                if head[crlf:] != line:
                    raise RuntimeError(f"unexpected GET reply {bytes(head)!r}")
                self._recv_exact(b)
                crlf = 2
        self._recv_exact(self.small[:2])

    def close(self) -> None:
        self.sock.close()


def _timed(fn) -> float:
    t0 = time.perf_counter()
    fn()
    return time.perf_counter() - t0


def _case(srv, block: int, total_bytes: int, repeats: int) -> list[dict]:
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
    wire = _Wire(srv.port)
    rp = redis_py.Redis(host="127.0.0.1", port=srv.port) if redis_py else None
    spans = [(i, min(n, i + per)) for i in range(0, n, per)]
    window = max(1, backend.options.window_bytes // block)  # the backend's pipelining window, in blocks

    def b_put():
        for lo, hi in spans:
            if not all(backend.put(keys[lo:hi], payloads[lo:hi], ns.layout_id)):
                raise RuntimeError("redis put refused a block")

    def b_get():
        for lo, hi in spans:
            if not all(backend.get_into(keys[lo:hi], bufs[lo:hi], ns.layout_id)):
                raise RuntimeError("redis get missed a block")

    def w_put():
        for lo, hi in spans:
            wire.put(wire_keys[lo:hi], payloads[lo:hi])

    def w_get():
        for lo, hi in spans:
            wire.get(wire_keys[lo:hi], bufs[lo:hi], window)

    def r_put():
        for lo, hi in spans:
            p = rp.pipeline(transaction=False)
            for k, v in zip(wire_keys[lo:hi], payloads[lo:hi]):
                p.set(k, v)
            p.execute()

    def r_get():
        for lo, hi in spans:
            if any(v is None for v in rp.mget(wire_keys[lo:hi])):
                raise RuntimeError("redis-py MGET missed")

    times: dict[str, list[float]] = {k: [] for k in ("wp", "bp", "rp", "wg", "bg", "rg")}
    for _ in range(repeats + 1):  # the first round warms up and is dropped
        srv.flushall()
        times["wp"].append(_timed(w_put))
        times["bp"].append(_timed(b_put))
        # Alternate which reader goes first: whoever reads first pays for the server's cold pages.
        for which in (("bg", "wg") if _ % 2 else ("wg", "bg")):
            times[which].append(_timed(b_get if which == "bg" else w_get))
        if rp is not None:
            srv.flushall()
            times["rp"].append(_timed(r_put))
            times["rg"].append(_timed(r_get))
    for i in range(0, n, max(1, n // 16)):
        if bufs[i] != payloads[i]:
            raise RuntimeError(f"redis returned wrong bytes for block {i}")
    backend.close()
    wire.close()
    if rp is not None:
        rp.close()
    srv.flushall()
    med = {k: statistics.median(v[1:]) for k, v in times.items() if v}
    note = f"1 connection, {per}-block batches, {window}-block pipelining windows, loopback"
    rows = [{"backend": "redis", "op": op, "block_bytes": block, "gib_s": gib / med[b],
             "ceiling_gib_s": gib / med[w], "ratio": med[w] / med[b], "note": note}
            for op, w, b in (("put", "wp", "bp"), ("get", "wg", "bg"))]
    if rp is not None:
        rows += [{"backend": "redis-py (context)", "op": op, "block_bytes": block, "gib_s": gib / med[r],
                  "ceiling_gib_s": gib / med[w], "ratio": med[w] / med[r],
                  "note": f"context only: redis-py {what}, {per}-block batches"}
                 for op, w, r, what in (("put", "wp", "rp", "pipeline SET"),
                                        ("get", "wg", "rg", "MGET, no copy into buffers"))]
    return rows
