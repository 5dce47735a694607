"""The S3 backend against moto's server over real HTTP: data paths, isolation, secrets, faults, timeouts.

Fault tests use a server of their own (``moto_server_private``) because they stop or slow it.
"""

from __future__ import annotations

import logging
import os
import threading
import time
import traceback
from typing import TYPE_CHECKING

import numpy as np
import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")

from kvtier.backend_api import BackendError, BackendTimeout, BackendUnavailable  # noqa: E402
from kvtier.backends.s3 import S3Backend  # noqa: E402
from kvtier.keys import Namespace  # noqa: E402

if TYPE_CHECKING:
    from kvtier.testing.moto_server import MotoServer

# Fixtures: moto_server (session), moto_server_private (per test), s3_bucket (fresh bucket).

NS = Namespace("s3-test/model", "bfloat16", 2, 2, 64, 16)
SIZE = 64 << 10


def keys(n: int) -> list[str]:
    return NS.keys([os.urandom(32) for _ in range(n)])


def blobs(n: int, size: int = SIZE) -> list[bytes]:
    return [os.urandom(size) for _ in range(n)]


def make(server: MotoServer, bucket: str, **opts) -> S3Backend:
    return S3Backend({"bucket": bucket, "endpoint_url": server.endpoint_url, **opts})


@pytest.fixture
def kv(moto_server, s3_bucket):
    b = make(moto_server, s3_bucket)
    yield b
    b.close()


def get(kv: S3Backend, ks: list[str], size: int = SIZE) -> list[bytes | None]:
    bufs = [bytearray(size) for _ in ks]
    ok = kv.get_into(ks, bufs, NS.layout_id)
    return [bytes(b) if good else None for b, good in zip(bufs, ok)]


# ----------------------------------------------------------------------------------- data paths


def test_round_trip_and_batches(kv):
    ks, data = keys(40), blobs(40)
    assert kv.put(ks, data, NS.layout_id) == [True] * 40
    assert get(kv, ks) == data
    assert get(kv, ks[::-1][:7]) == data[::-1][:7]
    assert kv.contains_prefix(ks) == 40


def test_large_block_streams_into_numpy(kv):
    k = keys(1)
    src = np.frombuffer(os.urandom(2 << 20), dtype=np.uint16)
    assert kv.put(k, [src], NS.layout_id) == [True]
    out = np.zeros_like(src)
    assert kv.get_into(k, [out], NS.layout_id) == [True]
    assert np.array_equal(out, src)


def test_missing_keys(kv):
    present, absent = keys(2)
    kv.put([present], blobs(1), NS.layout_id)
    sentinel = os.urandom(SIZE)
    bufs = [bytearray(SIZE), bytearray(sentinel)]
    assert kv.get_into([present, absent], bufs, NS.layout_id) == [True, False]
    assert bytes(bufs[1]) == sentinel
    assert kv.exists([absent, present]) == [False, True]
    assert kv.delete([absent]) == 0


def test_delete_more_than_one_request(moto_server, s3_bucket):
    # 1003 puts to moto took more than the default 18 s call budget on a loaded CI machine (202 cut at
    # it): this test is about deletes across requests, not speed, so it gives the batch room.
    with make(moto_server, s3_bucket, max_workers=16, timeout_s=60) as kv:
        ks = keys(1003)  # more than one DeleteObjects request (1000 keys each)
        assert all(kv.put(ks, [b"x"] * len(ks), NS.layout_id))
        assert kv.delete(ks) == 1003
        assert list(kv.scan(NS.id)) == []


def test_prefix_isolation(moto_server, s3_bucket):
    a, b = make(moto_server, s3_bucket, prefix="team"), make(moto_server, s3_bucket, prefix="/team2/")
    k = keys(1)
    da, db = blobs(2)
    a.put(k, [da], NS.layout_id)
    b.put(k, [db], NS.layout_id)
    assert get(a, k) == [da] and get(b, k) == [db]
    assert [x.key for x in a.scan()] == k and [x.key for x in b.scan(NS.id)] == k
    raw = sorted(o["Key"] for o in moto_server.client().list_objects_v2(Bucket=s3_bucket)["Contents"])
    assert raw == sorted([f"team/{k[0]}", f"team2/{k[0]}"])
    assert a.delete(k) == 1
    assert get(b, k) == [db] and get(a, k) == [None]


