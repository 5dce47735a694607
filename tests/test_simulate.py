"""``kvtier simulate``: its hit rates against real ``kvtier run`` runs, the grid, traces, outputs."""

from __future__ import annotations

import json
from importlib import resources

import numpy as np
import pyarrow.parquet as pq
import pytest
import yaml

from kvtier.config import ConfigError, load_config
from kvtier.simulate import LedgerBackend, simulate
from kvtier.simulate.grid import grid_points, parse_axes
from kvtier.tools.cli import main
from kvtier.workload import ChatWorkload, iter_trace


def _config(tmp_path, *, host: str, disk: str, write: str, block_tokens: int | None = None,
            promote: bool = True, second_disk: str | None = None, write_options: dict[str, object] | None = None) -> str:
    d = yaml.safe_load(resources.files("kvtier.configs").joinpath("local.yaml").read_text())
    d["device"]["kind"] = "cpu"
    d["host"]["capacity"] = host
    d["host"]["promote_loads"] = promote
    d["backends"][0]["options"] = {"path": str(tmp_path / "disk"), "capacity": disk}
    if second_disk is not None:  # a second, larger disk tier under the first (both written)
        d["backends"].append({"name": "disk_b", "type": "local_disk",
                              "options": {"path": str(tmp_path / "disk_b"), "capacity": second_disk}})
    d["policies"]["write"]["name"] = write
    if write_options is not None:
        d["policies"]["write"]["options"] = write_options
    d["storage"] = {"block_tokens": block_tokens}
    path = tmp_path / "c.yaml"
    path.write_text(yaml.safe_dump(d))
    return str(path)


def _real_hit_rates(out) -> dict[str, float]:
    """Per-tier hit rates (% of prompt blocks) from a ``kvtier run``'s requests.parquet."""
    t = pq.read_table(out / "requests.parquet").to_pydict()
    blocks = sum(t["prompt_blocks"])
    rates = {"device": 100 * sum(t["device_blocks"]) / blocks}
    for col in t:
        if col.endswith("_blocks") and col not in ("prompt_blocks", "failed_blocks", "stored_blocks",
                                                    "device_blocks"):
            rates[col[:-7]] = 100 * sum(t[col]) / blocks
    return rates


def _sim_rates(res) -> dict[str, float]:
    return {t: 100 * res.hit_rate(t) for t in res.tiers}


def _assert_close(real: dict[str, float], sim: dict[str, float]) -> None:
    for tier in set(real) | set(sim):
        assert abs(real.get(tier, 0.0) - sim.get(tier, 0.0)) <= 1.0, (tier, real, sim)


CHAT = dict(users=12, turns=4)


@pytest.mark.parametrize("host,write,block_tokens,promote,extra", [
    ("6MiB", "write_through", None, True, {}),
    ("0", "write_through_selective", None, True, {}),
    ("6MiB", "write_through", 64, True, {}),
    ("6MiB", "write_back", 64, True, {}),
    ("6MiB", "write_through", None, False, {}),
    ("6MiB", "write_through", 64, False, {}),
    ("2MiB", "write_back", None, False, {"second_disk": "48MiB"}),
    ("6MiB", "write_through_selective", 64, True, {"write_options": {"threshold": 1}}),
])
def test_simulated_hit_rates_match_a_real_run_of_the_chat(tmp_path, host, write, block_tokens, promote, extra):
    # Small tiers, so that every tier serves hits and both the host and the disk evict; no host tier at
    # all (stores go straight to the disk); stored values of 4 blocks (storage.block_tokens); loads from
    # the disk read straight into the CPU KV tensors, out of host memory (host.promote_loads false), one
    # block a value or 4; two disks under a host tier smaller than one turn, written back; and selective
    # writes of 4-block values.
    cfg = _config(tmp_path, host=host, disk="12MiB", write=write, block_tokens=block_tokens, promote=promote,
                  **extra)
    disks = ["local_disk", "disk_b"] if "second_disk" in extra else ["local_disk"]
    out = tmp_path / "run"
    assert main(["run", "--config", cfg, "--no-progress", "--wait-writes", "--device-blocks", "96", "--users", "12",
                 "--turns", "4", "--out", str(out), "--record-trace", str(out / "trace.jsonl")]) == 0
    real = _real_hit_rates(out)
    assert real["device"] > 0 and all(real.get(d, 0) > 0 for d in disks)
    assert real.get("host", 0) > 0 if host not in ("0", "2MiB") else real.get("host", 0) == 0
    config = load_config(cfg, env={})
    sim = simulate(config, ChatWorkload(**CHAT), device_blocks=96)
    # The run reports every tier, one that served nothing too (a column of zeros, not a missing one).
    assert {f"{t}_blocks" for t in sim.tiers} <= set(pq.read_table(out / "requests.parquet").column_names)
    # Every tier evicts, but the disk behind host memory under selective writes: few values go down.
    fills_disk = write != "write_through_selective" or host == "0"
    assert sim.written["local_disk"] > 0 and (sim.evicted["local_disk"] > 0 or not fills_disk)
    assert sim.evicted["host"] > 0 if host != "0" else "host" not in sim.tiers
    _assert_close(real, _sim_rates(sim))
    # The recorded trace (the model's own answers in the prompts) replays to the same figures.
    rec = simulate(config, iter_trace(out / "trace.jsonl"), device_blocks=96)
    _assert_close(real, _sim_rates(rec))
    assert rec.requests == sim.requests == 48
    assert rec.prompt_blocks == sim.prompt_blocks


