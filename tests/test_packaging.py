"""A wheel install (not only the editable one) carries the core, backends/, policies/ and configs/, and works
as the README types it: imports, plugin entry points, the embedded default config, the ``kvtier`` command.

The wheel is built once from a copy of the checkout (so no build/ or egg-info lands in the checkout other
engineers use) and installed once into a venv that sees the system's packages (torch, vLLM...) but must
import kvtier from the wheel: the system also has the checkout installed editable, and every check below
first proves it is not that one being imported.
"""

from __future__ import annotations

import importlib.util
import json
import os
import shutil
import subprocess
import sys
import venv
import zipfile
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]

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

# What a user of the installed wheel relies on, printed as JSON for the test to judge.
_AS_TYPED = """
import importlib.metadata as md, json, sys
import kvtier, kvtier.backends, kvtier.configs, kvtier.policies
from kvtier.config import load_config
dist = md.distribution("kvtier")
eps = md.entry_points(group="kvtier.backends")
cfg = load_config(None)
print(json.dumps({
    "prefix": sys.prefix,
    "files": [m.__file__ for m in (kvtier, kvtier.backends, kvtier.configs, kvtier.policies)],
    "dist_at": str(dist.locate_file("")),
    "dist_backends": sorted(ep.name for ep in dist.entry_points if ep.group == "kvtier.backends"),
    "backends_from": {ep.name: str(ep.dist.locate_file("")) for ep in eps if ep.dist is not None},
    "default_backends": [b.type for b in cfg.backends],
    "host_capacity": cfg.host.capacity,
}))
"""


def _clean_env() -> dict[str, str]:
    """The environment without what could point Python at the checkout or change the default config."""
    return {k: v for k, v in os.environ.items() if k != "PYTHONPATH" and not k.startswith("KVTIER_")}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    tmp = tmp_path_factory.mktemp("wheel")
    # The checkout as git sees it (tracked files and new ones not ignored), without caches and build output.
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"], cwd=ROOT,
                            capture_output=True, check=True).stdout.decode().split("\0")
    src = tmp / "src"
    for rel in filter(None, listed):
        if (ROOT / rel).is_file():
            (src / rel).parent.mkdir(parents=True, exist_ok=True)
            shutil.copy2(ROOT / rel, src / rel)
    dist = tmp / "dist"
    # No build isolation: the installed setuptools builds it, with no package index and in seconds.
    if importlib.util.find_spec("build") is not None:
        cmd = [sys.executable, "-m", "build", "--wheel", "--no-isolation", "--skip-dependency-check",
               "--outdir", str(dist), str(src)]
    else:  # an environment installed before `build` joined the test extra
        cmd = [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q",
               "-w", str(dist), str(src)]
    r = subprocess.run(cmd, capture_output=True, text=True, cwd=tmp)
    assert r.returncode == 0, r.stdout[-2000:] + r.stderr[-2000:]
    (whl,) = dist.glob("kvtier-*.whl")
    return whl


@pytest.fixture(scope="module")
def env_dir(wheel: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A fresh venv that sees the already-installed dependencies (torch etc.) with kvtier from the wheel."""
    env_dir = tmp_path_factory.mktemp("venv")
    venv.create(env_dir, system_site_packages=True, with_pip=False)
    # The system's pip, run by the venv's python, installs into the venv.  --ignore-installed rather than
    # --force-reinstall: the kvtier it sees is the system's editable install, which it must not uninstall.
    r = subprocess.run([str(env_dir / "bin" / "python"), "-m", "pip", "install", "-q", "--no-deps",
                        "--no-index", "--ignore-installed", str(wheel)],
                       capture_output=True, text=True, cwd=env_dir, env=_clean_env())
    assert r.returncode == 0, r.stderr[-2000:]
    return env_dir


def test_wheel_carries_every_module(wheel):
    names = zipfile.ZipFile(wheel).namelist()
    for must in ("kvtier/keys/__init__.py", "kvtier/backends/local_disk.py", "kvtier/policies/write.py",
                 "kvtier/configs/local.yaml", "kvtier/py.typed", "kvtier/testing/__init__.py"):
        assert must in names, must
    # Every module of the source tree, not only the ones named above: pyproject lists packages one by one,
    # and a package left off that list is missing from the wheel while the editable install still has it.
    for top, under in (("kvtier", "kvtier"), ("backends", "kvtier/backends"),
                       ("policies", "kvtier/policies")):
        for src in sorted((ROOT / top).rglob("*.py")):
            name = f"{under}/{src.relative_to(ROOT / top).as_posix()}"
            assert name in names, f"{name} is not in the wheel (a package missing from pyproject's list?)"


def test_wheel_install_imports_everything(env_dir, tmp_path):
    r = subprocess.run([str(env_dir / "bin" / "python"), "-c", _CHECK], capture_output=True, text=True,
                       cwd=tmp_path, env=_clean_env())
    assert r.returncode == 0, r.stderr
    assert "wheel ok" in r.stdout


def test_wheel_install_works_as_typed(env_dir, tmp_path):
    r = subprocess.run([str(env_dir / "bin" / "python"), "-c", _AS_TYPED], capture_output=True, text=True,
                       cwd=tmp_path, env=_clean_env())
    assert r.returncode == 0, r.stderr
    got = json.loads(r.stdout)
    site = Path(got["dist_at"]).resolve()
    # The venv's own site-packages won over the checkout's editable install...
    assert Path(got["prefix"]).resolve() == env_dir.resolve() and site.is_relative_to(env_dir.resolve())
    for f in got["files"]:
        assert Path(f).resolve().is_relative_to(site), f"{f} is not the wheel's (editable install imported?)"
        assert not Path(f).resolve().is_relative_to(ROOT), f
    # ... for the plugins too: the built-in backends' entry points are the wheel's distribution's.
    assert got["dist_backends"] == ["local_disk", "redis", "s3"]
    for name in ("local_disk", "redis", "s3"):
        assert Path(got["backends_from"][name]).resolve() == site, (name, got["backends_from"])
    # The embedded default config (configs/local.yaml inside the wheel) loads and validates.
    assert got["default_backends"] == ["local_disk"] and got["host_capacity"] > 0
    # The console script the wheel installs runs, from outside the checkout.
    r = subprocess.run([str(env_dir / "bin" / "kvtier"), "--help"], capture_output=True, text=True,
                       cwd=tmp_path, env=_clean_env(), timeout=60)
    assert r.returncode == 0, r.stderr
    assert "usage: kvtier" in r.stdout and "simulate" in r.stdout
    first = (env_dir / "bin" / "kvtier").read_text().splitlines()[0]
    assert first.startswith("#!") and Path(first[2:].split()[0]).parent == env_dir / "bin", first
