"""``kvtier bench peers`` without LMCache (CI never installs it): one line saying how to install it and
exit 2; and its pure helpers."""

from __future__ import annotations

import importlib.util
import subprocess
import sys

import pytest

from kvtier.tools.bench import peers


def test_without_lmcache_prints_how_to_install_and_exits_2(monkeypatch, capsys):
    monkeypatch.setattr(importlib.util, "find_spec", lambda name, *a: None if name == "lmcache" else object())
    args = type("A", (), {"stores": "redis", "block_sizes": "256KiB", "total": "1MiB", "repeats": 1,
                          "json": None})()
    assert peers.run(args) == 2
    out = capsys.readouterr().out.strip().splitlines()
    assert len(out) == 1
    assert "lmcache==0.5.6" in out[0] and "venv --system-site-packages" in out[0]
    assert "torch==2.13.0" in out[0] and "kvtier bench peers" in out[0]


@pytest.mark.skipif(importlib.util.find_spec("lmcache") is not None, reason="lmcache is installed here")
def test_cli_without_lmcache_exits_2():
    p = subprocess.run([sys.executable, "-m", "kvtier", "bench", "peers", "--stores", "redis"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 2, p.stderr
    assert p.stdout.count("\n") == 1 and "pip install lmcache==0.5.6" in p.stdout


def test_bench_peers_is_a_registered_command():
    p = subprocess.run([sys.executable, "-m", "kvtier", "bench", "peers", "--help"],
                       capture_output=True, text=True, timeout=120)
    assert p.returncode == 0 and "LMCache" in p.stdout


def test_rotation_puts_everyone_first_equally_often():
    names = ["a", "b", "c"]
    firsts = [peers.rotation(names, r)[0] for r in range(6)]
    assert sorted(firsts) == ["a", "a", "b", "b", "c", "c"]
    assert all(sorted(peers.rotation(names, r)) == names for r in range(6))
    assert peers.rotation([], 3) == []


def test_kv_shape_matches_block_bytes():
    assert peers.kv_shape(2 << 20) == (32, 2, 16, 8, 128)
    assert peers.kv_shape(256 << 10) == (4, 2, 16, 8, 128)
    with pytest.raises(ValueError, match="whole number"):
        peers.kv_shape(100_000)


def test_summarize_medians_drop_the_warmup_and_pick_the_fastest_ceiling():
    times = {"kv": [9.0, 1.0, 2.0, 3.0], "peer": [9.0, 4.0, 4.0, 4.0],
             "wire a": [0.1, 1.0, 1.0, 1.0], "wire b": [9.0, 0.5, 0.5, 0.5]}
    (row,) = peers.summarize("redis", "get", 1 << 20, 1.0, times, "kv", ["peer"], ["wire a", "wire b"])
    assert row["kvtier_gib_s"] == pytest.approx(0.5) and row["peer_gib_s"] == pytest.approx(0.25)
    assert row["ratio"] == pytest.approx(2.0)
    assert row["ratio_rounds"] == pytest.approx([4.0, 2.0, 4 / 3]) and row["ratio_spread"] == "1.33-4.00"
    assert row["ceiling"] == "wire b" and row["ceiling_gib_s"] == pytest.approx(2.0)
    assert row["kvtier_vs_ceiling"] == pytest.approx(0.25)
    (bare,) = peers.summarize("s3", "put", 1 << 20, 1.0, times, "kv", ["peer"], [])
    assert "ceiling_gib_s" not in bare


def test_fmt_block():
    assert [peers.fmt_block(n) for n in (2 << 20, 256 << 10, 1000)] == ["2MiB", "256KiB", "1000B"]


def test_drop_page_cache_walks_files(tmp_path):
    (tmp_path / "d").mkdir()
    for name in ("a", "d/b"):
        (tmp_path / name).write_bytes(b"x" * 4096)
    assert peers.drop_page_cache(str(tmp_path)) == 2
