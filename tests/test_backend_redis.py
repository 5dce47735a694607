"""The redis backend against real redis-server processes: TTL, passwords, TLS, timeouts, restarts,
corruption, and a real 3-node Redis Cluster (spread, redirects, a node down).  No mocks."""

import logging
import os
import subprocess
import time

import numpy as np
import pytest

from kvtier.backend_api import BackendError, BackendTimeout, BackendUnavailable
from kvtier.backends.redis import RedisBackend
from kvtier.format.blockformat import Segments
from kvtier.keys import Namespace
from kvtier.testing.redis_server import redis_available, start_redis

NS = Namespace("test/redis", "bfloat16", 2, 2, 64, 16)
SIZE = 64 << 10
SECRET = "s3cr3t-Pa55word"


def keys(n):
    return NS.keys([os.urandom(16) for _ in range(n)])


def payloads(n, size=SIZE):
    return [np.frombuffer(os.urandom(size), dtype=np.uint8) for _ in range(n)]


def get(b, ks, size=SIZE):
    bufs = [bytearray(size) for _ in ks]
    return b.get_into(ks, bufs, NS.layout_id), [bytes(x) for x in bufs]


@pytest.fixture(scope="module")
def secured():
    if redis_available():
        pytest.skip(str(redis_available()))
    srv = start_redis(password=SECRET)
    yield srv
    srv.cleanup()


# ------------------------------------------------------------------------ single server


def test_round_trip_and_ttl(redis_server):  # noqa: F811
    b = RedisBackend({"url": redis_server.url, "ttl_s": 30})
    ks, data = keys(40), payloads(40)
    assert b.put(ks, data, NS.layout_id) == [True] * 40
    ok, got = get(b, ks)
    assert ok == [True] * 40 and got == [bytes(d) for d in data]
    c = redis_server.client()
    ttl = c.pttl(b"kvtier:" + ks[0].encode())
    assert 0 < ttl <= 30_000
    assert c.strlen(b"kvtier:" + ks[0].encode()) == 88 + SIZE  # one key holds header + payload
    assert c.dbsize() == 40, "never a separate metadata key"
    assert b.stats().extra["keys"] == 40
    b.close()


def _told_until(told, n, timeout=10.0):
    deadline = time.monotonic() + timeout
    while sum(map(len, told)) < n and time.monotonic() < deadline:
        time.sleep(0.02)
    return [k for batch in told for k in batch]


def test_keys_redis_evicts_or_expires_are_told_to_the_owner():
    """A Redis at maxmemory (allkeys-lru) evicts on its own: the backend hears it (keyevent notifications,
    switched on by the default ``eviction_events: auto``) and tells ``on_evicted`` exactly the kvtier
    keys that are gone; another application's keys and ``eviction_events: off`` tell nothing."""
    if redis_available():
        pytest.skip(str(redis_available()))
    srv = start_redis(extra_args=["--maxmemory", "4mb", "--maxmemory-policy", "allkeys-lru"])
    b = RedisBackend({"url": srv.url})
    quiet = RedisBackend({"url": srv.url, "eviction_events": "off"})
    told: list[list[str]] = []
    b.on_evicted = told.append
    quiet.on_evicted = lambda keys: pytest.fail(f"eviction_events: off told {keys}")
    try:
        assert b._events is not None and b._events.subscribed.wait(10) and quiet._events is None
        assert "E" in srv.cli("CONFIG", "GET", "notify-keyspace-events")
        srv.client().set(b"someone-else", b"x" * 1000)
        ks = keys(120)  # 7.5 MiB of 64 KiB blocks into 4 MiB
        for i in range(0, 120, 10):
            assert b.put(ks[i:i + 10], payloads(10), NS.layout_id) == [True] * 10
        gone = [k for k, there in zip(ks, b.exists(ks)) if not there]
        assert len(gone) > 40
        got = _told_until(told, len(gone))
        assert sorted(got) == sorted(gone)  # every kvtier key evicted, nothing else
        # A TTL's end is the same news.
        short = RedisBackend({"url": srv.url, "ttl_s": 0.2})
        short.on_evicted = told.append
        assert short._events is not None and short._events.subscribed.wait(10)
        told.clear()
        k = keys(1)
        short.put(k, payloads(1, 1000), NS.layout_id)
        time.sleep(0.3)
        assert short.exists(k) == [False]  # an access makes Redis expire it at once
        assert k[0] in _told_until(told, 1)
        short.close()
    finally:
        b.close()
        quiet.close()
        srv.cleanup()


