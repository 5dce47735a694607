"""The planner's contract with its executors: a store's plan names, at its start, the host slot each of its
new blocks goes to (and a read's room, before its first value is read, the slot of each block it brings up), and the slots it hands out are those whatever the executors do meanwhile or in
whichever order write-backs end (the property several executors running one plan need: vLLM's TP ranks).
The executor's part is played here step by step, as ``store_path`` does it, on a real planner with ledger
backends."""

from __future__ import annotations

import pytest
from _stack_helpers import BLOCK_NBYTES, config

from kvtier.simulate.ledger_stack import SimulatedStack
from kvtier.tiering.planner import PlanRefused
from kvtier.tiering.results import FAILED, SKIPPED, STORED
from kvtier.tiering.room import Reservation


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


def _copy_down(p, taken: dict[bytes, bool]):
    """The executor's write-back, played: each victim copied down or not as ``taken`` says (default: taken)."""
    calls: list[list[bytes]] = []

    def write_back(victims):
        calls.append([v.key for v in victims])
        with p.lock:
            return p.written_back_locked(victims, {v.key: taken.get(v.key, True) for v in victims})

    return write_back, calls


def test_a_reads_room_is_named_before_its_first_value_and_each_chunk_gets_its_slots(tmp_path):
    sim, p = _planner(tmp_path)
    a, b, c, d, g = _keys(5)
    where = _fill(sim, p, [a, b, c, d])
    write_back, calls = _copy_down(p, {})
    rows = Reservation.take(p, [10, 11], write_back)  # a read of two blocks: positions 10 and 11
    assert rows.room.slots == [] and [v.key for v in rows.room.victims] == [c, d]
    assert rows.room.order() == [where[c], where[d]] and calls == []  # decided, nothing copied yet
    # Meanwhile a store evicts A, and its copy is never made: A's slot is free, and lower than D's.
    with p.lock:
        plan2 = p.start_store_locked([g], [6])
        p.release_slots(p.written_back_locked(plan2.victims, {a: True}))
    p.end_stores([g])
    # The first chunk's block takes C's slot, copying C alone down; the second takes D's, as named.
    assert rows.slots_for([10]) == {10: where[c]} and calls == [[c]]
    with p.lock:
        assert p.index.host_slot(d) == where[d]  # D is copied down only when a chunk needs its slot
    assert rows.slots_for([11, 10]) == {11: where[d]} and calls == [[c], [d]]  # never a slot twice
    rows.close()
    e, f = _keys(7)[5:]
    with p.lock:  # the reader commits the blocks it read into the slots it was handed
        p.commit_host_locked(e, where[c])
        p.commit_host_locked(f, where[d])
        p.check_locked()


def test_a_reads_room_settles_what_it_never_handed_out(tmp_path):
    sim, p = _planner(tmp_path)
    a, b, c, d = _keys(4)
    where = _fill(sim, p, [a, b, c, d])
    write_back, calls = _copy_down(p, {c: False})  # C's write-back fails
    rows = Reservation.take(p, [0, 1, 2], write_back)
    assert [v.key for v in rows.room.victims] == [c, d, a]
    assert rows.slots_for([0]) == {}  # C kept its slot: the block planned there finds none
    assert rows.slots_for([0]) == {} and calls == [[c]]  # and C is not tried twice
    assert rows.slots_for([1]) == {1: where[d]}
    p.release_slots([where[d]])  # the read of block 1 failed: the reader releases its slot
    rows.close()  # A was never copied down: abandoned, still in host memory
    with p.lock:
        assert p.index.host_slot(a) == where[a] and p.index.host_slot(c) == where[c]
        assert p.index.host_slot(d) is None
        p.check_locked()
    assert calls == [[c], [d]]
    try:
        rows.slots_for([2])
    except RuntimeError as e:
        assert "after close" in str(e)
    else:
        raise AssertionError("a closed reservation handed out a slot")


# ---------------------------------------------------------------------- a plan made elsewhere, followed


def _played(p, plan, hashes, written=None, landed=None):
    """The executor's run of store ``plan`` on planner ``p``, played: victims copied down as ``written``
    says (default: taken), the copies of the new blocks landing as ``landed`` says (default: all)."""
    written = written or {}
    with p.lock:
        held = [v for v in plan.victims if v.key not in plan.ready]
        copied = set(p.written_back_locked(held, {v.key: written.get(v.key, True) for v in held}))
        slots = plan.slots + [v.slot for v in plan.victims if v.key in plan.ready or v.slot in copied]
        take = plan.new[:len(slots)]
        keys = [hashes[i] for i in take]
        p.stored_locked(plan, take, keys, slots, [(landed or {}).get(k, True) for k in keys])
    p.end_stores([hashes[i] for i in plan.new[len(slots):]])


