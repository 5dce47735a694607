"""Shared by test_reliability_outages.py and test_reliability_stack.py (issue 6, stack-level items).

A P/D pair of real engines (the transformers-backed tiny Llama of ``kvtier.integrations.engine``: 2 layers,
2 KV heads, head_dim 16, block 16, float32 -> 8 KiB blocks): the prefill engine stores every prompt
block and flushes, the decode engine (``write: false``, no host tier, so every hit it gets is a real
backend read) computes the same keys from the tokens alone and loads what it finds.  Every decode is
compared with a no-cache baseline computed by a third engine with no tiers at all: equal logits
(|diff| <= 1e-4, as in test_pd.py) mean no wrong byte was served.

Every wait is bounded: ``bounded(fn, timeout)`` runs ``fn`` in a daemon thread and fails the test (after
dumping every thread's stack) if it has not returned in time, so a hang is a failure, never a stuck run.
"""

from __future__ import annotations

import faulthandler
import sys
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import pytest
import torch

from kvtier.config import parse_config
from kvtier.integrations.engine import CachedEngine, RequestResult

B = 16  # tokens per block
ATOL = 1e-4  # logits tolerance of a decode that loaded its prefix vs. the no-cache baseline (test_pd.py)
MODEL = {"id": "kvtier/tiny-llama", "kv_dtype": "float32", "num_layers": 2, "num_kv_heads": 2, "head_dim": 16,
         "block_size": B}
PROMPT_BLOCKS = 8  # full blocks per prompt; the last one holds the final token, so 7 are reusable (+3 tokens)
DECODE_TOKENS = 2


def engine_config(backends: list[dict[str, Any]], *, host: Any = "4MiB", num_blocks: int = 64, **extra: Any):
    return parse_config({"model": MODEL, "device": {"kind": "cpu", "num_blocks": num_blocks},
                         "host": {"capacity": host, "pinned": False}, "backends": backends, **extra})


def bounded(fn: Callable[..., Any], timeout: float, what: str) -> Any:
    """``fn()``, failing the test if it has not returned within ``timeout`` seconds (a hang).  (``...``: mypy
    cannot match a lambda that binds loop variables as defaults, ``lambda s=s: ...``, to ``Callable[[], Any]``.)"""
    box: dict[str, Any] = {}

    def run() -> None:
        try:
            box["value"] = fn()
        except BaseException as e:  # noqa: BLE001 - re-raised in the caller's thread
            box["error"] = e

    t = threading.Thread(target=run, daemon=True, name=f"bounded: {what}")
    t.start()
    t.join(timeout)
    if t.is_alive():
        faulthandler.dump_traceback(file=sys.stderr, all_threads=True)
        pytest.fail(f"{what}: still running after {timeout} s (a hang; thread stacks dumped to stderr)")
    if "error" in box:
        raise box["error"]
    return box.get("value")


class Prompts:
    """Fresh random prompts (never repeated, so a decode hit can only come from the shared backend)."""

    def __init__(self, seed: int, blocks: int = PROMPT_BLOCKS):
        self._g = torch.Generator().manual_seed(seed)
        self.blocks = blocks

    def __call__(self) -> list[int]:
        return torch.randint(0, 2048, (self.blocks * B + 3,), generator=self._g).tolist()


def reusable(prompt: list[int]) -> int:
    """Prompt blocks a decode may take from the cache (the block holding the last token is computed)."""
    return (len(prompt) - 1) // B


@dataclass
class Step:
    """One P/D request: prefill stores, flushes, decode loads and generates."""

    prompt: list[int]
    t_start: float
    seconds: float = 0.0
    prefill: RequestResult | None = None
    flushed: bool | None = None
    decode: RequestResult | None = None
    logits: torch.Tensor | None = None
    error: str | None = None  # an exception that reached the engine side (must never happen)


