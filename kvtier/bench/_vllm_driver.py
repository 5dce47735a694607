"""One vLLM process for ``kvtier bench vllm`` (run as ``python -m kvtier.bench._vllm_driver SPEC.json``).

SPEC: ``model``, ``kv_transfer`` (a KVTransferConfig's fields, or null for no connector), ``prompts`` (token
id lists), ``steps`` (``["ttft", i]``: time a 1-token generation of prompt ``i``; ``["reset"]``: drop vLLM's
own prefix cache, so the next hit must come from the connector), ``out`` (JSON path), ``kv_space_gib``.
"""

from __future__ import annotations

import json
import os
import sys
import time


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_space_gib", 4)))
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    kw = {}
    if spec.get("kv_transfer"):
        kw["kv_transfer_config"] = KVTransferConfig(**spec["kv_transfer"])
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True, block_size=spec.get("block_size", 32),
              dtype="bfloat16", max_model_len=spec.get("max_model_len", 8192), enable_prefix_caching=True,
              prefix_caching_hash_algo="sha256_cbor", seed=0, **kw)
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    prompts, rows = spec["prompts"], []
    for step in spec["steps"]:
        if step[0] == "reset":
            while not llm.reset_prefix_cache():
                time.sleep(0.05)
            continue
        t0 = time.perf_counter()
        out = llm.generate([{"prompt_token_ids": prompts[step[1]]}], params, use_tqdm=False)[0]
        rows.append({"prompt": step[1], "ttft_s": time.perf_counter() - t0, "cached": out.num_cached_tokens})
    with open(spec["out"], "w") as f:
        json.dump(rows, f)


if __name__ == "__main__":
    main(sys.argv[1])