def test_endpoint_url_honoured(moto_server, s3_bucket):
    kv = make(moto_server, s3_bucket, addressing_style="path")
    urls: list[str] = []
    kv._client.meta.events.register("before-send.s3", lambda request, **_: urls.append(request.url))
    kv.put(keys(1), blobs(1), NS.layout_id)
    assert urls and all(u.startswith(f"{moto_server.endpoint_url}/{s3_bucket}/") for u in urls)
    # Pointing elsewhere really goes elsewhere: nothing listens there.
    with socket_free_port() as port:
        other = S3Backend({"bucket": s3_bucket, "endpoint_url": f"http://127.0.0.1:{port}",
                           "timeout_s": 1, "retries": 0})
        with pytest.raises(BackendUnavailable):
            other.exists(keys(1))
        assert other.health() is False


def test_missing_bucket_is_an_error_not_a_miss(moto_server):
    kv = make(moto_server, "kvtier-no-such-bucket", retries=0)
    with pytest.raises(BackendError, match="NoSuchBucket"):
        kv.get_into(keys(1), [bytearray(8)], NS.layout_id)
    assert kv.health() is False
    created = make(moto_server, f"kvtier-made-{os.urandom(4).hex()}", create_bucket=True)
    assert created.health() and created.put(keys(1), [b"x"], NS.layout_id) == [True]
    make(moto_server, created.options.bucket, create_bucket=True)  # idempotent


def test_corrupted_object_is_a_miss_counted_and_deleted(kv, moto_server, s3_bucket):
    k, other = keys(2)
    data = blobs(1)[0]
    kv.put([k, other], [data, data], NS.layout_id)
    raw = moto_server.client()
    body = bytearray(raw.get_object(Bucket=s3_bucket, Key=k)["Body"].read())
    body[-1] ^= 0x01  # one flipped payload bit, re-PUT behind the backend's back
    raw.put_object(Bucket=s3_bucket, Key=k, Body=bytes(body))
    assert get(kv, [k, other]) == [None, data]
    s = kv.stats()
    assert (s.corrupt, s.hits, s.misses) == (1, 1, 1)
    with pytest.raises(raw.exceptions.ClientError):
        raw.head_object(Bucket=s3_bucket, Key=k)


def test_usage_and_stats(kv):
    ks = keys(3)
    kv.put(ks, blobs(3, 100), NS.layout_id)
    kv.put_manifest(NS)
    extra = kv.stats().extra
    assert extra["blocks"] == 3 and extra["bytes"] == 3 * (100 + 88)


# ----------------------------------------------------------------------------------- secrets


SECRET = "kvtierS3cr3t-Distinctive-0123456789abcdef"
TOKEN = "kvtierT0ken-Distinctive-9876543210"
AKID = "AKIAKVTIERDISTINCT01"


def test_credentials_never_in_logs_errors_or_repr(moto_server_private, caplog):
    server = moto_server_private
    bucket = server.new_bucket()
    caplog.set_level(logging.DEBUG)
    kv = S3Backend({"bucket": bucket, "endpoint_url": server.endpoint_url, "access_key_id": AKID,
                    "secret_access_key": SECRET, "session_token": TOKEN, "timeout_s": 1, "retries": 1})
    ks = keys(2)
    assert kv.put(ks, blobs(2), NS.layout_id) == [True, True]
    assert get(kv, ks)[0] is not None
    errors: list[BaseException] = []
    for bad in (make(server, "kvtier-absent-bucket", access_key_id=AKID, secret_access_key=SECRET,
                     session_token=TOKEN), kv):
        if bad is kv:
            server.stop()
        try:
            bad.get_into(ks[:1], [bytearray(SIZE)], NS.layout_id)
        except BackendError as e:
            errors.append(e)
    assert len(errors) == 2
    texts = [caplog.text, repr(kv), repr(kv.options), str(kv.options), kv.options.model_dump_json()]
    for err in errors:
        texts += [str(err), repr(err), "".join(traceback.format_exception(err))]
    assert any("Signature" in r.getMessage() or "Authorization" in r.getMessage()
               for r in caplog.records), "DEBUG logging of botocore was not captured: test is void"
    for text in texts:
        for secret in (SECRET, TOKEN, AKID):
            assert secret not in text