def _places(p, keys):
    with p.lock:
        return {k: p.index.host_slot(k) for k in keys}


def test_a_follower_places_every_block_in_the_slot_the_leaders_plan_named(tmp_path):
    """vLLM's scheduler (the leader) plans each store once; every rank's planner follows that plan on its
    own shard, whatever that rank's write-backs do meanwhile, and ends with the same blocks in the same
    host slots."""
    (_, lead), (_, follow) = _planner(tmp_path / "l"), _planner(tmp_path / "f")
    keys = _keys(8)
    for t, batch in enumerate([keys[:4], keys[:1], keys[1:2], keys[4:6], keys[6:8]]):
        ids = list(range(len(batch)))
        lead.now = follow.now = float(t)
        with lead.lock:
            plan = lead.start_store_locked(batch, ids)
        with follow.lock:
            mine = follow.adopt_store_locked(batch, ids, plan.lead(t))
        assert mine.room() == plan.room()
        assert [v.key for v in mine.victims] == [v.key for v in plan.victims]
        _played(lead, plan, batch)
        _played(follow, mine, batch)
        if t == 0:
            with follow.lock:  # this rank alone sees block 2 used again: its own choice of victims differs
                follow.now = 2.5
                follow.hit_locked(keys[2])
        assert _places(follow, keys) == _places(lead, keys)
    with lead.lock, follow.lock:
        lead.check_locked()
        follow.check_locked()
    # Two of the first four were written back and evicted for the last stores, on both sides alike.
    assert sum(s is not None for s in _places(lead, keys).values()) == 4


def test_a_follower_evicts_a_block_the_leader_does_not_know_and_refuses_a_slot_in_use(tmp_path):
    _, lead = _planner(tmp_path / "l", write="write_through")
    sim_f, follow = _planner(tmp_path / "f", write="write_through")
    a, b, x, c, d = _keys(5)
    sim_f.store([x], [0])  # the follower holds X (stored when the leader had it fail, say) in slot 0
    x_slot = _places(follow, [x])[x]
    with lead.lock:
        plan = lead.start_store_locked([a, b], [0, 1])
    assert x_slot in plan.room()  # the leader thinks that slot free
    with follow.lock:
        mine = follow.adopt_store_locked([a, b], [0, 1], plan.lead(0))
    assert mine.room() == plan.room() and [dr.key for dr in mine.dropped] == [x]
    _played(lead, plan, [a, b])
    _played(follow, mine, [a, b])
    assert _places(follow, [a, b, x]) == {**_places(lead, [a, b]), x: None}
    # A block pinned on the follower (a load reading it) sits in a slot the leader's next plan names: the
    # follower refuses that plan whole and holds nothing of it.
    with lead.lock:
        plan2 = lead.start_store_locked([c, d], [2, 3])
    with follow.lock:
        follow.index.acquire(a)  # pinned here
    busy = _places(follow, [a])[a]
    assert busy not in plan2.room()  # a free slot each: nothing in use is named yet
    with follow.lock:
        mine2 = follow.adopt_store_locked([c, d], [2, 3], plan2.lead(1))
    _played(lead, plan2, [c, d])
    _played(follow, mine2, [c, d])
    with lead.lock:  # every slot is taken now: the next store's room evicts A, which the follower pins
        plan3 = lead.start_store_locked([x], [4])
    assert [dr.key for dr in plan3.dropped] == [a] and plan3.room() == [busy]
    with follow.lock:
        with pytest.raises(PlanRefused, match=f"host slot {busy} holds block {a.hex()[:16]}, in use here"):
            follow.adopt_store_locked([x], [4], plan3.lead(2))
        follow.index.release(a)
    with follow.lock:
        follow.check_locked()  # nothing of the refused plan is held
        assert follow.index.host_slot(a) == busy
    _played(lead, plan3, [x])


def test_where_the_follower_holds_other_blocks_than_the_leader_the_plan_wins(tmp_path):
    """A rank's own load left A in its host memory, unknown to the leader, whose store then has A new: the
    rank stores A again in the plan's slot (its copy dropped).  B, held by the leader and gone here, is
    not stored here.  Had A been pinned here (a load reading it), the rank refuses the plan."""
    (sim_l, lead), (sim_f, follow) = _planner(tmp_path / "l"), _planner(tmp_path / "f")
    a, b, c = _keys(3)
    sim_l.store([b], [1])
    sim_f.store([a, c], [0, 2])  # A in the slot where the leader holds B
    with follow.lock:
        follow.drop_host_locked(c)
    with lead.lock:
        plan = lead.start_store_locked([a, b], [0, 1])
    assert plan.new == [0] and plan.room() != [_places(follow, [a])[a]]
    with follow.lock:
        follow.index.acquire(a)
        with pytest.raises(PlanRefused, match=f"block {a.hex()[:16]} \\(position 0\\), which the plan stores, is in use here"):
            follow.adopt_store_locked([a, b], [0, 1], plan.lead(0))
        follow.index.release(a)
        follow.check_locked()
        mine = follow.adopt_store_locked([a, b], [0, 1], plan.lead(0))
    assert mine.new == [0] and mine.room() == plan.room()
    # A is new here now (STORED once its copy lands); B, which the plan does not store, is skipped here.
    assert mine.status == [SKIPPED, SKIPPED]
    _played(lead, plan, [a, b])
    _played(follow, mine, [a, b])
    assert _places(follow, [a, b]) == {a: _places(lead, [a])[a], b: None}
    with lead.lock, follow.lock:
        lead.check_locked()
        follow.check_locked()


