"""Quotas per ``cache_salt`` tenant in one process (issue 45, section 3): one stack serving requests of two
salts, and unsalted ones, over a shared ``local_disk`` directory (real files, its SQLite index), a real
redis-server or moto's S3 server over HTTP (a marker object per tenant block).  Each salted request's blocks are charged to its tenant's own quota, so tenant B's puts
never evict tenant A's blocks within A's quota, each tenant is trimmed to its own share, and unsalted
blocks are charged to the namespace as before.  Keys and stored bytes do not change with a tenant."""

from __future__ import annotations

import os
import sqlite3
from typing import Any

import pytest
import torch

from kvtier.backends.local_disk import LocalDiskBackend
from kvtier.backends.s3 import S3Backend
from kvtier.config import parse_config
from kvtier.keys import tenant_tag
from kvtier.quota import Share
from kvtier.stack import TierStack

LAYERS, HEADS, HEAD_DIM, BLOCK = 2, 2, 16, 4
PAYLOAD = LAYERS * 2 * BLOCK * HEADS * HEAD_DIM * 4  # float32: 1024
STORED = PAYLOAD + 88
QUOTA = 4 * STORED
SALT_A, SALT_B = "salt-of-tenant-a", "salt-of-tenant-b"
TAG_A, TAG_B = tenant_tag(SALT_A), tenant_tag(SALT_B)


def make_stack(backend: dict[str, Any], quota: int | None = QUOTA, write: str = "write_through") -> TierStack:
    data = {
        "model": {"id": "test/tenants", "kv_dtype": "float32", "num_layers": LAYERS, "num_kv_heads": HEADS,
                  "head_dim": HEAD_DIM, "block_size": BLOCK},
        "keys": {"seed": "tenant-quotas"},
        "device": {"kind": "cpu", "num_blocks": 8, "layout": "flash_attn"},
        "host": {"capacity": 4 * PAYLOAD, "pinned": False},
        "backends": [{**backend, **({"quota": quota} if quota is not None else {})}],
        "policies": {"write": {"name": write}},
        "transfer": {"threads": 1},
    }
    return TierStack(parse_config(data))


class Requests:
    """Requests of one-block prompts through ``stack`` (each its own chain), each stored and written down."""

    def __init__(self, stack: TierStack):
        self.stack = stack
        self.hasher = stack.namespace.hasher()
        self.n = 0

    def serve(self, salt: str | None, count: int) -> list[str]:
        """``count`` requests of ``salt`` (None: unsalted), one after another; their blocks' backend keys."""
        keys = []
        for _ in range(count):
            self.n += 1
            (h,) = self.hasher.hash_blocks(list(range(self.n * 1000, self.n * 1000 + BLOCK)), cache_salt=salt)
            g = torch.Generator().manual_seed(self.n)
            self.stack.device.write_blocks(torch.randint(1, 256, (1, PAYLOAD), dtype=torch.uint8, generator=g), [0])
            res = self.stack.store([h], [0], tenant=tenant_tag(salt) if salt else None).wait(10.0)
            assert res is not None and self.stack.flush(10.0)
            keys.extend(self.stack.namespace.keys([h]))
        return keys

    def held(self, keys: list[str]) -> list[str]:
        return [k for k, ok in zip(keys, self.stack.backends[0].exists(keys)) if ok]


def disk(tmp_path, capacity: int = 64 * STORED) -> dict[str, Any]:
    return {"name": "shared", "type": "local_disk", "options": {"path": str(tmp_path / "blocks"), "capacity": capacity}}


def s3(moto_server, bucket: str) -> dict[str, Any]:
    return {"name": "shared", "type": "s3",
            "options": {"endpoint_url": moto_server.endpoint_url, "bucket": bucket, "prefix": "kv/"}}


@pytest.fixture(params=["local_disk", "redis", "s3"])
def shared(request, tmp_path) -> dict[str, Any]:
    if request.param == "local_disk":
        return disk(tmp_path)
    if request.param == "s3":
        return s3(request.getfixturevalue("moto_server"), request.getfixturevalue("s3_bucket"))
    srv = request.getfixturevalue("redis_server")
    return {"name": "shared", "type": "redis", "options": {"url": srv.url, "key_prefix": "team:",
                                                            "eviction_events": "off"}}


