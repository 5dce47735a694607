"""Dynamo's KV router (its real ``RadixTree`` and block hash, ``ai-dynamo-runtime``) fed vLLM KV events.

Events are vLLM's own classes, hashed with vLLM's ``sha256_cbor`` prefix hashing, encoded as vLLM's ZMQ
publisher encodes them; ``DynamoRouterView`` converts them as Dynamo's listener does (see its module).
The last test checks that conversion against Dynamo's real listener (``python -m dynamo.indexer``).
"""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request

import pytest

pytest.importorskip("dynamo._core")
pytest.importorskip("vllm.distributed.kv_events")

import msgspec  # noqa: E402
from vllm.distributed.kv_events import (  # noqa: E402
    AllBlocksCleared,
    BlockRemoved,
    BlockStored,
    KVEventBatch,
)
from vllm.utils.hashing import sha256_cbor  # noqa: E402
from vllm.v1.core.kv_cache_utils import BlockHash, hash_block_tokens, init_none_hash  # noqa: E402

from kvtier.integrations.vllm.events import TierEvents  # noqa: E402
from kvtier.plans import HostChanges, WorkerReport  # noqa: E402
from kvtier.testing.dynamo_router import DynamoRouterView, UndecodableBatch, external_hash  # noqa: E402

BS = 4
PROMPT = list(range(1000, 1012))  # 3 full blocks
SHARES_FIRST = PROMPT[:BS] + [7, 7, 7, 7, 8, 8, 8, 8]
W, OTHER = 1, 2

init_none_hash(sha256_cbor)


