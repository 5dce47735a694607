"""Real ``redis-server`` processes for tests and benchmarks: a single server and a 3-node Redis Cluster.

Nothing here is mocked: every handle owns a ``redis-server`` child process listening on a free loopback
port, with its own temporary directory and no persistence unless asked (``--save "" --appendonly no``).

Use from Python::

    srv = start_redis(password="s3cret")     # -> RedisServer; srv.url has the password in it
    srv.restart(); srv.pause(); srv.resume(); srv.stop()
    cl = start_redis_cluster(3)              # -> RedisCluster; cl.url, cl.nodes[i].stop() ...

or as pytest fixtures (import them into a test module or a conftest): ``redis_server`` and
``redis_cluster`` are session-scoped and flushed (FLUSHALL) before each test that asks for them;
a test that stops or pauses a node gets it back running before the next test.

Invariants: a handle's port never changes across ``restart()`` (clients reconnect to the same address);
``stop()`` is idempotent; every process started here is killed at interpreter exit at the latest.
"""

from __future__ import annotations

import atexit
import contextlib
import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from collections.abc import Iterator, Sequence
from typing import Any

__all__ = ["RedisServer", "RedisCluster", "start_redis", "start_redis_cluster", "free_port",
           "redis_available", "redis_server", "redis_cluster"]

_LIVE: set[RedisServer] = set()


def redis_available() -> str | None:
    """None when ``redis-server`` and ``redis-cli`` are on PATH, else the reason they cannot be used."""
    missing = [b for b in ("redis-server", "redis-cli") if shutil.which(b) is None]
    return f"{' and '.join(missing)} not found on PATH (apt install redis-server)" if missing else None


def free_port() -> int:
    """A currently free loopback TCP port (cluster bus ports are port + 10000, so keep it below 55535)."""
    for _ in range(100):
        with socket.socket() as s:
            s.bind(("127.0.0.1", 0))
            port: int = s.getsockname()[1]
        if port < 55535 and _port_free(port + 10000):
            return port
    raise RuntimeError("no free loopback port found")


def _port_free(port: int) -> bool:
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
            return True
        except OSError:
            return False


class RedisServer:
    """One ``redis-server`` process on 127.0.0.1:``port``; ``url`` carries the password if one is set."""

    def __init__(self, port: int | None = None, password: str | None = None,
                 extra_args: Sequence[str] = (), directory: str | None = None, tls: bool = False):
        why = redis_available()
        if why:
            raise RuntimeError(why)
        self.port = port or free_port()
        self.password = password
        self.tls = tls
        self.extra_args = list(extra_args)
        self._own_dir = directory is None
        self.dir = directory or tempfile.mkdtemp(prefix=f"kvtier-redis-{self.port}-")
        self.proc: subprocess.Popen[bytes] | None = None
        self.paused = False
        self.ca_file = _make_certs(self.dir) if tls else None

    # -------------------------------------------------------------- addresses

    @property
    def host(self) -> str:
        return "127.0.0.1"

    @property
    def url(self) -> str:
        auth = f":{self.password}@" if self.password else ""
        return f"{'rediss' if self.tls else 'redis'}://{auth}{self.host}:{self.port}"

    def __repr__(self) -> str:  # never the password
        return f"RedisServer(port={self.port}, running={self.running})"

    # -------------------------------------------------------------- lifecycle

    @property
    def running(self) -> bool:
        return self.proc is not None and self.proc.poll() is None

    def start(self, timeout: float = 10.0) -> RedisServer:
        if self.running:
            return self
        args = ["redis-server", "--port", str(self.port), "--bind", "127.0.0.1", "--dir", self.dir,
                "--save", "", "--appendonly", "no", "--protected-mode", "no", "--daemonize", "no",
                "--logfile", os.path.join(self.dir, "redis.log")]
        if self.password:
            args += ["--requirepass", self.password]
        if self.tls:
            d = self.dir
            args[1:3] = ["--port", "0", "--tls-port", str(self.port)]
            args += ["--tls-cert-file", f"{d}/server.crt", "--tls-key-file", f"{d}/server.key",
                     "--tls-ca-cert-file", f"{d}/ca.crt", "--tls-auth-clients", "no"]
        args += self.extra_args
        self.proc = subprocess.Popen(args, stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                     stderr=subprocess.DEVNULL, start_new_session=True)
        _LIVE.add(self)
        self.paused = False
        deadline = time.monotonic() + timeout
        while True:
            if self.proc.poll() is not None:
                raise RuntimeError(f"redis-server on port {self.port} exited with {self.proc.returncode}; "
                                   f"see {self.dir}/redis.log")
            with contextlib.suppress(OSError, RuntimeError):
                if self.cli("PING").strip() == "PONG":
                    return self
            if time.monotonic() > deadline:
                self.stop()
                raise RuntimeError(f"redis-server on port {self.port} did not answer PING in {timeout}s")
            time.sleep(0.02)

    def stop(self) -> None:
        """Kill the process (SIGKILL: like a crash; nothing is saved anyway).  Idempotent."""
        if self.proc is not None:
            if self.paused:
                self.resume()
            with contextlib.suppress(ProcessLookupError):
                self.proc.kill()
            self.proc.wait(timeout=10)
            self.proc = None
        _LIVE.discard(self)

    def restart(self) -> RedisServer:
        """Stop and start again on the same port (and, for a cluster node, the same node id)."""
        self.stop()
        return self.start()

    def pause(self) -> None:
        """SIGSTOP: the port still accepts connections but nothing answers (a hung server)."""
        assert self.proc is not None
        os.kill(self.proc.pid, signal.SIGSTOP)
        self.paused = True

    def resume(self) -> None:
        if self.proc is not None and self.paused:
            os.kill(self.proc.pid, signal.SIGCONT)
        self.paused = False

    def cleanup(self) -> None:
        self.stop()
        if self._own_dir:
            shutil.rmtree(self.dir, ignore_errors=True)

    # -------------------------------------------------------------- talking to it

    def cli(self, *args: str, timeout: float = 10.0) -> str:
        """Run one ``redis-cli`` command against this server and return its stdout (raw mode)."""
        cmd = ["redis-cli", "-h", self.host, "-p", str(self.port), "--raw"]
        if self.tls:
            cmd += ["--tls", "--cacert", f"{self.dir}/ca.crt"]
        env = dict(os.environ)
        if self.password:
            env["REDISCLI_AUTH"] = self.password  # not on the command line: ps would show it
        r = subprocess.run(cmd + list(args), capture_output=True, text=True, timeout=timeout, env=env)
        if r.returncode != 0:
            raise RuntimeError(f"redis-cli {args[0] if args else ''} failed: {r.stderr.strip()}")
        return r.stdout

    def client(self, **kw: Any) -> Any:
        """A redis-py client on this server (an independent view for assertions)."""
        import redis

        if self.tls:
            kw.update(ssl=True, ssl_ca_certs=self.ca_file)
        return redis.Redis(host=self.host, port=self.port, password=self.password,
                           socket_timeout=kw.pop("socket_timeout", 10), **kw)

    def flushall(self) -> None:
        self.cli("FLUSHALL")


