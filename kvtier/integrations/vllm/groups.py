"""vLLM's KV cache groups as kvtier sees them: one stream of stored values per group.

vLLM's hybrid KV cache manager (HMA) gives every kind of layer its own KV cache *group*, each with its
own block table over one shared block pool: full attention, sliding-window attention, and the
recurrent state of linear-attention / SSM layers (Mamba, gated delta net), which vLLM keeps per block
in its "align" mode (block ``i`` of a state group holds the state after ``(i + 1) * block_size``
tokens, where a scheduler step ended or checkpointed there).  kvtier stores each group as a stream of
its own, keyed by vLLM's block hashes in a namespace that names the group and the model's whole group
structure (:attr:`kvtier.keys.Namespace.kv_group`):

* a **full attention** group stores every prompt block, as a one-group model does;
* a **sliding window** group stores every prompt block too, copied out in the step that computes it
  (vLLM frees a block once it leaves the window and hands its id to another request), so a hit can
  land at any block; a load restores only the blocks inside the window ending at the hit (vLLM
  allocates nothing for the others);
* a **state** group stores the states vLLM hands over at block boundaries
  (``KVConnectorBlockState.boundary_state_offloads``), one value per boundary: each layer's state page
  as vLLM keeps it (its conv state, then its SSM state, unpadded).  The namespace holds the state shapes
  and dtypes, so any other arrangement is another namespace.

A hit is offered only at a block where every group can be restored: every full-attention block before
it, every window block, and the state at it.

Invariants: a model with one group has an empty ``kv_group`` (its keys are the ones it always had);
group descriptors differ between any two groups of one model and between any two group structures.
"""

from __future__ import annotations

import dataclasses
import enum
import math
from dataclasses import dataclass
from typing import Any

from ...config import KvtierConfig


class GroupKind(enum.Enum):
    FULL = "full"
    SLIDING = "sliding_window"
    STATE = "state"


@dataclass(frozen=True)
class KvGroup:
    """One KV cache group: its index in vLLM's ``kv_cache_groups``, kind, layers and sizes."""

    index: int
    kind: GroupKind
    layer_names: tuple[str, ...]
    block_size: int  # tokens per block
    window: int = 0  # sliding window in tokens (SLIDING)
    state_row_nbytes: int = 0  # one layer's state page without padding (STATE)
    state_spec: str = ""  # shapes and dtypes of the state tensors (STATE)
    descriptor: str = ""  # Namespace.kv_group; "" for a model with one group
    block_nbytes: int = 0  # one block of all the group's layers as vLLM holds it (unpadded)

    @property
    def is_attention(self) -> bool:
        return self.kind is not GroupKind.STATE

    def window_blocks(self) -> int:
        """Blocks a hit needs from a sliding window group (vLLM's own count: cdiv(window - 1, block_size))."""
        return max(1, math.ceil((self.window - 1) / self.block_size)) if self.kind is GroupKind.SLIDING else 0

    def label(self) -> str:
        if self.kind is GroupKind.SLIDING:
            return f"sliding_window({self.window})"
        if self.kind is GroupKind.STATE:
            return f"state({self.state_spec})"
        return "full"


def _dtype_name(d: Any) -> str:
    return str(d).removeprefix("torch.")


def kv_groups(kv_cache_config: Any) -> list[KvGroup]:
    """The groups of vLLM's ``KVCacheConfig``, in vLLM's order.  A kind kvtier cannot store (cross
    attention, chunked local attention, ...) is an error naming it, at start-up."""
    from vllm.v1.kv_cache_interface import FullAttentionSpec, MambaSpec, MLAAttentionSpec, SlidingWindowSpec

    raw = []
    for i, g in enumerate(kv_cache_config.kv_cache_groups):
        spec = g.kv_cache_spec
        names = tuple(g.layer_names)
        if isinstance(spec, SlidingWindowSpec):
            raw.append(KvGroup(i, GroupKind.SLIDING, names, int(spec.block_size), window=int(spec.sliding_window),
                               block_nbytes=int(spec.page_size_bytes) * len(names)))
        elif isinstance(spec, MambaSpec):
            import torch

            parts = [(tuple(int(x) for x in shape), dt) for shape, dt in zip(spec.shapes, spec.dtypes)]
            nbytes = sum(math.prod(s) * torch.empty((), dtype=dt).element_size() for s, dt in parts)
            desc = "+".join(f"{list(s)}:{_dtype_name(dt)}" for s, dt in parts)
            mtype = str(getattr(spec, "mamba_type", "")).rsplit(".", 1)[-1].lower()
            raw.append(KvGroup(i, GroupKind.STATE, names, int(spec.block_size), state_row_nbytes=int(nbytes),
                               state_spec=f"{mtype} {desc}" if mtype else desc,
                               block_nbytes=int(nbytes) * len(names)))
        elif type(spec) in (FullAttentionSpec, MLAAttentionSpec):
            raw.append(KvGroup(i, GroupKind.FULL, names, int(spec.block_size),
                               block_nbytes=int(spec.page_size_bytes) * len(names)))
        else:
            raise ValueError(f"kvtier: KV cache group {i} ({', '.join(names[:3])}) is {type(spec).__name__}, "
                             "which kvtier cannot store (it stores full attention, sliding window and "
                             "Mamba / gated-delta state groups)")
    if len(raw) == 1:
        return raw
    structure = ", ".join(f"{g.label()} x{len(g.layer_names)}" for g in raw)
    return [dataclasses.replace(g, descriptor=f"group {g.index} of [{structure}]: {g.label()}, layers "
                                              + ",".join(g.layer_names)) for g in raw]


def group_config(base: KvtierConfig, group: KvGroup, host_share: float) -> KvtierConfig:
    """``base`` (the deployment's config, its ``model`` filled from vLLM) for one group's stream: the
    group's layers and descriptor in the namespace, ``host_share`` of the host memory.  A state group's
    value is one row of raw bytes per layer (an MLA-shaped layout of one ``int8`` row of
    ``state_row_nbytes``, one "token" per block), never grouped (``storage.block_tokens``: each boundary
    state is a value of its own)."""
    if not group.descriptor:
        return base
    model: dict[str, Any] = {"num_layers": len(group.layer_names), "kv_group": group.descriptor}
    update: dict[str, Any] = {}
    if group.kind is GroupKind.STATE:
        model.update(kv_dtype="int8", num_kv_heads=1, head_dim=group.state_row_nbytes, block_size=1,
                     attention="mla")
        update["device"] = base.device.model_copy(update={"layout": "mla"})
        update["storage"] = base.storage.model_copy(update={"block_tokens": None, "payload": "canonical"})
    update["model"] = base.model.model_copy(update=model)
    update["host"] = base.host.model_copy(update={"capacity": int(base.host.capacity * host_share)})
    return base.model_copy(update=update)


def host_shares(groups: list[KvGroup]) -> dict[int, float]:
    """Each group's share of host memory: in proportion to the bytes of one of its blocks."""
    total = sum(g.block_nbytes for g in groups) or 1
    return {g.index: g.block_nbytes / total for g in groups}
