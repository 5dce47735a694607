"""One vLLM process for ``kvtier bench vllm`` (run as ``python -m kvtier.tools.bench._vllm_driver SPEC.json``).

SPEC: ``model``, ``kv_transfer`` (a KVTransferConfig's fields, or null for no connector), ``prompts`` (token
id lists), ``steps`` (``["ttft", i]``: time a 1-token generation of prompt ``i``; ``["reset"]``: drop vLLM's
own prefix cache, so the next hit must come from the connector; ``["itl", [i, ...]]``: a running request
decodes while prompts ``i, ...`` arrive and are served, and the gaps between its tokens are recorded
before and while they are; ``["files", "cold" | "page cache", [path, ...]]``: put those files in that
state and time the raw file ceiling of reading them in it; ``["redis", port, [key, ...], value_bytes]``:
time the raw Redis wire ceiling of reading those values), ``out`` (JSON path), ``kv_space_gib``.

Optional keys (left out: vLLM's own defaults, as before): ``block_size`` (32 unless given),
``max_model_len`` (8192 unless given), ``max_num_batched_tokens`` (vLLM's token budget per step: a longer
prompt is prefilled in chunks of it), ``disable_hybrid_kv_cache_manager`` (bool: force vLLM's hybrid KV
cache manager off, or explicitly on), ``in_process`` (true: the engine core and its worker run in this
process, ``VLLM_ENABLE_V1_MULTIPROCESSING=0``: one vLLM import instead of three), ``reserved_cpus``
(``VLLM_CPU_NUM_OF_RESERVED_CPU``: vLLM CPU reserves a different number of cores for its own threads when a
KV connector is configured, so rows compared side by side pin the same value).
"""

from __future__ import annotations

import json
import os
import sys
import time
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from vllm import LLM, PoolingRequestOutput


def main(spec_path: str) -> None:
    with open(spec_path) as f:
        spec = json.load(f)
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", str(spec.get("kv_space_gib", 4)))
    if spec.get("in_process"):
        os.environ["VLLM_ENABLE_V1_MULTIPROCESSING"] = "0"
    if spec.get("reserved_cpus") is not None:
        os.environ["VLLM_CPU_NUM_OF_RESERVED_CPU"] = str(spec["reserved_cpus"])
    from vllm import LLM, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from ...testing.hybrid_models import GDN_STATE_DTYPE

    # None is EngineArgs' own default: no connector, exactly as when the argument is left out.
    kv_transfer = KVTransferConfig(**spec["kv_transfer"]) if spec.get("kv_transfer") else None
    # Only the optional keys the spec names reach LLM(...): the others keep vLLM's defaults.
    kw: dict[str, Any] = {k: spec[k] for k in ("max_num_batched_tokens", "disable_hybrid_kv_cache_manager")
                          if spec.get(k) is not None}
    llm = LLM(model=spec["model"], skip_tokenizer_init=True, enforce_eager=True, block_size=spec.get("block_size", 32),
              dtype="bfloat16", max_model_len=spec.get("max_model_len", 8192), enable_prefix_caching=True,
              prefix_caching_hash_algo="sha256_cbor", seed=0, kv_transfer_config=kv_transfer,
              mamba_ssm_cache_dtype=GDN_STATE_DTYPE, **kw)
    params = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    prompts, rows = spec["prompts"], []
    for step in spec["steps"]:
        if step[0] == "itl":
            rows.append(_itl(llm, [prompts[i] for i in step[1]], len(prompts[0])))
            continue
        if step[0] == "files":
            rows.append({"files": step[1], "read_s": _read_files(step[2], cold=step[1] == "cold")})
            continue
        if step[0] == "redis":
            rows.append({"raw": "redis", "read_s": _read_redis(step[1], step[2], step[3])})
            continue
        if step[0] == "reset":
            while not llm.reset_prefix_cache():
                time.sleep(0.05)
            continue
        t0 = time.perf_counter()
        out = llm.generate([TokensPrompt(prompt_token_ids=prompts[step[1]])], params, use_tqdm=False)[0]
        rows.append({"prompt": step[1], "ttft_s": time.perf_counter() - t0, "cached": out.num_cached_tokens})
    with open(spec["out"], "w") as f:
        json.dump(rows, f)


