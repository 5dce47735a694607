"""``kvtier pd prefill|decode``: one side of a prefill/decode pair sharing persisted prefixes.

The prefill side computes the KV of every request's prompt and stores it (then flushes its writes); the
decode side, in another process and possibly on another host, gets only the token ids (plus multimodal
items and salt), computes the same keys, loads the longest stored prefix, computes the rest and generates
greedily.  Requests are JSONL: ``{"tokens": [...], "mm": [...], "cache_salt": "...", "max_new_tokens": 32}``.
"""

from __future__ import annotations

import argparse
import json
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from ..args import non_negative_int, out_file, positive_int, write_out
from ..cli import UserError


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("pd", help="prefill / decode instance sharing persisted prefixes", description=__doc__)
    p.add_argument("role", choices=["prefill", "decode"])
    p.add_argument("--config", required=True, metavar="FILE", help="deployment YAML (pd-prefill.yaml ...)")
    p.add_argument("--requests", required=True, metavar="FILE", help="JSONL requests")
    p.add_argument("--out", type=out_file, metavar="FILE", help="per-request results as JSON")
    p.add_argument("--logits", type=out_file, metavar="FILE", help="decode: save every step's logits (torch.save)")
    p.add_argument("--max-new-tokens", type=positive_int, default=None, help="default: per request, else 32 "
                   "(decode) / 1 (prefill)")
    p.add_argument("--no-cache", action="store_true", help="decode: recompute everything (the baseline)")
    p.add_argument("--seed", type=non_negative_int, default=0, help="model seed; both sides must agree (default 0)")
    p.set_defaults(func=run)


@dataclass
class PDRequest:
    """One line of a ``--requests`` file."""

    line: int
    tokens: Any
    mm: list[Any]
    cache_salt: str | None
    lora: Any
    max_new_tokens: int | None


def read_requests(path: str) -> list[PDRequest]:
    from ...workload import count_field  # here: every CLI start imports this module

    try:
        lines = Path(path).read_text().splitlines()
    except OSError as e:
        raise UserError(f"cannot read {path}: {e.strerror}") from None
    reqs = []
    for i, line in enumerate(lines, 1):
        if not line.strip():
            continue
        try:
            r = json.loads(line)
        except json.JSONDecodeError as e:
            raise UserError(f"{path}, line {i}: invalid JSON: {e.msg}") from None
        if not isinstance(r, dict) or "tokens" not in r:
            raise UserError(f"{path}, line {i}: expected an object with 'tokens'")
        unknown = set(r) - {"tokens", "mm", "cache_salt", "lora", "max_new_tokens"}
        if unknown:
            raise UserError(f"{path}, line {i}: unknown field(s) {sorted(unknown)}")
        try:  # the trace reader's check: the same rule and message
            mnt = count_field(r, "max_new_tokens", f"{path}, line {i}", low=1, default=None)
        except ValueError as e:
            raise UserError(str(e)) from None
        reqs.append(PDRequest(i, r["tokens"], r.get("mm") or [], r.get("cache_salt"), r.get("lora"), mnt))
    return reqs


def run(args: argparse.Namespace) -> int:
    import torch

    from ...integrations.engine import CachedEngine

    reqs = read_requests(args.requests)
    engine = CachedEngine.from_config(args.config, seed=args.seed)
    prefill = args.role == "prefill"
    out: list[dict[str, Any]] = []
    logits: list[Any] = []
    t0 = time.perf_counter()
    try:
        for i, r in enumerate(reqs):
            mnt = args.max_new_tokens or r.max_new_tokens or (1 if prefill else 32)
            try:
                res = engine.run_request(r.tokens, mm=r.mm, cache_salt=r.cache_salt,
                                         lora=r.lora, max_new_tokens=mnt, store=prefill,
                                         keep_logits=not prefill, use_cache=not args.no_cache)
            except ValueError as e:
                raise UserError(f"{args.requests}, line {r.line}: {e}") from None
            out.append({"request": i, "prompt_tokens": res.num_prompt_tokens,
                        "prompt_blocks": res.num_prompt_blocks, "device_blocks": res.device_blocks,
                        "loaded_blocks": res.loaded_blocks, "cached_blocks": res.cached_blocks,
                        "failed_blocks": res.failed_blocks, "computed_tokens": res.computed_tokens,
                        "stored_blocks": res.stored_blocks, "tokens": res.tokens,
                        "load_ms": res.load_s * 1e3, "compute_ms": res.compute_s * 1e3})
            if res.step_logits is not None:
                logits.append(torch.stack(res.step_logits))
        if prefill:
            engine.flush()
    finally:
        engine.close()
    wall = time.perf_counter() - t0
    hits = sum(o["cached_blocks"] for o in out)
    blocks = sum(o["prompt_blocks"] for o in out)
    print(f"{args.role}: {len(out)} requests in {wall:.2f} s; prefix blocks reused {hits} of {blocks}; "
          f"stored {sum(o['stored_blocks'] for o in out)}")
    if args.out:
        write_out("--out", args.out, lambda p: p.write_text(json.dumps(out, indent=1)))
    if args.logits:
        write_out("--logits", args.logits, lambda p: torch.save(logits, p))
    return 0
