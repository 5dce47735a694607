"""What NVIDIA Dynamo's KV-aware router makes of a vLLM instance's KV event stream, in-process.

Dynamo's router indexes vLLM's ``KVEventBatch``es (msgpack over ZMQ, kvtier's connector events included:
``take_events()`` lands in the same batch as vLLM's own GPU events) in a radix tree and scores each
instance by the number of leading blocks of a prompt it holds.  Its listener is Rust behind Dynamo's
distributed runtime (NATS / etcd), which a unit test does not have; the Python package only exposes the
tree (``dynamo._core.RadixTree``, fed Dynamo's own ``KvCacheEvent`` JSON) and the hash
(``compute_block_hash_for_seq``).  :class:`DynamoRouterView` therefore applies the listener's conversion
here, rule for rule, and feeds the result to a real ``RadixTree``; so a test can ask "would Dynamo route
this prompt to this instance, given the events it published?".

Mirrored from ai-dynamo/dynamo (``ai-dynamo-runtime==1.6.1``; the wheel's panic paths name these files):

* ``lib/kv-router/src/zmq_wire/deserialize.rs`` (``impl Deserialize for RawKvEvent``, ``visit_seq`` /
  ``visit_map``, ``normalize_medium``) and ``zmq_wire/types.rs`` (``KvEventBatch``, ``BlockHashValue``,
  ``Locality``): decoding.  A block hash must be a msgpack integer (``BlockHashValue`` is ``Signed(i64)`` |
  ``Unsigned(u64)``, a negative one is reinterpreted as u64); a byte-string hash fails the *whole batch*
  ("data did not match any variant of untagged enum BlockHashValue"), vLLM's own events in it included.
  vLLM publishes integers: ``maybe_convert_block_hash`` (``vllm/v1/core/kv_cache_utils.py``, on by
  default through ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES``) keeps the low 64 bits of the digest, i.e.
  ``int.from_bytes(h[-8:], "big")`` (:func:`external_hash`).  An empty ``medium`` counts as absent.
* ``lib/kv-router/src/zmq_wire/convert.rs`` (``convert_event``, ``create_stored_blocks``,
  ``create_stored_block_from_parts``): conversion.  ``locality`` ``REMOTE`` (or any value but ``LOCAL``)
  drops the event (no shared index consumes it yet, Dynamo #10457); ``medium`` picks the storage tier via
  ``StorageTier::from_kv_medium`` (``lib/kv-router/src/protocols.rs``, :data:`MEDIUM_TIERS`): absent is
  ``device``; a medium it does not know (``LOCAL_DISK``, ``REDIS``, ``S3``, lower case) drops the event.
  A stored event whose hashes repeat (parent included) becomes an empty removal.  Each stored block must
  have ``block_size`` equal to the worker's registered block size and enough ``token_ids``, else it and the
  rest of the event are not published; its ``tokens_hash`` is
  ``compute_block_hash_for_seq(block tokens, block_size, lora_name=...)[0]`` (XXH3, seed 1337), its
  ``block_hash`` the external hash, the event's ``parent_hash`` the parent's external hash.  ``lora_id``
  and ``group_idx`` are ignored; ``AllBlocksCleared`` clears the worker (every tier, as the standalone
  indexer does).  The tree skips (logs) a stored event whose parent it does not hold.
* Tiers: only ``device`` blocks reach the tree Dynamo's router scores by default (its ``scores``); the
  others go to lower-tier indexers (``lib/kv-router/src/indexer/lower_tier.rs``), reported per tier
  (``instances[...]["cpu" / "disk"]`` of the standalone indexer's ``/query``).  This view keeps one
  ``RadixTree`` per tier, so ``overlap(..., tier="host_pinned")`` answers the lower-tier question.

These rules were checked against the real listener of 1.6.1 (``python -m dynamo.indexer`` subscribed to a
vLLM ``ZmqEventPublisher``): the same events give the same trees and scores, and the drops above happen.

Not mirrored (refused with ``ValueError`` rather than guessed): ``extra_keys`` with content (multimodal
objects, cache salt), bigram (EAGLE) ``token_ids``.

Invariants: a batch is applied entirely or (undecodable) not at all; an event Dynamo drops leaves every
tree unchanged; ``overlap`` is ``find_matches`` over ``compute_block_hash_for_seq`` of the prompt, i.e. the
number of leading full blocks of the prompt the tree holds for that worker and DP rank.
"""

from __future__ import annotations

import json
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

StorageTier = Literal["device", "host_pinned", "disk", "external"]

