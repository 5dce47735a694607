"""Workloads that ``kvtier run`` replays: a synthetic multi-turn chat, or a trace file.

Synthetic chat (the default): ``users`` conversations share one system prompt; at turn ``t`` a user's
prompt is the system prompt + every earlier (question, answer) of that user + a new question.  Answers
are what the model generates, so turn ``t+1`` extends turn ``t``'s prompt and prefix reuse is what a real
chat deployment sees.  Requests go round-robin over users (turn 1 of every user, then turn 2, ...).

Trace file: JSONL or Parquet, one request per row, with either ``tokens`` (a list of ids) or ``length``
(an int: random ids of that length), and optionally ``prefix_id`` + ``prefix_length`` (rows with the same
``prefix_id`` share their first ``prefix_length`` tokens), ``max_new_tokens``, ``cache_salt``.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np


@dataclass
class Request:
    tokens: list[int]
    max_new_tokens: int
    user: int = 0
    turn: int = 0
    cache_salt: str | None = None
    mm: list[Any] = field(default_factory=list)


@dataclass(frozen=True)
class ChatWorkload:
    """Parameters of the synthetic multi-turn chat (all documented in ``kvtier run --help``)."""

    users: int = 8
    turns: int = 4
    system_prompt_tokens: int = 512
    question_tokens: int = 64
    answer_tokens: int = 32
    vocab_size: int = 2048
    seed: int = 0

    def __post_init__(self) -> None:
        for name in ("users", "turns", "system_prompt_tokens", "question_tokens", "answer_tokens"):
            v = getattr(self, name)
            if not isinstance(v, int) or v < (0 if name == "system_prompt_tokens" else 1):
                raise ValueError(f"workload.{name}: expected a positive integer, got {v!r}")

    @property
    def num_requests(self) -> int:
        return self.users * self.turns

    def replay(self, serve) -> None:
        """Call ``serve(request)`` for every request in order; it must return the tokens generated for
        the request, since the next turn's history depends on them."""
        rng = np.random.default_rng(self.seed)
        system = rng.integers(0, self.vocab_size, self.system_prompt_tokens).tolist()
        history = [list(system) for _ in range(self.users)]
        for turn in range(self.turns):
            for user in range(self.users):
                question = rng.integers(0, self.vocab_size, self.question_tokens).tolist()
                req = Request(history[user] + question, self.answer_tokens, user=user, turn=turn)
                answer = serve(req)
                history[user] = req.tokens + list(answer)


def load_trace(path: str | Path, *, vocab_size: int = 2048, default_max_new_tokens: int = 32,
               seed: int = 0) -> list[Request]:
    """Requests of a JSONL or Parquet trace; ValueError naming the row and field otherwise."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"trace {path}: no such file")
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        rows = pq.read_table(path).to_pylist()
    else:
        rows = []
        for i, line in enumerate(path.read_text().splitlines(), 1):
            if line.strip():
                try:
                    rows.append(json.loads(line))
                except json.JSONDecodeError as e:
                    raise ValueError(f"trace {path}, line {i}: invalid JSON: {e.msg}") from None
    rng = np.random.default_rng(seed)
    prefixes: dict[Any, list[int]] = {}
    out = []
    for i, row in enumerate(rows, 1):
        where = f"trace {path}, row {i}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object, got {type(row).__name__}")
        unknown = set(row) - {"tokens", "length", "prefix_id", "prefix_length", "max_new_tokens", "cache_salt"}
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}")
        if row.get("tokens") is not None:
            tokens = row["tokens"]
            if not isinstance(tokens, list) or not all(isinstance(t, int) and 0 <= t < vocab_size
                                                       for t in tokens):
                raise ValueError(f"{where}: tokens must be a list of ints in [0, {vocab_size})")
        elif row.get("length") is not None:
            n = row["length"]
            if not isinstance(n, int) or n < 1:
                raise ValueError(f"{where}: length must be a positive int, got {n!r}")
            tokens = rng.integers(0, vocab_size, n).tolist()
            pid = row.get("prefix_id")
            if pid is not None:
                plen = min(int(row.get("prefix_length") or 0), n)
                shared = prefixes.setdefault(pid, rng.integers(0, vocab_size, plen).tolist())
                tokens[: len(shared[:plen])] = shared[:plen]
        else:
            raise ValueError(f"{where}: needs 'tokens' or 'length'")
        if len(tokens) < 1:
            raise ValueError(f"{where}: empty prompt")
        mnt = row.get("max_new_tokens") or default_max_new_tokens
        out.append(Request(list(tokens), int(mnt), user=i - 1, cache_salt=row.get("cache_salt")))
    return out
