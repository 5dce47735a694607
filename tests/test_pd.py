"""Prefill and decode as two processes sharing persisted prefixes, on a real transformers model.

A prefill process stores the KV of every prompt; a separate decode process gets only token ids (plus
multimodal items and salt), computes the keys, loads the longest stored prefix, computes the rest and
generates 32 greedy tokens.  Its logits must equal a no-cache baseline's.

Tolerance: the decode side computes the suffix of the prompt against loaded KV, the baseline computes the
whole prompt in one pass.  The KV bytes are identical (checked by the block checksums), but float32 matmuls
over a different number of query rows may sum in a different order, so logits may differ in the last bits:
we allow |diff| <= 1e-4 (observed: below 1e-6 on logits of magnitude ~1-10) and require identical tokens.
"""

from __future__ import annotations

import json
import os
import time
from pathlib import Path
from typing import Any

import pytest
import torch
import yaml
from _forkserver import forkserver

from kvtier.format import blockformat
from kvtier.testing.redis_server import redis_available, start_redis

ROOT = Path(__file__).resolve().parents[1]
B = 16
ATOL = 1e-4


def make_requests(tmp_path: Path) -> Path:
    g = torch.Generator().manual_seed(3)
    shared = torch.randint(0, 2048, (64,), generator=g).tolist()  # a shared 4-block system prompt
    reqs = [
        {"tokens": shared + torch.randint(0, 2048, (53,), generator=g).tolist()},
        {"tokens": shared + torch.randint(0, 2048, (80,), generator=g).tolist()},  # len % B == 0
        {"tokens": torch.randint(0, 2048, (97,), generator=g).tolist(),
         "mm": [{"identifier": "sha256:img-1", "offset": 10, "length": 40}], "cache_salt": "tenant-a"},
    ]
    path = tmp_path / "requests.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in reqs))
    return path


def write_config(tmp_path: Path, role: str, backend: dict[str, Any],
                 security: dict[str, Any] | None = None) -> Path:
    cfg = yaml.safe_load((ROOT / "configs" / f"pd-{role}.yaml").read_text())
    if security is not None:
        cfg["security"] = security
    be = dict(backend)
    if role == "decode":
        be["write"] = False
    cfg["backends"] = [be]
    path = tmp_path / f"pd-{role}.yaml"
    path.write_text(yaml.safe_dump(cfg))
    return path


def kvtier(tmp_path: Path, *args: str) -> None:
    """``python -m kvtier ARGS`` as a process of its own.  On a CPU machine it is forked from the test fork
    server (tests/vllm/forkserver.py), which imported torch and transformers once: each of this module's
    seven runs is still its own process (its own engine, stack, backend connections), without the ~15 CPU
    seconds of importing them again.  ``PYTHONHASHSEED`` 0 as the vLLM tests' runs, so the one server serves
    them all (kvtier's keys do not depend on it: tests/test_keys.py).  With CUDA, a fresh interpreter (a
    fork would share the parent's CUDA state)."""
    log = tmp_path / f"kvtier-{args[0]}-{args[1]}-{time.monotonic_ns()}.log"
    with open(log, "w") as f:
        proc = forkserver.popen(["-m", "kvtier", *args], {**os.environ, "PYTHONHASHSEED": "0"}, f,
                                fresh=torch.cuda.is_available())
        try:
            rc = proc.wait(timeout=300)
        finally:
            if proc.poll() is None:
                proc.kill()
    assert rc == 0, log.read_text()[-6000:]


@pytest.fixture(scope="module")
def baseline(tmp_path_factory) -> tuple[list[dict[str, Any]], list[torch.Tensor]]:
    """The no-cache decode of the requests (``--no-cache``: every token computed, nothing loaded from any
    backend), run once for the module: the same requests, model and seed in every pair below."""
    tmp: Path = tmp_path_factory.mktemp("pd-baseline")
    reqs_path = make_requests(tmp)
    dec = write_config(tmp, "decode", {"name": "shared", "type": "local_disk",
                                       "options": {"path": str(tmp / "kv"), "capacity": "1GiB"}})
    kvtier(tmp, "pd", "decode", "--config", str(dec), "--requests", str(reqs_path), "--no-cache",
           "--out", str(tmp / "base.json"), "--logits", str(tmp / "base.pt"))
    return json.loads((tmp / "base.json").read_text()), torch.load(tmp / "base.pt")


