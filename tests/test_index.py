"""Behaviour of kvtier.index.BlockIndex, plus a randomized model check against a dicts-and-lists reference."""

from __future__ import annotations

import hashlib
import itertools
import pickle
import random
from typing import Any

import numpy as np
import pytest

from kvtier.index import MAX_BACKENDS, BlockIndex, Tier, TierNames, tier_of

DEV, HOST, B = Tier.DEVICE, Tier.HOST, Tier.backend


def key(i: int, size: int = 32) -> bytes:
    return hashlib.sha256(i.to_bytes(8, "little", signed=True)).digest()[:size]


def ticking() -> BlockIndex:
    """An index whose clock ticks 1, 2, 3... so last-access order is exact."""
    return BlockIndex(capacity=2, clock=itertools.count(1).__next__)


# ---------------------------------------------------------------------------------------------- prefix


def test_prefix_mixed_tiers_and_hole():
    ix = BlockIndex()
    ks = [key(i) for i in range(40)]
    for i in range(10):
        ix.insert(ks[i], device=i, host=100 + i, backends=[0])  # device wins over host and backends
    for i in range(10, 15):
        ix.insert(ks[i], host=i, backends=[0])
    for i in range(15, 35):
        ix.insert(ks[i], backends=[5, 2])  # lowest backend index wins
    for i in range(36, 40):  # after the hole at 35: never counted
        ix.insert(ks[i], device=i)
    m = ix.lookup_prefix(ks)
    assert m.length == 35
    assert m.runs() == [(DEV, 0, 10), (HOST, 10, 15), (B(2), 15, 35)]
    assert m.counts() == {DEV: 10, HOST: 5, B(2): 20}
    assert m.device_ids[:10].tolist() == list(range(10)) and (m.device_ids[10:] == -1).all()
    assert m.host_slots[:15].tolist() == [100 + i for i in range(10)] + list(range(10, 15))
    assert m.tiers.dtype == np.int8


def test_prefix_interleaved_and_entry_present_nowhere():
    ix = BlockIndex()
    ks = [key(i) for i in range(6)]
    ix.insert(ks[0], host=0)
    ix.insert(ks[1], device=0)
    ix.insert(ks[2], backends=[31])
    ix.insert(ks[3], device=1)
    ix.insert(ks[4])  # a placeholder, e.g. a load in flight: stops the chain
    ix.insert(ks[5], device=2)
    m = ix.lookup_prefix(ks)
    assert m.tiers.tolist() == [HOST, DEV, B(31), DEV]
    assert m.runs() == [(HOST, 0, 1), (DEV, 1, 2), (B(31), 2, 3), (DEV, 3, 4)]
    assert Tier.label(B(31)) == "backend[31]" and Tier.label(DEV) == "device"


def test_every_tier_is_a_tier_member_and_names_are_the_deployments():
    # Backend tiers are members too (one type for "tier" everywhere), and they round-trip through pickle
    # (lookups cross into plans) and through the int8 column codes.
    assert [type(Tier.backend(i)) for i in (0, 31)] == [Tier, Tier] and Tier.backend(3).name == "BACKEND_3"
    assert pickle.loads(pickle.dumps(Tier.backend(31))) is Tier.backend(31)
    assert [tier_of(c) for c in (-1, 0, 1, 2, 33)] == [Tier.MISSING, DEV, HOST, B(0), B(31)]
    assert Tier.backend(5).as_backend_index() == 5 and Tier.backend(5).is_backend and not HOST.is_backend
    with pytest.raises(ValueError, match="HOST is not a backend tier"):
        HOST.as_backend_index()
    with pytest.raises(ValueError, match="backend index"):
        Tier.backend(32)
    names = TierNames(("local_disk", "redis"))
    assert [names(t) for t in (DEV, HOST, B(0), B(1), B(2))] == ["device", "host", "local_disk", "redis",
                                                                 "backend[2]"]
    assert [names.tier(n) for n in ("device", "host", "redis")] == [DEV, HOST, B(1)]
    with pytest.raises(ValueError, match=r"no tier named 's3': expected device, host or one of \['local_disk', 'redis'\]"):
        names.tier("s3")


