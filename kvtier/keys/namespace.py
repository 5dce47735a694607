"""Namespaces: everything that makes two deployments' block bytes interchangeable, digested into the first half
of every stored key."""

from __future__ import annotations

import functools
import hashlib
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cbor2

from .hasher import BlockHasher, algo_problem, known_algo, none_hash_seed

# --------------------------------------------------------------------------- namespaces


def tenant_tag(cache_salt: str) -> str:
    """``Namespace.tenant`` of the tenant whose requests carry ``cache_salt``: 8 bytes of a domain-separated
    SHA-256, in hex.  A tag, not the salt: manifests are readable by whoever reads the store, and the salt
    is what keeps the tenant's prompts from being probed (a guessable salt can still be confirmed from
    its tag, as from its keys: give tenants random salts)."""
    if not isinstance(cache_salt, str) or not cache_salt:
        raise ValueError(f"cache_salt: expected a non-empty string, got {cache_salt!r}")
    return hashlib.sha256(b"kvtier tenant tag v1\x00" + cache_salt.encode()).digest()[:8].hex()


# 2: the payload of vLLM's CPU build became the canonical one.  Version 1 values written by vLLM CPU held
# its kernel's own arrangement of K (dim-major, or VNNI-packed with V on AMX) where the payload is
# token-major; nothing in them says so, so every version 1 namespace is left behind (a miss, never
# permuted KV), GPU and SGLang deployments' included.
BLOCK_FORMAT_VERSION = 2

#: ``Namespace.payload`` of values laid out as the canonical block payload (see kvtier.format.layout).
CANONICAL_PAYLOAD = "canonical"
#: Engine layouts (kvtier.format.layout kinds) that keep a block in an arrangement of their own, not the canonical
#: payload's: a value can hold either (``Namespace.payload``).  Every other kind's block is the payload.
HEAD_MAJOR_KINDS = ("cpu_attn", "cpu_attn_amx")


