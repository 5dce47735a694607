"""kvtier under vLLM's own KV offloading: ``KvtierTier`` as a secondary tier of vLLM's tiering manager.

vLLM's native offloading refuses to build its worker on a CPU platform, so the engine cannot run it here.
These tests drive vLLM's *own* ``TieringOffloadingSpec`` / ``TieringOffloadingManager`` in process, as its
scheduler does (``prepare_store`` -> the worker's copy into the primary row -> ``complete_store`` cascades;
``lookup`` -> RETRY while the probe runs -> promotion -> HIT -> ``prepare_load``), over vLLM's real shared
offload region (``/dev/shm``), with the tier loaded by vLLM's factory from ``module_path``, and real
backends: files, a real redis-server, moto's S3 server over HTTP.  What the GPU worker would copy into a
row is written by the test (random bytes per chunk), and a promotion must return exactly those bytes.

The cross-engine case runs a real vLLM (CPU build) with ``KvtierConnector``: the connector's values are
promoted by the tier into vLLM's primary region byte for byte, and values the tier stored from those rows
are loaded by the connector in another vLLM process, which then serves the prompt's prefix from them.
"""

from __future__ import annotations

import re
import time
import uuid
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import numpy as np
import pytest
import yaml

pytest.importorskip("vllm")

from vllm.v1.kv_offload.base import (  # noqa: E402
    Locality,
    LookupResult,
    Medium,
    ReqContext,
    ScheduleEndContext,
    make_offload_key,
)
from vllm.v1.kv_offload.config import (  # noqa: E402
    OffloadingCacheConfig,
    OffloadingConfig,
    OffloadingGroupConfig,
    OffloadingModelConfig,
    OffloadingParallelConfig,
)
from vllm.v1.kv_offload.tiering.manager import TieringOffloadingManager  # noqa: E402
from vllm.v1.kv_offload.tiering.spec import TieringOffloadingSpec  # noqa: E402

from kvtier.keys import BlockHasher  # noqa: E402

BS = 32
LAYERS = ("model.layers.0.self_attn.attn", "model.layers.1.self_attn.attn")
HEADS, HEAD_DIM = 2, 64
PAGE = len(LAYERS) * 2 * BS * HEADS * HEAD_DIM * 2  # bf16 K and V of one block, all layers: 32 KiB
TIER = {"type": "KvtierTier", "module_path": "kvtier.integrations.vllm_tier"}
MODEL = {"id": "kvtier/tier-test", "num_kv_heads": HEADS, "head_dim": HEAD_DIM}


def disk(path: Path, **options: Any) -> dict[str, Any]:
    return {"name": "disk", "type": "local_disk", "options": {"path": str(path), "capacity": "64MiB", **options}}


def write_yaml(tmp: Path, backends: list[dict[str, Any]], model: dict[str, Any] | None = MODEL) -> str:
    p = tmp / f"tier-{uuid.uuid4().hex[:8]}.yaml"
    data: dict[str, Any] = {"keys": {"algo": "sha256_cbor", "seed": "0"}, "backends": backends}
    if model is not None:
        data["model"] = model
    p.write_text(yaml.safe_dump(data))
    return str(p)


def offloading_config(tier: dict[str, Any], *, chunks: int = 16, model: str = "kvtier/tier-test",
                      events: bool = False, bp: dict[str, Any] | None = None) -> OffloadingConfig:
    extra: dict[str, Any] = {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": chunks * PAGE,
                             "secondary_tiers": [dict(tier)]}
    if bp is not None:
        extra["secondary_tiers"][0]["backpressure"] = bp
    return OffloadingConfig(
        groups=(OffloadingGroupConfig(tokens_per_block=BS, layer_names=LAYERS, group_id=0),),
        worker_kv_bytes_per_block=PAGE, enable_kv_cache_events=events, extra_config=extra,
        engine_id=f"kvtier-tier-{uuid.uuid4().hex[:12]}",
        model=OffloadingModelConfig(name=model, dtype="bfloat16"),
        cache=OffloadingCacheConfig(tokens_per_hash=BS, blocks_per_chunk=1),
        parallel=OffloadingParallelConfig(rank=0, world_size=1, tp_size=1, pp_size=1, pcp_size=1, dcp_size=1,
                                          data_parallel_index=0, data_parallel_size=1,
                                          data_parallel_rank_local=None, is_parallelism_agnostic=True))