#: ``StorageTier::from_kv_medium`` of Dynamo 1.6.1 (``lib/kv-router/src/protocols.rs``); absent: ``device``.
MEDIUM_TIERS: dict[str, StorageTier] = {
    "GPU": "device", "DEVICE": "device",
    "CPU": "host_pinned", "CPU_PINNED": "host_pinned", "CPU_TIER1": "host_pinned",
    "CPU_TIER2": "disk", "DISK": "disk", "NVME": "disk", "STORAGE": "disk",
    "EXTERNAL": "external", "NETWORK": "external", "REMOTE": "external", "SHARED": "external",
}

_U64 = (1 << 64) - 1


class UndecodableBatch(ValueError):
    """Dynamo's listener fails to decode the batch (it logs "Failed to decode KvEventBatch" and drops it)."""


def external_hash(block_hash: bytes | int) -> int:
    """The u64 Dynamo keys a block by: an int as its u64 bit pattern, bytes as vLLM's
    ``maybe_convert_block_hash`` turns them into the int it publishes (the low 64 bits, big-endian)."""
    if isinstance(block_hash, int):
        return block_hash & _U64
    return int.from_bytes(block_hash, "big") & _U64


@dataclass
class Outcome:
    """What one :meth:`DynamoRouterView.apply` did: events applied per tier, events the conversion dropped
    (why), events the tree refused (its error: a stored block whose parent it does not hold, ...)."""

    applied: dict[StorageTier, int] = field(default_factory=dict)
    dropped: list[str] = field(default_factory=list)
    rejected: list[str] = field(default_factory=list)