def test_backends_in_one_process_share_botocores_models_and_sign_with_their_own_credentials(moto_server, s3_bucket):
    """botocore's parsed models are shared by every S3 backend of a process (a client is then cheap to
    make); what a session holds of its own, its credentials, is not."""
    signed: dict[str, list[str]] = {"a": [], "b": []}
    kvs = {who: make(moto_server, s3_bucket, access_key_id=f"AKIAKVTIERSHARED{who.upper()}01",
                     secret_access_key=f"secret-of-{who}-0123456789") for who in signed}
    try:
        for who, kv in kvs.items():
            kv._client.meta.events.register(
                "before-send.s3", lambda request, who=who, **_: signed[who].append(request.headers["Authorization"]))
            ks = keys(1)
            assert kv.put(ks, blobs(1), NS.layout_id) == [True]
            assert get(kv, ks)[0] is not None
        for who, headers in signed.items():
            texts = [h.decode() if isinstance(h, bytes) else h for h in headers]
            assert texts and all(f"Credential=AKIAKVTIERSHARED{who.upper()}01/" in h for h in texts)
        models = [kv._client.meta.service_model.metadata for kv in kvs.values()]
        assert models[0] is models[1]  # one parse of the S3 model for both
    finally:
        for kv in kvs.values():
            kv.close()


# ----------------------------------------------------------------------------------- faults, timeouts


def test_server_stopped_fails_fast_then_recovers(moto_server_private):
    server = moto_server_private
    bucket = server.new_bucket()
    kv = make(server, bucket, timeout_s=1, retries=2)
    ks, data = keys(4), blobs(4)
    kv.put(ks, data, NS.layout_id)
    server.stop()
    for call in (lambda: kv.get_into(ks, [bytearray(SIZE) for _ in ks], NS.layout_id),
                 lambda: kv.put(ks, data, NS.layout_id), lambda: kv.exists(ks), lambda: kv.delete(ks)):
        t0 = time.monotonic()
        with pytest.raises((BackendUnavailable, BackendTimeout)):
            call()
        assert time.monotonic() - t0 < kv.call_budget_s + 1
    assert kv.health() is False
    assert kv.stats().get_failures == 4
    server.start()
    assert get(kv, ks) == data  # same endpoint, stale pooled connections replaced


def test_a_restarted_server_answers_as_soon_as_start_returns(moto_server_private):
    """The harness's promise the outage tests lean on: ``start()`` after ``stop()`` returns once the new
    server accepts connections (it returned at once, on the first start's ready event: 8 of 20 restarts
    were refused right after it)."""
    import socket

    server = moto_server_private
    for _ in range(10):
        server.stop()
        server.start()
        socket.create_connection(("127.0.0.1", server.port), timeout=1).close()


def test_slow_server_timeout_honoured(moto_server_private):
    server = moto_server_private
    bucket = server.new_bucket()
    kv = make(server, bucket, timeout_s=0.5, retries=1)
    ks = keys(3)
    kv.put(ks, blobs(3), NS.layout_id)
    with server.slow(5.0):
        for call in (lambda: kv.get_into(ks, [bytearray(SIZE) for _ in ks], NS.layout_id),
                     lambda: kv.put(ks, blobs(3), NS.layout_id), lambda: kv.exists(ks)):
            t0 = time.monotonic()
            with pytest.raises(BackendTimeout):
                call()
            took = time.monotonic() - t0
            assert 0.5 <= took < kv.call_budget_s + 1, took
    assert kv.exists(ks) == [True] * 3


def test_trickling_body_cut_at_budget_and_buffer_left_alone(moto_server_private):
    """A body that keeps coming, slower than the budget but faster than the read timeout, is cut at the
    call budget, and no byte lands in the caller's buffer after the call returned."""
    server = moto_server_private
    bucket = server.new_bucket()
    kv = make(server, bucket, timeout_s=2, retries=0)  # budget 2 s; a stuck reader would add 2 s more
    k = keys(1)
    kv.put(k, [os.urandom(2 << 20)], NS.layout_id)
    buf = bytearray(2 << 20)
    with server.slow(trickle_s=0.3):
        t0 = time.monotonic()
        with pytest.raises(BackendTimeout):
            kv.get_into(k, [buf], NS.layout_id)
        assert time.monotonic() - t0 < kv.call_budget_s + 1
        snapshot = bytes(buf)
        time.sleep(1.0)  # the server would have sent ~3 more pieces by now
        assert bytes(buf) == snapshot
    assert get(kv, k, 2 << 20)[0] is not None


