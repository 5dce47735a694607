"""Hybrid models through kvtier inside a real vLLM (CPU build), with vLLM's hybrid KV cache manager on.

Two models built locally with seeded random weights (kvtier.testing.hybrid_models): ``swa``, Gemma-3-shaped
(three sliding-window layers, window 128, one full attention layer; block size 32), and ``gdn``,
Qwen3-Next-shaped (three gated-delta-net layers, one full attention layer; vLLM makes its block size 96).
Each KV cache group is its own stream of stored values (kvtier.integrations.vllm.groups).

Prompts: A = 300 tokens, B = A's first 200 tokens + 100 others.  Every run prefills in chunks of 96
tokens (``max_num_batched_tokens``), so the GDN model's state exists at 96, 192 and 288 tokens: vLLM is
not bitwise invariant to how a prefix was computed (a GDN state computed over one 288-token chunk and one
over three 96-token chunks differ in the last bits), so every run computes its prefixes alike.

A prefill instance (``kv_producer``) runs [A, A, B] and writes local_disk and Redis: its second A is a hit
in vLLM's own prefix cache, the exact reference for a decode that loads A; its B (computed over what vLLM's
own cache kept of A, which differs by model) is B's reference, to within vLLM's cached-vs-fresh noise.
Before a decode instance (``kv_consumer``) runs [A, B] over one backend, B's own blocks (those it does not
share with A) are deleted from that backend: A loads 288 tokens (9 blocks of 32 / 3 of 96), B resumes at
192, the last block boundary both prompts share, where every group is stored.
"""

from __future__ import annotations

import re
import shutil
from pathlib import Path
from typing import Any

import pytest
from test_vllm import (
    A,
    assert_close_outputs,
    assert_same_outputs,
    block_files,
    damage_block,
    run_vllm,
)

from kvtier.keys import BlockHasher
from kvtier.testing.hybrid_models import BUILDERS, GDN_BLOCK_SIZE

B = A[:200] + [(7 * i) % 499 + 1 for i in range(100)]
CHUNK = 96  # tokens vLLM prefills per step in every run here

# model -> (block size, groups as (kind, layers)), A's and B's hit in tokens, blocks each group loads for A / B
MODELS: dict[str, dict[str, Any]] = {
    "swa": {"bs": 32, "kinds": ["sliding_window", "sliding_window", "sliding_window", "full"],
            # a 128-token window: vLLM needs cdiv(127, 32) = 4 blocks before the hit; full attention all of them
            "loads_A": [4, 4, 4, 9], "loads_B": [4, 4, 4, 6]},
    "gdn": {"bs": GDN_BLOCK_SIZE, "kinds": ["state", "state", "state", "full"],
            "loads_A": [1, 1, 1, 3], "loads_B": [1, 1, 1, 2]},
}


def hybrid_config(*backends: dict[str, Any]) -> dict[str, Any]:
    return {"keys": {"algo": "sha256_cbor"}, "host": {"capacity": "32MiB"}, "backends": list(backends)}


def disk(path: Path) -> dict[str, Any]:
    return {"name": "disk", "type": "local_disk", "options": {"path": str(path), "capacity": "1GiB"}}


def redis(url: str) -> dict[str, Any]:
    return {"name": "redis", "type": "redis", "options": {"url": url}}


def namespaces(log: str) -> list[str]:
    """The namespace of each KV cache group, in vLLM's group order (the scheduler side's start-up line)."""
    m = re.search(r"kvtier: scheduler side up \(.*\), namespace ([0-9a-f, ]+), load_mode", log)
    assert m, log[-3000:]
    return m.group(1).split(", ")


def loaded_blocks(log: str) -> list[int]:
    """Blocks each of the run's group loads delivered, in the order the worker logged them."""
    return [int(n) for n in re.findall(r"request \S+: (\d+) blocks loaded", log)]


def run(model: dict[str, Any], tmp: Path, role: str, prompts: list[list[int]], config: dict[str, Any]) -> dict[str, Any]:
    return run_vllm(model["dir"], tmp, role, prompts, config, max_batched_tokens=CHUNK)


@pytest.fixture(scope="module", params=sorted(MODELS))
def model(request, tmp_path_factory) -> dict[str, Any]:
    name = request.param
    return {**MODELS[name], "name": name, "dir": BUILDERS[name](tmp_path_factory.mktemp(f"model-{name}"))}


@pytest.fixture(scope="module")
def prefilled(model, module_redis_server, tmp_path_factory) -> dict[str, Any]:
    """The prefill instance's run of [A, A, B] over local_disk and Redis (both written)."""
    tmp = tmp_path_factory.mktemp(f"prefill-{model['name']}")
    module_redis_server.flushall()
    got = run(model, tmp, "kv_producer", [A, A, B], hybrid_config(disk(tmp / "blocks"), redis(module_redis_server.url)))
    return {**got, "disk": tmp / "blocks", "redis": module_redis_server}


