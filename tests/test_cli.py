"""Every subcommand answers --help, and user errors never print a traceback."""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from typing import cast

import pytest

from kvtier.tools.cli import build_parser


def _subcommands():
    parser = build_parser()
    sub = cast("argparse._SubParsersAction[argparse.ArgumentParser]",
               next(a for a in parser._actions if a.__class__.__name__ == "_SubParsersAction"))
    out = []
    for name, p in sub.choices.items():
        nested = [a for a in p._actions if a.__class__.__name__ == "_SubParsersAction"]
        if nested:
            assert nested[0].choices is not None  # a subparsers action: its subcommands
            out += [[name, n] for n in nested[0].choices]
        out.append([name])
    return out


def test_expected_commands_exist():
    names = {" ".join(c) for c in _subcommands()}
    for must in ("keys", "config check", "config schema", "plugins", "bench keys", "bench index",
                 "bench tiers", "bench backends", "bench prefix", "run", "pd", "inspect", "verify", "gc",
                 "doctor"):
        assert must in names, must


@pytest.mark.parametrize("cmd", _subcommands(), ids=lambda c: " ".join(c))
def test_help(cmd, capsys):
    # In process: each `python -m kvtier` costs about 5 s of imports here, and the entry point itself is
    # exercised by the subprocess tests below.
    from kvtier.tools.cli import main

    with pytest.raises(SystemExit) as done:
        main([*cmd, "--help"])
    assert done.value.code == 0
    assert "usage: kvtier" in capsys.readouterr().out