class Scheduler:
    """vLLM's scheduler side of native offloading, driven as OffloadingConnectorScheduler drives it."""

    def __init__(self, cfg: OffloadingConfig):
        self.spec = TieringOffloadingSpec(cfg)
        manager = self.spec.get_manager()
        assert isinstance(manager, TieringOffloadingManager)
        self.manager: Any = manager  # driven with plain bytes keys (OffloadKey is a NewType of bytes)
        self.tier: Any = self.manager.secondary_tiers[0]
        self.rows = np.asarray(self.manager.primary_tier.get_kv_memoryview()).view(np.uint8)
        self._n = 0
        self.promotions: set[int] = set()

    def ctx(self) -> ReqContext:
        self._n += 1
        ctx = ReqContext(req_id=f"req-{self._n}")
        self.manager.on_new_request(ctx)
        return ctx

    def step(self) -> None:
        self.manager.on_schedule_end(ScheduleEndContext(new_req_ids=(), preempted_req_ids=()))

    def settle(self, timeout: float = 30.0) -> None:
        """Step until no transfer is in flight (the engine keeps stepping while has_pending_work)."""
        deadline = time.monotonic() + timeout
        self.step()  # promotions reserved by lookups are submitted at the end of a step
        while self.manager.has_pending_work():
            assert time.monotonic() < deadline, "tier jobs never finished"
            time.sleep(0.005)
            self.step()

    def store(self, keys: Sequence[Any], payloads: list[bytes], copy: Any = None) -> None:
        """GPU -> primary (the test plays the worker's copy: ``copy(chunk, i)`` puts chunk ``i`` into row
        ``chunk``, else the bytes are written from the CPU) -> cascade to the tier."""
        ctx = self.ctx()
        out = self.manager.prepare_store(keys, ctx)
        assert out is not None
        for k, c in zip(out.keys_to_store, out.store_spec.chunk_ids):
            if copy is not None:
                copy(int(c), keys.index(k))
            else:
                self.rows[int(c), :PAGE] = np.frombuffer(payloads[keys.index(k)], dtype=np.uint8)
        self.manager.complete_store(out.keys_to_store, ctx)
        self.manager.on_request_finished(ctx)
        self.settle()

    def lookup_all(self, keys: Sequence[Any], timeout: float = 30.0) -> tuple[list[LookupResult], ReqContext]:
        """Each step, look the chain up as vLLM's scheduler does (RETRY does not stop the scan, a MISS
        does) until the answer no longer changes: every key HIT, or a HIT prefix then a MISS."""
        ctx = self.ctx()
        deadline = time.monotonic() + timeout
        while True:
            res = []
            for k in keys:
                r = self.manager.lookup(k, ctx)
                res.append(r)
                if r is LookupResult.MISS:
                    break
            if all(r in (LookupResult.HIT, LookupResult.MISS) for r in res):
                return res, ctx
            assert time.monotonic() < deadline, f"lookups never settled: {res}"
            self.step()
            time.sleep(0.005)

    def load(self, keys: Sequence[Any]) -> list[bytes]:
        """The prefix of ``keys`` vLLM would load, as the bytes of the primary rows it loads from."""
        res, ctx = self.lookup_all(keys)
        hits = [k for k, r in zip(keys, res) if r is LookupResult.HIT]
        assert hits == keys[:len(hits)]
        out = []
        if hits:
            spec = self.manager.prepare_load(hits, ctx)
            out = [self.rows[int(c), :PAGE].tobytes() for c in spec.chunk_ids]
            self.manager.complete_load(hits, ctx)
        self.manager.on_request_finished(ctx)
        self.settle()
        return out

    def close(self) -> None:
        del self.rows  # the region's mmap cannot close while a view of it lives
        self.manager.shutdown()


