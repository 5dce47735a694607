"""Block index: where a block is.

The scheduler-side map from a block key (the hash ``bytes`` from :mod:`kvtier.keys`) to where that block
lives: a device block id, a host slot, a set of storage backends (a bitmask over up to 32 backend indices),
plus a ref count, a hit count and the last access time.  It never touches a tensor.

Layout: struct-of-arrays.  A dict maps key -> slot (an int); every attribute is a column indexed by slot;
freed slots go on a free list and are reused; columns grow by doubling.  The integer columns are Python
lists, the access time an ``array.array`` of doubles: CPython specialises list indexing (7 ns a read or
write here) and not ``array.array``'s (18 ns a read, 31 a write), and an index operation is a dozen
such steps; numpy scans (backend candidates, long prefixes) copy the columns they read.  At 1 M entries
in host memory and a backend this costs ~270 B an entry (tracemalloc) including the 32-byte key ``bytes``
themselves (~200 B with ``array.array`` columns, for a simulated replay 35 % slower), where an object an
entry with an OrderedDict per tier costs several times that.

Tiers are codes of the int enum :class:`Tier`: ``DEVICE`` = 0, ``HOST`` = 1, backend ``i`` = ``2 + i``.

Invariant of the LRU lists: DEVICE and HOST each keep an intrusive doubly-linked list (prev/next columns)
that holds **exactly** the live entries present in that tier with ref count 0, least recently used at the
head.  Pinning (0 -> 1 refs) unlinks an entry, so eviction candidates are a walk from the head that never
meets a pinned entry; unpinning to 0 relinks it at the MRU end, the way vLLM's free-block queue treats a
released block.  Touch, set_device and set_host also move it to the MRU end.

Rooms: :mod:`.tiers` (tier codes, backend bitmasks), :mod:`.core` (the columns, LRU lists and every
single-key operation), :mod:`.batches` (the same operations over a request's keys, one call each) and
:mod:`.prefix` (longest-prefix lookups); :class:`BlockIndex` is all of them.
"""

from __future__ import annotations

from .batches import BatchOps
from .core import BlockEntry
from .prefix import SHORT_CHAIN, PrefixLookups, PrefixMatch
from .tiers import MAX_BACKENDS, TIER_OF_CODE, Tier, TierNames, tier_of


class BlockIndex(PrefixLookups, BatchOps):
    """key -> (device block id, host slot, backend set, refs, hits, last access), with per-tier LRU.

    Every single-key operation is O(1).  Not thread-safe: the tier stack calls it under its own lock, and
    readers (``lookup_prefix``) must hold it too, since a concurrent insert may grow the columns.

    Device block ids and host slots are unique: one id is held by at most one key (setting an id another
    key holds is a ValueError); they are small dense ints (reverse maps are arrays sized by the largest id).
    An entry may be present nowhere (e.g. a load in flight); lookups treat it as missing.
    """


__all__ = ["MAX_BACKENDS", "SHORT_CHAIN", "TIER_OF_CODE", "BlockEntry", "BlockIndex", "PrefixMatch", "Tier",
           "TierNames", "tier_of"]