def test_prefix_empty_and_first_miss_and_long_chain():
    ix = BlockIndex()
    assert ix.lookup_prefix([]).length == 0
    assert ix.lookup_prefix([]).runs() == []
    ks = [key(i) for i in range(5000)]
    for k in ks:
        ix.insert(k, backends=[1])
    assert ix.lookup_prefix([key(-1), *ks]).length == 0
    assert ix.lookup_prefix(ks).length == 5000  # crosses several growing chunks
    assert ix.lookup_prefix(ks[:4321] + [key(-1)] + ks[4321:]).length == 4321
    assert ix.lookup_prefix(tuple(ks[:3])).length == 3


def test_lookup_prefix_does_not_touch():
    ix = ticking()
    ix.insert(key(0), device=0)
    ix.insert(key(1), device=1)
    ix.lookup_prefix([key(0)])
    assert ix.entry(key(0)).hits == 0
    assert ix.eviction_candidates(DEV, 2) == [key(0), key(1)]


# ---------------------------------------------------------------------------------------------- LRU, pins


def test_lru_order_per_tier_after_touches():
    ix = ticking()
    a, b, c, d = (key(i) for i in range(4))
    for i, k in enumerate((a, b, c)):
        ix.insert(k, device=i)
    for i, k in enumerate((c, b, a)):  # host order differs from device order
        ix.set_host(k, i)
    ix.insert(d, host=3)
    assert ix.eviction_candidates(DEV, 10) == [a, b, c]
    assert ix.eviction_candidates(HOST, 10) == [c, b, a, d]
    ix.touch(a)
    assert ix.eviction_candidates(DEV, 10) == [b, c, a]
    assert ix.eviction_candidates(HOST, 10) == [c, b, d, a]
    ix.touch(c)
    ix.set_device(b, 7)  # moving to another device block counts as use
    assert ix.eviction_candidates(DEV, 2) == [a, c]
    assert ix.eviction_candidates(HOST, 10) == [b, d, a, c]
    assert ix.entry(a).hits == 1 and ix.entry(c).last_access > ix.entry(a).last_access > ix.entry(d).last_access
    ix.validate()


def test_pinned_is_never_a_candidate_and_unpin_returns_to_mru():
    ix = ticking()
    ks = [key(i) for i in range(5)]
    for i, k in enumerate(ks):
        ix.insert(k, device=i, host=i, backends=[0])
    assert ix.pin(ks[0]) == 1 and ix.pin(ks[0], 2) == 3
    ix.pin(ks[2])
    for tier in (DEV, HOST, B(0)):
        cands = ix.eviction_candidates(tier, 10)
        assert ks[0] not in cands and ks[2] not in cands, tier
        assert ix.evictable_count(tier) == 3 and ix.count(tier) == 5
    assert ix.pinned == 2
    assert ix.touch(ks[0]) == 1  # touching a pinned entry counts the hit (touch returns it); the list is untouched
    assert ix.entry(ks[0]).hits == 1 and ix.touch(ks[0]) == 2 and ix.hits(ks[0]) == 2
    assert ix.unpin(ks[0], 2) == 1
    assert ks[0] not in ix.eviction_candidates(DEV, 10)
    assert ix.unpin(ks[0]) == 0
    assert ix.eviction_candidates(DEV, 10) == [ks[1], ks[3], ks[4], ks[0]]
    ix.validate()