def test_each_tenant_is_trimmed_to_its_own_share(shared):
    """One stack, quota 4 blocks: A stores 4, three unsalted requests 3, then B 12.  B loses its own least
    recently used blocks down to its quota, never A's or the namespace's; then 8 more unsalted requests
    trim the namespace's untenanted share alone.  The keys are the ones an unsalted deployment computes
    for the same salted prompts: no key or value changes with a tenant.  (S3's age order is LastModified,
    whole seconds: these puts share a few, so there only the counts and the shares' members are checked.)"""
    stack = make_stack(shared)
    req = Requests(stack)
    backend = stack.backends[0]
    try:
        keys_a = req.serve(SALT_A, 4)
        plain = req.serve(None, 3)
        keys_b = req.serve(SALT_B, 12)
        assert req.held(keys_a) == keys_a and req.held(plain) == plain
        held_b = req.held(keys_b)
        ordered = shared["type"] != "s3"
        assert 0 < len(held_b) * STORED <= QUOTA
        if ordered:
            assert held_b == keys_b[-len(held_b):]  # B kept its most recent
        ns = stack.namespace.id
        # The trim took B's records with its blocks (read before any listing drops a stale record).
        assert backend.tenant_records(ns) == {**dict.fromkeys(keys_a, TAG_A), **dict.fromkeys(held_b, TAG_B)}
        listed = {share: [b.key for b in backend._share_blocks(share)]  # the quota's own listing
                  for share in (Share(ns, TAG_A), Share(ns, TAG_B), Share(ns))}
        # (A namespace's listing in Redis is in OBJECT IDLETIME order, seconds: these were put within one.)
        if ordered:
            assert listed[Share(ns, TAG_A)] == keys_a and listed[Share(ns, TAG_B)] == held_b
        assert sorted(listed[Share(ns, TAG_A)]) == sorted(keys_a) and sorted(listed[Share(ns, TAG_B)]) == sorted(held_b)
        assert sorted(listed[Share(ns)]) == sorted(plain)
        more = req.serve(None, 8)
        assert req.held(keys_a) == keys_a and req.held(keys_b) == held_b
        untenanted = req.held(plain + more)
        assert 0 < len(untenanted) * STORED <= QUOTA
        if shared["type"] == "local_disk":  # its index orders every block by use
            assert untenanted == (plain + more)[-len(untenanted):]
        assert backend.quota is not None and backend.quota.trimmed >= 12 - 4 + 11 - 4
    finally:
        stack.close()


def test_without_salts_every_request_shares_the_namespace_quota(shared):
    """The control: the same requests unsalted are one share, and B's puts take A's blocks."""
    stack = make_stack(shared)
    req = Requests(stack)
    try:
        keys_a = req.serve(None, 4)
        req.serve(None, 12)
        assert req.held(keys_a) != keys_a  # (local_disk: all of them, its oldest; Redis: those SCAN met first)
    finally:
        stack.close()


def test_local_disk_capacity_eviction_skips_a_tenant_within_its_quota(tmp_path):
    """A directory of 8 blocks (quota 4 per share): A holds 4, then B's requests fill it.  The capacity
    eviction each of B's puts needs finds A within its quota and takes B's own oldest blocks.  Another
    deployment without a quota, opening the same directory, sees the same guard (quotas and tenants are
    in the directory's index): its puts are refused rather than take A's blocks."""
    stack = make_stack(disk(tmp_path, capacity=8 * STORED))
    req = Requests(stack)
    try:
        keys_a = req.serve(SALT_A, 4)
        keys_b = req.serve(SALT_B, 8)
        assert req.held(keys_a) == keys_a
        held_b = req.held(keys_b)
        assert held_b == keys_b[-len(held_b):] and 0 < len(held_b) <= 4
        other = LocalDiskBackend({"path": str(tmp_path / "blocks"), "capacity": 8 * STORED}, name="other")
        for i in range(6):
            other.put([f"{'f' * 32}/{i:064x}"], [os.urandom(PAYLOAD)], 1)
        assert req.held(keys_a) == keys_a
        other.close()
    finally:
        stack.close()


