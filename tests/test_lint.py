"""ruff is configured in pyproject.toml and the tree stays clean."""

import shutil
import subprocess
from pathlib import Path

import pytest


def test_ruff_clean():
    ruff = shutil.which("ruff")
    if ruff is None:
        pytest.fail("ruff is not installed; it is part of the test extras")
    root = Path(__file__).resolve().parents[1]
    r = subprocess.run([ruff, "check", "."], cwd=root, capture_output=True, text=True)
    assert r.returncode == 0, r.stdout + r.stderr
