"""Metrics: per-tier counters and latencies, the per-request summary (device / host / storage matched
tokens, as FastDeploy reports), and the Prometheus exposition."""

from __future__ import annotations

import socket
import sys
import urllib.error
import urllib.request

import pytest
from _stack_helpers import BLOCK, BLOCK_NBYTES, TIMEOUT, chain, config, fill, make_stack

from kvtier.backend_api import BackendUnavailable
from kvtier.config import ConfigError
from kvtier.index import Tier
from kvtier.metrics import BUCKETS, LatencyStats, StackMetrics
from kvtier.stack import TierStack

pytest.importorskip("prometheus_client")


def test_latency_stats_percentiles_and_buckets():
    s = LatencyStats()
    for i in range(1, 101):
        s.observe(i / 1000)  # 1 ms .. 100 ms
    snap = s.snapshot()
    assert snap["count"] == 100 and snap["sum"] == pytest.approx(5.05)
    assert snap["p50"] == pytest.approx(0.0505, rel=0.02)
    assert snap["p90"] == pytest.approx(0.0901, rel=0.02)
    assert snap["p99"] == pytest.approx(0.099, rel=0.02)
    assert sum(s.buckets) == 100 and len(s.buckets) == len(BUCKETS) + 1
    assert LatencyStats().snapshot()["p99"] == 0.0


def test_stack_counts_hits_misses_bytes_and_skips(tmp_path):
    st, fb = make_stack(tmp_path, host_slots=4)
    try:
        hs = chain(st, 3)
        fill(st, [0, 1, 2], seed=1)
        st.store(hs, [0, 1, 2]).wait(TIMEOUT)
        assert st.flush(TIMEOUT)
        st.on_device_freed(range(32))
        st.load(hs, [10, 11, 12]).wait(TIMEOUT)  # 3 host hits
        st.load(chain(st, 2, start=900), [20, 21]).wait(TIMEOUT)  # 2 misses everywhere
        t = st.metrics.snapshot()["tiers"]
        nb = BLOCK_NBYTES
        assert t["device"]["bytes_out"] == 3 * nb and t["device"]["bytes_in"] == 3 * nb
        assert t["device"]["hits"] == 0 and t["device"]["misses"] == 5
        assert t["host"]["hits"] == 3 and t["host"]["hit_tokens"] == 3 * BLOCK and t["host"]["misses"] == 2
        assert t["host"]["bytes_in"] == 3 * nb and t["host"]["bytes_out"] == 3 * nb + 3 * nb  # load + write-down
        assert t["disk"]["bytes_in"] == 3 * nb and t["disk"]["misses"] == 0  # the 2 unknown blocks: no get
        assert t["disk"]["latency"]["write"]["count"] >= 1
        assert t["host"]["latency"]["read"]["count"] == 1 and t["host"]["latency"]["read"]["p50"] > 0
        # a failing backend: failure + skipped stores
        fb.fail("put", BackendUnavailable, times=1)
        fill(st, [3], seed=2)
        st.store(chain(st, 1, start=500), [3]).wait(TIMEOUT)
        assert st.flush(TIMEOUT)
        t = st.metrics.snapshot()["tiers"]["disk"]
        assert t["failures"] == 1 and t["stores_skipped"] == 1
    finally:
        st.close()