def test_simulated_hit_rates_match_a_real_run_of_another_trace(tmp_path):
    # A different shape: independent prompts sharing one of four prefixes, under write-back.
    rng = np.random.default_rng(1)
    rows = [{"t": i * 0.5, "length": int(rng.integers(200, 700)), "prefix_id": int(rng.integers(0, 4)),
             "prefix_length": int(rng.choice([160, 320, 480]))} for i in range(40)]
    trace = tmp_path / "trace.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    cfg = _config(tmp_path, host="6MiB", disk="12MiB", write="write_back")
    out = tmp_path / "run"
    assert main(["run", "--config", cfg, "--no-progress", "--wait-writes", "--device-blocks", "96", "--trace", str(trace),
                 "--out", str(out)]) == 0
    real = _real_hit_rates(out)
    assert real["device"] > 0 and real.get("local_disk", 0) > 0
    sim = simulate(load_config(cfg, env={}), iter_trace(trace), device_blocks=96)
    _assert_close(real, _sim_rates(sim))
    # write-back: what reaches the disk is what host memory evicted, never more than the host took in
    assert 0 < sim.written["local_disk"] <= sim.written["host"]


def test_hashed_trace_simulates_like_its_token_trace(tmp_path):
    config = load_config(_config(tmp_path, host="4MiB", disk="8MiB", write="write_through"), env={})
    hasher = config.namespace().hasher()
    rng = np.random.default_rng(3)
    shared = rng.integers(0, 2048, 300).tolist()
    toks = [shared[: int(rng.integers(100, 300))] + rng.integers(0, 2048, int(rng.integers(20, 200))).tolist()
            for _ in range(30)]
    a, b = tmp_path / "tokens.jsonl", tmp_path / "hashes.jsonl"
    a.write_text("".join(json.dumps({"t": i, "tokens": t}) + "\n" for i, t in enumerate(toks)))
    b.write_text("".join(json.dumps({"t": i, "num_tokens": len(t), "hashes": [h.hex() for h in
                                                                             hasher.hash_blocks(t)]}) + "\n"
                         for i, t in enumerate(toks)))
    ra, rb = simulate(config, iter_trace(a)), simulate(config, iter_trace(b))
    assert ra.hit_blocks == rb.hit_blocks and ra.prompt_blocks == rb.prompt_blocks
    assert sum(ra.hit_blocks.values()) > 0


