"""Issue 6 item 8: secrets and isolation.

Secrets: a Redis password and S3 credentials go through every path where text comes out of kvtier:
log records at DEBUG (botocore's wire logging included), exception messages with their whole cause chain
and traceback, ``repr``/``str``/dumps of backends and options, ``stats()``, config errors (a password
typed as a number, a misspelt key, a URL pasted where a mapping belongs, overrides from the environment)
and the ``kvtier config check`` command's output, run as a real subprocess.  None may contain a secret.

Isolation: blocks of different ``cache_salt``s never share a key (property-based, both hash algorithms,
and end to end through a backend); a key of namespace A is never returned for namespace B on local disk,
Redis and S3: not by ``exists``/``contains_prefix``/``get_into``/``scan``, and not even when A's stored
value is planted under B's key (the header's namespace check makes it a counted, deleted miss).
"""

from __future__ import annotations

import dataclasses
import json
import logging
import os
import shutil
import subprocess
import sys
import traceback
from collections.abc import Callable
from typing import Any

import pytest
from _reliability.common import check, payload
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from kvtier.backend_api import BackendError
from kvtier.backends.local_disk import LocalDiskBackend
from kvtier.config import ConfigError, parse_config
from kvtier.keys import BlockHasher, Namespace
from kvtier.testing.redis_server import redis_available, start_redis

REDIS_PW = "rEdIsPw-7c41e9b2d0"
WRONG_PW = "wRoNgPw-55aa31f0c2"
S3_KEY_ID = "AKIAKVTIERLEAKTEST9"
S3_SECRET = "kvtierS3Secret/0123+456789abcdefXYZ"
S3_TOKEN = "kvtierSessionToken-0a1b2c3d4e5f"
ENV_SECRET = "envS3Secret-9988776655aabb"
SECRETS = (REDIS_PW, WRONG_PW, S3_KEY_ID, S3_SECRET, S3_TOKEN, ENV_SECRET)
MODEL = {"id": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 64}
NS = Namespace("secrets/model", "bfloat16", 2, 2, 64, 16)
SIZE = 4096


def _leaks(texts: list[str]) -> list[tuple[str, str]]:
    return [(s, t[:200]) for t in texts for s in SECRETS if s in t]


def _exc_texts(e: BaseException) -> list[str]:
    return [str(e), repr(e), "".join(traceback.format_exception(e))]


def _log_texts(caplog) -> list[str]:
    out = []
    for r in caplog.records:
        out.append(r.getMessage())
        if r.exc_info:
            out.append("".join(traceback.format_exception(*r.exc_info)))
    return out + [caplog.text]


def _attempt(fn, texts: list[str]):
    try:
        return fn()
    except BackendError as e:
        texts.extend(_exc_texts(e))
        return None


def _cli_check(files: list[str], env: dict[str, str] | None = None) -> str:
    r = subprocess.run([sys.executable, "-m", "kvtier", "config", "check", *files], capture_output=True, text=True,
                       env={**os.environ, **(env or {})}, timeout=120)
    return r.stdout + r.stderr


def _write_yaml(path, doc) -> str:
    import yaml

    path.write_text(yaml.safe_dump(doc, sort_keys=False))
    return str(path)


# ======================================================================================= Redis


@pytest.fixture(scope="module")
def secured_redis():
    if redis_available():
        pytest.skip(str(redis_available()))
    srv = start_redis(password=REDIS_PW)
    yield srv
    srv.cleanup()


