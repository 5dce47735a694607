"""One store, two engines: a prefix a real vLLM (CPU build) computed and stored through kvtier's connector is
found and loaded by kvtier's SGLang backend inside SGLang's real HiCache controller, and the pages that land
in SGLang's host pool are the KV vLLM computed, byte for byte; pages SGLang stores are loaded by vLLM into
exactly that KV again.

The switch: both sides hash with one algorithm, ``keys.algo: sglang_sha256`` in the vLLM instance's YAML
(SGLang names pages that way itself), the same ``model.id`` (each engine loads the model from its own
path) and the same KV dtype and page size (vLLM ``--block-size`` = SGLang ``--page-size``).  The payload is
kvtier's canonical one on both sides: vLLM's CPU ``[N, H, B, 2*D]`` cache and SGLang's four host layouts.
The model and vLLM runs reuse ``tests/test_vllm.py``'s random-weight Llama; the KV reference is read from
vLLM's own KV cache tensors (``tests/sglang/vllm_kv.py``).
"""

from __future__ import annotations

import json
import os
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent / "sglang"))
sys.path.insert(0, str(Path(__file__).parent))
import sgl_harness as h  # noqa: E402 - before anything imports SGLang
import test_vllm as tv  # noqa: E402 - its model fixture and prompts
from test_sglang import block_files, same  # noqa: E402

model_dir = tv.model_dir  # the same random-weight Llama (2 layers, 2 KV heads, head dim 64, bf16)
BS = tv.BS  # vLLM block size = SGLang page size
A, B = tv.A, tv.B  # A: 300 tokens (9 full blocks); B shares A's first 5 blocks
DRIVER = Path(__file__).parent / "sglang" / "vllm_kv.py"
GEOMETRY: dict[str, Any] = {"page_size": BS, "layers": 2, "heads": 2, "head_dim": 64, "dtype": torch.bfloat16}


def yaml_file(path: Path, root: Path, **extra) -> str:
    path.write_text(yaml.safe_dump({"model": {"id": "shared-llama"}, **extra, "backends": [
        {"name": "disk", "type": "local_disk", "options": {"path": str(root), "capacity": "1GiB"}}]}))
    return str(path)


def run_vllm(model: str, tmp: Path, role: str, cfg: str, prompts: list[list[int]]) -> dict[str, Any]:
    pf, out, log = tmp / f"{role}.prompts.json", tmp / f"{role}.pt", tmp / f"{role}.log"
    pf.write_text(json.dumps(prompts))
    with open(log, "w") as f:  # forked from the process that imported vLLM once (tests/vllm/forkserver.py)
        proc = tv.forkserver.popen([str(DRIVER), "--model", model, "--config", cfg, "--prompts", str(pf),
                                    "--out", str(out), "--role", role, "--block-size", str(BS)],
                                   {**os.environ, "PYTHONHASHSEED": "0"}, f)
        try:
            rc = proc.wait(timeout=600)
        finally:
            proc.kill()
    assert rc == 0, log.read_text()[-6000:]
    res: dict[str, Any] = torch.load(out)
    res["log"] = log.read_text()
    return res


@pytest.fixture(scope="module")
def vllm_stored(model_dir, tmp_path_factory) -> tuple[Path, dict[str, Any]]:
    """A vLLM prefill instance stored A's 9 full blocks, keys sglang_sha256; and the KV its cache holds."""
    tmp = tmp_path_factory.mktemp("vllm")
    root = tmp / "blocks"
    res = run_vllm(model_dir, tmp, "kv_producer", yaml_file(tmp / "vllm.yaml", root, keys={"algo": "sglang_sha256"},
                                                            host={"capacity": "32MiB"}), [A])
    return root, res


def test_vllm_keys_are_sglang_page_keys(vllm_stored):
    root, _ = vllm_stored
    assert set(block_files(root)) == set(h.page_keys(A, BS)[:9])


@pytest.mark.parametrize("layout", h.LAYOUTS)
def test_sglang_loads_the_kv_vllm_computed(vllm_stored, tmp_path, layout, figures):
    root, res = vllm_stored
    want = res["pages"][0]  # [9, L, 2, B, H, D] from vLLM's KV cache
    cfg = yaml_file(tmp_path / "sglang.yaml", root)
    e = h.make_engine(cfg, layout=layout, model="/models/elsewhere/llama", **GEOMETRY)
    try:
        pf = h.prefetch(e, A)  # 300 tokens: 9 full pages and a partial one (never stored)
        assert (pf.hit_tokens, pf.loaded_tokens) == (9 * BS, 9 * BS)
        assert pf.slots is not None
        assert same(h.read_pages(e, pf.slots), want), "SGLang's host pool differs from vLLM's KV"
        pf = h.prefetch(e, B)  # shares 5 blocks with A
        assert (pf.hit_tokens, pf.loaded_tokens) == (5 * BS, 5 * BS)
        assert pf.slots is not None
        assert same(h.read_pages(e, pf.slots), want[:5])
    finally:
        e.close()
    figures(f"vLLM -> SGLang ({layout}) pages bit-identical", 9)


def test_vllm_loads_what_sglang_stored(model_dir, vllm_stored, tmp_path):
    """SGLang stores the pages (vLLM's KV, loaded above) into a fresh store from its own host pool; a vLLM
    decode instance loads A's 9 blocks from it, and its KV cache then holds exactly vLLM's original KV."""
    src, res = vllm_stored
    want = res["pages"][0]
    root = tmp_path / "blocks"
    e = h.make_engine(yaml_file(tmp_path / "from.yaml", src), layout="page_head", **GEOMETRY)
    w = h.make_engine(yaml_file(tmp_path / "to.yaml", root), layout="page_first", **GEOMETRY)
    try:
        pf = h.prefetch(e, A)
        assert pf.slots is not None
        pages = h.read_pages(e, pf.slots)
        assert h.backup(w, A[:9 * BS], pages)[0] == 9 * BS
    finally:
        e.close()
        w.close()
    got = run_vllm(model_dir, tmp_path, "kv_consumer", yaml_file(tmp_path / "dec.yaml", root,
                                                                 keys={"algo": "sglang_sha256"},
                                                                 host={"capacity": "32MiB"}), [A])
    assert got["results"][0]["cached"] == 9 * BS  # every full block from kvtier (the last token is vLLM's)
    assert same(got["pages"][0], want), "vLLM's KV after loading SGLang's pages differs from what it computed"
    assert got["results"][0]["tokens"] == res["results"][0]["tokens"]
