"""``kvtier keys``: block hashes of a request, one hex line per full block.

Reads ``{"tokens": [...], "block_size": 16, "algo": "sha256_cbor", "seed": null, "mm": [...],
"lora": {"name": ..., "path": ...}, "cache_salt": ...}`` from a file or stdin.  Used to debug cache misses
between instances and to feed external routers, so the output is exactly the engine-side hashes (no
namespace prefix)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ...keys import BlockHasher
from ..cli import UserError

_FIELDS = {"tokens", "block_size", "algo", "seed", "mm", "lora", "cache_salt"}


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("keys", help="print the block hashes of a JSON request (file or stdin)",
                       description=__doc__)
    p.add_argument("file", nargs="?", default="-", help="JSON request file ('-' or omitted: stdin)")
    p.set_defaults(func=run)


def request_hashes(req: object) -> list[bytes]:
    """Hashes for a parsed request object; ValueError naming the bad field otherwise."""
    if not isinstance(req, dict):
        raise UserError(f"expected a JSON object with fields {sorted(_FIELDS)}, got {type(req).__name__}")
    unknown = set(req) - _FIELDS
    if unknown:
        raise UserError(f"unknown field(s) {sorted(unknown)}; allowed: {', '.join(sorted(_FIELDS))}")
    if "tokens" not in req:
        raise UserError("missing field 'tokens'")
    hasher = BlockHasher(req.get("block_size", 16), req.get("algo") or "sha256_cbor", req.get("seed"))
    return hasher.hash_blocks(req["tokens"], mm=req.get("mm") or (), lora=req.get("lora"),
                              cache_salt=req.get("cache_salt"))


def run(args: argparse.Namespace) -> int:
    try:
        text = sys.stdin.read() if args.file == "-" else Path(args.file).read_text()
    except OSError as e:
        raise UserError(f"cannot read {args.file}: {e.strerror}") from None
    try:
        req = json.loads(text)
    except json.JSONDecodeError as e:
        raise UserError(f"{args.file}: invalid JSON at line {e.lineno} column {e.colno}: {e.msg}") from None
    sys.stdout.write("".join(h.hex() + "\n" for h in request_hashes(req)))
    return 0
