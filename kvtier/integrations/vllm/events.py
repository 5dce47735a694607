"""kvtier's tiers in vLLM's KV event stream: what a KV-aware router needs to see beyond vLLM's own blocks.

vLLM publishes ``BlockStored`` / ``BlockRemoved`` batches (``--kv-events-config``); a connector adds its own
through ``take_events()``, which vLLM calls on its scheduler side once a step.  kvtier's scheduler side
learns what its workers hold from their reports (folded across TP ranks: a block counts once every rank
holds it) and from backends' own eviction notices, and turns each change into an event:

* ``BlockStored`` when a block becomes loadable from a tier: landed in host memory, written to a backend;
* ``BlockRemoved`` when it stops being: dropped from host memory, evicted by a backend (its own LRU, a
  Redis ``maxmemory`` / TTL notice, another process's eviction or delete in a shared local_disk directory:
  another instance, ``kvtier gc``, ``verify --fix``, read from the directory's removal journal), found
  missing or corrupt by a load (removed from every tier it was announced in), or in a backend that answers
  again after an outage (it may have come back empty: every block announced there is removed, and
  announced again as it is written again).

The fields use vLLM's own vocabulary (``vllm.v1.kv_offload.base.Medium`` / ``Locality``), so that routers
which know vLLM's media take them (Dynamo 1.6.1 drops an event whose medium it does not know):
``medium`` is ``CPU`` for kvtier's host memory and ``STORAGE`` for every backend; ``ownership`` (vLLM:
"secondary offloading tier identifier") names the tier: ``kvtier:host``, ``kvtier:<backend type>``
(``kvtier:local_disk``, ``kvtier:redis``, ``kvtier:s3``, a plugin's type).  ``locality``: ``LOCAL`` for
host memory and local_disk (this instance, or its host, reads it), ``REMOTE`` for a network store every
instance can load from (Redis, S3).  Block hashes are kvtier's keys, which are vLLM's own
``request.block_hashes`` with ``keys.algo: sha256_cbor`` and vLLM's ``--prefix-caching-hash-algo
sha256_cbor``, published as vLLM publishes its own (``maybe_convert_block_hash``: the digest's last 8 bytes
as an integer, unless ``VLLM_KV_EVENTS_USE_INT_BLOCK_HASHES=0``); ``group_idx`` is the KV cache group (0
for a one-group model).

Invariants: a block is announced stored in a medium at most once until it is announced removed there; a
removal is sent only for a block announced in that medium (the announced set keeps the latest
``max_tracked`` blocks: older ones are forgotten, and their removal is not sent).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Any

from ...plans import HostChanges, WorkerReport

#: ``medium`` of kvtier's host memory and of its backends (vLLM's ``Medium.CPU`` / ``Medium.STORAGE``).
HOST_MEDIUM = "CPU"
STORAGE_MEDIUM = "STORAGE"
#: Backend kinds whose values every instance can load (``locality`` REMOTE); any other is LOCAL.
SHARED_KINDS = frozenset({"redis", "s3"})


@dataclass(frozen=True)
class Medium:
    """Where a block is loadable from, as an event names it (``medium``, ``locality``, ``ownership``)."""

    name: str
    locality: str
    ownership: str

    @classmethod
    def of_backend(cls, kind: str) -> Medium:
        return cls(STORAGE_MEDIUM, "REMOTE" if kind in SHARED_KINDS else "LOCAL", f"kvtier:{kind}")


HOST = Medium(HOST_MEDIUM, "LOCAL", "kvtier:host")


@dataclass(frozen=True)
class BlockInfo:
    """What a ``BlockStored`` event says of a block besides its hash (learnt when the scheduler planned it)."""

    parent: bytes | None
    token_ids: tuple[int, ...]
    order: int  # when it was learnt: a chain's blocks in prefix order


class TierEvents:
    """The events of one instance's scheduler side, per KV cache group, until vLLM takes them."""

    def __init__(self, backend_kinds: list[str], block_size: int, *, max_tracked: int = 1 << 20):
        self.backends = [Medium.of_backend(k) for k in backend_kinds]
        self.block_size = block_size
        self.max_tracked = max_tracked
        self._lock = threading.Lock()
        self._pending: list[Any] = []
        # (group, hash) -> media it is announced in; insertion order = age (oldest first)
        self._announced: OrderedDict[tuple[int, bytes], set[Medium]] = OrderedDict()
        self._info: OrderedDict[bytes, BlockInfo] = OrderedDict()
        self._learnt = 0

    def learn(self, hashes: Iterable[bytes], tokens: Sequence[int], start: int, parent: bytes | None) -> None:
        """Token ids and parents of blocks about to be stored (``hashes[0]`` is block ``start`` of ``tokens``,
        its parent ``parent``): a ``BlockStored`` event carries them."""
        with self._lock:
            prev = parent
            for j, h in enumerate(hashes):
                i = start + j
                self._learnt += 1
                self._info[h] = BlockInfo(prev, tuple(tokens[i * self.block_size:(i + 1) * self.block_size]),
                                          self._learnt)
                self._info.move_to_end(h)
                prev = h
            while len(self._info) > self.max_tracked:
                self._info.popitem(last=False)

    def record(self, report: WorkerReport, group: int = 0, host: HostChanges | None = None) -> None:
        """The changes a folded worker report says happened in ``group``'s backends, and ``host``, what the
        scheduler placed in and dropped from host memory."""
        stored: dict[Medium, list[bytes]] = {}
        removed: dict[Medium, list[bytes]] = {}
        with self._lock:
            if host is not None:
                for h in host.in_host:
                    self._add(stored, HOST, group, h)
                for h in host.left_host:
                    self._drop(removed, HOST, group, h)
            for h, i in sorted(report.in_backend, key=lambda p: p[1]):
                self._add(stored, self.backends[i], group, h)
            for h, i in report.left_backend:
                self._drop(removed, self.backends[i], group, h)
            for h in report.lost:
                for m in list(self._announced.get((group, h), ())):
                    self._drop(removed, m, group, h)
            self._emit(stored, removed, group)

    def forgotten(self, group: int, block_hash: bytes, backend: int) -> None:
        """A backend evicted ``block_hash`` on its own (its notice reached this process's manager)."""
        removed: dict[Medium, list[bytes]] = {}
        with self._lock:
            self._drop(removed, self.backends[backend], group, block_hash)
            self._emit({}, removed, group)

    def backend_reset(self, group: int, backend: int) -> None:
        """Backend ``backend`` answers again after an outage or a restart and may have come back empty: no
        block is known to be loadable there any more (``TierManager.on_backend_back``)."""
        removed: dict[Medium, list[bytes]] = {}
        m = self.backends[backend]
        with self._lock:
            for g, h in [k for k, media in self._announced.items() if k[0] == group and m in media]:
                self._drop(removed, m, g, h)
            self._emit({}, removed, group)

    def take(self) -> list[Any]:
        with self._lock:
            out, self._pending = self._pending, []
        return out

    # ------------------------------------------------------------------ internals (under the lock)

    def _add(self, out: dict[Medium, list[bytes]], m: Medium, group: int, h: bytes) -> None:
        media = self._announced.setdefault((group, h), set())
        if m in media:
            return
        media.add(m)
        self._announced.move_to_end((group, h))
        out.setdefault(m, []).append(h)
        while len(self._announced) > self.max_tracked:
            self._announced.popitem(last=False)

    def _drop(self, out: dict[Medium, list[bytes]], m: Medium, group: int, h: bytes) -> None:
        media = self._announced.get((group, h))
        if media is None or m not in media:
            return
        media.discard(m)
        if not media:
            del self._announced[(group, h)]
        out.setdefault(m, []).append(h)

    def _emit(self, stored: dict[Medium, list[bytes]], removed: dict[Medium, list[bytes]], group: int) -> None:
        from vllm.distributed.kv_events import BlockRemoved, BlockStored
        from vllm.v1.core.kv_cache_utils import BlockHash, maybe_convert_block_hash

        def ext(h: bytes) -> Any:  # int (vLLM's default), or the bytes themselves
            return maybe_convert_block_hash(BlockHash(h))

        for m, hashes in removed.items():
            self._pending.append(BlockRemoved(block_hashes=[ext(h) for h in hashes], medium=m.name, group_idx=group,
                                              locality=m.locality, ownership=m.ownership))
        unknown = self._learnt + 1
        for m, hashes in stored.items():
            # One event per block: a report's blocks need not be one chain (vLLM's own events are runs of a
            # chain, each naming its first block's parent).  Parents first, in the order the blocks were
            # planned: a router's tree (Dynamo's) skips a block whose parent it has not seen.
            hashes.sort(key=lambda h: info.order if (info := self._info.get(h)) is not None else unknown)
            for h in hashes:
                info = self._info.get(h)
                parent = info.parent if info else None
                self._pending.append(BlockStored(
                    block_hashes=[ext(h)], parent_block_hash=ext(parent) if parent is not None else None,
                    token_ids=list(info.token_ids) if info else [], block_size=self.block_size, lora_id=None,
                    medium=m.name, lora_name=None, group_idx=group, locality=m.locality, ownership=m.ownership))