def test_set_location_while_pinned_then_unpin():
    ix = ticking()
    ix.insert(key(0))
    ix.pin(key(0))
    ix.set_device(key(0), 3)
    assert ix.eviction_candidates(DEV, 5) == [] and ix.count(DEV) == 1
    ix.unpin(key(0))
    assert ix.eviction_candidates(DEV, 5) == [key(0)]
    assert ix.clear_device(key(0)) == 3 and ix.clear_device(key(0)) is None
    assert ix.eviction_candidates(DEV, 5) == [] and ix.count(DEV) == 0
    ix.validate()


def test_backend_candidates_by_last_access():
    ix = ticking()
    ks = [key(i) for i in range(4)]
    for k in ks:
        ix.insert(k, backends=[3])
    ix.touch(ks[0])
    ix.pin(ks[2])
    assert ix.eviction_candidates(B(3), 10) == [ks[1], ks[3], ks[0]]
    assert ix.eviction_candidates(B(3), 1) == [ks[1]]
    assert ix.eviction_candidates(B(4), 10) == [] and ix.eviction_candidates(B(3), 0) == []


# ---------------------------------------------------------------------------------------------- slots, growth


def test_remove_reinsert_reuses_slots_with_fresh_state():
    ix = BlockIndex(capacity=8)
    for i in range(8):
        ix.insert(key(i), device=i)
    for round_ in range(50):
        k = key(round_ % 8)
        old = ix.remove(k)
        assert old.device == round_ % 8 and k not in ix and ix.get(k) is None
        assert ix.key_at_device(round_ % 8) is None
        ix.insert(k, host=round_)
        e = ix.entry(k)
        assert (e.device, e.host, e.backends, e.refs, e.hits) == (None, round_, (), 0, 0)
        assert k not in ix.eviction_candidates(DEV, 100)
        ix.clear_host(k)
        ix.set_device(k, round_ % 8)
    assert ix.capacity == 8 and len(ix) == 8
    ix.validate()


def test_growth_keeps_data():
    ix = BlockIndex(capacity=1)
    n = 3000
    for i in range(n):
        ix.insert(key(i, 16), device=i if i % 3 == 0 else None, host=i if i % 3 == 1 else None,
                  backends=[i % 32])
        if i % 7 == 0:
            ix.touch(key(i, 16))
        if i % 11 == 0:
            ix.pin(key(i, 16))
    assert ix.capacity >= n and len(ix) == n
    for i in range(n):
        e = ix.entry(key(i, 16))
        assert e.device == (i if i % 3 == 0 else None) and e.host == (i if i % 3 == 1 else None)
        assert e.backends == (i % 32,) and e.hits == (i % 7 == 0) and e.refs == (i % 11 == 0)
    assert ix.eviction_candidates(DEV, 3) == [key(3, 16), key(6, 16), key(9, 16)]
    assert ix.lookup_prefix([key(i, 16) for i in range(n)]).length == n
    ix.validate()


def test_insert_many_bulk_and_all_or_nothing():
    ix = BlockIndex(capacity=4)
    ix.insert(key(0), device=0)
    ix.insert_many([key(i) for i in range(1, 1001)], backends=[2, 4])
    assert len(ix) == 1001 and ix.count(B(2)) == ix.count(B(4)) == 1000
    assert ix.entry(key(500)).backends == (2, 4) and ix.entry(key(500)).refs == 0
    assert ix.lookup_prefix([key(i) for i in range(1001)]).length == 1001
    with pytest.raises(ValueError, match=key(5).hex()):
        ix.insert_many([key(5000), key(5)])
    with pytest.raises(ValueError, match="repeated"):
        ix.insert_many([key(6000), key(6000)])
    assert key(5000) not in ix and len(ix) == 1001
    ix.validate()


# ---------------------------------------------------------------------------------------------- bits, ids


