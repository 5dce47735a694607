"""Built-in write policies: when a block in host memory is copied down to the backends.

==========================  ==============================================================
``write_through``           copied down as soon as it lands in host memory
``write_through_selective`` copied down once it has ``threshold`` hits (SGLang uses 2)
``write_back``              copied down only when it is evicted from host memory; the
                            eviction completes the copy first, then frees the slot
==========================  ==============================================================
"""

from __future__ import annotations

from collections.abc import Sequence

from pydantic import Field

from kvtier.policy_api import PolicyOptions, WritePolicy


class WriteThrough(WritePolicy):
    """Every block goes down to every writable backend at once.  Invariant: a block stored and then
    flushed is in every writable backend that accepted it."""

    def on_store(self, key: bytes) -> bool:
        return True

    def sends_on_store(self, keys: Sequence[bytes]) -> list[bytes]:
        # Every block, without a call each (a subclass answering per block is asked per block).
        if type(self).on_store is WriteThrough.on_store:
            return list(keys)
        return super().sends_on_store(keys)


class WriteThroughSelective(WritePolicy):
    """Only blocks that are reused go down: a block is copied once its hit count reaches ``threshold``
    (a store of a block already held, or a load of it, is a hit).  Invariant: a block with fewer hits
    is never written by this policy."""

    class Options(PolicyOptions):
        threshold: int = Field(2, ge=1, description="hits before a block is copied down")

    options: Options

    def on_store(self, key: bytes) -> bool:
        return False

    def on_hit(self, key: bytes, hits: int) -> bool:
        return hits >= self.options.threshold


class WriteBack(WritePolicy):
    """Blocks go down only when they leave host memory.  Invariant: an evicted block's slot is freed
    only after a backend holds the block (or the eviction is abandoned and the block stays)."""

    def on_evict(self, key: bytes) -> bool:
        return True


__all__ = ["WriteBack", "WriteThrough", "WriteThroughSelective"]
