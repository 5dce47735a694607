"""A moto S3 server on a free loopback port, reached over real HTTP (never in-process ``mock_aws``).

``start_moto()`` returns a :class:`MotoServer` handle with:

* ``endpoint_url`` -- ``http://127.0.0.1:<port>``; the port stays the same across ``stop``/``start``;
* ``delay_s`` / ``slow(delay_s)`` -- every request waits that long before moto answers (a slow server);
  ``trickle_s`` / ``slow(trickle_s=...)`` -- response bodies come in 64 KiB pieces that far apart (a
  server that never trips a per-read timeout but never finishes either);
* ``stop()`` -- the port refuses connections and every open connection is cut (a dead server);
  ``start()`` brings it back on the same port with the same objects (moto keeps its state in-process);
* ``client()`` -- a raw boto3 S3 client on the endpoint, for tests that tamper with objects.

The pytest fixtures at the bottom (``moto_server``: one per session; ``moto_server_private``: one per
test, for fault tests that stop or slow it; ``s3_bucket``: a fresh bucket on the session server) set
dummy AWS credentials in the environment.  Load them with ``pytest_plugins =
("kvtier.testing.moto_server",)`` in a test module or the root conftest.  Importing this module needs
moto and boto3, not pytest.

The server is moto's ``ThreadedMotoServer`` with its WSGI app wrapped (for the delay) and its
connections tracked (so ``stop`` really cuts keep-alive connections instead of leaving their handler
threads serving, which is what plain ``ThreadedMotoServer.stop`` does).
"""

from __future__ import annotations

import contextlib
import os
import socket
import threading
import uuid
from collections.abc import Iterator
from typing import Any

from moto.server import ThreadedMotoServer
from werkzeug.serving import ThreadedWSGIServer, WSGIRequestHandler

DUMMY_CREDENTIALS = {
    "AWS_ACCESS_KEY_ID": "testing",
    "AWS_SECRET_ACCESS_KEY": "testing",
    "AWS_SESSION_TOKEN": "testing",
    "AWS_DEFAULT_REGION": "us-east-1",
}
_TRICKLE_PIECE = 64 << 10
# Never let a developer's real profile or an instance role be used against the fake server.
_CLEARED = ("AWS_PROFILE", "AWS_DEFAULT_PROFILE", "AWS_SECURITY_TOKEN")


class _QuietHandler(WSGIRequestHandler):
    """No access log line per request (thousands per benchmark)."""

    def log_request(self, *args: Any, **kwargs: Any) -> None:
        pass


class _TrackingServer(ThreadedWSGIServer):
    """Werkzeug's threaded server, remembering live connections so ``cut_connections`` can end them."""

    def __init__(self, *args: Any, **kwargs: Any):
        self._conns: set[socket.socket] = set()
        self._conns_lock = threading.Lock()
        super().__init__(*args, **kwargs)

    def get_request(self) -> tuple[socket.socket, Any]:
        sock, addr = super().get_request()
        with self._conns_lock:
            self._conns.add(sock)
        return sock, addr

    def shutdown_request(self, request: Any) -> None:
        with self._conns_lock:
            self._conns.discard(request)
        super().shutdown_request(request)

    def cut_connections(self) -> None:
        with self._conns_lock:
            conns = list(self._conns)
        for s in conns:
            with contextlib.suppress(OSError):
                s.shutdown(socket.SHUT_RDWR)


