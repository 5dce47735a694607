"""``kvtier events``: shared stores' blocks as vLLM KV events, decoded by a subscriber with vLLM's own classes.

A real ``kvtier events`` process watches a local_disk directory, a real redis-server and an S3 bucket on
moto's server; other writers (as vLLM instances would) store and remove blocks there meanwhile."""

from __future__ import annotations

import os
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.backends.local_disk import LocalDiskBackend
from kvtier.backends.redis import RedisBackend
from kvtier.backends.s3 import S3Backend
from kvtier.keys import Namespace

zmq = pytest.importorskip("zmq")
pytest.importorskip("vllm.distributed.kv_events")

NS = Namespace("m", "bfloat16", 2, 2, 64, 16)
OTHER = Namespace("other", "bfloat16", 2, 2, 64, 16)
PAYLOAD = 2 * 2 * 16 * 2 * 64 * 2


def hashes(n: int, tag: int) -> list[bytes]:
    return [bytes([tag, i]) * 16 for i in range(n)]  # 32-byte block hashes, as sha256_cbor's


def put(b: Any, ns: Namespace, hs: list[bytes]) -> None:
    assert b.put(ns.keys(hs), [os.urandom(PAYLOAD) for _ in hs], ns.layout_id) == [True] * len(hs)


class Subscriber:
    """A SUB socket bound on a free loopback port (the publisher connects), and a replay request."""

    def __init__(self) -> None:
        self.ctx = zmq.Context()
        self.sock = self.ctx.socket(zmq.SUB)
        self.sock.setsockopt(zmq.SUBSCRIBE, b"")
        self.port = self.sock.bind_to_random_port("tcp://127.0.0.1")
        self.frames: list[list[bytes]] = []
        self.lock = threading.Lock()
        self.done = threading.Event()
        self.thread = threading.Thread(target=self._run, daemon=True)
        self.thread.start()

    def _run(self) -> None:
        while not self.done.is_set():
            if self.sock.poll(50):
                frame = self.sock.recv_multipart()
                with self.lock:
                    self.frames.append(frame)

    def events(self) -> list[tuple[int, Any]]:
        import msgspec
        from vllm.distributed.kv_events import KVEventBatch

        dec = msgspec.msgpack.Decoder(type=KVEventBatch)
        with self.lock:
            frames = list(self.frames)
        return [(int.from_bytes(seq, "big"), ev) for _, seq, payload in frames for ev in dec.decode(payload).events]

    def close(self) -> None:
        self.done.set()
        self.thread.join(5)
        self.sock.close(0)
        self.ctx.term()


def ext(hs: list[bytes]) -> set[int]:
    """Block hashes as vLLM's events carry them (the digest's last 8 bytes, an integer)."""
    return {int.from_bytes(h[-8:], "big") for h in hs}


def held(events: list[tuple[int, Any]]) -> dict[str, set[int]]:
    """What the stream says each tier holds (by ``ownership``), checking each block is announced once and
    removed only after."""
    out: dict[str, set[int]] = {}
    for _, ev in events:
        media = out.setdefault(ev.ownership, set())
        for h in ev.block_hashes:
            if type(ev).__name__ == "BlockStored":
                assert h not in media, f"{h.hex()} announced twice in {ev.medium}"
                media.add(h)
            else:
                assert h in media, f"{h.hex()} removed from {ev.medium} before it was announced"
                media.discard(h)
    return out


def wait_held(sub: Subscriber, want: dict[str, set[int]], what: str, timeout: float = 30.0) -> None:
    end = time.monotonic() + timeout
    while (got := held(sub.events())) != want:
        assert time.monotonic() < end, f"timed out waiting for {what}: the stream says {got}, the stores hold {want}"
        time.sleep(0.05)


