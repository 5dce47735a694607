"""kvtier's worker threads, and the CPUs they run on.

Every pool kvtier starts (backend I/O, transfers, copies, probes) is made by :func:`pool`, so its
threads first apply the process-wide CPU setting (``transfer.cpus``, see :func:`configure`):

* ``all`` (default): any CPU this process may use (its cgroup's cpuset, else every online CPU).
  A new thread inherits the CPU mask of the thread that starts it, and engines pin theirs: vLLM's CPU
  worker binds its main thread to one core for OpenMP (``VLLM_CPU_OMP_THREADS_BIND``), so without this
  every kvtier thread of that worker ran on that one core, beside the engine's own busy loop.  Measured
  inside vLLM on this 2-core machine: a 512 MiB load from local disk took 200-330 ms on the inherited
  core against about 90 ms outside vLLM.
* ``inherit``: keep the mask of the starting thread (the old behaviour).
* a CPU list such as ``"2-3"`` or ``"0,4-7"``: only those (e.g. the cores an engine reserves for I/O).
"""

from __future__ import annotations

import contextlib
import logging
import os
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

_cpus: str = "all"  # one str: assigning it is atomic
_warned: set[str] = set()  # CPU lists already reported as (partly) unavailable
log = logging.getLogger("kvtier.threads")


def parse_cpus(spec: str) -> set[int]:
    """``"0,2-3"`` -> {0, 2, 3}; ValueError naming the bad part."""
    out: set[int] = set()
    for part in str(spec).split(","):
        part = part.strip()
        lo, sep, hi = part.partition("-")
        if not lo.isdigit() or (sep and not hi.isdigit()):
            raise ValueError(f'expected "all", "inherit" or a CPU list like "0,2-3", got {spec!r} (at {part!r})')
        a, b = int(lo), int(hi) if sep else int(lo)
        if b < a:
            raise ValueError(f"CPU range {part!r} runs backwards")
        out.update(range(a, b + 1))
    return out


def check_cpus(spec: str) -> str:
    """Validate a ``transfer.cpus`` value (config loading); returns it."""
    if spec not in ("all", "inherit"):
        parse_cpus(spec)
    return spec


def configure(spec: str) -> None:
    """Set the CPUs for kvtier threads started from now on in this process.  A CPU list naming CPUs this
    process may not use is logged once (a config may be written for another machine): the threads use
    the listed ones it may, or, if none, keep the CPUs they inherit."""
    global _cpus
    _cpus = check_cpus(spec)
    if spec in ("all", "inherit") or spec in _warned:
        return
    have, want = allowed_cpus(), parse_cpus(spec)
    if want <= have:
        return
    _warned.add(spec)
    if want & have:
        log.warning("transfer.cpus %r: CPUs %s are not available to this process (it may use %s); "
                    "kvtier threads run on %s", spec, _show(want - have), _show(have), _show(want & have))
    else:
        log.warning("transfer.cpus %r: none of these CPUs is available to this process (it may use %s); "
                    "kvtier threads keep the CPUs they inherit", spec, _show(have))


def _show(cpus: set[int]) -> str:
    """{0, 1, 2, 5} -> "0-2,5"."""
    runs: list[list[int]] = []
    for c in sorted(cpus):
        if runs and c == runs[-1][1] + 1:
            runs[-1][1] = c
        else:
            runs.append([c, c])
    return ",".join(f"{a}-{b}" if b > a else f"{a}" for a, b in runs)


def allowed_cpus() -> set[int]:
    """CPUs this process may run on: the cgroup v2 cpuset when there is one, else every online CPU.
    Not ``sched_getaffinity(0)``: that is the calling thread's mask, which an engine may have narrowed."""
    with contextlib.suppress(OSError, ValueError):
        text = Path("/sys/fs/cgroup/cpuset.cpus.effective").read_text().strip()
        if text:
            return parse_cpus(text)
    return set(range(os.cpu_count() or 1))


def apply() -> None:
    """Put the calling thread on the configured CPUs (a no-op for ``inherit`` or where unsupported)."""
    spec = _cpus
    if spec == "inherit" or not hasattr(os, "sched_setaffinity"):
        return
    cpus = allowed_cpus() if spec == "all" else parse_cpus(spec) & allowed_cpus()
    with contextlib.suppress(OSError):  # a CPU the kernel refuses: keep the inherited mask
        if cpus:
            os.sched_setaffinity(0, cpus)


def pool(workers: int, name: str, initializer: Callable[[], None] | None = None) -> ThreadPoolExecutor:
    """A thread pool whose threads run on the configured CPUs (then run ``initializer``)."""
    def init() -> None:
        apply()
        if initializer is not None:
            initializer()
    return ThreadPoolExecutor(workers, thread_name_prefix=name, initializer=init)


__all__ = ["allowed_cpus", "apply", "check_cpus", "configure", "parse_cpus", "pool"]