def test_keys_another_client_deletes_are_told_to_the_owner(redis_server):  # noqa: F811
    """``kvtier verify --fix`` in another process, an operator's DEL: the owner hears those keys go too
    (``del`` keyevents, switched on with the others by ``eviction_events: auto``).  A server whose
    operator publishes evictions and expiries but not deletes (``listen`` mode) still has its evictions
    heard."""
    b = RedisBackend({"url": redis_server.url})
    told: list[list[str]] = []
    b.on_evicted = told.append
    try:
        assert b._events is not None and b._events.subscribed.wait(10)
        assert "g" in redis_server.cli("CONFIG", "GET", "notify-keyspace-events").split()[-1]
        ks = keys(3)
        assert b.put(ks, payloads(3, 1000), NS.layout_id) == [True] * 3
        other = RedisBackend({"url": redis_server.url, "eviction_events": "off"})
        assert other.delete(ks[:2]) == 2
        other.close()
        assert sorted(_told_until(told, 2)) == sorted(ks[:2])
    finally:
        b.close()
    redis_server.cli("CONFIG", "SET", "notify-keyspace-events", "Eex")
    listen = RedisBackend({"url": redis_server.url, "eviction_events": "listen"})
    told.clear()
    listen.on_evicted = told.append
    try:
        assert listen._events is not None and listen._events.subscribed.wait(10)
        short = RedisBackend({"url": redis_server.url, "ttl_s": 0.2, "eviction_events": "off"})
        k = keys(1)
        short.put(k, payloads(1, 1000), NS.layout_id)
        time.sleep(0.3)
        assert short.exists(k) == [False]
        short.close()
        assert _told_until(told, 1) == k
        assert set(redis_server.cli("CONFIG", "GET", "notify-keyspace-events").split()[-1]) == set("Eex")  # unchanged
    finally:
        listen.close()
        redis_server.cli("CONFIG", "SET", "notify-keyspace-events", "")


def test_no_ttl_by_default(redis_server):  # noqa: F811
    b = RedisBackend({"url": redis_server.url})
    k = keys(1)
    b.put(k, payloads(1), NS.layout_id)
    assert redis_server.client().pttl(b"kvtier:" + k[0].encode()) == -1


@pytest.mark.parametrize("stripes", [1, 3, 8])
def test_striped_batches_keep_key_order(redis_server, stripes):  # noqa: F811
    """A batch spread over several connections answers in key order: misses, a corrupt block and
    hits land where their keys are."""
    b = RedisBackend({"url": redis_server.url, "stripes": stripes, "max_connections": 4})
    ks, data = keys(11), payloads(11)
    stored = [i % 4 != 2 for i in range(11)]
    assert b.put([k for k, s in zip(ks, stored) if s], [d for d, s in zip(data, stored) if s],
                  NS.layout_id) == [True] * sum(stored)
    c = redis_server.client()
    c.setrange(b"kvtier:" + ks[5].encode(), 88 + 7, b"\xff\x00")
    ok, got = get(b, ks)
    want = [s and i != 5 for i, s in enumerate(stored)]
    assert ok == want
    assert [g == bytes(d) for g, d, good in zip(got, data, want) if good] == [True] * sum(want)
    assert b.exists(ks) == [s and i != 5 for i, s in enumerate(stored)]
    assert b.stats().corrupt == 1


def test_corrupted_value_is_a_miss_counted_and_deleted(redis_server):  # noqa: F811
    b = RedisBackend({"url": redis_server.url})
    ks, data = keys(3), payloads(3)
    b.put(ks, data, NS.layout_id)
    c = redis_server.client()
    rkey = b"kvtier:" + ks[1].encode()
    old = c.getrange(rkey, 88 + 1000, 88 + 1000)
    c.setrange(rkey, 88 + 1000, bytes([old[0] ^ 0xFF]))
    ok, got = get(b, ks)
    assert ok == [True, False, True]
    assert b.stats().corrupt == 1
    assert c.exists(rkey) == 0 and c.exists(b"kvtier:" + ks[0].encode()) == 1