def test_local_disk_index_of_an_earlier_schema_opens_and_its_blocks_are_untenanted(tmp_path):
    """An index written before ``blocks.tenant`` existed (schema 1) keeps opening: its blocks count as the
    namespace's, and new puts record their tenants beside them."""
    from kvtier.backends._disk_index import SCHEMA, index_path

    conf = disk(tmp_path)
    stack = make_stack(conf)
    req = Requests(stack)
    keys = req.serve(SALT_A, 2)
    index_dir = stack.backends[0].options.index_dir  # type: ignore[attr-defined]
    stack.close()
    db = index_path(index_dir, str(tmp_path / "blocks"))
    with sqlite3.connect(db) as c:  # back to the schema of an earlier build
        assert c.execute("SELECT count(*) FROM blocks WHERE tenant = ?", (TAG_A,)).fetchone()[0] == 2
        c.execute("DROP TRIGGER IF EXISTS changes_added")  # (triggers name no columns; dropped only to be sure)
        c.execute("ALTER TABLE blocks DROP COLUMN tenant")
        c.execute("DELETE FROM meta WHERE k = 'schema'")
    stack = make_stack(conf)
    req = Requests(stack)
    req.n = 100
    try:
        backend = stack.backends[0]
        ns = stack.namespace.id
        assert [b.key for b in backend._share_blocks(Share(ns))] == keys  # untenanted now
        keys_b = req.serve(SALT_B, 1)
        assert [b.key for b in backend._share_blocks(Share(ns, TAG_B))] == keys_b
        with sqlite3.connect(db) as c:
            assert c.execute("SELECT v FROM meta WHERE k = 'schema'").fetchone()[0] == SCHEMA
    finally:
        stack.close()


def test_redis_tenant_records_are_sets_beside_the_blocks(redis_server):
    """Redis: the tenants' sets hold block hashes, a stale member is dropped when the tenant is listed, and
    no tool lists a set as a block or a namespace."""
    stack = make_stack({"name": "shared", "type": "redis",
                        "options": {"url": redis_server.url, "key_prefix": "team:", "eviction_events": "off"}})
    req = Requests(stack)
    try:
        keys_a = req.serve(SALT_A, 3)
        ns = stack.namespace.id
        r = redis_server.client()
        members = r.zrange(f"team:tenants/{ns}/{TAG_A}", 0, -1)
        assert sorted(m.decode() for m in members) == sorted(k.split("/")[1] for k in keys_a)
        assert r.smembers(f"team:tenants/{ns}") == {TAG_A.encode()}
        backend = stack.backends[0]
        backend.delete(keys_a[:1])
        assert [b.key for b in backend._share_blocks(Share(ns, TAG_A))] == keys_a[1:]
        assert r.zcard(f"team:tenants/{ns}/{TAG_A}") == 2
        assert backend.namespaces() == [ns] and {b.key for b in backend.scan()} == set(keys_a[1:])
    finally:
        stack.close()


def test_a_tenant_must_be_a_tag(tmp_path):
    stack = make_stack(disk(tmp_path))
    try:
        with pytest.raises(ValueError, match="store: tenant: expected a tenant tag of 16 hex digits"):
            stack.store([b"\x01" * 32], [0], tenant=SALT_A)  # the salt itself, not its tag
        backend = stack.backends[0]
        with pytest.raises(ValueError, match=r"put: tenants\[0\] .*expected a tenant tag"):
            backend.put([f"{'a' * 32}/{'b' * 64}"], [b"x" * 8], 1, tenants=["Tenant"])
    finally:
        stack.close()


def test_a_block_written_back_long_after_its_store_is_charged_to_its_tenant(tmp_path):
    """write_back: a block reaches the backend only when host memory evicts it, many stores later.  The
    planner kept its tenant until then, so A's blocks are A's share, and the unsalted ones that pushed
    them out are the namespace's."""
    stack = make_stack(disk(tmp_path), quota=None, write="write_back")
    req = Requests(stack)
    try:
        keys_a = req.serve(SALT_A, 3)
        assert stack.backends[0].exists(keys_a) == [False] * 3  # still only in host memory
        plain = req.serve(None, 7)  # 4 host slots: A's blocks are written back as these come in
        ns = stack.namespace.id
        backend = stack.backends[0]
        assert [b.key for b in backend._share_blocks(Share(ns, TAG_A))] == keys_a
        assert set(b.key for b in backend._share_blocks(Share(ns))) <= set(plain)
        with stack.planner.lock:
            stack.planner.check_locked()  # no tenant record outlives its host block
    finally:
        stack.close()


