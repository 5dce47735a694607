"""Two deployments sharing one store (issue 45, section 3): a directory, a Redis with a ``key_prefix``, an S3
bucket under a ``prefix``.  Each deployment's tools see only its own namespaces unless told
``--all-namespaces``; a quota per namespace keeps one deployment's puts from evicting the other's blocks
within its own quota.  The tools run in process (``kvtier.tools.cli.main``) against real files, a real
redis-server and moto's server over HTTP."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.config import load_config
from kvtier.keys import Namespace
from kvtier.tools.cli import main

MODEL_A: dict[str, Any] = {"id": "tenant-a/model", "kv_dtype": "float32", "num_layers": 2, "num_kv_heads": 2,
                           "head_dim": 8, "block_size": 4, "tp_size": 2}
MODEL_B: dict[str, Any] = {**MODEL_A, "id": "tenant-b/model"}
PAYLOAD = 2 * 2 * 4 * 2 * 8 * 4  # layers * (K, V) * tokens * heads * head_dim * float32 = 1024
STORED = PAYLOAD + 88


def write_config(tmp_path: Path, name: str, model: dict[str, Any], backend: dict[str, Any],
                 quota: int | None = None) -> str:
    b = {**backend, **({"quota": quota} if quota is not None else {})}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"model": model, "keys": {"seed": "tenants"}, "backends": [b]}))
    return str(path)


def cli_json(capsys, *argv: str) -> tuple[int, dict[str, Any]]:
    rc = main([*argv, "--json"])
    out, _ = capsys.readouterr()
    return rc, json.loads(out)


def put(backend, ns: Namespace, n: int) -> list[str]:
    keys = ns.keys([os.urandom(32) for _ in range(n)])
    assert backend.put(keys, [os.urandom(PAYLOAD) for _ in keys], ns.layout_id) == [True] * n
    return keys


def disk(tmp_path: Path) -> dict[str, Any]:
    return {"name": "shared", "type": "local_disk", "options": {"path": str(tmp_path / "blocks")}}


def redis(url: str) -> dict[str, Any]:
    return {"name": "shared", "type": "redis", "options": {"url": url, "key_prefix": "team:"}}


def s3(endpoint: str, bucket: str) -> dict[str, Any]:
    return {"name": "shared", "type": "s3", "options": {"endpoint_url": endpoint, "bucket": bucket, "prefix": "kv/"}}


@pytest.fixture(params=["local_disk", "redis", "s3"])
def shared(request, tmp_path):
    """(backend config shared by both deployments, a callable flipping a stored byte of a key)."""
    if request.param == "local_disk":
        def flip_file(key: str) -> None:
            ns, h = key.split("/")
            p = tmp_path / "blocks" / ns / h[:2] / h
            data = bytearray(p.read_bytes())
            data[100] ^= 1
            p.write_bytes(bytes(data))
        return disk(tmp_path), flip_file
    if request.param == "redis":
        srv = request.getfixturevalue("redis_server")

        def flip_redis(key: str) -> None:
            r = srv.client()
            old = r.getrange(f"team:{key}", 100, 100)
            r.setrange(f"team:{key}", 100, bytes([old[0] ^ 1]))
        return redis(srv.url), flip_redis
    moto, bucket = request.getfixturevalue("moto_server"), request.getfixturevalue("s3_bucket")

    def flip(key: str) -> None:
        c = moto.client()
        body = bytearray(c.get_object(Bucket=bucket, Key=f"kv/{key}")["Body"].read())
        body[100] ^= 1
        c.put_object(Bucket=bucket, Key=f"kv/{key}", Body=bytes(body))
    return s3(moto.endpoint_url, bucket), flip


def test_tools_see_only_their_own_namespaces(tmp_path, capsys, shared):
    """B's inspect does not list A's model id and B's verify does not read A's blocks; A's other TP rank
    is A's; with --all-namespaces B's tools see A's too."""
    conf, flip = shared
    cfg_a, cfg_b = (write_config(tmp_path, n, m, conf) for n, m in (("a", MODEL_A), ("b", MODEL_B)))
    a, b = load_config(cfg_a, env={}), load_config(cfg_b, env={})
    ns_a, ns_b = a.namespace(), b.namespace()
    ns_a1 = Namespace(**{**ns_a.manifest(), "tp_rank": 1})
    with a.build_backend(a.backends[0]) as backend:
        for ns in (ns_a, ns_a1, ns_b):
            backend.put_manifest(ns)
        keys_a = put(backend, ns_a, 4) + put(backend, ns_a1, 2)
        keys_b = put(backend, ns_b, 3)
    flip(keys_a[0])  # damage A's block: only a tool that reads it can tell

    rc, doc = cli_json(capsys, "inspect", "--config", cfg_b)
    (be,) = doc["backends"]
    assert rc == 0 and [ns["id"] for ns in be["namespaces"]] == [ns_b.id] and be["other_namespaces"] == 2
    assert MODEL_A["id"] not in json.dumps(doc) and be["blocks"] == 3 and be["store_blocks"] == 9
    main(["inspect", "--config", cfg_b])
    out = capsys.readouterr().out
    assert MODEL_A["id"] not in out and ns_a.id not in out and "2 other namespaces" in out

    rc, doc = cli_json(capsys, "verify", "--config", cfg_b)
    (be,) = doc["backends"]
    assert rc == 0 and be["checked"] == 3 and be["bytes_checked"] == 3 * STORED and be["corrupt"] == []

    rc, doc = cli_json(capsys, "inspect", "--config", cfg_a)  # A's own: its config's rank and its rank 1
    (be,) = doc["backends"]
    assert {ns["id"]: ns["blocks"] for ns in be["namespaces"]} == {ns_a.id: 4, ns_a1.id: 2}
    assert be["other_namespaces"] == 1 and MODEL_B["id"] not in json.dumps(doc)

    rc, doc = cli_json(capsys, "inspect", "--config", cfg_b, "--all-namespaces")
    assert rc == 0 and MODEL_A["id"] in json.dumps(doc) and doc["backends"][0]["blocks"] == 9
    rc, doc = cli_json(capsys, "verify", "--config", cfg_b, "--all-namespaces")
    (be,) = doc["backends"]
    assert rc == 1 and be["checked"] == 9 and [c["key"] for c in be["corrupt"]] == [keys_a[0]]
    rc, doc = cli_json(capsys, "verify", "--config", cfg_b, "--fix")  # B's --fix leaves A's block alone
    assert rc == 0 and doc["backends"][0]["deleted"] == []
    rc, doc = cli_json(capsys, "verify", "--config", cfg_a)
    assert rc == 1 and [c["key"] for c in doc["backends"][0]["corrupt"]] == [keys_a[0]]
    assert set(keys_b).isdisjoint(json.dumps(doc))