def test_redis_password_never_leaks(secured_redis, tmp_path, caplog, capfd, figures):
    from kvtier.backends.redis import RedisBackend

    caplog.set_level(logging.DEBUG)
    texts: list[str] = []
    port = secured_redis.port
    keys = NS.keys([bytes([i]) * 16 for i in range(4)])
    data = [payload(k, 0, SIZE) for k in keys]

    # working, with the password in the URL and as an option
    opts: dict[str, Any]
    for opts in ({"url": f"redis://:{REDIS_PW}@127.0.0.1:{port}/0"},
                 {"url": f"redis://127.0.0.1:{port}/0", "password": REDIS_PW},
                 {"url": f"redis://default:{REDIS_PW}@127.0.0.1:{port}/0"}):
        b = RedisBackend(opts)
        assert b.put(keys, data, NS.layout_id) == [True] * 4
        bufs = [bytearray(SIZE) for _ in keys]
        assert b.get_into(keys, bufs, NS.layout_id) == [True] * 4
        assert [check(k, x) for k, x in zip(keys, bufs)] == [0] * 4
        b.put_manifest(NS)
        texts += [repr(b), str(b.options), repr(b.options), b.options.model_dump_json(), str(b.options.model_dump()),
                  str(b.stats()), json.dumps(dataclasses.asdict(b.stats()), default=str), str(list(b.scan())),
                  str(b.namespaces()), str(b.get_manifest(NS.id))]
        assert b.health()
        b.close()

    # refused: a wrong password, in the URL and as an option
    errors = 0
    for opts in ({"url": f"redis://:{WRONG_PW}@127.0.0.1:{port}/0"},
                 {"url": f"redis://127.0.0.1:{port}/0", "password": WRONG_PW}):
        b = RedisBackend({**opts, "timeout_s": 2})
        op: Callable[[], object]
        for op in (lambda b=b: b.put(keys, data, NS.layout_id),
                   lambda b=b: b.get_into(keys, [bytearray(SIZE)] * 4, NS.layout_id),
                   lambda b=b: b.exists(keys), lambda b=b: list(b.scan()), lambda b=b: b.delete(keys)):
            n = len(texts)
            _attempt(op, texts)
            errors += len(texts) > n
        texts += [repr(b), str(b.stats())]
        assert not b.health()
        b.close()
    assert errors == 10, "every operation with a wrong password fails"

    # the server gone: connection errors
    b = RedisBackend({"url": f"redis://:{REDIS_PW}@127.0.0.1:{port}/0", "timeout_s": 1})
    assert b.exists(keys) == [True] * 4
    secured_redis.stop()
    try:
        for op in (lambda: b.get_into(keys, [bytearray(SIZE)] * 4, NS.layout_id), lambda: b.exists(keys),
                   lambda: b.put(keys, data, NS.layout_id)):
            assert _attempt(op, texts) is None
    finally:
        secured_redis.start()
    b.close()

    # config errors around a password: never echoed
    bad_configs: list[dict[str, Any]] = [
        {"url": f"redis://:{REDIS_PW}@127.0.0.1:{port}/0?db=1"},
        {"url": f"redis://:{REDIS_PW}@127.0.0.1:{port}/zero"},
        {"url": f"redis://:{REDIS_PW}@127.0.0.1:{port}/0", "pasword": REDIS_PW},
        {"url": f"redis://:{REDIS_PW}@127.0.0.1:{port}/0", "password": REDIS_PW},
        {"url": f"http://:{REDIS_PW}@127.0.0.1:{port}/0"},
        {"url": f"redis://127.0.0.1:{port}/0", "password": 7654321987},
        {"url": f"redis://127.0.0.1:{port}/0", "password": [REDIS_PW]},
        {"url": f"redis://:{REDIS_PW}@127.0.0.1:{port}/0", "ttl_s": -1, "max_connections": "many"},
    ]
    for opts in bad_configs:
        with pytest.raises(ConfigError) as ei:
            parse_config({"model": MODEL, "backends": [{"type": "redis", "options": opts}]})
        texts += _exc_texts(ei.value)
    with pytest.raises(ConfigError) as ei:  # a URL pasted where the options mapping goes
        parse_config({"model": MODEL, "backends": [{"type": "redis", "options": f"redis://:{REDIS_PW}@h:1/0"}]})
    texts += _exc_texts(ei.value)

    # the CLI: a valid and an invalid config, and a bad override from the environment
    good = _write_yaml(tmp_path / "good.yaml", {"model": MODEL, "backends": [
        {"type": "redis", "options": {"url": f"redis://:{REDIS_PW}@127.0.0.1:{port}/0"}}]})
    bad = _write_yaml(tmp_path / "bad.yaml", {"model": MODEL, "backends": [
        {"type": "redis", "options": {"url": f"redis://:{REDIS_PW}@127.0.0.1:{port}/x", "password": 1234567890}},
        {"type": "redis", "name": "r2", "options": f"redis://:{REDIS_PW}@h:1"}]})
    out = _cli_check([good, bad])
    assert "good.yaml: ok" in out and "bad.yaml: invalid" in out
    texts.append(out)
    out = _cli_check([good], {"KVTIER_BACKENDS__0__OPTIONS__URL": f"redis://:{REDIS_PW}@127.0.0.1:{port}/0?a=1"})
    assert "invalid" in out and "KVTIER_BACKENDS__0__OPTIONS__URL" in out
    texts.append(out)

    texts += _log_texts(caplog)
    captured = capfd.readouterr()
    texts += [captured.out, captured.err]
    leaks = _leaks(texts)
    texts_numbers = [t for t in texts if "7654321987" in t or "1234567890" in t]  # passwords typed as numbers
    figures("texts checked for the Redis password (logs, errors, reprs, config errors, CLI)", len(texts))
    figures("Redis password leaks", len(leaks) + len(texts_numbers))
    assert leaks == [] and texts_numbers == []


