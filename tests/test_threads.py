"""kvtier's threads run on the configured CPUs, whatever core the thread that started them was pinned to."""

from __future__ import annotations

import os
import threading

import pytest

from kvtier import threads
from kvtier.config import ConfigError, parse_config
from kvtier.format.groups import MIN_PARALLEL_READS, load_chunks

needs_affinity = pytest.mark.skipif(not hasattr(os, "sched_setaffinity") or len(threads.allowed_cpus()) < 2,
                                    reason="needs Linux CPU affinity and at least 2 CPUs")


def test_cpu_lists_parse_and_bad_ones_name_the_part():
    assert threads.parse_cpus("0,2-3") == {0, 2, 3}
    assert threads.parse_cpus(" 5 ") == {5}
    for bad, part in (("0-", "0-"), ("x", "x"), ("1,,2", "")):
        with pytest.raises(ValueError, match=f"at '{part}'"):
            threads.parse_cpus(bad)
    with pytest.raises(ValueError, match="runs backwards"):
        threads.parse_cpus("3-1")


def test_transfer_cpus_in_the_config():
    base = {"model": {"id": "m", "num_layers": 1, "num_kv_heads": 1, "head_dim": 8}}
    assert parse_config(base).transfer.cpus == "all"
    assert parse_config({**base, "transfer": {"cpus": "0-1"}}).transfer.cpus == "0-1"
    with pytest.raises(ConfigError, match=r"transfer\.cpus: .*'lots'"):
        parse_config({**base, "transfer": {"cpus": "lots"}})
    with pytest.raises(ConfigError, match=r"transfer\.cpus: expected \"all\""):
        parse_config({**base, "transfer": {"cpus": 3}})


def _mask_of_pool_thread_started_from_core0(spec: str) -> set[int]:
    """Start a kvtier pool from a thread pinned to CPU 0 (as vLLM's CPU worker pins its main thread)
    and return the CPU mask its worker thread runs with."""
    out: dict[str, set[int]] = {}

    def starter() -> None:
        os.sched_setaffinity(0, {0})
        threads.configure(spec)
        with threads.pool(1, "kvtier-test") as pool:
            out["mask"] = pool.submit(os.sched_getaffinity, 0).result()

    t = threading.Thread(target=starter)
    t.start()
    t.join()
    return out["mask"]


@needs_affinity
def test_pool_threads_leave_the_core_their_starter_was_pinned_to():
    try:
        assert _mask_of_pool_thread_started_from_core0("all") == threads.allowed_cpus()
        assert _mask_of_pool_thread_started_from_core0("inherit") == {0}
        assert _mask_of_pool_thread_started_from_core0("1") == {1}
    finally:
        threads.configure("all")


@needs_affinity
def test_cpus_this_process_may_not_use_are_logged_once_and_skipped(monkeypatch, caplog):
    """A CPU list written for a bigger machine: the CPUs missing here are named once, and the threads run
    on the listed ones this process may use, or keep their inherited CPUs when there are none."""
    have = threads.allowed_cpus()
    beyond = max(have) + 100
    monkeypatch.setattr(threads, "_warned", set())
    try:
        with caplog.at_level("WARNING", logger="kvtier.threads"):
            assert _mask_of_pool_thread_started_from_core0(f"1,{beyond}") == {1}
            assert _mask_of_pool_thread_started_from_core0(f"{beyond}-{beyond + 1}") == {0}
            threads.configure(f"1,{beyond}")  # again: already said
        msgs = [r.getMessage() for r in caplog.records]
        assert msgs == [
            f"transfer.cpus '1,{beyond}': CPUs {beyond} are not available to this process (it may use "
            f"{threads._show(have)}); kvtier threads run on 1",
            f"transfer.cpus '{beyond}-{beyond + 1}': none of these CPUs is available to this process (it may "
            f"use {threads._show(have)}); kvtier threads keep the CPUs they inherit"]
        assert threads._show({0, 1, 2, 5, 7, 8}) == "0-2,5,7-8"
    finally:
        threads.configure("all")


def test_pool_runs_the_extra_initializer():
    seen = []
    with threads.pool(1, "kvtier-test", lambda: seen.append(threading.current_thread().name)) as pool:
        pool.submit(lambda: None).result()
    assert seen and seen[0].startswith("kvtier-test")


def test_load_chunks_cover_the_load_and_grow():
    mib = 2**20
    spans = load_chunks(128, 4 * mib, 32 * mib)  # a 4k-token vLLM prompt of 4 MiB blocks
    assert spans[0] == (0, 2) and spans[-1][1] == 128
    assert all(a == b for (_, a), (b, _) in zip(spans, spans[1:]))  # contiguous, in order
    sizes = [b - a for a, b in spans]
    assert sizes[:5] == [2, 4, 8, 16, 32] and max(sizes) == 32  # up to 4x the chunk (128 MiB)
    assert len(spans) == 8  # 2+4+8+16+32+32+32+2, against 16 fixed 32 MiB chunks
    assert load_chunks(0, mib, 32 * mib) == []
    assert load_chunks(3, 64 * mib, 32 * mib) == [(0, 1), (1, 3)]  # units larger than a chunk: one, then two
    # ...growing to MIN_PARALLEL_READS values however large (read in parallel), not two at a time.
    sizes = [b - a for a, b in load_chunks(16, 64 * mib, 32 * mib)]
    assert sizes == [1, 2, 4, 4, 4, 1] and MIN_PARALLEL_READS == 4
