"""What a chunk of vLLM's primary CPU tier is called in kvtier, and which bytes of its row are the value.

vLLM's ``OffloadingConnector`` names a chunk by an ``OffloadKey``: the block hash of the chunk's *last*
block (``request.block_hashes[...]``, vLLM's chained prefix-caching hash) followed by a 4-byte KV cache
group index.  This tier stores the chunk under ``<namespace id>/<that block hash>``, the same key kvtier's
own connector and SGLang store block ``i`` under when their hash is the same chain (``keys.algo:
sha256_cbor`` = vLLM's ``--prefix-caching-hash-algo sha256_cbor``, the same ``PYTHONHASHSEED``).

The value's payload is the first ``payload_nbytes`` bytes of the chunk's primary row (the row's page
alignment padding is not stored).  The namespace (:class:`kvtier.keys.Namespace`) names everything that
fixes what those bytes mean, and two deployments read each other's values only when their namespaces
are equal.  Invariant: the namespace built here equals the one ``KvtierConnector`` builds **exactly when**
the row holds what the connector's value holds; otherwise at least one field differs, so the other side
misses (never misreads).  The row equals the connector's value when all of these hold:

* one KV cache group (no hybrid model), one worker (``world_size`` 1), one vLLM block per chunk
  (``blocks_per_chunk`` 1) and vLLM's hash block is that block (``tokens_per_hash == tokens_per_block``);
* the layer pages in the row are what the connector's value holds: on vLLM's CPU build, the connector
  with ``storage.payload: engine`` stores each layer's page as vLLM CPU keeps it (``cpu_attn`` /
  ``cpu_attn_amx``, picked the way vLLM picks its kernel), which is exactly the primary row;
* the model fields agree (model id, KV dtype, layers, KV heads, head dim, block size, seed).

Everywhere else the payload field says what the row is (``vllm_<KV cache layout>``, with ``_w<N>`` for
N workers' cells side by side and ``_c<k>`` for chunks of k blocks, layer-major), a name no connector or
SGLang namespace has: those values are shared only among vLLM-native instances whose rows agree.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from ...config import ConfigError, KvtierConfig, load_engine_config
from ...format.layout import dtype_name, parse_dtype
from ...keys import HEAD_MAJOR_KINDS, Namespace

#: Bytes of the group index at the end of a vLLM ``OffloadKey`` (``make_offload_key``).
GROUP_IDX_BYTES = 4


@dataclass(frozen=True)
class TierNaming:
    """How this tier names and cuts chunks: the kvtier config, its namespace, the vLLM group it serves
    and the payload bytes of one primary row."""

    config: KvtierConfig
    namespace: Namespace
    group_id: int
    payload_nbytes: int
    #: Whether values are the ones ``KvtierConnector`` stores (the module's conditions), said at start-up.
    connector_compatible: bool

    def block_hash(self, key: bytes) -> bytes | None:
        """The block hash in a vLLM ``OffloadKey``; None when the key is not this tier's (another group,
        or a hash length kvtier keys cannot hold: such a chunk is a miss, never stored under a guess)."""
        if len(key) <= GROUP_IDX_BYTES:
            return None
        if int.from_bytes(key[-GROUP_IDX_BYTES:], "big") != self.group_id:
            return None
        h = key[:-GROUP_IDX_BYTES]
        return h if len(h) in (16, 32) else None

    def stored_key(self, key: bytes) -> str | None:
        """kvtier's key (``<namespace>/<hash hex>``) for a vLLM ``OffloadKey``; None as :meth:`block_hash`."""
        h = self.block_hash(key)
        return None if h is None else self.namespace.key(h)

    def offload_key(self, block_hash: bytes) -> bytes:
        """The vLLM ``OffloadKey`` of a block hash in this tier's group (for eviction notices)."""
        return block_hash + self.group_id.to_bytes(GROUP_IDX_BYTES, "big")


