"""A wheel install (not only the editable one) carries the core, backends/, policies/ and configs/."""

from __future__ import annotations

import subprocess
import sys
import venv
import zipfile

import pytest

_CHECK = """
import importlib, importlib.resources, sys
import kvtier, kvtier.backends, kvtier.policies, kvtier.testing, kvtier.simulate.replay
assert kvtier.__file__.startswith(sys.prefix), kvtier.__file__
assert kvtier.backends.__file__.startswith(sys.prefix), kvtier.backends.__file__
assert importlib.resources.files("kvtier.configs").joinpath("local.yaml").is_file()
from kvtier import plugins
for p in plugins.available():
    if p.distribution == "kvtier":
        plugins.load(p.group, p.name)   # every built-in imports from the wheel
print("wheel ok")
"""


@pytest.mark.timeout(600)
def test_wheel_install_imports_everything(tmp_path):
    root = __import__("pathlib").Path(__file__).resolve().parents[1]
    dist = tmp_path / "dist"
    subprocess.run([sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
                    "-w", str(dist), str(root)], check=True)
    (whl,) = dist.glob("kvtier-*.whl")
    names = zipfile.ZipFile(whl).namelist()
    for must in ("kvtier/keys/__init__.py", "kvtier/backends/local_disk.py", "kvtier/policies/write.py",
                 "kvtier/configs/local.yaml", "kvtier/py.typed", "kvtier/testing/__init__.py"):
        assert must in names, must
    # Every module of the source tree, not only the ones named above: pyproject lists packages one by one,
    # and a package left off that list is missing from the wheel while the editable install still has it.
    for top, under in (("kvtier", "kvtier"), ("backends", "kvtier/backends"), ("policies", "kvtier/policies")):
        for src in sorted((root / top).rglob("*.py")):
            name = f"{under}/{src.relative_to(root / top).as_posix()}"
            assert name in names, f"{name} is not in the wheel (a package missing from pyproject's list?)"
    # A fresh venv that sees the already-installed dependencies (torch etc.) but gets kvtier from the wheel.
    env_dir = tmp_path / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=True)
    py = env_dir / "bin" / "python"
    subprocess.run([str(py), "-m", "pip", "install", "-q", "--no-deps", "--no-index", str(whl)], check=True)
    r = subprocess.run([str(py), "-c", _CHECK], capture_output=True, text=True, cwd=tmp_path)
    assert r.returncode == 0, r.stderr
    assert "wheel ok" in r.stdout
