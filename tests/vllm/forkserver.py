"""Run the vLLM test scripts (``driver.py``, ``soak.py``, ``../sglang/vllm_kv.py``) without importing vLLM
again for every run (and ``python -m kvtier pd``'s prefill / decode processes, tests/test_pd.py, without
importing torch and transformers again for each).

Importing vLLM's CPU build costs about 25 CPU-seconds on this 2-core machine, and the connector tests start
some 45 vLLM processes.  The server (``python forkserver.py SOCKET``) imports torch and vLLM's modules
once, then forks one child per run: the child takes the run's environment, working directory, ``argv``
and log file (stdout and stderr), runs the script as ``__main__`` (as ``python script.py ...`` does) and
exits through the interpreter as usual (atexit handlers, vLLM's own shutdown).  Every run is still its own
process with its own vLLM engine and kvtier connector: nothing but imported module code is shared, and a
run's scheduler, worker, host memory and logs are its own.  The server waits for each child and reports
its exit status as ``subprocess`` does (negative: killed by that signal).

The client side is :func:`popen`: a ``subprocess.Popen``-like handle (``pid``, ``poll``, ``wait``,
``kill``).  It falls back to a plain ``subprocess.Popen`` where a fork cannot stand in for a fresh
interpreter: another Python executable, or ``PYTHON*`` variables (read at interpreter start, e.g.
``PYTHONHASHSEED``) other than the server's, or a caller that asks for one (``fresh``: a case whose
timing window a forked run does not give).  ``KVTIER_TEST_FORKSERVER=0`` turns it off.
"""

from __future__ import annotations

import atexit
import contextlib
import ctypes
import json
import os
import runpy
import selectors
import signal
import socket
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import IO, Any

# Imported by the server before it forks (what every run imports first; what a run imports beyond these it
# imports itself).  kvtier is not among them: the code under test is imported by each run.
PRELOAD = ("torch", "transformers", "vllm", "vllm.config", "vllm.engine.arg_utils", "vllm.entrypoints.llm",
           "vllm.v1.engine.llm_engine", "vllm.v1.engine.core", "vllm.v1.core.sched.scheduler",
           "vllm.v1.worker.cpu_worker", "vllm.v1.worker.cpu_model_runner", "vllm.v1.executor.uniproc_executor",
           "vllm.model_executor.models.llama", "vllm.distributed.kv_transfer.kv_connector.v1.base",
           "vllm.utils.hashing", "vllm.v1.core.kv_cache_utils",
           # what ``python -m kvtier pd`` (tests/test_pd.py) imports for its transformers Llama
           "transformers.models.llama.modeling_llama")


def _die_with_parent() -> None:
    """The server ends when the process that started it (pytest) does (Linux; elsewhere a no-op)."""
    with contextlib.suppress(Exception):
        ctypes.CDLL(None, use_errno=True).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG


def serve(path: str) -> None:
    _die_with_parent()
    import importlib

    for name in PRELOAD:
        with contextlib.suppress(Exception):  # a module vLLM moved: that run imports what it needs itself
            importlib.import_module(name)
    listener = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    listener.bind(path + ".tmp")
    os.rename(path + ".tmp", path)  # connectable once it exists
    listener.listen(16)
    running: dict[int, socket.socket] = {}
    sel = selectors.DefaultSelector()
    sel.register(listener, selectors.EVENT_READ)
    while True:
        for _key, _ in sel.select(timeout=0.05 if running else 1.0):
            conn, _ = listener.accept()
            req = json.loads(_read_line(conn))
            pid = os.fork()
            if pid == 0:  # the run: never returns (SystemExit unwinds to the interpreter's own exit)
                sel.close()
                listener.close()
                conn.close()
                _child(req)
            running[pid] = conn
            conn.sendall(f"{pid}\n".encode())
        for pid, conn in list(running.items()):
            done, status = os.waitpid(pid, os.WNOHANG)
            if done:
                with contextlib.suppress(OSError):
                    conn.sendall(f"{os.waitstatus_to_exitcode(status)}\n".encode())
                conn.close()
                del running[pid]


def _read_line(conn: socket.socket) -> str:
    buf = b""
    while not buf.endswith(b"\n"):
        chunk = conn.recv(65536)
        if not chunk:
            break
        buf += chunk
    return buf.decode()


