"""Counters of the tier stack, per tier and per request, with optional Prometheus exposition.

Per tier (``device``, ``host``, and each backend by its instance name):

==================  ==========================================================================
``hits``            blocks served from this tier (a load or a prefetch found them here)
``misses``          blocks asked of this tier that it could not serve
``hit_tokens``      ``hits * block_size``
``bytes_in``        bytes written into this tier
``bytes_out``       bytes read out of this tier
``stores_skipped``  blocks that should have been written here but were not (full, refused, error)
``failures``        operations that failed (a backend error, a failed transfer or device copy)
``evictions``       blocks evicted from this tier by the stack (host memory)
``unavailable``     keys a backend left unanswered because it, or the node holding them, was down
``dropped``         host blocks evicted unwritten because their write-back kept failing (bounded)
==================  ==========================================================================

plus a latency per operation (``read``, ``write``, ``lookup``): count, sum, a fixed histogram (for
Prometheus) and p50 / p90 / p99 over a reservoir of the last 1024 samples.

Per storage backend, read when asked (:meth:`StackMetrics.watch_backends`): ``up`` (0 while the backend
has been unreachable since it last answered a whole call), ``used_bytes`` and ``capacity_bytes`` (what the
backend's own ``stats()`` reports, where it reports them), and the counters ``corrupt`` and ``forged``
(values the backend refused and deleted: damaged, or not sealed by this deployment's key; its
``stats()``'s, since start-up).

Per request (each :meth:`kvtier.stack.TierStack.lookup`): the matched tokens by tier, as FastDeploy's
prefix cache manager reports them: device / host / storage (all backends together).

Invariant: every counter only grows, and the Prometheus collector reads the same numbers as
:meth:`StackMetrics.snapshot` (it is a view at scrape time, not a second set of counters).
``prometheus_client`` is optional (extra ``prometheus``); without it everything but the exposition works.
"""

from __future__ import annotations

import bisect
import threading
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import numpy as np

from .index import Tier

COUNTERS = ("hits", "misses", "hit_tokens", "bytes_in", "bytes_out", "stores_skipped", "failures", "evictions",
            "unavailable", "dropped")
OPS = ("read", "write", "lookup")
# Seconds: from a host copy of a few blocks (~10 us) to a slow object store (~10 s).
BUCKETS = (1e-5, 5e-5, 1e-4, 5e-4, 1e-3, 2.5e-3, 5e-3, 1e-2, 2.5e-2, 5e-2, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0)
RESERVOIR = 1024
# Per-backend gauges (``kvtier_backend_<name>{tier=...}``) and their help.
BACKEND_GAUGES = {
    "up": "1 if the backend answered its last call in full, 0 while it has been unreachable since",
    "used_bytes": "Bytes the backend holds, as its stats() report them (Redis: used_memory of its masters)",
    "capacity_bytes": "Bytes the backend may hold, where bounded (local_disk capacity, Redis maxmemory)",
}
# Per-backend counters (``kvtier_backend_<name>_total{tier=...}``), from its stats(), and their help.
BACKEND_COUNTERS = {
    "corrupt": "Values the backend refused and deleted as damaged (checksum, header, length)",
    "forged": "Values a sealed backend (security authenticate / encrypt) refused and deleted: intact, but not "
              "sealed under this deployment's key, mode and namespace",
}
# /metrics has no authentication: by default it answers only this host (config: metrics.bind_address).
DEFAULT_BIND_ADDRESS = "127.0.0.1"


class WatchedBackends(Protocol):
    """What :meth:`StackMetrics.watch_backends` reads: a stack's backends (``kvtier._stack_backends``)."""

    names: list[str]
    backends: list[Any]  # StorageBackend: only its stats() is called

    def up(self) -> list[bool]: ...


