"""Host slots without bytes: which slots of a host tier are free, being written, or hold a block.

The bookkeeping half of :class:`~kvtier.memory.host.HostTier`, torch-free by import, so the planner (which
decides which slot a block goes to) and a simulation (which has slots and no bytes) run the same code as
the worker's slab.

Slot life cycle::

    FREE --allocate/take--> WRITING --commit--> READY --free--> FREE
                               |  ^                  |            ^
                               |  +------reuse-------+            |
                               +---------------free---------------+

(``reuse``: the block a READY slot held is evicted and the slot handed straight to the block that takes its
place, so a plan can name that slot before the eviction happens; ``take``: named FREE slots, for a planner
that follows a plan another planner made.)

Invariants:
* nothing here waits: ``allocate`` returns what it can at once (``skipped`` counts the rest), lowest slot
  first (fresh allocations are contiguous runs, which copy in one piece);
* only READY slots hold a valid block; WRITING slots are being filled and are never readable;
* a slot is in exactly one state, and ``num_free + writing + ready == num_slots``; the free list holds
  the FREE slots, sorted, each once (the count checked by ``counts``, the whole by ``check``).

All methods are thread-safe.
"""

from __future__ import annotations

import bisect
import enum
import threading
from collections.abc import Hashable, Sequence
from dataclasses import dataclass


class SlotState(enum.Enum):
    """The state of one host slot (the life cycle above)."""

    FREE = "free"
    WRITING = "writing"
    READY = "ready"


FREE, WRITING, READY = SlotState.FREE, SlotState.WRITING, SlotState.READY


@dataclass
class Allocation:
    """Result of :meth:`SlotTable.allocate`: the slots obtained (in WRITING state) and how many of the
    requested were not (``skipped``: count them as skipped stores, or make room and ask again)."""

    slots: list[int]
    skipped: int = 0


@dataclass(frozen=True)
class SlotCounts:
    """Slots by state, and the allocations asked for since start."""

    num_slots: int
    free: int
    writing: int
    ready: int
    allocated: int  # slots handed out since start
    skipped: int  # slots asked for but not available