def chain(tokens: list[int]) -> list[bytes]:
    """vLLM's block hashes (sha256_cbor) of the full blocks of ``tokens``."""
    out: list[BlockHash] = []
    for i in range(len(tokens) // BS):
        out.append(hash_block_tokens(sha256_cbor, out[-1] if out else None, tokens[i * BS:(i + 1) * BS]))
    return [bytes(h) for h in out]


def stored(hashes, tokens, i, *, medium="GPU", locality=None, as_int=True, block_size=BS):
    """BlockStored of block ``i`` of a chain, its hashes as vLLM publishes them (int unless ``as_int``)."""
    conv = external_hash if as_int else (lambda h: h)
    return BlockStored(block_hashes=[conv(hashes[i])], parent_block_hash=conv(hashes[i - 1]) if i else None,
                       token_ids=tokens[i * BS:(i + 1) * BS], block_size=block_size, lora_id=None, medium=medium,
                       lora_name=None, group_idx=0, locality=locality)


def wire(*events) -> bytes:
    """The payload frame vLLM's ZmqEventPublisher sends (msgspec msgpack Encoder)."""
    return msgspec.msgpack.Encoder().encode(KVEventBatch(ts=time.time(), events=list(events)))


@pytest.fixture
def hashes():
    return chain(PROMPT)


def test_prefix_overlap_follows_stores_removals_and_clears(hashes):
    view = DynamoRouterView(BS)
    for i in range(3):
        out = view.apply(W, wire(stored(hashes, PROMPT, i)))
        assert out.applied == {"device": 1} and not out.dropped
    assert view.overlap(W, PROMPT, BS) == 3
    assert view.overlap(W, PROMPT + [1, 2], BS) == 3  # a partial last block is not scored
    assert view.overlap(W, SHARES_FIRST, BS) == 1
    assert view.overlap(W, [5] * 12, BS) == 0
    assert view.overlap(OTHER, PROMPT, BS) == 0
    view.apply(W, wire(BlockRemoved(block_hashes=[external_hash(hashes[2])], medium="GPU", group_idx=0)))
    assert view.overlap(W, PROMPT, BS) == 2
    view.apply(W, wire(AllBlocksCleared()))
    assert view.overlap(W, PROMPT, BS) == 0


def test_tree_holds_dynamo_hashes(hashes):
    """The tree is keyed as Dynamo keys it: the external hash is the low 64 bits of vLLM's digest, the
    local hash Dynamo's XXH3 hash of the block's tokens (what a router computes from a prompt)."""
    from dynamo._core import compute_block_hash_for_seq

    view = DynamoRouterView(BS)
    view.apply(W, KVEventBatch(ts=0.0, events=[stored(hashes, PROMPT, i) for i in range(3)]))  # decoded form
    blocks = [b for e in view.dump() for b in e["event"]["data"]["stored"]["blocks"]]
    assert {b["block_hash"] for b in blocks} == {int.from_bytes(h[-8:], "big") for h in hashes}
    assert {b["tokens_hash"] for b in blocks} == set(compute_block_hash_for_seq(PROMPT, BS))
    assert all(e["worker_id"] == W for e in view.dump())


def test_one_event_carries_a_run_of_blocks(hashes):
    view = DynamoRouterView(BS)
    ev = BlockStored(block_hashes=[external_hash(h) for h in hashes], parent_block_hash=None, token_ids=PROMPT,
                     block_size=BS, lora_id=None, medium=None, lora_name=None)
    view.apply(W, wire(ev))
    assert view.overlap(W, PROMPT) == 3


def test_dp_rank_comes_from_the_batch(hashes):
    view = DynamoRouterView(BS)
    for i in range(3):
        view.apply(W, msgspec.msgpack.Encoder().encode(
            KVEventBatch(ts=0.0, events=[stored(hashes, PROMPT, i)], data_parallel_rank=1)))
    assert view.overlap(W, PROMPT, dp_rank=1) == 3
    assert view.overlap(W, PROMPT, dp_rank=0) == 0


def test_kvtier_media_map_to_lower_tiers_or_are_dropped(hashes):
    """kvtier's host memory (CPU) is Dynamo's host_pinned tier, outside the device tree its router scores;
    LOCAL_DISK / REDIS / S3 are media Dynamo 1.6.1 does not know, and REMOTE events are dropped."""
    view = DynamoRouterView(BS)
    for i in range(3):
        assert view.apply(W, wire(stored(hashes, PROMPT, i, medium="CPU", locality="LOCAL"))).applied == {
            "host_pinned": 1}
    assert view.overlap(W, PROMPT) == 0
    assert view.overlap(W, PROMPT, tier="host_pinned") == 3
    assert view.overlap(W, SHARES_FIRST, tier="host_pinned") == 1
    for medium, locality in (("LOCAL_DISK", "LOCAL"), ("REDIS", "REMOTE"), ("S3", "REMOTE"), ("CPU", "REMOTE")):
        out = view.apply(OTHER, wire(*(stored(hashes, PROMPT, i, medium=medium, locality=locality)
                                       for i in range(3))))
        assert out.applied == {} and len(out.dropped) == 3, (medium, out)
    for tier in ("device", "host_pinned", "disk", "external"):
        assert view.overlap(OTHER, PROMPT, tier=tier) == 0
    view.apply(W, wire(BlockRemoved(block_hashes=[external_hash(hashes[2])], medium="CPU", locality="LOCAL")))
    assert view.overlap(W, PROMPT, tier="host_pinned") == 2
    view.apply(W, wire(AllBlocksCleared()))
    assert view.overlap(W, PROMPT, tier="host_pinned") == 0


def test_media_filter(hashes):
    view = DynamoRouterView(BS, media={"CPU"})
    out = view.apply(W, wire(*(stored(hashes, PROMPT, i) for i in range(3)),
                             *(stored(hashes, PROMPT, i, medium="CPU", locality="LOCAL") for i in range(2))))
    assert out.applied == {"host_pinned": 2} and len(out.dropped) == 3
    assert view.overlap(W, PROMPT) == 0 and view.overlap(W, PROMPT, tier="host_pinned") == 2


def test_byte_hashes_fail_the_whole_batch(hashes):
    """Dynamo 1.6.1 takes only integer hashes: one raw 32-byte hash loses the batch, vLLM's GPU events in
    it too.  Converted as vLLM converts its own (low 64 bits), the same events index the same blocks."""
    batch = wire(stored(hashes, PROMPT, 0), stored(hashes, PROMPT, 1, medium="CPU", locality="LOCAL", as_int=False))
    view = DynamoRouterView(BS)
    with pytest.raises(UndecodableBatch):
        view.apply(W, batch)
    assert view.overlap(W, PROMPT) == 0 and view.overlap(W, PROMPT, tier="host_pinned") == 0
    lenient = DynamoRouterView(BS, accept_bytes_hashes=True)
    lenient.apply(W, batch)
    assert lenient.overlap(W, PROMPT) == 1


def test_what_kvtier_publishes(hashes):
    """kvtier's own event stream (TierEvents), as Dynamo 1.6.1 takes it: integer hashes as vLLM publishes its
    own; host memory (CPU) scores in Dynamo's host_pinned tier, a local_disk backend (STORAGE, LOCAL) in its
    disk tier; a shared store's blocks (locality REMOTE: every instance loads them) are not this worker's,
    and Dynamo drops them."""
    ev = TierEvents(["local_disk", "redis"], BS)
    ev.learn(hashes, PROMPT, 0, None)
    ev.record(WorkerReport(in_backend={(h, 0) for h in hashes}),
              host=HostChanges(in_host={h: i for i, h in enumerate(hashes)}))
    ev.record(WorkerReport(in_backend={(h, 1) for h in hashes}))
    view = DynamoRouterView(BS)
    out = view.apply(W, wire(*ev.take()))
    assert out.applied == {"host_pinned": 3, "disk": 3} and len(out.dropped) == 3  # REDIS: REMOTE
    assert view.overlap(W, PROMPT, tier="host_pinned") == 3 and view.overlap(W, PROMPT, tier="disk") == 3
    assert view.overlap(W, PROMPT) == 0  # the device tier: vLLM's own blocks only


def test_blocks_of_another_size_are_not_published(hashes):
    view = DynamoRouterView(BS)
    out = view.apply(W, wire(stored(hashes, PROMPT, 0, block_size=BS * 2)))
    assert out.applied == {"device": 1}  # an empty store, as Dynamo applies it
    assert view.overlap(W, PROMPT) == 0


def test_self_referencing_store_is_a_no_op(hashes):
    view = DynamoRouterView(BS)
    view.apply(W, wire(stored(hashes, PROMPT, 0)))
    loop = BlockStored(block_hashes=[external_hash(hashes[0])], parent_block_hash=external_hash(hashes[0]),
                       token_ids=PROMPT[BS:2 * BS], block_size=BS, lora_id=None, medium=None, lora_name=None)
    view.apply(W, wire(loop))
    assert view.overlap(W, PROMPT) == 1


# ---------------------------------------------------------------------- against Dynamo's real listener


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def test_view_matches_dynamos_own_listener(hashes):
    """The same vLLM ZMQ stream, through Dynamo's standalone indexer (its Rust ZMQ listener and
    conversion) and through the view: the same device scores and the same per-tier contents."""
    from vllm.distributed.kv_events import ZmqEventPublisher

    zport, hport = _free_port(), _free_port()
    pub = ZmqEventPublisher(0, endpoint=f"tcp://*:{zport}")
    proc = subprocess.Popen([sys.executable, "-m", "dynamo.indexer", "--port", str(hport), "--threads", "1",
                             "--block-size", str(BS), "--workers", f"{W}=tcp://127.0.0.1:{zport}"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env={**os.environ})

    def http(path, body=None):
        req = urllib.request.Request(f"http://127.0.0.1:{hport}{path}",
                                     data=None if body is None else json.dumps(body).encode(),
                                     headers={"content-type": "application/json"})
        return json.loads(urllib.request.urlopen(req, timeout=5).read())

    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                http("/workers")
                break
            except OSError:
                if time.monotonic() > deadline or proc.poll() is not None:
                    pytest.skip("dynamo.indexer did not start")
                time.sleep(0.2)
        time.sleep(1.0)  # the SUB socket connects; a PUB drops what it sends before
        other = chain(SHARES_FIRST)
        batches = [
            KVEventBatch(ts=0.0, events=[stored(hashes, PROMPT, i) for i in range(3)]),
            KVEventBatch(ts=0.0, events=[stored(other, SHARES_FIRST, i, medium="CPU", locality="LOCAL")
                                         for i in range(3)]),
            KVEventBatch(ts=0.0, events=[stored(hashes, PROMPT, 0, medium="LOCAL_DISK", locality="LOCAL"),
                                         stored(hashes, PROMPT, 0, medium="REDIS", locality="REMOTE")]),
            KVEventBatch(ts=0.0, events=[BlockRemoved(block_hashes=[external_hash(hashes[2])], medium="GPU")]),
        ]
        view = DynamoRouterView(BS)
        for b in batches:
            pub.publish(b)
            view.apply(W, msgspec.msgpack.Encoder().encode(b))
        time.sleep(1.5)
        for prompt in (PROMPT, SHARES_FIRST):
            got = http("/query", {"token_ids": prompt, "model_name": "default"})
            assert got["scores"].get(str(W), {}).get("0", 0) == view.overlap(W, prompt) * BS
        dumped = http("/dump")["default:default"]["events"]
        real: dict[str, set[tuple[int, int]]] = {}
        for e in dumped:
            for blk in e["event"]["data"]["stored"]["blocks"]:
                real.setdefault(e["storage_tier"], set()).add((blk["block_hash"], blk["tokens_hash"]))
        mine = {t: {(blk["block_hash"], blk["tokens_hash"]) for e in view.dump(t)
                    for blk in e["event"]["data"]["stored"]["blocks"]}
                for t in ("device", "host_pinned", "disk", "external")}
        assert real == {t: s for t, s in mine.items() if s}
        assert len(real["device"]) == 2 and len(real["host_pinned"]) == 3
    finally:
        proc.terminate()
        proc.wait(10)
        pub.shutdown()