def test_a_victim_gone_from_its_slot_on_the_follower_hands_the_slot_over_at_once(tmp_path):
    """A rank's own read evicted a block the leader still counts in host memory; when the leader names it
    as a write-back victim, that rank takes its slot at once (nothing to copy down) and the new block lands
    where the leader planned it."""
    (_, lead), (_, follow) = _planner(tmp_path / "l"), _planner(tmp_path / "f")
    keys = _keys(5)
    for t, batch in enumerate([keys[:4], keys[4:5]]):
        ids = list(range(len(batch)))
        lead.now = follow.now = float(t)
        with lead.lock:
            plan = lead.start_store_locked(batch, ids)
        if t == 1:
            victim = plan.victims[0]
            with follow.lock:
                follow.drop_host_locked(victim.key)  # gone here, its slot free
                follow.commit_host_locked(keys[4] + b"x", follow.host_slots().allocate(1).slots[0])  # refilled
        with follow.lock:
            mine = follow.adopt_store_locked(batch, ids, plan.lead(t))
        if t == 1:
            assert mine.ready == {victim.key} and [d.key for d in mine.dropped] == [keys[4] + b"x"]
        _played(lead, plan, batch)
        _played(follow, mine, batch)
        assert _places(follow, keys) == _places(lead, keys)
    with lead.lock, follow.lock:
        lead.check_locked()
        follow.check_locked()


def test_a_load_the_leader_plans_is_read_into_the_slots_it_named_and_placed_only_where_every_side_read_it(
        tmp_path):
    """vLLM's scheduler leads each load too: the block it serves from host memory stays pinned until the
    load is folded; the blocks it lacks get one room, which every rank's read follows.  Rank 1 fails C's
    write-back, so the block planned in C's slot finds none there: the leader places only what both ranks
    read into the named slot, drops C (no longer on every rank) and frees the rest."""
    from kvtier.plans import HostOutcome

    (sim, lead), *sides = [_planner(tmp_path / n) for n in ("l", "r0", "r1")]
    a, b, c, d, e, f = _keys(6)
    where = _fill(sim, lead, [a, b, c, d])
    for s, p in sides:
        assert _fill(s, p, [a, b, c, d]) == where
    with lead.lock:
        plan = lead.start_load_locked([a, e, f], into_host=True)
        assert plan.held == [a] and lead.index.entry(a).refs == 1  # served from host memory: pinned
        assert plan.fetch == [1, 2] and [v.key for v in plan.room.victims] == [c, d]
    lp = plan.lead(7)
    outcomes = []
    for r, (_, p) in enumerate(sides):
        write_back, _ = _copy_down(p, {c: r == 0})  # rank 1 cannot copy C down
        rows = Reservation.follow(p, lp.room, lp.fetch, write_back)
        given = rows.slots_for([1, 2])
        assert given == ({1: where[c], 2: where[d]} if r == 0 else {2: where[d]})
        with p.lock:
            for pos, slot in given.items():
                p.commit_host_locked([a, e, f][pos], slot)
        rows.close()
        outcomes.append(HostOutcome(frozenset(given), rows.handed()))
    with lead.lock:
        lead.fold_load_locked(plan, [a, e, f], outcomes)
        assert lead.index.entry(a).refs == 0  # unpinned once folded
        placed = {k: lead.index.host_slot(k) for k in (a, b, c, d, e, f)}
        lead.check_locked()
    assert placed == {a: where[a], b: where[b], c: None, d: None, e: None, f: where[d]}
    for _, p in sides:
        assert {k: s for k, s in _places(p, [a, b, e, f]).items() if placed[k] is not None} == \
            {k: s for k, s in placed.items() if s is not None and k in (a, b, e, f)}
        with p.lock:
            p.check_locked()
    with lead.lock:  # C's slot and the slot read into on rank 0 alone are free on the leader
        assert lead.host_slots().num_free == 1