def test_scan_ignores_foreign_keys(redis_server):  # noqa: F811
    b = RedisBackend({"url": redis_server.url})
    ks = keys(5)
    b.put(ks, payloads(5, 100), NS.layout_id)
    c = redis_server.client()
    c.set("someone-else:" + ks[0], b"x")
    c.set("kvtier:" + "0" * 31 + "*/x", b"x")  # a glob character in a key must not match everything
    assert sorted(x.key for x in b.scan(NS.id)) == sorted(ks)
    assert all(x.size == 188 for x in b.scan(NS.id))


def test_server_restart_fails_fast_then_reconnects(redis_server):  # noqa: F811
    b = RedisBackend({"url": redis_server.url, "timeout_s": 2})
    ks, data = keys(4), payloads(4)
    assert b.put(ks, data, NS.layout_id) == [True] * 4  # a pooled connection now exists
    redis_server.stop()
    for call in (lambda: get(b, ks), lambda: b.put(ks, data, NS.layout_id), lambda: b.exists(ks)):
        t0 = time.monotonic()
        with pytest.raises(BackendUnavailable):
            call()
        assert time.monotonic() - t0 < 1.0, "a dead server must fail fast, not wait for the timeout"
    assert b.health() is False
    redis_server.start()  # same port, empty (no persistence)
    assert b.put(ks, data, NS.layout_id) == [True] * 4
    assert get(b, ks)[0] == [True] * 4
    # A restart while connections sit in the pool: the first call after it still succeeds.
    redis_server.restart()
    assert b.exists(ks) == [False] * 4
    assert b.health() is True


def test_hung_server_times_out(redis_server):  # noqa: F811
    timeout = 0.5
    b = RedisBackend({"url": redis_server.url, "timeout_s": timeout})
    ks, data = keys(4), payloads(4)
    b.put(ks, data, NS.layout_id)
    fresh = RedisBackend({"url": redis_server.url, "timeout_s": timeout})  # connects while paused
    redis_server.pause()  # SIGSTOP: the kernel still accepts connections, nothing answers
    try:
        for call in (lambda: get(b, ks), lambda: b.put(ks, data, NS.layout_id),
                     lambda: fresh.exists(ks)):
            t0 = time.monotonic()
            with pytest.raises(BackendTimeout):
                call()
            assert time.monotonic() - t0 < timeout + 1.0
    finally:
        redis_server.resume()
    assert get(b, ks)[0] == [True] * 4, "the timed-out connection was dropped, a new one works"
    assert fresh.exists(ks) == [True] * 4


# ------------------------------------------------------------------------ credentials, TLS, options


def test_password_in_url(secured):
    b = RedisBackend({"url": secured.url})
    assert SECRET not in repr(b) and SECRET not in repr(b.options) and SECRET not in str(b.options)
    assert SECRET not in b.options.url and SECRET not in b.options.model_dump_json()
    ks, data = keys(2), payloads(2)
    assert b.put(ks, data, NS.layout_id) == [True, True]
    assert get(b, ks)[1] == [bytes(d) for d in data]


def test_password_option_and_username(secured):
    b = RedisBackend({"url": f"redis://127.0.0.1:{secured.port}/0", "password": SECRET, "username": "default"})
    assert b.exists(keys(1)) == [False]


def test_wrong_or_missing_password_is_a_clear_error(secured, caplog):
    caplog.set_level(logging.DEBUG)
    wrong = "not-" + SECRET
    for opts in ({"url": f"redis://:{wrong}@127.0.0.1:{secured.port}"},
                 {"url": f"redis://127.0.0.1:{secured.port}"}):
        b = RedisBackend(opts)
        with pytest.raises(BackendUnavailable) as e:
            b.put(keys(1), payloads(1), NS.layout_id)
        msg = str(e.value)
        assert "rejected" in msg and ("WRONGPASS" in msg or "NOAUTH" in msg), msg
        assert wrong not in msg and SECRET not in msg
        assert wrong not in repr(b) and b.health() is False
    assert wrong not in caplog.text and SECRET not in caplog.text