def test_a_trace_hashed_once_simulates_exactly_like_the_trace(tmp_path):
    """What a grid's workers replay (the trace hashed once in the parent) gives every figure the trace
    itself gives: token rows with a salt, length rows sharing a prefix, hashes rows, a prompt shorter
    than a block, rows without a time."""
    from dataclasses import asdict

    from kvtier.simulate.hashed import hash_trace, iter_hashed

    config = load_config(_config(tmp_path, host="2MiB", disk="4MiB", write="write_back"), env={})
    hasher = config.namespace().hasher()
    rng = np.random.default_rng(5)
    shared = rng.integers(0, 2048, 256).tolist()
    rows = []
    for i in range(60):
        kind = i % 4
        if kind == 0:
            rows.append({"t": i * 0.1, "tokens": shared + rng.integers(0, 2048, 40).tolist(), "cache_salt": "a"})
        elif kind == 1:
            rows.append({"t": i * 0.1, "length": 300, "prefix_id": i % 3, "prefix_length": 200, "max_new_tokens": 8})
        elif kind == 2:
            rows.append({"num_tokens": 250, "hashes": [h.hex() for h in hasher.hash_blocks(shared[:250])]})
        else:
            rows.append({"tokens": [1, 2, 3]})
    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps(r) + "\n" for r in rows))
    n, _ = hash_trace(iter_trace(trace), hasher, tmp_path / "t.bin")
    assert n == 60
    direct = asdict(simulate(config, iter_trace(trace), device_blocks=24))
    replayed = asdict(simulate(config, iter_hashed(tmp_path / "t.bin"), device_blocks=24))
    for timing in ("sim_s", "hash_s"):
        direct.pop(timing), replayed.pop(timing)
    assert replayed == direct
    assert direct["hit_blocks"]["local_disk"] > 0 and direct["evicted"]["host"] > 0


def test_a_grid_hashes_its_trace_once_per_way_of_keying_blocks(tmp_path):
    import argparse

    from kvtier.tools.commands.simulate import _hash_once

    trace = tmp_path / "t.jsonl"
    trace.write_text("".join(json.dumps({"length": 100 + i}) + "\n" for i in range(5)))
    args = argparse.Namespace(trace=str(trace), seed=0)
    same = grid_points(None, parse_axes(["host.capacity=1MiB,4MiB,8MiB"]), env={})
    files, _ = _hash_once(args, same, tmp_path)
    assert len(set(files)) == 1 and files[0] is not None
    seeds = grid_points(None, parse_axes(["keys.seed=1,2", "host.capacity=1MiB,4MiB"]), env={})
    files, _ = _hash_once(args, seeds, tmp_path)
    assert len(set(files)) == 2 and files[0] == files[1] != files[2] == files[3]


def test_kvtier_run_refuses_hashed_rows(tmp_path, capsys):
    b = tmp_path / "hashes.jsonl"
    b.write_text(json.dumps({"hashes": ["00" * 32]}) + "\n")
    assert main(["run", "--trace", str(b), "--no-progress", "--out", str(tmp_path / "o")]) == 2
    assert "trace row 1: 'hashes' rows can only be simulated" in capsys.readouterr().err


def test_grid_points_and_errors_name_the_grid_argument(tmp_path):
    axes = parse_axes(["host.capacity=1MiB,4MiB", "policies.write.name=write_through,write_back"])
    points = grid_points(None, axes, env={})
    assert [p.values for p in points][:2] == [
        {"host.capacity": "1MiB", "policies.write.name": "write_through"},
        {"host.capacity": "1MiB", "policies.write.name": "write_back"}]
    assert [int(p.config.host.capacity) for p in points] == [2**20] * 2 + [4 * 2**20] * 2
    assert points[1].config.policies.write.name == "write_back"
    with pytest.raises(ConfigError, match=r'--grid host.capacty: host has no key "capacty"; did you mean "capacity"'):
        grid_points(None, parse_axes(["host.capacty=1GiB"]), env={})
    with pytest.raises(ConfigError, match=r"backends\[0\].options.capacity.*--grid backends\[0\].options.capacity"):
        grid_points(None, parse_axes(["backends[0].options.capacity=lots"]), env={})
    with pytest.raises(ConfigError, match=r"policies.write.name.*no_such_policy"):
        grid_points(None, parse_axes(["policies.write.name=no_such_policy"]), env={})
    for bad in ("host.capacity", "host.capacity=", "=1GiB", "host..capacity=1GiB", "host.capacity=1GiB,"):
        with pytest.raises(ValueError, match="--grid"):
            parse_axes([bad])
    with pytest.raises(ValueError, match="given twice"):
        parse_axes(["host.capacity=1GiB", "host.capacity=2GiB"])