def test_request_summary_device_host_storage(tmp_path):
    st, _ = make_stack(tmp_path, host_slots=4)
    try:
        hs = chain(st, 6)
        fill(st, list(range(6)), seed=3)
        st.store(hs[:4], [0, 1, 2, 3]).wait(TIMEOUT)  # 4 in host + disk, still on device
        st.flush(TIMEOUT)
        st.store(hs[4:], [4, 5]).wait(TIMEOUT)  # evicts blocks 0 and 1 from host
        st.flush(TIMEOUT)
        st.on_device_freed([0, 1, 2, 3, 4, 5])
        fill(st, [0], seed=3)
        st.store(hs[:1], [0]).wait(TIMEOUT)  # block 0 on device again
        st.flush(TIMEOUT)
        res = st.lookup(hs + chain(st, 2, start=999))
        assert res.tiers[0] is Tier.DEVICE and res.num_blocks == 6
        summary = st.metrics.recent_requests()[-1]
        assert summary.num_tokens == 8 * BLOCK
        assert summary.device_tokens == res.device_tokens == BLOCK
        assert summary.host_tokens == res.host_tokens
        assert summary.storage_tokens == res.storage_tokens == 6 * BLOCK - res.device_tokens - res.host_tokens
        assert res.storage_tokens > 0 and res.host_tokens > 0
        st.lookup(hs, record=False)
        assert st.metrics.snapshot()["requests"]["requests"] == 1
        text = st.summary()
        assert "requests 1: matched tokens device 4" in text and "host slots" in text
        stats = st.stats()
        assert stats["index"]["disk"] == 6 and stats["host"]["num_slots"] == 4 and stats["pending"] == 0
        assert stats["backends"]["disk"]["puts"] == 6
    finally:
        st.close()


def test_prometheus_text_exposition(tmp_path):
    st, _ = make_stack(tmp_path)
    try:
        hs = chain(st, 2)
        fill(st, [0, 1], seed=4)
        st.store(hs, [0, 1]).wait(TIMEOUT)
        st.flush(TIMEOUT)
        st.on_device_freed([0, 1])
        st.lookup(hs)
        st.load(hs, [5, 6]).wait(TIMEOUT)
        text = st.metrics.generate_latest().decode()
        assert 'kvtier_tier_hits_total{kind="host",tier="host"} 2.0' in text
        assert f'kvtier_tier_bytes_in_total{{kind="storage",tier="disk"}} {float(2 * BLOCK_NBYTES)}' in text
        assert 'kvtier_request_matched_tokens_total{tier="host"} 8.0' in text
        assert "kvtier_requests_total 1.0" in text
        assert 'kvtier_tier_op_seconds_bucket{le="+Inf",op="write",tier="disk"}' in text
        assert "kvtier_host_slots 4.0" in text and "kvtier_pending_writes 0.0" in text
    finally:
        st.close()


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _scrape(host: str, port: int) -> str:
    with urllib.request.urlopen(f"http://{host}:{port}/metrics", timeout=TIMEOUT) as r:
        return str(r.read().decode())


def test_prometheus_server_from_config(tmp_path):
    port = _free_port()
    st = TierStack(config(tmp_path, metrics={"prometheus_port": port}))
    try:
        assert st.config.metrics.bind_address == "127.0.0.1"  # the default: this host only
        assert st.metrics_port == port
        assert 'kvtier_tier_hits_total{kind="device",tier="device"} 0.0' in _scrape("127.0.0.1", port)
        if sys.platform == "linux":  # all of 127/8 reaches lo there: another address, not on the bound one
            with pytest.raises(urllib.error.URLError):
                _scrape("127.0.0.2", port)
    finally:
        st.close()


@pytest.mark.skipif(sys.platform != "linux", reason="127.0.0.2 is a loopback address on Linux only")
def test_prometheus_bind_address_every_interface(tmp_path):
    port = _free_port()
    st = TierStack(config(tmp_path, metrics={"prometheus_port": port, "bind_address": "0.0.0.0"}))
    try:
        assert "kvtier_requests_total 0.0" in _scrape("127.0.0.2", port)
    finally:
        st.close()


@pytest.mark.parametrize("value, shown", [("everywhere", '"everywhere"'), ("127.0.0.256", '"127.0.0.256"'),
                                          ("", '""')])
def test_bind_address_must_be_an_ip_address(tmp_path, value, shown):
    with pytest.raises(ConfigError) as e:
        config(tmp_path, metrics={"prometheus_port": 9400, "bind_address": value})
    want = 'metrics.bind_address: expected an IP address like "127.0.0.1", "0.0.0.0" or "::", got '
    assert str(e.value) == want + shown  # one line, naming the key
    with pytest.raises(ConfigError, match=r"^metrics\.bind_address: .*got 9400$"):
        config(tmp_path, metrics={"bind_address": 9400})
    assert config(tmp_path, metrics={"bind_address": "0:0::1"}).metrics.bind_address == "::1"