def test_gc_evicts_only_its_own_namespaces(tmp_path, capsys):
    conf_a = disk(tmp_path)
    conf = {**conf_a, "options": {**conf_a["options"], "capacity": 6 * STORED}}
    cfg_a, cfg_b = (write_config(tmp_path, n, m, conf) for n, m in (("a", MODEL_A), ("b", MODEL_B)))
    a, b = load_config(cfg_a, env={}), load_config(cfg_b, env={})
    with a.build_backend(a.backends[0]) as backend:  # capacity 6: A's 4 then B's 2, nothing evicted
        keys_a = put(backend, a.namespace(), 4)
        keys_b = put(backend, b.namespace(), 2)
    conf["options"]["capacity"] = 3 * STORED  # lowered: 3 blocks over
    for name, model in (("a", MODEL_A), ("b", MODEL_B)):
        write_config(tmp_path, name, model, conf)
    rc, doc = cli_json(capsys, "gc", "--config", cfg_b)
    be = doc["backends"][0]
    assert rc == 0 and sorted(be["evicted"]) == sorted(keys_b) and be["bytes_after"] == 4 * STORED
    main(["gc", "--config", cfg_b])
    assert "still over" in capsys.readouterr().out
    rc, doc = cli_json(capsys, "gc", "--config", cfg_b, "--all-namespaces")
    be = doc["backends"][0]
    assert rc == 0 and sorted(be["evicted"]) == sorted(keys_a[:1]) and be["bytes_after"] == 3 * STORED