def test_tls():
    if redis_available():
        pytest.skip(str(redis_available()))
    try:
        srv = start_redis(tls=True, password=SECRET)
    except (RuntimeError, subprocess.SubprocessError) as e:
        pytest.skip(f"no TLS-capable redis-server / openssl here: {e}")
    try:
        b = RedisBackend({"url": srv.url, "tls_ca_file": srv.ca_file})
        ks, data = keys(6), payloads(6, 300_000)
        assert b.put(ks, data, NS.layout_id) == [True] * 6
        assert get(b, ks, 300_000)[1] == [bytes(d) for d in data]
        # A payload in segments (a block read straight into an engine's KV) over TLS: one part at a time.
        parts = [bytearray(100_000), bytearray(1), bytearray(199_999)]
        seg = Segments([memoryview(p) for p in parts])
        assert b.get_into(ks[:1], [seg], NS.layout_id) == [True] and b"".join(parts) == bytes(data[0])
        untrusted = RedisBackend({"url": srv.url})  # the test CA is not trusted by default
        with pytest.raises(BackendUnavailable, match="CERTIFICATE_VERIFY_FAILED"):
            untrusted.exists(ks)
    finally:
        srv.cleanup()


@pytest.mark.parametrize("opts, match", [
    ({"url": "http://127.0.0.1"}, "redis://"),
    ({"url": "redis://:pw@127.0.0.1", "password": "x"}, "both"),
    ({"url": "redis://127.0.0.1/abc"}, "database"),
    ({"url": "redis://127.0.0.1", "key_prefix": "{tag}"}, "hash tag"),
    ({"url": "redis://127.0.0.1", "ttl_s": 0}, "greater than"),
    ({"url": "redis://127.0.0.1", "colour": "red"}, "Extra inputs"),
])
def test_bad_options(opts, match):
    with pytest.raises(ValueError, match=match):
        RedisBackend(opts)


# ------------------------------------------------------------------------ cluster


def test_cluster_spread_and_round_trip(redis_cluster):  # noqa: F811
    b = RedisBackend({"url": redis_cluster.url})
    ks, data = keys(90), payloads(90, 20_000)
    assert b.put(ks, data, NS.layout_id) == [True] * 90
    counts = [int(n.cli("DBSIZE")) for n in redis_cluster.nodes]
    assert sum(counts) == 90 and all(c > 0 for c in counts), counts
    ok, got = get(b, ks[::-1], 20_000)
    assert ok == [True] * 90 and got == [bytes(d) for d in data[::-1]]
    assert sorted(x.key for x in b.scan(NS.id)) == sorted(ks)
    assert b.contains_prefix(ks) == 90 and b.delete(ks[:30]) == 30
    assert b.exists(ks[:31]) == [False] * 30 + [True]
    assert b.stats().extra["nodes"] == 3


def test_cluster_nodes_each_tell_the_keys_they_expire(redis_cluster):  # noqa: F811
    """A cluster node publishes only its own keys' events: the backend listens to every master."""
    b = RedisBackend({"url": redis_cluster.url, "ttl_s": 0.2})
    told: list[list[str]] = []
    b.on_evicted = told.append
    try:
        deadline = time.monotonic() + 10
        while len(b._events.subscribed_nodes) < 3 and time.monotonic() < deadline:
            time.sleep(0.02)
        assert len(b._events.subscribed_nodes) == 3
        ks = keys(30)
        assert b.put(ks, payloads(30, 1000), NS.layout_id) == [True] * 30
        time.sleep(0.3)
        assert b.exists(ks) == [False] * 30
        assert sorted(_told_until(told, 30)) == sorted(ks)
    finally:
        b.close()


