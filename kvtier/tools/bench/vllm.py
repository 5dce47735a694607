"""``kvtier bench vllm``: time to first token inside a real vLLM, per source of a 4k-token prompt's KV.

A model whose KV is shaped like Llama-3-8B's (32 layers, 8 KV heads, head dim 128; small hidden size,
random weights built locally) is served by vLLM.  Rows, all on the same prompts in one run:

* ``recompute``: a fresh prompt, computed (the prefill instance's own TTFT);
* ``vllm-device-cache``: the same prompt again in that process, a hit in vLLM's own prefix cache (the floor;
  kvtier is still writing that process's earlier prompts to the backend meanwhile, which slows it);
* ``vllm-device-cache-quiet``: the same hit in the decode process after its kvtier rows, where kvtier writes
  nothing (the floor without background work: ``x_quiet_floor``);
* ``kvtier:<backend>``: a separate decode process (``kv_consumer``) whose memory is empty loads the prefix
  from that backend; ``kvtier:host``: the same process after ``reset_prefix_cache()``, so the hit comes
  from kvtier's host tier in the worker (not for the engine rows, whose loads read straight into vLLM's
  KV and leave host memory out);
* ``example-connector``: vLLM's own ExampleConnector (safetensors on local disk) in the same roles.

kvtier's rows run once per ``--payloads`` value (YAML ``storage.payload``), each on prompts of its own:
``canonical`` rows as named above, ``engine`` rows marked ``[engine payload]`` (vLLM CPU's blocks stored as
its kernel keeps them: plain copies, readable only by the same layout; and ``host.promote_loads: false``,
so local_disk and Redis read them straight into vLLM's KV tensors).

Ratios are TTFT / floor (lower is better).  Medians over ``--repeats`` prompts.

Beside each local_disk and Redis load row, the raw ceiling of reading the same stored values, timed in the
decode process just before the load (local_disk: open / readv, files in the same page-cache state; Redis:
the raw wire loops of ``bench backends``): no load ends before its bytes are read, so a raw read already
over a goal's multiple of the floor says the goal is out of reach on that machine, whatever the loader.

Then decode stalls: a request decodes while two other 4k-token prompts arrive.  In the prefill process
they are computed (``recompute``); in each decode process their KV is loaded by kvtier from the backend
(asynchronously: the request waits in vLLM while the decoder keeps stepping).  The table gives the
decoder's inter-token latency p50 / p99 / max before and while the arrivals are served.
"""

from __future__ import annotations

import argparse
import json
import os
import random
import re
import statistics
import subprocess
import sys
import tempfile
from contextlib import ExitStack
from pathlib import Path
from typing import Any

from ..args import out_file, positive_int
from ..output import print_table, write_json
from . import vllm_hybrid
from .prefix import backend_section

HELP = "TTFT inside a real vLLM: recompute, vLLM's own cache, kvtier host / disk / Redis / S3, ExampleConnector"


def add_arguments(p: argparse.ArgumentParser) -> None:
    p.add_argument("--model", choices=["llama", "swa", "hybrid"], default="llama",
                   help="llama (default): this bench; swa / hybrid: hybrid models with vLLM's hybrid KV cache "
                        "manager on and off (kvtier.tools.bench.vllm_hybrid; the llama-only options below are ignored)")
    p.add_argument("--tokens", type=positive_int, default=None, help="default 4096 (llama), 2048 (swa, hybrid)")
    p.add_argument("--repeats", type=positive_int, default=3, help="distinct prompts per row (median)")
    p.add_argument("--backends", default=None, help="default disk,redis,s3 (llama), disk,redis (swa, hybrid)")
    p.add_argument("--layers", type=positive_int, default=None, help="default 32 (llama), 8 (swa, hybrid)")
    p.add_argument("--no-example", action="store_true", help="skip vLLM's ExampleConnector rows")
    p.add_argument("--block-tokens", type=positive_int, default=None,
                   help="storage.block_tokens for kvtier's backends (tokens per stored value; default: one "
                        "vLLM block)")
    p.add_argument("--load-mode", choices=["async", "sync", "auto"], default="auto",
                   help="the connector's kv_connector_extra_config.load_mode (default auto, as vLLM runs "
                        "it when the flag does not say)")
    p.add_argument("--payloads", default="canonical,engine",
                   help="storage.payload values to run kvtier's rows with (comma-separated): canonical "
                        "(token-major, any engine reads it) and engine (vLLM CPU's own arrangement)")
    p.add_argument("--reserved-cpus", type=int, default=2, metavar="N",
                   help="VLLM_CPU_NUM_OF_RESERVED_CPU in every vLLM process of the run (default %(default)s: what "
                        "vLLM reserves by itself at TP 1 when a KV connector is configured), so every row runs "
                        "the model on the same cores")
    p.add_argument("--json", type=out_file, metavar="PATH")
    vllm_hybrid.add_model_options(p)