def test_engine_yaml_scope(tmp_path, capsys):
    """An engine YAML's own namespaces are those whose manifest matches the model fields it sets; one that
    sets no model.id is refused (exit 2, one line) unless --all-namespaces."""
    cfg_a = write_config(tmp_path, "a", MODEL_A, disk(tmp_path))
    a = load_config(cfg_a, env={})
    b_ns = Namespace(**{**a.namespace().manifest(), "model": MODEL_B["id"]})
    with a.build_backend(a.backends[0]) as backend:
        backend.put_manifest(a.namespace())
        backend.put_manifest(b_ns)
        put(backend, a.namespace(), 2)
        put(backend, b_ns, 3)
    engine = tmp_path / "engine.yaml"
    engine.write_text(yaml.safe_dump({"model": {"id": MODEL_B["id"]}, "backends": [disk(tmp_path)]}))
    rc, doc = cli_json(capsys, "inspect", "--config", str(engine))
    (be,) = doc["backends"]
    assert rc == 0 and [ns["id"] for ns in be["namespaces"]] == [b_ns.id] and be["other_namespaces"] == 1
    engine.write_text(yaml.safe_dump({"backends": [disk(tmp_path)]}))
    for tool in ("inspect", "verify", "gc"):
        rc = main([tool, "--config", str(engine)])
        err = capsys.readouterr().err
        assert rc == 2 and "sets no model.id" in err and "--all-namespaces" in err and len(err.splitlines()) == 1
    rc, doc = cli_json(capsys, "inspect", "--config", str(engine), "--all-namespaces")
    assert rc == 0 and doc["backends"][0]["blocks"] == 5


# ------------------------------------------------------------------------------------- quotas


def test_quota_config_errors(tmp_path):
    from kvtier.config import ConfigError

    cases = [({**disk(tmp_path), "quota": "2GiB", "options": {"path": str(tmp_path), "capacity": "1GiB"}},
              "backends[0].quota: 2GiB is more than backend shared's capacity (1GiB): a quota is a share of it"),
             ({**disk(tmp_path), "quota": "1MiB", "write": False}, "backends[0].quota: backend shared is read-only"),
             ({**disk(tmp_path), "quota": "lots"}, "backends[0].quota: "),
             ({**disk(tmp_path), "quota": 0}, "backends[0].quota: expected a size of at least 1 byte")]
    for i, (backend, message) in enumerate(cases):
        path = tmp_path / f"bad{i}.yaml"
        path.write_text(yaml.safe_dump({"model": MODEL_A, "backends": [backend]}))
        with pytest.raises(ConfigError) as e:
            load_config(str(path), env={})
        assert len(e.value.problems) == 1 and e.value.problems[0].startswith(message), e.value.problems
    ok = write_config(tmp_path, "ok", MODEL_A, disk(tmp_path), quota="64MiB")  # type: ignore[arg-type]
    assert load_config(ok, env={}).backends[0].quota == 64 << 20


def deployment(tmp_path: Path, name: str, model: dict[str, Any], backend: dict[str, Any], quota: int | None):
    """(the backend as the deployment opens it, its namespace, the keys the stack was told were evicted)."""
    cfg = load_config(write_config(tmp_path, name, model, backend, quota), env={})
    b = cfg.build_backend(cfg.backends[0])
    told: list[str] = []
    b.on_evicted = told.extend
    return b, cfg.namespace(), told