# ======================================================================================= S3


def test_s3_credentials_never_leak(moto_server, s3_bucket, tmp_path, caplog, capfd, monkeypatch, figures):
    pytest.importorskip("boto3")
    from kvtier.backends.s3 import S3Backend

    caplog.set_level(logging.DEBUG)  # botocore logs its signed requests at DEBUG
    texts: list[str] = []
    keys = NS.keys([bytes([i]) * 32 for i in range(4)])
    data = [payload(k, 0, SIZE) for k in keys]
    creds = {"access_key_id": S3_KEY_ID, "secret_access_key": S3_SECRET, "session_token": S3_TOKEN}

    b = S3Backend({"bucket": s3_bucket, "endpoint_url": moto_server.endpoint_url, **creds})
    assert b.put(keys, data, NS.layout_id) == [True] * 4
    bufs = [bytearray(SIZE) for _ in keys]
    assert b.get_into(keys, bufs, NS.layout_id) == [True] * 4
    assert [check(k, x) for k, x in zip(keys, bufs)] == [0] * 4
    assert b.exists(keys) == [True] * 4
    b.put_manifest(NS)
    texts += [repr(b), str(b.options), repr(b.options), b.options.model_dump_json(), str(b.options.model_dump()),
              str(b.stats()), str(list(b.scan())), str(b.get_manifest(NS.id))]
    assert b.delete(keys[:1]) == 1
    b.close()

    # errors: a bucket that does not exist, then a dead endpoint
    nb = S3Backend({"bucket": "no-such-bucket-kvtier", "endpoint_url": moto_server.endpoint_url, "retries": 0, **creds})
    n = len(texts)
    for op in (lambda: nb.put(keys, data, NS.layout_id), lambda: nb.get_into(keys, [bytearray(SIZE)] * 4, NS.layout_id),
               lambda: nb.exists(keys), lambda: list(nb.scan())):
        _attempt(op, texts)  # HEAD of a missing bucket is a plain 404: exists() says False, no error
    assert len(texts) - n >= 9, "put, get and scan fail on a missing bucket"
    assert not nb.health()
    nb.close()
    dead = S3Backend({"bucket": s3_bucket, "endpoint_url": "http://127.0.0.1:9", "retries": 0, "timeout_s": 1, **creds})
    for op in (lambda: dead.get_into(keys, [bytearray(SIZE)] * 4, NS.layout_id), lambda: dead.exists(keys),
               lambda: dead.put(keys, data, NS.layout_id)):
        assert _attempt(op, texts) is None
    dead.close()

    # credentials from the environment (boto3's chain), not the options
    monkeypatch.setenv("AWS_ACCESS_KEY_ID", S3_KEY_ID)
    monkeypatch.setenv("AWS_SECRET_ACCESS_KEY", ENV_SECRET)
    monkeypatch.delenv("AWS_SESSION_TOKEN", raising=False)
    eb = S3Backend({"bucket": s3_bucket, "endpoint_url": moto_server.endpoint_url})
    assert eb.get_into(keys[1:], [bytearray(SIZE) for _ in keys[1:]], NS.layout_id) == [True] * 3
    texts += [repr(eb), str(eb.options)]
    eb.close()

    # config errors around credentials
    for opts in ({"bucket": "bkt", "secret_acess_key": S3_SECRET}, {"bucket": "bkt", "secret_access_key": 98765432101},
                 {"bucket": "bkt", "secret_access_key": [S3_SECRET]}, {"bucket": "b", **creds},
                 {"bucket": "bkt", "session_token": {"v": S3_TOKEN}, "max_workers": 0}):
        with pytest.raises(ConfigError) as ei:
            parse_config({"model": MODEL, "backends": [{"type": "s3", "options": opts}]})
        texts += _exc_texts(ei.value)
    good = _write_yaml(tmp_path / "good.yaml", {"model": MODEL, "backends": [
        {"type": "s3", "options": {"bucket": "bkt", **creds}}]})
    bad = _write_yaml(tmp_path / "bad.yaml", {"model": MODEL, "backends": [
        {"type": "s3", "options": {"bucket": "bkt", "secret_acess_key": S3_SECRET, "access_key_id": 12345678901}}]})
    out = _cli_check([good, bad], {"KVTIER_BACKENDS__0__OPTIONS__SESSION_TOKEN": "[1, 2]"})
    assert "good.yaml: invalid" in out and "bad.yaml: invalid" in out  # the override breaks good.yaml too
    texts.append(out)
    out = _cli_check([good])
    assert "good.yaml: ok" in out
    texts.append(out)

    texts += _log_texts(caplog)
    captured = capfd.readouterr()
    texts += [captured.out, captured.err]
    numbers = [t for t in texts if "98765432101" in t or "12345678901" in t]
    leaks = _leaks(texts)
    figures("log records captured at DEBUG during S3 calls", len(caplog.records))
    figures("texts checked for S3 credentials (logs, errors, reprs, config errors, CLI)", len(texts))
    figures("S3 credential leaks", len(leaks) + len(numbers))
    scrubbed = sum("***" in r.getMessage() for r in caplog.records if r.name.startswith(("botocore", "urllib3")))
    figures("botocore/urllib3 DEBUG records with a credential scrubbed out", scrubbed)
    assert scrubbed > 0, "the signed requests were logged (so the credentials were there to leak) and scrubbed"
    assert leaks == [] and numbers == []