def _model(d: Path, layers: int) -> str:
    import torch
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=1024, hidden_size=256, intermediate_size=512, num_hidden_layers=layers,
                      num_attention_heads=8, num_key_value_heads=8, head_dim=128, max_position_embeddings=16384)
    # transformers types PreTrainedModel.to through a decorator mypy reads as unbound (as in hf_llama)
    LlamaForCausalLM(cfg).to(dtype=torch.bfloat16).save_pretrained(d)  # type: ignore[call-arg]
    return str(d)


#: per vLLM process of the run, the cores its model's OpenMP threads were bound to (vLLM CPU logs its binding),
#: for the fairness line
RAN_ON: dict[str, str] = {}
_BOUND = re.compile(r"local_rank=0, core ids=\[([^\]]*)\]")


def _run(tmp: Path, tag: str, model: str, prompts: list[list[int]], steps: list[list[Any]],
         kv_transfer: dict[str, Any] | None, reserved_cpus: int | None = None) -> list[dict[str, Any]]:
    spec = {"model": model, "prompts": prompts, "steps": steps, "kv_transfer": kv_transfer,
            "out": str(tmp / f"{tag}.json"), "kv_space_gib": 2, "reserved_cpus": reserved_cpus}
    (tmp / f"{tag}.spec.json").write_text(json.dumps(spec))
    with open(tmp / f"{tag}.log", "w") as log:
        rc = subprocess.run([sys.executable, "-m", "kvtier.tools.bench._vllm_driver", str(tmp / f"{tag}.spec.json")],
                            stdout=log, stderr=subprocess.STDOUT, timeout=1800).returncode
    if rc != 0:
        raise RuntimeError(f"vLLM run {tag!r} failed ({rc}); see {tmp / (tag + '.log')}:\n"
                           + (tmp / f"{tag}.log").read_text()[-3000:])
    bound = _BOUND.findall((tmp / f"{tag}.log").read_text())
    RAN_ON[tag] = f"cores [{bound[-1]}]" if bound else "cores not logged"
    rows: list[dict[str, Any]] = json.loads((tmp / f"{tag}.json").read_text())
    return rows