@pytest.mark.parametrize("b_quota", [4, None])
def test_local_disk_puts_do_not_evict_another_namespace_within_its_quota(tmp_path, capsys, b_quota):
    """The issue's case: a directory of 8 blocks shared by A (quota 4 blocks, holding 4) and B.  B's 8 puts
    evicted A's blocks; now B loses its own: by its quota when it has one, by the capacity (A's blocks
    being within A's quota) when it has none.  Two backend instances, as two processes open the
    directory: the quota is in the directory's shared index."""
    conf = {**disk(tmp_path), "options": {"path": str(tmp_path / "blocks"), "capacity": 8 * STORED}}
    a, ns_a, _ = deployment(tmp_path, "a", MODEL_A, conf, 4 * STORED)
    b, ns_b, told_b = deployment(tmp_path, "b", MODEL_B, conf, None if b_quota is None else b_quota * STORED)
    keys_a = put(a, ns_a, 4)
    keys_b = [k for _ in range(8) for k in put(b, ns_b, 1)]
    assert a.exists(keys_a) == [True] * 4
    main(["inspect", "--config", str(tmp_path / "a.yaml")])
    assert f"namespace {ns_a.id}  [this config]: 4 blocks, 4.3KiB of quota 4.3KiB (100.0%)" in \
        capsys.readouterr().out
    held_b = [k for k, ok in zip(keys_b, b.exists(keys_b)) if ok]
    assert held_b == keys_b[-len(held_b):]  # B kept its most recent blocks
    assert len(held_b) * STORED <= (4 if b_quota is None else b_quota) * STORED
    assert set(told_b) == set(keys_b) - set(held_b)  # the stack was told of every block B lost
    a.close()
    b.close()


def test_local_disk_without_quotas_the_issue_reproduces(tmp_path):
    """The control: no quota anywhere, B's puts evict A's least recently used blocks."""
    conf = {**disk(tmp_path), "options": {"path": str(tmp_path / "blocks"), "capacity": 8 * STORED}}
    a, ns_a, _ = deployment(tmp_path, "a", MODEL_A, conf, None)
    b, ns_b, _ = deployment(tmp_path, "b", MODEL_B, conf, None)
    keys_a = put(a, ns_a, 4)
    for _ in range(6):
        put(b, ns_b, 1)
    assert a.exists(keys_a) == [False, False, True, True]
    a.close()
    b.close()


def test_local_disk_namespace_over_its_quota_loses_its_own_oldest(tmp_path):
    """A at quota 4 blocks: its 5th put takes it over, and it loses its least recently used blocks (one it
    read again is not among them), never the blocks of B, which has no quota."""
    conf = {**disk(tmp_path), "options": {"path": str(tmp_path / "blocks"), "capacity": 64 * STORED}}
    a, ns_a, told = deployment(tmp_path, "a", MODEL_A, conf, 4 * STORED)
    b, ns_b, _ = deployment(tmp_path, "b", MODEL_B, conf, None)
    keys_b = put(b, ns_b, 6)
    keys_a = [k for _ in range(3) for k in put(a, ns_a, 1)]
    assert a.get_into(keys_a[:1], [bytearray(PAYLOAD)], ns_a.layout_id) == [True]  # no longer the oldest
    keys_a += [k for _ in range(2) for k in put(a, ns_a, 1)]
    left = [k for k, ok in zip(keys_a, a.exists(keys_a)) if ok]
    assert keys_a[0] in left and keys_a[1] not in left and told == [k for k in keys_a if k not in left]
    assert sum(blk.size for blk in a.scan(ns_a.id)) <= 4 * STORED and b.exists(keys_b) == [True] * 6
    a.close()
    b.close()


@pytest.fixture
def small_redis():
    from kvtier.testing.redis_server import redis_available, start_redis

    if redis_available():
        pytest.skip(str(redis_available()))
    srv = start_redis(extra_args=["--maxmemory", "8mb", "--maxmemory-policy", "allkeys-lru"])
    yield srv
    srv.cleanup()


@pytest.mark.parametrize("b_quota", [2 << 20, None])
def test_redis_quota_keeps_a_deployment_from_evicting_another(tmp_path, small_redis, b_quota):
    """A Redis at maxmemory 8 MiB with key_prefix, shared: A writes 4 blocks of 256 KiB, B 40 (10 MiB).
    Without a quota Redis's own LRU evicts A's blocks; with B's quota (2 MiB) B trims its own and Redis
    never reaches maxmemory."""
    conf = redis(small_redis.url)
    conf["options"]["eviction_events"] = "off"
    a, ns_a, _ = deployment(tmp_path, "a", MODEL_A, conf, 2 << 20)
    b, ns_b, told_b = deployment(tmp_path, "b", MODEL_B, conf, b_quota)
    size = 256 << 10
    keys_a = ns_a.keys([os.urandom(32) for _ in range(4)])
    assert a.put(keys_a, [os.urandom(size) for _ in keys_a], ns_a.layout_id) == [True] * 4
    for _ in range(40):
        k = ns_b.keys([os.urandom(32)])
        b.put(k, [os.urandom(size)], ns_b.layout_id)
    kept_a = a.exists(keys_a)
    if b_quota is None:
        assert kept_a != [True] * 4  # the control: the issue's case
    else:
        assert kept_a == [True] * 4
        assert sum(blk.size for blk in b.scan(ns_b.id)) <= b_quota and len(told_b) >= 32
    a.close()
    b.close()


