"""Provenance (kvtier.security): in modes authenticate and encrypt a value nobody holding the deployment key
sealed is never served, counted as forged and deleted, on real files, a real redis-server and moto's S3
server; rotation, tenants, encryption at rest, config errors, and the key kept out of every output."""

from __future__ import annotations

import io
import json
import logging
import os
import pickle
import struct
from contextlib import redirect_stdout

import numpy as np
import pytest
import xxhash

from kvtier.backend_api import frame
from kvtier.backends.local_disk import LocalDiskBackend
from kvtier.backends.redis import RedisBackend
from kvtier.backends.s3 import S3Backend
from kvtier.config import ConfigError, parse_config
from kvtier.format import blockformat as bf
from kvtier.keys import Namespace
from kvtier.security import Forged, KeyRing, Seal, derive_tenant_key

pytest.importorskip("cryptography")

NS = Namespace("sec/model", "bfloat16", 2, 2, 64, 16)
LID = NS.layout_id
SIZE = 16 << 10  # a payload; the no-plaintext check scans it at every 16-byte step
KEY1 = bytes(range(100, 132))
KEY2 = bytes(range(200, 232))
MODES = ("authenticate", "encrypt")


def ring(keys=None, write=1, tenant=None, tenant_keys=False):
    return KeyRing(keys or {1: KEY1}, write, tenant, tenant_keys)


def payloads(n, size=SIZE):
    rng = np.random.default_rng(n + size)
    return [rng.integers(0, 256, size, dtype=np.uint8).tobytes() for _ in range(n)]


def prompt_keys(n, salt=None):
    """Keys of a prompt's blocks, as the stack computes them from token ids (a prompt nobody sent yet)."""
    tokens = list(range(1000, 1000 + 16 * n))
    return NS.keys(NS.hasher().hash_blocks(tokens, cache_salt=salt))


def get(b, keys, size=SIZE):
    bufs = [bytearray(size) for _ in keys]
    ok = b.get_into(keys, bufs, LID)
    return [bytes(x) if good else None for x, good in zip(bufs, ok)]


# ------------------------------------------------------------------ the three real stores


@pytest.fixture(params=["local_disk", "redis", "s3"])
def store(request, tmp_path):
    """``make(seal) -> backend`` over one shared store (several instances see the same values), and
    ``raw(key) -> stored bytes`` read behind kvtier's back."""
    kind = request.param
    made = []
    if kind == "local_disk":
        def make(seal):
            b = LocalDiskBackend({"path": str(tmp_path / "kv"), "capacity": 1 << 30})
            b.secure(seal)
            made.append(b)
            return b

        def raw(key):
            return (tmp_path / "kv" / key[:32] / key[33:35] / key[33:]).read_bytes()
    elif kind == "redis":
        server = request.getfixturevalue("redis_server")

        def make(seal):
            b = RedisBackend({"url": server.url, "eviction_events": "off"})
            b.secure(seal)
            made.append(b)
            return b

        def raw(key):
            return server.client().get(b"kvtier:" + key.encode())
    else:
        moto = request.getfixturevalue("moto_server")
        bucket = request.getfixturevalue("s3_bucket")

        def make(seal):
            b = S3Backend({"bucket": bucket, "endpoint_url": moto.endpoint_url})
            b.secure(seal)
            made.append(b)
            return b

        def raw(key):
            return moto.client().get_object(Bucket=bucket, Key=key)["Body"].read()
    yield make, raw
    for b in made:
        b.close()


def _local_path(tmp_path, key, name="kv"):
    return tmp_path / name / key[:32] / key[33:35] / key[33:]