def _kvtier(role: str, cfg_path: Path, load_mode: str) -> dict[str, Any]:
    return {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": role, "kv_connector_extra_config": {"kvtier_config": str(cfg_path), "load_mode": load_mode}}


def _stored_of(by_hash: dict[str, str], prompts: list[list[int]], block_size: int = 32) -> list[list[str]]:
    """Per prompt, the names (``by_hash``: block hash hex -> file or key) holding its stored blocks."""
    from ...keys import BlockHasher

    hasher = BlockHasher(block_size, "sha256_cbor", None)  # the bench configs' keys
    return [[by_hash[h.hex()] for h in hasher.hash_blocks(p) if h.hex() in by_hash] for p in prompts]


def _files_of(root: Path, prompts: list[list[int]]) -> list[list[str]]:
    """Per prompt, the local_disk files holding its stored blocks (a file is named by its block hash)."""
    return _stored_of({p.name: str(p) for p in root.rglob("*") if p.is_file()}, prompts)


def _redis_values_of(url: str, prompts: list[list[int]]) -> tuple[int, list[list[str]], int]:
    """Per prompt, the Redis keys holding its stored blocks (a key ends with its block hash), the server's
    port and a value's size in bytes (header + payload)."""
    from urllib.parse import urlsplit

    from ...backends._resp import Connection

    u = urlsplit(url)
    port = u.port or 6379
    conn = Connection((u.hostname or "127.0.0.1", port), timeout=30, connect_timeout=30)
    try:
        keys = _stored_of({k.decode().rsplit("/", 1)[-1]: k.decode() for k in conn.call("KEYS", "*")}, prompts)
        size = int(conn.call("STRLEN", keys[0][0])) if keys and keys[0] else 0
    finally:
        conn.close()
    return port, keys, size


def run(args: argparse.Namespace) -> int:
    import yaml

    if getattr(args, "model", "llama") != "llama":
        return vllm_hybrid.run(args)
    args.tokens = args.tokens or 4096
    args.layers = args.layers or 32
    args.backends = args.backends or "disk,redis,s3"
    rng = random.Random(0)
    n = args.repeats
    payloads = [x.strip() for x in args.payloads.split(",") if x.strip()]
    if not payloads or not set(payloads) <= {"canonical", "engine"}:
        print(f"kvtier bench vllm: --payloads: expected canonical and / or engine, got {args.payloads!r}",
              file=sys.stderr)
        return 2
    # Per payload, a set of 2n + 2 prompts (its stored values are then its own, whatever the namespace):
    # 0..n-1: every backend's rows; n..2n-1: local_disk's page-cache rows; 2n, 2n+1: the ITL arrivals.
    # tokens + 2: every connector can load the first ``tokens`` (vLLM computes at least the last one).  Not
    # tokens + 1: vLLM's ExampleConnector saves a prompt of L tokens under its first (L - 1) // B * B and
    # looks it up under its first (L - 2) // B * B, so where B divides L - 1 it never finds what it saved
    # (this bench's ExampleConnector rows were recomputes until it changed).
    per = 2 * n + 2
    prompts = [[rng.randrange(1, 1000) for _ in range(args.tokens + 2)] for _ in range(per * len(payloads))]
    rows: dict[str, list[float]] = {}
    reads: dict[str, list[float]] = {}  # disk row -> raw read of its prompts' files in the same state
    itl: list[dict[str, Any]] = []
    with ExitStack() as stack, tempfile.TemporaryDirectory() as d:
        tmp = Path(d)
        model = _model(tmp / "model", args.layers)
        backends = [backend_section(b.strip(), stack, str(tmp), capacity="64GiB", bucket_prefix="vllm")
                    for b in args.backends.split(",") if b.strip()]
        for be, (k, payload) in [(be, kp) for be in backends for kp in enumerate(payloads)]:
            o = k * per  # this payload's prompts
            label = be["name"] + ("" if payload == "canonical" else " [engine payload]")
            host_row = "kvtier:host" + ("" if payload == "canonical" else " [engine payload]")
            arrivals = [o + 2 * n, o + 2 * n + 1]  # stored by the prefill, first seen by the decoder in the ITL step
            cfg = tmp / f"{be['name']}-{payload}.yaml"
            # engine rows: the fast configuration on vLLM CPU (values as its kernel keeps them, read from
            # local_disk or Redis straight into its KV tensors)
            host_cfg = {"capacity": "2GiB", **({"promote_loads": False} if payload == "engine" else {})}
            cfg.write_text(yaml.safe_dump({"keys": {"algo": "sha256_cbor"}, "host": host_cfg,
                                           "backends": [be], "storage": {"block_tokens": args.block_tokens,
                                                                         "payload": payload}}))
            disk = be["type"] == "local_disk"
            mine = list(range(o, o + n))
            extra = list(range(o + n, o + 2 * n)) if disk else []
            # prefill: recompute, then vLLM's own cache (the floor); stores into the backend
            pre = _run(tmp, f"prefill-{be['name']}-{payload}", model, prompts,
                       [["ttft", i] for i in mine] + [["ttft", i] for i in mine]
                       + [["ttft", i] for i in extra] + [["itl", arrivals]],
                       _kvtier("kv_producer", cfg, args.load_mode), args.reserved_cpus)
            rows.setdefault("recompute", []).extend(r["ttft_s"] for r in pre[:n])
            rows.setdefault("vllm-device-cache", []).extend(r["ttft_s"] for r in pre[n:2 * n])
            if not itl:
                itl.append({"arrivals": "recompute", **pre[-1]})
            # In P/D the decode host is not the one that wrote the blocks: let the kernel finish writing the
            # prefill's files back first (else its writeback of GBs of dirty pages competes with the loads).
            os.sync()
            # decode: from the backend (empty memory), then from kvtier's host tier after a prefix-cache reset,
            # then the same prompts again: vLLM's own cache in a process where kvtier writes nothing.
            # local_disk, twice, each time in a stated page-cache state (on a VM whose kernel pages idle
            # files out within ~30 s the state is otherwise whatever the timing left): out of it (cold), and
            # in it; each load after the raw file ceiling over the same files in the same state.
            if disk:
                files = _files_of(Path(be["options"]["path"]), prompts[o:o + 2 * n])
                first = [s for i in mine for s in (["files", "cold", files[i - o]], ["ttft", i])]
                first += [s for i in extra for s in (["files", "page cache", files[i - o]], ["ttft", i])]
            elif be["type"] == "redis":
                port, values, size = _redis_values_of(be["options"]["url"], prompts[o:o + n])
                first = [s for i in mine for s in (["redis", port, values[i - o], size], ["ttft", i])]
            else:
                first = [["ttft", i] for i in mine]
            dec = _run(tmp, f"decode-{be['name']}-{payload}", model, prompts,
                       first + [["reset"]] + [["ttft", i] for i in mine] + [["ttft", i] for i in mine]
                       + [["itl", arrivals]], _kvtier("kv_consumer", cfg, args.load_mode), args.reserved_cpus)
            ttft = [r for r in dec if "ttft_s" in r]
            loads, host, again = ttft[:n + len(extra)], ttft[n + len(extra):2 * n + len(extra)], ttft[-n:]
            if disk:
                rows.setdefault(f"kvtier:{label} (cold)", []).extend(r["ttft_s"] for r in loads[:n])
                rows.setdefault(f"kvtier:{label} (page cache)", []).extend(r["ttft_s"] for r in loads[n:])
                for r in dec:
                    if "files" in r:
                        reads.setdefault(f"kvtier:{label} ({r['files']})", []).append(r["read_s"])
            else:
                rows.setdefault(f"kvtier:{label}", []).extend(r["ttft_s"] for r in loads)
                for r in dec:
                    if r.get("raw") == "redis":
                        reads.setdefault(f"kvtier:{label}", []).append(r["read_s"])
            if payload != "engine":  # those loads read straight into vLLM's KV, out of host memory: no host hit
                rows.setdefault(host_row, []).extend(r["ttft_s"] for r in host)
            rows.setdefault("vllm-device-cache-quiet", []).extend(r["ttft_s"] for r in again)
            itl.append({"arrivals": f"kvtier:{label}", **dec[-1]})
            if any(r["cached"] < args.tokens // 32 * 32 for r in loads + host):
                print(f"WARNING {label}: some loads were partial: {[r['cached'] for r in loads + host]}")
        if not args.no_example:
            # vLLM's ExampleConnector reads its own files (safetensors): in the page cache, as the
            # page-cache local_disk row.
            ex = {"kv_connector": "ExampleConnector",
                  "kv_connector_extra_config": {"shared_storage_path": str(tmp / "example")}}
            _run(tmp, "example-prefill", model, prompts, [["ttft", i] for i in range(n)], {**ex, "kv_role": "kv_both"},
                 args.reserved_cpus)
            os.sync()
            ex_files = [str(p) for p in (tmp / "example").rglob("*") if p.is_file()]
            steps = [s for i in range(n) for s in (["files", "page cache", ex_files], ["ttft", i])]
            dec = _run(tmp, "example-decode", model, prompts, steps, {**ex, "kv_role": "kv_both"}, args.reserved_cpus)
            got = [r for r in dec if "ttft_s" in r]
            rows["example-connector (page cache)"] = [r["ttft_s"] for r in got]
            if any(r["cached"] < args.tokens // 32 * 32 for r in got):
                print(f"WARNING example-connector: some loads were partial: {[r['cached'] for r in got]}")
    floor = statistics.median(rows["vllm-device-cache"])
    quiet = statistics.median(rows["vllm-device-cache-quiet"]) if "vllm-device-cache-quiet" in rows else floor
    example = rows.get("example-connector (page cache)")
    table = [{"source": k, "ttft_ms": statistics.median(v) * 1e3, "spread_ms": f"{min(v) * 1e3:.0f}-{max(v) * 1e3:.0f}",
              "x_floor": statistics.median(v) / floor, "x_quiet_floor": statistics.median(v) / quiet,
              **({"x_example": statistics.median(v) / statistics.median(example)} if example else {}),
              "runs": len(v)} for k, v in rows.items()]
    if args.block_tokens:
        print(f"kvtier stores values of {args.block_tokens} tokens (storage.block_tokens)")
    print(f"TTFT of a {args.tokens}-token prompt, {args.layers} layers x 8 kv heads x 128 head dim (bf16, "
          f"{args.tokens * args.layers * 2 * 8 * 128 * 2 / 2**20:.0f} MiB of KV), medians")
    print_table(table, ["source", "ttft_ms", "spread_ms", "x_floor", "x_quiet_floor",
                        *(["x_example"] if example else []), "runs"])
    threads = sorted(set(RAN_ON.values()))
    print(f"every vLLM process ran with VLLM_CPU_NUM_OF_RESERVED_CPU={args.reserved_cpus}; the model's threads "
          f"bound to: {', '.join(threads)}" + ("" if len(threads) == 1 else
                                             " (NOT the same in every process: " + ", ".join(
                                                 f"{k} {v}" for k, v in RAN_ON.items()) + ")"))
    read_rows = [{"source": row, "raw_read_ms": statistics.median(v) * 1e3,
                  "raw_read_x_floor": statistics.median(v) / floor, "raw_read_x_quiet_floor":
                  statistics.median(v) / quiet, "kvtier_ttft_ms": statistics.median(rows[row]) * 1e3,
                  # the ceiling a loader is held to: the quiet own-cache hit plus 1.3 x the raw read
                  "ceiling_ms": (quiet + 1.3 * statistics.median(v)) * 1e3,
                  "x_ceiling": statistics.median(rows[row]) / (quiet + 1.3 * statistics.median(v)),
                  "runs": len(v)} for row, v in reads.items()]
    if read_rows:
        print("\nraw ceilings, timed in the decode process just before each kvtier load, over the same prompt's "
              "stored values (the TTFT adds the checksums, the copy into vLLM's KV and the step): local_disk: "
              "open / readv with the backend's threads, as `bench backends`, files in the same state; Redis: the "
              "raw wire loops of `bench backends` (the faster one).  A load cannot end before its bytes are read: "
              "where raw_read_x_floor exceeds a goal, no loader meets it on this machine")
        print_table(read_rows, ["source", "raw_read_ms", "raw_read_x_floor", "raw_read_x_quiet_floor",
                                "kvtier_ttft_ms", "ceiling_ms", "x_ceiling", "runs"])
        print("ceiling_ms: vLLM's own cache in the decode process + 1.3 x the raw read; x_ceiling: the kvtier "
              "TTFT / that (at most 1 is the goal)")
    print("x_floor: / vLLM's own cache in the prefill process, while kvtier writes that process's earlier "
          "prompts down in the background; x_quiet_floor: / the same hit in a decode process, where kvtier "
          "writes nothing")
    print("\ndecode inter-token latency (ms) of a running request, alone vs while 2 prompts arrive")
    itl_rows = [{"arrivals": r["arrivals"], **{k.removesuffix("_s") + "_ms": r[k] * 1e3 for k in r
                                                  if k.endswith("_s")}, "tokens_during": r["decode_tokens_during"]}
                for r in itl]
    print_table(itl_rows, ["arrivals", "itl_base_p50_ms", "itl_base_p99_ms", "itl_during_p50_ms",
                           "itl_during_p99_ms", "itl_during_max_ms", "arrivals_served_ms", "tokens_during"])
    write_json(args.json, {"rows": table, "itl": itl_rows, "disk_reads": read_rows})
    return 0
