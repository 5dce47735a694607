"""``kvtier bench vllm --model swa|hybrid``: time to first token of a hybrid model inside a real vLLM, with
vLLM's hybrid KV cache manager (HMA) on and forced off, and the bytes kvtier stores per prompt token.

Two models with random weights built locally (:mod:`kvtier.testing.hybrid_models`): ``swa``, Gemma-3-shaped
(every fourth layer full attention, the others a 128-token sliding window; block size 32), and ``hybrid``,
Qwen3-Next-shaped (every fourth layer full attention, the others gated delta net; vLLM raises its block
size until an attention page holds a state page: 96 tokens at head dim 64, 64 at head dim 128).  With HMA
on (vLLM's default with kvtier's connector, which supports it) each KV cache group is its own stream of
stored values: a sliding window load restores only the window's blocks, a state group one state per hit.
With HMA off (``disable_hybrid_kv_cache_manager=True``) vLLM serves a sliding-window model as one
full-attention group (every layer keeps, and kvtier stores and loads, every block); a hybrid SSM model
needs HMA, so vLLM is expected to refuse to start: that row then reads ``refused: <the error's first
line>``.

Rows, per HMA setting, all on the same ``--repeats`` random prompts of ``--tokens`` (+2) tokens:

* ``recompute``: a fresh prompt, computed in the prefill process (``kv_producer``, which stores it to
  local_disk and Redis at once);
* ``vllm-device-cache``: the same prompt again in that process, a hit in vLLM's own prefix cache (the
  floor: ``x_floor`` is a row's TTFT over it, per HMA setting; kvtier may still be writing that process's
  earlier prompts meanwhile);
* ``kvtier:disk`` / ``kvtier:redis``: a separate decode process (``kv_consumer``) whose memory is empty
  loads the prefix from that backend alone (local_disk: the files the prefill just wrote, synced, in the
  page cache as the prefill left them).

Each process first serves a warm-up prompt of the same length, untimed (the prefill computes and stores
it, each decode loads it): a process's first long prefill or load pays one-time costs.  Every run
prefills in chunks of ``--chunk-tokens`` (``max_num_batched_tokens``; a multiple of every block size
here), so the GDN model's state exists at several block boundaries of each prompt.  vLLM's CPU step times
swing by up to 10x with anything else on the cores: the bench prints the load average before each process.

Second table: bytes kvtier wrote per prompt token: local_disk, the sizes of the files under its directory
after the prefill; Redis, the STRLEN of every key; each over the prompt tokens stored (``--repeats``
prompts and the warm-up, x their full blocks' tokens).  Headers included; every stream counted
(full-attention blocks, sliding-window blocks, states).  ``groups``: the streams stored (namespaces under
local_disk's directory: one per KV cache group; 1 with HMA off).
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

from ..output import print_table, write_json
from .prefix import backend_section

HELP = ("TTFT of hybrid models (sliding window; gated delta net) inside a real vLLM, its hybrid KV cache "
        "manager on and off, and bytes stored per token (the same as `bench vllm --model swa|hybrid`)")

#: --model -> the hybrid_models builder's key
MODELS = {"swa": "swa", "hybrid": "gdn"}


def _positive(text: str) -> int:
    """An argparse ``type``: an integer >= 1 (as ``commands._types.positive_int``)."""
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected an integer >= 1, got {text!r}")
    return value


def add_model_options(p: argparse.ArgumentParser) -> None:
    """The options only the hybrid models take (``bench vllm`` adds them beside its own)."""
    p.add_argument("--head-dim", type=_positive, default=128, help="swa / hybrid: attention head dim (default 128)")
    p.add_argument("--kv-heads", type=_positive, default=2, help="swa / hybrid: KV heads (default 2)")
    p.add_argument("--chunk-tokens", type=_positive, default=768,
                   help="swa / hybrid: max_num_batched_tokens, the prefill chunk (default 768: a multiple of every "
                        "block size vLLM picks here, 32 swa; 64 or 96 hybrid, by head dim)")
    p.add_argument("--kv-space-gib", type=_positive, default=2, help="swa / hybrid: VLLM_CPU_KVCACHE_SPACE (GiB)")
    p.add_argument("--work-dir", metavar="DIR",
                   help="swa / hybrid: keep the model, each vLLM process's spec and log and the stored values "
                        "there (default: a temporary directory, removed)")


def add_arguments(p: argparse.ArgumentParser) -> None:
    """``kvtier bench vllm_hybrid``: ``bench vllm --model swa|hybrid`` under a name of its own."""
    p.add_argument("--model", choices=sorted(MODELS), default="swa")
    p.add_argument("--tokens", type=_positive, default=2048)
    p.add_argument("--repeats", type=_positive, default=3, help="distinct prompts per row (median)")
    p.add_argument("--layers", type=_positive, default=8, help="every fourth one full attention (default 8)")
    p.add_argument("--backends", default="disk,redis")
    p.add_argument("--json", metavar="PATH")
    add_model_options(p)


class Refused(RuntimeError):
    """A vLLM process that failed; ``line`` is the first line of its error."""

    def __init__(self, line: str, log: Path) -> None:
        super().__init__(f"{line} (see {log})")
        self.line = line


def _error_line(log: str) -> str:
    """The first line of the error a failed vLLM process ended with: its last ``SomeError: ...`` line (less
    vLLM's ``[rank0]:`` prefix), else its last line."""
    tail = [re.sub(r"^\[rank\d+\]:\s*", "", ln.strip()) for ln in log.splitlines() if ln.strip()]
    errors = [ln for ln in tail if re.match(r"^([\w.]+\.)?\w*(Error|Exception)\b[^:]*:", ln)]
    return errors[-1] if errors else tail[-1] if tail else "(no output)"


def _run(tmp: Path, tag: str, spec: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
    """One vLLM process (``_vllm_driver``); its rows and its log.  Raises :class:`Refused` if it failed."""
    spec = {**spec, "out": str(tmp / f"{tag}.json")}
    (tmp / f"{tag}.spec.json").write_text(json.dumps(spec))
    log_path = tmp / f"{tag}.log"
    # vLLM CPU's step times swing with anything else on the cores: say how busy the machine was
    print(f"  {tmp.name}/{tag}: load average {os.getloadavg()[0]:.2f} before", flush=True)
    with open(log_path, "w") as log:
        rc = subprocess.run([sys.executable, "-m", "kvtier.tools.bench._vllm_driver", str(tmp / f"{tag}.spec.json")],
                            stdout=log, stderr=subprocess.STDOUT, timeout=1800).returncode
    text = log_path.read_text()
    if rc != 0:
        raise Refused(_error_line(text), log_path)
    rows: list[dict[str, Any]] = json.loads((tmp / f"{tag}.json").read_text())
    return rows, text


def _groups(log: str, disk: Path | None) -> int | str:
    """The streams kvtier stored: namespaces under local_disk's directory (one per KV cache group), else
    its start-up line for a hybrid model (at INFO: not in the log where something else set up logging)."""
    if disk is not None and disk.is_dir():
        return sum(1 for d in disk.iterdir() if d.is_dir())
    m = re.search(r"hybrid KV cache manager is on: (\d+) KV cache groups", log)
    return int(m.group(1)) if m else "?"


def _block_size(log: str, asked: int) -> int:
    """The block size vLLM ran with: a hybrid SSM model's is raised until an attention page holds a state page."""
    m = re.search(r"Setting attention block size to (\d+) tokens", log)
    return int(m.group(1)) if m else asked


def _kvtier(role: str, cfg: Path) -> dict[str, Any]:
    return {"kv_connector": "KvtierConnector", "kv_connector_module_path": "kvtier.integrations.vllm",
            "kv_role": role, "kv_connector_extra_config": {"kvtier_config": str(cfg)}}


def _config(path: Path, backends: list[dict[str, Any]]) -> Path:
    """A kvtier YAML over ``backends`` (written to ``path``)."""
    import yaml

    path.write_text(yaml.safe_dump({"keys": {"algo": "sha256_cbor"}, "host": {"capacity": "2GiB"},
                                    "backends": backends}))
    return path


def _disk_bytes(root: Path) -> int:
    return sum(p.stat().st_size for p in root.rglob("*") if p.is_file())


def _redis_bytes(url: str) -> int:
    """The sum of STRLEN over every key of the Redis server at ``url`` (one Lua call through redis-cli)."""
    lua = "local s = 0 for _, k in ipairs(redis.call('KEYS', '*')) do s = s + redis.call('STRLEN', k) end return s"
    out = subprocess.run(["redis-cli", "-u", url, "--raw", "EVAL", lua, "0"], capture_output=True, text=True,
                         timeout=60, check=True).stdout
    return int(out.strip())


def _build(model: str, d: Path, args: argparse.Namespace) -> str:
    from ...testing.hybrid_models import BUILDERS

    return BUILDERS[MODELS[model]](d, layers=args.layers or 8, head_dim=args.head_dim, kv_heads=args.kv_heads)


def run(args: argparse.Namespace) -> int:
    model_name: str = args.model
    tokens: int = args.tokens or 2048
    n: int = args.repeats
    backends = [b.strip() for b in (args.backends or "disk,redis").split(",") if b.strip()]
    if not backends or not set(backends) <= {"disk", "redis"}:
        print(f"kvtier bench vllm --model {model_name}: --backends: expected disk and / or redis, got "
              f"{args.backends!r}", file=sys.stderr)
        return 2
    rng = random.Random(0)
    # tokens + 2, as the Llama bench: the first `tokens` can be loaded (vLLM computes at least the last one).
    # Prompt n is every process's warm-up (untimed): its first long prefill (or load) pays one-time costs.
    prompts = [[rng.randrange(1, 500) for _ in range(tokens + 2)] for _ in range(n + 1)]  # vocab: 512
    warm = ["ttft", n]
    timed = [["ttft", i] for i in range(n)]
    rows: list[dict[str, Any]] = []
    sizes: list[dict[str, Any]] = []
    blocks: set[int] = set()
    with ExitStack() as stack:
        if args.work_dir:
            tmp = Path(args.work_dir)
            tmp.mkdir(parents=True, exist_ok=False)
        else:
            tmp = Path(stack.enter_context(tempfile.TemporaryDirectory()))
        model = _build(model_name, tmp / "model", args)
        base = {"model": model, "prompts": prompts, "kv_space_gib": args.kv_space_gib, "in_process": True,
                "block_size": 32, "max_model_len": tokens + 256, "max_num_batched_tokens": args.chunk_tokens}
        for hma in ("on", "off"):
            where = tmp / f"hma-{hma}"
            where.mkdir()
            spec = {**base, "disable_hybrid_kv_cache_manager": True if hma == "off" else None}
            secs = {b: backend_section(b, stack, str(where), capacity="16GiB") for b in backends}  # own servers
            key = {"model": model_name, "hma": hma}
            tag = f"{model_name}-hma-{hma}"
            print(f"[{tag}] prefill (kv_producer, {'+'.join(backends)})", flush=True)
            # prefill: the warm-up, every prompt (recompute), every prompt again (vLLM's own cache)
            cfg = _config(where / "all.yaml", [secs[b] for b in backends])
            try:
                pre, log = _run(where, "prefill", {**spec, "steps": [warm] + timed + timed,
                                                   "kv_transfer": _kvtier("kv_producer", cfg)})
            except Refused as e:
                print(f"[{tag}] refused: {e}", flush=True)
                rows.append({**key, "source": "(every row)", "ttft_ms": f"refused: {e.line}"})
                sizes.append({**key, "groups": "-", **{f"bytes_per_token_{b}": "refused" for b in backends}})
                continue
            bs = _block_size(log, 32)
            blocks.add(bs)
            ttft = [r for r in pre if "ttft_s" in r][1:]
            got: dict[str, list[dict[str, Any]]] = {"recompute": ttft[:n], "vllm-device-cache": ttft[n:]}
            os.sync()
            disk = Path(secs["disk"]["options"]["path"]) if "disk" in secs else None
            stored = (n + 1) * ((tokens + 2) // bs * bs)  # the warm-up prompt is stored too
            size: dict[str, Any] = {**key, "groups": _groups(log, disk), "block": bs, "tokens_stored": stored}
            if disk is not None:
                size["bytes_per_token_disk"] = _disk_bytes(disk) / stored
            if "redis" in secs:
                size["bytes_per_token_redis"] = _redis_bytes(secs["redis"]["options"]["url"]) / stored
            sizes.append(size)
            for b in backends:
                print(f"[{tag}] decode (kv_consumer, {b})", flush=True)
                cfg = _config(where / f"{b}.yaml", [secs[b]])
                try:
                    dec, _ = _run(where, f"decode-{b}", {**spec, "steps": [warm] + timed,
                                                        "kv_transfer": _kvtier("kv_consumer", cfg)})
                except Refused as e:
                    print(f"[{tag}] decode {b} failed: {e}", flush=True)
                    rows.append({**key, "source": f"kvtier:{b}", "ttft_ms": f"failed: {e.line}"})
                    continue
                got[f"kvtier:{b}"] = [r for r in dec if "ttft_s" in r][1:]
            floor = statistics.median(r["ttft_s"] for r in got["vllm-device-cache"])
            for source, rs in got.items():
                t = [r["ttft_s"] for r in rs]
                rows.append({**key, "source": source, "ttft_ms": statistics.median(t) * 1e3,
                             "x_floor": statistics.median(t) / floor,
                             "spread": f"{min(t) * 1e3:.0f}-{max(t) * 1e3:.0f}", "runs": len(t),
                             "cached_tokens": "/".join(str(r["cached"]) for r in rs)})
    layers = args.layers or 8
    print(f"\nTTFT of a {tokens}-token prompt, {model_name} model: {layers} layers "
          f"({layers // 4} full attention), {args.kv_heads} kv heads x {args.head_dim} head dim (bf16), "
          f"block {'/'.join(map(str, sorted(blocks))) or '?'}, prefill chunks of {args.chunk_tokens} tokens; "
          f"medians of {n}")
    print_table(rows, ["model", "hma", "source", "ttft_ms", "x_floor", "spread", "runs", "cached_tokens"])
    print("x_floor: / vllm-device-cache of the same hma setting; spread: min-max ms; cached_tokens: per run, "
          "the prompt tokens vLLM did not compute (its cache or kvtier's load)")
    print(f"\nbytes kvtier stored per prompt token ({n + 1} prompts, the warm-up's included, x their full blocks' "
          "tokens; headers included; groups: the streams stored)")
    print_table(sizes, ["model", "hma", "groups", "block"] + [f"bytes_per_token_{b}" for b in backends])
    write_json(args.json, {"rows": rows, "bytes": sizes})
    return 0
