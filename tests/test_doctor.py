"""``kvtier doctor`` finds each defect planted with real parts: a torchvision that fails to import beside this
torch (a package on PYTHONPATH, and one pip installed into a throwaway venv for ``--fix``), vLLM CPU's
VLLM_CPU_KVCACHE_SPACE unset or too large, a YAML with a typo, a Redis port nothing listens on beside a
real redis-server, a server that never answers, and a local disk whose capacity exceeds its filesystem."""

from __future__ import annotations

import os
import re
import socket
import subprocess
import sys
import venv
import zipfile
from pathlib import Path
from typing import Any

import pytest
import yaml

from kvtier.testing.redis_server import free_port, redis_available, start_redis
from kvtier.tools.cli import main
from kvtier.tools.commands import doctor
from kvtier.units import format_size

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
VLLM_LOCAL = str(CONFIGS / "vllm-local.yaml")
MODEL = {"id": "kvtier/doctor-test", "kv_dtype": "float32", "num_layers": 2, "num_kv_heads": 2, "head_dim": 8}
NO_IMPORTS = ("--skip", "imports", "--skip", "companions")  # each child import of vLLM takes 20-40 s here
NMS = "operator torchvision::nms does not exist"


def doctor_cli(capsys, *argv: str) -> tuple[int, list[str]]:
    rc = main(["doctor", *argv])
    out, err = capsys.readouterr()
    assert err == "", err
    return rc, out.splitlines()


