"""Writer and reader processes for the reliability tests (run as a script, never imported by pytest).

``worker.py zygote KIND TARGET --progress FILE [--keys N --size BYTES --batch B]``
    Imports everything once, then reads commands on stdin, one per line:
    ``go ROUND``  forks a writer child that stores batches under ROUND's versions until it is killed,
                  and prints the child's pid.  The child publishes its progress in FILE (eight
                  little-endian u64: round, batches started, batches done, keys refused) so the test
                  knows which batch a SIGKILL interrupted.
    ``wait PID``  reaps the child and prints the signal that ended it (0 if it exited).
    Forking from an idle, single-threaded zygote makes each round's writer start in milliseconds.

``worker.py mix KIND TARGET --id I [--keys N --size BYTES --batch B --seconds S --capacity C]``
    Prints ``ready`` once its backend is open, waits for a line on stdin, then for S seconds randomly
    writes batches (versions ``I << 40 | n``) and reads batches of the shared key set, checking every
    hit with ``common.check``.  Prints one JSON object of counts at the end.

``worker.py churn disk DIR --id I --capacity C [--size BYTES --batch B --seconds S --threads T]``
    Prints ``ready``, waits for a line on stdin, then for S seconds stores batches of new keys (all in
    shard ``00``, so one directory listing sees every block), each put evicting older blocks.  Prints one
    JSON object of counts at the end.

Key schedule of the zygote's children (the test replays it): batch ``b`` of round ``r`` stores the keys
``common.batch_keys(r, b)`` with version ``common.version(r, b)``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
import traceback

import numpy as np
from common import LID, NS, batch_keys, check, key_of, make_backend, payload, version

# progress slots
ROUND, STARTED, DONE, REFUSED = 0, 1, 2, 3


def _writer_child(args, rnd: int) -> None:
    prog = np.memmap(args.progress, dtype="<u8", mode="r+", shape=(8,))
    keys = [key_of(i) for i in range(args.keys)]
    backend = make_backend(args.kind, args.target, **_opts(args))
    prog[ROUND] = rnd
    b = 0
    while True:
        idx = batch_keys(rnd, b, args.keys, args.batch)
        ks = [keys[i] for i in idx]
        data = [payload(k, version(rnd, b), args.size) for k in ks]
        prog[STARTED] = b + 1
        ok = backend.put(ks, data, LID)
        prog[REFUSED] += len(ok) - sum(ok)
        prog[DONE] = b + 1
        b += 1


def _opts(args) -> dict[str, object]:
    if args.kind == "disk":
        return {"capacity": args.capacity or "1GiB", "threads": 4}
    return {}


def zygote(args) -> int:
    for line in sys.stdin:
        cmd, _, arg = line.strip().partition(" ")
        if cmd == "go":
            pid = os.fork()
            if pid == 0:  # the writer: runs until SIGKILL
                try:
                    _writer_child(args, int(arg))
                except BaseException:  # noqa: BLE001 - reported on stderr, the test sees no progress
                    traceback.print_exc()
                finally:
                    os._exit(1)
            print(pid, flush=True)
        elif cmd == "wait":
            _, status = os.waitpid(int(arg), 0)
            print(os.WTERMSIG(status) if os.WIFSIGNALED(status) else 0, flush=True)
        elif cmd:
            print(f"unknown command {cmd!r}", file=sys.stderr, flush=True)
            return 2
    return 0


def mix(args) -> int:
    keys = [key_of(i) for i in range(args.keys)]
    opts = {"capacity": args.capacity or "1GiB", "threads": 2} if args.kind == "disk" else {}
    backend = make_backend(args.kind, args.target, **opts)
    rng = np.random.default_rng(1000 + args.id)
    res = {"id": args.id, "writes": 0, "puts_ok": 0, "puts_refused": 0, "reads": 0, "hits": 0, "wrong": 0,
           "hits_from": {}, "max_seen": {}, "errors": 0, "first_error": None}
    print("ready", flush=True)
    sys.stdin.readline()
    deadline = time.monotonic() + args.seconds
    n = 0
    while time.monotonic() < deadline:
        idx = rng.choice(args.keys, size=args.batch, replace=False)
        ks = [keys[i] for i in idx]
        try:
            if rng.random() < 0.5:
                n += 1
                v = (args.id << 40) | n
                ok = backend.put(ks, [payload(k, v, args.size) for k in ks], LID)
                res["writes"] += 1
                res["puts_ok"] += sum(ok)
                res["puts_refused"] += len(ok) - sum(ok)
            else:
                bufs = [bytearray(args.size) for _ in ks]
                ok = backend.get_into(ks, bufs, LID)
                res["reads"] += len(ks)
                for k, buf, hit in zip(ks, bufs, ok):
                    if not hit:
                        continue
                    res["hits"] += 1
                    v = check(k, buf)
                    if v is None:
                        res["wrong"] += 1
                        continue
                    w = str(v >> 40)
                    res["hits_from"][w] = res["hits_from"].get(w, 0) + 1
                    res["max_seen"][w] = max(res["max_seen"].get(w, 0), v & ((1 << 40) - 1))
        except Exception as e:  # noqa: BLE001 - counted; the test asserts there are none
            res["errors"] += 1
            res["first_error"] = res["first_error"] or f"{type(e).__name__}: {e}"
    res["last_version"] = n
    res["corrupt"] = backend.stats().corrupt
    backend.close()
    print(json.dumps(res), flush=True)
    return 0


def churn(args) -> int:
    import hashlib

    backend = make_backend("disk", args.target, capacity=args.capacity, threads=args.threads)
    data = np.frombuffer(np.random.default_rng(args.id).bytes(args.size), dtype=np.uint8)
    res = {"id": args.id, "stored": 0, "refused": 0, "errors": 0, "first_error": None}
    print("ready", flush=True)
    sys.stdin.readline()
    deadline = time.monotonic() + args.seconds
    n = 0
    while time.monotonic() < deadline:
        hashes = [b"\x00" + hashlib.sha256(f"churn-{args.id}-{n + j}".encode()).digest()[:15]
                  for j in range(args.batch)]
        n += args.batch
        try:
            ok = backend.put([NS.key(h) for h in hashes], [data] * len(hashes), LID)
            res["stored"] += sum(ok)
            res["refused"] += len(ok) - sum(ok)
        except Exception as e:  # noqa: BLE001 - counted; the test asserts there are none
            res["errors"] += 1
            res["first_error"] = res["first_error"] or f"{type(e).__name__}: {e}"
    backend.close()
    print(json.dumps(res), flush=True)
    return 0


def main() -> int:
    p = argparse.ArgumentParser()
    p.add_argument("mode", choices=["zygote", "mix", "churn"])
    p.add_argument("kind", choices=["disk", "redis"])
    p.add_argument("target")
    p.add_argument("--progress")
    p.add_argument("--id", type=int, default=0)
    p.add_argument("--keys", type=int, default=48)
    p.add_argument("--size", type=int, default=64 << 10)
    p.add_argument("--batch", type=int, default=8)
    p.add_argument("--seconds", type=float, default=2.0)
    p.add_argument("--capacity", default=None)
    p.add_argument("--threads", type=int, default=2)
    args = p.parse_args()
    return {"zygote": zygote, "mix": mix, "churn": churn}[args.mode](args)


if __name__ == "__main__":
    sys.exit(main())
