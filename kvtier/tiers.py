"""Memory that holds blocks: the device tier (the engine's KV tensors) and the host tier (a slab of slots).

The implementation lives in three small modules; this one gathers their public names:

* :mod:`kvtier.device` - :class:`DeviceTier`: registered KV tensors, gather / scatter of whole blocks or
  of some layers, between the KV device and payload rows (host slab or staging); its row copies are
  :mod:`kvtier.rows`, its host <-> GPU byte ranges :mod:`kvtier.copy2d`;
* :mod:`kvtier.host` - :class:`HostTier`: the pre-allocated (page-locked when CUDA exists) slab, free
  list and slot states (pins and recency are the block index's); never waits;
* :mod:`kvtier.blockpool` - :class:`BlockPool`: device block ids for standalone use (free queue with LRU
  reuse of cached blocks and ref counts, as vLLM's KV cache manager).

Moving bytes asynchronously between the two tiers is :mod:`kvtier.transfer`.
"""

from .blockpool import BlockPool, PoolExhausted
from .copy2d import memcpy2d_available
from .device import DeviceTier
from .host import FREE, READY, WRITING, Allocation, HostTier, HostTierStats, SlotState, resolve_pin_memory

__all__ = ["FREE", "READY", "WRITING", "Allocation", "BlockPool", "DeviceTier", "HostTier", "SlotState",
           "HostTierStats", "PoolExhausted", "memcpy2d_available", "resolve_pin_memory"]