# ======================================================================================= isolation


def test_cache_salts_never_share_a_block(figures):
    n = {"examples": 0, "blocks": 0}

    @settings(max_examples=300, deadline=None, database=None, suppress_health_check=list(HealthCheck))
    @given(tokens=st.lists(st.integers(0, 2**32 + 5), min_size=1, max_size=96), block_size=st.integers(1, 16),
           salts=st.lists(st.text(min_size=1, max_size=8), min_size=2, max_size=4, unique=True),
           algo=st.sampled_from(["sha256_cbor", "xxh3_128"]))
    def run(tokens, block_size, salts, algo):
        h = BlockHasher(block_size, algo)
        seen: dict[bytes, object] = {}
        for salt in [None, *salts]:
            for blk in h.hash_blocks(tokens, cache_salt=salt):
                assert seen.setdefault(blk, salt) == salt, "two salts share a block"
                n["blocks"] += 1
        n["examples"] += 1

    run()
    figures("cache_salt sets fuzzed / block keys compared", f"{n['examples']}/{n['blocks']}")
    figures("blocks shared across cache_salts", 0)


def test_cache_salt_isolation_end_to_end(tmp_path):
    b = LocalDiskBackend({"path": str(tmp_path / "d"), "capacity": "64MiB"})
    h = NS.hasher()
    tokens = list(range(16 * 8))
    a = NS.keys(h.hash_blocks(tokens, cache_salt="tenant-a"))
    assert b.put(a, [payload(k, 0, SIZE) for k in a], NS.layout_id) == [True] * 8
    for salt in ("tenant-b", None, "tenant-a "):
        other = NS.keys(h.hash_blocks(tokens, cache_salt=salt))
        assert b.contains_prefix(other) == 0
        assert b.get_into(other, [bytearray(SIZE) for _ in other], NS.layout_id) == [False] * 8
    assert b.contains_prefix(a) == 8
    b.close()


VARIANTS: dict[str, dict[str, Any]] = {
    "kv_dtype": dict(kv_dtype="float8_e4m3fn"), "tp_rank": dict(tp_rank=1, tp_size=2), "tp_size": dict(tp_size=2),
    "model": dict(model="secrets/model-v2"), "block_size": dict(block_size=32), "num_layers": dict(num_layers=3),
    "head_dim": dict(head_dim=128), "attention": dict(attention="mla"), "pp_rank": dict(pp_rank=1, pp_size=2),
    "hash_seed": dict(hash_seed="other-seed"), "hash_algo": dict(hash_algo="xxh3_128"),
}