def test_cli_writes_table_parquet_and_plot(tmp_path, capsys, monkeypatch):
    monkeypatch.setenv("KVTIER_BACKENDS__0__OPTIONS__PATH", str(tmp_path / "unused"))
    out = tmp_path / "sim"
    assert main(["simulate", "--grid", "host.capacity=1MiB,8MiB,64MiB", "--grid",
                 "policies.write.name=write_through,write_back", "--users", "16", "--turns", "4",
                 "--jobs", "2", "--out", str(out)]) == 0
    text = capsys.readouterr().out
    assert "6 grid point(s) x 64 requests" in text and "hit% host" in text
    assert "raw ceiling, same prompt keys through a bare OrderedDict LRU in this run" in text
    t = pq.read_table(out / "simulate.parquet").to_pydict()
    assert len(t["host.capacity"]) == 6
    # More host memory never serves fewer blocks from host memory (same policy), and serves more here.
    for pol in ("write_through", "write_back"):
        host = [h for h, p in zip(t["hit_pct_host"], t["policies.write.name"]) if p == pol]
        assert host == sorted(host) and host[-1] > host[0]
    assert (out / "hit_rate.png").read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    assert not (tmp_path / "unused").exists()  # a simulation writes nothing to the backends


def test_cli_errors(tmp_path, capsys):
    assert main(["simulate", "--trace", str(tmp_path / "nope.jsonl")]) == 2
    assert "no such file" in capsys.readouterr().err
    bad = tmp_path / "bad.jsonl"
    bad.write_text('{"tokens": [1, 2, 3]}\n{"tokens": [1, "x"]}\n')
    assert main(["simulate", "--trace", str(bad), "--out", str(tmp_path / "o"), "--jobs", "1"]) == 2
    assert "row 2: tokens must be a list of ints" in capsys.readouterr().err
    assert main(["simulate", "--grid", "host.capacity:1GiB"]) == 2
    assert "expected PATH=V1,V2" in capsys.readouterr().err


def test_trace_is_read_lazily(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text('{"tokens": [1, 2, 3], "t": 0.5}\n' + "not json\n")
    it = iter_trace(p)
    first = next(it)  # the bad second line is not read yet
    assert first.tokens == [1, 2, 3] and first.t == 0.5
    with pytest.raises(ValueError, match="line 2: invalid JSON"):
        next(it)


def test_ledger_evicts_least_recently_used_and_refuses_oversized():
    led = LedgerBackend(name="disk", value_nbytes=100, capacity=300)
    assert led.record_put(["a", "b", "c"]) == [True] * 3
    assert led.record_get(["a", "zz"]) == [True, False]  # a is now the most recent
    led.record_put(["d"])
    assert led.contains_prefix(["a"]) == 1 and led.contains_prefix(["b"]) == 0 and led.evictions == 1
    assert led.contains_prefix(["c", "d", "a"]) == 3
    tiny = LedgerBackend(name="tiny", value_nbytes=100, capacity=50)
    assert tiny.record_put(["x"]) == [False] and tiny.refused == 1


def test_ledger_never_evicts_a_held_value_as_local_disk_never_evicts_one_being_read():
    led = LedgerBackend(name="disk", value_nbytes=100, capacity=200)
    led.record_put(["a", "b"])
    led.hold(["a"])
    led.hold(["a"])  # counted: two loads read it
    assert led.record_put(["c"]) == [True] and led.contains_prefix(["a", "c"]) == 2  # b went, not a
    led.hold(["c"])
    assert led.record_put(["d"]) == [False] and led.refused == 1  # only held values left: refused
    led.release(["a", "c"])  # a is still held once, c no longer
    assert led.record_put(["d"]) == [True] and led.contains_prefix(["a", "d"]) == 2 and led.evictions == 2
    led.release(["a"])
    assert led.record_put(["e"]) == [True] and led.contains_prefix(["a"]) == 0 and led.evictions == 3


@pytest.mark.parametrize("row,message", [
    ({"hashes": ["zz"]}, "row 1: hashes\\[0\\]: expected a hex string, got 'zz'"),
    ({"hashes": []}, "row 1: hashes must be a non-empty list of hex strings"),
    ({"tokens": [1, 2], "t": -1}, "row 1: t must be a number of seconds >= 0, got -1"),
    ({"hashes": ["00" * 32], "num_tokens": 0}, "row 1: num_tokens must be a positive int, got 0"),
    ({"tokens": [1], "tenant": "x"}, "row 1: unknown field\\(s\\) \\['tenant'\\]"),
    ({"t": 1.0}, "row 1: needs 'tokens', 'length' or 'hashes'"),
    ({"tokens": [1, 2], "max_new_tokens": -1}, "row 1: max_new_tokens must be a positive int, got -1"),
    ({"tokens": [1, 2], "max_new_tokens": 0}, "row 1: max_new_tokens must be a positive int, got 0"),
    ({"tokens": [1, 2], "max_new_tokens": "8"}, "row 1: max_new_tokens must be a positive int, got '8'"),
    ({"length": 40, "prefix_id": 1, "prefix_length": -3}, "row 1: prefix_length must be an int >= 0, got -3"),
    ({"length": 40, "prefix_id": [1]}, "row 1: prefix_id must be a string or an int, got \\[1\\]"),
    ({"length": 1.5}, "row 1: length must be a positive int, got 1.5"),
    ({"tokens": [1, 2], "cache_salt": 5}, "row 1: cache_salt: expected a non-empty string, got 5"),
    ({"tokens": [1, 2], "lora": {"a": 1}}, "row 1: lora: expected \\{name, path\\}"),
    ({"tokens": [1, 2], "lora": "adapter"}, "row 1: lora: expected \\{name, path\\} or \\[name, path\\]"),
    ({"tokens": [1, 2], "mm": [{"identifier": "im", "offset": 1, "length": 4}]},
     "row 1: mm\\[0\\] \\('im'\\) covers tokens \\[1, 5\\) but the sequence has 2 tokens"),
])
def test_trace_rows_are_refused_naming_row_and_field(tmp_path, row, message):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps(row) + "\n")
    with pytest.raises(ValueError, match=message):
        list(iter_trace(p))


