"""kvtier as SGLang's HiCache storage backend, inside SGLang 0.5.23's own classes on a CPU.

Every test drives SGLang's real ``HiCacheController`` (its prefetch, prefetch-I/O and backup threads) with
kvtier attached through SGLang's backend factory exactly as ``--hicache-storage-backend dynamic`` does,
over SGLang's real host pools (``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` on ``cpu``) in every
host layout, and kvtier's real backends: local disk, a real redis-server and S3 (moto's server).
``tests/sglang/sgl_harness.py`` plays the radix cache's part around the controller (backups, prefetches,
host slots) and reads / writes host pages per token with its own implementation of SGLang's layouts.
Page data is random bytes (every bit pattern of the dtype), so "equal" means bit-identical.
"""

from __future__ import annotations

import json
import random
import re
import subprocess
import sys
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml

sys.path.insert(0, str(Path(__file__).parent / "sglang"))
import sgl_harness as h  # noqa: E402 - SGLang importable without torchvision, before anything imports it

from kvtier.config import load_engine_config  # noqa: E402
from kvtier.integrations.sglang import KvtierStorage  # noqa: E402
from kvtier.integrations.sglang.store import PageStore  # noqa: E402

CONFIGS = Path(__file__).resolve().parents[1] / "configs"
WRITER = Path(__file__).parent / "sglang" / "sgl_writer.py"
P = 4  # tokens per page


def tokens(n_pages: int, seed: int) -> list[int]:
    rng = random.Random(seed)
    return [rng.randrange(1, 50_000) for _ in range(n_pages * P)]


def write_yaml(tmp: Path, backend: dict[str, Any], name: str = "kvtier.yaml", **extra) -> str:
    p = tmp / name
    p.write_text(yaml.safe_dump({"backends": [backend], **extra}))
    return str(p)


def disk(path: Path) -> dict[str, Any]:
    return {"name": "disk", "type": "local_disk", "options": {"path": str(path), "capacity": "1GiB"}}


def redis(url: str, **opts) -> dict[str, Any]:
    return {"name": "redis", "type": "redis", "options": {"url": url, **opts}}


def s3(moto, bucket: str) -> dict[str, Any]:
    return {"name": "s3", "type": "s3", "options": {"bucket": bucket, "endpoint_url": moto.endpoint_url,
                                                    "region": "us-east-1"}}


def load(cfg: str, toks: list[int], **kw) -> tuple[h.Prefetch, torch.Tensor | None]:
    """A fresh SGLang controller prefetches ``toks``; (what it found and loaded, the loaded pages)."""
    e = h.make_engine(cfg, **kw)
    try:
        pf = h.prefetch(e, toks)
        got = h.read_pages(e, pf.slots[:pf.loaded_tokens]) if pf.slots is not None else None
        return pf, got
    finally:
        e.close()


