"""Two deployments sharing one store (issue 45, section 3): a directory, a Redis with a ``key_prefix``, an S3
bucket under a ``prefix``.  Each deployment's tools see only its own namespaces unless told
``--all-namespaces``.  The tools run in process (``kvtier.cli.main``) against real files, a real
redis-server and moto's server over HTTP."""

from __future__ import annotations

import json
import os
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.cli import main
from kvtier.config import load_config
from kvtier.keys import Namespace

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
        def flip(key: str) -> None:
            ns, h = key.split("/")
            p = tmp_path / "blocks" / ns / h[:2] / h
            data = bytearray(p.read_bytes())
            data[100] ^= 1
            p.write_bytes(bytes(data))
        return disk(tmp_path), flip
    if request.param == "redis":
        srv = request.getfixturevalue("redis_server")

        def flip(key: str) -> None:
            r = srv.client()
            old = r.getrange(f"team:{key}", 100, 100)
            r.setrange(f"team:{key}", 100, bytes([old[0] ^ 1]))
        return redis(srv.url), flip
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