@pytest.fixture
def sched_factory() -> Iterator[Any]:
    made: list[Scheduler] = []

    def make(cfg: OffloadingConfig) -> Scheduler:
        s = Scheduler(cfg)
        made.append(s)
        return s

    yield make
    for s in made:
        s.close()


def spy_jobs(s: Scheduler) -> list[Any]:
    """Every JobResult the tier hands vLLM's manager, as it hands it (and the promotion job ids in
    ``s.promotions``)."""
    finished: list[Any] = []
    s.promotions = set()
    tier = s.tier
    orig_results, orig_load = tier.get_finished_jobs, tier.submit_load

    def results() -> Any:
        got = list(orig_results())
        finished.extend(got)
        return got

    def load(job: Any) -> None:
        s.promotions.add(job.job_id)
        orig_load(job)
    tier.get_finished_jobs, tier.submit_load = results, load
    return finished


def chain(n: int, seed: int = 1) -> tuple[list[bytes], list[bytes]]:
    """vLLM offload keys of a prompt of ``n`` blocks (its block hashes: kvtier's sha256_cbor = vLLM's, seed
    "0") and random KV bytes per chunk."""
    rng = np.random.default_rng(seed)
    tokens = rng.integers(1, 30000, n * BS).tolist()
    hashes = BlockHasher(BS, "sha256_cbor", seed="0").hash_blocks(tokens)
    return [make_offload_key(h, 0) for h in hashes], [rng.bytes(PAGE) for _ in range(n)]


def fresh(sched_factory: Any, tier: dict[str, Any], **kw: Any) -> Scheduler:
    s: Scheduler = sched_factory(offloading_config(tier, **kw))
    return s


def test_stores_cascade_to_local_disk_and_promotions_return_the_same_bytes(sched_factory, tmp_path):
    """A prompt's chunks cascade from vLLM's primary region to local_disk as kvtier values; an instance
    with an empty primary finds them (RETRY while its probe runs, never blocking), promotes them and
    serves exactly the bytes stored.  Files are kvtier's verified values (header + payload)."""
    tier = {**TIER, "kvtier_config": write_yaml(tmp_path, [disk(tmp_path / "d")])}
    keys, payloads = chain(5)
    a = fresh(sched_factory, tier)
    a.store(keys, payloads)
    files = sorted(p.name for p in (tmp_path / "d").rglob("*") if re.fullmatch(r"[0-9a-f]{64}", p.name))
    assert files == sorted(k[:-4].hex() for k in keys)
    b = fresh(sched_factory, tier)
    ctx = b.ctx()
    assert b.manager.lookup(keys[0], ctx) is LookupResult.RETRY  # the probe is in flight, nothing waited
    b.manager.on_request_finished(ctx)
    assert b.load(keys) == payloads
    assert b.load(keys) == payloads  # now from vLLM's primary tier
    st = b.tier.stats()["backends"]["disk"]
    assert st["hits"] == 5 and st["corrupt"] == 0


def test_a_damaged_value_is_a_failed_key_never_promoted(sched_factory, tmp_path):
    tier = {**TIER, "kvtier_config": write_yaml(tmp_path, [disk(tmp_path / "d")])}
    keys, payloads = chain(4, seed=2)
    fresh(sched_factory, tier).store(keys, payloads)
    victim = next(p for p in (tmp_path / "d").rglob(keys[2][:-4].hex()))
    raw = bytearray(victim.read_bytes())
    raw[-100] ^= 0xFF  # one payload bit flipped: the checksum fails
    victim.write_bytes(bytes(raw))
    b = fresh(sched_factory, tier)
    finished = spy_jobs(b)
    res, ctx = b.lookup_all(keys)
    b.manager.on_request_finished(ctx)
    assert res == [LookupResult.HIT, LookupResult.HIT, LookupResult.MISS]  # key 2: a miss once its load failed
    promo = [r for r in finished if r.job_id in b.promotions]
    assert len(promo) == 1 and promo[0].success is False
    assert set(promo[0].successful_keys) == {keys[0], keys[1], keys[3]}  # verified ones only
    assert not victim.exists()  # deleted by the backend
    assert b.load(keys) == payloads[:2]
    assert b.tier.stats()["backends"]["disk"]["corrupt"] == 1


