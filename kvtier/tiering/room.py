"""A read's host room, run: the planner's :class:`~kvtier.tiering.planner.Room` for every block a read (a
load's or a prefetch's backend values) puts in host memory, handed out chunk by chunk.

The room is decided once, before the read's first value: which slot each block goes to.  The read then
asks for the slots of the blocks its next chunk brings up; a victim whose slot a block needs is copied
down only then (so a chunk's reads wait on its own write-backs alone, as when room was made per chunk),
through the executor's ``write_back`` (the real stack's :class:`~kvtier.tiering.store_path.HostRoom`, or
the simulator's ledger).  Torch-free, so the simulator runs the same hand-out as the stack.

Invariants:
* a block gets the slot the room named for it, or none (its victim was not copied down, or it was not
  in the plan): never a slot the room did not name;
* every slot and victim of the room is settled exactly once: handed out (the reader commits or releases
  it), or at :meth:`Reservation.close` released (a free slot never handed out) or abandoned (a victim never
  copied down).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

from .planner import CopyDown, Planner, Room

#: Copy held victims down and return the slots of those handed over (``Planner.written_back_locked``).
WriteBack = Callable[[Sequence[CopyDown]], list[int]]


class Reservation:
    """The room of one read, position by position (``positions[k]`` goes to ``room.order()[k]``)."""

    def __init__(self, planner: Planner, room: Room, positions: Sequence[int], write_back: WriteBack):
        self.planner = planner
        self.room = room
        self.write_back = write_back
        order = room.order()
        self._index = {pos: k for k, pos in enumerate(positions[:len(order)])}
        self._order = order
        self._n_free = len(room.slots)
        self._given: set[int] = set()  # room indices handed out
        self._victim_done: dict[int, bool] = {}  # victim index -> its slot was handed over
        self._closed = False

    @classmethod
    def take(cls, planner: Planner, positions: Sequence[int], write_back: WriteBack) -> Reservation:
        """Decide the room of a read that puts the blocks at ``positions`` (in order) in host memory."""
        if planner.slots is None or not positions:
            return cls(planner, Room([], []), [], write_back)
        with planner.lock:
            room = planner.take_room_locked(len(positions))
        return cls(planner, room, positions, write_back)

    @classmethod
    def follow(cls, planner: Planner, room: Room, positions: Sequence[int], write_back: WriteBack) -> Reservation:
        """Follow a room a leading planner decided for a read of ``positions`` (``LeadLoad``): the same
        slots and victims here (``Planner.adopt_room_locked``; raises its ``PlanRefused``, nothing taken,
        where that room cannot be followed here)."""
        if planner.slots is None or not positions or not room.order():
            return cls(planner, Room([], []), [], write_back)
        with planner.lock:
            mine = planner.adopt_room_locked(room)
        return cls(planner, mine, positions, write_back)

    def named(self, pos: int) -> int | None:
        """The slot the room names for ``pos`` (None: none)."""
        k = self._index.get(pos)
        return None if k is None else self._order[k]

    def handed(self) -> frozenset[bytes]:
        """The victims whose slots were handed over so far (copied down, or gone from them here already)."""
        ready = self.room.ready
        return frozenset(v.key for i, v in enumerate(self.room.victims)
                         if self._victim_done.get(i) or v.key in ready)

    def slots_for(self, positions: Sequence[int]) -> dict[int, int]:
        """The slots of ``positions`` (WRITING, now the caller's to commit or release), copying down the
        victims whose slots they take first; a position without one is left out."""
        if self._closed:
            raise RuntimeError("reservation: slots asked for after close")
        wanted = [(pos, self._index[pos]) for pos in positions if pos in self._index]
        victims = [k - self._n_free for _, k in wanted if k >= self._n_free and k - self._n_free not in self._victim_done]
        ready = self.room.ready  # gone from their slots already (a follower's room): nothing to copy down
        for v in [v for v in victims if self.room.victims[v].key in ready]:
            self._victim_done[v] = True
        victims = [v for v in victims if self.room.victims[v].key not in ready]
        if victims:
            todo = [self.room.victims[v] for v in victims]
            try:
                handed = set(self.write_back(todo))
            except BaseException:
                for v in victims:
                    self._victim_done[v] = False  # settled (abandoned) by write_back's failure: never twice
                self.planner.abandon_victims(todo)
                raise
            for v in victims:
                self._victim_done[v] = self.room.victims[v].slot in handed
        out: dict[int, int] = {}
        for pos, k in wanted:
            if k in self._given:
                continue
            if k < self._n_free or self._victim_done[k - self._n_free]:
                self._given.add(k)
                out[pos] = self._order[k]
        return out

    def close(self) -> None:
        """Settle what was never handed out: free slots released, victims never copied down abandoned."""
        if self._closed:
            return
        self._closed = True
        unused = [self._order[k] for k in range(self._n_free) if k not in self._given]
        # A victim copied down (its slot handed over, WRITING) whose slot no block was given: released too.
        unused += [v.slot for i, v in enumerate(self.room.victims)
                   if self._victim_done.get(i) and self._n_free + i not in self._given]
        ready = self.room.ready  # taken already, never held: released if never handed out, never abandoned
        unused += [v.slot for i, v in enumerate(self.room.victims) if v.key in ready and i not in self._victim_done]
        self.planner.release_slots(unused)
        self.planner.abandon_victims([v for i, v in enumerate(self.room.victims)
                                      if i not in self._victim_done and v.key not in ready])


__all__ = ["Reservation", "WriteBack"]