def test_s3_quota_keeps_a_namespace_within_it(tmp_path, moto_server, s3_bucket):
    conf = s3(moto_server.endpoint_url, s3_bucket)
    a, ns_a, _ = deployment(tmp_path, "a", MODEL_A, conf, None)
    b, ns_b, told_b = deployment(tmp_path, "b", MODEL_B, conf, 3 * STORED)
    keys_a = put(a, ns_a, 4)
    keys_b = [k for _ in range(6) for k in put(b, ns_b, 1)]
    left = [blk.key for blk in b.scan(ns_b.id)]
    assert len(left) * STORED <= 3 * STORED and set(told_b) == set(keys_b) - set(left)
    assert a.exists(keys_a) == [True] * 4
    a.close()
    b.close()


def test_local_disk_quota_holds_across_processes(tmp_path):
    """B in a process of its own, without a quota, fills the directory A shares: A's blocks within A's
    quota stay (the quota is recorded in the directory's index, which every process opens)."""
    import subprocess
    import sys

    conf = {**disk(tmp_path), "options": {"path": str(tmp_path / "blocks"), "capacity": 8 * STORED}}
    a, ns_a, _ = deployment(tmp_path, "a", MODEL_A, conf, 4 * STORED)
    keys_a = put(a, ns_a, 4)
    cfg_b = write_config(tmp_path, "b", MODEL_B, conf)
    script = f"""
import os
from kvtier.config import load_config
cfg = load_config({cfg_b!r}, env={{}})
ns = cfg.namespace()
with cfg.build_backend(cfg.backends[0]) as b:
    for _ in range(8):
        assert b.put(ns.keys([os.urandom(32)]), [os.urandom({PAYLOAD})], ns.layout_id) == [True]
    print(sum(blk.size for blk in b.scan(ns.id)))
"""
    r = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    assert int(r.stdout) == 4 * STORED  # B kept what the capacity left it: its own 4 most recent
    assert a.exists(keys_a) == [True] * 4
    a.close()


def test_quota_counts_at_most_once_per_sixteenth_written():
    """The listing is the expensive part (a SCAN of a Redis, a LIST of a prefix): made when the estimate
    goes over, then not again before quota / 16 bytes more are written here, even while something else
    keeps removing the namespace's blocks (so a count may find it just within); the namespace exceeds
    its quota by at most that 1/16."""
    from kvtier.quota import SLACK, QuotaKeeper, Share

    stored: dict[str, int] = {}
    counts = []

    def blocks(share: Share) -> list[tuple[str, int]]:
        counts.append(share)
        return [(k, n) for k, n in stored.items() if k.startswith(share.namespace)]

    def remove(share: Share, keys: list[str]) -> None:
        assert all(k.startswith(share.namespace) for k in keys)
        for k in keys:
            del stored[k]

    keeper = QuotaKeeper(1600, blocks, remove)
    for i in range(400):
        stored[f"{'a' * 32}/{i:064x}"] = 10
        keeper.wrote([(f"{'a' * 32}/{i:064x}", 10)])
        if i % 7 == 0:  # another process removes some
            stored.pop(next(iter(stored)))
    assert sum(stored.values()) <= 1600 + 1600 // SLACK and keeper.trimmed > 0  # the documented bound
    assert 1 < len(counts) <= 1 + 400 * 10 // (1600 // SLACK)


# ------------------------------------------------------------------ quotas per cache_salt tenant


