"""The storage backend contract: what a third party subclasses to add a tier below host memory.

A backend stores *values* under string keys ``<namespace id>/<block hash hex>``.  Each value is one
stored block (``kvtier.format.blockformat``): header + payload, written and replaced atomically as one unit
(one file, one Redis key, one S3 object).  The public methods here do the framing, the verification,
the metrics and the error typing once, for every backend; a backend implements the ``_underscore`` hooks.

Invariants:
* ``get_into`` never reports ok for a value whose header or checksum does not match what was asked
  for; such a value is counted as corrupt and deleted.
* A put's payload may be one buffer or :class:`kvtier.format.blockformat.Segments` (one payload in several
  buffers, in order: a value of several engine blocks put from the host slots that hold them).  Either
  way the stored value is the same bytes: the header (checksum or seal over the payload's bytes back to
  back), then the payload.  Only a backend that ``writes_segments`` is handed segments; for any other
  ``put`` joins them into one buffer first (the one copy it cannot avoid for that backend).
* A backend given a seal (``secure``: security mode ``authenticate`` / ``encrypt``, ``kvtier.security``)
  writes only sealed values (format version 2) and serves only values its seal opens; one it does not
  is counted as ``forged`` (or corrupt, when its framing is damaged) and deleted.  Hooks frame and check
  through ``_frame`` / ``_verify`` (never ``frame`` / ``verify`` directly), so the mode holds in every
  backend's own workers too.
* Public methods raise only ``BackendError`` subclasses, each naming the backend and a key; the stack
  turns them into misses / skipped stores / metrics, so a backend fault never reaches the engine.
* No hook ever sees a key that is not canonical (``kvtier.keys.invalid_key``: lower-case hex, no path
  parts, nothing else).  Every public method that takes keys or a namespace id checks them all first and
  refuses the whole call with ``InvalidKey`` (a ``BackendError`` and a ``ValueError``) naming the backend
  and the key; nothing is read, written, counted or treated as a miss.  A malformed key is the caller's
  bug, and a miss would hide it.
* A backend given a quota (``limit``) keeps each share it writes within it after every put (a namespace's
  untenanted blocks, or one ``cache_salt`` tenant's: ``put(..., tenants=)``), by deleting that share's own
  least recently used blocks (``kvtier.quota``); a put never fails for it.  A put's tenants change no
  key and no stored byte: a hook that records them (``counts_tenants``) reads them with ``_put_tenant``
  in the thread that called ``put``, beside the write, never in it, or is handed them after the put
  (``_record_tenants``); a record that fails is logged and counted (``stats().tenants_unrecorded``), and
  the put stands (those blocks then count as their namespace's).  A trim of a tenant's share deletes
  with its tenant readable the same way (``_put_tenant`` in ``_delete``), so a backend can drop its
  record of those blocks in the same call.
* All public methods are thread-safe if the hooks are.
"""

from __future__ import annotations

import contextlib
import errno
import logging
import os
import socket
import ssl
import threading
import time
from abc import ABC, abstractmethod
from collections.abc import Callable, Collection, Iterable, Iterator, Mapping, Sequence
from contextvars import ContextVar
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any, ClassVar, Self, TypeVar

from pydantic import BaseModel, ConfigDict

from .format import blockformat
from .keys import MANIFEST_NAME, invalid_key, show_key, split_key
from .plugins import strict_options
from .quota import QuotaKeeper, Share, tenant_problem
from .security import Forged, Seal

if TYPE_CHECKING:
    from .keys import Namespace

T = TypeVar("T")
log = logging.getLogger("kvtier.backend_api")

_BISECT_MIN = 8  # shorter chains are probed whole: a few parallel requests beat a sequential search
# The tenant each key of the put running in this thread (or task) is charged to (``StorageBackend.put``'s
# ``tenants``): a context variable, so the write hooks' signatures stay what they are.
_PUT_TENANTS: ContextVar[Mapping[str, str] | None] = ContextVar("kvtier_put_tenants", default=None)


class BackendError(Exception):
    """A backend operation failed.  ``backend`` is the instance name, ``key`` the first key involved."""

    def __init__(self, backend: str, key: str | None, message: str):
        self.backend, self.key = backend, key
        where = f"backend {backend!r}" + (f", key {show_key(key)}" if key is not None else "")
        super().__init__(f"{where}: {message}")


class InvalidKey(BackendError, ValueError):
    """A key (or namespace id) that is not canonical, refused before any I/O.  Also a ``ValueError``: it is
    the caller's bug, not the backend's fault."""


class BackendUnavailable(BackendError):
    """The backend cannot be reached (connection refused, server down, disk gone)."""


class BackendTimeout(BackendError):
    """The backend did not answer within its configured timeout."""


class BackendDiskFull(BackendError):
    """The storage has no room (ENOSPC, EDQUOT).  Retrying will not help until space is freed or the
    backend's ``capacity`` is lowered; counted in ``stats().disk_full``."""


