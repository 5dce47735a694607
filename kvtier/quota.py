"""Quotas per namespace in a shared backend (``backends[i].quota``): the bytes each namespace this deployment
writes may hold there, so deployments sharing a directory, a Redis or a bucket each keep to their share.

A namespace over its quota loses its own least recently used (or, where a backend knows no use, oldest)
blocks, never another namespace's: the backend deletes them after the put that took it over and tells the
stack (``on_evicted``), as it does for its own capacity evictions.

Invariants:
* Only the namespaces a backend instance writes are bounded by it, each separately (every TP rank's and
  KV cache group's namespace has the whole quota); the count is the stored values' bytes (header
  included), as ``kvtier inspect`` shows them.
* The exact count is the backend's own listing of the namespace (``StorageBackend._namespace_blocks``),
  taken at the first put of a namespace, then when this process's estimate (the last count plus what
  this process wrote since) goes over the quota, but not before ``quota / SLACK`` bytes were written here
  since the last count: a listing per 1/16 of the quota written, never per put.  A count that finds the
  namespace over its quota removes blocks down to ``quota - quota // SLACK`` (a low-water mark).  So a
  namespace may exceed its quota by what this process wrote in the last 1/16 of a quota (a count found
  it just within), and by what other processes writing it wrote since this one counted (each of them
  counts too).
* Counting and trimming never fail a put: a backend error there is logged (without a key) and the next
  put over the estimate tries again.  One thread counts a namespace at a time; the others' puts only add
  to the estimate.
* Quotas protect a namespace from another's capacity evictions only where the backend's own eviction
  knows them (``local_disk`` records them in its directory's index and skips the blocks of a namespace
  within its quota); in Redis (``maxmemory``) and S3 (no eviction, or lifecycle rules) they protect by
  keeping every deployment that has one within it: size them so their sum fits the store.
* Quotas are per namespace.  A value's ``cache_salt`` tenant is in its namespace only when its deployment
  asks for it (``security.tenant_namespace``: the tenant's tag is a field of the namespace digest, so
  every key says which tenant it is charged to); then each tenant deployment has its own quota.  Without
  it tenants of one model share their namespace's quota.  One process serving requests of several salts
  charges them all to its one namespace: a request's salt is folded into its block hashes, which no
  listing can read back.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

#: The low-water mark: a namespace found over its quota is trimmed to ``quota - quota // SLACK``.
SLACK = 16


@dataclass
class QuotaKeeper:
    """The quota of every namespace one backend instance writes.  ``blocks(ns)`` lists a namespace's
    blocks as (key, size), least recently used first; ``remove(keys)`` deletes them and tells the stack."""

    limit: int
    blocks: Callable[[str], Iterable[tuple[str, int]]]
    remove: Callable[[list[str]], None]
    estimate: dict[str, int] = field(default_factory=dict)  # namespace id -> bytes, per this process
    since: dict[str, int] = field(default_factory=dict)  # namespace id -> bytes written here since its count
    counting: set[str] = field(default_factory=set)
    trimmed: int = 0  # blocks removed to keep a namespace within its quota, since start-up
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def low_water(self) -> int:
        return self.limit - self.limit // SLACK

    def wrote(self, written: Iterable[tuple[str, int]]) -> None:
        """After a put: ``written`` is (key, stored bytes) of each value it stored.  Counts and trims a
        namespace the estimate says is over its quota (on this thread)."""
        due = []
        with self.lock:
            per_ns: dict[str, int] = {}
            for key, size in written:
                ns = key.partition("/")[0]
                per_ns[ns] = per_ns.get(ns, 0) + size
            for ns, n in per_ns.items():
                est = self.estimate.get(ns)
                since = self.since.get(ns, 0) + n
                self.since[ns] = since
                if est is not None:
                    self.estimate[ns] = est + n
                # Not before quota / SLACK bytes more were written here: a count that found the namespace
                # within its quota (something else removed blocks) must not be repeated at every put.
                over = est is None or (est + n > self.limit and since >= self.limit // SLACK)
                if over and ns not in self.counting:
                    self.counting.add(ns)
                    due.append(ns)
        for ns in due:
            try:
                self._count(ns)
            except Exception as e:  # noqa: BLE001 - never fails the put that wrote the blocks
                log.warning("quota of namespace %s: could not count or trim it (%s); trying again at a later put",
                            ns, type(e).__name__)
            finally:
                with self.lock:
                    self.counting.discard(ns)

    def _count(self, ns: str) -> None:
        listed = list(self.blocks(ns))
        total = sum(size for _, size in listed)
        victims: list[str] = []
        if total > self.limit:
            for key, size in listed:
                if total <= self.low_water:
                    break
                victims.append(key)
                total -= size
        if victims:
            self.remove(victims)
        with self.lock:
            self.estimate[ns] = total
            self.since[ns] = 0
            self.trimmed += len(victims)