def test_simulate_refuses_hashes_of_another_algorithm_and_a_host_tier_too_small(tmp_path):
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"hashes": ["00" * 16]}) + "\n")
    config = load_config(None, env={})
    with pytest.raises(ValueError, match="trace row 1: hashes are 16 bytes, keys.algo sha256_cbor makes 32"):
        simulate(config, iter_trace(p))
    p.write_text(json.dumps({"hashes": ["00" * 32] * 2, "num_tokens": 31}) + "\n")
    with pytest.raises(ValueError, match="trace row 1: 2 block hashes for num_tokens 31 "
                                         "\\(at most 1 full blocks of 16 tokens\\)"):
        simulate(config, iter_trace(p))
    small = load_config(None, env={"KVTIER_HOST__CAPACITY": "1KiB"})
    with pytest.raises(ValueError, match="host.capacity: 1024 B holds no block of 65536 B"):
        simulate(small, iter_trace(p))


def test_a_grid_refuses_hashes_of_another_algorithm_before_any_point_runs(tmp_path, capsys):
    """With several points the trace is hashed once in the parent: the same error, before any worker."""
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"hashes": ["00" * 32]}) + "\n" + json.dumps({"hashes": ["00" * 16]}) + "\n")
    assert main(["simulate", "--trace", str(p), "--grid", "host.capacity=1GiB,2GiB", "--jobs", "1",
                 "--out", str(tmp_path / "o")]) == 2
    assert "trace row 2: hashes are 16 bytes, keys.algo sha256_cbor makes 32" in capsys.readouterr().err


def test_a_trace_without_a_full_prompt_block_is_simulated_and_reported(tmp_path, capsys):
    """Nothing to look up (every prompt shorter than a block): a table of zeros, and no ceiling line
    (nothing was timed; its ratio would divide by zero)."""
    p = tmp_path / "t.jsonl"
    p.write_text(json.dumps({"t": 0, "tokens": [1, 2, 3]}) + "\n")
    assert main(["simulate", "--trace", str(p), "--out", str(tmp_path / "o")]) == 0
    out = capsys.readouterr().out
    assert "1 requests (0 prompt blocks" in out and "raw ceiling" not in out
    assert (tmp_path / "o" / "simulate.parquet").is_file()