class LatencyStats:
    """count, sum, histogram buckets (cumulative on export) and a reservoir of the last samples.
    Not locked: :class:`StackMetrics` holds its lock around every call."""

    def __init__(self) -> None:
        self.count = 0
        self.sum = 0.0
        self.buckets = [0] * (len(BUCKETS) + 1)  # last one is +Inf
        self._recent: deque[float] = deque(maxlen=RESERVOIR)

    def observe(self, seconds: float) -> None:
        self.count += 1
        self.sum += seconds
        self.buckets[bisect.bisect_left(BUCKETS, seconds)] += 1
        self._recent.append(seconds)

    def snapshot(self) -> dict[str, float]:
        out = {"count": self.count, "sum": self.sum}
        if self._recent:
            p = np.percentile(np.fromiter(self._recent, dtype=np.float64), (50, 90, 99))
            out.update(p50=float(p[0]), p90=float(p[1]), p99=float(p[2]))
        else:
            out.update(p50=0.0, p90=0.0, p99=0.0)
        return out


class TierMetrics:
    """The counters and latencies of one tier."""

    def __init__(self, name: str, kind: str):
        self.name = name
        self.kind = kind  # "device", "host" or "storage"
        self.counters = dict.fromkeys(COUNTERS, 0)
        self.latency = {op: LatencyStats() for op in OPS}


@dataclass(frozen=True)
class RequestSummary:
    """Matched tokens of one lookup, by tier kind (FastDeploy's gpu / cpu / storage match tokens)."""

    num_tokens: int  # tokens asked about (full blocks)
    device_tokens: int
    host_tokens: int
    storage_tokens: int

    @property
    def matched_tokens(self) -> int:
        return self.device_tokens + self.host_tokens + self.storage_tokens

    def __str__(self) -> str:
        return (f"matched {self.matched_tokens}/{self.num_tokens} tokens: device {self.device_tokens}, "
                f"host {self.host_tokens}, storage {self.storage_tokens}")