def test_abandoned_request_does_not_write_late(moto_server_private):
    """A get still waiting for its response when the budget ends never touches the buffer afterwards."""
    server = moto_server_private
    bucket = server.new_bucket()
    kv = make(server, bucket, timeout_s=3, retries=0)
    kv.call_budget_s = 0.5  # shorter than the server's delay and the read timeout
    k, data = keys(1), blobs(1)
    kv.put(k, data, NS.layout_id)
    sentinel = os.urandom(SIZE)
    buf = bytearray(sentinel)
    with server.slow(1.5):
        with pytest.raises(BackendTimeout, match="call budget"):
            kv.get_into(k, [buf], NS.layout_id)
        time.sleep(2.0)  # the server answers meanwhile; the abandoned worker must drop it
    assert bytes(buf) == sentinel


def test_concurrent_callers_share_the_pool(kv):
    ks, data = keys(64), blobs(64, 4096)
    kv.put(ks, data, NS.layout_id)
    bad: list[str] = []

    def reader(i: int) -> None:
        sl = slice(i * 8, i * 8 + 8)
        if get(kv, ks[sl], 4096) != data[sl]:
            bad.append(f"reader {i}")

    threads = [threading.Thread(target=reader, args=(i,)) for i in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not bad


class socket_free_port:
    """A loopback port with nothing listening on it (bound, then released)."""

    def __enter__(self) -> int:
        import socket

        s = socket.socket()
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        self.port = port
        s.close()
        return self.port

    def __exit__(self, *exc) -> None:
        pass


def test_contains_prefix_bisects_with_few_requests(moto_server, s3_bucket):
    """A 256-block chain is answered with O(log n) HEADs, not 256 (each probe is a request on S3)."""
    import numpy as np

    from kvtier.keys import Namespace

    ns = Namespace("test/s3-bisect", "bfloat16", 1, 1, 8, 4)
    be = S3Backend({"bucket": s3_bucket, "endpoint_url": moto_server.endpoint_url, "region": "us-east-1"})
    try:
        keys = ns.keys([i.to_bytes(16, "big") for i in range(256)])
        assert be.put(keys[:173], [np.full(32, i % 251 + 1, np.uint8) for i in range(173)], ns.layout_id) \
            == [True] * 173
        probes = []
        real = be._exists
        be._exists = lambda ks: probes.append(len(ks)) or real(ks)  # type: ignore[func-returns-value]
        assert be.contains_prefix(keys) == 173
        assert len(probes) <= 10 and sum(probes) <= 10
        assert be.contains_prefix(keys[173:]) == 0
        assert be.contains_prefix(keys[:5]) == 5  # short chains are probed whole, in parallel
    finally:
        be.close()


def test_put_body_serves_readers_that_copy_into_fixed_size_buffers():
    """botocore reads a put's body through awscrt when ``awscrt`` is installed: it calls ``readinto`` (or
    assigns ``read(len(m))`` into ``m``), so the body must never hand such a reader more than it asked for.
    Measured before the fix, with awscrt installed: every put failed with "memoryview assignment: lvalue
    and rvalue have different structures"."""
    from kvtier.backends.s3 import _ReadGuard, _TwoPartBody

    header, payload = b"H" * 88, bytes(range(256)) * 300
    for size in (1, 7, 1000, 65536, 1 << 20):
        body = _TwoPartBody(header, memoryview(payload), _ReadGuard())
        out, buf = bytearray(), bytearray(size)
        while n := body.readinto(memoryview(buf)):
            assert n <= size
            out += buf[:n]
        assert out == header + payload and body.tell() == len(body)
    body = _TwoPartBody(header, memoryview(payload), _ReadGuard())
    body.seek(100)
    buf = bytearray(50)
    assert body.readinto(buf) == 50 and bytes(buf) == payload[12:62]
