"""Shared test plumbing: the ``figures`` fixture collects the numbers reliability and benchmark-style tests
measure, and they are printed together at the end of the run (so CI output carries them)."""

from __future__ import annotations

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