def test_cli_refuses_a_rate_that_is_not_positive(capsys):
    assert main(["simulate", "--rate", "0"]) == 2
    assert "--rate: expected > 0, got 0.0" in capsys.readouterr().err



def test_null_model_draws_the_stream_one_call_a_request_would():
    """NullModel reads its answers from values drawn ahead in bulk: the tokens must be exactly those of
    one draw per request from the same seed (a simulation's chat, and its figures, are unchanged)."""
    from kvtier.simulate.replay import NullModel

    model, rng = NullModel(16, vocab_size=500, seed=3), np.random.default_rng(3)
    sizes = [32, 0, 1, 70_000, 17, 65_536, 5]  # across a refill, one bigger than a refill, and empty
    for n in sizes:
        assert model.generate([], [], 0, n)[0] == rng.integers(0, 500, n).tolist()


def test_bare_lru_is_a_least_recently_used_cache_and_counts_two_ops_a_key():
    from collections import OrderedDict

    from kvtier.simulate.replay import bare_lru

    cache: OrderedDict[bytes, None] = OrderedDict()
    assert bare_lru(cache, 2, [b"a", b"b", b"a", b"c"]) == 8
    assert list(cache) == [b"a", b"c"]  # b, least recently used when c came, went
    bare_lru(cache, 2, [b"a", b"d"])
    assert list(cache) == [b"a", b"d"]


def test_the_ceiling_times_the_same_prompt_keys_and_changes_no_result(tmp_path):
    """``ceiling=True`` runs the bare LRU over every request's prompt keys (two ops a block), timed apart
    from the replay, whose figures stay those of a run without it."""
    from dataclasses import asdict

    config = load_config(_config(tmp_path, host="1MiB", disk="4MiB", write="write_back"))
    plain = asdict(simulate(config, ChatWorkload(8, 3, 64, 16, 16, seed=1), device_blocks=24))
    res = simulate(config, ChatWorkload(8, 3, 64, 16, 16, seed=1), device_blocks=24, ceiling=True)
    assert res.ceiling_ops == 2 * res.prompt_blocks > 0 and res.ceiling_s > 0
    assert res.ceiling_ops_per_s == res.ceiling_ops / res.ceiling_s
    timed = asdict(res)
    for k in ("sim_s", "hash_s", "ceiling_ops", "ceiling_s"):
        timed.pop(k), plain.pop(k)
    assert timed == plain
    assert plain["hit_blocks"]["local_disk"] > 0  # the chat reached every tier


def test_a_request_the_pool_cannot_hold_takes_no_block_with_it():
    """The engine refuses a request larger than the whole device pool before touching it, and one that
    finds too few blocks free (others in flight) gives back the references its prefix hit took."""
    from kvtier.integrations.engine import CachedEngine
    from kvtier.memory.blockpool import BlockPool, PoolExhausted
    from kvtier.simulate.ledger_stack import SimulatedStack
    from kvtier.simulate.replay import NullModel, block_nbytes

    config = load_config(None, env={})
    stack = SimulatedStack(config, block_nbytes(config))
    pool = BlockPool(8, on_evict=lambda keys, ids: stack.on_device_freed(ids))
    engine = CachedEngine(stack, NullModel(16), pool)  # type: ignore[arg-type]
    prompt = list(range(64))  # 4 full blocks; with 16 new tokens a request needs 5 blocks
    engine.run_request(prompt, max_new_tokens=16)
    assert pool.num_free == 8 and pool.num_cached == 4
    with pytest.raises(ValueError, match="64 prompt \\+ 200 new tokens need 17 device blocks of 16 tokens; "
                                         "the device pool has 8"):
        engine.run_request(prompt, max_new_tokens=200)
    assert pool.num_free == 8
    held = pool.allocate(4)  # another request in flight: 4 left, the 4 cached ones; the next request hits
    # those 4 and needs 4 more (7 prompt blocks + 1 for its new tokens)
    with pytest.raises(PoolExhausted):
        engine.run_request(prompt + list(range(48)), max_new_tokens=16)
    assert pool.num_free == 4 and all(pool.ref_count(b) == 0 for b in range(8) if b not in held)
    pool.free(held)
    stack.close()
