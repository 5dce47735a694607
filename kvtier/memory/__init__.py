"""The memory room: memory that holds blocks and the copies between it.

* :mod:`~kvtier.memory.device` - :class:`DeviceTier`: registered KV tensors, gather / scatter of whole
  blocks or of some layers, between the KV device and payload rows (host slab or staging); its row copies
  are :mod:`~kvtier.memory.rows`, its host <-> GPU byte ranges :mod:`~kvtier.memory.copy2d`;
* :mod:`~kvtier.memory.host` - :class:`HostTier`: the pre-allocated (page-locked when CUDA exists) slab;
  its slot states are :mod:`~kvtier.memory.host_slots` (torch-free, so the planner decides on them);
* :mod:`~kvtier.memory.blockpool` - :class:`BlockPool`: device block ids for standalone use (free queue
  with LRU reuse of cached blocks and ref counts, as vLLM's KV cache manager);
* :mod:`~kvtier.memory.transfer` - moving bytes asynchronously between the two tiers;
* :mod:`~kvtier.memory.blockids` - block ids and slots as callers hold them, normalised.

Import from the submodules (this package imports none of them: the planner imports
:mod:`~kvtier.memory.host_slots` and stays torch-free).  Invariant: memory builds on :mod:`kvtier.format` (what the
bytes are) and decides nothing about placement: which block goes to which slot is the planner's
(:mod:`kvtier.tiering`).
"""
