"""Small hybrid models with seeded random weights, built locally (nothing downloaded), for vLLM's CPU build:
what kvtier's hybrid tests and ``kvtier bench vllm --model swa|hybrid`` serve.

* :func:`build_swa_model`: Gemma-3-shaped, sliding-window attention beside full attention (three sliding
  layers with a 128-token window, one full layer): vLLM's hybrid KV cache manager gives it a sliding
  window group per sliding layer and a full attention group.
* :func:`build_gdn_model`: Qwen3-Next-shaped, gated delta net (linear attention) beside full attention
  (three GDN layers, one full layer; a tiny MoE): a state group per GDN layer, in vLLM's "align" mode.

Why these two: vLLM 0.32's CPU build serves both (its CPU GDN prefill kernel); its Mamba2 hybrids (Granite 4,
NemotronH, Falcon-H1) fail on CPU at the first prefill longer than one block (``mamba_mixer2``: IndexError
in ``varlen_states[last_chunk_indices_p]``: the CPU chunk scan returns final states only, and Mamba2 asks
for a checkpoint inside the prefill), and Bamba is no longer in vLLM.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

#: Tokens per block vLLM gives the GDN model on CPU at its default head dim of 64 (vLLM raises the attention
#: block size, in steps of 32, until one attention page holds a state page: 96 here whatever block size is
#: asked for; 64 at head dim 128).  That holds with the SSM state in float32, which the drivers ask for
#: (``mamba_ssm_cache_dtype``): vLLM keeps it in float32 anyway on a CPU with AVX-512 BF16 (its accelerated
#: GDN path) and in the model's dtype on others, so the page, and the block size, would differ by machine
#: (160 tokens on the former with four value heads).  Two value heads: a float32 state page of 34 KiB
#: still fits one 96-token attention page (48 KiB) and not a 64-token one.
GDN_BLOCK_SIZE = 96
#: The SSM state's dtype every driver asks vLLM for (see GDN_BLOCK_SIZE).
GDN_STATE_DTYPE = "float32"
SWA_WINDOW = 128


def _save(model: Any, out: str | Path) -> str:
    import torch

    Path(out).mkdir(parents=True, exist_ok=True)
    model.to(torch.bfloat16).save_pretrained(out)
    return str(out)


def build_swa_model(out: str | Path, *, layers: int = 4, head_dim: int = 64, kv_heads: int = 2) -> str:
    """A Gemma-3-shaped text model: every fourth layer full attention, the others a 128-token sliding window."""
    import torch
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    kinds = ["full_attention" if (i + 1) % 4 == 0 else "sliding_attention" for i in range(layers)]
    cfg = Gemma3TextConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                           num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=head_dim,
                           max_position_embeddings=16384, sliding_window=SWA_WINDOW, layer_types=kinds,
                           tie_word_embeddings=True)
    return _save(Gemma3ForCausalLM(cfg), out)


def build_gdn_model(out: str | Path, *, layers: int = 4, head_dim: int = 64, kv_heads: int = 2) -> str:
    """A Qwen3-Next-shaped model: every fourth layer full attention, the others gated delta net."""
    import torch
    from transformers import Qwen3NextConfig, Qwen3NextForCausalLM

    torch.manual_seed(0)
    kinds = ["full_attention" if (i + 1) % 4 == 0 else "linear_attention" for i in range(layers)]
    cfg = Qwen3NextConfig(vocab_size=512, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                          num_attention_heads=4, num_key_value_heads=kv_heads, head_dim=head_dim,
                          max_position_embeddings=16384, layer_types=kinds,
                          linear_num_value_heads=2, linear_num_key_heads=2, linear_key_head_dim=64,
                          linear_value_head_dim=64, linear_conv_kernel_dim=4,
                          num_experts=4, num_experts_per_tok=2, moe_intermediate_size=128,
                          shared_expert_intermediate_size=128, decoder_sparse_step=1, mlp_only_layers=[],
                          tie_word_embeddings=False)
    return _save(Qwen3NextForCausalLM(cfg), out)


BUILDERS = {"swa": build_swa_model, "gdn": build_gdn_model}