def _hf_shape(model: str) -> tuple[int, int] | None:
    """(total KV heads, head dim) from the model's Hugging Face config, when it can be read locally."""
    try:
        from transformers import AutoConfig

        cfg = AutoConfig.from_pretrained(model, local_files_only=True)
    except Exception:  # noqa: BLE001 - not a local / cached HF model: the YAML must say
        return None
    cfg = getattr(cfg, "text_config", None) or cfg
    heads = getattr(cfg, "num_attention_heads", None)
    kv_heads = getattr(cfg, "num_key_value_heads", None) or heads
    head_dim = getattr(cfg, "head_dim", None) or (
        cfg.hidden_size // heads if heads and getattr(cfg, "hidden_size", None) else None)
    if not isinstance(kv_heads, int) or not isinstance(head_dim, int):
        return None
    return kv_heads, head_dim


def _engine_config_keeping_yaml(path: str | os.PathLike[str] | None, facts: dict[str, Any],
                                env: Mapping[str, str] | None) -> KvtierConfig:
    """``load_engine_config`` where the HF-derived shape yields to a YAML that sets one of the two fields."""
    try:
        return load_engine_config(path, facts, engine="vLLM's offloading", env=env)
    except ConfigError as e:
        mine = [k for k in ("num_kv_heads", "head_dim") if any(p.startswith(f"model.{k}:") and "the YAML says" in p
                                                               for p in e.problems)]
        if not mine:
            raise
        return load_engine_config(path, {k: v for k, v in facts.items() if k not in mine},
                                  engine="vLLM's offloading", env=env)


def row_payload_name(config: Any, kv_dtype: str, block_size: int, head_dim: int) -> str:
    """The ``Namespace.payload`` of a primary row (see the module docstring): vLLM CPU's own layouts by
    the names kvtier's connector gives them, else ``vllm_<layout>`` with its worker / chunk suffixes."""
    from vllm.platforms import current_platform

    world = 1 if config.replicated_layout else int(config.parallel.world_size)
    bpc = int(config.cache.blocks_per_chunk)
    if current_platform.is_cpu() and not config.canonical_layout:
        from ..vllm.facts import vllm_cpu_isa

        cache_dtype = "auto" if not kv_dtype.startswith("float8") else kv_dtype
        base = "cpu_attn_amx" if vllm_cpu_isa(parse_dtype(kv_dtype), block_size, head_dim,
                                              cache_dtype) == "amx" else "cpu_attn"
    else:
        layout = str(config.kv_cache_layout or "default").lower()
        base = f"vllm_{layout}" + ("_canonical" if config.canonical_layout else "")
    if world > 1:
        base += f"_w{world}"
    if bpc > 1:
        base += f"_c{bpc}"
    return base


def tier_naming(config: Any, kvtier_config: str | os.PathLike[str] | None, *,
                env: Mapping[str, str] | None = None) -> TierNaming:
    """The naming of the tier for vLLM's ``OffloadingConfig`` ``config`` and the kvtier YAML at
    ``kvtier_config`` (None: the embedded default's backends).  vLLM fills the ``model`` section where
    it knows a field; KV heads and head dim come from the YAML, else from the model's local Hugging Face
    config.  Raises ``ValueError`` (a ``ConfigError`` for the YAML) naming what is wrong, in one line."""
    groups = list(config.groups)
    if len(groups) != 1:
        raise ValueError(f"kvtier tier: vLLM offloads {len(groups)} KV cache groups (a hybrid model); this "
                         "tier serves models with one group")
    group = groups[0]
    block_size = int(group.tokens_per_block)
    if int(config.cache.tokens_per_hash) != block_size:
        raise ValueError(f"kvtier tier: vLLM hashes every {config.cache.tokens_per_hash} tokens but its blocks "
                         f"hold {block_size}; this tier needs one hash per block (the default)")
    kv_dtype = dtype_name(parse_dtype(str(config.model.dtype)))
    world = 1 if config.replicated_layout else int(config.parallel.world_size)
    bpc = int(config.cache.blocks_per_chunk)
    facts: dict[str, Any] = {"id": str(config.model.name), "kv_dtype": kv_dtype,
                             "num_layers": len(group.layer_names), "block_size": block_size,
                             "tp_rank": 0, "tp_size": 1, "pp_rank": 0, "pp_size": 1}
    try:  # KV heads and head dim from the YAML (or its KVTIER_ overrides) when it sets them
        cfg = load_engine_config(kvtier_config, facts, engine="vLLM's offloading", env=env)
    except ConfigError as e:
        if not any(p.startswith(("model.num_kv_heads", "model.head_dim")) for p in e.problems):
            raise
        shape = _hf_shape(str(config.model.name))
        if shape is None:
            raise ValueError(f"kvtier tier: cannot read {config.model.name!r}'s Hugging Face config for its KV "
                             "heads and head dim; set model.num_kv_heads and model.head_dim in the kvtier YAML"
                             ) from None
        facts["num_kv_heads"] = max(1, shape[0] // max(1, int(config.parallel.tp_size)))
        facts["head_dim"] = shape[1]
        cfg = _engine_config_keeping_yaml(kvtier_config, facts, env)
    payload = row_payload_name(config, kv_dtype, block_size, cfg.model.head_dim)
    if cfg.storage.block_tokens not in (None, cfg.model.block_size):
        raise ValueError(f"kvtier tier: storage.block_tokens must be null here (vLLM's blocks_per_chunk groups "
                         f"blocks), got {cfg.storage.block_tokens}")
    m = cfg.model
    ns = Namespace(model=m.id, kv_dtype=m.kv_dtype, num_layers=m.num_layers, num_kv_heads=m.num_kv_heads,
                   head_dim=m.head_dim, block_size=m.block_size, attention=m.attention, tp_rank=0, tp_size=1,
                   pp_rank=0, pp_size=1, hash_algo=cfg.keys.algo, hash_seed=cfg.keys.seed,
                   storage_blocks=bpc, payload=payload, tenant=cfg.security.namespace_tenant)
    payload_nbytes = int(config.worker_kv_bytes_per_block) * bpc * world
    comps = 1 if m.attention == "mla" else 2
    implied = m.num_layers * comps * m.block_size * m.num_kv_heads * m.head_dim * parse_dtype(m.kv_dtype).itemsize
    if implied * bpc * world != payload_nbytes:
        raise ValueError(f"kvtier tier: the model section implies {implied} bytes per block per worker "
                         f"({m.num_layers} layers x {comps} x {m.block_size} tokens x {m.num_kv_heads} heads x "
                         f"{m.head_dim} x {m.kv_dtype}) but vLLM's pages hold {config.worker_kv_bytes_per_block}; "
                         "set model.num_kv_heads / head_dim / attention in the kvtier YAML to the rank's values")
    compatible = world == 1 and bpc == 1 and payload in HEAD_MAJOR_KINDS
    return TierNaming(cfg, ns, int(group.group_id), payload_nbytes, compatible)
