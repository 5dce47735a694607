"""Shared test plumbing: the ``figures`` fixture collects the numbers reliability and benchmark-style tests
measure, and they are printed together at the end of the run (so CI output carries them)."""

from __future__ import annotations

import os
import subprocess

import pytest

# Real servers shared by every test module (one redis-server, one 3-node cluster, one moto server per
# session; each test that asks gets them flushed / a fresh bucket).
pytest_plugins = ("kvtier.testing.redis_server", "kvtier.testing.moto_server")

_FIGURES: list[tuple[str, str, object]] = []


@pytest.fixture
def figures(request):
    """``figures("wrong blocks served", 0)``: record a figure under the current test's name."""

    def record(name: str, value: object) -> None:
        _FIGURES.append((request.node.nodeid, name, value))

    return record


def pytest_terminal_summary(terminalreporter):
    if not _FIGURES:
        return
    terminalreporter.section("kvtier figures")
    for nodeid, name, value in _FIGURES:
        terminalreporter.write_line(f"{nodeid}: {name} = {value}")


SMALL_TMPFS_BYTES = 8 << 20


@pytest.fixture
def small_tmpfs(tmp_path):
    """An 8 MiB tmpfs mounted for this test only (unmounted afterwards): a disk that really fills up.
    Mounting needs root; otherwise the test is skipped and says why."""
    if not hasattr(os, "geteuid") or os.geteuid() != 0:
        pytest.skip("needs root to mount a small tmpfs (mount -t tmpfs -o size=8m); not root")
    mnt = tmp_path / "small"
    mnt.mkdir()
    r = subprocess.run(["mount", "-t", "tmpfs", "-o", f"size={SMALL_TMPFS_BYTES >> 20}m", "tmpfs", str(mnt)],
                       capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"cannot mount a tmpfs here: {r.stderr.strip() or r.returncode}")
    try:
        yield mnt
    finally:
        if subprocess.run(["umount", str(mnt)], capture_output=True).returncode != 0:
            subprocess.run(["umount", "-l", str(mnt)], capture_output=True)