def doctor_process(python: str, *argv: str,
                   env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    return subprocess.run([python, "-m", "kvtier", "doctor", *argv], capture_output=True, text=True,
                          timeout=600, env={**os.environ, **(env or {})}, cwd=Path(__file__).parents[1])


def line(lines: list[str], check: str) -> str:
    """The one output line of ``check``."""
    found = [ln for ln in lines if ln[6:].startswith(f"{check}: ")]
    assert len(found) == 1, (check, lines)
    return found[0]


def write_config(tmp_path: Path, doc: dict[str, Any], name: str = "kv.yaml") -> str:
    path = tmp_path / name
    path.write_text(yaml.safe_dump(doc))
    return str(path)


# ----------------------------------------------------------------------------- torchvision beside torch


def fake_torchvision(root: Path) -> Path:
    """A package named torchvision whose import fails as a torchvision built for another torch does."""
    pkg = root / "torchvision"
    pkg.mkdir(parents=True)
    (pkg / "__init__.py").write_text(f"raise RuntimeError({NMS!r})\n")
    return root


def test_broken_torchvision_fails_with_the_fix_named(tmp_path):
    r = doctor_process(sys.executable, "--engine", "none", "--skip", "config",
                       env={"PYTHONPATH": str(fake_torchvision(tmp_path / "site"))})
    assert r.returncode == 2, r.stdout + r.stderr
    lines = r.stdout.splitlines()
    assert line(lines, "torch").startswith("ok    torch: 2.")
    tv = line(lines, "torchvision")
    assert tv.startswith("FAIL  torchvision: torchvision (no version) fails to import beside torch 2.")
    assert f"(torchvision: RuntimeError: {NMS})" in tv
    if doctor._installed("transformers"):  # what the broken import breaks in turn, seen in a child process
        assert f"(torchvision: RuntimeError: {NMS}), and transformers' Llama fails to import with it; " in tv
    assert tv.endswith("; run `kvtier doctor --fix` (uninstalls torchvision, which kvtier and vLLM's text "
                       "models do not need)")
    assert lines[-1] == "doctor: 2 ok, 0 warnings, 1 failure" and "Traceback" not in r.stdout + r.stderr


def fake_wheel(where: Path) -> Path:
    """A wheel of that broken torchvision, with its dist-info, so pip installs (and uninstalls) it."""
    import base64
    import hashlib

    info = "torchvision-0.0.1.dist-info"
    files = {"torchvision/__init__.py": f"raise RuntimeError({NMS!r})\n",
             f"{info}/METADATA": "Metadata-Version: 2.1\nName: torchvision\nVersion: 0.0.1\n",
             f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: kvtier-tests\nRoot-Is-Purelib: true\n"
                              "Tag: py3-none-any\n"}
    wheel = where / "torchvision-0.0.1-py3-none-any.whl"
    record = []
    with zipfile.ZipFile(wheel, "w") as z:
        for name, text in files.items():
            z.writestr(name, text)
            digest = base64.urlsafe_b64encode(hashlib.sha256(text.encode()).digest()).rstrip(b"=").decode()
            record.append(f"{name},sha256={digest},{len(text.encode())}")
        z.writestr(f"{info}/RECORD", "\n".join([*record, f"{info}/RECORD,,"]))
    return wheel


def test_fix_uninstalls_the_broken_one_from_the_doctors_own_environment(tmp_path):
    """--fix runs pip of the interpreter the doctor runs in: here a throwaway venv over the system's packages,
    whose own (broken) torchvision shadows the system's; the system python is never touched."""
    env_dir = tmp_path / "venv"
    venv.create(env_dir, system_site_packages=True, with_pip=False)  # pip: the system's, run by this python
    py = str(env_dir / "bin" / "python")
    constraint = tmp_path / "constraint.txt"
    constraint.write_text("torch==2.13.0\n")
    subprocess.run([py, "-m", "pip", "install", "-q", "--no-index", "--no-deps", "-c", str(constraint),
                    str(fake_wheel(tmp_path))], check=True, capture_output=True, timeout=300)
    site = next(env_dir.glob("lib/python*/site-packages"))
    assert (site / "torchvision-0.0.1.dist-info").is_dir()

    r = doctor_process(py, "--engine", "none", "--skip", "config", "--fix")
    out = r.stdout.splitlines()
    assert out[2].startswith("FAIL  torchvision: torchvision 0.0.1 fails to import beside torch 2."), r.stdout
    assert out[3].startswith("ok    fix: ran `python -m pip uninstall -y torchvision`: exit status 0 (")
    assert "Successfully uninstalled torchvision-0.0.1" in out[3]
    assert not (site / "torchvision").exists() and not (site / "torchvision-0.0.1.dist-info").exists()
    if doctor.importlib.util.find_spec("torchvision") is None:  # nothing below the venv's own copy
        assert out[4] == "ok    torchvision: none of torchvision, torchaudio, torchcodec installed (kvtier " \
                         "and vLLM's text models need none)"
        assert r.returncode == 0, r.stdout + r.stderr


def test_fix_command_is_this_interpreters_pip():
    assert doctor.fix_command(["torchvision", "torchcodec"]) == \
        [sys.executable, "-m", "pip", "uninstall", "-y", "torchvision", "torchcodec"]


# ----------------------------------------------------------------------------- VLLM_CPU_KVCACHE_SPACE


@pytest.fixture
def vllm_cpu():
    if not doctor.vllm_cpu_build():
        pytest.skip("vLLM's CPU build is not installed")
    mem = doctor.memory()
    assert mem is not None
    return mem


def test_kvcache_space_unset(capsys, monkeypatch, vllm_cpu):
    monkeypatch.delenv("VLLM_CPU_KVCACHE_SPACE", raising=False)
    rc, out = doctor_cli(capsys, "--config", VLLM_LOCAL, "--engine", "vllm", *NO_IMPORTS, "--skip",
                         "backends", "--skip", "disk")
    found = line(out, "VLLM_CPU_KVCACHE_SPACE")
    total, avail = vllm_cpu
    if total * doctor.VLLM_MEMORY_FRACTION > avail:  # vLLM's own test at start-up
        assert rc == 2 and found.startswith("FAIL  VLLM_CPU_KVCACHE_SPACE: unset: vLLM CPU then reserves "
                                            "--gpu-memory-utilization (0.92) of all memory, ")
        assert "first start fails with `Available memory on node 0 ... is less than desired CPU memory " \
               "utilization`" in found
    else:
        assert found.startswith("warn  VLLM_CPU_KVCACHE_SPACE: unset: vLLM CPU reserves 0.92 of all memory")
    assert re.search(r"; export VLLM_CPU_KVCACHE_SPACE=\d+ \(GiB of KV cache per vLLM worker\)$", found)


def test_kvcache_space_larger_than_memory(capsys, monkeypatch, vllm_cpu):
    gib = vllm_cpu[1] // 2**30 + 64
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", str(gib))
    rc, out = doctor_cli(capsys, "--config", VLLM_LOCAL, "--engine", "vllm", *NO_IMPORTS, "--skip",
                         "backends", "--skip", "disk")
    assert rc == 2
    assert re.fullmatch(rf"FAIL  VLLM_CPU_KVCACHE_SPACE: {gib} GiB is more than the \S+ available: vLLM "
                        r"CPU's KV cache allocation fails at start-up; "
                        r"export VLLM_CPU_KVCACHE_SPACE=\d+ or less",
                        line(out, "VLLM_CPU_KVCACHE_SPACE"))
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "1")
    rc, out = doctor_cli(capsys, "--config", VLLM_LOCAL, "--engine", "vllm", "--tp", "2",
                         *NO_IMPORTS, "--skip", "backends", "--skip", "disk")
    assert line(out, "VLLM_CPU_KVCACHE_SPACE").startswith("ok    VLLM_CPU_KVCACHE_SPACE: 1 GiB per worker, ")
    assert "2GiB x 2 vLLM workers = 4GiB" in line(out, "host tier")  # each TP worker keeps its own host tier
    monkeypatch.setenv("VLLM_CPU_KVCACHE_SPACE", "4G")
    rc, out = doctor_cli(capsys, "--engine", "vllm", *NO_IMPORTS, "--skip", "config")
    assert rc == 2 and line(out, "VLLM_CPU_KVCACHE_SPACE") == (
        "FAIL  VLLM_CPU_KVCACHE_SPACE: '4G' is not a whole number (vLLM reads GiB as an int); set it to the "
        "GiB of KV cache each vLLM worker keeps, e.g. 4")