def run_pair(tmp_path: Path, backend: dict[str, Any],
             baseline: tuple[list[dict[str, Any]], list[torch.Tensor]],
             security: dict[str, Any] | None = None) -> None:
    reqs_path = make_requests(tmp_path)
    reqs = [json.loads(x) for x in reqs_path.read_text().splitlines()]
    pre = write_config(tmp_path, "prefill", backend, security)
    dec = write_config(tmp_path, "decode", backend, security)
    kvtier(tmp_path, "pd", "prefill", "--config", str(pre), "--requests", str(reqs_path))
    kvtier(tmp_path, "pd", "decode", "--config", str(dec), "--requests", str(reqs_path),
           "--out", str(tmp_path / "decode.json"), "--logits", str(tmp_path / "decode.pt"))
    got = json.loads((tmp_path / "decode.json").read_text())
    got_logits = torch.load(tmp_path / "decode.pt")
    base, base_logits = baseline
    assert len(got) == len(base) == len(reqs)
    for req, g, b, gl, bl in zip(reqs, got, base, got_logits, base_logits):
        reusable = (len(req["tokens"]) - 1) // B
        # Every full prompt block (but a last one holding the final token, which is always computed) hit.
        assert g["cached_blocks"] == reusable, g
        assert g["failed_blocks"] == 0
        assert g["computed_tokens"] == len(req["tokens"]) - reusable * B
        assert b["cached_blocks"] == 0
        assert len(g["tokens"]) == 32 and g["tokens"] == b["tokens"]
        assert gl.shape == bl.shape == (32, 2048)
        assert torch.allclose(gl, bl, atol=ATOL, rtol=0), (gl - bl).abs().max()


def test_pd_over_shared_disk(tmp_path, baseline):
    run_pair(tmp_path, {"name": "shared", "type": "local_disk",
                        "options": {"path": str(tmp_path / "kv"), "capacity": "1GiB"}}, baseline)
    assert any((tmp_path / "kv").rglob("*")), "prefill wrote nothing to the shared directory"


@pytest.mark.skipif(redis_available() is not None, reason=str(redis_available()))
def test_pd_over_redis(tmp_path, baseline, monkeypatch):
    """The pair over Redis in security mode encrypt (the disk and S3 pairs cover mode none): the same
    tokens as the no-cache baseline, the key given to both processes in an environment variable."""
    monkeypatch.setenv("PD_DEPLOYMENT_KEY", os.urandom(32).hex())
    srv = start_redis()
    try:
        run_pair(tmp_path, {"name": "shared", "type": "redis", "options": {"url": srv.url},
                            "security": "encrypt"}, baseline,
                 security={"keys": [{"id": 1, "env": "PD_DEPLOYMENT_KEY"}]})
        keys = srv.cli("KEYS", "kvtier:*").split()
        value = srv.client().get(next(k for k in keys if not k.endswith("manifest.json")))
        assert blockformat.stored_version(value) == blockformat.FORMAT_VERSION_SEALED  # sealed, and
        assert value[65] == blockformat.MODE_ENCRYPT  # its mode byte (offset 65): encrypt
    finally:
        srv.stop()


def test_pd_over_s3(tmp_path, baseline):
    # Imported here: moto is a test extra the shared-disk pair does not need (it also runs on a GPU
    # machine that has only torch, where it checks the same pair with the KV on CUDA).
    from kvtier.testing.moto_server import dummy_credentials, start_moto

    with dummy_credentials(), start_moto() as moto:
        bucket = moto.new_bucket()
        run_pair(tmp_path, {"name": "shared", "type": "s3",
                            "options": {"bucket": bucket, "endpoint_url": moto.endpoint_url,
                                        "region": "us-east-1"}}, baseline)
