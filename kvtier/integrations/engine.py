"""A small serving engine: PagedLlama's compute + a device block pool + kvtier's tier stack.

It plays the part vLLM plays with a KV connector: per request it hashes the prompt, reuses blocks still
on the device, asks the stack for the longest stored prefix, loads it into freshly allocated device
blocks, computes only the rest, and stores the blocks it computed.  It is what ``kvtier run`` and the
P/D tests drive.

Invariant: a block is used as cached KV only if it is on the device under its key (pool hit) or the
stack reported it *loaded*; anything the stack could not load is recomputed, never read.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import torch

from ..format.layout import parse_dtype
from ..keys import tenant_tag
from ..memory.blockpool import BlockPool
from .hf_llama import PagedLlama, TinyLlamaSpec

# The dtypes the transformers model computes in on CPU and GPU alike (fp8 KV needs a real engine).
_COMPUTE_DTYPES = ("float32", "float16", "bfloat16")


@dataclass
class RequestResult:
    """What happened to one request: where its prefix came from, what was computed, what it produced."""

    num_prompt_tokens: int
    num_prompt_blocks: int                      # full blocks of the prompt (the hashable ones)
    device_blocks: int = 0                      # prefix blocks reused on the device
    loaded_blocks: dict[str, int] = field(default_factory=dict)  # tier name -> blocks loaded from it
    failed_blocks: int = 0                      # stored blocks that failed to load (recomputed)
    computed_tokens: int = 0
    tokens: list[int] = field(default_factory=list)
    step_logits: list[torch.Tensor] | None = None
    lookup_s: float = 0.0
    load_s: float = 0.0
    compute_s: float = 0.0
    store_s: float = 0.0
    stored_blocks: int = 0

    @property
    def cached_blocks(self) -> int:
        return self.device_blocks + sum(self.loaded_blocks.values())

    @property
    def saved_tokens(self) -> int:
        return self.num_prompt_tokens - self.computed_tokens


class CachedEngine:
    """Runs requests through PagedLlama with prefix reuse from the device pool and the tier stack."""

    def __init__(self, stack: Any, model: PagedLlama, pool: BlockPool):
        self.stack = stack
        self.model = model
        self.pool = pool
        self.hasher = stack.namespace.hasher()
        self.block_size = model.block_size
        # Wait for each request's writes to the backends before the next request: what the backends hold
        # (and so evict) then depends on the requests alone, not on how fast writes ran beside the model,
        # as ``kvtier simulate`` models it.  Off, writes overlap the next requests, as in a server.
        self.wait_writes = False

    @classmethod
    def from_config(cls, config: Any = None, *, num_blocks: int | None = None, seed: int = 0,
                    stack_kwargs: dict[str, Any] | None = None) -> CachedEngine:
        """Build model, pool and stack from a kvtier config (path, KvtierConfig or None = default)."""
        from ..config import KvtierConfig, load_config
        from ..stack import TierStack

        cfg = config if isinstance(config, KvtierConfig) else load_config(config)
        m = cfg.model
        if m.kv_dtype not in _COMPUTE_DTYPES:
            raise ValueError(f"model.kv_dtype: the built-in engine computes in float32/float16/bfloat16, "
                             f"got {m.kv_dtype!r}")
        if m.attention != "mha" or cfg.device.layout != "flash_attn":
            raise ValueError("the built-in engine runs model.attention 'mha' with device.layout 'flash_attn'")
        spec = TinyLlamaSpec(num_layers=m.num_layers, num_heads=m.num_kv_heads, num_kv_heads=m.num_kv_heads,
                             head_dim=m.head_dim, hidden_size=m.num_kv_heads * m.head_dim,
                             intermediate_size=2 * m.num_kv_heads * m.head_dim, seed=seed)
        nb = num_blocks or cfg.device.num_blocks
        device = "cuda" if cfg.device.kind == "cuda" or (cfg.device.kind == "auto" and
                                                       torch.cuda.is_available()) else "cpu"
        model = PagedLlama(spec, num_blocks=nb, block_size=m.block_size, dtype=parse_dtype(m.kv_dtype),
                           device=device, model_id=m.id)
        stack = TierStack(cfg, kv_caches=model.kv_caches, **(stack_kwargs or {}))
        pool = BlockPool(nb, on_evict=lambda keys, block_ids: stack.on_device_freed(block_ids))
        return cls(stack, model, pool)

    def run_request(self, prompt: Sequence[int], *, mm: Sequence[Any] = (), cache_salt: str | None = None,
                    lora: Any = None, max_new_tokens: int = 32, store: bool = True,
                    keep_logits: bool = False, use_cache: bool = True,
                    hashes: Sequence[bytes] | None = None) -> RequestResult:
        """Serve one request.  ``hashes``: the prompt's block hashes when the caller has them already
        (a simulation of a hashed trace); otherwise they are computed from ``prompt``."""
        B = self.block_size
        prompt = list(prompt)
        t0 = time.perf_counter()
        if hashes is None:
            hashes = self.hasher.hash_blocks(prompt, mm=mm, cache_salt=cache_salt, lora=lora)
        elif len(hashes := list(hashes)) > len(prompt) // B:
            raise ValueError(f"{len(hashes)} block hashes for a prompt of {len(prompt)} tokens "
                             f"(at most {len(prompt) // B} full blocks of {B})")
        total_blocks = -(-(len(prompt) + max_new_tokens) // B)
        if total_blocks > self.pool.num_blocks:  # no request finishing first would make room: refuse now
            raise ValueError(f"{len(prompt)} prompt + {max_new_tokens} new tokens need {total_blocks} device "
                             f"blocks of {B} tokens; the device pool has {self.pool.num_blocks} "
                             "(device.num_blocks, or --device-blocks)")
        res = RequestResult(len(prompt), len(hashes))
        # At least the last prompt token is computed: its logits start the generation.
        reusable = hashes[: (len(prompt) - 1) // B] if use_cache else []
        dev = self.pool.lookup_prefix(reusable)
        if dev:
            self.pool.touch(dev)
        res.device_blocks = len(dev)
        rest = reusable[len(dev):]
        try:
            found = self.stack.lookup(rest, start=len(dev)) if rest else None
            res.lookup_s = time.perf_counter() - t0
            new = self.pool.allocate(total_blocks - len(dev))
        except BaseException:
            self.pool.free(list(reversed(dev)))  # the prefix hit's references, taken above
            raise
        table = dev + new
        try:
            loaded = 0
            t1 = time.perf_counter()
            if found is not None and found.num_blocks:
                k = found.num_blocks
                out = self.stack.load(rest[:k], new[:k], start=len(dev)).wait()
                loaded = out.num_loaded
                res.failed_blocks = k - loaded
                res.loaded_blocks = found.names.count(found.tiers[:loaded])
            res.load_s = time.perf_counter() - t1
            cached_tokens = (len(dev) + loaded) * B
            res.computed_tokens = len(prompt) - cached_tokens
            t2 = time.perf_counter()
            res.tokens, logits = self.model.generate(prompt, table, cached_tokens, max_new_tokens)
            res.compute_s = time.perf_counter() - t2
            if keep_logits:
                res.step_logits = [x.cpu() for x in logits]
            # Full prompt blocks now hold valid KV under their keys: reusable on the device (the prefix
            # hit's blocks hold theirs already: referenced since lookup, no allocation could take them)...
            self.pool.cache_many(table[len(dev):len(hashes)], hashes[len(dev):])
            # ...and, for the ones computed here, worth storing (loaded ones are already stored).
            first_new = len(dev) + loaded
            if store and first_new < len(hashes):
                t3 = time.perf_counter()
                # Stored values of several blocks are whole groups from a group boundary: the store
                # starts there (blocks before first_new are valid on the device too).
                g = getattr(self.stack, "storage_blocks", 1)
                s0 = first_new // g * g
                # A salted request's blocks are charged to its tenant's quota in the backends.
                tenant = tenant_tag(cache_salt) if cache_salt else None
                self.stack.store(hashes[s0:], table[s0 : len(hashes)], start=s0, tenant=tenant).wait()
                res.store_s = time.perf_counter() - t3
                res.stored_blocks = len(hashes) - first_new
                if self.wait_writes:
                    self.stack.flush()
        finally:
            # Tail first, so a request's prefix outlives its suffix in the free queue (as vLLM does).
            self.pool.free(list(reversed(table)))
        return res

    def flush(self, timeout: float | None = None) -> None:
        self.stack.flush(timeout)

    def close(self) -> None:
        self.stack.close()