class MotoServer(ThreadedMotoServer):
    """moto's threaded server on 127.0.0.1 with an injectable delay and a real stop/start."""

    def __init__(self, port: int = 0):
        super().__init__(ip_address="127.0.0.1", port=port, verbose=False)
        self.delay_s = 0.0
        self.trickle_s = 0.0
        self._woken = threading.Event()  # set on stop, so delayed requests end at once

    # -- moto hook: the same app ThreadedMotoServer serves, wrapped, on a tracking server

    def _server_entry(self) -> None:
        from moto.server import DomainDispatcherApplication, create_backend_app

        app = DomainDispatcherApplication(create_backend_app)

        def delayed(environ: dict[str, Any], start_response: Any) -> Any:
            if self.delay_s > 0 and self._woken.wait(self.delay_s):
                start_response("503 Service Unavailable", [("Content-Length", "0")])
                return [b""]
            result = app(environ, start_response)
            return self._trickle(result) if self.trickle_s > 0 else result

        self._server = _TrackingServer(self._ip_address, self._port, delayed, handler=_QuietHandler)
        # Pin the port chosen by the OS so a restart comes back on the same endpoint.
        self._port = self._server.server_address[1]
        self._server_ready_event.set()
        self._server.serve_forever()

    def _trickle(self, result: Any) -> Iterator[bytes]:
        woken = self._woken
        try:
            for piece in result:
                for i in range(0, len(piece), _TRICKLE_PIECE):
                    yield piece[i:i + _TRICKLE_PIECE]
                    if woken.wait(self.trickle_s):
                        return  # stopped: the client sees a short body
        finally:
            close = getattr(result, "close", None)
            if close is not None:
                close()

    # -- public handle

    @property
    def port(self) -> int:
        return self._port

    @property
    def endpoint_url(self) -> str:
        return f"http://127.0.0.1:{self._port}"

    @property
    def running(self) -> bool:
        return self._server is not None

    def start(self) -> None:
        if self._server is not None:
            return
        self._woken.clear()
        # moto's start() returns once this event is set; a restart must wait for its own server, not find
        # the event the first start set (it did: a test's first request after a restart was refused).
        self._server_ready_event.clear()
        super().start()

    def stop(self) -> None:
        """Refuse new connections and cut open ones; objects are kept for a later ``start``."""
        if self._server is None:
            return
        server = self._server
        assert isinstance(server, _TrackingServer)  # start() makes only these
        self._woken.set()
        server.shutdown()
        server.server_close()
        server.cut_connections()
        if self._thread is not None:
            self._thread.join()
        self._server = None

    restart = start

    @contextlib.contextmanager
    def slow(self, delay_s: float = 0.0, *, trickle_s: float = 0.0) -> Iterator[MotoServer]:
        """Within the block, every request waits ``delay_s`` seconds before it is answered, and response
        bodies trickle out in 64 KiB pieces ``trickle_s`` apart."""
        old = self.delay_s, self.trickle_s
        self.delay_s, self.trickle_s = delay_s, trickle_s
        try:
            yield self
        finally:
            self.delay_s, self.trickle_s = old
            # Wake requests still sleeping so they do not outlive the test that slowed them.
            self._woken.set()
            self._woken = threading.Event()

    def client(self, **kwargs: Any) -> Any:
        """A raw boto3 S3 client on this server (dummy credentials unless given)."""
        import boto3
        from botocore.config import Config

        kw: dict[str, Any] = {"region_name": "us-east-1", "aws_access_key_id": "testing",
                              "aws_secret_access_key": "testing",
                              "config": Config(retries={"max_attempts": 1})}
        kw.update(kwargs)
        return boto3.client("s3", endpoint_url=self.endpoint_url, **kw)

    def new_bucket(self, prefix: str = "kvtier-test") -> str:
        """Create a bucket with a fresh name and return the name."""
        name = f"{prefix}-{uuid.uuid4().hex[:12]}"
        self.client().create_bucket(Bucket=name)
        return name

    def __enter__(self) -> MotoServer:
        return self

    def __exit__(self, *exc: Any) -> None:
        self.stop()


def start_moto(port: int = 0) -> MotoServer:
    """Start a moto S3 server on ``port`` (0: a free one) of 127.0.0.1 and return its handle."""
    server = MotoServer(port)
    server.start()
    return server


@contextlib.contextmanager
def dummy_credentials() -> Iterator[None]:
    """Dummy AWS credentials in the environment for the duration (restored afterwards)."""
    saved = {k: os.environ.get(k) for k in (*DUMMY_CREDENTIALS, *_CLEARED)}
    os.environ.update(DUMMY_CREDENTIALS)
    for k in _CLEARED:
        os.environ.pop(k, None)
    try:
        yield
    finally:
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v


# ----------------------------------------------------------------------------------- pytest fixtures

try:
    import pytest
except ImportError:  # pragma: no cover - the helpers above (and the benchmark) work without pytest
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    @pytest.fixture(scope="session")
    def moto_server() -> Iterator[MotoServer]:
        """One moto server for the session; tests must not stop or slow it (use ``moto_server_private``)."""
        with dummy_credentials(), start_moto() as server:
            yield server

    @pytest.fixture
    def moto_server_private() -> Iterator[MotoServer]:
        """A moto server of this test's own, free to be stopped, restarted and slowed."""
        with dummy_credentials(), start_moto() as server:
            yield server

    @pytest.fixture
    def s3_bucket(moto_server: MotoServer) -> str:
        """A fresh, empty bucket on the session server."""
        return moto_server.new_bucket()