@pytest.mark.parametrize("mode", MODES)
def test_forged_values_are_never_served_counted_and_deleted(store, mode):
    make, raw = store
    plain = make(None)  # a writer without the key: well-formed version 1 values (valid header, checksum)
    sealed = make(Seal(mode, ring()))
    good = prompt_keys(2, salt="sent")
    data = payloads(2)
    assert sealed.put(good, data, LID) == [True, True]
    assert get(sealed, good) == data
    # One value over a real key, one planted for a prompt nobody has sent yet.
    future = prompt_keys(3, salt="not yet sent")
    fake = payloads(4, SIZE)
    assert plain.put([good[1], future[2]], fake[:2], LID) == [True, True]
    assert bf.stored_version(raw(good[1])) == 1
    assert get(sealed, [good[0], good[1], future[2]]) == [data[0], None, None]
    s = sealed.stats()
    assert (s.forged, s.corrupt) == (2, 0)
    assert sealed.exists([good[1], future[2]]) == [False, False]  # deleted
    # A sealed value copied under another key (a replay) is refused too.
    assert sealed.put([future[0]], [fake[2]], LID) == [True]
    blob = raw(future[0])
    plain._write([future[1]], [(blob[: bf.SEALED_HEADER_SIZE], memoryview(blob[bf.SEALED_HEADER_SIZE:]))])
    assert get(sealed, [future[1]]) == [None]
    assert sealed.stats().forged == 3


@pytest.mark.parametrize("mode", MODES)
def test_a_value_of_another_key_mode_or_tenant_is_refused(store, mode):
    make, _ = store
    other_mode = "encrypt" if mode == "authenticate" else "authenticate"
    reader = make(Seal(mode, ring(tenant="a")))
    writers = [make(Seal(mode, ring({1: KEY2}, tenant="a"))),  # another deployment key, same id
               make(Seal(other_mode, ring(tenant="a"))),  # the right key, the other mode
               make(Seal(mode, ring(tenant="b")))]  # another tenant of the same deployment
    ks = prompt_keys(len(writers))
    for w, k, p in zip(writers, ks, payloads(len(writers))):
        assert w.put([k], [p], LID) == [True]
    assert get(reader, ks) == [None] * len(ks)
    assert reader.stats().forged == len(ks)
    # and mode none reads no sealed value (an unknown format version: corrupt, deleted)
    assert make(Seal(mode, ring(tenant="a"))).put(ks[:1], payloads(1), LID) == [True]
    none = make(None)
    assert get(none, ks[:1]) == [None] and none.stats().corrupt == 1


def test_a_tenant_key_cannot_make_another_tenants_values(store):
    """A deployment given only tenant a's key (``tenant_keys``) makes values tenant a's readers accept
    (derived from the deployment key) and none that tenant b's readers accept."""
    make, _ = store
    key_a = derive_tenant_key(KEY1, "a")
    tenant_a = make(Seal("authenticate", ring({1: key_a}, tenant="a", tenant_keys=True)))
    reader_a = make(Seal("authenticate", ring(tenant="a")))
    reader_b = make(Seal("authenticate", ring(tenant="b")))
    ka, kb = prompt_keys(1, salt="a"), prompt_keys(1, salt="b")
    pa, pb = payloads(2)
    assert tenant_a.put(ka + kb, [pa, pb], LID) == [True, True]  # b's key too: it can write anything
    assert get(reader_a, ka) == [pa]
    assert get(reader_b, kb) == [None] and reader_b.stats().forged == 1


@pytest.mark.parametrize("mode", MODES)
def test_rotation_old_key_reads_while_new_key_writes(store, mode):
    make, _ = store
    old = make(Seal(mode, ring({1: KEY1}, write=1)))
    new = make(Seal(mode, ring({1: KEY1, 2: KEY2}, write=2)))
    k_old, k_new = prompt_keys(2, salt="old"), prompt_keys(2, salt="new")
    p_old, p_new = payloads(2), payloads(3)[:2]
    assert old.put(k_old, p_old, LID) == [True, True]
    assert new.put(k_new, p_new, LID) == [True, True]
    assert get(new, k_old + k_new) == p_old + p_new  # both keys read
    dropped = make(Seal(mode, ring({2: KEY2}, write=2)))  # once key 1 is retired, its values are refused
    assert get(dropped, k_old[:1]) == [None] and dropped.stats().forged == 1