def test_backend_bits():
    ix = BlockIndex()
    k = key(0)
    ix.insert(k, backends=[1])
    assert ix.add_backend(k, 31) and not ix.add_backend(k, 31) and ix.add_backend(k, 0)
    assert ix.entry(k).backends == (0, 1, 31) and ix.count(B(31)) == 1
    assert ix.remove_backend(k, 1) and not ix.remove_backend(k, 1)
    assert ix.entry(k).backends == (0, 31) and ix.count(B(1)) == 0
    assert ix.lookup_prefix([k]).tiers.tolist() == [B(0)]
    ix.remove(k)
    assert ix.count(B(0)) == ix.count(B(31)) == 0
    for bad in (-1, MAX_BACKENDS, "0"):
        with pytest.raises(ValueError, match="backend index"):
            ix.insert(key(1), backends=[bad])  # type: ignore[list-item]
    assert key(1) not in ix
    with pytest.raises(ValueError, match="unknown tier"):
        ix.count(Tier.MISSING)


def test_device_ids_and_host_slots_are_unique_and_reversible():
    ix = BlockIndex()
    a, b = key(1), key(2)
    ix.insert(a, device=5, host=9)
    assert ix.key_at_device(5) == a and ix.key_at_host(9) == a and ix.key_at_device(6) is None
    with pytest.raises(ValueError, match=f"{b.hex()}: device block 5 already holds block {a.hex()}"):
        ix.insert(b, device=5)
    assert b not in ix  # a failed insert changes nothing
    ix.insert(b)
    with pytest.raises(ValueError, match="host slot 9 already holds"):
        ix.set_host(b, 9)
    assert ix.set_device(a, 5) == 5  # idempotent for the holder
    assert ix.set_device(a, 6) == 5 and ix.key_at_device(5) is None and ix.key_at_device(6) == a
    with pytest.raises(ValueError, match="device block must be an int"):
        ix.set_device(b, -3)
    ix.validate()


def test_place_on_device_takes_numpy_ids_and_names_the_block_of_a_bad_one():
    ix = BlockIndex()
    a, b = key(1), key(2)
    ix.place_on_device(a, np.int64(4))
    ix.place_on_device(b, 4)  # the block now holds b: a lost its device copy and, being nowhere, its entry
    assert ix.key_at_device(4) == b and a not in ix
    for bad in (4.0, "4", -1):
        with pytest.raises(ValueError, match=f"block {a.hex()}: device block must be an int in .*got {bad!r}"):
            ix.place_on_device(a, bad)  # type: ignore[arg-type]
    assert ix.key_at_device(4) == b
    ix.free_device(np.int32(4))
    assert ix.key_at_device(4) is None and b not in ix
    ix.validate()


def test_error_messages_name_the_key():
    ix = BlockIndex()
    k = key(42)
    with pytest.raises(KeyError, match=f"{k.hex()}: not in the index"):
        ix.touch(k)
    with pytest.raises(KeyError, match=k.hex()):
        ix.remove(k)
    ix.insert(k)
    with pytest.raises(ValueError, match=f"{k.hex()}: already in the index"):
        ix.insert(k)
    with pytest.raises(ValueError, match=f"{k.hex()}: cannot unpin by 1, ref count is 0 .*below zero"):
        ix.unpin(k)
    ix.pin(k, 2)
    with pytest.raises(ValueError, match=f"{k.hex()}: cannot remove, pinned \\(ref count 2\\)"):
        ix.remove(k)
    with pytest.raises(ValueError, match="pin count must be >= 1"):
        ix.pin(k, 0)
    with pytest.raises(TypeError, match="non-empty bytes"):
        ix.insert("abc")  # type: ignore[arg-type]
    assert ix.entry(k).refs == 2


# ---------------------------------------------------------------------------------------------- model-based