class _DiskRaw:
    def __init__(self, root):
        self.root = root

    def copy(self, src: str, dst: str) -> None:
        def path(k):
            ns, h = k.split("/")
            return os.path.join(self.root, ns, h[:2], h)

        os.makedirs(os.path.dirname(path(dst)), exist_ok=True)
        shutil.copyfile(path(src), path(dst))


class _RedisRaw:
    def __init__(self, client):
        self.c = client

    def copy(self, src, dst):
        self.c.set(b"kvtier:" + dst.encode(), self.c.get(b"kvtier:" + src.encode()))


class _S3Raw:
    def __init__(self, client, bucket):
        self.c, self.bucket = client, bucket

    def copy(self, src, dst):
        self.c.copy_object(Bucket=self.bucket, Key=dst, CopySource={"Bucket": self.bucket, "Key": src})


def _namespace_isolation(b, raw, label: str, figures) -> None:
    base = dataclasses.asdict(NS)
    a = NS
    others = {name: Namespace(**{**base, **v}) for name, v in VARIANTS.items()}
    ids = {a.id, *(o.id for o in others.values())}
    assert len(ids) == len(others) + 1, "every variant has its own namespace id"
    hashes = [bytes([i, 7]) * 8 for i in range(6)]
    ka = a.keys(hashes)
    assert b.put(ka, [payload(k, 0, SIZE) for k in ka], a.layout_id) == [True] * 6
    served = misfiled_detected = 0
    for name, o in others.items():
        kb = o.keys(hashes)
        assert b.exists(kb) == [False] * 6 and b.contains_prefix(kb) == 0, name
        ok = b.get_into(kb, [bytearray(SIZE) for _ in kb], o.layout_id)
        served += sum(ok)
        assert [blk.key for blk in b.scan(o.id)] == [], name
        # A's value planted under B's key (a misfiled block, a hash collision, a tool's mistake)
        before = b.stats().corrupt
        raw.copy(ka[0], kb[0])
        got = b.get_into([kb[0]], [bytearray(SIZE)], o.layout_id)
        served += sum(got)
        misfiled_detected += b.stats().corrupt - before
        assert got == [False] and b.exists([kb[0]]) == [False], f"{name}: planted value not removed"
    assert sorted(blk.key for blk in b.scan(a.id)) == sorted(ka)
    bufs = [bytearray(SIZE) for _ in ka]
    assert b.get_into(ka, bufs, a.layout_id) == [True] * 6 and [check(k, x) for k, x in zip(ka, bufs)] == [0] * 6
    figures(f"namespace variants checked ({label})", len(others))
    figures(f"cross-namespace blocks served ({label})", served)
    figures(f"A's value planted under B's key: detected/planted ({label})", f"{misfiled_detected}/{len(others)}")
    assert served == 0
    assert misfiled_detected == len(others)


def test_namespace_isolation_local_disk(tmp_path, figures):
    b = LocalDiskBackend({"path": str(tmp_path / "d"), "capacity": "64MiB"})
    _namespace_isolation(b, _DiskRaw(b.root), "disk", figures)
    b.close()


def test_namespace_isolation_redis(redis_server, figures):
    from kvtier.backends.redis import RedisBackend

    b = RedisBackend({"url": redis_server.url})
    _namespace_isolation(b, _RedisRaw(redis_server.client()), "redis", figures)
    b.close()


def test_namespace_isolation_s3(moto_server, s3_bucket, figures):
    pytest.importorskip("boto3")
    from kvtier.backends.s3 import S3Backend

    b = S3Backend({"bucket": s3_bucket, "endpoint_url": moto_server.endpoint_url})
    _namespace_isolation(b, _S3Raw(moto_server.client(), s3_bucket), "s3", figures)
    b.close()


def test_leak_detector():
    """The detector the tests above rely on finds a secret wherever it is, and only then."""
    assert _leaks([f"x {REDIS_PW} y"]) and _leaks([f"url=redis://:{REDIS_PW}@h"]) and _leaks([S3_SECRET])
    assert _leaks(["a", "b", f"{S3_KEY_ID}/20260101/us-east-1/s3/aws4_request"]) and not _leaks(["nothing here"])