class DynamoRouterView:
    """Dynamo's radix-tree index of vLLM instances' KV events (one ``RadixTree`` per storage tier).

    ``block_size``: the block size the workers register with Dynamo (``kv_block_size``).
    ``media``: when given, only events whose ``medium`` is in it (``None`` for an absent medium) are
    applied, after Dynamo's own gating: e.g. ``{"CPU"}`` to see what kvtier's host memory alone earns.
    ``accept_bytes_hashes``: Dynamo 1.6.1 rejects a batch with byte-string hashes; True converts them as
    vLLM does before publishing (:func:`external_hash`), to see what a fixed publisher would earn.
    """

    def __init__(self, block_size: int, *, media: Collection[str | None] | None = None,
                 accept_bytes_hashes: bool = False) -> None:
        self.block_size = block_size
        self.media = None if media is None else frozenset(media)
        self.accept_bytes_hashes = accept_bytes_hashes
        self._trees: dict[StorageTier, Any] = {}
        self._event_id = 0

    # ------------------------------------------------------------------ input

    def apply(self, worker_id: int, batch: Any, *, dp_rank: int | None = None) -> Outcome:
        """Apply one batch from ``worker_id``: a ``vllm.distributed.kv_events.KVEventBatch``, or its msgpack
        bytes as the ZMQ publisher sends them (the payload frame).  ``dp_rank``: the worker's data-parallel
        rank, by default the batch's ``data_parallel_rank`` (0 when absent).

        Raises :class:`UndecodableBatch` (nothing applied) where Dynamo's listener would drop the batch.
        """
        if isinstance(batch, (bytes, bytearray, memoryview)):
            import msgspec
            from vllm.distributed.kv_events import KVEventBatch

            try:
                batch = msgspec.msgpack.Decoder(KVEventBatch).decode(batch)
            except msgspec.DecodeError as e:
                raise UndecodableBatch(str(e)) from e
        rank = dp_rank if dp_rank is not None else (batch.data_parallel_rank or 0)
        converted = [self._convert(ev) for ev in batch.events]  # all-or-nothing: convert before applying
        out = Outcome()
        for tier, payload, why in converted:
            if tier is None or payload is None:
                out.dropped.append(why)
                continue
            # AllBlocksCleared (device placement) empties the worker's lower tiers too, as the indexer does
            for t in (list(self._trees) or [tier]) if payload["data"] == "cleared" else [tier]:
                self._event_id += 1
                payload["event_id"] = self._event_id
                payload["dp_rank"] = rank
                try:
                    self._tree(t).apply_event(worker_id, json.dumps(payload).encode())
                except RuntimeError as e:  # e.g. an unknown parent: Dynamo logs it and skips the event
                    out.rejected.append(str(e))
                    continue
                out.applied[tier] = out.applied.get(tier, 0) + 1
        return out

    def apply_all(self, worker_id: int, batches: Iterable[Any]) -> list[Outcome]:
        return [self.apply(worker_id, b) for b in batches]

    def remove_worker(self, worker_id: int) -> None:
        for tree in self._trees.values():
            tree.remove_worker(worker_id)

    # ------------------------------------------------------------------ queries

    def overlap(self, worker_id: int, token_ids: Sequence[int], block_size: int | None = None, *,
                tier: StorageTier = "device", dp_rank: int = 0, lora_name: str | None = None) -> int:
        """Leading blocks of ``token_ids`` Dynamo scores for ``worker_id`` in ``tier`` (``device``: the tree
        its router scores by default)."""
        tree = self._trees.get(tier)
        if tree is None:
            return 0
        from dynamo._core import compute_block_hash_for_seq

        hashes = compute_block_hash_for_seq(list(token_ids), block_size or self.block_size, lora_name=lora_name)
        scores: dict[Any, int] = tree.find_matches(hashes).scores
        return int(scores.get((worker_id, dp_rank), 0))

    def dump(self, tier: StorageTier = "device") -> list[dict[str, Any]]:
        """The tier's tree as Dynamo's own events (``RadixTree.dump_tree_as_events``), decoded."""
        tree = self._trees.get(tier)
        return [] if tree is None else [json.loads(e) for e in tree.dump_tree_as_events()]

    # ------------------------------------------------------------------ conversion (convert.rs)

    def _tree(self, tier: StorageTier) -> Any:
        if tier not in self._trees:
            from dynamo._core import RadixTree

            self._trees[tier] = RadixTree()
        return self._trees[tier]

    def _hash(self, h: Any) -> int:
        if isinstance(h, int) and not isinstance(h, bool) and -(1 << 63) <= h <= _U64:
            return h & _U64
        if isinstance(h, (bytes, bytearray)) and self.accept_bytes_hashes:
            return external_hash(bytes(h))
        raise UndecodableBatch(f"data did not match any variant of untagged enum BlockHashValue: {h!r}")

    def _convert(self, ev: Any) -> tuple[StorageTier | None, dict[str, Any] | None, str]:
        """(tier, Dynamo ``KvCacheEvent`` JSON without id / rank, why dropped) of one vLLM event."""
        kind = type(ev).__name__
        if kind == "AllBlocksCleared":
            return "device", {"data": "cleared"}, ""
        if kind not in ("BlockStored", "BlockRemoved"):
            raise UndecodableBatch(f"unknown variant {kind!r}")
        hashes = [self._hash(h) for h in ev.block_hashes]
        parent = None
        if kind == "BlockStored":
            parent = None if ev.parent_block_hash is None else self._hash(ev.parent_block_hash)
            if ev.token_ids and not isinstance(ev.token_ids[0], int):
                raise ValueError("bigram (EAGLE) token_ids are not mirrored")
            if any(k for k in (getattr(ev, "extra_keys", None) or ())):
                raise ValueError("extra_keys (multimodal objects, cache salt) are not mirrored")
        medium = ev.medium or None  # normalize_medium: "" is absent
        locality = getattr(ev, "locality", None)
        if locality is not None and locality != "LOCAL":
            return None, None, f"locality {locality!r} (not LOCAL)"
        tier: StorageTier | None = "device" if medium is None else MEDIUM_TIERS.get(medium)
        if tier is None:
            return None, None, f"unknown medium {medium!r}"
        if self.media is not None and medium not in self.media:
            return None, None, f"medium {medium!r} filtered out by this view"
        if kind == "BlockRemoved":
            return tier, {"data": {"removed": {"block_hashes": hashes}}}, ""
        if len(set(hashes) | ({parent} if parent is not None else set())) != len(hashes) + (parent is not None):
            return tier, {"data": {"removed": {"block_hashes": []}}}, ""  # self-referencing: a no-op
        return tier, {"data": {"stored": {"parent_hash": parent, "start_position": None,
                                          "blocks": self._blocks(ev, hashes)}}}, ""

    def _blocks(self, ev: Any, hashes: list[int]) -> list[dict[str, Any]]:
        from dynamo._core import compute_block_hash_for_seq

        blocks: list[dict[str, Any]] = []
        tokens: list[int] = list(ev.token_ids)
        for i, h in enumerate(hashes):
            # create_stored_blocks: every block of the event has the event's block_size
            if ev.block_size != self.block_size or (i + 1) * self.block_size > len(tokens):
                break
            part = tokens[i * self.block_size:(i + 1) * self.block_size]
            local = compute_block_hash_for_seq(part, self.block_size, lora_name=ev.lora_name)[0]
            blocks.append({"block_hash": h, "tokens_hash": local, "mm_extra_info": None})
        return blocks