class Reference:
    """The obvious implementation: a dict of dicts and one Python list per memory tier (LRU first)."""

    def __init__(self) -> None:
        self.e: dict[bytes, dict[str, Any]] = {}
        self.lru: dict[int, list[bytes]] = {DEV: [], HOST: []}
        self.tick = 0

    def now(self) -> int:
        self.tick += 1
        return self.tick

    def loc(self, k: bytes, t: int):
        return self.e[k]["dev" if t == DEV else "host"]

    def mru(self, k: bytes, t: int) -> None:
        if k in self.lru[t]:
            self.lru[t].remove(k)
        if self.e[k]["refs"] == 0 and self.loc(k, t) is not None:
            self.lru[t].append(k)

    def owner(self, t: int, ident: int):
        return next((k for k in self.e if self.loc(k, t) == ident), None)

    def best(self, k: bytes) -> int:
        e = self.e.get(k)
        if e is None:
            return Tier.MISSING
        if e["dev"] is not None:
            return DEV
        if e["host"] is not None:
            return HOST
        return B(min(e["bk"])) if e["bk"] else Tier.MISSING


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_model_based_random_operations(seed: int):
    rng = random.Random(seed)
    ix, ref = ticking(), Reference()
    pool = [key(i, 16 if i % 2 else 32) for i in range(48)]
    ids = range(24)

    for step in range(4000):
        k = rng.choice(pool)
        op = rng.choice(["insert", "insert", "remove", "pin", "unpin", "unpin", "touch", "set", "set",
                         "clear", "add_b", "rm_b"])
        present = k in ref.e
        if not present and op != "insert":
            with pytest.raises(KeyError):
                ix.touch(k)
            continue
        if op == "insert":
            dev = rng.choice([None, rng.choice(ids)])
            host = rng.choice([None, rng.choice(ids)])
            bk = set(rng.sample([0, 1, 2, 31], rng.randint(0, 2)))
            if present or (dev is not None and ref.owner(DEV, dev)) or (host is not None and ref.owner(HOST, host)):
                with pytest.raises(ValueError):
                    ix.insert(k, device=dev, host=host, backends=bk)
                continue
            ix.insert(k, device=dev, host=host, backends=bk)
            ref.e[k] = {"dev": dev, "host": host, "bk": bk, "refs": 0, "hits": 0, "last": ref.now()}
            ref.mru(k, DEV)
            ref.mru(k, HOST)
        elif op == "remove":
            if ref.e[k]["refs"]:
                with pytest.raises(ValueError, match="pinned"):
                    ix.remove(k)
                continue
            assert ix.remove(k).hits == ref.e[k]["hits"]
            del ref.e[k]
            for t in (DEV, HOST):
                if k in ref.lru[t]:
                    ref.lru[t].remove(k)
        elif op == "pin":
            n = rng.randint(1, 2)
            assert ix.pin(k, n) == ref.e[k]["refs"] + n
            ref.e[k]["refs"] += n
            for t in (DEV, HOST):
                if k in ref.lru[t]:
                    ref.lru[t].remove(k)
        elif op == "unpin":
            n = rng.randint(1, 2)
            if n > ref.e[k]["refs"]:
                with pytest.raises(ValueError, match="below zero"):
                    ix.unpin(k, n)
                continue
            ref.e[k]["refs"] -= n
            assert ix.unpin(k, n) == ref.e[k]["refs"]
            if ref.e[k]["refs"] == 0:
                ref.mru(k, DEV)
                ref.mru(k, HOST)
        elif op == "touch":
            ix.touch(k)
            ref.e[k]["hits"] += 1
            ref.e[k]["last"] = ref.now()
            ref.mru(k, DEV)
            ref.mru(k, HOST)
        elif op in ("set", "clear"):
            t = rng.choice([DEV, HOST])
            name = "dev" if t == DEV else "host"
            if op == "clear":
                got = ix.clear_device(k) if t == DEV else ix.clear_host(k)
                assert got == ref.e[k][name]
                ref.e[k][name] = None
                if k in ref.lru[t]:
                    ref.lru[t].remove(k)
                continue
            ident = rng.choice(ids)
            setter = ix.set_device if t == DEV else ix.set_host
            if ref.owner(t, ident) not in (None, k):
                with pytest.raises(ValueError, match="already holds"):
                    setter(k, ident)
                continue
            assert setter(k, ident) == ref.e[k][name]
            ref.e[k][name] = ident
            ref.mru(k, t)
        elif op == "add_b":
            b = rng.choice([0, 1, 2, 31])
            assert ix.add_backend(k, b) == (b not in ref.e[k]["bk"])
            ref.e[k]["bk"].add(b)
        else:
            b = rng.choice([0, 1, 2, 31])
            assert ix.remove_backend(k, b) == (b in ref.e[k]["bk"])
            ref.e[k]["bk"].discard(b)

        if step % 50 == 0:
            check_against(ix, ref, pool, rng)
    check_against(ix, ref, pool, rng)


