"""A real transformers Llama whose KV cache is paged like vLLM's FlashAttention cache.

This is the engine kvtier proves itself on (tests, ``kvtier run``): the model is built from a config with
seeded random weights (nothing is downloaded), and its KV lives in per-layer tensors
``[2, num_blocks, block_size, num_kv_heads, head_dim]`` registered with kvtier's device tier.  A forward
pass reads the KV of earlier positions from the pages named by a block table and writes the KV of the new
positions back into them, so blocks loaded from storage are used exactly like blocks computed here.

Invariant: the KV of position ``p`` of a sequence lives at ``kv[layer][:, block_table[p // B], p % B]``.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from ..format.layout import dtype_name
from ..keys import Namespace


@dataclass(frozen=True)
class TinyLlamaSpec:
    """The shape of the test model; small enough to run on two CPU cores in seconds."""

    vocab_size: int = 2048
    hidden_size: int = 128
    intermediate_size: int = 256
    num_layers: int = 4
    num_heads: int = 4
    num_kv_heads: int = 4
    head_dim: int = 32
    max_positions: int = 8192
    seed: int = 0
    # Larger than Llama's 0.02 so random weights give varied greedy tokens: a test comparing two token
    # streams then compares something (at 0.02 every step repeats one token).
    init_std: float = 0.1

    def hf_config(self) -> Any:
        from transformers import LlamaConfig

        return LlamaConfig(
            vocab_size=self.vocab_size, hidden_size=self.hidden_size,
            intermediate_size=self.intermediate_size, num_hidden_layers=self.num_layers,
            num_attention_heads=self.num_heads, num_key_value_heads=self.num_kv_heads,
            head_dim=self.head_dim, max_position_embeddings=self.max_positions,
            initializer_range=self.init_std)


class PagedLlama:
    """Runs a ``LlamaForCausalLM`` (seeded random weights) over a paged KV cache.

    The scheduler side (which blocks are cached, which to load) is kvtier's; this class only computes.
    """

    def __init__(self, spec: TinyLlamaSpec | None = None, *, num_blocks: int, block_size: int,
                 dtype: torch.dtype = torch.float32, device: str | torch.device = "cpu",
                 model_id: str = "kvtier/tiny-llama"):
        from transformers import LlamaForCausalLM

        self.spec = spec or TinyLlamaSpec()
        self.block_size = block_size
        self.num_blocks = num_blocks
        self.dtype = dtype
        self.device = torch.device(device)
        self.model_id = model_id
        # Same seed -> same weights in every process: prefill and decode run "the same model".
        with torch.random.fork_rng(devices=[]):
            torch.manual_seed(self.spec.seed)
            self.model = LlamaForCausalLM(self.spec.hf_config())
        # transformers types PreTrainedModel.to through a decorator mypy reads as unbound
        self.model = self.model.to(device=self.device, dtype=dtype).eval()  # type: ignore[call-arg]
        s = self.spec
        self.kv_caches = [
            torch.zeros(2, num_blocks, block_size, s.num_kv_heads, s.head_dim, dtype=dtype, device=self.device)
            for _ in range(s.num_layers)
        ]

    def namespace(self, **overrides: Any) -> Namespace:
        """The namespace this engine's blocks belong to (model, dtype, layout)."""
        s = self.spec
        fields: dict[str, Any] = dict(model=self.model_id, kv_dtype=dtype_name(self.dtype),
                      num_layers=s.num_layers, num_kv_heads=s.num_kv_heads, head_dim=s.head_dim,
                      block_size=self.block_size)
        fields.update(overrides)
        return Namespace(**fields)

    # ------------------------------------------------------------------ compute

    @torch.no_grad()
    def forward(self, token_ids: Sequence[int], block_table: Sequence[int], start: int) -> torch.Tensor:
        """Logits ``[len(token_ids), vocab]`` for positions ``start .. start+n-1``.

        The KV of positions ``< start`` is read from ``block_table``'s pages; the KV of the new positions is
        written into them.  ``block_table`` must cover every position up to ``start + n - 1``.
        """
        from transformers import DynamicCache

        n = len(token_ids)
        B = self.block_size
        end = start + n
        if n == 0:
            raise ValueError("forward: no tokens")
        need = -(-end // B)
        if len(block_table) < need:
            raise ValueError(f"forward: positions up to {end - 1} need {need} blocks, "
                             f"block table has {len(block_table)}")
        table = torch.as_tensor(list(block_table[:need]), dtype=torch.long, device=self.device)
        bad = [b for b in block_table[:need] if not 0 <= b < self.num_blocks]
        if bad:
            raise ValueError(f"forward: block id {bad[0]} outside [0, {self.num_blocks})")
        cache = DynamicCache()
        if start:
            for layer, kv in enumerate(self.kv_caches):
                k, v = self._read_pages(kv, table, start)
                cache.update(k, v, layer)
        ids = torch.as_tensor([list(token_ids)], dtype=torch.long, device=self.device)
        pos = torch.arange(start, end, device=self.device).unsqueeze(0)
        out = self.model(input_ids=ids, position_ids=pos, past_key_values=cache, use_cache=True)
        slots = table[torch.arange(start, end, device=self.device) // B] * B + \
            torch.arange(start, end, device=self.device) % B
        for layer, kv in enumerate(self.kv_caches):
            lay = out.past_key_values.layers[layer]
            # [1, heads, seq, dim] -> the new positions as [n, heads, dim]
            for i, t in enumerate((lay.keys, lay.values)):
                kv[i].view(-1, *kv.shape[3:])[slots] = t[0, :, start:end].transpose(0, 1).to(self.dtype)
        logits: torch.Tensor = out.logits[0].float()
        return logits

    def _read_pages(self, kv: torch.Tensor, table: torch.Tensor,
                    length: int) -> tuple[torch.Tensor, torch.Tensor]:
        flat = kv[:, table].reshape(2, -1, *kv.shape[3:])[:, :length]  # [2, length, heads, dim]
        k = flat[0].transpose(0, 1).unsqueeze(0).contiguous()
        v = flat[1].transpose(0, 1).unsqueeze(0).contiguous()
        return k, v

    @torch.no_grad()
    def generate(self, prompt: Sequence[int], block_table: Sequence[int], num_cached_tokens: int,
                 max_new_tokens: int) -> tuple[list[int], list[torch.Tensor]]:
        """Greedy decoding.  Positions ``< num_cached_tokens`` must already be in the pages (loaded from
        kvtier); the rest of the prompt is computed.  Returns the new tokens and the logits of each step
        (step 0 = the prompt's last position)."""
        if not 0 <= num_cached_tokens < len(prompt):
            raise ValueError(f"generate: num_cached_tokens={num_cached_tokens} must be in [0, {len(prompt)})")
        logits = self.forward(prompt[num_cached_tokens:], block_table, num_cached_tokens)[-1]
        tokens: list[int] = []
        steps = [logits]
        pos = len(prompt)
        for _ in range(max_new_tokens):
            nxt = int(torch.argmax(logits))
            tokens.append(nxt)
            if len(tokens) == max_new_tokens:
                break
            logits = self.forward([nxt], block_table, pos)[-1]
            steps.append(logits)
            pos += 1
        return tokens, steps