class SlotTable:
    """``num_slots`` slots: a free list (lowest first), per-slot state and key.  No recency, no pins: the
    owner of the blocks (the planner's index and eviction policy) decides which block leaves."""

    def __init__(self, num_slots: int):
        if num_slots < 1:
            raise ValueError(f"num_slots: expected >= 1, got {num_slots}")
        self.num_slots = num_slots
        self._lock = threading.Lock()
        self._state = [FREE] * num_slots
        self._key: list[Hashable | None] = [None] * num_slots
        # The FREE slots, negated and sorted (so the lowest slots are at the end): an allocation is a slice
        # off the end (lowest first, in C, moving nothing), where a heap popped slot by slot; a freed slot
        # goes in by bisection.
        self._free = list(range(-num_slots + 1, 1))
        self._n_free = num_slots
        self._n_writing = self._n_ready = 0
        self._allocated = self._skipped = 0

    # ------------------------------------------------------------------ state changes

    def allocate(self, n: int) -> Allocation:
        """Up to ``n`` FREE slots, now WRITING, lowest first.  Never waits and never evicts: making room
        is the caller's decision (it knows which blocks are least recently used)."""
        if n < 0:
            raise ValueError(f"allocate: n must be >= 0, got {n}")
        with self._lock:
            free, state = self._free, self._state
            slots = [-s for s in reversed(free[-n:])] if n else []
            if n:
                del free[-n:]
            for s in slots:
                state[s] = WRITING
            got = len(slots)
            self._n_free -= got
            self._n_writing += got
            self._allocated += got
            self._skipped += n - got
            return Allocation(slots, n - got)

    def take(self, slots: Sequence[int]) -> None:
        """FREE -> WRITING for exactly these slots (a plan made elsewhere named them).  All or nothing:
        raises ValueError naming a slot that is not FREE."""
        with self._lock:
            self._expect(slots, (FREE,), "take")
            free = self._free
            for s in slots:
                self._state[s] = WRITING
                del free[bisect.bisect_left(free, -s)]
            self._n_free -= len(slots)
            self._n_writing += len(slots)
            self._allocated += len(slots)

    def commit(self, slots: Sequence[int], keys: Sequence[Hashable] | None = None) -> None:
        """WRITING -> READY: the slots now hold valid blocks (optionally tagged with ``keys``).
        Commit only slots whose bytes fully arrived."""
        if keys is not None and len(keys) != len(slots):
            raise ValueError(f"commit: {len(slots)} slots but {len(keys)} keys")
        with self._lock:
            state, key, n = self._state, self._key, self.num_slots
            # Checked as it goes (one pass: this runs for every block a store or a read lands); a wrong
            # slot, or one given twice (READY by then), undoes what this call did and _expect names it.
            for done, (s, k) in enumerate(zip(slots, keys if keys is not None else [None] * len(slots))):
                if not 0 <= s < n or state[s] is not WRITING:
                    for u in slots[:done]:
                        state[u] = WRITING
                        key[u] = None
                    self._expect(slots, (WRITING,), "commit")
                    raise AssertionError(f"commit: slot {s} refused but not named")  # _expect always raises here
                state[s] = READY
                key[s] = k
            self._n_writing -= len(slots)
            self._n_ready += len(slots)

    def reuse(self, slots: Sequence[int]) -> None:
        """READY -> WRITING: the blocks these slots held are gone (evicted), and each slot goes to the block
        planned to take its place, never back to the free list where another caller could take it.
        All or nothing."""
        with self._lock:
            self._expect(slots, (READY,), "reuse")
            for s in slots:
                self._state[s] = WRITING
                self._key[s] = None
            self._n_ready -= len(slots)
            self._n_writing += len(slots)
            self._allocated += len(slots)

    def free(self, slots: Sequence[int]) -> None:
        """Back to FREE (a failed or abandoned write, an evicted block, a dropped one).  Raises for a slot
        already free; all or nothing."""
        with self._lock:
            self._expect(slots, (WRITING, READY), "free")
            for s in slots:
                st = self._state[s]
                if st == WRITING:
                    self._n_writing -= 1
                else:
                    self._n_ready -= 1
                self._state[s] = FREE
                self._key[s] = None
                bisect.insort(self._free, -s)
            self._n_free += len(slots)

    def holds(self, slots: Sequence[int], keys: Sequence[Hashable] | None = None) -> list[bool]:
        """Per slot, whether it is READY (and, with ``keys``, still holds that key: it may have been
        evicted and refilled since the caller looked it up).  A check, not a claim: the caller keeps the
        slot from being freed while it reads it (the stack: an index reference)."""
        if keys is not None and len(keys) != len(slots):
            raise ValueError(f"holds: {len(slots)} slots but {len(keys)} keys")
        with self._lock:
            return [self._state[self.check_slot(s)] == READY and (keys is None or self._key[s] == keys[i])
                    for i, s in enumerate(slots)]

    # ------------------------------------------------------------------ queries

    def in_state(self, slots: Sequence[int], state: SlotState) -> list[bool]:
        """Per slot, whether it is in ``state`` (False for a slot out of range): one look under the lock
        for a whole batch, where ``state()`` per slot cost a transfer's submission a call per block."""
        n, st = self.num_slots, self._state
        with self._lock:
            return [0 <= s < n and st[s] is state for s in slots]

    def state(self, slot: int) -> SlotState:
        return self._state[self.check_slot(slot)]

    def key(self, slot: int) -> Hashable | None:
        return self._key[self.check_slot(slot)]

    @property
    def num_free(self) -> int:
        return self._n_free

    def counts(self) -> SlotCounts:
        with self._lock:
            out = SlotCounts(self.num_slots, self._n_free, self._n_writing, self._n_ready, self._allocated,
                             self._skipped)
        if out.free + out.writing + out.ready != out.num_slots:
            raise AssertionError(f"host slots: {out} do not add up")
        return out

    def check(self) -> None:
        """The invariants above, over every slot (O(slots): tests, and a planner's ``check_locked``)."""
        c = self.counts()
        with self._lock:
            free = [-s for s in reversed(self._free)]
            free_states = [self._state[s] for s in free]
            n_free = sum(st is FREE for st in self._state)
        if free != sorted(set(free)) or len(free) != c.free or n_free != c.free or any(
                st is not FREE for st in free_states):
            raise AssertionError(f"host slots: the free list is not the {c.free} FREE slots, sorted")

    # ------------------------------------------------------------------ internals

    def check_slot(self, s: int) -> int:
        if not 0 <= s < self.num_slots:
            raise IndexError(f"slot {s} out of range [0, {self.num_slots})")
        return s

    def _expect(self, slots: Sequence[int], states: tuple[SlotState, ...], what: str) -> None:
        st, n = self._state, self.num_slots
        # One pass for the usual case (every slot in range, in an expected state, once); only a refusal
        # walks the slots again to name the first wrong one.
        if len(states) == 1:
            want = states[0]
            wrong = [s for s in slots if not 0 <= s < n or st[s] is not want]
        else:
            wrong = [s for s in slots if not 0 <= s < n or st[s] not in states]
        if not wrong and len(set(slots)) == len(slots):
            return
        seen = set()
        for s in slots:
            if self._state[self.check_slot(s)] not in states:
                raise ValueError(f"{what}: slot {s} is {self._state[s].value}, expected "
                                 f"{' or '.join(x.value for x in states)}")
            if s in seen:
                raise ValueError(f"{what}: slot {s} given twice")
            seen.add(s)