class StackMetrics:
    """All counters of one :class:`kvtier.stack.TierStack`; thread-safe (one lock, held briefly).

    ``tiers``: tier names in order (``device``, ``host`` if present, then backend names); every name
    other than ``device`` / ``host`` is a storage tier.  ``gauges``: an optional callable returning
    current values (host slots used, pinned blocks, pending writes...) exported beside the counters.
    """

    def __init__(self, tiers: Sequence[str], block_size: int, *, gauges: Any = None, recent: int = 256):
        if len(set(tiers)) != len(tiers):
            raise ValueError(f"tier names must be unique, got {list(tiers)}")
        self.block_size = block_size
        self._tiers = {t: TierMetrics(t, t if t in ("device", "host") else "storage") for t in tiers}
        self._lock = threading.Lock()
        self._gauges = gauges
        self._requests: deque[RequestSummary] = deque(maxlen=recent)
        self._req_totals = {"requests": 0, "num_tokens": 0, "device_tokens": 0, "host_tokens": 0,
                            "storage_tokens": 0}
        self._registry: Any = None  # a prometheus_client CollectorRegistry, made on first use
        self._server: Any = None
        self._backends: WatchedBackends | None = None

    @property
    def tiers(self) -> list[str]:
        return list(self._tiers)

    # ------------------------------------------------------------------ recording

    def add(self, tier: str, **counters: int) -> None:
        """Add to counters of ``tier`` (unknown tiers are ignored: a metric never raises)."""
        t = self._tiers.get(tier)
        if t is None:
            return
        with self._lock:
            for k, v in counters.items():
                t.counters[k] += v

    def hit(self, tier: str, blocks: int, nbytes: int = 0) -> None:
        """``blocks`` served from ``tier`` (``nbytes`` read out of it)."""
        if blocks:
            self.add(tier, hits=blocks, hit_tokens=blocks * self.block_size, bytes_out=nbytes)

    def watch_backends(self, backends: WatchedBackends) -> None:
        """Export ``backends``' health and usage beside the counters, read at each snapshot / scrape."""
        self._backends = backends

    def observe(self, tier: str, op: str, seconds: float) -> None:
        t = self._tiers.get(tier)
        if t is None:
            return
        with self._lock:
            t.latency[op].observe(seconds)

    def record_request(self, tiers: Sequence[Tier], num_blocks: int) -> RequestSummary:
        """One lookup: ``tiers[i]`` is where block ``i`` of the matched prefix lives."""
        dev = sum(1 for t in tiers if t == Tier.DEVICE)
        host = sum(1 for t in tiers if t == Tier.HOST)
        b = self.block_size
        s = RequestSummary(num_blocks * b, dev * b, host * b, (len(tiers) - dev - host) * b)
        with self._lock:
            self._requests.append(s)
            tot = self._req_totals
            tot["requests"] += 1
            tot["num_tokens"] += s.num_tokens
            tot["device_tokens"] += s.device_tokens
            tot["host_tokens"] += s.host_tokens
            tot["storage_tokens"] += s.storage_tokens
        return s

    # ------------------------------------------------------------------ reading

    def snapshot(self) -> dict[str, Any]:
        """Plain numbers: {"tiers": {name: {counters..., "latency": {op: {...}}}}, "requests": {...},
        "gauges": {...}}."""
        with self._lock:
            tiers = {n: {"kind": t.kind, **t.counters,
                         "latency": {op: s.snapshot() for op, s in t.latency.items()}}
                     for n, t in self._tiers.items()}
            reqs = dict(self._req_totals)
        out: dict[str, Any] = {"tiers": tiers, "requests": reqs}
        if self._backends is not None:
            out["backends"] = _backend_gauges(self._backends)
        if self._gauges is not None:
            try:
                out["gauges"] = dict(self._gauges())
            except Exception as e:  # noqa: BLE001 - a gauge must never break a scrape
                out["gauges"] = {"error": str(e)}
        return out

    def recent_requests(self) -> list[RequestSummary]:
        with self._lock:
            return list(self._requests)

    def summary(self) -> str:
        """Human-readable: requests' matched tokens by tier, then hit rates per tier."""
        snap = self.snapshot()
        r = snap["requests"]
        asked = r["num_tokens"] or 1
        lines = [f"requests {r['requests']}: matched tokens device {r['device_tokens']} "
                 f"({r['device_tokens'] / asked:.1%}), host {r['host_tokens']} ({r['host_tokens'] / asked:.1%}), "
                 f"storage {r['storage_tokens']} ({r['storage_tokens'] / asked:.1%}) of {r['num_tokens']}"]
        for name, t in snap["tiers"].items():
            looked = t["hits"] + t["misses"]
            rate = f"{t['hits'] / looked:.1%}" if looked else "-"
            lines.append(f"  {name:<12} hits {t['hits']} ({rate}), misses {t['misses']}, in {t['bytes_in']} B, "
                         f"out {t['bytes_out']} B, skipped {t['stores_skipped']}, evicted {t['evictions']}, "
                         f"failures {t['failures']}")
        return "\n".join(lines)

    # ------------------------------------------------------------------ Prometheus

    @property
    def registry(self) -> Any:
        """A ``prometheus_client.CollectorRegistry`` holding this stack's metrics (created on first use).
        Raises ImportError naming the extra when prometheus_client is missing."""
        if self._registry is None:
            try:
                from prometheus_client import CollectorRegistry
            except ImportError as e:
                raise ImportError("Prometheus exposition needs prometheus_client: "
                                  "pip install 'kvtier[prometheus]'") from e
            reg = CollectorRegistry(auto_describe=False)
            reg.register(_Collector(self))
            self._registry = reg
        return self._registry

    def generate_latest(self) -> bytes:
        """The text exposition format (what ``/metrics`` serves)."""
        from prometheus_client import generate_latest

        return generate_latest(self.registry)

    def serve(self, port: int, addr: str = DEFAULT_BIND_ADDRESS) -> int:
        """Serve ``/metrics`` on ``addr``:``port`` (0: any free port) in a daemon thread; returns the port."""
        from prometheus_client import start_http_server

        server, _thread = start_http_server(port, addr=addr, registry=self.registry)
        self._server = server
        return server.server_address[1]

    def close(self) -> None:
        if self._server is not None:
            self._server.shutdown()
            self._server.server_close()
            self._server = None


