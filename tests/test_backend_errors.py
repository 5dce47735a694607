"""How the backend contract types a hook's exception: by class and errno, never by its name or text.

Timeouts, unreachable servers, a full disk and refused access are different faults with different cures,
so each is its own ``BackendError`` subclass; disk full and access denied name where and what to do, and
are counted in ``stats().disk_full`` / ``stats().permission_denied``."""

from __future__ import annotations

import errno
import os
import socket
import ssl

import pytest

from kvtier.backend_api import (
    BackendDiskFull,
    BackendError,
    BackendPermissionDenied,
    BackendTimeout,
    BackendUnavailable,
)
from kvtier.keys import Namespace
from kvtier_memstore import MemStoreBackend

NS = Namespace("m", "bfloat16", 2, 2, 64, 16)
KEY = NS.key(bytes(16))


class TimeoutLikeName(Exception):
    """Named like a timeout, is not one."""


class ConnectionLostInName(Exception):
    """Named like a connection error, is not one."""


class Raising(MemStoreBackend):
    """Every hook raises ``self.error``."""

    error: BaseException = RuntimeError("unset")

    def _write(self, keys, values):
        raise self.error

    _exists = _delete = _read_into = _write


def raised(error: BaseException) -> tuple[BackendError, Raising]:
    b = Raising(name="mem")
    b.error = error
    with pytest.raises(BackendError) as e:
        b.put([KEY], [b"x" * 8], NS.layout_id)
    return e.value, b


@pytest.mark.parametrize("error, kind", [
    (TimeoutError("read"), BackendTimeout),  # socket.timeout is this class
    (TimeoutError(errno.ETIMEDOUT, "connect"), BackendTimeout),
    (OSError(errno.ETIMEDOUT, "connect"), BackendTimeout),  # Python makes this a TimeoutError
    (ConnectionRefusedError(errno.ECONNREFUSED, "refused"), BackendUnavailable),
    (ConnectionResetError("reset"), BackendUnavailable),
    (OSError(errno.EIO, "I/O error"), BackendUnavailable),
    (ssl.SSLCertVerificationError(1, "CERTIFICATE_VERIFY_FAILED"), BackendUnavailable),  # errno 1 is not EPERM
    (socket.gaierror(socket.EAI_NONAME, "no such host"), BackendUnavailable),
    # Neither the class name nor the message makes a timeout or an outage: only the type does.
    (TimeoutLikeName("it timed out"), BackendError),
    (ConnectionLostInName("connection timed out"), BackendError),
    (RuntimeError("Timeout: connection refused"), BackendError),
    (OSError(errno.ENOSPC, "No space left on device"), BackendDiskFull),
    (OSError(errno.EDQUOT, "Disk quota exceeded"), BackendDiskFull),
    (PermissionError(errno.EACCES, "Permission denied"), BackendPermissionDenied),
    (OSError(errno.EPERM, "Operation not permitted"), BackendPermissionDenied),
    (OSError(errno.EROFS, "Read-only file system"), BackendPermissionDenied),
])
def test_errors_are_typed_by_class_and_errno(error, kind):
    e, b = raised(error)
    assert type(e) is kind, f"{error!r} became {type(e).__name__}: {e}"
    assert e.__cause__ is error and "backend 'mem'" in str(e) and KEY in str(e)
    s = b.stats()
    assert s.disk_full == (kind is BackendDiskFull)
    assert s.permission_denied == (kind is BackendPermissionDenied)
    assert s.put_failures == 1


def test_disk_full_and_denied_say_where_and_what_to_do():
    e, _ = raised(OSError(errno.ENOSPC, "No space left on device", "/data/kv/ab/x.tmp"))
    assert "no space left on the device at /data/kv/ab/x.tmp" in str(e) and "free space" in str(e)
    assert "capacity" in str(e)
    e, _ = raised(PermissionError(errno.EACCES, "Permission denied", "/data/kv"))
    assert "permission denied on /data/kv" in str(e) and "access" in str(e)
    if hasattr(os, "getuid"):
        assert f"uid {os.getuid()}" in str(e)
    e, _ = raised(OSError(errno.EROFS, "Read-only file system"))
    assert "read-only filesystem on the backend's storage" in str(e) and "write: false" in str(e)


def test_local_disk_names_its_root(tmp_path):
    from kvtier.backends.local_disk import LocalDiskBackend

    b = LocalDiskBackend({"path": str(tmp_path / "d")})
    e = b._wrap(OSError(errno.ENOSPC, "No space left on device"), KEY)
    assert isinstance(e, BackendDiskFull) and f"at {b.root}:" in str(e)
    assert b.stats().disk_full == 1
    b.close()


def test_s3_client_errors_are_typed_by_class():
    """botocore's exceptions are not builtin ones (EndpointConnectionError is no OSError); the S3 backend
    translates them by class and error code."""
    from botocore import exceptions as bx

    from kvtier.backends.s3 import S3Backend

    b = S3Backend({"bucket": "kvtier-errors", "prefix": "team", "endpoint_url": "http://127.0.0.1:9",
                   "retries": 0})
    try:
        cases = [
            (bx.ReadTimeoutError(endpoint_url="http://x"), BackendTimeout),
            (bx.ConnectTimeoutError(endpoint_url="http://x"), BackendTimeout),
            (bx.EndpointConnectionError(endpoint_url="http://x"), BackendUnavailable),
            (bx.ConnectionClosedError(endpoint_url="http://x"), BackendUnavailable),
            (bx.ClientError({"Error": {"Code": "SlowDown", "Message": "slow"}}, "PutObject"), BackendUnavailable),
            (bx.ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "PutObject"),
             BackendPermissionDenied),
            (bx.NoCredentialsError(), BackendPermissionDenied),
            (bx.ClientError({"Error": {"Code": "NoSuchBucket", "Message": "no"}}, "GetObject"), BackendError),
        ]
        for error, kind in cases:
            e = b._wrap(error, KEY)
            assert type(e) is kind, f"{error!r} became {type(e).__name__}: {e}"
        denied = b._wrap(bx.ClientError({"Error": {"Code": "AccessDenied", "Message": "no"}}, "GetObject"), KEY)
        assert "on s3://kvtier-errors/team/" in str(denied)
        assert b.stats().permission_denied == 3
    finally:
        b.close()