def test_encrypted_values_hold_no_plaintext_run(store):
    make, raw = store
    b = make(Seal("encrypt", ring()))
    ks = prompt_keys(2)
    data = payloads(2)
    assert b.put(ks, data, LID) == [True, True]
    for k, p in zip(ks, data):
        blob = raw(k)
        assert len(blob) == bf.SEALED_HEADER_SIZE + len(p)
        assert not any(p[i:i + 16] in blob for i in range(0, len(p) - 16, 16))
    assert get(b, ks) == data
    # authenticate stores the payload as is (what it is for: provenance, not secrecy)
    a = make(Seal("authenticate", ring()))
    assert a.put(ks[:1], data[:1], LID) == [True]
    assert raw(ks[0])[bf.SEALED_HEADER_SIZE:] == data[0]


# ------------------------------------------------------------------ the seal itself


@pytest.mark.parametrize("mode", MODES)
def test_segments_open_as_one_buffer_and_any_flip_is_forged(mode):
    seal = Seal(mode, ring())
    key = prompt_keys(1)[0]
    payload = memoryview(bytearray(payloads(1, 3000)[0]))
    header, stored = seal.seal(key, payload, LID)
    assert len(header) == bf.SEALED_HEADER_SIZE and bf.stored_version(header) == 2
    size = len(header) + stored.nbytes
    for cut in (1, 1000, 2999):
        buf = bytearray(stored)
        segs = bf.Segments([memoryview(buf)[:cut], memoryview(buf)[cut:]])
        assert seal.open(key, size, header, segs, LID) is None and bytes(buf) == bytes(payload)
    flipped = bytearray(stored)
    flipped[1234] ^= 1
    assert isinstance(seal.open(key, size, header, memoryview(flipped), LID), Forged)
    tampered = bytearray(header)
    tampered[65] = 3 - tampered[65]  # the mode byte, header checksum recomputed
    tampered[104:112] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(tampered[:104])))
    assert isinstance(seal.open(key, size, bytes(tampered), memoryview(bytearray(stored)), LID), Forged)
    damaged = bytearray(header)
    damaged[20] ^= 1  # no checksum recomputed: damage, not a forgery
    why = seal.open(key, size, bytes(damaged), memoryview(bytearray(stored)), LID)
    assert why == "header checksum mismatch" and not isinstance(why, Forged)
    v1 = frame(key, payload, LID)
    why = seal.open(key, len(v1) + payload.nbytes, v1 + bytes(24), memoryview(bytearray(payload.nbytes)), LID)
    assert isinstance(why, Forged) and "version 1" in why


def test_a_landing_buffer_decrypts_into_the_callers_and_a_flip_there_is_forged():
    """Mode encrypt read through ``Seal.landing`` (the ciphertext in the thread's buffer, one
    ``decrypt_into`` to the caller's): the same bytes as in place; any altered byte, or the tag of another
    value, is Forged; authenticate has no landing buffer (its payload is read where it is served)."""
    seal = Seal("encrypt", ring())
    key, other = prompt_keys(2)
    payload = memoryview(bytearray(payloads(1, 3000)[0]))
    header, stored = seal.seal(key, payload, LID)
    size = len(header) + stored.nbytes
    dest = memoryview(bytearray(payload.nbytes))
    land = seal.landing(dest)
    assert land is not None and land.nbytes == payload.nbytes + bf.TAG_SIZE
    land[:payload.nbytes] = stored
    assert seal.open(key, size, header, dest, LID, land) is None and bytes(dest) == bytes(payload)
    land[:payload.nbytes] = stored
    land[1234] ^= 1
    assert isinstance(seal.open(key, size, header, dest, LID, land), Forged)
    header2, stored2 = seal.seal(key, payload, LID)  # another nonce and tag for the same block
    land[:payload.nbytes] = stored
    assert isinstance(seal.open(key, size, header2, dest, LID, land), Forged)
    assert seal.landing(bf.Segments([dest[:10], dest[10:]])) is None
    auth = Seal("authenticate", ring())
    assert auth.landing(dest) is None
    with pytest.raises(ValueError, match="landing buffer is for mode encrypt"):
        auth.open(key, size, header, dest, LID, land)


