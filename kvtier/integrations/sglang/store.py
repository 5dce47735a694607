"""The worker role of kvtier under SGLang: pages between SGLang's host pool and kvtier's backends.

SGLang's HiCache keeps its own host memory (L2) and calls a storage backend (L3) from its own background
threads: existence probes from the prefetch thread, reads into host slots from its prefetch I/O thread,
writes from its backup thread.  :class:`PageStore` serves those calls with kvtier's core, nothing else:

* **Existence** goes through a :class:`~kvtier.tiering.manager.TierManager`: pages it already knows (found by an
  earlier probe) answer from its index, the rest is probed in its probe pool through the backend set
  (fastest backend first, bisecting on request-per-probe backends such as S3).  SGLang's thread waits
  for that probe; any backend fault is 0 pages found.
* **Bytes** go through a :class:`~kvtier._stack_backends.BackendSet`: each page is kvtier's canonical
  payload (:mod:`.pages`), framed and verified by :class:`~kvtier.backend_api.StorageBackend`.  A read takes
  each page from the first backend that has a verified copy; a page no backend can deliver (missing,
  corrupt - then deleted -, backend down) is a miss, reported to the manager so its index forgets it.
  A write goes to every writable backend (write-through); a page counts as stored when one took it.
* Nothing raises into SGLang: faults are misses, skipped writes, log lines and metrics.
"""

from __future__ import annotations

import functools
import logging
import threading
from collections.abc import Callable, Sequence
from typing import Any

import torch

from ...backend_api import StorageBackend
from ...config import KvtierConfig
from ...keys import Namespace
from ...metrics import StackMetrics
from ...plans import LookupState, WorkerReport
from ...tiering.backend_set import BackendSet
from ...tiering.manager import TierManager
from .pages import PageCodec

log = logging.getLogger("kvtier.sglang")

#: Bytes of canonical payload staged at once (a batch of 128 large pages is moved in pieces).
STAGING_BYTES = 64 << 20
#: How long an existence probe may take before it counts as a miss (every backend call is bounded by the
#: backend's own timeout; this is the belt to those braces).
PROBE_DEADLINE_S = 120.0