def redis(url: str, **options: Any) -> dict[str, Any]:
    return {"name": "redis", "type": "redis", "options": {"url": url, **options}}


def s3(bucket: str, endpoint: str) -> dict[str, Any]:
    return {"name": "s3", "type": "s3", "options": {"bucket": bucket, "endpoint_url": endpoint, "region": "us-east-1"}}


@pytest.mark.parametrize("kind", ["redis", "s3"])
def test_stores_cascade_to_redis_and_s3_and_promote_byte_identical(kind, request, sched_factory, tmp_path):
    if kind == "redis":
        backend = redis(request.getfixturevalue("redis_server").url)
    else:
        backend = s3(request.getfixturevalue("s3_bucket"), request.getfixturevalue("moto_server").endpoint_url)
    tier = {**TIER, "kvtier_config": write_yaml(tmp_path, [backend])}
    keys, payloads = chain(4, seed=3)
    a = fresh(sched_factory, tier)
    a.store(keys, payloads)
    assert a.tier.stats()["backends"][kind]["puts"] == 4
    b = fresh(sched_factory, tier)
    assert b.load(keys) == payloads
    assert b.tier.locality is Locality.REMOTE


def test_a_backend_outage_is_misses_and_failed_jobs_never_an_exception(sched_factory, tmp_path, redis_server):
    """Redis stops after the probe found the chunks: the promotion fails (keys become misses, vLLM
    recomputes), and stores while it is down are failed jobs; no method of the tier raises, and the
    manager has no pending work left once the jobs are reported."""
    tier = {**TIER, "kvtier_config": write_yaml(tmp_path, [redis(redis_server.url, timeout_s=1.0)])}
    keys, payloads = chain(3, seed=4)
    fresh(sched_factory, tier).store(keys, payloads)
    b = fresh(sched_factory, tier)
    finished = spy_jobs(b)
    ctx = b.ctx()
    assert [b.manager.lookup(k, ctx) for k in keys] == [LookupResult.RETRY] * 3
    b.step()  # the probe batch goes to vLLM's lookup thread
    deadline = time.monotonic() + 10
    while b.tier._probes._pending_results.empty():  # noqa: SLF001 - waiting for the probe, not polling the tier
        assert time.monotonic() < deadline
        time.sleep(0.01)
    redis_server.stop()
    assert b.manager.lookup(keys[0], ctx) is LookupResult.HIT_PENDING  # found: promotion reserved
    b.manager.on_request_finished(ctx)
    b.settle()
    assert [r.success for r in finished if r.job_id in b.promotions] == [False]
    res, ctx2 = b.lookup_all(keys)
    b.manager.on_request_finished(ctx2)
    assert res == [LookupResult.MISS]
    more, more_payloads = chain(2, seed=5)
    b.store(more, more_payloads)  # cascades fail while Redis is down
    stores = [r for r in finished if r.job_id not in b.promotions]
    assert stores and not any(r.success for r in stores)
    assert not b.manager.has_pending_work()
    stats = b.tier.stats()
    assert stats["backends"]["redis"]["unavailable"] > 0
    redis_server.start()


def test_has_pending_work_while_a_cascade_is_in_flight(sched_factory, tmp_path, redis_server):
    """A store to a stalled Redis (paused: it accepts nothing) stays in flight: has_pending_work is True
    for the tier and vLLM's manager, and every method keeps answering at once; resumed, it completes."""
    tier = {**TIER, "kvtier_config": write_yaml(tmp_path, [redis(redis_server.url, timeout_s=20.0)])}
    s = fresh(sched_factory, tier)
    keys, payloads = chain(2, seed=6)
    redis_server.pause()
    ctx = s.ctx()
    out = s.manager.prepare_store(keys, ctx)
    for k, c in zip(out.keys_to_store, out.store_spec.chunk_ids):
        s.rows[int(c), :PAGE] = np.frombuffer(payloads[keys.index(k)], dtype=np.uint8)
    t0 = time.monotonic()
    s.manager.complete_store(out.keys_to_store, ctx)
    s.manager.on_request_finished(ctx)
    for _ in range(5):
        s.step()
        assert s.manager.has_pending_work() and s.tier.has_pending_work()
        assert list(s.tier.get_finished_jobs()) == []
    assert time.monotonic() - t0 < 2.0  # nothing waited on the stalled server
    redis_server.resume()
    s.settle()
    assert not s.tier.has_pending_work()
    assert fresh(sched_factory, tier).load(keys) == payloads