class RedisCluster:
    """A Redis Cluster of ``n`` masters (no replicas) on loopback; ``url`` names one node (a seed)."""

    def __init__(self, nodes: list[RedisServer]):
        self.nodes = nodes
        self._ok_pids = [n.proc.pid for n in nodes if n.proc is not None]

    @property
    def url(self) -> str:
        return self.nodes[0].url

    @property
    def urls(self) -> list[str]:
        return [n.url for n in self.nodes]

    def __repr__(self) -> str:
        return f"RedisCluster(ports={[n.port for n in self.nodes]})"

    def node_for_key(self, key: str | bytes) -> RedisServer:
        """The node that owns ``key``'s hash slot (asked of the cluster, not computed here)."""
        slot = int(self._any_running().cli("CLUSTER", "KEYSLOT", key if isinstance(key, str) else key.decode()))
        for node in self.nodes:
            for line in node.cli("CLUSTER", "NODES").splitlines() if node.running and not node.paused else ():
                f = line.split()
                if "myself" in f[2]:
                    for rng in f[8:]:
                        lo, _, hi = rng.partition("-")
                        if lo.isdigit() and int(lo) <= slot <= int(hi or lo):
                            return node
        raise LookupError(f"no running node owns slot {slot}")

    def _any_running(self) -> RedisServer:
        for n in self.nodes:
            if n.running and not n.paused:
                return n
        raise RuntimeError("no cluster node is running")

    def flushall(self) -> None:
        for n in self.nodes:
            if n.running and not n.paused:
                n.flushall()

    def heal(self) -> None:
        """Bring every node back (resume / restart) and wait until the cluster is ok again."""
        was_paused = False
        for n in self.nodes:
            if n.paused:
                n.resume()
                was_paused = True
            if not n.running:
                n.start()
        pids = [n.proc.pid for n in self.nodes if n.proc is not None]
        if was_paused or pids != self._ok_pids:  # a node was stopped since the cluster was last seen ok
            _wait_cluster_ok(self.nodes)
            self._ok_pids = pids

    def stop(self) -> None:
        for n in self.nodes:
            n.stop()

    def cleanup(self) -> None:
        for n in self.nodes:
            n.cleanup()


def start_redis(port: int | None = None, password: str | None = None,
                extra_args: Sequence[str] = (), tls: bool = False) -> RedisServer:
    """Start one ``redis-server`` (no persistence) and return its handle once it answers PING.

    ``tls=True``: TLS only, with a throw-away CA (``handle.ca_file``) and a server certificate for
    127.0.0.1 / localhost, made with the ``openssl`` command; ``handle.url`` is then ``rediss://``."""
    return RedisServer(port, password, extra_args, tls=tls).start()


