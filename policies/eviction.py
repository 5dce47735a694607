"""Built-in eviction policy: least recently used first."""

from __future__ import annotations

from kvtier.index import BlockIndex
from kvtier.policy_api import EvictionPolicy


class LRU(EvictionPolicy):
    """The least recently used unpinned blocks of a tier, oldest first.  The order is the index's own
    per-tier LRU list (stores, loads and hits move a block to the most recent end; pinned blocks are not
    in it), so choosing ``n`` victims costs O(n)."""

    def victims(self, index: BlockIndex, tier: int, n: int) -> list[bytes]:
        return index.eviction_candidates(tier, n) if n > 0 else []


__all__ = ["LRU"]