def test_back_pressure_drops_cascades_as_vllms_detector_decides(sched_factory, tmp_path):
    """The tier reports each cascade's bytes and time; vLLM's EMA detector (water marks set below any real
    store's latency) goes under pressure after its warm-up and vLLM drops later cascades to this tier."""
    tier = {**TIER, "kvtier_config": write_yaml(tmp_path, [disk(tmp_path / "d")])}
    bp = {"backpressure_cls": "EMABackpressureDetector", "policy_cls": "DropStorePolicy",
          "high_water_s": 1e-9, "low_water_s": 1e-10, "warmup_completions": 2, "decay_half_life_s": 0}
    s = fresh(sched_factory, tier, bp=bp)
    keys, payloads = chain(6, seed=7)
    for k, p in zip(keys, payloads):  # one prompt block after another: one cascade each
        s.store([k], [p])
    det = s.tier.bp_detector
    assert det.is_under_pressure()
    files = {p.name for p in (tmp_path / "d").rglob("*") if re.fullmatch(r"[0-9a-f]{64}", p.name)}
    assert files == {k[:-4].hex() for k in keys[:3]}  # 2 warm-up completions, 1 that set the pressure
    stats = s.manager.get_stats()
    assert stats is not None
    dropped = stats.reduce()
    assert any("backpressure_stores_dropped" in name and v == 3 for name, v in dropped.items()), dropped


def test_events_carry_storage_medium_locality_and_the_kvtier_backend(sched_factory, tmp_path, redis_server):
    """Stored chunks are announced per backend: vLLM's medium STORAGE, locality LOCAL for local_disk and
    REMOTE for Redis, and the kvtier backend as the event's ownership (kvtier:<type>); local_disk's own evictions
    (capacity for 3 values) are announced removed."""
    backends = [disk(tmp_path / "d", capacity=3 * (PAGE + 88) + 100), redis(redis_server.url)]
    tier = {**TIER, "kvtier_config": write_yaml(tmp_path, backends), "enable_kv_events": True}
    s = fresh(sched_factory, tier, events=True)
    keys, payloads = chain(5, seed=8)
    s.store(keys[:3], payloads[:3])
    s.store(keys[3:], payloads[3:])  # local_disk makes room: the two oldest values go
    evs = [e for e in s.manager.take_events() if e.ownership is not None]
    stored: dict[Any, set[bytes]] = {}
    for e in evs:
        if not e.removed:
            stored.setdefault((e.ownership, e.locality, e.medium), set()).update(e.keys)
    assert stored == {("kvtier:local_disk", Locality.LOCAL, Medium.STORAGE): set(keys),
                      ("kvtier:redis", Locality.REMOTE, Medium.STORAGE): set(keys)}
    removed = [e for e in evs if e.removed]
    assert removed and all(e.ownership == "kvtier:local_disk" and e.medium is Medium.STORAGE for e in removed)
    assert {k for e in removed for k in e.keys} == set(keys[:2])  # the two least recently written
    assert fresh(sched_factory, tier).load(keys) == payloads  # Redis still has all five
    assert s.tier.locality is None  # local and remote backends together: vLLM's filters match either