def test_cluster_node_down(redis_cluster):  # noqa: F811
    b = RedisBackend({"url": redis_cluster.url, "timeout_s": 2})
    ks, data = keys(60), payloads(60, 1000)
    assert b.put(ks, data, NS.layout_id) == [True] * 60
    dead = redis_cluster.nodes[1]
    on_dead = [redis_cluster.node_for_key("kvtier:" + k) is dead for k in ks]
    assert any(on_dead) and not all(on_dead)
    dead.stop()
    t0 = time.monotonic()
    ok, got = get(b, ks, 1000)
    assert time.monotonic() - t0 < 1.5
    assert ok == [not d for d in on_dead], "the dead node's keys miss, the others hit"
    assert all(g == bytes(x) for g, x, good in zip(got, data, ok) if good)
    assert b.put(ks, data, NS.layout_id) == [not d for d in on_dead]
    assert b.exists(ks) == [not d for d in on_dead]
    only_dead = [k for k, d in zip(ks, on_dead) if d]
    with pytest.raises(BackendUnavailable):
        b.put(only_dead, payloads(len(only_dead), 1000), NS.layout_id)
    assert b.health() is True and b.stats().extra["nodes_down"] == 1
    dead.start()  # rejoins with its node id (nodes.conf in its directory)
    redis_cluster.heal()
    assert b.put(ks, data, NS.layout_id) == [True] * 60
    assert get(b, ks, 1000)[0] == [True] * 60


def test_cluster_moved_refreshes_the_slot_map(redis_cluster):  # noqa: F811
    b = RedisBackend({"url": redis_cluster.url})
    ks, data = keys(30), payloads(30, 500)
    assert b.put(ks, data, NS.layout_id) == [True] * 30
    router = b._router
    router._slots = [router.masters[0]] * 16384  # a stale map: every slot on the first node
    ok, got = get(b, ks, 500)  # the others answer MOVED; the map is reloaded and the keys re-sent
    assert ok == [True] * 30 and got == [bytes(d) for d in data]
    assert len(set(router._slots)) == 3


def test_cluster_ask_during_migration(redis_cluster):  # noqa: F811
    b = RedisBackend({"url": redis_cluster.url})
    k = keys(1)
    rkey = "kvtier:" + k[0]
    src = redis_cluster.node_for_key(rkey)
    dst = next(n for n in redis_cluster.nodes if n is not src)
    slot = src.cli("CLUSTER", "KEYSLOT", rkey).strip()
    src_id, dst_id = src.cli("CLUSTER", "MYID").strip(), dst.cli("CLUSTER", "MYID").strip()
    dst.cli("CLUSTER", "SETSLOT", slot, "IMPORTING", src_id)
    src.cli("CLUSTER", "SETSLOT", slot, "MIGRATING", dst_id)
    try:
        data = payloads(1, 777)
        assert b.put(k, data, NS.layout_id) == [True]  # absent on src -> ASK -> ASKING + SET on dst
        assert int(dst.cli("DBSIZE")) == 1 and int(src.cli("DBSIZE")) == 0
        assert get(b, k, 777) == ([True], [bytes(data[0])])
    finally:
        for n in (src, dst):
            n.cli("CLUSTER", "SETSLOT", slot, "STABLE")
        dst.flushall()


def test_cluster_errors_name_the_backend(redis_cluster):  # noqa: F811
    b = RedisBackend({"url": redis_cluster.url, "cluster": True}, name="shared")
    for n in redis_cluster.nodes:
        n.stop()
    with pytest.raises(BackendError, match="backend 'shared'"):
        b.exists(keys(3))


def test_cluster_hung_node_bounds_the_call(redis_cluster):  # noqa: F811
    timeout = 0.5
    b = RedisBackend({"url": redis_cluster.url, "timeout_s": timeout})
    ks, data = keys(30), payloads(30, 1000)
    assert b.put(ks, data, NS.layout_id) == [True] * 30
    hung = redis_cluster.nodes[2]
    on_hung = [redis_cluster.node_for_key("kvtier:" + k) is hung for k in ks]
    hung.pause()
    t0 = time.monotonic()
    ok, _ = get(b, ks, 1000)
    assert time.monotonic() - t0 < timeout + 1.0
    assert ok == [not h for h in on_hung]


def test_cluster_seed_list(redis_cluster):  # noqa: F811
    dead = f"redis://127.0.0.1:{redis_cluster.nodes[0].port}"
    redis_cluster.nodes[0].stop()
    others = [f"127.0.0.1:{n.port}" for n in redis_cluster.nodes[1:]]
    b = RedisBackend({"url": dead, "startup_nodes": others})
    ks = keys(20)
    ok = b.put(ks, payloads(20, 100), NS.layout_id)
    assert b._router.cluster is True and any(ok) and not all(ok)
