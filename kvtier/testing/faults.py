"""FaultyBackend: wrap any :class:`~kvtier.backend_api.StorageBackend` and inject faults on demand.

A test tool for the tier stack and for fault-injection tests: errors, delays, gates (hold calls until
the test releases them), per-key refusals and corrupt reads, each on one operation, for some keys,
after some calls, a number of times::

    fb = FaultyBackend(LocalDiskBackend({"path": str(tmp_path)}))
    fb.fail("get", BackendTimeout, times=1)        # the next get_into raises BackendTimeout
    fb.corrupt(keys={k})                            # reads of k land garbage and fail their checksum
    gate = fb.gate("put")                           # puts wait until gate.release()

Operations: ``contains`` (contains_prefix), ``exists``, ``put``, ``get`` (get_into), ``delete``,
``scan``, ``manifest`` (put/get_manifest), ``health``; ``"*"`` matches all.

Invariants: with no fault armed it behaves exactly as the wrapped backend (every public call is
delegated); a fault fires only on calls matching its op and keys, skips its first ``after`` matching
calls and fires at most ``times`` times (None: until :meth:`FaultyBackend.clear`); a gate never holds a
call longer than its ``max_wait`` (then the call proceeds), so a test cannot hang on it.
"""

from __future__ import annotations

import os
import threading
import time
from collections import Counter
from collections.abc import Callable, Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Any

from ..backend_api import (
    BackendError,
    BackendOptions,
    BackendStats,
    BackendUnavailable,
    StorageBackend,
    StoredBlock,
)
from ..format.blockformat import Segments

OPS = ("contains", "exists", "put", "get", "delete", "scan", "manifest", "health")


class Gate:
    """Holds the calls it fires on until :meth:`release` (or ``max_wait`` seconds).  ``entered`` is set
    as soon as one call is held; ``held`` counts calls held so far."""

    def __init__(self, max_wait: float = 10.0):
        self.max_wait = max_wait
        self.entered = threading.Event()
        self.held = 0
        self._open = threading.Event()
        self._lock = threading.Lock()

    def release(self) -> None:
        self._open.set()

    @property
    def released(self) -> bool:
        return self._open.is_set()

    def _hold(self) -> None:
        with self._lock:
            self.held += 1
        self.entered.set()
        self._open.wait(self.max_wait)


@dataclass
class Fault:
    """One armed fault (see the module docstring).  ``fired`` counts the calls it acted on."""

    op: str
    kind: str  # "error" | "delay" | "gate" | "drop" | "corrupt"
    keys: frozenset[str] | None = None
    times: int | None = None
    after: int = 0
    error: Any = None
    seconds: float = 0.0
    gate: Gate | None = None
    seen: int = 0
    fired: int = 0
    enabled: bool = field(default=True)

    def matches(self, op: str, keys: Sequence[str]) -> bool:
        if not self.enabled or (self.op != "*" and self.op != op):
            return False
        return self.keys is None or any(k in self.keys for k in keys)