def test_version_1_values_still_load_in_mode_none(tmp_path):
    b = LocalDiskBackend({"path": str(tmp_path / "kv")})
    ks, data = prompt_keys(2), payloads(2)
    assert b.put(ks, data, LID) == [True, True]
    assert bf.stored_version(_local_path(tmp_path, ks[0]).read_bytes()) == 1
    assert get(b, ks) == data and b.header_size == bf.HEADER_SIZE


# ------------------------------------------------------------------ config, and the key kept secret

SECRET_HEX = "5ec7e7" * 11  # 33 bytes, recognisable in any output


def config(tmp_path, security, modes=("authenticate",)):
    return {"model": {"id": "m", "num_layers": 2, "num_kv_heads": 2, "head_dim": 64},
            "backends": [{"type": "local_disk", "name": f"d{i}", "security": m,
                          "options": {"path": str(tmp_path / f"kv{i}")}} for i, m in enumerate(modes)],
            "security": security}


def problems(data):
    with pytest.raises(ConfigError) as e:
        cfg = parse_config(data)
        cfg.build_backends()
    return e.value.problems


def test_config_errors_name_the_key_path(tmp_path, monkeypatch):
    short = tmp_path / "short"
    short.write_text("abcd")
    good = tmp_path / "good"
    good.write_text(SECRET_HEX)
    monkeypatch.delenv("KVTIER_TEST_NO_SUCH_KEY", raising=False)
    assert problems(config(tmp_path, {"keys": [{"id": 1}]})) == \
        ["security.keys[0]: expected exactly one of file or env (where the key is read from), got neither"]
    assert problems(config(tmp_path, {})) == \
        ["backends[0].security: authenticate needs a deployment key: add security.keys (a file or environment "
         "variable holding one)"]
    two = [{"id": 1, "file": str(good)}, {"id": 1, "env": "X"}]
    assert problems(config(tmp_path, {"keys": two})) == [
        "security.keys[1].id: duplicate key id 1 (also security.keys[0])",
        "security.write_key: required with several keys: the id (1) of the one that seals new values"]
    assert problems(config(tmp_path, {"keys": two[:1], "write_key": 7})) == \
        ["security.write_key: 7 is not the id of any of security.keys (ids: 1)"]
    assert problems(config(tmp_path, {"keys": two[:1], "tenant_keys": True})) == \
        ["security.tenant_keys: true needs security.tenant (the cache_salt the tenant keys are for)"]
    (p,) = problems(config(tmp_path, {"keys": [{"id": 1, "file": str(short)}]}))
    assert p.startswith(f"security.keys[0].file: key file {short} holds a key of 2 bytes; expected at least 32")
    (p,) = problems(config(tmp_path, {"keys": [{"id": 1, "env": "KVTIER_TEST_NO_SUCH_KEY"}]}))
    assert p == "security.keys[0].env: environment variable KVTIER_TEST_NO_SUCH_KEY is not set"
    (p,) = problems(config(tmp_path, {"keys": [{"id": 1, "file": str(good)}]}, modes=("sign",)))
    assert p.startswith("backends[0].security: ")


def test_the_key_never_appears_in_repr_errors_logs_or_pickles(tmp_path, monkeypatch, caplog):
    monkeypatch.setenv("KVTIER_TEST_KEY", SECRET_HEX)
    data = config(tmp_path, {"keys": [{"id": 1, "env": "KVTIER_TEST_KEY"}]}, modes=MODES)
    cfg = parse_config(data)
    backends = cfg.build_backends()
    key = bytes.fromhex(SECRET_HEX)
    seen = [repr(cfg), str(cfg.model_dump()), json.dumps(cfg.model_dump(mode="json"))]
    seen += [repr(b) + repr(b.seal) + repr(b.seal.keyring) + str(vars(b.seal.keyring)) for b in backends]
    with caplog.at_level(logging.DEBUG):
        ks = prompt_keys(1)
        LocalDiskBackend({"path": str(tmp_path / "kv0")}).put(ks, payloads(1), LID)
        assert get(backends[0], ks) == [None] and backends[0].stats().forged == 1
    seen.append(caplog.text)
    seen.append(str(backends[0].stats()))
    monkeypatch.setenv("KVTIER_TEST_KEY", SECRET_HEX[:-10])  # too short now: the error names the variable
    (p,) = problems(data)
    seen.append(p)
    for text in seen:
        assert SECRET_HEX not in text and SECRET_HEX[:16] not in text and key.hex() not in text
        assert repr(key)[2:-1] not in text
    with pytest.raises(TypeError):
        pickle.dumps(backends[0].seal.keyring)
    for b in backends:
        b.close()