class BackendPermissionDenied(BackendError):
    """The process may not use the storage (EACCES, EPERM, EROFS; S3 AccessDenied).  Retrying will not help
    until access is granted; counted in ``stats().permission_denied``."""


_DISK_FULL = {errno.ENOSPC: "no space left on the device", errno.EDQUOT: "disk quota exceeded"}
_DENIED = {errno.EACCES: "permission denied", errno.EPERM: "operation not permitted",
           errno.EROFS: "read-only filesystem"}


class BackendOptions(BaseModel):
    """Base of every backend's options (its YAML ``options:`` mapping).  Unknown keys are errors, also for
    a backend whose ``Options`` is a plain pydantic ``BaseModel`` (``kvtier.plugins.strict_options``)."""

    model_config = ConfigDict(extra="forbid")
    timeout_s: float = 5.0


@dataclass
class BackendStats:
    """Counters since start-up (``blocks`` / ``bytes`` / ``capacity_bytes`` are current usage)."""

    puts: int = 0
    put_bytes: int = 0
    put_failures: int = 0
    gets: int = 0
    hits: int = 0
    misses: int = 0
    get_bytes: int = 0
    get_failures: int = 0
    corrupt: int = 0
    forged: int = 0  # values a sealed backend refused: intact headers, but not sealed by this deployment
    deletes: int = 0
    disk_full: int = 0  # errors: no space / quota (BackendDiskFull, or a key of a batch that failed so)
    permission_denied: int = 0  # errors: access refused (BackendPermissionDenied, or such a key)
    unavailable: int = 0  # keys not answered: the backend (or the node holding them) was down or timed out
    restarts: int = 0  # times the store behind it was found restarted (a Redis node with a new run_id)
    tenants_unrecorded: int = 0  # stored keys whose cache_salt tenant a put could not record (_record_tenants)
    put_seconds: float = 0.0
    get_seconds: float = 0.0
    extra: dict[str, Any] = field(default_factory=dict)


def frame(key: str, payload: memoryview | blockformat.Segments, layout_id: int) -> bytes:
    """The stored header for ``payload`` (one buffer, or segments: the same header as for their bytes
    joined) under ``key``; thread-safe, hashes the payload without copying."""
    ns, h = split_key(key)
    return blockformat.encode_header(ns, h, layout_id, payload)


def verify(key: str, size: int, header: bytes | bytearray | memoryview, payload: memoryview | blockformat.Segments,
           layout_id: int) -> str | None:
    """Why a stored value of ``size`` bytes, read as (header, payload), is not ``key``'s block; None if it is.
    ``header``: the whole stored header as read (88 bytes, or 4096 for an aligned value)."""
    expected = _header_nbytes(header) + payload.nbytes
    if size != expected:
        return f"stored value is {size} bytes, expected {expected}"
    ns, h = split_key(key)
    return blockformat.check_block(header, payload, ns, h, layout_id)


def _put_view(payload: Any, segments: bool) -> memoryview | blockformat.Segments:
    """A payload handed to ``StorageBackend.put`` (any contiguous buffer, or
    :class:`kvtier.format.blockformat.Segments`: one payload in several buffers, stored as their bytes
    back to back) as the put's hooks take it: a byte view of a buffer; segments as they are when the
    backend ``writes_segments``, else joined into one buffer, one copy per value, so its hooks see one
    buffer as always (one part needs no copy: it is that part)."""
    if isinstance(payload, blockformat.Segments):
        return payload if segments and len(payload.parts) > 1 else payload.joined()
    return memoryview(payload).cast("B")


def _header_nbytes(header: bytes | bytearray | memoryview) -> int:
    """The stored length a version 1 header buffer stands for: its own length when it is one a header may
    have (88, or 4096 for an aligned value), else 88 (``check_block`` then says what is wrong with it)."""
    n = memoryview(header).nbytes
    return n if n in blockformat.HEADER_SIZES else blockformat.HEADER_SIZE


@dataclass
class StoredBlock:
    key: str
    size: int