@dataclass
class PD:
    """A prefill engine, a decode engine and a no-cache baseline engine over shared backends."""

    pre: CachedEngine
    dec: CachedEngine
    base: CachedEngine
    flush_timeout: float = 10.0
    steps: list[Step] = field(default_factory=list)
    _baseline: dict[tuple[int, ...], torch.Tensor] = field(default_factory=dict)

    @classmethod
    def build(cls, backend: dict[str, Any], *, pre_host: Any = "4MiB", flush_timeout: float = 10.0) -> PD:
        """``backend``: one backend entry (name, type, options) both sides share; the decode side gets it
        with ``write: false``."""
        pre = CachedEngine.from_config(engine_config([{**backend, "write": True}], host=pre_host))
        dec = CachedEngine.from_config(engine_config([{**backend, "write": False}], host=0))
        base = CachedEngine.from_config(engine_config([], host=0))
        return cls(pre, dec, base, flush_timeout)

    def step(self, prompt: list[int]) -> Step:
        """Prefill ``prompt`` (store + flush), then decode it.  An exception is recorded, not raised."""
        s = Step(prompt, time.monotonic())
        try:
            s.prefill = self.pre.run_request(prompt, max_new_tokens=1)
            s.flushed = self.pre.stack.flush(self.flush_timeout)
            s.decode = self.dec.run_request(prompt, max_new_tokens=DECODE_TOKENS, store=False, keep_logits=True)
            assert s.decode.step_logits is not None  # keep_logits
            s.logits = torch.stack(s.decode.step_logits)
        except Exception:  # noqa: BLE001 - counted: the figure "engine exceptions" must be 0
            s.error = traceback.format_exc()
        s.seconds = time.monotonic() - s.t_start
        self.steps.append(s)
        return s

    def baseline(self, prompt: list[int]) -> torch.Tensor:
        key = tuple(prompt)
        if key not in self._baseline:
            r = self.base.run_request(prompt, max_new_tokens=DECODE_TOKENS, store=False, keep_logits=True,
                                      use_cache=False)
            assert r.step_logits is not None  # keep_logits
            self._baseline[key] = torch.stack(r.step_logits)
        return self._baseline[key]

    def wrong(self, steps: list[Step] | None = None) -> list[int]:
        """Indices (into ``steps``) of decodes whose logits differ from the no-cache baseline.  Only decodes
        that used cached blocks are compared: one that recomputed everything ran the baseline's own
        computation, and no served byte could have reached it."""
        out = []
        for i, s in enumerate(self.steps if steps is None else steps):
            if s.logits is None or s.decode is None or s.decode.cached_blocks == 0:
                continue
            if not torch.allclose(s.logits, self.baseline(s.prompt), atol=ATOL, rtol=0):
                out.append(i)
        return out

    def checked(self, steps: list[Step] | None = None) -> int:
        """How many decodes :meth:`wrong` compares (those that used cached blocks)."""
        return sum(1 for s in (self.steps if steps is None else steps) if s.decode and s.decode.cached_blocks)

    def errors(self) -> list[str]:
        return [s.error for s in self.steps if s.error is not None]

    def close(self) -> None:
        for e in (self.pre, self.dec, self.base):
            e.stack.close(timeout=10)


def hits(steps: list[Step]) -> list[int | None]:
    """Blocks each step's decode reused (None: the step raised)."""
    return [None if s.decode is None else s.decode.cached_blocks for s in steps]


def counters(engine_or_stack: Any, tier: str) -> dict[str, int]:
    """The stack's counters of ``tier`` (hits, misses, stores_skipped, failures, ...)."""
    stack = getattr(engine_or_stack, "stack", engine_or_stack)
    t = stack.metrics.snapshot()["tiers"][tier]
    return {k: v for k, v in t.items() if isinstance(v, int)}


def delta(after: dict[str, int], before: dict[str, int]) -> dict[str, int]:
    return {k: after[k] - before.get(k, 0) for k in after}
