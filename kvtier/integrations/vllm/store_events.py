"""The KV events of shared stores that no engine instance owns: what ``kvtier events`` publishes.

A Redis, an S3 bucket or a directory shared by many vLLM instances holds blocks any of them can load.  Each
instance's connector announces only what it wrote or saw go (``events.TierEvents``); a router that wants
to know what the shared store holds, whoever wrote it and whatever removed it, listens to ``kvtier
events`` instead: it watches the store's backends and turns what they hold into the same vLLM
``BlockStored`` / ``BlockRemoved`` events as the connector's (``events``: ``medium`` STORAGE, ``ownership``
``kvtier:<backend type>``, ``locality`` REMOTE for a network store and LOCAL for a directory).

Two sources, because no backend tells everything:

* **notices**: what a backend says it lost as it happens (Redis ``maxmemory`` evictions and TTL expiries
  through its keyevent listener; a local_disk directory's removal journal: another process's evictions,
  ``kvtier gc``, ``verify --fix``), told within about a second;
* **reconcile**: every ``reconcile_s`` each backend is listed (``scan``) and compared with what was
  announced: new blocks are announced stored, vanished ones removed (an S3 delete, a Redis ``DEL``, a
  block written since the last listing).  A store is therefore seen whole within one period.

Invariants:

* A block is announced stored in a backend only after a listing found it there; once a notice or a
  listing says it is gone, it is announced removed, once.
* A notice that arrives while a listing runs wins over that listing (the listing may have seen the block
  before it went): a block is never re-announced from a stale listing.
* A backend that cannot be listed is announced empty (every block announced there removed) until it
  lists again: a load from it would fail, so nothing there is offered meanwhile.
* One namespace (one model and layout) per publisher: vLLM's events carry no model, so a router reads one
  stream per model.  Block hashes are the keys' hashes: vLLM's own with ``keys.algo: sha256_cbor``.
  Values record no tokens, so ``token_ids`` is empty and ``parent_block_hash`` unset.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Sequence
from dataclasses import dataclass
from functools import partial
from typing import Any

from ...backend_api import StorageBackend
from ...plans import WorkerReport
from .events import Medium, TierEvents

log = logging.getLogger("kvtier.events")

#: Events per published batch: a first listing of millions of blocks goes out in pieces a subscriber can take.
BATCH_EVENTS = 1000


@dataclass(frozen=True)
class WatchedBackend:
    """A backend whose blocks are published, by its name and kind in the config."""

    name: str
    kind: str
    backend: StorageBackend

    @property
    def medium(self) -> Medium:
        return Medium.of_backend(self.kind)


class StoreEvents:
    """What the watched backends hold of ``namespace_id``, as vLLM KV events (``take``)."""

    def __init__(self, backends: Sequence[WatchedBackend], namespace_id: str, block_size: int):
        self.backends = list(backends)
        self.namespace_id = namespace_id
        self._prefix = namespace_id + "/"
        self.events = TierEvents([b.kind for b in backends], block_size)
        self._lock = threading.Lock()
        self._known: list[set[bytes]] = [set() for _ in backends]
        self._gone_while_listing: list[set[bytes] | None] = [None for _ in backends]
        self.failed: list[str | None] = [None for _ in backends]  # why a backend's last listing failed
        for i, b in enumerate(backends):
            b.backend.on_evicted = partial(self._gone, i)

    def _hashes(self, keys: Sequence[str]) -> list[bytes]:
        out = []
        for k in keys:
            if k.startswith(self._prefix):
                try:
                    out.append(bytes.fromhex(k[len(self._prefix):]))
                except ValueError:  # a manifest, or another application's key
                    continue
        return out

    def _gone(self, i: int, keys: list[str]) -> None:
        """A backend's notice: ``keys`` left it (its own eviction, expiry, another process's delete)."""
        hashes = self._hashes(keys)
        with self._lock:
            during = self._gone_while_listing[i]
            for h in hashes:
                if during is not None:
                    during.add(h)
                if h in self._known[i]:
                    self._known[i].discard(h)
                    self.events.forgotten(0, h, i)

    def reconcile(self) -> dict[str, tuple[int, int]]:
        """List every backend and announce the difference: per backend name, (stored, removed) announced."""
        out: dict[str, tuple[int, int]] = {}
        for i, b in enumerate(self.backends):
            with self._lock:
                self._gone_while_listing[i] = set()
            try:
                present = set(self._hashes([blk.key for blk in b.backend.scan(self.namespace_id)]))
            except Exception as e:  # noqa: BLE001 - a store that cannot be listed is announced empty, not fatal
                why = f"{type(e).__name__}: {e}"
                if self.failed[i] != why:
                    log.warning("kvtier events: backend %r (%s) cannot be listed (%s): its blocks are announced "
                                "removed until it lists again", b.name, b.kind, why)
                self.failed[i] = why
                with self._lock:
                    self._gone_while_listing[i] = None
                    n = len(self._known[i])
                    self._known[i] = set()
                self.events.backend_reset(0, i)
                out[b.name] = (0, n)
                continue
            if self.failed[i] is not None:
                log.warning("kvtier events: backend %r lists again", b.name)
                self.failed[i] = None
            with self._lock:
                present -= self._gone_while_listing[i] or set()
                self._gone_while_listing[i] = None
                stored, removed = present - self._known[i], self._known[i] - present
                self._known[i] = present
            self.events.record(WorkerReport(in_backend={(h, i) for h in stored},
                                            left_backend={(h, i) for h in removed}))
            out[b.name] = (len(stored), len(removed))
        return out

    def take(self) -> list[list[Any]]:
        """The events since the last call, in batches of at most ``BATCH_EVENTS``."""
        evs = self.events.take()
        return [evs[j:j + BATCH_EVENTS] for j in range(0, len(evs), BATCH_EVENTS)]


__all__ = ["BATCH_EVENTS", "StoreEvents", "WatchedBackend"]