def check_against(ix: BlockIndex, ref: Reference, pool: list[bytes], rng: random.Random) -> None:
    ix.validate()
    assert len(ix) == len(ref.e) and set(ix) == set(ref.e)
    for k, e in ref.e.items():
        got = ix.entry(k)
        assert (got.device, got.host, set(got.backends), got.refs, got.hits, got.last_access) == (
            e["dev"], e["host"], e["bk"], e["refs"], e["hits"], e["last"])
    for t in (DEV, HOST):
        assert ix.eviction_candidates(t, 1000) == ref.lru[t]
        assert ix.eviction_candidates(t, 3) == ref.lru[t][:3]
        assert ix.count(t) == sum(ref.loc(k, t) is not None for k in ref.e)
    for b in (0, 1, 31):
        lru = sorted((e["last"], k) for k, e in ref.e.items() if b in e["bk"] and e["refs"] == 0)
        assert ix.eviction_candidates(B(b), 1000) == [k for _, k in lru]
        assert ix.count(B(b)) == sum(b in e["bk"] for e in ref.e.values())
    # mostly present keys, so chains run long, with an occasional absent one as the hole
    chain = rng.sample(list(ref.e), min(20, len(ref.e)))
    chain.insert(rng.randint(0, len(chain)), rng.choice(pool))
    want = list(itertools.takewhile(lambda c: c != Tier.MISSING, map(ref.best, chain)))
    m = ix.lookup_prefix(chain)
    assert m.length == len(want) and m.tiers.tolist() == want
    assert m.device_ids.tolist() == [ref.e[k]["dev"] if ref.e[k]["dev"] is not None else -1
                                     for k in chain[:m.length]]


def test_bench_index_smoke(tmp_path, capsys):
    import argparse
    import json

    from kvtier.tools.bench import index as bench

    parser = argparse.ArgumentParser()
    bench.add_arguments(parser)
    out = tmp_path / "ix.json"
    assert bench.run(parser.parse_args(["--entries", "20000", "--repeats", "3", "--json", str(out)])) == 0
    figures = json.loads(out.read_text())
    assert figures["chain"] == 8192 and figures["lookup_ms"] > 0 and figures["bytes_per_entry"] > 0
    assert "ceiling: bare dict.get loop" in capsys.readouterr().out


def test_forget_backend_unmarks_it_everywhere_and_drops_entries_it_leaves_nowhere():
    idx = BlockIndex(capacity=4)  # grows past it: the scan covers the grown columns
    idx.insert(key(0), backends=[0])            # only in backend 0: dropped
    idx.insert(key(1), backends=[0, 1])         # also in backend 1: kept there
    idx.insert(key(2), host=5, backends=[0])    # in host memory: kept
    idx.insert(key(3), backends=[0])
    idx.pin(key(3))                             # in use: kept (a load holds it)
    idx.insert(key(4), backends=[1])            # never in backend 0: untouched
    for i in range(5, 12):
        idx.insert(key(i), device=i)
    assert idx.forget_backend(0) == 4
    assert idx.count(Tier.backend(0)) == 0 and idx.count(Tier.backend(1)) == 2
    assert key(0) not in idx
    assert idx.entry(key(1)).backends == (1,) and idx.entry(key(2)).backends == ()
    assert idx.entry(key(2)).host == 5 and idx.refs(key(3)) == 1 and idx.entry(key(3)).backends == ()
    assert idx.entry(key(4)).backends == (1,)
    assert idx.forget_backend(0) == 0
    idx.validate()
    with pytest.raises(ValueError, match=r"backend index must be an int in \[0, 32\)"):
        idx.forget_backend(32)


