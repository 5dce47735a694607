"""What vLLM already knows about the model and its KV cache, as kvtier config fields.

Both halves of the connector build their :class:`~kvtier.config.KvtierConfig` from the same facts, so
the scheduler's keys and namespace equal every worker's (except the TP / PP rank, which only a worker
knows: the scheduler probes rank 0's namespace).
"""

from __future__ import annotations

import difflib
import os
from collections.abc import Mapping
from typing import Any

from ...config import KvtierConfig, load_engine_config
from ...format.layout import dtype_name, parse_dtype
from ...keys import none_hash_seed
from ...plans import RankTally


def model_facts(vllm_config: Any, num_layers: int, *, tp_rank: int = 0, pp_rank: int = 0) -> dict[str, Any]:
    """The ``model`` section vLLM implies (``num_layers``: attention layers whose KV this rank holds)."""
    mc, cc, pc = vllm_config.model_config, vllm_config.cache_config, vllm_config.parallel_config
    # vLLM's names (auto, fp8, fp8_e5m2, bfloat16, ...) are kvtier's dtype aliases; fp8 stays raw bytes.
    kv_dtype = dtype_name(mc.dtype if cc.cache_dtype == "auto" else parse_dtype(cc.cache_dtype))
    name = mc.served_model_name
    name = name[0] if isinstance(name, list | tuple) else name
    mla = bool(getattr(mc, "use_mla", False))
    # Replicated KV: the TP rank and size do not describe the bytes and stay out of the namespace: the
    # ranks share one copy, and deployments of any TP size share blocks (a TP=8 prefill feeds a TP=4 decode).
    replicated = kv_replicated_across_tp(vllm_config)
    return {
        "id": str(name or mc.model),
        "kv_dtype": kv_dtype,
        "num_layers": int(num_layers),
        "num_kv_heads": 1 if mla else int(mc.get_num_kv_heads(pc)),
        "head_dim": int(mc.get_head_size()),
        "block_size": int(cc.block_size),
        "attention": "mla" if mla else "mha",
        "tp_rank": 0 if replicated else int(tp_rank),
        "tp_size": 1 if replicated else int(pc.tensor_parallel_size),
        "pp_rank": int(pp_rank),
        "pp_size": int(pc.pipeline_parallel_size),
    }


def kv_replicated_across_tp(vllm_config: Any) -> bool:
    """Whether every TP rank holds the same KV bytes for every token: MLA, whose latent vLLM replicates
    (both ranks of a TP=2 run stored bitwise equal values), unless context parallelism gives each rank
    other tokens."""
    pc = vllm_config.parallel_config
    return bool(getattr(vllm_config.model_config, "use_mla", False)) and all(
        int(getattr(pc, f, 1)) == 1 for f in ("decode_context_parallel_size", "prefill_context_parallel_size"))


def rank_tally(vllm_config: Any, *, writes: bool) -> RankTally:
    """The scheduler's count of its workers' reports: every rank of vLLM's TP x PCP x PP grid holds its own
    shard, and writes it when the instance stores (``writes``); where the KV is replicated across TP, the
    TP rank 0 of each pipeline stage alone writes (the others only read)."""
    pc = vllm_config.parallel_config
    ranks = int(pc.world_size)
    writers = (int(pc.pipeline_parallel_size) if kv_replicated_across_tp(vllm_config) else ranks) if writes else 0
    return RankTally(ranks, writers)


def worker_rank(tp_rank: int, tp_size: int, pcp_rank: int, pcp_size: int, pp_rank: int) -> int:
    """A worker's rank in [0, TP x PCP x PP), as :func:`rank_tally` counts them."""
    return (pp_rank * pcp_size + pcp_rank) * tp_size + tp_rank


def why_loads_cannot_work(vllm_config: Any) -> str | None:
    """Why this vLLM cannot compute a prompt over a prefix loaded into its KV cache (None: it can).

    vLLM's CPU MLA attention computes a prefill as if no earlier tokens were cached, so it turns its own
    prefix caching off for MLA models; a connector's loaded prefix would be ignored by the prompt's
    other tokens, and the output would be wrong (measured on a DeepSeek-V2-shaped model: other greedy
    tokens from the second one on).  Its AMX MLA path keeps prefix caching on, and so do loads."""
    from vllm.platforms import current_platform

    if (current_platform.is_cpu() and getattr(vllm_config.model_config, "use_mla", False)
            and not vllm_config.cache_config.enable_prefix_caching):
        return ("vLLM's CPU MLA attention cannot compute a prompt over a prefix computed before (vLLM turns "
                "its own prefix caching off for MLA models on CPU)")
    return None