# ----------------------------------------------------------------------------- the YAML


def test_engine_yaml_passes_and_a_typo_fails(tmp_path, capsys):
    only_config = (*NO_IMPORTS, "--skip", "kvcache", "--skip", "backends", "--skip", "disk", "--skip",
                   "memory")
    rc, out = doctor_cli(capsys, "--config", VLLM_LOCAL, "--engine", "vllm", *only_config)
    assert rc == 0 and line(out, "config") == (
        f"ok    config: {VLLM_LOCAL}: valid; model: filled by the engine (vllm) at start-up; this file sets "
        "none of them (model.id, which names the namespace, will be the engine's model name)")

    typo = tmp_path / "typo.yaml"
    typo.write_text("host:\n  capacty: 2GiB\nbackends: []\n")
    rc, out = doctor_cli(capsys, "--config", str(typo), *only_config)
    assert rc == 2 and line(out, "config") == (
        f'FAIL  config: {typo}: host.capacty: unknown key; did you mean "capacity"?; fix the file '
        "(`kvtier config check` lists every problem)")

    rc, out = doctor_cli(capsys, "--config", str(tmp_path / "nope.yaml"), *NO_IMPORTS)
    assert rc == 2 and line(out, "config") == (
        f"FAIL  config: {tmp_path / 'nope.yaml'}: cannot read the file: No such file or directory; fix the "
        "file (`kvtier config check` lists every problem)")
    assert not any(ln[6:].startswith(("backend", "host tier")) for ln in out)  # nothing to check them by


# ----------------------------------------------------------------------------- backends


@pytest.fixture(scope="module")
def redis_srv():
    if redis_available():
        pytest.skip(str(redis_available()))
    srv = start_redis()
    yield srv
    srv.cleanup()


def test_backends_reachable_writable_or_named(tmp_path, capsys, redis_srv):
    dead = free_port()
    silent = socket.socket()  # accepts connections (the kernel's backlog) and never answers
    silent.bind(("127.0.0.1", 0))
    silent.listen(8)
    hung = silent.getsockname()[1]
    cfg = write_config(tmp_path, {"model": MODEL, "host": {"capacity": 0}, "backends": [
        {"name": "live", "type": "redis", "options": {"url": redis_srv.url, "timeout_s": 2}},
        {"name": "dead", "type": "redis", "options": {"url": f"redis://127.0.0.1:{dead}/0", "timeout_s": 2}},
        {"name": "hung", "type": "redis", "options": {"url": f"redis://127.0.0.1:{hung}/0",
                                                      "timeout_s": 60}},
        {"name": "reader", "type": "redis", "options": {"url": redis_srv.url}, "write": False},
        {"name": "disk", "type": "local_disk", "options": {"path": str(tmp_path / "blocks"),
                                                           "capacity": "1MiB"}},
        {"name": "fresh", "type": "local_disk", "options": {"path": str(tmp_path / "new" / "blocks"),
                                                            "capacity": "1MiB"}},
    ]})
    (tmp_path / "blocks").mkdir()
    try:
        rc, out = doctor_cli(capsys, "--config", cfg, "--engine", "none", *NO_IMPORTS, "--timeout", "3")
    finally:
        silent.close()
    assert rc == 2
    ms = r"\d+(\.\d)? ms"
    live = re.escape(redis_srv.url.rstrip("/")) + "(/0)?"  # the backend shows its database
    assert re.fullmatch(rf"ok    backend live: redis url={live}: reachable, a lookup in {ms}; "
                        rf"wrote, read back and deleted a 4KiB probe in {ms}", line(out, "backend live"))
    assert line(out, "backend dead").startswith(f"FAIL  backend dead: redis url=redis://127.0.0.1:{dead}/0: "
                                                "a lookup failed: backend 'dead'")
    assert line(out, "backend dead").endswith("; start the service, or fix backends[1].options")
    assert line(out, "backend hung") == (
        f"FAIL  backend hung: redis url=redis://127.0.0.1:{hung}/0: no answer within 3 s; "
        "check the service and the network (--timeout raises the bound)")
    assert re.fullmatch(rf"ok    backend reader: redis url={live}: reachable, a lookup in {ms}; "
                        r"write probe skipped \(write: false\)", line(out, "backend reader"))
    assert re.fullmatch(rf"ok    backend disk: local_disk path={tmp_path / 'blocks'}: reachable, a lookup in "
                        rf"{ms}; wrote, read back and deleted a 4KiB probe in {ms}",
                        line(out, "backend disk"))
    assert line(out, "backend fresh") == (
        f"ok    backend fresh: local_disk path={tmp_path / 'new' / 'blocks'}: does not exist yet; local_disk "
        f"creates it at start-up ({tmp_path} is writable)")
    assert line(out, "host tier") == "ok    host tier: off (host.capacity 0)"
    assert out[-1] == "doctor: 9 ok, 0 warnings, 2 failures"
    # The probes left nothing behind: no key in Redis, no block file or directory on disk.
    import redis

    assert redis.Redis.from_url(redis_srv.url).keys("*") == []
    # (the usage ledger, and the removal journal noting the probe block's delete for other processes)
    assert sorted(p.name for p in (tmp_path / "blocks").iterdir()) == [".kvtier-removed.log", ".kvtier-usage.json"]
    assert not (tmp_path / "new").exists()