def _child(req: dict[str, Any]) -> None:
    os.setsid()  # as a process of its own: a signal to the server's group does not reach it
    os.environ.clear()
    os.environ.update(req["env"])
    os.chdir(req["cwd"])
    fd = os.open(req["log"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    sys.stdout.flush()
    sys.stderr.flush()
    os.dup2(fd, 1)
    os.dup2(fd, 2)
    os.close(fd)
    stdin = os.open(os.devnull, os.O_RDONLY)
    os.dup2(stdin, 0)
    os.close(stdin)
    argv = list(req["argv"])
    module = argv[1] if argv[0] == "-m" else None
    code: Any = 0
    try:
        if module is not None:  # ``python -m module ...``: the working directory first on sys.path
            sys.argv = argv[1:]
            sys.path[0] = os.getcwd()
            runpy.run_module(module, run_name="__main__", alter_sys=True)
        else:
            sys.argv = argv
            sys.path[0] = os.path.dirname(os.path.abspath(argv[0]))
            runpy.run_path(argv[0], run_name="__main__")
    except SystemExit as e:
        code = e.code
    except BaseException:
        import traceback

        traceback.print_exc()
        code = 1
    sys.exit(code)  # the interpreter's normal exit: threads joined, atexit handlers, buffers flushed


class Forked:
    """A run the server forked: the parts of ``subprocess.Popen`` the tests use."""

    def __init__(self, conn: socket.socket) -> None:
        self._conn = conn
        self.pid = int(_read_line(conn))
        self.returncode: int | None = None

    def _collect(self, timeout: float | None) -> int | None:
        if self.returncode is None:
            self._conn.settimeout(timeout)
            try:
                line = _read_line(self._conn)
            except (TimeoutError, BlockingIOError):
                return None
            self._conn.close()
            self.returncode = int(line) if line.strip() else -signal.SIGKILL  # the server itself died
        return self.returncode

    def poll(self) -> int | None:
        return self._collect(0.0)

    def wait(self, timeout: float | None = None) -> int:
        rc = self._collect(timeout)
        if rc is None:
            raise subprocess.TimeoutExpired("forked run", timeout or 0)
        return rc

    def kill(self) -> None:
        if self.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                os.kill(self.pid, signal.SIGKILL)


_server: dict[str, Any] = {}


def _startup_env(env: dict[str, str]) -> dict[str, str]:
    return {k: v for k, v in env.items() if k.startswith("PYTHON")}


def _socket(env: dict[str, str]) -> str | None:
    """The server's socket (started on first use, with ``env``'s startup variables); None if it failed."""
    if "path" not in _server:
        d = tempfile.mkdtemp(prefix="kvtier-vllm-forkserver-")
        sock, log = os.path.join(d, "sock"), os.path.join(d, "server.log")
        with open(log, "w") as f:
            proc = subprocess.Popen([sys.executable, __file__, sock], stdout=f, stderr=subprocess.STDOUT,
                                    stdin=subprocess.DEVNULL, env={**os.environ, **_startup_env(env)})
        _server.update(path=None, proc=proc, startup=_startup_env(env))
        atexit.register(proc.terminate)
        deadline = time.monotonic() + 600
        while not os.path.exists(sock) and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.1)
        if os.path.exists(sock):
            _server["path"] = sock
        else:
            proc.kill()
            print(f"vLLM fork server did not start; runs start their own interpreter:\n"
                  f"{Path(log).read_text()[-3000:]}", file=sys.stderr)
    if _server["path"] is None or _server["proc"].poll() is not None or _server["startup"] != _startup_env(env):
        return None
    path: str = _server["path"]
    return path


def popen(argv: list[str], env: dict[str, str], log: IO[Any], cwd: str | None = None, fresh: bool = False) -> Any:
    """``subprocess.Popen([sys.executable, *argv], stdout=log, stderr=STDOUT, env=env)``, forked from the
    server where that is the same thing (see the module's docstring); ``fresh``: always a new interpreter."""
    path = None if fresh or os.environ.get("KVTIER_TEST_FORKSERVER", "1") == "0" else _socket(env)
    if path is None:
        return subprocess.Popen([sys.executable, *argv], stdout=log, stderr=subprocess.STDOUT, env=env, cwd=cwd)
    conn = socket.socket(socket.AF_UNIX, socket.SOCK_STREAM)
    conn.connect(path)
    log.flush()
    conn.sendall((json.dumps({"argv": [str(a) for a in argv], "env": env, "cwd": cwd or os.getcwd(),
                              "log": log.name}) + "\n").encode())
    return Forked(conn)


if __name__ == "__main__":
    serve(sys.argv[1])