def tenant_deployment(tmp_path: Path, name: str, salt: str | None, backend: dict[str, Any], quota: int | None,
                      tenant_namespace: bool = True):
    """A deployment of MODEL_A serving the tenant whose requests carry ``salt`` (``security.tenant``)."""
    security = {"tenant": salt, "tenant_namespace": tenant_namespace} if salt is not None else {}
    b = {**backend, **({"quota": quota} if quota is not None else {})}
    path = tmp_path / f"{name}.yaml"
    path.write_text(yaml.safe_dump({"model": MODEL_A, "keys": {"seed": "tenants"}, "backends": [b],
                                    "security": security}))
    cfg = load_config(str(path), env={})
    backend_ = cfg.build_backend(cfg.backends[0])
    told: list[str] = []
    backend_.on_evicted = told.extend
    return backend_, cfg.namespace(), told


def test_a_tenant_namespace_is_its_own_and_changes_no_other_key(tmp_path):
    """``security.tenant_namespace``: the tenant's tag (never its salt) is in the namespace, so two tenants of
    one model get two namespaces; without it, and for deployments without a tenant, the namespace and
    so every key is the one they had (the field is left out of the manifest when empty)."""
    from kvtier.config import ConfigError
    from kvtier.keys import tenant_tag

    conf = disk(tmp_path)
    plain = tenant_deployment(tmp_path, "plain", None, conf, None)[1]
    off = tenant_deployment(tmp_path, "off", "salt-a", conf, None, tenant_namespace=False)[1]
    a = tenant_deployment(tmp_path, "a", "salt-a", conf, None)[1]
    b = tenant_deployment(tmp_path, "b", "salt-b", conf, None)[1]
    assert "tenant" not in plain.manifest() and plain.id == off.id
    assert plain.id == Namespace(model=MODEL_A["id"], kv_dtype="float32", num_layers=2, num_kv_heads=2,
                                 head_dim=8, block_size=4, tp_size=2, hash_seed="tenants").id
    assert len({plain.id, a.id, b.id}) == 3
    assert a.manifest()["tenant"] == tenant_tag("salt-a") and "salt-a" not in json.dumps(a.manifest())
    assert Namespace.from_manifest(a.manifest()).id == a.id
    with pytest.raises(ValueError, match="tenant: expected '' or a tenant tag"):
        Namespace(model="m", kv_dtype="float32", num_layers=1, num_kv_heads=1, head_dim=1, block_size=1,
                  tenant="salt-a")
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump({"model": MODEL_A, "backends": [conf], "security": {"tenant_namespace": True}}))
    with pytest.raises(ConfigError) as e:
        load_config(str(path), env={})
    assert e.value.problems == ["security.tenant_namespace: true needs security.tenant (the cache_salt of the "
                                "tenant whose namespace it is)"]


@pytest.mark.parametrize("per_tenant", [True, False])
def test_local_disk_a_tenant_within_its_quota_keeps_its_blocks_against_another_tenant_of_the_model(
        tmp_path, per_tenant):
    """Two tenants of one model share a directory of 8 blocks: A (quota 4) holds 4, B (quota 4) puts 8.
    With ``tenant_namespace`` B loses its own oldest blocks, never A's (each tenant's count is its own
    namespace's); without it (the control) both are one namespace and B's puts take A's blocks."""
    conf = {**disk(tmp_path), "options": {"path": str(tmp_path / "blocks"), "capacity": 8 * STORED}}
    a, ns_a, _ = tenant_deployment(tmp_path, "a", "salt-a", conf, 4 * STORED, per_tenant)
    b, ns_b, told_b = tenant_deployment(tmp_path, "b", "salt-b", conf, 4 * STORED, per_tenant)
    keys_a = put(a, ns_a, 4)
    if not per_tenant:
        assert ns_a.id == ns_b.id
        for _ in range(8):
            put(b, ns_b, 1)
        assert a.exists(keys_a) == [False] * 4
        a.close()
        b.close()
        return
    keys_b = [k for _ in range(8) for k in put(b, ns_b, 1)]
    assert a.exists(keys_a) == [True] * 4
    held_b = [k for k, ok in zip(keys_b, b.exists(keys_b)) if ok]
    assert held_b == keys_b[-len(held_b):] and len(held_b) <= 4
    assert set(told_b) == set(keys_b) - set(held_b)
    assert sum(blk.size for blk in a.scan(ns_a.id)) == 4 * STORED
    a.close()
    b.close()