def test_s3_tenant_markers_beside_the_blocks(moto_server, s3_bucket):
    """S3: each tenant block has a zero-byte marker ``<prefix>tenants/<ns>/<tag>/<hash>``; no listing of
    blocks (scan, namespaces, usage, the tenant-less share) shows one; a quota's trim of a tenant deletes
    its markers with its blocks; a block deleted otherwise leaves a stale marker, dropped when its tenant
    is next counted."""
    stack = make_stack(s3(moto_server, s3_bucket))
    req = Requests(stack)
    client = moto_server.client()

    def markers(tag: str = "") -> list[str]:
        pages = client.get_paginator("list_objects_v2").paginate(Bucket=s3_bucket, Prefix=f"kv/tenants/{ns}/{tag}")
        objs = [o for page in pages for o in page.get("Contents", ())]
        assert all(o["Size"] == 0 for o in objs)
        return sorted(o["Key"].rpartition("/")[2] for o in objs)

    def hashes(keys: list[str]) -> list[str]:
        return sorted(k.partition("/")[2] for k in keys)

    try:
        ns = stack.namespace.id
        keys_a = req.serve(SALT_A, 3)
        plain = req.serve(None, 2)
        assert markers(TAG_A) == hashes(keys_a) and markers() == hashes(keys_a)
        backend = stack.backends[0]
        assert backend.namespaces() == [ns] and backend_blocks(stack) == sorted(keys_a + plain)
        assert stack.backends[0].stats().extra["blocks"] == 5
        assert sorted(b.key for b in backend._share_blocks(Share(ns))) == sorted(plain)
        keys_b = req.serve(SALT_B, 9)  # over B's quota of 4: trimmed, markers and all
        held_b = req.held(keys_b)
        assert 0 < len(held_b) * STORED <= QUOTA and markers(TAG_B) == hashes(held_b)
        assert req.held(keys_a) == keys_a and req.held(plain) == plain
        backend.delete(keys_a[:1])  # not a trim: the marker stays until A is counted
        assert markers(TAG_A) == hashes(keys_a)
        assert sorted(b.key for b in backend._share_blocks(Share(ns, TAG_A))) == sorted(keys_a[1:])
        assert markers(TAG_A) == hashes(keys_a[1:])
        assert backend.stats().tenants_unrecorded == 0
    finally:
        stack.close()


def test_s3_a_marker_that_fails_leaves_the_put_standing(moto_server, s3_bucket, caplog):
    """A marker PUT refused (here by the client, before it is sent: a connection error) is logged without
    a key and counted, the put stands and its blocks count as their namespace's."""
    import logging

    from botocore.exceptions import EndpointConnectionError

    stack = make_stack(s3(moto_server, s3_bucket))
    req = Requests(stack)
    backend = stack.backends[0]

    def refuse_markers(params: dict[str, Any], **_: Any) -> None:
        if "/tenants/" in params.get("Key", ""):
            raise EndpointConnectionError(endpoint_url=moto_server.endpoint_url)

    assert isinstance(backend, S3Backend)
    backend._client.meta.events.register("before-parameter-build.s3.PutObject", refuse_markers)
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier.backend_api"):
            keys_a = req.serve(SALT_A, 2)
        assert req.held(keys_a) == keys_a and backend.stats().put_failures == 0
        said = [r.getMessage() for r in caplog.records if "could not record the tenants" in r.getMessage()]
        assert len(said) == 2 and all(k.partition("/")[2] not in m for m in said for k in keys_a)
        assert backend.stats().tenants_unrecorded == 2
        ns = stack.namespace.id
        assert list(backend._share_blocks(Share(ns, TAG_A))) == []
        assert sorted(b.key for b in backend._share_blocks(Share(ns))) == sorted(keys_a)
    finally:
        stack.close()


def test_a_backend_that_counts_no_tenants_charges_them_to_their_namespace_and_says_so(tmp_path, caplog):
    """A backend that cannot list a tenant's blocks (``counts_tenants`` false: a third party's) stores a
    tenant's puts, charges them to the namespace's quota (never refused), and the log says so once."""
    import logging

    class Untenanted(LocalDiskBackend):
        counts_tenants = False

    backend = Untenanted({"path": str(tmp_path / "blocks")}, name="plain")
    backend.limit(QUOTA)
    ns = "a" * 32
    keys = [f"{ns}/{i:064x}" for i in range(6)]
    try:
        with caplog.at_level(logging.INFO, logger="kvtier.backend_api"):
            for i, k in enumerate(keys):
                assert backend.put([k], [os.urandom(PAYLOAD)], 1, tenants=[(TAG_A, TAG_B)[i % 2]]) == [True]
        said = [r for r in caplog.records if "cannot list a cache_salt tenant's blocks" in r.getMessage()]
        assert len(said) == 1 and "salt" not in said[0].getMessage().replace("cache_salt", "")
        held = [k for k, ok in zip(keys, backend.exists(keys)) if ok]
        assert 0 < len(held) * STORED <= QUOTA  # one share: the namespace's
        assert sorted(b.key for b in backend._share_blocks(Share(ns))) == held
    finally:
        backend.close()


def backend_blocks(stack: TierStack) -> list[str]:
    return sorted(b.key for b in stack.backends[0].scan(stack.namespace.id))