def same(a: torch.Tensor | None, b: torch.Tensor) -> bool:
    return a is not None and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def pages_for(toks: list[int], seed: int, **kw) -> torch.Tensor:
    """The pages ``sgl_writer.py`` / ``store`` put for ``toks`` (same geometry, same seed)."""
    e = h.Engine(None, None, "", P, kw.get("mla", False),
                 (3, 1, P, 1, 8) if kw.get("mla") else (3, 2, P, 2, 8), torch.bfloat16)
    return h.random_pages(e, len(toks) // P, seed)


def store(cfg: str, toks: list[int], seed: int, **kw) -> int:
    e = h.make_engine(cfg, **kw)
    try:
        stored, _ = h.backup(e, toks, pages_for(toks, seed, **kw))
        return stored
    finally:
        e.close()


def block_files(root: Path) -> dict[str, Path]:
    return {p.name: p for p in root.rglob("*") if p.is_file() and re.fullmatch(r"[0-9a-f]{64}", p.name)}


# ---------------------------------------------------------------------- one store, across processes


def test_pages_from_another_process_every_backend(tmp_path, redis_server, moto_server, s3_bucket, figures):
    """One process writes pages through SGLang's controller into local disk, Redis and S3 (interface_v1 on
    and off, three host layouts); fresh controllers in this process, in other layouts and the other
    interface, load every page bit-identical, and kvtier stored exactly its canonical payload."""
    cfgs = {"disk": write_yaml(tmp_path, disk(tmp_path / "blocks"), "disk.yaml"),
            "redis": write_yaml(tmp_path, redis(redis_server.url), "redis.yaml"),
            "s3": write_yaml(tmp_path, s3(moto_server, s3_bucket), "s3.yaml")}
    plan = [("disk", "layer_first", True, "page_head", False), ("redis", "page_first", False, "layer_first", True),
            ("s3", "page_head", True, "page_first_direct", True)]
    jobs = [{"yaml": cfgs[b], "layout": wl, "v1": wv, "tokens": tokens(9, i), "seed": i}
            for i, (b, wl, wv, _, _) in enumerate(plan)]
    (tmp_path / "jobs.json").write_text(json.dumps(jobs))
    r = subprocess.run([sys.executable, str(WRITER), str(tmp_path / "jobs.json")], capture_output=True, text=True,
                       timeout=300, cwd=Path(__file__).parent / "sglang")
    assert r.returncode == 0, r.stderr[-4000:]
    assert json.loads(r.stdout.strip().splitlines()[-1]) == [9 * P] * 3
    for i, (b, _, _, rl, rv) in enumerate(plan):
        toks = tokens(9, i)
        pf, got = load(cfgs[b], toks + [7, 7, 7], layout=rl, v1=rv)  # a partial page more: never a key
        assert (pf.hit_tokens, pf.loaded_tokens) == (9 * P, 9 * P), b
        assert same(got, pages_for(toks, i)), f"{b}: pages differ"
    # What kvtier stored is the canonical payload (per layer K then V, token-major), framed and verified
    # by kvtier's StorageBackend: read it back through the backend contract, by key.
    e = h.make_engine(cfgs["disk"])
    try:
        st: PageStore = e.kvtier.store
        keys = h.page_keys(tokens(9, 0), P)
        rows = torch.empty((9, st.codec.page_nbytes), dtype=torch.uint8)
        assert st.get_rows(keys, rows) == [True] * 9
        assert torch.equal(rows, pages_for(tokens(9, 0), 0).view(torch.uint8).reshape(9, -1))
        manifest = st.backends_list[0].get_manifest(st.namespace.id)
        assert manifest is not None
        assert manifest["hash_algo"] == "sglang_sha256"
    finally:
        e.close()
    figures("sglang pages written in another process, read bit-identical (3 backends)", 27)


# ---------------------------------------------------------------------- layouts and interfaces


@pytest.mark.parametrize("v1", [True, False], ids=["interface_v1", "generic"])
def test_every_host_layout_reads_every_other(tmp_path, v1):
    """Pages stored from each of SGLang's four host layouts load into each of the four (and through the
    other interface), bit-identical: the stored bytes depend on the KV, never on the layout."""
    cfg = write_yaml(tmp_path, disk(tmp_path / "blocks"))
    for i, layout in enumerate(h.LAYOUTS):
        assert store(cfg, tokens(5, 100 + i), 100 + i, layout=layout, v1=v1) == 5 * P
    for layout in h.LAYOUTS:
        e = h.make_engine(cfg, layout=layout, v1=not v1)
        try:
            for i in range(len(h.LAYOUTS)):
                pf = h.prefetch(e, tokens(5, 100 + i))
                assert pf.loaded_tokens == 5 * P, (layout, i)
                assert pf.slots is not None
                assert same(h.read_pages(e, pf.slots), pages_for(tokens(5, 100 + i), 100 + i)), (layout, i)
        finally:
            e.close()


@pytest.mark.parametrize("layout", h.LAYOUTS)
def test_hybrid_cache_controller(tmp_path, layout):
    """SGLang's HybridCacheController (what its unified radix cache runs; here over a HostPoolGroup holding
    the KV pool) stores and loads through kvtier the same pages the plain controller does."""
    cfg = write_yaml(tmp_path, disk(tmp_path / "blocks"))
    toks = tokens(6, 21)
    assert store(cfg, toks, 21, layout=layout, hybrid=True) == 6 * P
    pf, got = load(cfg, toks, layout=layout, hybrid=False)
    assert pf.loaded_tokens == 6 * P and same(got, pages_for(toks, 21))
    assert store(cfg, tokens(6, 22), 22, layout=layout) == 6 * P
    pf, got = load(cfg, tokens(6, 22), layout=layout, hybrid=True)
    assert type(pf) is h.Prefetch and pf.loaded_tokens == 6 * P and same(got, pages_for(tokens(6, 22), 22))


@pytest.mark.parametrize("layout", h.MLA_LAYOUTS)
def test_mla_pages_are_shared_by_every_tp_rank(tmp_path, layout):
    """MLA KV is the same on every TP rank: rank 0 stores (SGLang writes MLA from one rank), rank 1 of the
    same deployment loads it, in another host layout, and so does a deployment of another TP size (as
    vLLM's MLA namespace); an MHA deployment of the same model finds nothing."""
    cfg = write_yaml(tmp_path, disk(tmp_path / "blocks"))
    toks = tokens(6, 7)
    assert store(cfg, toks, 7, layout=layout, mla=True, tp_rank=0, tp_size=2) == 6 * P
    other = h.MLA_LAYOUTS[(h.MLA_LAYOUTS.index(layout) + 1) % 3]
    pf, got = load(cfg, toks, layout=other, mla=True, tp_rank=1, tp_size=2)
    assert pf.loaded_tokens == 6 * P and same(got, pages_for(toks, 7, mla=True))
    pf, got = load(cfg, toks, layout=layout, mla=True, tp_rank=3, tp_size=4)
    assert pf.loaded_tokens == 6 * P and same(got, pages_for(toks, 7, mla=True))
    assert load(cfg, toks, layout=layout)[0].hit_tokens == 0


def test_fp8_cache_raw_bytes(tmp_path):
    """SGLang holds an fp8 KV cache as raw bytes (uint8 pools) and does not tell a storage backend which fp8:
    the YAML's model.kv_dtype names it (required), every byte pattern round-trips, and e4m3 / e5m2 caches
    never share pages."""
    e4 = write_yaml(tmp_path, disk(tmp_path / "blocks"), "e4.yaml", model={"kv_dtype": "float8_e4m3fn"})
    e5 = write_yaml(tmp_path, disk(tmp_path / "blocks"), "e5.yaml", model={"kv_dtype": "float8_e5m2"})
    toks = tokens(5, 23)
    e = h.make_engine(e4, dtype=torch.float8_e4m3fn, layout="page_head")
    try:
        assert e.kvtier.store.namespace.kv_dtype == "float8_e4m3fn"
        pages = h.random_pages(e, 5, 23)
        assert h.backup(e, toks, pages)[0] == 5 * P
    finally:
        e.close()
    pf, got = load(e4, toks, dtype=torch.float8_e4m3fn, layout="layer_first")
    assert pf.loaded_tokens == 5 * P and same(got, pages)
    assert load(e5, toks, dtype=torch.float8_e5m2)[0].hit_tokens == 0
    with pytest.raises(ValueError, match="model.kv_dtype: SGLang holds this KV cache as raw bytes"):
        h.make_engine(write_yaml(tmp_path, disk(tmp_path / "blocks")), dtype=torch.float8_e4m3fn)


def test_batches_longer_than_sglang_storage_batch(tmp_path):
    """150 pages: SGLang splits every call at 128 pages; the chain is found and loaded across the cut."""
    cfg = write_yaml(tmp_path, disk(tmp_path / "blocks"))
    toks = tokens(150, 3)
    assert store(cfg, toks, 3, tokens=2048) == 150 * P
    pf, got = load(cfg, toks, layout="page_head", tokens=2048)
    assert (pf.hit_tokens, pf.loaded_tokens) == (150 * P, 150 * P) and same(got, pages_for(toks, 3))
    pf, _ = load(cfg, toks[:40 * P] + tokens(20, 4), tokens=2048)
    assert pf.hit_tokens == 40 * P  # a shared prefix of 40 pages, then another chain


# ---------------------------------------------------------------------- integrity


def test_damaged_page_is_a_miss_never_served(tmp_path, figures):
    """A flipped payload byte in page 4, a truncated page 6, page 8 replaced by another page's (valid)
    value: the load stops before page 4; pages 0-3 arrive intact; the damaged values are deleted."""
    root = tmp_path / "blocks"
    cfg = write_yaml(tmp_path, disk(root))
    toks = tokens(10, 5)
    assert store(cfg, toks, 5) == 10 * P
    files = block_files(root)
    keys = h.page_keys(toks, P)
    raw = bytearray(files[keys[4]].read_bytes())
    raw[-7] ^= 0x40
    files[keys[4]].write_bytes(bytes(raw))
    files[keys[6]].write_bytes(files[keys[6]].read_bytes()[:-10])
    files[keys[8]].write_bytes(files[keys[9]].read_bytes())
    e = h.make_engine(cfg, layout="page_first")
    try:
        pf = h.prefetch(e, toks)
        assert pf.hit_tokens == 10 * P  # existence is a hint; bytes are verified when read
        assert pf.loaded_tokens == 4 * P
        assert pf.slots is not None
        assert same(h.read_pages(e, pf.slots[:4 * P]), pages_for(toks, 5)[:4])
        st: PageStore = e.kvtier.store
        assert st.backends_list[0].stats().corrupt >= 1
        # Read every page directly: exactly the three damaged ones fail, and they are gone afterwards.
        rows = torch.empty((10, st.codec.page_nbytes), dtype=torch.uint8)
        ok = st.get_rows(keys, rows)
        assert [i for i, g in enumerate(ok) if not g] == [4, 6, 8]
        assert st.backends_list[0].stats().corrupt == 3
        assert keys[4] not in block_files(root) and keys[6] not in block_files(root)
        assert h.prefetch(e, toks).hit_tokens == 4 * P  # the store now knows where the chain breaks
    finally:
        e.close()
    figures("sglang damaged pages served", 0)


# ---------------------------------------------------------------------- faults never reach SGLang


def test_redis_down_is_a_miss_not_an_error(tmp_path, redis_server, caplog):
    """Redis stopped: the hit query finds nothing, a load planned on an earlier hit loads nothing, a backup
    stores nothing; SGLang's threads see misses (no exception in its logs) and keep serving."""
    cfg = write_yaml(tmp_path, redis(redis_server.url, timeout_s=1.0))
    toks = tokens(6, 9)
    e = h.make_engine(cfg)
    try:
        assert h.backup(e, toks, pages_for(toks, 9))[0] == 6 * P
        op = e.ctrl.prefetch("before-outage", toks)
        assert h._wait(e.ctrl.prefetch_hit_queue, "hit").storage_hit_count == 6 * P
        redis_server.stop()
        with caplog.at_level("WARNING"):
            # The transfer of the hit found before the outage: nothing arrives, nothing raises.
            op.host_indices = e.ctrl.alloc_prefetch_host_buffers(op, 6 * P)
            e.ctrl.prefetch_buffer.put(op)
            while not (ack := h._wait(e.ctrl.ack_prefetch_queue, "ack")).completed_req:
                assert not ack.completed_tokens
            assert h.prefetch(e, toks).hit_tokens == 0
            assert h.backup(e, tokens(3, 10), pages_for(tokens(3, 10), 10))[0] == 0
        assert not [r for r in caplog.records if r.name.startswith("sglang") and r.exc_info]
        assert any("kvtier" in r.name for r in caplog.records)
        fails = e.kvtier.kvtier_stats()["metrics"]["tiers"]["redis"]["failures"]
        assert fails >= 3
        redis_server.start()
        assert h.backup(e, tokens(3, 10), pages_for(tokens(3, 10), 10))[0] == 3 * P  # back when Redis is
    finally:
        e.close()


def test_sglang_fault_injection(tmp_path, monkeypatch):
    """SGLang's own fault injector around kvtier (half of all calls fail, random delays): whatever SGLang
    loads is exactly the stored bytes, and nothing raises."""
    cfg = write_yaml(tmp_path, disk(tmp_path / "blocks"))
    toks = tokens(12, 11)
    assert store(cfg, toks, 11) == 12 * P
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_FAILURE", "0.5")
    monkeypatch.setenv("SGLANG_TEST_HICACHE_BACKEND_RANDOM_DELAY", "0.005")
    e = h.make_engine(cfg, layout="page_head")
    try:
        assert type(e.storage).__name__ == "HiCacheStorageFailureInjector"
        assert isinstance(e.kvtier, KvtierStorage)
        loaded: set[int] = set()
        # About a third of the prefetches load something at these odds (19 of 60 measured), so 12 tries
        # find none about once in a hundred runs: tries go on, up to 60, until one has.
        for attempt in range(60):
            if attempt >= 12 and loaded:
                break
            pf = h.prefetch(e, toks)
            assert pf.loaded_tokens % P == 0 and pf.loaded_tokens <= pf.hit_tokens
            if pf.loaded_tokens:
                n = pf.loaded_tokens // P
                assert pf.slots is not None
                assert same(h.read_pages(e, pf.slots[:n * P]), pages_for(toks, 11)[:n])
                loaded.add(n)
            if pf.slots is not None:
                e.host.free(pf.slots)
        assert loaded, "some loads must get through at 50% failures"
    finally:
        e.close()


# ---------------------------------------------------------------------- namespaces


def test_namespace_isolation(tmp_path):
    """SGLang's page keys name only tokens; kvtier's namespace keeps apart what must not mix: another model,
    another TP rank or TP size, another KV dtype, MLA vs MHA.  The same deployment finds everything."""
    cfg = write_yaml(tmp_path, disk(tmp_path / "blocks"))
    toks = tokens(4, 13)
    assert store(cfg, toks, 13, model="llama-a", tp_rank=0, tp_size=2) == 4 * P
    assert load(cfg, toks, model="llama-a", tp_rank=0, tp_size=2)[0].loaded_tokens == 4 * P
    for kw in ({"model": "llama-b", "tp_rank": 0, "tp_size": 2}, {"model": "llama-a", "tp_rank": 1, "tp_size": 2},
               {"model": "llama-a"}, {"model": "llama-a", "tp_rank": 0, "tp_size": 2, "dtype": torch.float16},
               {"model": "llama-a", "tp_rank": 0, "tp_size": 2, "mla": True}):
        assert load(cfg, toks, **kw)[0].hit_tokens == 0, kw


def test_model_id_from_yaml_wins_over_sglang_name(tmp_path):
    """Two hosts loading the model from different paths share pages through ``model.id``."""
    cfg = write_yaml(tmp_path, disk(tmp_path / "blocks"), model={"id": "shared-llama"})
    toks = tokens(3, 14)
    assert store(cfg, toks, 14, model="/models/a/llama") == 3 * P
    assert load(cfg, toks, model="/mnt/b/llama")[0].loaded_tokens == 3 * P


# ---------------------------------------------------------------------- configuration


def test_config_mistakes_fail_startup_naming_the_key(tmp_path):
    """A wrong YAML stops SGLang's start-up (its factory re-raises as ValueError) with kvtier's one line."""
    bad = write_yaml(tmp_path, disk(tmp_path / "b"), "algo.yaml", keys={"algo": "sha256_cbor"})
    with pytest.raises(ValueError, match="keys.algo: the YAML says 'sha256_cbor' but SGLang names its pages"):
        h.make_engine(bad)
    bad = write_yaml(tmp_path, disk(tmp_path / "b"), "layers.yaml", model={"num_layers": 32})
    with pytest.raises(ValueError, match="model.num_layers: the YAML says 32 but SGLang runs 3"):
        h.make_engine(bad)
    with pytest.raises(ValueError, match="backends\\[0\\].type: unknown backend 'nfs'"):
        h.make_engine(write_yaml(tmp_path, {"type": "nfs"}, "nfs.yaml"))
    # A misspelt key of ours ran on the embedded default config; SGLang's own keys pass through.
    with pytest.raises(ValueError, match="extra-config: unknown key\\(s\\) \\['kvtier_confg'\\]; kvtier reads "
                                         "kvtier_config"):
        h.make_engine(None, extra={"kvtier_confg": str(tmp_path / "x.yaml")})


def test_read_only_backend_stores_nothing_and_loads(tmp_path):
    """``write: false`` (a decode-only instance): SGLang's backups are accepted and not stored."""
    root = tmp_path / "blocks"
    cfg = write_yaml(tmp_path, disk(root))
    ro = write_yaml(tmp_path, {**disk(root), "write": False}, "ro.yaml")
    toks = tokens(3, 15)
    assert store(cfg, toks, 15) == 3 * P
    n = len(block_files(root))
    assert store(ro, tokens(3, 16), 16) == 3 * P
    assert len(block_files(root)) == n
    assert load(ro, toks)[0].loaded_tokens == 3 * P


@pytest.mark.parametrize("path", sorted(CONFIGS.glob("sglang-*.yaml")), ids=lambda p: p.name)
def test_example_configs(path):
    facts = {"id": "meta-llama/Llama-3.1-8B-Instruct", "kv_dtype": "bfloat16", "num_layers": 32,
             "num_kv_heads": 8, "head_dim": 128, "block_size": 64, "attention": "mha"}
    cfg = load_engine_config(path, facts, engine="SGLang", env={})
    assert cfg.backends and cfg.namespace().id
    assert path.read_text().lstrip().startswith("#")


def test_metrics_count_pages_and_bytes(tmp_path):
    cfg = write_yaml(tmp_path, disk(tmp_path / "blocks"))
    toks = tokens(5, 17)
    e = h.make_engine(cfg)
    try:
        h.backup(e, toks, pages_for(toks, 17))
        h.prefetch(e, toks)
        st = e.kvtier.kvtier_stats()
        disk_m = st["metrics"]["tiers"]["disk"]
        page = e.kvtier.store.codec.page_nbytes
        assert (disk_m["hits"], disk_m["bytes_in"], disk_m["bytes_out"]) == (5, 5 * page, 5 * page)
        assert st["backends"]["disk"]["puts"] == 5
    finally:
        e.close()
