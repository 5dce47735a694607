"""The format room: what a block is as bytes, with no memory and no I/O of its own.

* :mod:`~kvtier.format.layout` - engine KV layouts and the canonical block payload (which bytes a block
  is, and in which order);
* :mod:`~kvtier.format.blockformat` - the stored value: a versioned header, the payload, its checksum;
* :mod:`~kvtier.format.groups` - stored values of several engine blocks (``storage.block_tokens``).

Invariant: nothing here imports another kvtier room but :mod:`kvtier.keys` (the namespace a layout
belongs to); moving bytes is :mod:`kvtier.memory`'s, which builds on this room and never the reverse.
"""