def test_verify_reports_forged_and_inspect_counts_without_the_key(tmp_path):
    from kvtier.tools.cli import main

    keyfile = tmp_path / "key"
    keyfile.write_text(os.urandom(32).hex())
    data = config(tmp_path, {"keys": [{"id": 1, "file": str(keyfile)}]})
    data["model"] = {"id": "sec/model", "num_layers": 2, "num_kv_heads": 2, "head_dim": 64}
    cfg = parse_config(data)
    (sealed,) = cfg.build_backends()
    ns = cfg.namespace()
    ks = ns.keys(ns.hasher().hash_blocks(list(range(64))))
    nbytes = 2 * 2 * 16 * 2 * 64 * 2
    sealed.put_manifest(ns)
    assert sealed.put(ks[:3], payloads(3, nbytes), ns.layout_id) == [True] * 3
    LocalDiskBackend({"path": str(tmp_path / "kv0")}).put(ks[3:], payloads(1, nbytes), ns.layout_id)
    path = tmp_path / "c.yaml"
    path.write_text(json.dumps(data))

    def run(*argv):
        out = io.StringIO()
        with redirect_stdout(out):
            rc = main([*argv, "--config", str(path), "--json", "--no-progress"])
        return rc, json.loads(out.getvalue())

    rc, doc = run("verify")
    assert rc == 1 and doc["forged"] == 1 and doc["corrupt"] == 0
    (b,) = doc["backends"]
    assert b["ok"] == 3 and [f["key"] for f in b["forged"]] == ks[3:] and "version 1" in b["forged"][0]["reason"]
    keyfile.unlink()  # inspect counts without the key
    rc, doc = run("inspect")
    assert rc == 0 and doc["backends"][0]["blocks"] == 4 and doc["backends"][0]["security"] == "authenticate"


@pytest.mark.parametrize("mode", MODES)
def test_the_stack_serves_sealed_blocks_and_recomputes_a_forged_one(tmp_path, mode):
    """Through the config and the tier stack (what kvtier run, P/D and the connectors use): a stored prompt
    loads in a second stack; a block replaced by a well-formed version 1 value is recomputed, never loaded."""
    import torch
    from _stack_helpers import TIMEOUT, chain, config, fill, read

    from kvtier.stack import TierStack

    keyfile = tmp_path / "key"
    keyfile.write_text(os.urandom(32).hex())
    cfg = config(tmp_path, backends=[{"name": "disk", "type": "local_disk", "security": mode,
                                      "options": {"path": str(tmp_path / "disk")}}],
                 security={"keys": [{"id": 1, "file": str(keyfile)}]})
    with TierStack(cfg) as st:
        hs = chain(st, 3)
        rows = fill(st, [0, 1, 2], seed=5)
        st.store(hs, [0, 1, 2]).wait(TIMEOUT)
        st.flush(TIMEOUT)
        key = st.namespace.key(hs[1])
        nbytes = st.layout.block_nbytes
    path = _local_path(tmp_path, key, "disk")
    assert bf.stored_version(path.read_bytes()) == 2
    if mode == "encrypt":
        assert rows[1].numpy().tobytes()[:64] not in path.read_bytes()
    fake = bytes([7]) * nbytes
    path.write_bytes(frame(key, memoryview(fake), st.namespace.layout_id) + fake)
    with TierStack(cfg) as st2:
        lr = st2.load(hs, [5, 6, 7]).wait(TIMEOUT)
        assert lr.ok == (True, False, False) and lr.recompute == [6, 7]
        assert torch.equal(read(st2, [5]), rows[:1])
        assert st2.backends[0].stats().forged == 1 and not path.exists()