def test_kvtier_events_publishes_what_shared_stores_hold(tmp_path: Path, redis_server, moto_server, s3_bucket):
    root = tmp_path / "disk"
    disk_opts = {"path": str(root), "capacity": "1GiB"}
    redis_opts = {"url": redis_server.url}
    s3_opts = {"bucket": s3_bucket, "endpoint_url": moto_server.endpoint_url, "prefix": "kv/"}
    disk, redis, s3 = LocalDiskBackend(disk_opts), RedisBackend(redis_opts), S3Backend(s3_opts)
    for b in (disk, redis, s3):
        b.put_manifest(NS)
    put(disk, NS, hashes(3, 1))
    put(redis, NS, hashes(2, 2))
    put(s3, NS, hashes(2, 3))
    put(redis, OTHER, hashes(2, 9))  # another model's blocks in the same store: not in this stream
    cfg = tmp_path / "shared.yaml"
    cfg.write_text(yaml.safe_dump({"keys": {"algo": "sha256_cbor"}, "backends": [
        {"name": "disk", "type": "local_disk", "options": disk_opts},
        {"name": "redis", "type": "redis", "options": redis_opts},
        {"name": "s3", "type": "s3", "options": s3_opts}]}))
    sub = Subscriber()
    replay_port = sub.port + 1 if sub.port < 65000 else sub.port - 1
    cmd = [sys.executable, "-m", "kvtier", "events", "--config", str(cfg), "--engine", "vllm",
           "--namespace", NS.id, "--endpoint", f"tcp://127.0.0.1:{sub.port}",
           "--replay-endpoint", f"tcp://127.0.0.1:{replay_port}", "--reconcile-s", "1"]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    try:
        # The first listing: every block of the namespace, in its medium, with its locality.
        want = {"kvtier:local_disk": ext(hashes(3, 1)), "kvtier:redis": ext(hashes(2, 2)),
                "kvtier:s3": ext(hashes(2, 3))}
        # Its wait includes the ``kvtier events`` process's start-up (its imports): beside the whole suite on a
        # loaded 2-core machine that alone outlasted 30 s once (the stream still said nothing).
        wait_held(sub, want, "the first listing", timeout=120.0)
        stored = [ev for _, ev in sub.events()]
        assert {(ev.medium, ev.locality, ev.ownership) for ev in stored} == {
            ("STORAGE", "LOCAL", "kvtier:local_disk"), ("STORAGE", "REMOTE", "kvtier:redis"),
            ("STORAGE", "REMOTE", "kvtier:s3")}
        assert all(ev.block_size == 16 and ev.token_ids == [] and ev.parent_block_hash is None for ev in stored)

        # Another process deletes a disk block (as kvtier gc does): a notice from the directory's journal.
        t0 = time.monotonic()
        tool = LocalDiskBackend({**disk_opts, "removals_poll_s": 0})
        assert tool.delete(NS.keys(hashes(3, 1)[:1])) == 1
        tool.close()
        want["kvtier:local_disk"] -= ext(hashes(3, 1)[:1])
        wait_held(sub, want, "the disk delete")
        # New blocks anywhere, a Redis DEL, an S3 delete: the next listing.
        put(redis, NS, hashes(1, 4))
        put(disk, NS, hashes(1, 5))
        assert redis_server.cli("DEL", "kvtier:" + NS.keys(hashes(2, 2)[:1])[0]).strip() == "1"
        s3.delete(NS.keys(hashes(2, 3)[1:]))
        want["kvtier:redis"] = ext([hashes(2, 2)[1], hashes(1, 4)[0]])
        want["kvtier:local_disk"] |= ext(hashes(1, 5))
        want["kvtier:s3"] = ext(hashes(2, 3)[:1])
        wait_held(sub, want, "the changes after the first listing")
        took = time.monotonic() - t0
        assert took < 10, f"changes took {took:.1f} s to reach the stream (listing every 1 s)"
        seqs = [seq for seq, _ in sub.events()]
        assert seqs == sorted(seqs) and seqs[0] == 0

        # vLLM's replay protocol: a subscriber that missed batches asks from a sequence number.
        ctx = zmq.Context()
        req = ctx.socket(zmq.DEALER)
        req.connect(f"tcp://127.0.0.1:{replay_port}")
        req.send(b"", zmq.SNDMORE)
        req.send((0).to_bytes(8, "big"))
        replayed = []
        while req.poll(5000):
            frames = req.recv_multipart()
            seq = int.from_bytes(frames[-2], "big", signed=True)
            if seq == -1:
                break
            replayed.append(seq)
        req.close(0)
        ctx.term()
        assert replayed == sorted(set(seqs)), "every batch published is replayed in order"
    finally:
        proc.terminate()
        out, _ = proc.communicate(timeout=30)
        sub.close()
        for b in (disk, redis, s3):
            b.close()
    assert proc.returncode == 0, out
    assert f"kvtier events: namespace {NS.id}, block size 16: disk (STORAGE, LOCAL, kvtier:local_disk), redis " \
           f"(STORAGE, REMOTE, kvtier:redis), s3 (STORAGE, REMOTE, kvtier:s3); publishing on " \
           f"tcp://127.0.0.1:{sub.port}" in out


def test_kvtier_events_needs_one_namespace(tmp_path: Path, capsys):
    from kvtier.tools.cli import main

    root = tmp_path / "disk"
    disk = LocalDiskBackend({"path": str(root)})
    for ns in (NS, OTHER):
        disk.put_manifest(ns)
        put(disk, ns, hashes(1, 1))
    disk.close()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"backends": [{"name": "disk", "type": "local_disk",
                                                 "options": {"path": str(root)}}]}))
    assert main(["events", "--config", str(cfg), "--engine", "vllm"]) == 2  # whose namespaces: untold
    assert "sets no model.id" in capsys.readouterr().err
    assert main(["events", "--config", str(cfg), "--engine", "vllm", "--all-namespaces"]) == 2
    err = capsys.readouterr().err
    assert "--namespace is needed: the config names no model of its own and its backends hold 2 namespaces" in err


def test_kvtier_events_refuses_a_listing_period_that_is_not_positive(tmp_path: Path, capsys):
    from kvtier.tools.cli import main

    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"backends": [{"name": "disk", "type": "local_disk",
                                                 "options": {"path": str(tmp_path / "disk")}}]}))
    for bad in ("0", "-1"):
        assert main(["events", "--config", str(cfg), "--engine", "vllm", "--reconcile-s", bad]) == 2
        assert f"--reconcile-s must be > 0, got {float(bad)}" in capsys.readouterr().err


def test_kvtier_events_needs_a_block_size_where_no_backend_holds_the_namespaces_manifest(tmp_path: Path, capsys):
    """Blocks of one namespace on disk, but no manifest: the events' block size (tokens per block) cannot be
    told, and the error names the option and the namespace before anything is published."""
    from kvtier.tools.cli import main

    root = tmp_path / "disk"
    disk = LocalDiskBackend({"path": str(root)})
    put(disk, NS, hashes(1, 1))
    disk.close()
    cfg = tmp_path / "c.yaml"
    cfg.write_text(yaml.safe_dump({"backends": [{"name": "disk", "type": "local_disk",
                                                 "options": {"path": str(root)}}]}))
    assert main(["events", "--config", str(cfg), "--engine", "vllm", "--namespace", NS.id]) == 2
    assert f"--block-size is needed: no backend holds a manifest of namespace {NS.id}" in capsys.readouterr().err