def b_only(model: dict[str, Any]) -> list[str]:
    """The block hashes (hex) of B's blocks after the 200 tokens it shares with A."""
    b = BlockHasher(model["bs"], "sha256_cbor", seed="0").hash_blocks(B)
    return [h.hex() for h in b[200 // model["bs"]:]]


def decode_disk(model: dict[str, Any], prefilled: dict[str, Any], tmp: Path) -> Path:
    """A copy of the prefill's local_disk directory without B's own blocks."""
    d = tmp / "blocks"
    shutil.copytree(prefilled["disk"], d)
    gone = set(b_only(model))
    for ns in namespaces(prefilled["log"]):
        for name, path in block_files(d / ns).items():
            if name in gone:
                path.unlink()
    return d


def test_prefill_stores_every_group_and_vllm_keeps_its_hybrid_manager(model, prefilled):
    log = prefilled["log"]
    assert "Turning off hybrid kv cache manager" not in log
    assert f"kvtier: vLLM's hybrid KV cache manager is on: {len(model['kinds'])} KV cache groups" in log
    assert [r["cached"] for r in prefilled["results"]][:2] == [0, 288]
    hasher = BlockHasher(model["bs"], "sha256_cbor", seed="0")
    a, b = hasher.hash_blocks(A), hasher.hash_blocks(B)
    for ns, kind in zip(namespaces(log), model["kinds"]):
        stored = set(block_files(prefilled["disk"] / ns))
        if kind == "state":
            # the state at every block boundary a prefill step ended on: A's 96, 192, 288, and B's 288
            # (B computed from 0, or from a boundary vLLM kept, in steps of 96)
            want = {h.hex() for h in a if h in a[:3 * 96 // model["bs"]]} | {b[-1].hex()}
            assert len(want) == 4
            assert stored >= want and stored <= want | {h.hex() for h in b}, (kind, ns)
        else:
            # every full block of both, the sliding window's included (a hit may land on any)
            assert stored == {h.hex() for h in a + b}, (kind, ns)


@pytest.mark.parametrize("backend", ["disk", "redis"])
def test_decode_loads_every_group_and_equals_vllms_own_cache(model, prefilled, tmp_path, backend):
    if backend == "disk":
        cfg = hybrid_config(disk(decode_disk(model, prefilled, tmp_path)))
    else:
        srv = prefilled["redis"]
        for ns in namespaces(prefilled["log"]):
            for h in b_only(model):
                assert srv.cli("DEL", f"kvtier:{ns}/{h}").strip() == "1"  # the backend's default key_prefix
        cfg = hybrid_config(redis(srv.url))
    got = run(model, tmp_path, "kv_consumer", [A, B], cfg)
    assert "Turning off hybrid kv cache manager" not in got["log"]
    # A: its 288 loadable tokens; B: the 192 it shares with A (the last boundary where every group is stored)
    assert [r["cached"] for r in got["results"]] == [288, 192]
    # Exactly the offered prefix, group by group: the window's blocks of a sliding window group, one state
    # of a state group, every block of the full attention group (each group's load logs its own line).
    loads = loaded_blocks(got["log"])
    assert sorted(loads) == sorted(model["loads_A"] + model["loads_B"]), got["log"][-3000:]
    assert_same_outputs(got["results"][:1], prefilled["results"][1:2])  # A: vLLM's own cache held the prefix
    assert_close_outputs(got["results"][1:], prefilled["results"][2:])


def test_damaged_values_are_recomputed_and_a_lost_state_resumes_at_the_boundary_before(model, prefilled, tmp_path):
    """A's value at its last block is damaged in the first group (a window block, or the state at 288):
    A's load fails as a whole (never a partial state), vLLM recomputes, and the tokens stay exact.  For the
    GDN model the second group's state at 192 is gone as well: B then resumes at 96, the last boundary where
    every group is stored."""
    d = decode_disk(model, prefilled, tmp_path)
    bs = model["bs"]
    hashes = BlockHasher(bs, "sha256_cbor", seed="0").hash_blocks(A)
    ns = namespaces(prefilled["log"])
    victim = damage_block(d / ns[0], hashes[299 // bs - 1])
    if model["name"] == "gdn":
        block_files(d / ns[1])[hashes[1].hex()].unlink()
    got = run(model, tmp_path, "kv_consumer", [A, B], hybrid_config(disk(d)))
    assert re.search(r"request \S+: 1 of \d+ blocks not loaded \(recomputed\)", got["log"]), got["log"][-3000:]
    assert not victim.exists(), "a corrupt value must be deleted"
    assert_close_outputs(got["results"], prefilled["results"][1:])
    if model["name"] == "gdn":
        assert got["results"][1]["cached"] == 96