@dataclass(frozen=True)
class Namespace:
    """Everything that makes two deployments' block bytes interchangeable.

    Invariant: two namespaces share a digest iff every field is equal, so blocks of a bf16 and an fp8
    deployment (or of TP rank 0 and 1, or of two hash seeds) can never be confused.  The digest is a
    pure function of the fields (canonical CBOR of the manifest -> sha256), stable across processes,
    hosts and kvtier versions; changing how it is computed means bumping ``BLOCK_FORMAT_VERSION``.
    """

    model: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    attention: str = "mha"  # "mha" (K and V) or "mla" (one latent vector per token)
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    hash_algo: str = "sha256_cbor"
    hash_seed: str | int | None = None
    format_version: int = BLOCK_FORMAT_VERSION
    # Engine blocks per stored value (``storage.block_tokens / block_size``).  Values of different group
    # sizes must never be confused, so it is part of the digest, but only when > 1: the namespaces (and
    # so every key) of deployments that store one block per value are unchanged.
    storage_blocks: int = 1
    # How a stored payload is arranged: "canonical" (token, head, dim: any engine reads it), or the name
    # of an engine layout whose own arrangement the values keep as is (``storage.payload: engine`` on vLLM
    # CPU: "cpu_attn_amx", "cpu_attn"); only instances whose KV cache is arranged the same read them.
    # Part of the digest, but only when not canonical, for the reason ``storage_blocks`` gives.
    payload: str = CANONICAL_PAYLOAD
    # Which KV cache group of a hybrid model (vLLM's hybrid KV cache manager: full attention, sliding
    # window, recurrent state) these values hold, and the model's whole group structure: see
    # ``kvtier.integrations.vllm.groups``.  Empty for a model with one group; part of the digest only when
    # set, for the reason ``storage_blocks`` gives, so a hybrid deployment never reads a plain one's values.
    kv_group: str = ""
    # The ``cache_salt`` tenant these values belong to, as its tag (:func:`tenant_tag`: never the salt,
    # which guards the tenant's prompts and would be readable in every manifest), when the deployment asks
    # for a namespace of its own per tenant (``security.tenant_namespace``): then quotas, the tools' scope
    # and the eviction guard are per tenant.  Part of the digest only when set, for the reason
    # ``storage_blocks`` gives: every deployment without it keeps the keys it had.
    tenant: str = ""

    def __post_init__(self) -> None:
        if self.attention not in ("mha", "mla"):
            raise ValueError(f"attention: expected 'mha' or 'mla', got {self.attention!r}")
        if not isinstance(self.payload, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", self.payload):
            raise ValueError(f"payload: expected 'canonical' or an engine layout name, got {self.payload!r}")
        if not known_algo(self.hash_algo):
            raise ValueError(algo_problem("hash_algo", self.hash_algo))
        for f in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size", "pp_size", "storage_blocks"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f}: expected an integer >= 1, got {v!r}")
        if not isinstance(self.tenant, str) or not re.fullmatch(r"(?:[0-9a-f]{16})?", self.tenant):
            raise ValueError(f"tenant: expected '' or a tenant tag of 16 hex digits (keys.tenant_tag), "
                             f"got {self.tenant!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank: expected 0 <= tp_rank < tp_size={self.tp_size}, got {self.tp_rank}")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank: expected 0 <= pp_rank < pp_size={self.pp_size}, got {self.pp_rank}")
        # Resolve the seed now (PYTHONHASHSEED / default) so the digest pins the seed actually used.
        object.__setattr__(self, "hash_seed", none_hash_seed(self.hash_algo, self.hash_seed))

    def manifest(self) -> dict[str, Any]:
        """The fields as a plain dict (JSON-able): what a tool shows for a namespace."""
        out = {f: getattr(self, f) for f in self.__dataclass_fields__}
        if out["storage_blocks"] == 1:
            del out["storage_blocks"]  # see the field: keys from before grouping existed stay the same
        if out["payload"] == CANONICAL_PAYLOAD:
            del out["payload"]  # likewise: canonical namespaces keep the keys they had
        if not out["kv_group"]:
            del out["kv_group"]  # likewise: one-group models keep the keys they had
        if not out["tenant"]:
            del out["tenant"]  # likewise: deployments without a tenant namespace keep the keys they had
        return out

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> Namespace:
        return cls(**manifest)

    # Computed once per (immutable) namespace: backend keys are built per block, and a cbor + sha256 of
    # the manifest per key was a measurable share of a simulated replay.
    @functools.cached_property
    def digest(self) -> bytes:
        """16 bytes; goes into every stored block's header."""
        return hashlib.sha256(cbor2.dumps(self.manifest(), canonical=True)).digest()[:16]

    @functools.cached_property
    def id(self) -> str:
        """The digest in hex: the prefix of every backend key."""
        return self.digest.hex()

    @functools.cached_property
    def layout_id(self) -> int:
        """A u32 naming dtype + layout, stored in the block header (a second check beside the digest)."""
        spec: tuple[str | int, ...] = (self.kv_dtype, self.num_layers, self.num_kv_heads, self.head_dim,
                                       self.block_size, self.attention)
        if self.payload != CANONICAL_PAYLOAD:
            spec += (self.payload,)
        if self.kv_group:
            spec += (self.kv_group,)
        return int.from_bytes(hashlib.sha256(cbor2.dumps(spec, canonical=True)).digest()[:4], "little")

    def hasher(self) -> BlockHasher:
        return BlockHasher(self.block_size, self.hash_algo, self.hash_seed)

    def key(self, block_hash: bytes) -> str:
        """The string a backend sees: ``<namespace id>/<block hash hex>``."""
        return f"{self.id}/{block_hash.hex()}"

    def keys(self, block_hashes: Sequence[bytes]) -> list[str]:
        prefix = self.id + "/"
        return [prefix + h.hex() for h in block_hashes]