def _backend_gauges(watched: WatchedBackends) -> dict[str, dict[str, float]]:
    """``{name: {backend name: value}}`` of :data:`BACKEND_GAUGES` and :data:`BACKEND_COUNTERS`; a value a
    backend lacks (or cannot tell now: it is down) is left out."""
    out: dict[str, dict[str, float]] = {g: {} for g in (*BACKEND_GAUGES, *BACKEND_COUNTERS)}
    for name, b, up in zip(watched.names, watched.backends, watched.up()):
        out["up"][name] = 1.0 if up else 0.0
        if not up:
            continue  # its stats() may wait on the unreachable server: a scrape must stay quick
        try:
            stats = b.stats()
            extra = stats.extra
        except Exception:  # noqa: BLE001 - a gauge must never break a scrape
            continue
        for counter in BACKEND_COUNTERS:
            v = getattr(stats, counter, None)
            if isinstance(v, int) and not isinstance(v, bool):
                out[counter][name] = float(v)
        for gauge, key in (("used_bytes", "bytes"), ("capacity_bytes", "capacity_bytes")):
            v = extra.get(key)
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                out[gauge][name] = float(v)
    return out


class _Collector:
    """Reads a :class:`StackMetrics` snapshot at scrape time."""

    def __init__(self, metrics: StackMetrics):
        self.metrics = metrics

    def collect(self) -> Iterator[Any]:
        from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, HistogramMetricFamily

        m = self.metrics
        snap = m.snapshot()
        helps = {
            "hits": "Blocks served from the tier", "misses": "Blocks the tier could not serve",
            "hit_tokens": "Tokens of the blocks served from the tier", "bytes_in": "Bytes written into the tier",
            "bytes_out": "Bytes read out of the tier",
            "stores_skipped": "Blocks not stored in the tier (full, refused, error)",
            "failures": "Failed operations on the tier (backend errors, failed transfers)",
            "evictions": "Blocks evicted from the tier by the stack",
            "unavailable": "Keys a backend left unanswered because it (or a node of it) was unavailable",
            "dropped": "Blocks evicted from host memory unwritten: their write-back kept failing",
        }
        for c in COUNTERS:
            fam = CounterMetricFamily(f"kvtier_tier_{c}", helps[c], labels=["tier", "kind"])
            for name, t in snap["tiers"].items():
                fam.add_metric([name, t["kind"]], t[c])
            yield fam
        hist = HistogramMetricFamily("kvtier_tier_op_seconds", "Latency of tier operations",
                                     labels=["tier", "op"])
        with m._lock:
            rows = [(n, op, list(s.buckets), s.sum) for n, t in m._tiers.items() for op, s in t.latency.items()]
        for name, op, buckets, total in rows:
            cum, acc = [], 0
            for le, n in zip([*map(str, BUCKETS), "+Inf"], buckets):
                acc += n
                cum.append((le, acc))
            hist.add_metric([name, op], cum, total)
        yield hist
        reqs = snap["requests"]
        yield CounterMetricFamily("kvtier_requests", "Lookups recorded as requests", value=reqs["requests"])
        fam = CounterMetricFamily("kvtier_request_matched_tokens", "Matched tokens of requests by tier kind",
                                  labels=["tier"])
        for kind in ("device", "host", "storage"):
            fam.add_metric([kind], reqs[f"{kind}_tokens"])
        yield fam
        yield CounterMetricFamily("kvtier_request_tokens", "Tokens asked about by requests",
                                  value=reqs["num_tokens"])
        for gauge, values in (snap.get("backends") or {}).items():
            per_backend = CounterMetricFamily(f"kvtier_backend_{gauge}", BACKEND_COUNTERS[gauge], labels=["tier"]) \
                if gauge in BACKEND_COUNTERS else \
                GaugeMetricFamily(f"kvtier_backend_{gauge}", BACKEND_GAUGES[gauge], labels=["tier"])
            for name, v in values.items():
                per_backend.add_metric([name], v)
            yield per_backend
        for name, v in (snap.get("gauges") or {}).items():
            if isinstance(v, (int, float)) and not isinstance(v, bool):
                yield GaugeMetricFamily(f"kvtier_{name}", name.replace("_", " "), value=v)


__all__ = ["BACKEND_COUNTERS", "BACKEND_GAUGES", "BUCKETS", "COUNTERS", "DEFAULT_BIND_ADDRESS", "OPS", "LatencyStats",
           "RequestSummary", "StackMetrics", "TierMetrics", "WatchedBackends"]