def vllm_cpu_isa(dtype: Any, block_size: int, head_dim: int, kv_cache_dtype: str) -> str:
    """The kernel (``amx``, ``vec``, ``vec16``, ``neon``, ...) vLLM's CPU attention writes its KV cache with,
    as vLLM itself picks it (``dtype``: the model's torch dtype)."""
    from vllm.v1.attention.backends.cpu_attn import _get_attn_isa

    return str(_get_attn_isa(dtype, block_size, head_dim, kv_cache_dtype))


def cpu_kv_layout(vllm_config: Any) -> str | None:
    """The kvtier layout of vLLM CPU's per-layer KV cache, as the workers detect it from their tensors
    (``cpu_attn_amx`` where vLLM picks its amx kernel, else ``cpu_attn``); None off the CPU and for MLA,
    whose caches keep the canonical payload.  The scheduler needs it for ``storage.payload: engine``,
    whose namespace names the layout, before any worker has registered its tensors."""
    from vllm.platforms import current_platform

    mc, cc = vllm_config.model_config, vllm_config.cache_config
    if not current_platform.is_cpu() or getattr(mc, "use_mla", False):
        return None
    isa = vllm_cpu_isa(mc.dtype, cc.block_size, mc.get_head_size(), cc.cache_dtype)
    return "cpu_attn_amx" if isa == "amx" else "cpu_attn"


# What the connector reads from kv_connector_extra_config (the YAML, scheduler.LoadMode, worker.idle_wait_ms).
EXTRA_CONFIG_KEYS = ("kvtier_config", "load_mode", "idle_wait_ms")


def check_extra_config(extra: Mapping[str, Any] | None) -> None:
    """``kv_connector_extra_config`` holds the connector's keys only: a misspelt ``kvtier_confg`` would
    otherwise run the instance on the embedded default config (its own disk, not the shared one)."""
    unknown = sorted(set(extra or {}) - set(EXTRA_CONFIG_KEYS))
    if unknown:
        close = difflib.get_close_matches(unknown[0], EXTRA_CONFIG_KEYS, n=1)
        hint = f"; did you mean {close[0]!r}?" if close else ""
        raise ValueError(f"kvtier: kv_connector_extra_config: unknown key(s) {unknown}{hint} "
                         f"(known: {', '.join(EXTRA_CONFIG_KEYS)})")


def kvtier_config(vllm_config: Any, num_layers: int, *, tp_rank: int = 0, pp_rank: int = 0,
                  layout: str | None = None) -> KvtierConfig:
    """The deployment's kvtier config: the YAML named by ``kv_connector_extra_config.kvtier_config``
    (the embedded default's tiers when absent), its ``model`` section filled from vLLM."""
    extra = vllm_config.kv_transfer_config.kv_connector_extra_config or {}
    check_extra_config(extra)
    facts = model_facts(vllm_config, num_layers, tp_rank=tp_rank, pp_rank=pp_rank)
    return load_engine_config(extra.get("kvtier_config"), facts, engine="vLLM",
                              device={"layout": layout} if layout else None)


def key_seed_problem(config: KvtierConfig, vllm_hash_algo: str | None) -> str | None:
    """Why kvtier's block keys would differ from vLLM's ``request.block_hashes`` though both hash with
    ``sha256_cbor`` (which routers and the key check rely on), or None.  vLLM seeds its chain from
    ``PYTHONHASHSEED`` (a string) when set, else from a fixed default; ``keys.seed`` null follows the same
    rule, so only an explicit seed can disagree.  Checked before the model loads (``early``) and when the
    scheduler side starts."""
    seed = config.keys.seed
    if config.keys.algo != "sha256_cbor" or vllm_hash_algo != "sha256_cbor" or seed is None:
        return None
    theirs = none_hash_seed("sha256_cbor", None)
    if seed == theirs:
        return None
    env = os.environ.get("PYTHONHASHSEED")
    why = f"PYTHONHASHSEED={env!r}" if env is not None else f"its default {theirs!r} (PYTHONHASHSEED unset)"
    return (f"keys.seed: {seed!r} would make kvtier's block keys differ from vLLM's request.block_hashes, "
            f"which vLLM seeds from {why}; remove keys.seed from the YAML and set PYTHONHASHSEED alike on "
            "every instance and router")


def kv_layers(kv_cache_config: Any) -> list[str]:
    """Names of the attention layers of the (single) KV cache group, in layer order."""
    groups = kv_cache_config.kv_cache_groups
    if len(groups) != 1:
        raise ValueError(f"kvtier: models with {len(groups)} KV cache groups (hybrid attention) are not "
                         "supported yet; run vLLM with one group")
    return list(groups[0].layer_names)
