"""Quotas per namespace, and per ``cache_salt`` tenant within one, in a shared backend (``backends[i].quota``):
the bytes each namespace this deployment writes may hold there, and each tenant of it, so deployments
sharing a directory, a Redis or a bucket, and tenants sharing one deployment, each keep to their share.

A share (:class:`Share`) is a namespace's untenanted blocks, or one tenant's blocks in a namespace: a put
charges a block to the tenant its request was salted for (``StorageBackend.put(..., tenants=)``, the tag
``kvtier.keys.tenant_tag(cache_salt)``), to its namespace otherwise.  A share over its quota loses its own
least recently used (or, where a backend knows no use, oldest) blocks, never another share's: the
backend deletes them after the put that took it over and tells the stack (``on_evicted``), as it does for
its own capacity evictions.

Invariants:
* Only the shares a backend instance writes are bounded by it, each separately (every TP rank's and KV
  cache group's namespace, and every tenant in each, has the whole quota); the count is the stored
  values' bytes (header included), as ``kvtier inspect`` shows them.  A namespace's untenanted share never
  counts its tenants' blocks, nor a tenant's share another tenant's: a share's trim removes only its own.
* The exact count is the backend's own listing of the share (``StorageBackend._share_blocks``), taken at
  the first put of a share, then when this process's estimate (the last count plus what this process
  wrote since) goes over the quota, but not before ``quota / SLACK`` bytes were written here since the
  last count: a listing per 1/16 of the quota written, never per put.  A count that finds the share over
  its quota removes blocks down to ``quota - quota // SLACK`` (a low-water mark).  So a share may exceed
  its quota by what this process wrote in the last 1/16 of a quota (a count found it just within), and
  by what other processes writing it wrote since this one counted (each of them counts too).
* Counting and trimming never fail a put: a backend error there is logged (without a key) and the next
  put over the estimate tries again.  One thread counts a share at a time; the others' puts only add to
  the estimate.
* Quotas protect a share from another's capacity evictions only where the backend's own eviction knows
  them (``local_disk`` records them in its directory's index and skips the blocks of a share within its
  quota); in Redis (``maxmemory``) and S3 (no eviction, or lifecycle rules) they protect by keeping every
  deployment and tenant that has one within it: size them so their sum fits the store.
* A backend counts tenants only if it can list a tenant's blocks (``StorageBackend.counts_tenants``):
  ``local_disk`` (a tenant column in its index), ``redis`` (a sorted set of block hashes per tenant) and
  ``s3`` (a zero-byte marker object per tenant block) do.  The stored blocks, their keys and the namespace
  digest are the same with or without a tenant: the tenant is bookkeeping beside them, which
  ``local_disk`` loses when its index is rebuilt from the files (the blocks then count as untenanted),
  Redis when a tenant's set is evicted, and Redis or S3 for the blocks whose record failed after their
  put (logged and counted in ``stats().tenants_unrecorded``; the put stands).  A backend that does not
  count tenants charges their blocks to their namespace, and says so once in the log, never silently.
* A tenant of its own namespace (``security.tenant_namespace``: the tenant's tag is a field of the
  namespace digest) needs no tenant share: its namespace is its share.
"""

from __future__ import annotations

import logging
import re
import threading
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

#: The low-water mark: a share found over its quota is trimmed to ``quota - quota // SLACK``.
SLACK = 16
#: A tenant tag as ``kvtier.keys.tenant_tag`` makes it (kept in step with ``Namespace.tenant``'s check).
TENANT_TAG = re.compile(r"[0-9a-f]{16}")


@dataclass(frozen=True, order=True)
class Share:
    """What a quota bounds: the untenanted blocks of a namespace (``tenant`` None), or one tenant's blocks in
    it (``tenant``: its tag)."""

    namespace: str
    tenant: str | None = None

    def __str__(self) -> str:
        return self.namespace if self.tenant is None else f"{self.namespace} tenant {self.tenant}"


def tenant_problem(tenant: object) -> str | None:
    """Why ``tenant`` is no tenant tag (None when it is one)."""
    if isinstance(tenant, str) and TENANT_TAG.fullmatch(tenant):
        return None
    return f"expected a tenant tag of 16 hex digits (kvtier.keys.tenant_tag(cache_salt)), got {tenant!r}"


@dataclass
class QuotaKeeper:
    """The quota of every share one backend instance writes.  ``blocks(share)`` lists a share's blocks as
    (key, size), least recently used first; ``remove(share, keys)`` deletes those of its blocks and tells
    the stack."""

    limit: int
    blocks: Callable[[Share], Iterable[tuple[str, int]]]
    remove: Callable[[Share, list[str]], None]
    estimate: dict[Share, int] = field(default_factory=dict)  # bytes, per this process
    since: dict[Share, int] = field(default_factory=dict)  # bytes written here since its count
    counting: set[Share] = field(default_factory=set)
    trimmed: int = 0  # blocks removed to keep a share within its quota, since start-up
    lock: threading.Lock = field(default_factory=threading.Lock)

    @property
    def low_water(self) -> int:
        return self.limit - self.limit // SLACK

    def wrote(self, written: Iterable[tuple[str, int]], tenants: Mapping[str, str] | None = None) -> None:
        """After a put: ``written`` is (key, stored bytes) of each value it stored, ``tenants`` the tenant
        each tenant's key was charged to (the others: their namespace's).  Counts and trims a share the
        estimate says is over its quota (on this thread)."""
        due = []
        charged = tenants or {}
        with self.lock:
            per_share: dict[Share, int] = {}
            for key, size in written:
                share = Share(key.partition("/")[0], charged.get(key))
                per_share[share] = per_share.get(share, 0) + size
            for share, n in per_share.items():
                est = self.estimate.get(share)
                since = self.since.get(share, 0) + n
                self.since[share] = since
                if est is not None:
                    self.estimate[share] = est + n
                # Not before quota / SLACK bytes more were written here: a count that found the share
                # within its quota (something else removed blocks) must not be repeated at every put.
                over = est is None or (est + n > self.limit and since >= self.limit // SLACK)
                if over and share not in self.counting:
                    self.counting.add(share)
                    due.append(share)
        for share in due:
            try:
                self._count(share)
            except Exception as e:  # noqa: BLE001 - never fails the put that wrote the blocks
                log.warning("quota of namespace %s: could not count or trim it (%s); trying again at a later "
                            "put", share, type(e).__name__)
            finally:
                with self.lock:
                    self.counting.discard(share)

    def _count(self, share: Share) -> None:
        listed = list(self.blocks(share))
        total = sum(size for _, size in listed)
        victims: list[str] = []
        if total > self.limit:
            for key, size in listed:
                if total <= self.low_water:
                    break
                victims.append(key)
                total -= size
        if victims:
            self.remove(share, victims)
        with self.lock:
            self.estimate[share] = total
            self.since[share] = 0
            self.trimmed += len(victims)
