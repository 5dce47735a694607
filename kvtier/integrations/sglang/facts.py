"""What SGLang already knows about the model and its KV pages, as kvtier config fields.

SGLang's page keys carry no model, dtype, layout or TP rank (they hash token ids only), so everything
that makes page bytes interchangeable goes into kvtier's namespace here: model id, KV dtype, layers,
heads, head dim, page size, MHA / MLA, TP / PP rank and size, and the key algorithm ``sglang_sha256``.

MLA KV is the same on every TP rank (SGLang writes it from one rank and every rank reads it), so an MLA
model's namespace is rank 0's on every rank.

An fp8 KV cache is held by SGLang as raw bytes (``uint8`` host pools); which fp8 it is comes from SGLang's
``--kv-cache-dtype`` (its server args), else from ``model.kv_dtype`` in the YAML, and is required.
"""

from __future__ import annotations

import logging
from typing import Any

import torch

from ...config import ConfigError, KvtierConfig, load_engine_config
from ...format.layout import dtype_name
from ...keys import SGLANG_SHA256
from .pages import PageGeometry

log = logging.getLogger("kvtier.sglang")

#: Keys of ``--hicache-storage-backend-extra-config`` that kvtier reads (SGLang's own are passed through).
EXTRA_KEYS = ("kvtier_config",)


def refuse_unsupported(storage_config: Any) -> None:
    """Raise ``NotImplementedError`` for SGLang parallel modes whose pages kvtier cannot name yet."""
    if getattr(storage_config, "attn_cp_size", 1) > 1:
        raise NotImplementedError("kvtier: attention context parallelism (attn_cp_size > 1) splits every page "
                                  "across ranks; not supported yet")
    if getattr(storage_config, "dcp_size", 1) > 1:
        raise NotImplementedError("kvtier: decode context parallelism (dcp_size > 1) is not supported yet")
    if getattr(storage_config, "should_split_heads", False):
        raise NotImplementedError("kvtier: heterogeneous TP page splitting (tp_lcm_size with page_head) is "
                                  "not supported yet")


_FP8 = {"fp8_e4m3": "float8_e4m3fn", "fp8_e5m2": "float8_e5m2"}


def sglang_fp8_dtype() -> str | None:
    """kvtier's name for SGLang's ``--kv-cache-dtype`` when it is an fp8 kind; None when SGLang has published
    no server args (tests, tools) or the KV cache is not fp8."""
    try:
        from sglang.srt.runtime_context import get_server_args

        return _FP8.get(str(get_server_args().kv_cache_dtype))
    except Exception:  # noqa: BLE001 - no server args in this process
        return None


def model_facts(storage_config: Any, geo: PageGeometry) -> dict[str, Any]:
    """The ``model`` section SGLang implies (``id`` only when SGLang names the model; ``kv_dtype`` not when the
    host pool holds raw bytes and SGLang's server args do not say which fp8)."""
    mla = bool(storage_config.is_mla_model)
    facts: dict[str, Any] = {
        "num_layers": geo.num_layers,
        "num_kv_heads": geo.num_kv_heads,
        "head_dim": geo.head_dim,
        "block_size": geo.page_size,
        "attention": "mla" if mla else "mha",
        # MLA KV is the same on every TP rank: neither the rank nor the TP size describes its bytes, so
        # deployments of any TP size (and vLLM's, kvtier.integrations.vllm.facts) share MLA pages.
        "tp_rank": 0 if mla else int(storage_config.tp_rank),
        "tp_size": 1 if mla else int(storage_config.tp_size),
        "pp_rank": int(storage_config.pp_rank),
        "pp_size": int(storage_config.pp_size),
    }
    if geo.dtype == torch.uint8:
        fp8 = sglang_fp8_dtype()
        if fp8 is not None:
            facts["kv_dtype"] = fp8
    else:
        facts["kv_dtype"] = dtype_name(geo.dtype)
    if storage_config.model_name:
        facts["id"] = str(storage_config.model_name)
    return facts


def kvtier_config(storage_config: Any, geo: PageGeometry) -> KvtierConfig:
    """The deployment's kvtier config: the YAML named by ``extra_config["kvtier_config"]`` (the embedded
    default's backends when absent), its ``model`` section filled from SGLang, keys ``sglang_sha256``."""
    extra = storage_config.extra_config or {}
    # SGLang's own keys share this dict, so only ours can be judged: a misspelt kvtier_config would
    # otherwise run the instance on the embedded default config.
    ours = sorted(k for k in extra if str(k).startswith("kvtier") and k not in EXTRA_KEYS)
    if ours:
        raise ConfigError([f"--hicache-storage-backend-extra-config: unknown key(s) {ours}; kvtier reads "
                           f"{', '.join(EXTRA_KEYS)}"], "<extra config>")
    path = extra.get("kvtier_config")
    facts = model_facts(storage_config, geo)
    cfg = load_engine_config(path, facts, engine="SGLang")
    if "kv_dtype" not in facts and "kv_dtype" not in cfg.model.model_fields_set:
        raise ConfigError(["model.kv_dtype: SGLang holds this KV cache as raw bytes (an fp8 cache) and does not "
                           "say which fp8; set model.kv_dtype: float8_e4m3fn or float8_e5m2 (SGLang's "
                           "--kv-cache-dtype fp8_e4m3 / fp8_e5m2)"], str(path or "<default>"))
    if "algo" in cfg.keys.model_fields_set and cfg.keys.algo != SGLANG_SHA256:
        raise ConfigError([f"keys.algo: the YAML says {cfg.keys.algo!r} but SGLang names its pages itself "
                           f"({SGLANG_SHA256}); remove the key, or set it to {SGLANG_SHA256} (also on a vLLM "
                           "instance that shares these blocks)"], str(path or "<default>"))
    # The namespace records what the keys mean: SGLang's page hashes.
    return cfg.model_copy(update={"keys": cfg.keys.model_copy(update={"algo": SGLANG_SHA256})})
