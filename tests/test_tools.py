"""``kvtier inspect``, ``kvtier verify`` and ``kvtier gc`` against real backends: local_disk in tmp_path,
a real redis-server (one with a password) and moto's S3 server over HTTP.  Corruption is done the way
it happens in the field: a byte flipped in a file, SETRANGE on a Redis value, an S3 object re-put with
changed bytes, a truncated file, another key's block under a name."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.backend_api import StoredBlock
from kvtier.backends.local_disk import JOURNAL_NAME, LEDGER_NAME, LocalDiskBackend
from kvtier.keys import Namespace
from kvtier.testing.redis_server import redis_available, start_redis
from kvtier.tools.cli import main
from kvtier.tools.commands._storage_tools import NamespaceInfo

MODEL: dict[str, Any] = {"id": "kvtier/tools-test", "kv_dtype": "float32", "num_layers": 2, "num_kv_heads": 2,
                         "head_dim": 8, "block_size": 4}
NS = Namespace(MODEL["id"], "float32", 2, 2, 8, 4, hash_seed="tools")
PAYLOAD = 2 * 2 * 4 * 2 * 8 * 4  # layers * (K, V) * tokens * heads * head_dim * float32 = 1024
STORED = PAYLOAD + 88
OTHER = Namespace("other/model", "bfloat16", 1, 2, 8, 4, tp_rank=1, tp_size=2, hash_seed="tools")
NOMANIFEST = Namespace("anonymous/model", "float16", 1, 1, 16, 4, hash_seed="tools")
SECRET = "Sup3r-s3cret-pw-4711"


def config(tmp_path: Path, *backends: dict[str, Any], name: str = "kv.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump({"model": MODEL, "keys": {"seed": "tools"}, "backends": list(backends)}))
    return str(path)


def disk(tmp_path: Path, capacity: int | str = "1GiB", name: str = "disk") -> dict[str, Any]:
    return {"name": name, "type": "local_disk", "options": {"path": str(tmp_path / "blocks"), "capacity": capacity}}


def cli(capsys, *argv: str) -> tuple[int, str, str]:
    rc = main(list(argv))
    out, err = capsys.readouterr()
    return rc, out, err


def cli_json(capsys, *argv: str) -> tuple[int, dict[str, Any]]:
    rc, out, err = cli(capsys, *argv, "--json")
    return rc, json.loads(out)


def put(backend, ns: Namespace, n: int, size: int | None = None) -> list[str]:
    size = PAYLOAD if size is None else size
    keys = ns.keys([os.urandom(32) for _ in range(n)])
    assert backend.put(keys, [os.urandom(size) for _ in keys], ns.layout_id) == [True] * n
    return keys


def block_path(tmp_path: Path, key: str) -> Path:
    ns, h = key.split("/")
    return tmp_path / "blocks" / ns / h[:2] / h


def flip(path: Path, offset: int) -> None:
    with open(path, "r+b") as f:
        f.seek(offset)
        b = f.read(1)
        f.seek(offset)
        f.write(bytes([b[0] ^ 0x5A]))


def test_config_namespace_is_ns(tmp_path):
    from kvtier.config import load_config

    assert load_config(config(tmp_path, disk(tmp_path)), env={}).namespace() == NS


@pytest.fixture
def populated(tmp_path):
    """A local_disk directory with 7 blocks of the config's namespace, 3 of another namespace (with a
    manifest) and 2 of a namespace without a manifest."""
    b = LocalDiskBackend({"path": str(tmp_path / "blocks")})
    b.put_manifest(NS)
    b.put_manifest(OTHER)
    keys = {"own": put(b, NS, 7), "other": put(b, OTHER, 3, 256), "anon": put(b, NOMANIFEST, 2, 200)}
    b.close()
    return keys


# ------------------------------------------------------------------------------------- inspect


def test_inspect_local_disk(tmp_path, capsys, populated):
    cfg = config(tmp_path, disk(tmp_path, capacity=4 * STORED))  # over capacity: inspect must not evict
    rc, doc = cli_json(capsys, "inspect", "--config", cfg, "--all-namespaces")
    assert rc == 0 and doc["namespace"] == NS.id
    (b,) = doc["backends"]
    assert b["name"] == "disk" and b["type"] == "local_disk" and b["error"] is None
    assert b["capacity_bytes"] == 4 * STORED and b["location"] == f"path={tmp_path / 'blocks'}"
    assert b["blocks"] == 12 and b["bytes"] == 7 * STORED + 3 * 344 + 2 * 288
    by_id = {ns["id"]: ns for ns in b["namespaces"]}
    assert list(by_id)[0] == NS.id  # the config's own namespace first
    own, other, anon = by_id[NS.id], by_id[OTHER.id], by_id[NOMANIFEST.id]
    assert (own["blocks"], own["bytes"], own["this_config"]) == (7, 7 * STORED, True)
    assert own["manifest"] == NS.manifest() and own["manifest_problem"] is None
    assert own["layout_id"] == NS.layout_id and own["block_payload_bytes"] == PAYLOAD
    assert (other["blocks"], other["bytes"], other["this_config"]) == (3, 3 * 344, False)
    assert other["manifest"]["tp_rank"] == 1 and other["manifest"]["kv_dtype"] == "bfloat16"
    assert (anon["blocks"], anon["bytes"]) == (2, 2 * 288)
    assert anon["manifest"] is None and anon["manifest_problem"] == "no manifest"
    # + 2 manifests + the usage ledger
    assert sum(1 for _ in (tmp_path / "blocks").rglob("*") if _.is_file()) == 12 + 2 + 1

    rc, out, _ = cli(capsys, "inspect", "--config", cfg, "--all-namespaces")
    assert rc == 0
    assert f"namespace {NS.id}  [this config]: 7 blocks, 7.6KiB" in out
    assert "12 blocks, 9.2KiB (9392 bytes) of capacity 4.3KiB" in out
    assert "model: kvtier/tools-test" in out and "model: other/model" in out
    assert "tp_rank: 1" in out and "hash_seed: tools" in out and f"layout id {NS.layout_id:#010x}" in out
    assert f"namespace {NOMANIFEST.id}: 2 blocks, 576B" in out
    assert "no manifest: what this namespace holds cannot be told" in out


@pytest.mark.parametrize("kind", ["local_disk", "redis", "s3"])
def test_inspect_shows_each_tenants_share(tmp_path, capsys, request, kind):
    """Where a backend counts ``cache_salt`` tenants, inspect shows per namespace each tenant's blocks and
    bytes (by tag) and the untenanted rest, each against the quota (every share has the whole quota).  A
    record whose block is gone counts nothing, and inspect leaves it (read only)."""
    from kvtier.keys import tenant_tag

    conf: dict[str, Any]
    if kind == "local_disk":
        conf = disk(tmp_path)
    elif kind == "redis":
        srv = request.getfixturevalue("redis_server")
        conf = {"name": "redis", "type": "redis", "options": {"url": srv.url, "key_prefix": "t:",
                                                             "eviction_events": "off"}}
    else:
        moto = request.getfixturevalue("moto_server")
        conf = {"name": "s3", "type": "s3", "options": {"bucket": request.getfixturevalue("s3_bucket"),
                                                       "endpoint_url": moto.endpoint_url, "prefix": "kv/"}}
    from kvtier.backends.redis import RedisBackend
    from kvtier.backends.s3 import S3Backend

    cls = {"local_disk": LocalDiskBackend, "redis": RedisBackend, "s3": S3Backend}[kind]
    b = cls(conf["options"], name=conf["name"])
    b.limit(1 << 30)  # (Redis and S3 record tenants only for a writer with a quota)
    tag_a, tag_b = tenant_tag("salt-a"), tenant_tag("salt-b")
    keys = NS.keys([os.urandom(32) for _ in range(9)])
    tenants = [tag_a] * 3 + [tag_b] * 2 + [None] * 4
    assert b.put(keys, [os.urandom(PAYLOAD) for _ in keys], NS.layout_id, tenants=tenants) == [True] * 9
    put(b, OTHER, 2, 256)
    b.delete(keys[:1])  # one of A's, its record left behind where records are beside the blocks
    records = b.tenant_records(NS.id)
    cfg = config(tmp_path, {**conf, "quota": 8 * STORED})
    try:
        rc, doc = cli_json(capsys, "inspect", "--config", cfg)
        assert rc == 0
        (ns,) = doc["backends"][0]["namespaces"]
        assert (ns["blocks"], ns["bytes"]) == (8, 8 * STORED)
        assert ns["tenants"] == [{"tenant": t, "blocks": n, "bytes": n * STORED}
                                 for t, n in sorted({tag_a: 2, tag_b: 2}.items())]
        assert ns["untenanted"] == {"blocks": 4, "bytes": 4 * STORED}
        rc, out, _ = cli(capsys, "inspect", "--config", cfg)
        assert rc == 0 and "salt-a" not in out
        assert f"    tenant {tag_a}: 2 blocks, 2.2KiB (25.0% of quota)" in out
        assert f"    tenant {tag_b}: 2 blocks, 2.2KiB (25.0% of quota)" in out
        assert "    untenanted: 4 blocks, 4.3KiB (50.0% of quota)" in out
        assert b.tenant_records(NS.id) == records  # nothing dropped
        rc, doc = cli_json(capsys, "inspect", "--config", cfg, "--all-namespaces")
        other = next(n for n in doc["backends"][0]["namespaces"] if n["id"] == OTHER.id)
        assert other["tenants"] == [] and other["untenanted"] == {"blocks": 2, "bytes": 2 * 344}
    finally:
        b.close()


def test_inspect_empty_and_manifest_only(tmp_path, capsys):
    b = LocalDiskBackend({"path": str(tmp_path / "blocks")})
    b.put_manifest(OTHER)
    b.close()
    cfg = config(tmp_path, disk(tmp_path))
    rc, doc = cli_json(capsys, "inspect", "--config", cfg)  # OTHER is another deployment's: counted only
    (be,) = doc["backends"]
    assert rc == 0 and be["blocks"] == 0 and be["namespaces"] == [] and be["other_namespaces"] == 1
    rc, doc = cli_json(capsys, "inspect", "--config", cfg, "--all-namespaces")
    (be,) = doc["backends"]
    assert rc == 0 and be["blocks"] == 0 and be["bytes"] == 0
    assert [(ns["id"], ns["blocks"], ns["manifest"]) for ns in be["namespaces"]] == \
        [(OTHER.id, 0, OTHER.manifest())]


@pytest.mark.parametrize("ns", [NS, OTHER, NOMANIFEST, Namespace("m", "float8_e4m3fn", 3, 1, 64, 16, "mla"),
                                Namespace("m", "bfloat16", 32, 8, 128, 16)])
def test_payload_size_matches_layout(ns):
    from kvtier.format.layout import KVLayout

    assert NamespaceInfo(ns.id, ns.manifest(), ns).payload_nbytes == KVLayout.from_namespace(ns, 1).block_nbytes


# ------------------------------------------------------------------------------------- verify


def test_verify_local_disk_finds_exactly_the_corrupt_blocks(tmp_path, capsys, populated):
    own, anon = populated["own"], populated["anon"]
    flip(block_path(tmp_path, own[0]), 88 + 500)  # payload byte
    flip(block_path(tmp_path, own[1]), 68)  # layout id field (the header checksum catches it)
    with open(block_path(tmp_path, own[2]), "r+b") as f:  # truncated
        f.truncate(STORED - 100)
    block_path(tmp_path, own[4]).write_bytes(block_path(tmp_path, own[5]).read_bytes())  # another key's block
    flip(block_path(tmp_path, anon[0]), 88 + 3)  # a payload byte in the namespace without a manifest
    bad = {own[0]: "payload checksum mismatch", own[1]: "header checksum mismatch",
           own[2]: "payload length", own[4]: "block hash", anon[0]: "payload checksum mismatch"}
    files = {p: p.read_bytes() for p in (tmp_path / "blocks").rglob("*")  # the ledger and journal change
             if p.is_file() and p.name not in (LEDGER_NAME, JOURNAL_NAME)}  # with deletes
    cfg = config(tmp_path, disk(tmp_path, capacity=4 * STORED))

    rc, out, err = cli(capsys, "verify", "--config", cfg, "--all-namespaces")
    assert rc == 1, out + err
    reported = {line.split()[1].rstrip(":") for line in out.splitlines() if line.strip().startswith("CORRUPT")}
    assert reported == set(bad)
    assert f"namespace {NOMANIFEST.id}: no manifest" in out and "could not be cross-checked" in out
    assert "12 blocks checked, 5 corrupt" in out and "run with --fix" in out
    assert {p: p.read_bytes() for p in files} == files  # no --fix: nothing changed, nothing evicted

    rc, doc = cli_json(capsys, "verify", "--config", cfg, "--all-namespaces")
    (b,) = doc["backends"]
    assert rc == 1 and doc["corrupt"] == 5 and b["deleted"] == []
    assert {c["key"] for c in b["corrupt"]} == set(bad)
    for c in b["corrupt"]:
        assert bad[c["key"]] in c["reason"], c
    assert b["layout_not_cross_checked"] == {NOMANIFEST.id: "no manifest"}
    assert b["ok"] == 7 and b["checked"] == 12

    rc, out, _ = cli(capsys, "verify", "--config", cfg, "--all-namespaces", "--fix")
    assert rc == 0 and "5 corrupt, 5 deleted" in out
    left = {p for p in files if p.exists()}
    assert left == set(files) - {block_path(tmp_path, k) for k in bad}
    assert all(p.read_bytes() == files[p] for p in left)

    rc, doc = cli_json(capsys, "verify", "--config", cfg, "--all-namespaces")
    assert rc == 0 and doc["corrupt"] == 0 and doc["backends"][0]["ok"] == 7
    b = LocalDiskBackend({"path": str(tmp_path / "blocks")})
    good = [own[3], own[5], own[6]]
    assert b.get_into(good, [bytearray(PAYLOAD) for _ in good], NS.layout_id) == [True] * 3
    b.close()


@pytest.mark.timeout(60)
def test_verify_finishes_on_a_fifo_under_a_block_name(tmp_path, capsys, populated):
    """A FIFO where a block file should be: opening it for reading would wait for a writer forever.  verify
    reports it as corrupt without blocking, and --fix removes it."""
    own = populated["own"]
    fifo = block_path(tmp_path, NS.key(bytes(32)))
    fifo.parent.mkdir(parents=True, exist_ok=True)
    os.mkfifo(fifo)
    cfg = config(tmp_path, disk(tmp_path))
    rc, doc = cli_json(capsys, "verify", "--config", cfg, "--all-namespaces")
    (b,) = doc["backends"]
    assert rc == 1 and [c["key"] for c in b["corrupt"]] == [NS.key(bytes(32))], b
    assert b["ok"] == len(own) + 5 and fifo.exists()  # no --fix: left alone
    rc, out, _ = cli(capsys, "verify", "--config", cfg, "--all-namespaces", "--fix")
    assert rc == 0 and "1 corrupt, 1 deleted" in out, out
    assert not os.path.lexists(fifo)


def test_verify_checks_payload_length_against_the_manifest(tmp_path, capsys):
    b = LocalDiskBackend({"path": str(tmp_path / "blocks")})
    b.put_manifest(NS)
    good, short = put(b, NS, 3), put(b, NS, 1, PAYLOAD // 2)  # framed and checksummed, but the wrong size
    b.close()
    rc, doc = cli_json(capsys, "verify", "--config", config(tmp_path, disk(tmp_path)))
    (c,) = doc["backends"][0]["corrupt"]
    assert rc == 1 and c["key"] == short[0] and f"{PAYLOAD}-byte blocks" in c["reason"]
    assert len(good) == doc["backends"][0]["ok"]


def test_verify_manifest_of_another_namespace_is_not_trusted(tmp_path, capsys):
    b = LocalDiskBackend({"path": str(tmp_path / "blocks")})
    keys = put(b, NS, 2)
    b._write_small(f"{NS.id}/manifest.json", json.dumps(OTHER.manifest()).encode())  # a wrong manifest
    b.close()
    rc, doc = cli_json(capsys, "verify", "--config", config(tmp_path, disk(tmp_path)))
    be = doc["backends"][0]
    assert rc == 0 and be["ok"] == len(keys)
    assert f"describes namespace {OTHER.id}" in be["layout_not_cross_checked"][NS.id]


@pytest.fixture
def redis_backend_cfg(redis_server):
    from kvtier.backends.redis import RedisBackend

    b = RedisBackend({"url": redis_server.url})
    yield redis_server, b, {"name": "redis", "type": "redis", "options": {"url": redis_server.url}}
    b.close()


def test_verify_redis(tmp_path, capsys, redis_backend_cfg):
    srv, b, conf = redis_backend_cfg
    b.put_manifest(NS)
    keys = put(b, NS, 12) + put(b, NOMANIFEST, 3, 200)
    r = srv.client()
    bad = [keys[1], keys[6], keys[13]]
    for k, off in zip(bad, (88 + 1000, 40, 88 + 7)):  # payload, block hash field, payload (no manifest)
        old = r.getrange(f"kvtier:{k}", off, off)
        r.setrange(f"kvtier:{k}", off, bytes([old[0] ^ 0xFF]))
    cfg = config(tmp_path, conf)

    rc, doc = cli_json(capsys, "verify", "--config", cfg, "--all-namespaces")
    be = doc["backends"][0]
    assert rc == 1 and {c["key"] for c in be["corrupt"]} == set(bad) and be["ok"] == 12
    assert be["layout_not_cross_checked"] == {NOMANIFEST.id: "no manifest"}
    assert all(r.exists(f"kvtier:{k}") for k in keys)

    rc, out, _ = cli(capsys, "verify", "--config", cfg, "--all-namespaces", "--fix")
    assert rc == 0 and "15 blocks checked, 3 corrupt, 3 deleted" in out
    assert [bool(r.exists(f"kvtier:{k}")) for k in keys] == [k not in bad for k in keys]
    assert r.exists(f"kvtier:{NS.id}/manifest.json")
    assert cli_json(capsys, "verify", "--config", cfg, "--all-namespaces")[0] == 0

    rc, doc = cli_json(capsys, "inspect", "--config", cfg, "--all-namespaces")
    by_id = {ns["id"]: ns for ns in doc["backends"][0]["namespaces"]}
    assert rc == 0 and by_id[NS.id]["blocks"] == 10 and by_id[NS.id]["bytes"] == 10 * STORED
    assert by_id[NS.id]["manifest"] == NS.manifest() and by_id[NOMANIFEST.id]["blocks"] == 2

    rc, doc = cli_json(capsys, "gc", "--config", cfg, "--all-namespaces")  # no capacity option: skipped
    assert rc == 0 and "no capacity option" in doc["backends"][0]["skipped"]


def test_verify_s3(tmp_path, capsys, moto_server, s3_bucket):
    from kvtier.backends.s3 import S3Backend

    opts = {"bucket": s3_bucket, "endpoint_url": moto_server.endpoint_url, "prefix": "kv/"}
    b = S3Backend(opts)
    b.put_manifest(NS)
    keys = put(b, NS, 10)
    b.close()
    s3 = moto_server.client()
    bad = [keys[2], keys[7]]
    for k, off in zip(bad, (88 + 11, 20)):  # a payload byte, a namespace digest byte
        body = bytearray(s3.get_object(Bucket=s3_bucket, Key=f"kv/{k}")["Body"].read())
        body[off] ^= 0x01
        s3.put_object(Bucket=s3_bucket, Key=f"kv/{k}", Body=bytes(body))
    cfg = config(tmp_path, {"name": "s3", "type": "s3", "options": opts})

    rc, out, _ = cli(capsys, "verify", "--config", cfg)
    assert rc == 1 and "10 blocks checked, 2 corrupt" in out
    assert {line.split()[1].rstrip(":") for line in out.splitlines() if "CORRUPT" in line} == set(bad)

    rc, doc = cli_json(capsys, "verify", "--config", cfg, "--fix")
    be = doc["backends"][0]
    assert rc == 0 and sorted(be["deleted"]) == sorted(bad)
    listed = {o["Key"] for o in s3.list_objects_v2(Bucket=s3_bucket)["Contents"]}
    assert listed == {f"kv/{k}" for k in keys if k not in bad} | {f"kv/{NS.id}/manifest.json"}


# ------------------------------------------------------------------------------------- gc


def test_gc_local_disk_evicts_least_recently_used_first(tmp_path, capsys):
    b = LocalDiskBackend({"path": str(tmp_path / "blocks")})
    b.put_manifest(NS)
    keys = put(b, NS, 12) + put(b, OTHER, 4, PAYLOAD)
    b.close()
    # Last use as the backend records it (file times): a shuffled order, so it is not write order.
    order = [keys[i] for i in (13, 0, 5, 15, 2, 7, 1, 3, 4, 6, 8, 9, 10, 11, 12, 14)]
    for i, k in enumerate(order):
        t = 1_700_000_000 + 60 * i
        os.utime(block_path(tmp_path, k), (t, t))
    cfg = config(tmp_path, disk(tmp_path, capacity=10 * STORED + 50))

    rc, doc = cli_json(capsys, "gc", "--config", cfg, "--all-namespaces", "--dry-run")
    be = doc["backends"][0]
    assert rc == 0 and be["evicted"] == order[:6] and be["bytes_after"] == 10 * STORED
    assert all(block_path(tmp_path, k).exists() for k in keys)

    rc, out, _ = cli(capsys, "gc", "--config", cfg, "--all-namespaces", "-v")
    assert rc == 0
    assert "16 blocks, 17.4KiB of capacity 10.9KiB; 6.5KiB over: evicting least recently used first" in out
    assert "evicted 6 blocks, 6.5KiB:" in out and "now 10 blocks, 10.9KiB of 10.9KiB" in out
    assert f"namespace {NS.id}: 4 blocks, 4.3KiB" in out and f"namespace {OTHER.id}: 2 blocks, 2.2KiB" in out
    assert all(f"    {k} ({STORED} bytes)" in out for k in order[:6])
    assert [block_path(tmp_path, k).exists() for k in order] == [False] * 6 + [True] * 10
    assert (tmp_path / "blocks" / NS.id / "manifest.json").exists()  # manifests are never evicted

    rc, doc = cli_json(capsys, "gc", "--config", cfg, "--all-namespaces")  # within capacity now: nothing to do
    be = doc["backends"][0]
    assert rc == 0 and be["evicted"] == [] and be["bytes_before"] == be["bytes_after"] == 10 * STORED


def test_evict_to_generic_default(redis_backend_cfg):
    _, b, _ = redis_backend_cfg
    put(b, NS, 8)
    seen: list[StoredBlock] = []
    removed = b.evict_to(5 * STORED, on_evict=seen.extend)
    assert len(removed) == 3 and seen == removed
    assert sum(blk.size for blk in b.scan()) == 5 * STORED
    assert b.evict_to(5 * STORED) == []
    assert sorted(blk.key for blk in b.evict_to(0, dry_run=True)) == sorted(blk.key for blk in b.scan())


# ------------------------------------------------------------------------------------- errors and secrets


def test_bad_config_exits_2(tmp_path, capsys):
    rc, out, err = cli(capsys, "verify", "--config", str(tmp_path / "missing.yaml"))
    assert rc == 2 and "cannot read the file" in err and out == ""
    bad = tmp_path / "bad.yaml"
    bad.write_text(yaml.safe_dump({"model": MODEL, "backends": [
        {"type": "local_disk", "options": {"path": str(tmp_path), "capcity": "1GiB"}}]}))
    rc, _, err = cli(capsys, "gc", "--config", str(bad))
    assert rc == 2 and 'backends[0].options.capcity: unknown key; did you mean "capacity"?' in err
    rc, _, err = cli(capsys, "inspect", "--config", config(tmp_path, name="empty.yaml"))
    assert rc == 2 and "no backends configured" in err
    rc, _, err = cli(capsys, "inspect", "--config", config(tmp_path, disk(tmp_path)), "--backend", "nope")
    assert rc == 2 and "no backend named 'nope'" in err and "'disk'" in err
    typo = config(tmp_path, disk(tmp_path / "nowhere"), name="typo.yaml")
    for tool in ("inspect", "verify", "gc"):
        rc, out, _ = cli(capsys, tool, "--config", typo)
        assert rc == 1 and f"{tmp_path / 'nowhere' / 'blocks'} does not exist" in out, tool
    assert not (tmp_path / "nowhere").exists()
    r = subprocess.run([sys.executable, "-m", "kvtier", "verify", "--config", str(bad)], capture_output=True,
                       text=True, timeout=120)
    assert r.returncode == 2 and "Traceback" not in r.stderr and "capcity" in r.stderr


@pytest.fixture(scope="module")
def secured():
    if redis_available():
        pytest.skip(str(redis_available()))
    srv = start_redis(password=SECRET)
    yield srv
    srv.cleanup()


def test_secrets_never_printed(tmp_path, capsys, secured):
    from kvtier.backends.redis import RedisBackend

    url = f"redis://:{SECRET}@127.0.0.1:{secured.port}/0"
    b = RedisBackend({"url": url})
    b.put_manifest(NS)
    keys = put(b, NS, 4)
    b.close()
    r = secured.client()
    r.setrange(f"kvtier:{keys[0]}", 100, b"\x00\x01")
    good = config(tmp_path, {"name": "r", "type": "redis", "options": {"url": url}}, name="good.yaml")
    wrong = config(tmp_path, {"name": "r", "type": "redis", "options": {"url": url.replace(SECRET, SECRET[::-1]),
                                                                       "timeout_s": 2}}, name="wrong.yaml")
    closed = config(tmp_path, disk(tmp_path), {"name": "down", "type": "redis", "options": {
        "url": f"redis://:{SECRET}@127.0.0.1:1/0", "timeout_s": 0.5}}, name="closed.yaml")
    broken = config(tmp_path, {"name": "r", "type": "redis", "options": {
        "url": f"redis://:{SECRET}@127.0.0.1:notaport/0"}}, name="broken.yaml")
    outputs = []
    for argv in (["inspect", "--config", good], ["verify", "--config", good], ["gc", "--config", good],
                 ["inspect", "--config", good, "--json"], ["verify", "--config", good, "--fix", "--json"]):
        rc, out, err = cli(capsys, *argv)
        outputs.append(out + err)
        assert rc in (0, 1), argv
    assert "1 corrupt" in outputs[1] and "redis://127.0.0.1" in outputs[0]
    for argv in (["inspect", "--config", wrong], ["verify", "--config", wrong]):
        rc, out, err = cli(capsys, *argv)
        outputs.append(out + err)
        assert rc == 1 and "ERROR" in out
    rc, out, err = cli(capsys, "inspect", "--config", closed)
    outputs.append(out + err)
    assert rc == 1 and "backend down" in out and "ERROR" in out and "backend disk" in out  # the others still shown
    rc, out, err = cli(capsys, "verify", "--config", broken)
    outputs.append(out + err)
    assert rc == 2
    for text in outputs:
        assert SECRET not in text and SECRET[::-1] not in text


# ------------------------------------------------------------------------------------- engine YAMLs


def engine_config(tmp_path: Path, *backends: dict[str, Any], model: dict[str, Any] | None = None) -> str:
    """A deployment YAML as vLLM / SGLang use it: no model section (or a partial one), the engine fills it."""
    path = tmp_path / "engine.yaml"
    doc: dict[str, Any] = {"backends": list(backends)}
    if model is not None:
        doc["model"] = model
    path.write_text(yaml.safe_dump(doc))
    return str(path)


ACROSS = "model filled by the engine ({}) at start-up, so the file names no namespace of its own: "


@pytest.mark.parametrize("model", [None, {"id": "meta-llama/Llama-3.1-8B-Instruct"}])
def test_engine_yaml_inspect_verify_gc_work_across_namespaces(tmp_path, capsys, populated, model):
    """A YAML without a complete model section (what vLLM and SGLang load) was refused with `model: missing
    required section`; it has no namespace of its own, so the tools work on every namespace stored."""
    own, other = populated["own"], populated["other"]
    cfg = engine_config(tmp_path, disk(tmp_path, capacity=8 * STORED), model=model)

    rc, out, err = cli(capsys, "inspect", "--config", cfg, "--all-namespaces")
    assert rc == 0, err
    assert out.splitlines()[0] == f"config {cfg}: " + ACROSS.format("vllm / sglang") + \
        "showing every namespace found in its backends"
    assert "[this config]" not in out and f"namespace {NS.id}: 7 blocks" in out
    assert f"namespace {OTHER.id}: 3 blocks" in out and f"namespace {NOMANIFEST.id}: 2 blocks" in out
    rc, doc = cli_json(capsys, "inspect", "--config", cfg, "--all-namespaces", "--engine", "vllm")
    assert rc == 0 and doc["namespace"] is None and doc["engine_fills_model"] is True
    assert not any(ns["this_config"] for ns in doc["backends"][0]["namespaces"])

    flip(block_path(tmp_path, own[0]), 88 + 7)  # one corrupt block in each namespace with a manifest
    flip(block_path(tmp_path, other[1]), 88 + 7)
    rc, out, _ = cli(capsys, "verify", "--config", cfg, "--all-namespaces", "--engine", "sglang")
    assert rc == 1
    assert out.splitlines()[0] == f"config {cfg}: " + ACROSS.format("sglang") + "checking each block " \
        "against its own namespace's manifest and header, across every namespace found in its backends"
    assert f"CORRUPT {own[0]}: payload checksum mismatch" in out
    assert f"CORRUPT {other[1]}: payload checksum mismatch" in out and "12 blocks checked, 2 corrupt" in out

    rc, out, _ = cli(capsys, "gc", "--config", cfg, "--all-namespaces")  # 7 + 3 + 2 blocks of three sizes, of three namespaces
    assert rc == 0 and "trimming each backend to its capacity, least recently used first, across" in out
    assert "12 blocks, 9.2KiB of capacity 8.7KiB; 496B over: evicting least recently used first" in out
    assert sum(p.stat().st_size for p in (tmp_path / "blocks").glob("*/??/*")) <= 8 * STORED


def test_engine_yaml_problems_still_exit_2(tmp_path, capsys):
    cfg = engine_config(tmp_path, {**disk(tmp_path), "optons": {}}, model={"id": "m", "num_layer": 4})
    rc, _, err = cli(capsys, "inspect", "--config", cfg)
    assert rc == 2 and f"invalid config {cfg} (2 problems):" in err
    assert 'model.num_layer: unknown key; did you mean "num_layers"?' in err
    assert "backends[0].optons: unknown key" in err
    # --engine none: standalone (kvtier run, pd) needs a complete model section
    rc, _, err = cli(capsys, "gc", "--config", engine_config(tmp_path, disk(tmp_path)), "--engine", "none")
    assert rc == 2 and "model: missing required section" in err