def test_backend_up_and_usage_gauges_follow_an_outage(tmp_path):
    st, fb = make_stack(tmp_path)
    try:
        fill(st, [0, 1], seed=6)
        st.store(chain(st, 1), [0]).wait(TIMEOUT)
        assert st.flush(TIMEOUT)
        g = st.metrics.snapshot()["backends"]
        assert g["up"] == {"disk": 1.0} and g["capacity_bytes"] == {"disk": 10 * 2**30}
        assert g["used_bytes"]["disk"] >= BLOCK_NBYTES
        fb.fail("put", BackendUnavailable, times=1)
        fb.fail("health", BackendUnavailable)  # down until cleared, whoever probes it meanwhile
        st.store(chain(st, 1, start=100), [1]).wait(TIMEOUT)
        assert st.flush(TIMEOUT)
        g = st.metrics.snapshot()["backends"]
        # Down: no usage asked of it (a scrape must not wait on an unreachable server).
        assert g == {"up": {"disk": 0.0}, "used_bytes": {}, "capacity_bytes": {}, "corrupt": {}, "forged": {}}
        assert 'kvtier_backend_up{tier="disk"} 0.0' in st.metrics.generate_latest().decode()
        fb.clear()
        assert st.lookup(chain(st, 1, start=900)).num_blocks == 0  # asks the disk: a whole answer, it is back
        assert st.metrics.snapshot()["backends"]["up"] == {"disk": 1.0}
        assert 'kvtier_backend_up{tier="disk"} 1.0' in st.metrics.generate_latest().decode()
    finally:
        st.close()


def test_forged_and_corrupt_values_are_backend_counters(tmp_path):
    """A sealed local_disk refuses a value written without the key (forged) and a damaged one (corrupt):
    both are counted, in the snapshot and on /metrics beside the backend gauges; the key is nowhere."""
    import os

    from kvtier.backends.local_disk import LocalDiskBackend
    from kvtier.keys import Namespace
    from kvtier.security import KeyRing, Seal

    key = os.urandom(32)
    ns = Namespace("test/forged", "float32", 1, 1, 8, 4)
    sealed = LocalDiskBackend({"path": str(tmp_path / "d")}, name="disk")
    sealed.secure(Seal("authenticate", KeyRing({1: key}, 1)))
    plain = LocalDiskBackend({"path": str(tmp_path / "d")}, name="writer-without-key")
    forged, damaged = ns.keys([os.urandom(32), os.urandom(32)])
    assert plain.put([forged], [os.urandom(256)], ns.layout_id) == [True]
    assert sealed.put([damaged], [os.urandom(256)], ns.layout_id) == [True]
    path = tmp_path / "d" / ns.id / damaged.split("/")[1][:2] / damaged.split("/")[1]
    data = bytearray(path.read_bytes())
    data[5] ^= 0xFF  # the format version: no longer a value of this mode's framing
    path.write_bytes(bytes(data))
    assert sealed.get_into([forged, damaged], [bytearray(256), bytearray(256)], ns.layout_id) == [False, False]

    class Watched:
        names, backends = ["disk"], [sealed]

        def up(self) -> list[bool]:
            return [True]

    m = StackMetrics(["device", "host", "disk"], 4)
    m.watch_backends(Watched())
    g = m.snapshot()["backends"]
    assert g["forged"] == {"disk": 1.0} and g["corrupt"] == {"disk": 1.0}
    text = m.generate_latest().decode()
    assert 'kvtier_backend_forged_total{tier="disk"} 1.0' in text
    assert 'kvtier_backend_corrupt_total{tier="disk"} 1.0' in text
    assert key.hex() not in text
    sealed.close()
    plain.close()


def test_unknown_tier_is_ignored_and_names_must_be_unique():
    m = StackMetrics(["device", "host"], 16)
    m.add("nope", hits=1)
    m.observe("nope", "read", 0.1)
    assert set(m.snapshot()["tiers"]) == {"device", "host"}
    with pytest.raises(ValueError, match="unique"):
        StackMetrics(["device", "device"], 16)