@pytest.mark.parametrize("seed", range(5))
def test_short_chains_are_looked_up_exactly_as_the_vector_path_does(seed, monkeypatch):
    """Chains up to SHORT_CHAIN keys are walked key by key; the answer (length, tier, device id and host
    slot of each block, dtypes) must be the vectorised one's, on an index with every kind of entry; and
    prefix_tiers (the manager's lookups) must give the same tiers."""
    import kvtier.index.prefix as index_mod

    r = random.Random(seed)
    ix = BlockIndex()
    ks = [key(i) for i in range(60)]
    for i, k in enumerate(ks):
        kind = r.choice(["device", "host", "both", "backends", "placeholder", "absent", "absent"])
        if kind == "absent":
            continue
        ix.insert(k, device=i if kind in ("device", "both") else None,
                  host=100 + i if kind in ("host", "both") else None,
                  backends=r.sample(range(MAX_BACKENDS), r.randint(1, 3)) if kind == "backends" else ())
    chains = [[], ks[:1], ks[:20]] + [[ks[j] for j in r.sample(range(60), r.randint(1, 48))] for _ in range(40)]
    chains += [[k for k in ks if ix.lookup_prefix([k]).length] [:n] for n in (5, 30, 48)]  # long hits
    for chain in chains:
        short = ix.lookup_prefix(chain)
        monkeypatch.setattr(index_mod, "SHORT_CHAIN", -1)
        vec = ix.lookup_prefix(chain)
        monkeypatch.setattr(index_mod, "SHORT_CHAIN", 48)
        assert short.length == vec.length
        for a, b in ((short.tiers, vec.tiers), (short.device_ids, vec.device_ids), (short.host_slots, vec.host_slots)):
            assert a.dtype == b.dtype and a.tolist() == b.tolist()
        assert short.in_memory == vec.in_memory
        assert ix.prefix_tiers(chain) == [tier_of(t) for t in vec.tiers.tolist()]
    assert max(ix.lookup_prefix(c).length for c in chains) >= 20  # long runs were compared, not only misses


def _state(ix: BlockIndex, ks: list[bytes]) -> tuple[object, ...]:
    """Everything observable: each key's entry, both memory tiers' LRU order, every backend's count."""
    ix.validate()
    return ([ix.get(k) for k in ks], ix.eviction_candidates(DEV, 10**6), ix.eviction_candidates(HOST, 10**6),
            [ix.count(B(i)) for i in range(4)], ix.pinned, len(ix))


