"""``kvtier events --config FILE``: publish what shared stores hold as vLLM KV events, for KV-aware routers.

Runs beside a Redis, an S3 bucket or a directory that many vLLM instances share, and publishes one
namespace's blocks there as vLLM's own ``BlockStored`` / ``BlockRemoved`` batches (msgpack over ZMQ, vLLM's
``ZmqEventPublisher``: sequence numbers, and a replay endpoint a subscriber asks for what it missed), so a
router (llm-d's precise prefix-cache scorer, Dynamo's KV router, your own) learns a shared tier that no
instance's own stream fully describes.  Removals the backends notice (Redis evictions and expiries, a
directory's removal journal) go out within about a second; every ``--reconcile-s`` each backend is listed
and compared with what was announced.  Stops on SIGINT / SIGTERM.  Exit status 0; 2 for a bad config,
flag or namespace.  Needs vLLM's event classes (``pip install 'kvtier[vllm]'``)."""

from __future__ import annotations

import argparse
import signal
import threading
import time
from typing import Any

from ...keys import Namespace
from ..cli import UserError
from . import _storage_tools as st


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("events", help="publish what shared backends hold as vLLM KV events (ZMQ), for routers",
                       description=__doc__)
    p.add_argument("--config", required=True, metavar="FILE",
                   help="deployment YAML; its backends are the stores watched (KVTIER_... overrides apply)")
    st.add_engine_argument(p)
    p.add_argument("--backend", action="append", metavar="NAME", help="only this backend (by name); repeatable")
    p.add_argument("--namespace", metavar="ID", help="the namespace (model) to publish; default: the config's "
                   "own, or the only one of this deployment's its backends hold")
    st.add_scope_argument(p)
    p.add_argument("--block-size", type=int, metavar="TOKENS",
                   help="tokens per block in the events; default: from the namespace's manifest")
    p.add_argument("--endpoint", default="tcp://*:5557",
                   help="ZMQ PUB address: tcp://*:PORT binds, tcp://HOST:PORT connects (default %(default)s)")
    p.add_argument("--replay-endpoint", metavar="ADDR",
                   help="ZMQ ROUTER address answering replay requests (vLLM's replay protocol); default none")
    p.add_argument("--topic", default="", help="ZMQ topic of every message (default: none)")
    p.add_argument("--buffer-steps", type=int, default=10_000, help="batches kept for replay (default %(default)s)")
    p.add_argument("--reconcile-s", type=float, default=10.0,
                   help="seconds between listings of every backend (default %(default)s)")
    p.add_argument("--duration-s", type=float, help="stop after this many seconds (default: run until stopped)")
    p.set_defaults(func=run)


def _namespace(loaded: st.Loaded, opened: list[st.OpenedBackend], wanted: str | None) -> str:
    if wanted:
        return wanted
    if loaded.namespace_id is not None:
        return loaded.namespace_id
    found = sorted({ns for ob in opened if ob.backend is not None for ns in loaded.scope.ids(ob.backend)[0]})
    if len(found) != 1:
        whose = "" if loaded.scope.all else " of this deployment's"
        raise UserError(f"--namespace is needed: the config names no model of its own and its backends hold "
                        f"{len(found)}{whose} namespaces{': ' + ', '.join(found) if found else ''} (vLLM's events "
                        "name no model, so one publisher serves one namespace)")
    return found[0]


def _block_size(opened: list[st.OpenedBackend], namespace_id: str, wanted: int | None) -> int:
    if wanted:
        return wanted
    for ob in opened:
        if ob.backend is None:
            continue
        manifest = ob.backend.get_manifest(namespace_id)
        if manifest is not None:
            ns = Namespace.from_manifest(manifest)
            return int(ns.block_size * ns.storage_blocks)
    raise UserError(f"--block-size is needed: no backend holds a manifest of namespace {namespace_id}")


def run(args: argparse.Namespace) -> int:
    try:
        from vllm.distributed.kv_events import KVEventBatch, ZmqEventPublisher
    except ImportError as e:
        raise UserError(f"kvtier events publishes with vLLM's event classes, which cannot be imported ({e}): "
                        "pip install 'kvtier[vllm]'") from None
    from ...integrations.vllm.store_events import StoreEvents, WatchedBackend

    if args.reconcile_s <= 0:
        raise UserError(f"--reconcile-s must be > 0, got {args.reconcile_s}")
    # A namespace named with --namespace is the operator's choice, of this deployment's or not: the scope
    # only picks one when none is named.
    loaded = st.load(args, named=args.namespace is not None)
    with st.open_backends(loaded.cfg, args.backend, keys=False) as opened:
        for ob in opened:
            if ob.backend is None:
                raise UserError(f"backend {ob.name} ({ob.conf.type}): {ob.error}")
        ns = _namespace(loaded, opened, args.namespace)
        block_size = _block_size(opened, ns, args.block_size)
        watched = [WatchedBackend(ob.name, ob.conf.type, ob.backend) for ob in opened if ob.backend is not None]
        feed = StoreEvents(watched, ns, block_size)
        pub = ZmqEventPublisher(0, args.endpoint, args.replay_endpoint, args.buffer_steps, topic=args.topic)
        stop = threading.Event()
        for sig in (signal.SIGINT, signal.SIGTERM):
            signal.signal(sig, lambda *_: stop.set())
        media = ", ".join(f"{w.name} ({w.medium.name}, {w.medium.locality}, {w.medium.ownership})" for w in watched)
        print(f"kvtier events: namespace {ns}, block size {block_size}: {media}; publishing on {args.endpoint}"
              + (f", replay on {args.replay_endpoint}" if args.replay_endpoint else "")
              + f"; every backend listed every {args.reconcile_s:g} s", flush=True)
        end = time.monotonic() + args.duration_s if args.duration_s else None
        next_listing = time.monotonic()
        try:
            while not stop.is_set() and (end is None or time.monotonic() < end):
                if time.monotonic() >= next_listing:
                    feed.reconcile()
                    next_listing = time.monotonic() + args.reconcile_s
                batch: list[Any]
                for batch in feed.take():
                    pub.publish(KVEventBatch(ts=time.time(), events=batch))
                stop.wait(0.1)
        finally:
            for batch in feed.take():  # what was noticed last still goes out
                pub.publish(KVEventBatch(ts=time.time(), events=batch))
            pub.shutdown()
    return 0
