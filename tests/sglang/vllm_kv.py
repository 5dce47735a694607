"""A real vLLM (CPU build, in-process engine) with kvtier's connector: stores its prompt blocks
(``--role kv_producer``) or loads them (``kv_consumer``), then dumps the KV its cache holds for them, read
from its own KV cache tensors.

    python tests/sglang/vllm_kv.py --model DIR --config YAML --prompts FILE --out FILE.pt
        [--role kv_producer|kv_consumer] [--block-size 32]

Output (``torch.save``): ``{"pages": [tensor [n_blocks, L, 2, B, H, D] per prompt], "block_ids": [...],
"results": [{"tokens", "cached"} per prompt]}``:
each full prompt block's K and V per layer, token-major, taken from vLLM's KV cache as vLLM CPU's kernel
for that layer (its ``isa``) arranges a head of its ``[N, H, B, 2*D]`` tensor (:func:`kv_of_block`), at the
block vLLM's prefix cache holds for the block's hash.  kvtier's code is not used to read it.

``keys.algo: sglang_sha256`` is what makes vLLM's kvtier keys equal SGLang's page keys.  Until
``kvtier.config`` lists that algorithm in ``keys.algo`` (an additive change of the config schema), this
driver widens the schema's choice in its own process; it does nothing once the schema has it.
"""

from __future__ import annotations

import argparse
import json
import os
from typing import Literal, get_args

os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # engine core and worker in this process: tensors in reach
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")


def accept_sglang_keys() -> None:
    from kvtier import config

    field = config.KeysSection.model_fields["algo"]
    choices = get_args(field.annotation)
    if "sglang_sha256" not in choices:
        field.annotation = Literal[(*choices, "sglang_sha256")]  # type: ignore[assignment]
        config.KeysSection.model_rebuild(force=True)
        config.KvtierConfig.model_rebuild(force=True)


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--prompts", required=True)
    ap.add_argument("--out", required=True)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--role", default="kv_producer")
    a = ap.parse_args()
    accept_sglang_keys()

    import torch
    import vllm.v1.core.kv_cache_utils as kcu
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt
    from vllm.utils.hashing import get_hash_fn_by_name

    B = a.block_size
    llm = LLM(model=a.model, skip_tokenizer_init=True, enforce_eager=True, block_size=B, dtype="bfloat16",
              max_model_len=2048, enable_prefix_caching=True, prefix_caching_hash_algo="sha256_cbor", seed=0,
              kv_transfer_config=KVTransferConfig(
                  kv_connector="KvtierConnector", kv_connector_module_path="kvtier.integrations.vllm",
                  kv_role=a.role, kv_connector_extra_config={"kvtier_config": a.config}))
    with open(a.prompts) as f:
        prompts = json.load(f)
    results = []
    for p in prompts:
        out = llm.generate([TokensPrompt(prompt_token_ids=p)], SamplingParams(max_tokens=4, temperature=0.0),
                           use_tqdm=False)[0]
        results.append({"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens})
    core = llm.llm_engine.engine_core.engine_core  # type: ignore[attr-defined] # the in-process client
    pool = core.scheduler.kv_cache_manager.block_pool
    runner = core.model_executor.driver_worker.worker.model_runner
    names = runner.kv_cache_config.kv_cache_groups[0].layer_names
    ctx = llm.llm_engine.vllm_config.compilation_config.static_forward_context
    caches = [ctx[n].kv_cache for n in names]
    isas = [ctx[n].isa for n in names]  # the kernel vLLM's CPU attention writes each layer's cache with
    fn = get_hash_fn_by_name("sha256_cbor")
    out_pages, out_ids = [], []
    for p in prompts:
        parent, ids = None, []
        for i in range(len(p) // B):
            parent = kcu.hash_block_tokens(fn, parent, p[i * B:(i + 1) * B], None)
            blocks = pool.get_cached_block(parent, [0])
            assert blocks, f"vLLM's prefix cache lost block {i}"
            ids.append(blocks[0].block_id)
        pages = []
        for bid in ids:
            pages.append(torch.stack([kv_of_block(kv, bid, isa) for kv, isa in zip(caches, isas)]))
        out_pages.append(torch.stack(pages).clone())
        out_ids.append(ids)
    torch.save({"pages": out_pages, "block_ids": out_ids, "results": results}, a.out)


def kv_of_block(kv, bid: int, isa: str):
    """Block ``bid`` of one layer's ``[N, H, B, 2*D]`` cache as ``[2, B, H, D]`` (K, V token-major), by
    explicit indexing, as vLLM CPU's kernels arrange a head (tests/test_vllm_cpu_kv_arrangement.py): per
    head B*D elements of K then B*D of V; vec / vec16: K [D, B], V [B, D]; amx: K [B/16, D/2, 16, 2],
    V [D/16, B/2, 16, 2]."""
    import torch

    n, h, b, d2 = kv.shape
    d = d2 // 2
    k, v = kv.view(n, h, 2, b * d)[bid].unbind(1)
    tt, dd = torch.meshgrid(torch.arange(b), torch.arange(d), indexing="ij")
    if isa == "amx":
        k_at = ((tt // 16) * (d // 2) + dd // 2) * 32 + (tt % 16) * 2 + dd % 2
        v_at = ((dd // 16) * (b // 2) + tt // 2) * 32 + (dd % 16) * 2 + tt % 2
    else:
        assert isa in ("vec", "vec16"), f"vLLM CPU's {isa} kernel: arrangement not known to this test"
        k_at, v_at = dd * b + tt, tt * d + dd
    return torch.stack([k[:, k_at].permute(1, 0, 2), v[:, v_at].permute(1, 0, 2)])


if __name__ == "__main__":
    main()
