"""Every subcommand answers --help, and user errors never print a traceback."""

from __future__ import annotations

import subprocess
import sys

import pytest

from kvtier.cli import build_parser


def _subcommands():
    parser = build_parser()
    sub = next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction")
    out = []
    for name, p in sub.choices.items():
        nested = [a for a in p._actions if a.__class__.__name__ == "_SubParsersAction"]
        if nested:
            out += [[name, n] for n in nested[0].choices]
        out.append([name])
    return out


def test_expected_commands_exist():
    names = {" ".join(c) for c in _subcommands()}
    for must in ("keys", "config check", "config schema", "plugins", "bench keys", "bench index",
                 "bench tiers", "bench backends", "bench prefix", "run", "pd", "inspect", "verify", "gc"):
        assert must in names, must


@pytest.mark.parametrize("cmd", _subcommands(), ids=lambda c: " ".join(c))
def test_help(cmd):
    r = subprocess.run([sys.executable, "-m", "kvtier", *cmd, "--help"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "usage: kvtier" in r.stdout


def test_user_error_is_one_line_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvtier", "config", "check", str(tmp_path / "nope.yaml")],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "nope.yaml" in r.stderr