@pytest.mark.parametrize("seed", range(6))
def test_batch_operations_are_their_single_key_forms_in_order(seed):
    """place_on_device_many, acquire_many, release_many, drop_host_many, land_host_many, add_backend_many,
    free_devices, host_slots, masks, refs_many and loaded_many leave exactly the state (entries, LRU orders, counts) of the single-key calls in order,
    on random batches with repeats, absent keys and keys pinned twice."""
    r = random.Random(seed)
    ks = [key(i) for i in range(40)]
    one, many = ticking(), ticking()
    for step in range(300):
        batch = [r.choice(ks) for _ in range(r.randint(0, 8))]
        op = r.choice(["place", "acquire", "release", "drop_host", "add_backend", "free", "set_host", "land",
                       "loaded"])
        if op == "place":
            ids = r.sample(range(30), len(batch))
            batch = list(dict.fromkeys(batch))[:len(ids)]
            ids = ids[:len(batch)]
            for k, b in zip(batch, ids):
                one.place_on_device(k, b)
            many.place_on_device_many(batch, ids)
        elif op == "acquire":
            want_slots = [one.host_slot(k) if k in one else None for k in batch]
            for k in batch:
                one.acquire(k)
            got_slots: list[int] = []
            many.acquire_many(batch, got_slots)
            assert got_slots == [-1 if h is None else h for h in want_slots]
        elif op == "release":
            batch = [k for k in dict.fromkeys(batch) if k in one and one.refs(k)]
            for k in batch:
                one.release(k)
            many.release_many(batch)
        elif op == "drop_host":
            batch = [k for k in dict.fromkeys(batch) if k in one and not one.refs(k)]
            want = [one.host_slot(k) for k in batch]
            for k in batch:
                one.clear_host(k)
                one.discard_if_unused(k)
            assert many.drop_host_many(batch) == [-1 if h is None else h for h in want]
        elif op == "add_backend":
            i = r.randrange(4)
            for k in batch:
                if k in one:
                    one.add_backend(k, i)
            many.add_backend_many(batch, i)
        elif op == "free":
            ids = [r.randrange(35) for _ in batch]
            for b in ids:  # free_device's meaning from the primitives (free_device is free_devices of one)
                held = one.key_at_device(b)
                if held is not None:
                    one.clear_device(held)
                    one.discard_if_unused(held)
            many.free_devices(ids)
        elif op == "loaded":  # a load's pinned blocks land: place, touch and release each (loaded_many)
            batch = list(dict.fromkeys(batch))
            placed: list[Any] = r.sample(range(30), len(batch))
            if batch and r.random() < 0.3:  # an id of another type: the rest take the three calls
                cut = r.randrange(len(batch))
                placed[cut:] = [np.int64(b) for b in placed[cut:]]
            for k in batch:
                one.acquire(k)
                many.acquire(k)
            for k, b in zip(batch, placed):
                one.place_on_device(k, b)
            want = [one.touch(k, float(step)) for k in batch]
            for k in batch:
                one.release(k)
            assert many.loaded_many(batch, placed, float(step)) == want
        elif op == "land":  # land_host_many: insert if absent and set_host, unless in another slot already
            batch = list(dict.fromkeys(batch))
            free = [x for x in range(100) if one.key_at_host(x) is None]
            slots = r.sample(free, len(batch))
            want = []
            for k, slot in zip(batch, slots):
                if k in one and one.host_slot(k) is not None and one.host_slot(k) != slot:
                    want.append(False)
                    continue
                if k not in one:
                    one.insert(k)
                one.set_host(k, slot)
                want.append(True)
            assert many.land_host_many(batch, slots) == want
        else:  # give a few keys host slots, the single way in both: what drop_host then takes away
            for k in dict.fromkeys(batch):
                if k in one and one.host_slot(k) is None:
                    slot = next(s for s in range(100) if one.key_at_host(s) is None)
                    one.set_host(k, slot)
                    many.set_host(k, slot)
        assert many.host_slots(ks) == [-1 if one.host_slot(k) is None else one.host_slot(k) for k in ks]
        assert many.masks(ks) == [sum(1 << i for i in one.entry(k).backends) if k in one else 0 for k in ks]
        assert many.refs_many(ks) == [one.refs(k) if k in one else 0 for k in ks]
        assert _state(one, ks) == _state(many, ks), (step, op)
    assert one.count(HOST) and one.pinned and len(one) > 10  # the walk reached every kind of entry
    with pytest.raises(ValueError, match="place_on_device_many: 2 keys for 1 device block ids"):
        many.place_on_device_many(ks[:2], [0])
    with pytest.raises(ValueError, match="land_host_many: 1 keys for 2 host slots"):
        many.land_host_many(ks[:1], [0, 1])
    with pytest.raises(ValueError, match="loaded_many: 2 keys for 1 device block ids"):
        many.loaded_many(ks[:2], [0])