def test_help_through_the_entry_point():
    r = subprocess.run([sys.executable, "-m", "kvtier", "events", "--help"], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert "usage: kvtier events" in r.stdout


def test_help_imports_no_engine_or_torch():
    # `kvtier --help` (and every command's parser) imports each command's module to list it; torch alone
    # took 2-6 s of that here, on every tool invocation and every CLI subprocess of the tests.
    code = ("import sys; from kvtier.tools.cli import build_parser; build_parser(); "
            "print(sorted(m for m in ('torch', 'vllm', 'sglang', 'transformers', 'boto3') if m in sys.modules))")
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert r.returncode == 0, r.stderr
    assert r.stdout.strip() == "[]"


def test_user_error_is_one_line_exit_2(tmp_path):
    r = subprocess.run([sys.executable, "-m", "kvtier", "config", "check", str(tmp_path / "nope.yaml")],
                       capture_output=True, text=True)
    assert r.returncode == 2
    assert "Traceback" not in r.stderr and "nope.yaml" in r.stderr


@pytest.mark.parametrize("argv, message", [
    (["run", "--device-blocks", "0"], "argument --device-blocks: expected an integer >= 1, got '0'"),
    (["run", "--seed", "-1"], "argument --seed: expected an integer >= 0, got '-1'"),
    (["simulate", "--jobs", "-1"], "argument --jobs: expected an integer >= 0, got '-1'"),
    (["simulate", "--seed", "x"], "argument --seed: expected an integer >= 0, got 'x'"),
    (["pd", "--max-new-tokens", "0"], "argument --max-new-tokens: expected an integer >= 1, got '0'"),
    (["config", "schema", "--indent", "-2"], "argument --indent: expected an integer >= 0, got '-2'"),
    (["bench", "index", "--repeats", "0"], "argument --repeats: expected an integer >= 1, got '0'"),
    (["bench", "keys", "--vocab", "0"], "argument --vocab: expected an integer >= 1, got '0'"),
    (["bench", "backends", "--total", "0"], "argument --total: expected a size of at least 1 byte, got '0'"),
    (["bench", "backends", "--block-sizes", "2MiB,0"], "argument --block-sizes: expected a size of at least 1 byte"),
    (["bench", "peers", "--total", "lots"], 'argument --total: expected a size like "4GiB", got "lots"'),
])
def test_numbers_out_of_range_are_refused_naming_the_flag(argv, message, capsys):
    """Before: --device-blocks 0 silently meant the config's size, --jobs -1 one process, and --seed -1
    a numpy traceback."""
    with pytest.raises(SystemExit) as e:
        build_parser().parse_args(argv)
    assert e.value.code == 2 and message in capsys.readouterr().err


@pytest.mark.parametrize("cmd", ["run", "simulate"])
def test_a_device_pool_smaller_than_one_request_is_a_user_error(cmd, tmp_path, capsys):
    """A request needs its whole block table on the device at once: a pool smaller than that is refused
    naming the request, the blocks it needs and the setting (it was a PoolExhausted traceback)."""
    from kvtier.tools.cli import main

    extra = ["--no-progress"] if cmd == "run" else []
    assert main([cmd, "--device-blocks", "2", "--users", "1", "--turns", "1", "--out", str(tmp_path / "o"),
                 *extra]) == 2
    err = capsys.readouterr().err
    assert ("request 1: 576 prompt + 32 new tokens need 38 device blocks of 16 tokens; the device pool has 2 "
            "(device.num_blocks, or --device-blocks)") in err


@pytest.mark.parametrize("argv, message", [
    (["--tokens", "100"], "--tokens 100: the prefix must hold at least one stored value of the largest "
                          "--block-tokens (256 tokens)"),
    (["--block-tokens", "8"], "--block-tokens: each value must be a multiple of the 16-token block, got '8'"),
])
def test_bench_prefix_refuses_a_prefix_it_cannot_measure(argv, message, capsys):
    """A prefix shorter than one stored value was an mmap OSError out of the raw ceiling."""
    from kvtier.tools.cli import main

    assert main(["bench", "prefix", "--backends", "disk", "--repeats", "1", *argv]) == 2
    assert message in capsys.readouterr().err


@pytest.mark.parametrize("second, message", [
    ('{"tokens": [1, 2, 3], "max_new_tokens": "abc"}', "max_new_tokens must be a positive int, got 'abc'"),
    ('{"tokens": [1, -2, 3]}', "tokens[1] = -2: token ids must be non-negative"),
])
def test_pd_requests_errors_name_the_file_line(second, message, tmp_path, capsys):
    """Errors name the line of the requests file (a blank line before it included), whether found while
    reading it or when the request is served; a string max_new_tokens was a TypeError traceback."""
    from kvtier.tools.cli import main

    reqs = tmp_path / "reqs.jsonl"
    reqs.write_text('{"tokens": [1, 2, 3]}\n\n' + second + "\n")
    cfg = tmp_path / "c.yaml"
    cfg.write_text("model: {id: m, num_layers: 1, num_kv_heads: 1, head_dim: 8}\nhost: {capacity: 0}\n"
                   "backends: []\n")
    assert main(["pd", "prefill", "--config", str(cfg), "--requests", str(reqs)]) == 2
    assert f"{reqs}, line 3: {message}" in capsys.readouterr().err


def test_output_paths_are_checked_before_the_work(tmp_path, capsys):
    """An output that cannot be written is refused naming the flag before anything runs (it was a
    FileNotFoundError traceback after the whole workload had run)."""
    from kvtier.tools.cli import main

    a_file = tmp_path / "f"
    a_file.write_text("x")
    for argv, message in (
        (["run", "--record-trace", str(a_file / "t.jsonl")], f"argument --record-trace: '{a_file}/t.jsonl': "
                                                             f"'{a_file}' is not a directory"),
        (["simulate", "--out", str(a_file / "sub")], f"argument --out: '{a_file}/sub': '{a_file}' is not a directory"),
        (["pd", "prefill", "--config", "c.yaml", "--requests", "r.jsonl", "--out", str(tmp_path)],
         f"argument --out: '{tmp_path}' is a directory"),
        (["bench", "index", "--json", str(a_file / "x.json")], "argument --json: "),
    ):
        with pytest.raises(SystemExit):
            build_parser().parse_args(argv)
        assert message in capsys.readouterr().err
    assert build_parser().parse_args(["simulate", "--out", "~/o"]).out == os.path.expanduser("~/o")
    # A file in a directory not made yet is fine: its writer makes the directory (as --record-trace did).
    new = tmp_path / "new" / "sub" / "t.jsonl"
    assert build_parser().parse_args(["run", "--record-trace", str(new)]).record_trace == str(new)
    # What only the system can refuse: the directory is created before the work, and refused there.
    assert main(["simulate", "--out", "/proc/kvtier-test/o", "--users", "1", "--turns", "1"]) == 2
    assert "--out /proc/kvtier-test/o: cannot create the directory" in capsys.readouterr().err