class StorageBackend(ABC):
    """Base class of all storage backends.  Subclasses set ``Options`` and implement the hooks."""

    Options: ClassVar[type[BaseModel]] = BackendOptions  # or a plain BaseModel (BackendOptions says why)
    #: How ``contains_prefix`` probes a chain: "all" asks about every key in one batch (right when a batch
    #: is one round trip: files, Redis pipelines); "bisect" asks about O(log n) keys one at a time (right
    #: when every probe is a request of its own, as on S3).
    prefix_probe: ClassVar[str] = "all"
    #: Whether ``_get_blocks`` takes an ``on_verified`` callback and calls it for each key the moment
    #: that key's buffer holds verified bytes (in its own reading thread).  Otherwise ``get_into``
    #: reports the verified keys once the whole batch has been read.
    streams_verified: ClassVar[bool] = False
    #: Whether ``_put_blocks`` (and ``_write``, which the default ``_put_blocks`` calls) takes a
    #: :class:`kvtier.format.blockformat.Segments` in place of a payload buffer: one payload in several
    #: buffers, to be stored as their bytes back to back after the header (``os.writev``, a scatter-gather
    #: send), so a value of several engine blocks goes down from the host slots that hold them with no
    #: joined copy.  Otherwise ``put`` joins a value's segments into one buffer before any hook sees it,
    #: and a backend's hooks only ever get single buffers.
    writes_segments: ClassVar[bool] = False
    #: Whether ``_get_blocks`` takes a :class:`kvtier.format.blockformat.Segments` in place of a payload buffer
    #: (one payload in several buffers: read it into them in order, verify it with ``check_block``, which
    #: takes segments too).  Then ``get_into`` may be handed segments, and a CPU engine's blocks are read
    #: straight into its KV tensors, with no copy through host memory.
    reads_segments: ClassVar[bool] = False
    #: Whether the backend can list one ``cache_salt`` tenant's blocks of a namespace (``_share_blocks``),
    #: so a quota bounds each tenant separately (``kvtier.quota``).  A backend that cannot charges a
    #: tenant's blocks to its namespace, and says so once in the log.
    counts_tenants: ClassVar[bool] = False

    def __init__(self, options: BaseModel | dict[str, Any] | None = None, *, name: str | None = None):
        # A subclass declares ``options: <its Options>`` for the precise type (backends/s3.py does).
        self.options: BaseModel = options if isinstance(options, BaseModel) else (
            strict_options(self.Options).model_validate({} if options is None else options))
        self.name = name or type(self).__name__
        self._stats = BackendStats()
        self._lock = threading.Lock()
        self.seal: Seal | None = None
        self.quota: QuotaKeeper | None = None
        self._said_tenants = False  # logged once: this backend charges tenants to their namespaces

    def limit(self, quota_bytes: int | None) -> None:
        """Keep each namespace this instance writes within ``quota_bytes`` (``backends[i].quota``; None: no
        quota): see ``kvtier.quota``.  Set once, before the first put (the builders in ``kvtier.config``)."""
        self.quota = None if quota_bytes is None else QuotaKeeper(
            quota_bytes, lambda share: ((b.key, b.size) for b in self._call(lambda: list(self._share_blocks(share)))),
            self._trim)

    def _trim(self, share: Share, keys: list[str]) -> None:
        """Remove blocks of a share over its quota: deleted (a tenant's with their tenant readable by
        ``_put_tenant`` in ``_delete``), then told to the stack as an eviction."""
        mark = _PUT_TENANTS.set(None if share.tenant is None else dict.fromkeys(keys, share.tenant))
        try:
            self.delete(keys)
        finally:
            _PUT_TENANTS.reset(mark)
        self._evicted(keys)

    def secure(self, seal: Seal | None) -> None:
        """Seal what this backend writes and open what it reads (None: mode ``none``, format version 1).
        Set once, before the first call (the builders in ``kvtier.config`` do it)."""
        self.seal = seal

    @property
    def header_size(self) -> int:
        """Bytes of header before each stored payload in this backend's mode."""
        return blockformat.HEADER_SIZE if self.seal is None else self.seal.header_size

    @classmethod
    def stored_value_nbytes(cls, options: Any, payload_nbytes: int, sealed: bool) -> int:
        """Bytes one stored value of ``payload_nbytes`` takes in a backend of this class with ``options``
        (sealed: in mode authenticate or encrypt), without building one: what ``kvtier simulate``'s ledgers
        count against a capacity.  A backend that frames values its own way says so here."""
        return (blockformat.SEALED_HEADER_SIZE if sealed else blockformat.HEADER_SIZE) + payload_nbytes

    def _frame(self, key: str, payload: memoryview | blockformat.Segments,
               layout_id: int) -> tuple[bytes, memoryview | blockformat.Segments]:
        """(header, stored payload) for ``payload`` under ``key`` in this backend's mode; thread-safe.  The
        stored payload is ``payload`` itself (segments stay segments) except when encrypting (then one
        new buffer of ciphertext)."""
        if self.seal is None:
            return frame(key, payload, layout_id), payload
        return self.seal.seal(key, payload, layout_id)

    def _verify(self, key: str, size: int, header: bytes | bytearray | memoryview,
                payload: memoryview | blockformat.Segments, layout_id: int, checksum: int | None = None,
                stored: memoryview | None = None) -> str | None:
        """``verify`` in this backend's mode: why the value read is not to be served (a ``Forged`` reason
        for a sealed backend's refusal of an intact value), or None, then ``payload`` holds the block
        (decrypted in place when encrypting).  ``checksum``: the payload's xxh3-64 if the reader took it
        as it read (mode ``none`` only; a sealed value has none).  ``stored``: where the reader put the
        stored payload instead of ``payload`` (``self.seal.landing(payload)``, mode encrypt only)."""
        if self.seal is not None:
            return self.seal.open(key, size, header, payload, layout_id, stored)
        if checksum is None:
            return verify(key, size, header, payload, layout_id)
        expected = _header_nbytes(header) + payload.nbytes
        if size != expected:
            return f"stored value is {size} bytes, expected {expected}"
        ns, h = split_key(key)
        return blockformat.check_block(header, payload, ns, h, layout_id, checksum)

    # ------------------------------------------------------------------ hooks a backend implements

    @abstractmethod
    def _write(self, keys: Sequence[str], values: Sequence[tuple[bytes, memoryview]]) -> list[bool]:
        """Store each ``(header, payload)`` as one value (the header's bytes, then the payload's), replacing
        any old one atomically.  In a backend that ``writes_segments`` a payload may be a
        :class:`kvtier.format.blockformat.Segments`: its parts' bytes back to back are the payload."""

    @abstractmethod
    def _read_into(self, keys: Sequence[str], headers: Sequence[memoryview],
                   payloads: Sequence[memoryview]) -> list[int | None]:
        """For each key read the value's first ``len(header)`` bytes into ``header`` and the rest into
        ``payload``; return the value's full stored length (even when it does not fit), or None if
        the key is absent."""

    @abstractmethod
    def _exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is present (a cheap check; content is verified on read)."""

    @abstractmethod
    def _delete(self, keys: Sequence[str]) -> int:
        """Delete the keys; return how many existed."""

    @abstractmethod
    def _scan(self, prefix: str) -> Iterator[StoredBlock]:
        """Every stored key starting with ``prefix`` (blocks and manifests alike)."""

    def _read_small(self, key: str) -> bytes | None:
        """A whole small value (manifests); the default goes through ``_read_into``."""
        size = self._read_into([key], [memoryview(bytearray(0))], [memoryview(bytearray(0))])[0]
        if size is None:
            return None
        buf = bytearray(size)
        got = self._read_into([key], [memoryview(buf)[:0]], [memoryview(buf)])[0]
        return bytes(buf) if got == size else None

    def _write_small(self, key: str, data: bytes) -> None:
        """Store a small raw value (manifests); the default goes through ``_write``."""
        self._write([key], [(b"", memoryview(data))])

    def _put_blocks(self, keys: Sequence[str], payloads: Sequence[memoryview], layout_id: int) -> list[bool]:
        """Frame and store each payload; per-key success.  The default encodes every header here, in the
        calling thread, then calls ``_write`` once.  A backend may override this to frame inside its own
        workers (checksumming a payload while it is hot in cache); it must store exactly
        ``self._frame(key, payload, layout_id)``'s header and payload, atomically per key.  A payload is
        :class:`kvtier.format.blockformat.Segments` only in a backend that ``writes_segments``."""
        # Typed for the ordinary backend's ``_write`` (one buffer); segments reach only one that
        # ``writes_segments``, whose ``_write`` takes them (see there).
        return self._write(keys, [self._frame(k, p, layout_id)  # type: ignore[misc]
                                  for k, p in zip(keys, payloads)])

    def _get_blocks(self, keys: Sequence[str], payloads: Sequence[memoryview],
                    layout_id: int) -> list[bool | str]:
        """Per key: True (a verified block, payload now in the buffer), False (absent), or why the stored
        value is not the expected block (``get_into`` then counts and deletes it).  The default reads with
        ``_read_into`` and verifies here; a backend may override this to verify inside its own workers,
        but must report True only for values that passed ``self._verify``."""
        headers = [memoryview(bytearray(self.header_size)) for _ in keys]
        sizes = self._read_into(keys, headers, payloads)
        return [False if size is None else (self._verify(key, size, header, view, layout_id) or True)
                for key, size, header, view in zip(keys, sizes, headers, payloads)]

    def _close(self) -> None:  # noqa: B027 - optional hook, nothing to release by default
        """Release connections, threads and file handles."""

    def _health(self) -> None:
        """Raise if the backend is unusable; the default probes one absent key."""
        self._exists([f"{'0' * 32}/{'0' * 32}"])

    def _usage(self) -> dict[str, Any]:
        """Current usage, e.g. {"blocks": n, "bytes": b, "capacity_bytes": c}; optional."""
        return {}

    def _location(self) -> str | None:
        """Where the backend keeps its values (a directory, ``s3://bucket/prefix``), for error messages
        that say where to free space or grant access; optional."""
        return None

    def _translate_error(self, e: Exception) -> Exception:
        """Map a client library's own exception onto the builtin one that says what happened
        (``TimeoutError``, ``ConnectionError``, ``OSError`` with ``ENOSPC`` / ``EACCES`` ...), so the base
        class types it; optional, the default returns ``e``.  Errors are typed by class and errno, never
        by their text."""
        return e

    def _namespace_blocks(self, namespace_id: str) -> Iterable[StoredBlock]:
        """One namespace's blocks, least recently used (or oldest) first: the order a namespace over its
        quota loses them in (``kvtier.quota``).  Optional; the default lists them in scan order."""
        return self.scan(namespace_id)

    def _share_blocks(self, share: Share) -> Iterable[StoredBlock]:
        """One share's blocks (``kvtier.quota``), least recently used (or oldest) first: a namespace's
        untenanted blocks (``share.tenant`` None), or one tenant's.  The default, for a backend that does
        not count tenants, lists the whole namespace (``_namespace_blocks``); one that ``counts_tenants``
        overrides it, and then a namespace's listing leaves its tenants' blocks out."""
        if share.tenant is not None:
            raise NotImplementedError(f"backend {self.name!r} lists no tenant's blocks (counts_tenants is false)")
        return self._namespace_blocks(share.namespace)

    def _tenant_records(self, namespace_id: str) -> Mapping[str, str]:
        """Block key -> tenant tag of every tenant block a namespace's records name (stored or not: the
        caller joins them with a listing), read only (no stale record dropped).  A backend that
        ``counts_tenants`` implements it; the default names none."""
        return {}

    def _record_tenants(self, stored: Mapping[Share, list[str]]) -> None:  # noqa: B027 - optional hook
        """After a put by a backend with a quota: ``stored`` are the keys it stored per tenant share, for
        a backend that ``counts_tenants`` and keeps its tenants' listings apart from the write (Redis's sorted
        sets, S3's marker objects).  An exception is logged and counted, never a failed put.
        Optional; a backend that records a key's tenant with the key itself reads ``_put_tenant``."""

    def _put_tenant(self, key: str) -> str | None:
        """In a write hook, on the thread that called ``put``: the tenant tag the put charges ``key`` to
        (None: its namespace).  In ``_delete`` during a quota's trim of a tenant's share: that tenant (a
        backend that keeps records beside the blocks drops theirs with them)."""
        charged = _PUT_TENANTS.get()
        return None if charged is None else charged.get(key)

    def _eviction_order(self) -> Iterable[StoredBlock]:
        """Every stored block (not manifests), least recently used first: the order ``evict_to`` removes
        them in.  Optional; the default knows nothing of use and lists them in scan order."""
        return self.scan()

    # ------------------------------------------------------------------ evictions a backend makes itself

    #: Set by the tier stack (or manager) that uses this backend: called with the keys of blocks the
    #: backend removed on its own to stay within its capacity, so the stack stops believing they are there
    #: (it would neither offer them as hits that fail to load, nor skip writing them again).
    on_evicted: Callable[[list[str]], None] | None = None

    def _evicted(self, keys: list[str]) -> None:
        """Tell the owner about blocks this backend evicted itself.  A backend with a capacity calls it
        after such an eviction, outside its own locks (the owner takes its own).  Whatever the listener
        does, it never fails the put that evicted."""
        listener = self.on_evicted
        if keys and listener is not None:
            try:
                listener(keys)
            except Exception as e:  # noqa: BLE001 - a hint lost is a future failed load, not a failed put
                log.error("backend %r: the eviction listener failed: %s", self.name, e)

    def hold(self, keys: Sequence[str]) -> None:  # noqa: B027 - optional: only self-evicting backends hold
        """``keys`` are about to be read (a load was planned on them): a backend that evicts on its own
        keeps them until ``release(keys)`` (counted: each ``hold`` needs its ``release``), so a load in
        flight never finds its block evicted by a put meanwhile.  Keys not stored are fine.  The default
        does nothing: a backend that never evicts by itself has nothing to hold."""

    def release(self, keys: Sequence[str]) -> None:  # noqa: B027 - see hold
        """End one ``hold(keys)``."""

    # ------------------------------------------------------------------ public API (used by the stack)
    # Each method that takes keys (or a namespace id) raises InvalidKey for a non-canonical one before
    # any hook runs, never a miss: see the module docstring.

    def contains_prefix(self, keys: Sequence[str]) -> int:
        """How many leading keys of the chain ``keys`` are present."""
        if not keys:
            return 0
        self._refuse_invalid(keys)
        if self.prefix_probe == "bisect" and len(keys) > _BISECT_MIN:
            return self._bisect_prefix(keys)
        present = self._call(self._exists, keys)
        n = 0
        for ok in present:
            if not ok:
                break
            n += 1
        return n

    def _bisect_prefix(self, keys: Sequence[str]) -> int:
        """The prefix length in O(log n) single-key probes, assuming the chain is prefix-closed (stores
        write a chain front to back).  A hole the probes step over only costs a failed load later, which
        the stack recomputes; it is never served."""
        if not self._call(self._exists, [keys[0]])[0]:
            return 0
        lo, hi = 1, len(keys)  # keys[lo - 1] is present; the answer lies in [lo, hi]
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if self._call(self._exists, [keys[mid - 1]])[0]:
                lo = mid
            else:
                hi = mid - 1
        return lo

    def exists(self, keys: Sequence[str]) -> list[bool]:
        """Whether each key is present (content is verified on read, not here)."""
        if not keys:
            return []
        self._refuse_invalid(keys)
        return list(self._call(self._exists, keys))

    def put(self, keys: Sequence[str], payloads: Sequence[Any], layout_id: int, *,
            tenants: Sequence[str | None] | None = None) -> list[bool]:
        """Store each payload (any contiguous buffer) as a verified block; per-key success.  ``tenants``:
        per key the ``cache_salt`` tenant (its tag, ``kvtier.keys.tenant_tag``) whose quota the block is
        charged to, None for its namespace's (``kvtier.quota``); it changes no key and no stored byte."""
        if len(keys) != len(payloads):
            raise ValueError(f"put: {len(keys)} keys but {len(payloads)} payloads")
        if tenants is not None and len(tenants) != len(keys):
            raise ValueError(f"put: {len(keys)} keys but {len(tenants)} tenants")
        if not keys:
            return []
        self._refuse_invalid(keys)
        charged = self._charges(keys, tenants)
        views = [_put_view(p, self.writes_segments) for p in payloads]
        t0 = time.perf_counter()
        mark = _PUT_TENANTS.set(charged or None)
        try:
            ok = list(self._call(self._put_blocks, keys, views, layout_id))
        except BackendError:
            with self._lock:
                self._stats.put_failures += len(keys)
            raise
        finally:
            _PUT_TENANTS.reset(mark)
        nbytes = sum(v.nbytes for v, good in zip(views, ok) if good)
        with self._lock:
            s = self._stats
            s.puts += sum(ok)
            s.put_failures += len(ok) - sum(ok)
            s.put_bytes += nbytes
            s.put_seconds += time.perf_counter() - t0
        if self.quota is not None and nbytes:
            hsize = self.header_size
            if charged:
                self._tenants_stored(charged, [k for k, good in zip(keys, ok) if good])
            self.quota.wrote([(k, hsize + v.nbytes) for k, v, good in zip(keys, views, ok) if good], charged)
        return ok

    def _charges(self, keys: Sequence[str], tenants: Sequence[str | None] | None) -> dict[str, str]:
        """key -> tenant tag of a put's tenants' keys (checked); empty when the backend counts no tenants
        (said once: their blocks are charged to their namespaces)."""
        if tenants is None:
            return {}
        for i, t in enumerate(tenants):
            if t is not None and (why := tenant_problem(t)) is not None:
                raise ValueError(f"put: tenants[{i}] (key {show_key(keys[i])}): {why}")
        charged = {k: t for k, t in zip(keys, tenants) if t is not None}
        if charged and not self.counts_tenants:
            if not self._said_tenants and self.quota is not None:
                self._said_tenants = True
                log.info("backend %r cannot list a cache_salt tenant's blocks: tenants' blocks are charged to "
                         "their namespace's quota here (kvtier.quota)", self.name)
            return {}
        return charged

    def _tenants_stored(self, charged: Mapping[str, str], stored: Sequence[str]) -> None:
        """Hand the tenants of a put's stored keys to ``_record_tenants``; never fails the put."""
        per: dict[Share, list[str]] = {}
        for k in stored:
            if (t := charged.get(k)) is not None:
                per.setdefault(Share(k.partition("/")[0], t), []).append(k)
        if not per:
            return
        try:
            self._call(self._record_tenants, per)
        except BackendError as e:  # the next count lists the share without them: within, not a failed put
            n = sum(len(keys) for keys in per.values())
            with self._lock:
                self._stats.tenants_unrecorded += n
            log.warning("backend %r: could not record the tenants of %d stored block(s) of a put (%s); they count "
                        "as their namespace's", self.name, n, type(e).__name__)

    def get_into(self, keys: Sequence[str], buffers: Sequence[Any], layout_id: int, *,
                 on_verified: Callable[[int], None] | None = None) -> list[bool]:
        """Read each key's payload into the matching writable buffer; per-key ok.  A value that fails
        any check is a miss, counted as corrupt (or forged: a sealed backend's refusal) and deleted.

        ``on_verified(i)``, when given, is called once for each key ``i`` whose buffer holds verified
        bytes: as soon as they are (a backend that ``streams_verified``, from its reading threads, so a
        caller can copy a block on while it is still in the CPU cache) or else once the batch is read.
        It must not raise.  It is never called for a key that is not ok, except when the batch then
        fails as a whole (the result is all False: the caller must not serve what it was told of)."""
        if len(keys) != len(buffers):
            raise ValueError(f"get_into: {len(keys)} keys but {len(buffers)} buffers")
        if not keys:
            return []
        self._refuse_invalid(keys)
        views = [b if isinstance(b, blockformat.Segments) else memoryview(b).cast("B") for b in buffers]
        told = bytearray(len(keys))  # keys the hook already reported verified
        stream: tuple[Callable[[int], None], ...] = ()
        if on_verified is not None and self.streams_verified:
            tell = on_verified

            def verified(i: int) -> None:
                told[i] = 1
                tell(i)

            stream = (verified,)
        t0 = time.perf_counter()
        try:
            results = self._call(self._get_blocks, keys, views, layout_id, *stream)
        except BackendError:
            with self._lock:
                self._stats.gets += len(keys)
                self._stats.get_failures += len(keys)
            raise
        ok = [res is True for res in results]
        if on_verified is not None:
            for i, good in enumerate(ok):
                if good and not told[i]:
                    on_verified(i)
        self._found_corrupt([(key, res) for key, res in zip(keys, results) if isinstance(res, str)])
        hits = sum(ok)
        with self._lock:
            s = self._stats
            s.gets += len(keys)
            s.hits += hits
            s.misses += len(keys) - hits
            s.get_bytes += sum(v.nbytes for v, good in zip(views, ok) if good)
            s.get_seconds += time.perf_counter() - t0
        return ok

    def delete(self, keys: Sequence[str]) -> int:
        """Delete the keys; how many existed."""
        if not keys:
            return 0
        self._refuse_invalid(keys)
        n = self._call(self._delete, keys)
        with self._lock:
            self._stats.deletes += n
        return n

    def scan(self, namespace_id: str | None = None) -> Iterator[StoredBlock]:
        """Stored blocks (not manifests), of one namespace or of all (a malformed namespace id raises
        InvalidKey when iteration starts)."""
        if namespace_id:
            self._refuse_invalid([f"{namespace_id}/{MANIFEST_NAME}"], manifest=True)
        prefix = f"{namespace_id}/" if namespace_id else ""
        try:
            for blk in self._scan(prefix):
                if invalid_key([blk.key]) is None:
                    yield blk
        except BackendError:
            raise
        except Exception as e:  # noqa: BLE001 - typed for the caller
            raise self._wrap(e, prefix or None) from e

    def tenant_records(self, namespace_id: str) -> dict[str, str]:
        """Block key -> ``cache_salt`` tenant tag of the namespace's blocks put for a tenant, as this
        backend recorded them (``counts_tenants``; empty otherwise).  Read only; a record may name a block
        no longer stored, so join it with ``scan(namespace_id)`` (``kvtier inspect`` does)."""
        self._refuse_invalid([f"{namespace_id}/{MANIFEST_NAME}"], manifest=True)
        return dict(self._call(self._tenant_records, namespace_id))

    def namespaces(self) -> list[str]:
        """Namespace ids that have a manifest or at least one block."""
        seen: set[str] = set()
        for blk in self._call(lambda: list(self._scan(""))):
            ns = blk.key.partition("/")[0]
            if len(ns) == 32:
                seen.add(ns)
        return sorted(seen)

    def put_manifest(self, namespace: Namespace) -> None:
        """Store a namespace's fields so tools can say what a namespace id means."""
        import json

        data = json.dumps(namespace.manifest(), sort_keys=True).encode()
        key = f"{namespace.id}/{MANIFEST_NAME}"
        self._refuse_invalid([key], manifest=True)
        self._call(self._write_small, key, data)

    def get_manifest(self, namespace_id: str) -> dict[str, Any] | None:
        """The namespace's manifest as :meth:`put_manifest` wrote it; None when there is none, or when
        what is stored is not a JSON object (unreadable: no manifest to trust)."""
        import json

        key = f"{namespace_id}/{MANIFEST_NAME}"
        self._refuse_invalid([key], manifest=True)
        raw = self._call(self._read_small, key)
        try:
            m = json.loads(raw) if raw else None
        except ValueError:
            return None
        return m if isinstance(m, dict) else None

    def evict_to(self, capacity_bytes: int, *, dry_run: bool = False,
                 on_evict: Callable[[list[StoredBlock]], None] | None = None,
                 namespaces: Collection[str] | None = None) -> list[StoredBlock]:
        """Delete blocks in ``_eviction_order`` until those left total at most ``capacity_bytes``; return
        the blocks removed (``dry_run``: that would be removed, deleting nothing).  ``on_evict`` gets
        each batch once it is deleted (``kvtier gc`` drives its progress bar with it).  ``namespaces``:
        only blocks of these namespace ids are removed (every block still counts towards the total)."""
        blocks = self._call(lambda: list(self._eviction_order()))
        excess = sum(b.size for b in blocks) - capacity_bytes
        victims: list[StoredBlock] = []
        for blk in blocks:
            if excess <= 0:
                break
            if namespaces is not None and blk.key.partition("/")[0] not in namespaces:
                continue
            victims.append(blk)
            excess -= blk.size
        if dry_run:
            return victims
        for i in range(0, len(victims), 256):
            batch = victims[i:i + 256]
            self.delete([b.key for b in batch])
            if on_evict is not None:
                on_evict(batch)
        return victims

    def stats(self) -> BackendStats:
        with self._lock:
            s = BackendStats(**{k: v for k, v in vars(self._stats).items() if k != "extra"})
        try:
            s.extra = dict(self._usage())
        except Exception as e:  # noqa: BLE001 - usage is best-effort
            s.extra = {"usage_error": str(e)}
        return s

    def health(self) -> bool:
        try:
            self._call(self._health)
            return True
        except BackendError:
            return False

    def close(self) -> None:
        self._call(self._close)

    def __enter__(self) -> Self:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    # ------------------------------------------------------------------ internals

    def _refuse_invalid(self, keys: Sequence[str], *, manifest: bool = False) -> None:
        """Raise ``InvalidKey`` for the first non-canonical key; called before any hook sees ``keys``."""
        bad = invalid_key(keys, manifest=manifest)
        if bad is not None:
            i, why = bad
            raise InvalidKey(self.name, keys[i], f"refused before any I/O: {why}")

    def _on_corrupt(self, key: str, why: str) -> None:
        what = "forged" if isinstance(why, Forged) else "corrupt"
        log.warning("backend %r: %s block %s (%s); deleting", self.name, what, key, why)

    def _found_corrupt(self, found: Sequence[tuple[str, str]]) -> None:
        """Entries under these keys are no valid value (``(key, why)``): each is logged, counted as corrupt
        and deleted, wherever a hook found it (a read, or an existence check that met a special file).
        If the delete fails it stays a miss; ``kvtier verify --fix`` can remove it later."""
        if not found:
            return
        for key, why in found:
            self._on_corrupt(key, why)
        with contextlib.suppress(BackendError):
            self._call(self._delete, [key for key, _ in found])
        forged = sum(isinstance(why, Forged) for _, why in found)
        with self._lock:
            self._stats.corrupt += len(found) - forged
            self._stats.forged += forged

    def _call(self, fn: Callable[..., T], *args: Any) -> T:
        """Run a hook, turning any exception into a typed BackendError naming backend and key."""
        try:
            return fn(*args)
        except BackendError:
            raise
        except Exception as e:  # noqa: BLE001 - every fault is typed for the stack
            key = args[0][0] if args and isinstance(args[0], Sequence) and not isinstance(args[0], str) and \
                args[0] and isinstance(args[0][0], str) else (args[0] if args and isinstance(args[0], str) else None)
            err = self._wrap(e, key)
            if isinstance(err, BackendUnavailable | BackendTimeout):
                n = len(args[0]) if args and isinstance(args[0], Sequence) and not isinstance(args[0], str) else 1
                self.note_unavailable(n)
            raise err from e

    def note_unavailable(self, n: int) -> None:
        """Count ``n`` keys left unanswered because the backend or part of it was unavailable (a hook
        that answers the rest of a batch, e.g. a Redis Cluster with a node down, calls this for its lost
        keys), so the stack can tell an outage from ordinary misses."""
        with self._lock:
            self._stats.unavailable += n

    def unavailable_count(self) -> int:
        """Keys left unanswered so far for unavailability (cheap: no I/O, unlike ``stats()``)."""
        with self._lock:
            return self._stats.unavailable

    def note_restarted(self) -> None:
        """The store behind this backend restarted since it was last seen (a Redis node answering with a
        new ``run_id``), so it may have come back empty: a hook that notices it calls this.  The stack then
        stops assuming this backend holds what it wrote there, and writes again what host memory still
        holds, even when no call ever failed (a restart between two calls)."""
        with self._lock:
            self._stats.restarts += 1

    def restart_count(self) -> int:
        """Restarts noticed so far (cheap: no I/O)."""
        with self._lock:
            return self._stats.restarts

    def _wrap(self, e: Exception, key: str | None) -> BackendError:
        """The typed error for a hook's exception ``e`` (counted when it is disk full / access denied)."""
        e = self._translate_error(e)
        what = f"{type(e).__name__}: {e}"
        if isinstance(e, TimeoutError):  # socket.timeout is TimeoutError
            return BackendTimeout(self.name, key, f"timed out: {what}")
        kind = self._count_fault(e)
        if kind is not None and isinstance(e, OSError):
            where = getattr(e, "filename", None) or self._location() or "the backend's storage"
            if kind == "disk_full":
                return BackendDiskFull(self.name, key, f"{_DISK_FULL[e.errno or 0]} at {where}: free space there, "
                                       "or lower this backend's capacity below what the filesystem holds "
                                       f"({what})")
            uid = f" (uid {os.getuid()})" if hasattr(os, "getuid") else ""
            todo = ("remount it read-write, or mark this backend `write: false`" if e.errno == errno.EROFS
                    else f"grant this process{uid} read and write access there, or point the backend at "
                         "storage it may use")
            return BackendPermissionDenied(self.name, key, f"{_DENIED[e.errno or 0]} on {where}: {todo} ({what})")
        if isinstance(e, OSError):  # ConnectionError, ssl errors, a vanished disk (EIO, ENOENT, ...)
            return BackendUnavailable(self.name, key, f"unavailable: {what}")
        return BackendError(self.name, key, what)

    def _count_fault(self, e: BaseException) -> str | None:
        """Count ``e`` if it is disk full or access denied; its kind ("disk_full", "permission_denied") or
        None.  Hooks that report a key's failure as False instead of raising call this for its error."""
        # Only an OS errno says disk full / denied: ssl and resolver errors reuse the field for their own
        # codes (an SSL verify failure has errno 1, which is EPERM's number).
        os_error = isinstance(e, OSError) and not isinstance(e, (ssl.SSLError, socket.gaierror, socket.herror))
        code = e.errno if isinstance(e, OSError) and os_error else None
        kind = "disk_full" if code in _DISK_FULL else "permission_denied" if code in _DENIED else None
        if kind is not None:
            with self._lock:
                setattr(self._stats, kind, getattr(self._stats, kind) + 1)
        return kind