def test_kvtier_runs_engine_charges_each_salted_request_to_its_tenant(tmp_path):
    """``kvtier run`` / the Python API (``CachedEngine.run_request(..., cache_salt=)``): one engine serving
    requests of two salts and an unsalted one stores each request's blocks in its own share."""
    from kvtier.integrations.engine import CachedEngine

    data = {
        "model": {"id": "test/tenants", "kv_dtype": "float32", "num_layers": LAYERS, "num_kv_heads": HEADS,
                  "head_dim": HEAD_DIM, "block_size": BLOCK},
        "device": {"kind": "cpu", "num_blocks": 16, "layout": "flash_attn"},
        "host": {"capacity": 8 * PAYLOAD, "pinned": False},
        "backends": [{**disk(tmp_path), "quota": QUOTA}],
        "policies": {"write": {"name": "write_through"}},
        "transfer": {"threads": 1},
    }
    engine = CachedEngine.from_config(parse_config(data))
    try:
        prompt = list(range(3 * BLOCK + 1))  # 3 full blocks, each request's own keys (salted or not)
        for salt in (SALT_A, SALT_B, None):
            engine.run_request(prompt, cache_salt=salt, max_new_tokens=1)
        engine.flush(10.0)
        stack, hasher = engine.stack, engine.stack.namespace.hasher()
        ns, backend = stack.namespace, stack.backends[0]
        for share, salt in ((Share(ns.id, TAG_A), SALT_A), (Share(ns.id, TAG_B), SALT_B), (Share(ns.id), None)):
            want = ns.keys(hasher.hash_blocks(prompt, cache_salt=salt))
            assert sorted(b.key for b in backend._share_blocks(share)) == sorted(want)
    finally:
        engine.close()


def test_redis_a_tenant_record_that_fails_leaves_the_put_standing(caplog):
    """A redis-server that refuses the tenants' sorted sets (``rename-command ZADD ""``): a tenant's puts are
    stored, the failure to record their tenant is logged (without a key) and counted, not as an outage,
    and the blocks count as their namespace's."""
    import logging

    from kvtier.testing.redis_server import redis_available, start_redis

    if (why := redis_available()) is not None:
        pytest.skip(why)
    srv = start_redis(extra_args=["--rename-command", "ZADD", ""])
    stack = make_stack({"name": "shared", "type": "redis",
                        "options": {"url": srv.url, "key_prefix": "team:", "eviction_events": "off"}})
    req = Requests(stack)
    backend = stack.backends[0]
    try:
        with caplog.at_level(logging.WARNING, logger="kvtier.backend_api"):
            keys_a = req.serve(SALT_A, 3)
        assert req.held(keys_a) == keys_a
        said = [r.getMessage() for r in caplog.records if "could not record the tenants" in r.getMessage()]
        assert len(said) == 3 and all(k.partition("/")[2] not in m for m in said for k in keys_a)
        stats = backend.stats()
        assert (stats.tenants_unrecorded, stats.put_failures, stats.unavailable) == (3, 0, 0)
        ns = stack.namespace.id
        assert list(backend._share_blocks(Share(ns, TAG_A))) == []
        assert sorted(b.key for b in backend._share_blocks(Share(ns))) == sorted(keys_a)
        plain = req.serve(None, 1)  # the namespace's share holds both now: 4 blocks, its whole quota
        assert req.held(keys_a + plain) == keys_a + plain
    finally:
        stack.close()
        srv.cleanup()


def test_a_faulty_backend_wrapper_counts_and_lists_tenants_as_its_inner_backend(tmp_path):
    """``FaultyBackend`` (the fault-injection wrapper) says what its inner backend says of tenants: whether
    it counts them (so a put's tenants are charged, and ``kvtier inspect`` asks) and their records; a
    scan fault reaches ``tenant_records`` as it reaches ``scan``."""
    from kvtier.backend_api import BackendUnavailable
    from kvtier.testing.faults import FaultyBackend

    inner = LocalDiskBackend({"path": str(tmp_path / "blocks")}, name="disk")
    wrapped = FaultyBackend(inner)
    ns = "e" * 32
    keys = [f"{ns}/{i:064x}" for i in range(3)]
    try:
        assert wrapped.counts_tenants is True
        assert wrapped.put(keys, [os.urandom(PAYLOAD)] * 3, 1, tenants=[TAG_A, None, TAG_B]) == [True] * 3
        assert wrapped.tenant_records(ns) == inner.tenant_records(ns) == {keys[0]: TAG_A, keys[2]: TAG_B}
        wrapped.fail("scan", times=1)
        with pytest.raises(BackendUnavailable):
            wrapped.tenant_records(ns)
    finally:
        wrapped.close()
