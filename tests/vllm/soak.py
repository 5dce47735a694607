"""A randomised soak of kvtier inside one real vLLM engine (CPU build), stepped in this process.

    python tests/vllm/soak.py --model DIR --config YAML|none --seed N --steps N --out FILE

Six base prompts (random lengths); each step may add a request (a random cut of a base plus random
tokens, a random ``max_tokens``, sometimes a tenant's ``cache_salt`` or ``prompt_logprobs``) and may abort
a live one.  A small vLLM KV cache (48 blocks, chunks of 256 tokens) makes vLLM preempt and evict its
own prefix cache; a small kvtier host tier and disk make kvtier evict.  Then the engine drains, vLLM's
prefix cache is reset, and each base prompt is served alone (greedy), so kvtier serves what it kept.

The JSON out: the final tokens and cached counts, and kvtier's state at the end on both sides (requests
it still tracks, pinned index entries, loads in flight, worker counters), after ``validate()`` of both
indexes.  ``--config none`` runs without a connector (the reference tokens).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import random
import time
from typing import TYPE_CHECKING, Any, cast

if TYPE_CHECKING:
    from vllm.inputs import TokensPrompt

    from kvtier.integrations.vllm.connector import KvtierConnector
    from kvtier.integrations.vllm.scheduler import SchedulerSide

logging.basicConfig(level=logging.INFO, format="%(processName)s %(name)s %(levelname)s %(message)s")
logging.getLogger("kvtier").setLevel(os.environ.get("KVTIER_LOG_LEVEL", "INFO"))


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--config", required=True)
    ap.add_argument("--seed", type=int, required=True)
    ap.add_argument("--steps", type=int, default=400)
    ap.add_argument("--out", required=True)
    a = ap.parse_args()
    os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"  # the engine core here: one step() is one step
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig

    rng = random.Random(a.seed)
    bases = [[rng.randrange(1, 500) for _ in range(rng.choice([64, 100, 160, 250, 400]))] for _ in range(6)]
    kw: dict[str, Any] = {}
    if a.config != "none":
        kw["kv_transfer_config"] = KVTransferConfig(
            kv_connector="KvtierConnector", kv_connector_module_path="kvtier.integrations.vllm",
            kv_role="kv_both", kv_connector_extra_config={"kvtier_config": a.config})
    llm = LLM(model=a.model, skip_tokenizer_init=True, enforce_eager=True, block_size=32, max_model_len=1024,
              prefix_caching_hash_algo="sha256_cbor", seed=0, num_gpu_blocks_override=48,
              max_num_batched_tokens=256, **kw)
    eng = llm.llm_engine
    live: set[str] = set()
    sent = aborted = 0
    for _ in range(a.steps):
        if rng.random() < 0.35:
            base = rng.choice(bases)
            prompt = base[:rng.randrange(32, len(base) + 1)] + [rng.randrange(1, 500) for _ in range(rng.randrange(80))]
            params = SamplingParams(max_tokens=rng.randrange(1, 24), temperature=0.0, detokenize=False,
                                    prompt_logprobs=0 if rng.random() < 0.05 else None)
            req: TokensPrompt = {"prompt_token_ids": prompt}
            if rng.random() < 0.15:
                req["cache_salt"] = rng.choice(["t1", "t2"])
            eng.add_request(f"r{sent}", req, params)
            live.add(f"r{sent}")
            sent += 1
        if live and rng.random() < 0.04:
            victim = rng.choice(sorted(live))
            eng.abort_request([victim])
            live.discard(victim)
            aborted += 1
        live -= {o.request_id for o in eng.step() if o.finished}
    while eng.has_unfinished_requests():
        eng.step()
    deadline = time.monotonic() + 60
    while not llm.reset_prefix_cache():  # refused while any KV block is still held (a leak if forever)
        if time.monotonic() > deadline:
            raise RuntimeError("vLLM still holds KV blocks a minute after the last request finished")
        eng.step()
        time.sleep(0.01)
    final = []
    for base in bases:
        one: list[TokensPrompt] = [{"prompt_token_ids": base}]
        out = llm.generate(one, SamplingParams(max_tokens=12, temperature=0.0, detokenize=False), use_tqdm=False)[0]
        final.append({"tokens": list(out.outputs[0].token_ids), "cached": out.num_cached_tokens})
        llm.reset_prefix_cache()
    state: dict[str, Any] = {}
    if a.config != "none":
        from vllm.distributed.kv_transfer.kv_transfer_state import get_kv_transfer_group

        from kvtier.integrations.vllm.worker import WorkerSide

        client: Any = eng.engine_core  # the in-process client (VLLM_ENABLE_V1_MULTIPROCESSING=0)
        side: SchedulerSide = client.engine_core.scheduler.connector._scheduler
        worker = cast("KvtierConnector", get_kv_transfer_group())._worker
        assert isinstance(worker, WorkerSide)  # the soak's model has one KV cache group
        worker.stack.flush()
        side.manager.index.validate()
        worker.stack.index.validate()
        state = {"tracked_requests": len(side._reqs), "scheduler_pinned": side.manager.index.pinned,
                 "worker_pinned": worker.stack.index.pinned, "loads_in_flight": len(worker._loads),
                 "stats": dict(worker.stats), "key_mismatches": side.key_mismatches}
    with open(a.out, "w") as f:
        json.dump({"sent": sent, "aborted": aborted, "final": final, "state": state}, f)


if __name__ == "__main__":
    main()
