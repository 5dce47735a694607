"""The scheduler's placement authority for one KV cache group's stream: one planner decides the host room
of every store and load for all of vLLM's TP x PP ranks, and learns what became of it from every rank.

vLLM's EngineCore plans each step before its workers run it.  A :class:`HostLeader` starts each store
there (:meth:`~kvtier.tiering.planner.Planner.start_store_locked`: which host slots, which victims, what is
sent down) and each load (:meth:`~kvtier.tiering.planner.Planner.start_load_locked`: the blocks it serves
from host memory, pinned meanwhile, and the host room of those the ranks read from a backend), sends it
with the plan (``StorePlan.lead``, ``LoadPlan.lead``), and every rank's stack follows it on its own shard
(``TierStack.store(..., plan=)``, ``TierStack.load(..., plan=)``).  Each rank reports what it did per plan
(``WorkerReport.outcomes``); once every rank has, the leader folds them
(:meth:`~kvtier.tiering.planner.Planner.fold_store_locked`, ``fold_load_locked``).  The slot table is the
smallest rank's (the workers tell it at start-up: vLLM's KV connector handshake), so a slot the leader
names exists on every rank.

Invariants:
* the leader places a block in a host slot only once every rank reported it placed there, so a lookup
  offers a host hit only for a block every rank holds (a rank that diverged refuses or evicts, and its
  failure is the leader's failure);
* every plan is folded exactly once: when its last rank reports, or, past ``max_pending`` plans in flight
  (a rank that never reports), with the missing ranks counted as having placed and handed over nothing;
* nothing here touches a tensor or does I/O: the planner's ledger of slots and keys only.
"""

from __future__ import annotations

import dataclasses
from collections import OrderedDict
from collections.abc import Callable, Iterable
from dataclasses import dataclass, field

from ...memory.host_slots import SlotTable
from ...plans import HostChanges, HostOutcome, LoadPlan, StorePlan, WorkerReport
from ...tiering.manager import TierManager
from ...tiering.planner import Planner


@dataclass
class _Pending:
    """A plan the leader started, waiting for every rank's outcome; ``fold`` ends it with one outcome per
    rank."""

    fold: Callable[[list[HostOutcome]], object]
    outcomes: dict[int, HostOutcome] = field(default_factory=dict)


class HostLeader:
    """One stream's planner in the scheduler (see the module docstring).  ``slots``: host slots per rank
    (the smallest rank's); ``ranks``: the workers that each run every plan; ``loads_into_host``: whether the
    ranks read a load's blocks from backends into host memory (False: straight into vLLM's KV, on its CPU
    build with ``host.promote_loads`` false, so a load takes no host room)."""

    def __init__(self, manager: TierManager, slots: int, ranks: int, *, loads_into_host: bool = True,
                 max_pending: int = 4096):
        if slots < 1 or ranks < 1:
            raise ValueError(f"host leader: {slots} host slots and {ranks} ranks (want >= 1 each)")
        self.planner = Planner(manager.config, backends=manager.backends, metrics=manager.metrics,
                               slots=SlotTable(slots), device_blocks=0, manager=manager, tracks_device=False)
        self.planner.drain_host_changes()  # record host-memory changes: the event stream announces them
        self.ranks = ranks
        self.loads_into_host = loads_into_host
        self.max_pending = max_pending
        self._pending: OrderedDict[int, _Pending] = OrderedDict()
        self._next_id = 0

    @property
    def pending(self) -> int:
        """Plans some rank has not reported yet."""
        return len(self._pending)

    def lead(self, sp: StorePlan) -> StorePlan:
        """``sp`` with its store started here: the plan every rank follows."""
        planner = self.planner
        hashes = list(sp.hashes)
        with planner.lock:
            start = planner.start_store_locked(hashes, list(sp.block_ids))
        plan_id = self._wait(lambda sides: planner.fold_store_locked(start, hashes, sides, sp.start, sp.tenant))
        return dataclasses.replace(sp, lead=start.lead(plan_id))

    def lead_load(self, lp: LoadPlan) -> LoadPlan:
        """``lp`` with its load started here: the plan every rank follows."""
        planner = self.planner
        hashes = list(lp.hashes)
        with planner.lock:
            start = planner.start_load_locked(hashes, self.loads_into_host)
        plan_id = self._wait(lambda sides: planner.fold_load_locked(start, hashes, sides, lp.start))
        return dataclasses.replace(lp, lead=start.lead(plan_id))

    def _wait(self, fold: Callable[[list[HostOutcome]], object]) -> int:
        """A new plan id, whose ``fold`` runs (under the planner's lock) once every rank reported it."""
        plan_id, self._next_id = self._next_id, self._next_id + 1
        self._pending[plan_id] = _Pending(fold)
        while len(self._pending) > self.max_pending:
            self._settle(next(iter(self._pending)))
        return plan_id

    def fold(self, reports: Iterable[WorkerReport]) -> None:
        """The ranks' outcomes in one step's reports; a plan every rank has reported is folded."""
        for rep in reports:
            for plan_id, outcome in rep.outcomes.items():
                p = self._pending.get(plan_id)
                if p is None:
                    continue
                p.outcomes[rep.rank] = outcome
                if len(p.outcomes) >= self.ranks:
                    self._settle(plan_id)

    def _settle(self, plan_id: int) -> None:
        p = self._pending.pop(plan_id)
        sides = [p.outcomes.get(r, HostOutcome.nothing()) for r in range(self.ranks)]
        with self.planner.lock:
            p.fold(sides)

    def lose(self, lost: set[bytes]) -> set[bytes]:
        """Blocks a rank's load did not find (``WorkerReport.lost``): not on that rank, so not in host
        memory on every rank: they leave host memory here unless a plan here holds them (its fold settles
        them).  Returns those the manager may forget (not pinned here by a plan in flight)."""
        planner = self.planner
        with planner.lock:
            for key in lost:
                e = planner.index.get(key)
                if e is not None and e.host is not None and not e.refs:
                    planner.drop_host_locked(key)
            return {key for key in lost if (e := planner.index.get(key)) is None or not e.refs}

    def host_changes(self) -> HostChanges:
        """Blocks placed in and gone from host memory since the last call (for the event stream)."""
        return self.planner.drain_host_changes()

    def check(self) -> None:
        """The planner's invariants (tests: call with no plan pending)."""
        with self.planner.lock:
            self.planner.check_locked()


__all__ = ["HostLeader"]