def _read_files(paths: list[str], cold: bool) -> float:
    """Seconds of ``bench backends``' raw file ceiling (``RawFiles.get``: open / readv into page-aligned
    buffers, with local_disk's default thread count) over ``paths``: out of the page cache (``cold``:
    dropped before, and again after, so the load that follows reads from the device too), or in it
    (read once before the timed read)."""
    import mmap
    from concurrent.futures import ThreadPoolExecutor

    from .backend_disk import THREADS, RawFiles, drop_cached

    size = max((os.path.getsize(p) for p in paths), default=0)
    mem = mmap.mmap(-1, max(1, len(paths) * size))
    bufs = [memoryview(mem)[i * size:(i + 1) * size] for i in range(len(paths))]
    try:
        with ThreadPoolExecutor(THREADS) as pool:
            raw = RawFiles(paths, pool, THREADS)
            if cold:
                drop_cached(paths)
            else:
                raw.get(slice(None), bufs)
            t0 = time.perf_counter()
            raw.get(slice(None), bufs)
            took = time.perf_counter() - t0
        if cold:
            drop_cached(paths)
        return took
    finally:
        for b in bufs:
            b.release()
        mem.close()


def _read_redis(port: int, keys: list[str], value_bytes: int) -> float:
    """Seconds of ``bench backends``' Redis wire ceiling (raw RESP, values received straight into
    buffers, no framing or checksum) reading ``keys``: the faster of its loops (``Ceiling.VARIANTS``),
    each timed once after an untimed read of one value on its connections."""
    from .backend_redis import Ceiling

    bufs = [memoryview(bytearray(value_bytes)) for _ in keys]
    ks = [k.encode() for k in keys]
    ceiling = Ceiling(port)
    try:
        best = float("inf")
        for v in range(len(Ceiling.VARIANTS)):
            ceiling.get(v, ks[:1], bufs[:1])
            t0 = time.perf_counter()
            ceiling.get(v, ks, bufs)
            best = min(best, time.perf_counter() - t0)
        return best
    finally:
        ceiling.close()


def _itl(llm: LLM, arriving: list[list[int]], vocab_hint: int) -> dict[str, Any]:
    """Inter-token gaps of one decoding request: 24 tokens alone, then while ``arriving`` prompts are
    admitted and served (their KV computed or loaded), then alone again."""
    from vllm import RequestOutput, SamplingParams
    from vllm.inputs import TokensPrompt

    eng = llm.llm_engine
    dec = SamplingParams(max_tokens=4000, temperature=0.0, ignore_eos=True, detokenize=False)
    one = SamplingParams(max_tokens=1, temperature=0.0, detokenize=False)
    eng.add_request("itl-decoder", TokensPrompt(prompt_token_ids=list(range(1, 65))), dec)
    stamps: list[float] = []
    seen = 0

    def step() -> list[RequestOutput | PoolingRequestOutput]:
        nonlocal seen
        outs = eng.step()
        for o in outs:
            # A generate engine yields only RequestOutputs; the check narrows the engine's declared union.
            if isinstance(o, RequestOutput) and o.request_id == "itl-decoder" and len(o.outputs[0].token_ids) > seen:
                seen = len(o.outputs[0].token_ids)
                stamps.append(time.perf_counter())
        return outs

    while seen < 24:
        step()
    base_end = len(stamps)
    t0 = time.perf_counter()
    for k, p in enumerate(arriving):
        eng.add_request(f"itl-arrival-{k}", TokensPrompt(prompt_token_ids=p), one)
    pending = {f"itl-arrival-{k}" for k in range(len(arriving))}
    while pending:
        for o in step():
            if o.request_id in pending and o.finished:
                pending.discard(o.request_id)
    window = time.perf_counter() - t0
    load_end = len(stamps)
    target = seen + 24
    while seen < target:
        step()
    eng.abort_request(["itl-decoder"])
    gaps = [b - a for a, b in zip(stamps, stamps[1:])]
    base, during = gaps[1:base_end - 1], gaps[base_end - 1:load_end]
    pct = lambda xs, q: sorted(xs)[min(len(xs) - 1, int(q * len(xs)))] if xs else float("nan")  # noqa: E731
    return {"itl_base_p50_s": pct(base, 0.5), "itl_base_p99_s": pct(base, 0.99), "itl_during_p50_s": pct(during, 0.5),
            "itl_during_p99_s": pct(during, 0.99), "itl_during_max_s": max(during, default=float("nan")),
            "arrivals_served_s": window, "decode_tokens_during": len(during)}


if __name__ == "__main__":
    main(sys.argv[1])
