"""The planner's contract with its executors: a store's plan names, at its start, the host slot each of its
new blocks goes to, and the slots it hands out are those whatever the executors do meanwhile or in
whichever order write-backs end (the property several executors running one plan need: vLLM's TP ranks).
The executor's part is played here step by step, as ``store_path`` does it, on a real planner with ledger
backends."""

from __future__ import annotations

from _stack_helpers import BLOCK_NBYTES, config

from kvtier.simulate.ledger_stack import SimulatedStack
from kvtier.tiering.results import FAILED, STORED


def _planner(tmp_path, write: str = "write_back"):
    sim = SimulatedStack(config(tmp_path, write=write, host_slots=4), BLOCK_NBYTES)
    return sim, sim.planner


def _keys(n: int) -> list[bytes]:
    return [bytes([i + 1]) * 32 for i in range(n)]


def _fill(sim, p, keys):
    """Four blocks in host memory, none written (write-back); then A and B used again, so C and D are the
    least recently used and A the next."""
    a, b, c, d = keys[:4]
    p.now = 1.0
    sim.store([a, b, c, d], [0, 1, 2, 3])
    p.now = 2.0
    sim.store([a], [0])
    p.now = 3.0
    sim.store([b], [1])
    with p.lock:
        return {k: p.index.host_slot(k) for k in (a, b, c, d)}


def test_a_store_gets_the_slots_its_plan_named_though_another_store_freed_a_lower_one(tmp_path):
    sim, p = _planner(tmp_path)
    a, b, c, d, e, f, g = _keys(7)
    where = _fill(sim, p, [a, b, c, d])
    with p.lock:
        plan1 = p.start_store_locked([e, f], [4, 5])
    assert plan1.slots == [] and [v.key for v in plan1.victims] == [c, d]
    assert plan1.room() == [where[c], where[d]]
    with p.lock:
        plan2 = p.start_store_locked([g], [6])
    assert [v.key for v in plan2.victims] == [a]
    # Store 2's write-back ends first, and its copy is never made: A's slot is free again meanwhile.
    with p.lock:
        handed2 = p.written_back_locked(plan2.victims, {a: True})
    assert handed2 == [where[a]] == plan2.room()
    p.release_slots(handed2)
    p.end_stores([g])
    # Store 1's write-backs end now: it gets C's and D's slots, as planned, not the lowest free one.
    with p.lock:
        handed1 = p.written_back_locked(plan1.victims, {c: True, d: True})
        assert handed1 == plan1.room()
        down = p.stored_locked(plan1, [0, 1], [e, f], handed1, [True, True])
        assert [p.index.host_slot(k) for k in (e, f)] == plan1.room()
        assert plan1.status == [STORED, STORED] and down == []  # write-back: nothing goes down on a store
        assert p.index.host_slot(c) is None and p.index.host_slot(d) is None
        p.check_locked()


def test_a_victim_not_copied_down_keeps_its_slot_and_the_chain_head_keeps_the_room(tmp_path):
    sim, p = _planner(tmp_path)
    a, b, c, d, e, f = _keys(6)
    where = _fill(sim, p, [a, b, c, d])
    with p.lock:
        plan = p.start_store_locked([e, f], [4, 5])
        handed = p.written_back_locked(plan.victims, {c: False, d: True})  # C's write-back failed
    assert handed == [where[d]]
    with p.lock:
        p.stored_locked(plan, [0], [e], handed, [True])
    p.end_stores([f])
    with p.lock:
        assert p.index.host_slot(e) == where[d] and p.index.host_slot(c) == where[c]
        assert p.index.host_slot(f) is None
        p.check_locked()
    assert p.counts()["unwritten"] == 1  # C waits in host memory for its next eviction


def test_the_write_down_of_a_store_is_decided_at_its_start(tmp_path):
    sim, p = _planner(tmp_path, write="write_through")
    a, b, c = _keys(3)
    with p.lock:
        plan = p.start_store_locked([a, b, c], [0, 1, 2])
    assert plan.sends_down == {a, b, c} and len(plan.room()) == 3
    with p.lock:
        down = p.stored_locked(plan, [0, 1, 2], [a, b, c], plan.room(), [True, False, True])
    assert down == [a, c] and plan.status == [STORED, FAILED, STORED]
    _, p_r = _planner(tmp_path / "r", write="write_back")
    with p_r.lock:
        assert p_r.start_store_locked([a], [0]).sends_down == frozenset()