@pytest.mark.gpu
def test_the_same_cascade_and_promotion_with_the_primary_region_pinned_on_a_gpu(sched_factory, tmp_path):
    """As on a GPU node: vLLM's region registered as pinned memory (vLLM's own host_register), chunks copied
    into it from GPU memory, cascaded to local_disk, promoted by another instance and copied back to the
    GPU equal to what was stored."""
    import torch

    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    from vllm.v1.kv_offload.cpu.host_register import host_register

    tier = {**TIER, "kvtier_config": write_yaml(tmp_path, [disk(tmp_path / "d")])}

    def pinned(s: Scheduler) -> torch.Tensor:
        region = s.spec._scheduler_mmap
        assert region is not None
        base = region.base_tensor
        assert host_register(base.data_ptr(), region.total_size_bytes)
        region.is_pinned, region.pinned_addresses = True, [base.data_ptr()]  # vLLM unregisters at cleanup
        return torch.from_numpy(s.rows)

    keys, payloads = chain(4, seed=9)
    kv = torch.tensor(np.frombuffer(b"".join(payloads), dtype=np.uint8), device="cuda").view(4, PAGE)
    a = fresh(sched_factory, tier)
    rows_a = pinned(a)
    assert rows_a.is_pinned()

    def gpu_to_row(chunk: int, i: int) -> None:
        rows_a[chunk, :PAGE].copy_(kv[i], non_blocking=True)
        torch.cuda.synchronize()
    a.store(keys, payloads, copy=gpu_to_row)
    b = fresh(sched_factory, tier)
    pinned(b)
    got = b.load(keys)
    back = torch.tensor(np.frombuffer(b"".join(got), dtype=np.uint8)).view(4, PAGE).cuda(non_blocking=True)
    assert torch.equal(back, kv)


# --------------------------------------------------------------------------- with KvtierConnector in real vLLM

import test_vllm as tv  # noqa: E402 - its model fixture, prompts and driver
from test_vllm import model_dir  # noqa: E402,F401 - the fixture, for this module


def test_kvtier_connector_values_and_the_tiers_are_the_same_values(model_dir, tmp_path):  # noqa: F811
    """Where the layouts agree (vLLM's CPU build, one worker, one block per chunk, the connector with
    ``storage.payload: engine``), the tier and ``KvtierConnector`` store the same values under the same
    keys.  A real vLLM with the connector computes prompt A (9 blocks); the tier, named from vLLM's own
    offloading config and the model's HF config (no model section in its YAML), promotes those values into
    vLLM's primary region byte for byte; it cascades those rows to a second directory; a second real vLLM
    with the connector loads A's 9 blocks from the tier's values (288 cached tokens) and decodes A's tokens."""
    from kvtier.backends.local_disk import LocalDiskBackend

    producer_dir, tier_dir = tmp_path / "connector", tmp_path / "tier"

    def conn_cfg(d: Path) -> dict[str, Any]:
        return {**tv.kv_config(tv.disk(d)), "storage": {"payload": "engine"}}

    pre = tv.run_vllm(model_dir, tmp_path, "kv_producer", [tv.A], conn_cfg(producer_dir))
    hashes = tv.vllm_block_hashes(tv.A)
    keys = [make_offload_key(h, 0) for h in hashes]
    # LAYERS, PAGE: the test model's (2 layers, 2 KV heads of 64, bf16, blocks of 32)
    a = Scheduler(offloading_config({**TIER, "kvtier_config": write_yaml(tmp_path, [tv.disk(producer_dir)],
                                                                         model=None)}, model=model_dir))
    try:
        assert a.tier.naming.connector_compatible
        got = a.load(keys)
        assert len(got) == 9
        ns = a.tier.naming.namespace
        with LocalDiskBackend({"path": str(producer_dir)}) as raw:  # the connector's values, read directly
            bufs = [bytearray(PAGE) for _ in keys]
            assert raw.get_into(ns.keys(hashes), bufs, ns.layout_id) == [True] * 9
        assert got == [bytes(b) for b in bufs]
    finally:
        a.close()
    b = Scheduler(offloading_config({**TIER, "kvtier_config": write_yaml(tmp_path, [tv.disk(tier_dir)], model=None)},
                                    model=model_dir))
    try:
        b.store(keys, got)
    finally:
        b.close()
    assert set(tv.block_files(tier_dir)) == {h.hex() for h in hashes}
    post = tv.run_vllm(model_dir, tmp_path, "kv_consumer", [tv.A], conn_cfg(tier_dir))
    assert [r["cached"] for r in post["results"]] == [288]  # A's 9 full blocks, all from the tier's values
    tv.assert_close_outputs(post["results"], pre["results"])