class PageStore:
    """kvtier's backends for one SGLang rank: ``config`` (its ``model`` section from SGLang, keys
    ``sglang_sha256``) and the codec of that rank's host pool."""

    def __init__(self, config: KvtierConfig, codec: PageCodec, *,
                 backends: Sequence[StorageBackend] | None = None):
        if config.storage_blocks > 1:
            # SGLang hands its storage one page key at a time, without the chain position that places
            # values of several pages (kvtier.format.groups): it stores one page per value.
            raise ValueError(f"kvtier: storage.block_tokens must be null or model.block_size (the page size, "
                             f"{config.model.block_size}) with SGLang, got {config.storage.block_tokens}")
        self.config = config
        self.codec = codec
        self.namespace: Namespace = config.namespace()
        if codec.page_nbytes != _payload_nbytes(self.namespace):
            raise ValueError(f"kvtier: a page of the host pool is {codec.page_nbytes} bytes but the namespace "
                             f"says {_payload_nbytes(self.namespace)}")
        self._owned = backends is None
        built = list(backends) if backends is not None else \
            config.build_backends()
        self.backends_list = built
        names = [b.name for b in built]
        self.metrics = StackMetrics(names, self.namespace.block_size)
        writable = {b.name: b.write for b in config.backends}
        self.backends = BackendSet(built, [writable.get(n, True) for n in names], self.metrics,
                                   self.namespace.layout_id, codec.page_nbytes)
        self.manager = TierManager(config, backends=built, metrics=self.metrics)
        self.read_only = not self.backends.writable
        self._local = threading.local()
        self._warned: set[str] = set()
        self.metrics_port: int | None = None
        if self.backends.writable:
            self.backends.put_manifests(self.namespace)

    # ------------------------------------------------------------------ keys

    def keys(self, hexes: Sequence[str]) -> tuple[list[bytes], list[str]]:
        """SGLang's page keys (hex) as kvtier hashes and stored keys; ValueError naming a bad one."""
        hashes = []
        for i, k in enumerate(hexes):
            if not isinstance(k, str) or len(k) != 64 or k != k.lower():
                raise ValueError(f"page key [{i}] {k!r}: expected SGLang's 64 lower-case hex digits")
            hashes.append(bytes.fromhex(k))
        return hashes, self.namespace.keys(hashes)

    # ------------------------------------------------------------------ existence

    def exists(self, hexes: Sequence[str]) -> int:
        """Leading pages of ``hexes`` present in some backend (0 on any fault)."""
        if not hexes or not len(self.backends):
            return 0
        hashes, _ = self.keys(hexes)
        # SGLang's prefetch thread may block: wait on the manager's probe instead of polling it.
        found = self.manager.lookup(hashes, wait_s=PROBE_DEADLINE_S)
        if found.state is not LookupState.PENDING:
            return found.num_blocks
        self.warn("probe", f"an existence probe of {len(hashes)} pages took over {PROBE_DEADLINE_S} s; "
                           "counted as a miss")
        return 0

    # ------------------------------------------------------------------ bytes

    def staging(self, pages: int) -> torch.Tensor:
        """A per-thread ``[pages, page_nbytes]`` uint8 buffer (reused; grown on demand)."""
        buf = getattr(self._local, "buf", None)
        if buf is None or buf.shape[0] < pages:
            buf = torch.empty((pages, self.codec.page_nbytes), dtype=torch.uint8)
            self._local.buf = buf
        return buf[:pages]

    def chunks(self, n: int) -> list[tuple[int, int]]:
        """``[a, b)`` ranges of ``n`` pages, each staged at once (at most ``STAGING_BYTES``)."""
        step = max(1, STAGING_BYTES // max(1, self.codec.page_nbytes))
        return [(a, min(n, a + step)) for a in range(0, n, step)]

    def put_pages(self, hexes: Sequence[str], page_ids: torch.Tensor) -> list[bool]:
        """Store host pages ``page_ids`` under ``hexes``; per page, whether a backend took it."""
        out: list[bool] = []
        for a, b in self.chunks(len(hexes)):
            rows = self.staging(b - a)
            self.codec.gather(page_ids[a:b], rows)
            out += self.put_rows(hexes[a:b], rows)
        return out

    def put_rows(self, hexes: Sequence[str], rows: torch.Tensor) -> list[bool]:
        """Store canonical payload rows under ``hexes``."""
        if self.read_only:
            return [True] * len(hexes)  # nothing to store by configuration: not a failure
        _, strs = self.keys(hexes)
        views = [rows[j].numpy() for j in range(len(hexes))]
        took = [False] * len(hexes)
        for i in self.backends.writable:
            for j, ok in enumerate(self.backends.put(i, strs, views)):
                took[j] = took[j] or ok
        if any(took):
            self.manager.forget_probes()  # an earlier "absent" answer may be stale now
        return took

    def get_pages(self, hexes: Sequence[str], page_ids: torch.Tensor) -> list[bool]:
        """Load pages ``hexes`` into host pages ``page_ids``; per page, whether it arrived verified.  Only
        verified pages are written into the host pool."""
        out: list[bool] = []
        for a, b in self.chunks(len(hexes)):
            rows = self.staging(b - a)
            ok = self.get_rows(hexes[a:b], rows)
            good = [j for j, g in enumerate(ok) if g]
            if good:
                sel = torch.tensor(good, dtype=torch.int64)
                self.codec.scatter(rows.index_select(0, sel) if len(good) < len(ok) else rows,
                                   page_ids[a:b].index_select(0, sel))
            out += ok
        return out

    def get_rows(self, hexes: Sequence[str], rows: torch.Tensor) -> list[bool]:
        """Read pages ``hexes`` into canonical payload rows; per page ok (a row not ok is undefined)."""
        hashes, strs = self.keys(hexes)
        ok = [False] * len(hexes)
        todo = list(range(len(hexes)))
        for i in range(len(self.backends)):  # fastest first; what one lacks (or holds corrupt) from the next
            if not todo:
                break
            got = self.backends.get_into(i, [strs[j] for j in todo], [rows[j].numpy() for j in todo])
            for j, g in zip(todo, got):
                ok[j] = g
            todo = [j for j in todo if not ok[j]]
        if todo:
            self.manager.apply(WorkerReport(lost={hashes[j] for j in todo}))
            self.manager.forget_probes()
        return ok

    # ------------------------------------------------------------------ upkeep

    def warn(self, what: str, message: str, *, once: bool = True, exc: BaseException | None = None) -> None:
        """Log a fault (the first of each kind with its traceback, then one line each)."""
        first = what not in self._warned
        self._warned.add(what)
        if first or not once:
            log.warning("kvtier: %s", message, exc_info=exc if first else None)
        else:
            log.debug("kvtier: %s", message)

    def serve_metrics(self, port: int) -> None:
        try:
            self.metrics_port = self.metrics.serve(port, self.config.metrics.bind_address)
        except (OSError, ImportError) as e:
            log.warning("kvtier: cannot serve metrics on port %d: %s", port, e)

    def stats(self) -> dict[str, Any]:
        return {"namespace": self.namespace.id, "metrics": self.metrics.snapshot(),
                "backends": self.backends.stats(), "manager": self.manager.stats()}

    def close(self) -> None:
        self.manager.close()
        self.backends.close([self._owned] * len(self.backends))
        self.metrics.close()


def _payload_nbytes(ns: Namespace) -> int:
    from ...format.layout import parse_dtype

    comps = 1 if ns.attention == "mla" else 2
    return ns.num_layers * comps * ns.block_size * ns.num_kv_heads * ns.head_dim * parse_dtype(ns.kv_dtype).itemsize


def guarded(fallback: Callable[..., Any]) -> Callable[[Callable[..., Any]], Callable[..., Any]]:
    """Decorator for SGLang-facing methods: any exception is logged (through the instance's ``store``
    when it has one) and answered with ``fallback(*args)``: a miss, never an error in SGLang."""
    def wrap(fn: Callable[..., Any]) -> Callable[..., Any]:
        @functools.wraps(fn)
        def inner(self: Any, *args: Any, **kwargs: Any) -> Any:
            try:
                return fn(self, *args, **kwargs)
            except Exception as e:  # noqa: BLE001 - a kvtier fault is a miss, never an SGLang error
                store = getattr(self, "store", None)
                what = f"{fn.__name__} failed: {type(e).__name__}: {e}"
                if isinstance(store, PageStore):
                    store.warn(f"{fn.__name__}:{type(e).__name__}", what, exc=e)
                else:
                    log.warning("kvtier: %s", what)
                return fallback(*args)
        return inner
    return wrap