def _make_certs(d: str) -> str:
    """A CA and a server certificate (for IP 127.0.0.1 and localhost) in ``d``; returns the CA path."""
    if shutil.which("openssl") is None:
        raise RuntimeError("openssl not found on PATH (needed to make test TLS certificates)")
    with open(f"{d}/san.ext", "w") as f:
        f.write("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    for cmd in (
        f"req -x509 -newkey rsa:2048 -nodes -keyout {d}/ca.key -out {d}/ca.crt -days 2 -subj /CN=kvtier-test-ca",
        f"req -newkey rsa:2048 -nodes -keyout {d}/server.key -out {d}/server.csr -subj /CN=localhost",
        f"x509 -req -in {d}/server.csr -CA {d}/ca.crt -CAkey {d}/ca.key -CAcreateserial "
        f"-out {d}/server.crt -days 2 -extfile {d}/san.ext",
    ):
        subprocess.run(["openssl", *cmd.split()], check=True, capture_output=True, timeout=60)
    return f"{d}/ca.crt"


def start_redis_cluster(n: int = 3, password: str | None = None, node_timeout_ms: int = 2000,
                        extra_args: Sequence[str] = ()) -> RedisCluster:
    """Start ``n`` cluster-enabled servers and join them with ``redis-cli --cluster create``.

    ``cluster-require-full-coverage no`` keeps the surviving nodes serving their own slots when one node
    is down, which is what the fault tests exercise."""
    nodes = []
    try:
        for _ in range(n):
            args = ["--cluster-enabled", "yes", "--cluster-config-file", "nodes.conf",
                    "--cluster-node-timeout", str(node_timeout_ms),
                    "--cluster-require-full-coverage", "no", "--cluster-allow-reads-when-down", "yes",
                    *extra_args]
            if password:
                args += ["--masterauth", password]
            nodes.append(start_redis(password=password, extra_args=args))
        cmd = ["redis-cli", "--cluster", "create", *[f"127.0.0.1:{s.port}" for s in nodes],
               "--cluster-replicas", "0", "--cluster-yes"]
        env = dict(os.environ)
        if password:
            env["REDISCLI_AUTH"] = password
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=60, env=env)
        if r.returncode != 0:
            raise RuntimeError(f"redis-cli --cluster create failed: {r.stdout[-500:]} {r.stderr[-500:]}")
        _wait_cluster_ok(nodes)
        return RedisCluster(nodes)
    except BaseException:
        for s in nodes:
            s.cleanup()
        raise


def _wait_cluster_ok(nodes: Sequence[RedisServer], timeout: float = 30.0) -> None:
    """Until every node reports cluster_state:ok and knows every other node as connected."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            ok = all("cluster_state:ok" in s.cli("CLUSTER", "INFO") for s in nodes) and all(
                s.cli("CLUSTER", "NODES").count("connected") >= len(nodes) for s in nodes)
        except (RuntimeError, subprocess.TimeoutExpired):
            ok = False
        if ok:
            return
        if time.monotonic() > deadline:
            raise RuntimeError("redis cluster did not reach cluster_state:ok")
        time.sleep(0.1)


@atexit.register
def _kill_all() -> None:
    for s in list(_LIVE):
        with contextlib.suppress(Exception):
            s.cleanup()


# ------------------------------------------------------------------ pytest fixtures

try:
    import pytest
except ImportError:  # pragma: no cover - the helpers above work without pytest
    pytest = None  # type: ignore[assignment]

if pytest is not None:

    def _own_server() -> Iterator[RedisServer]:
        why = redis_available()
        if why:
            pytest.skip(why)
        srv = start_redis()
        yield srv
        srv.cleanup()

    _redis_server_session = pytest.fixture(scope="session", name="_redis_server_session")(_own_server)
    #: A server of one test module's own, never emptied by another test (``redis_server`` is, before each
    #: test): for module-scoped fixtures that store values several tests read.
    module_redis_server = pytest.fixture(scope="module", name="module_redis_server")(_own_server)

    @pytest.fixture
    def redis_server(_redis_server_session: RedisServer) -> Iterator[RedisServer]:
        """A running single server, emptied before the test; restarted afterwards if the test broke it."""
        srv = _redis_server_session
        if srv.paused:
            srv.resume()
        if not srv.running:
            srv.start()
        srv.flushall()
        yield srv
        if srv.paused:
            srv.resume()
        if not srv.running:
            srv.start()

    @pytest.fixture(scope="session")
    def _redis_cluster_session() -> Iterator[RedisCluster]:
        why = redis_available()
        if why:
            pytest.skip(why)
        cl = start_redis_cluster(3)
        yield cl
        cl.cleanup()

    @pytest.fixture
    def redis_cluster(_redis_cluster_session: RedisCluster) -> Iterator[RedisCluster]:
        """A healthy 3-node cluster, emptied before the test and healed after it."""
        cl = _redis_cluster_session
        cl.heal()
        cl.flushall()
        yield cl
        cl.heal()