class FaultyBackend(StorageBackend):
    """A backend that delegates to ``inner`` and injects the faults armed on it (thread-safe)."""

    def __init__(self, inner: StorageBackend, *, name: str | None = None):
        super().__init__(BackendOptions(timeout_s=getattr(inner.options, "timeout_s", 5.0)),
                         name=name or inner.name)
        self.inner = inner
        # What the inner backend reads, this one passes on: per instance, as the inner one is (setattr, since
        # the base class declares it a class-level fact of a backend type).
        setattr(self, "reads_segments", inner.reads_segments)  # noqa: B010
        setattr(self, "counts_tenants", inner.counts_tenants)  # noqa: B010 - and whom it charges a put to
        inner.on_evicted = self._evicted  # what the inner backend evicts, this one's owner hears
        self.faults: list[Fault] = []
        self.calls: Counter[str] = Counter()
        self.injected: Counter[str] = Counter()
        self._flock = threading.Lock()

    # ------------------------------------------------------------------ arming

    def fail(self, op: str = "*", error: Any = BackendUnavailable, *, keys: Iterable[str] | None = None,
             times: int | None = None, after: int = 0) -> Fault:
        """Raise ``error`` (a BackendError subclass, instantiated naming this backend, or any exception
        instance, e.g. to model a backend that breaks the contract)."""
        return self._arm(Fault(op, "error", _keys(keys), times, after, error=error))

    def delay(self, op: str, seconds: float, *, keys: Iterable[str] | None = None, times: int | None = None,
              after: int = 0) -> Fault:
        """Sleep ``seconds`` before the call."""
        return self._arm(Fault(op, "delay", _keys(keys), times, after, seconds=seconds))

    def gate(self, op: str, *, keys: Iterable[str] | None = None, times: int | None = None, after: int = 0,
             max_wait: float = 10.0) -> Gate:
        """Hold matching calls until the returned gate is released."""
        g = Gate(max_wait)
        self._arm(Fault(op, "gate", _keys(keys), times, after, gate=g))
        return g

    def drop(self, op: str, *, keys: Iterable[str] | None = None, times: int | None = None,
             after: int = 0) -> Fault:
        """``put`` / ``get``: the matching keys (all, without ``keys``) report False, without an error
        (a refused write, a vanished value)."""
        if op not in ("put", "get"):
            raise ValueError(f"drop applies to put or get, not {op!r}")
        return self._arm(Fault(op, "drop", _keys(keys), times, after))

    def corrupt(self, *, keys: Iterable[str] | None = None, times: int | None = None, after: int = 0) -> Fault:
        """Reads of the matching keys land garbage in the caller's buffer and fail verification (the
        backend reports them not ok and counts them corrupt), as a real checksum failure does."""
        return self._arm(Fault("get", "corrupt", _keys(keys), times, after))

    def clear(self) -> None:
        """Disarm every fault and release every gate."""
        with self._flock:
            for f in self.faults:
                f.enabled = False
                if f.gate is not None:
                    f.gate.release()
            self.faults.clear()

    def _arm(self, f: Fault) -> Fault:
        if f.op != "*" and f.op not in OPS:
            raise ValueError(f"unknown op {f.op!r}; expected one of {', '.join(OPS)} or '*'")
        with self._flock:
            self.faults.append(f)
        return f

    # ------------------------------------------------------------------ firing

    def _before(self, op: str, keys: Sequence[str]) -> dict[str, str]:
        """Count the call, run errors / delays / gates; return {key: "drop" or "corrupt"} for the rest."""
        actions: list[Fault] = []
        with self._flock:
            self.calls[op] += 1
            for f in self.faults:
                if not f.matches(op, keys):
                    continue
                f.seen += 1
                if f.seen <= f.after or (f.times is not None and f.fired >= f.times):
                    continue
                f.fired += 1
                self.injected[f"{op}:{f.kind}"] += 1
                actions.append(f)
        affected: dict[str, str] = {}
        for f in actions:
            if f.kind == "delay":
                time.sleep(f.seconds)
            elif f.kind == "gate":
                assert f.gate is not None
                f.gate._hold()
            elif f.kind == "error":
                key = next((k for k in keys if f.keys is None or k in f.keys), None)
                err = f.error
                if isinstance(err, type) and issubclass(err, BackendError):
                    raise err(self.name, key, f"injected {op} fault")
                raise err if isinstance(err, BaseException) else err()
            else:
                for k in keys:
                    if f.keys is None or k in f.keys:
                        affected.setdefault(k, f.kind)
        return affected

    # ------------------------------------------------------------------ the public API, delegated

    def contains_prefix(self, keys: Sequence[str]) -> int:
        self._before("contains", keys)
        return self.inner.contains_prefix(keys)

    def exists(self, keys: Sequence[str]) -> list[bool]:
        self._before("exists", keys)
        return self.inner.exists(keys)

    def put(self, keys: Sequence[str], payloads: Sequence[Any], layout_id: int, *,
            tenants: Sequence[str | None] | None = None) -> list[bool]:
        drop = self._before("put", keys)
        if not drop:
            return self.inner.put(keys, payloads, layout_id, tenants=tenants)
        keep = [i for i, k in enumerate(keys) if k not in drop]
        kept = None if tenants is None else [tenants[i] for i in keep]
        got = self.inner.put([keys[i] for i in keep], [payloads[i] for i in keep], layout_id,
                             tenants=kept) if keep else []
        out = [False] * len(keys)
        for i, ok in zip(keep, got):
            out[i] = ok
        return out

    def get_into(self, keys: Sequence[str], buffers: Sequence[Any], layout_id: int, *,
                 on_verified: Callable[[int], None] | None = None) -> list[bool]:
        bad = self._before("get", keys)
        tell = None
        if on_verified is not None:
            report = on_verified

            def tell(i: int) -> None:  # a key this wrapper fails below is never reported verified
                if keys[i] not in bad:
                    report(i)
        ok = self.inner.get_into(keys, buffers, layout_id, on_verified=tell)
        for i, k in enumerate(keys):
            if k in bad:
                if bad[k] == "corrupt" and ok[i]:
                    buf = buffers[i]  # what a torn or rotten value leaves behind:
                    for view in buf.parts if isinstance(buf, Segments) else [memoryview(buf).cast("B")]:
                        view[:] = os.urandom(view.nbytes)
                    with self._lock:
                        self._stats.corrupt += 1
                ok[i] = False
        return ok

    def hold(self, keys: Sequence[str]) -> None:
        self.inner.hold(keys)

    def release(self, keys: Sequence[str]) -> None:
        self.inner.release(keys)

    def delete(self, keys: Sequence[str]) -> int:
        self._before("delete", keys)
        return self.inner.delete(keys)

    def scan(self, namespace_id: str | None = None) -> Iterator[StoredBlock]:
        self._before("scan", [])
        return self.inner.scan(namespace_id)

    def tenant_records(self, namespace_id: str) -> dict[str, str]:
        self._before("scan", [namespace_id])
        return self.inner.tenant_records(namespace_id)

    def namespaces(self) -> list[str]:
        self._before("scan", [])
        return self.inner.namespaces()

    def put_manifest(self, namespace: Any) -> None:
        self._before("manifest", [])
        self.inner.put_manifest(namespace)

    def get_manifest(self, namespace_id: str) -> dict[str, Any] | None:
        self._before("manifest", [])
        return self.inner.get_manifest(namespace_id)

    def stats(self) -> BackendStats:
        s = self.inner.stats()
        with self._lock:
            s.corrupt += self._stats.corrupt
        s.extra = {**s.extra, "injected": dict(self.injected)}
        return s

    def health(self) -> bool:
        try:
            self._before("health", [])
        except BackendError:
            return False
        return self.inner.health()

    def close(self) -> None:
        self.clear()
        self.inner.close()

    # ------------------------------------------------------------------ hooks (unused: calls are delegated)

    def _write(self, keys: Sequence[str], values: Sequence[tuple[bytes, memoryview]]) -> list[bool]:  # pragma: no cover
        return self.inner._write(keys, values)

    def _read_into(self, keys: Sequence[str], headers: Sequence[memoryview],
                   payloads: Sequence[memoryview]) -> list[int | None]:  # pragma: no cover
        return self.inner._read_into(keys, headers, payloads)

    def _exists(self, keys: Sequence[str]) -> list[bool]:  # pragma: no cover
        return self.inner._exists(keys)

    def _delete(self, keys: Sequence[str]) -> int:  # pragma: no cover
        return self.inner._delete(keys)

    def _scan(self, prefix: str) -> Iterator[StoredBlock]:  # pragma: no cover
        return self.inner._scan(prefix)


def _keys(keys: Iterable[str] | None) -> frozenset[str] | None:
    return None if keys is None else frozenset(keys)


__all__ = ["OPS", "Fault", "FaultyBackend", "Gate"]