def test_local_disk_capacity_beyond_its_filesystem_warns(tmp_path, capsys):
    cfg = write_config(tmp_path, {"model": MODEL, "host": {"capacity": 0}, "backends": [
        {"name": "nvme", "type": "local_disk", "options": {"path": str(tmp_path / "kv"),
                                                           "capacity": "4000TiB"}}]})
    rc, out = doctor_cli(capsys, "--config", cfg, "--engine", "none", *NO_IMPORTS)
    assert rc == 1, out
    assert re.fullmatch(rf"warn  disk space \(nvme\): capacity {format_size(4000 * 2**40)} is more than the "
                        rf"\S+ free on the filesystem of {tmp_path}: writes fail \(disk full\) before kvtier "
                        r"evicts; lower backends\[0\].options.capacity to \S+ or less, or free space",
                        line(out, "disk space (nvme)"))
    assert out[-1] == "doctor: 4 ok, 1 warning, 0 failures"


def test_host_tier_against_memory(tmp_path, capsys):
    total, avail = doctor.memory() or pytest.skip("this host's memory cannot be read")
    big = write_config(tmp_path, {"model": MODEL, "host": {"capacity": avail + 2**30}})
    rc, out = doctor_cli(capsys, "--config", big, "--engine", "none", *NO_IMPORTS)
    assert rc == 2
    over = format_size(avail + 2**30)
    assert line(out, "host tier").startswith(f"FAIL  host tier: {over} is more than the ")
    half = write_config(tmp_path, {"model": MODEL, "host": {"capacity": avail * 3 // 5}})
    rc, out = doctor_cli(capsys, "--config", half, "--engine", "none", *NO_IMPORTS)
    assert line(out, "host tier").startswith("warn  host tier: ")
    rc, out = doctor_cli(capsys, "--config", half, "--engine", "vllm", "--tp", "2", *NO_IMPORTS, "--skip",
                         "kvcache")
    each = format_size(avail * 3 // 5)
    assert line(out, "host tier").startswith(f"FAIL  host tier: {each} x 2 vLLM workers = ")
    rc, out = doctor_cli(capsys, "--config", half, "--engine", "sglang", *NO_IMPORTS)
    assert line(out, "host tier") == ("ok    host tier: not used under SGLang (its --hicache-size / "
                                      "--hicache-ratio size its host memory)")


def test_no_password_is_printed(tmp_path, capsys):
    if redis_available():
        pytest.skip(str(redis_available()))
    secret = "Doct0r-s3cret-9931"
    srv = start_redis(password=secret)
    try:
        wrong = srv.url.replace(secret, secret[::-1])
        cfg = write_config(tmp_path, {"model": MODEL, "host": {"capacity": 0}, "backends": [
            {"name": "good", "type": "redis", "options": {"url": srv.url, "timeout_s": 2}},
            {"name": "wrong", "type": "redis", "options": {"url": wrong, "timeout_s": 2}}]})
        rc, out = doctor_cli(capsys, "--config", cfg, "--engine", "none", *NO_IMPORTS)
    finally:
        srv.cleanup()
    text = "\n".join(out)
    assert rc == 2 and secret not in text and secret[::-1] not in text
    assert line(out, "backend good").startswith("ok    backend good: redis url=redis://")
    assert line(out, "backend wrong").startswith("FAIL  backend wrong: redis url=redis://")
    assert "a lookup failed: " in line(out, "backend wrong") and "WRONGPASS" in line(out, "backend wrong")
