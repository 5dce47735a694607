"""Workloads that ``kvtier run`` replays: a synthetic multi-turn chat, or a trace file.

Synthetic chat (the default): ``users`` conversations share one system prompt; at turn ``t`` a user's
prompt is the system prompt + every earlier (question, answer) of that user + a new question.  Answers
are what the model generates, so turn ``t+1`` extends turn ``t``'s prompt and prefix reuse is what a real
chat deployment sees.  Requests go round-robin over users (turn 1 of every user, then turn 2, ...).

Trace file: JSONL or Parquet, one request per row, with either ``tokens`` (a list of ids) or ``length``
(an int: random ids of that length), and optionally ``prefix_id`` + ``prefix_length`` (rows with the same
``prefix_id`` share their first ``prefix_length`` tokens), ``t`` (arrival in seconds), ``max_new_tokens``,
``cache_salt``, ``mm`` and ``lora`` (as ``kvtier keys`` takes them).  ``kvtier simulate`` also reads rows
with ``hashes`` (block hashes as hex) instead of tokens.  ``kvtier run --record-trace`` writes the
requests it served in this format (tokens include the generated answers of earlier turns).
"""

from __future__ import annotations

import json
from collections.abc import Callable, Iterator
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, overload

import numpy as np

from .keys import Extras


@dataclass
class Request:
    tokens: list[int]
    max_new_tokens: int
    user: int = 0
    turn: int = 0
    cache_salt: str | None = None
    mm: list[Any] = field(default_factory=list)
    t: float | None = None              # arrival, seconds from the trace's start (traces only)
    lora: Any = None
    hashes: list[bytes] | None = None   # given instead of tokens (simulation of a hashed trace)
    num_tokens: int | None = None       # prompt length of a hashed row


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

    def replay(self, serve: Callable[[Request], list[int]]) -> None:
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


TRACE_FIELDS = ("t", "tokens", "hashes", "num_tokens", "length", "prefix_id", "prefix_length",
                "max_new_tokens", "cache_salt", "mm", "lora")


class TraceRecorder:
    """Writes served requests as JSONL trace rows (``t``, ``tokens``, ``max_new_tokens`` and the extra
    keys), one line each as it is served, so a long run never holds its trace in memory."""

    def __init__(self, path: str | Path):
        self.path = Path(path)
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._f = open(self.path, "w", encoding="utf-8")  # noqa: SIM115 - closed by close()

    def write(self, req: Request, t: float) -> None:
        row: dict[str, Any] = {"t": round(t, 6), "tokens": req.tokens, "max_new_tokens": req.max_new_tokens}
        for name in ("cache_salt", "lora"):
            if getattr(req, name) is not None:
                row[name] = getattr(req, name)
        if req.mm:
            row["mm"] = req.mm
        self._f.write(json.dumps(row, separators=(",", ":")) + "\n")

    def close(self) -> None:
        self._f.close()


def load_trace(path: str | Path, *, vocab_size: int = 2048, default_max_new_tokens: int = 32,
               seed: int = 0) -> list[Request]:
    """Every request of a JSONL or Parquet trace (:func:`iter_trace` reads one row at a time)."""
    return list(iter_trace(path, vocab_size=vocab_size, default_max_new_tokens=default_max_new_tokens,
                           seed=seed))


def _rows(path: Path) -> Iterator[dict[str, Any]]:
    """The rows of a trace, one at a time (JSONL line by line, Parquet a row group batch at a time)."""
    if path.suffix == ".parquet":
        import pyarrow.parquet as pq

        for batch in pq.ParquetFile(path).iter_batches(batch_size=1024):
            yield from batch.to_pylist()
        return
    with open(path, encoding="utf-8") as f:
        for i, line in enumerate(f, 1):
            if line.strip():
                try:
                    yield json.loads(line)
                except json.JSONDecodeError as e:
                    raise ValueError(f"trace {path}, line {i}: invalid JSON: {e.msg}") from None


def iter_trace(path: str | Path, *, vocab_size: int = 2048, default_max_new_tokens: int = 32,
               seed: int = 0) -> Iterator[Request]:
    """Requests of a JSONL or Parquet trace, read lazily (a trace of millions of requests never has all
    its token lists in memory); ValueError naming the row and field otherwise.

    A row has ``tokens`` (ids), or ``length`` (random ids, ``prefix_id`` + ``prefix_length`` share a
    prefix), or ``hashes`` (block hashes as hex, for ``kvtier simulate`` only; ``num_tokens`` the
    prompt length, default every block full); optional ``t`` (seconds), ``max_new_tokens``,
    ``cache_salt``, ``mm`` and ``lora`` (as in ``kvtier keys``)."""
    path = Path(path)
    if not path.exists():
        raise ValueError(f"trace {path}: no such file")
    rng = np.random.default_rng(seed)
    prefixes: dict[Any, list[int]] = {}
    for i, row in enumerate(_rows(path), 1):
        where = f"trace {path}, row {i}"
        if not isinstance(row, dict):
            raise ValueError(f"{where}: expected an object, got {type(row).__name__}")
        row = {k: v for k, v in row.items() if v is not None}  # Parquet fills absent fields with null
        unknown = set(row) - set(TRACE_FIELDS)
        if unknown:
            raise ValueError(f"{where}: unknown field(s) {sorted(unknown)}; allowed: {', '.join(TRACE_FIELDS)}")
        hashes = None
        if "tokens" in row:
            tokens = row["tokens"]
            if not isinstance(tokens, list) or not all(type(t) is int and 0 <= t < vocab_size for t in tokens):
                raise ValueError(f"{where}: tokens must be a list of ints in [0, {vocab_size})")
        elif "length" in row:
            n = count_field(row, "length", where, low=1, default=0)  # present (this branch), never the default
            tokens = rng.integers(0, vocab_size, n).tolist()
            pid = row.get("prefix_id")
            if pid is not None:
                if not isinstance(pid, str | int) or isinstance(pid, bool):
                    raise ValueError(f"{where}: prefix_id must be a string or an int, got {pid!r}")
                plen = count_field(row, "prefix_length", where, low=0, default=0)
                plen = min(plen, n)
                shared = prefixes.setdefault(pid, rng.integers(0, vocab_size, plen).tolist())
                tokens[: len(shared[:plen])] = shared[:plen]
        elif "hashes" in row:
            hashes = _hashes(row["hashes"], where)
            tokens = []
        else:
            raise ValueError(f"{where}: needs 'tokens', 'length' or 'hashes'")
        if hashes is None and len(tokens) < 1:
            raise ValueError(f"{where}: empty prompt")
        t = row.get("t")
        if t is not None and (not isinstance(t, int | float) or isinstance(t, bool) or t < 0):
            raise ValueError(f"{where}: t must be a number of seconds >= 0, got {t!r}")
        nt = count_field(row, "num_tokens", where, low=1, default=None)
        mnt = count_field(row, "max_new_tokens", where, low=1, default=default_max_new_tokens)
        try:  # checked here, where the row is known (the hasher names only the field)
            Extras.checked(row.get("mm") or [], row.get("lora"), row.get("cache_salt"),
                           nt if hashes is not None else len(tokens))
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None
        yield Request(list(tokens), mnt, user=i - 1, cache_salt=row.get("cache_salt"),
                      mm=list(row.get("mm") or []), t=None if t is None else float(t), lora=row.get("lora"),
                      hashes=hashes, num_tokens=nt)


@overload
def count_field(row: dict[str, Any], field: str, where: str, *, low: int, default: int) -> int: ...
@overload
def count_field(row: dict[str, Any], field: str, where: str, *, low: int, default: None) -> int | None: ...
def count_field(row: dict[str, Any], field: str, where: str, *, low: int, default: int | None) -> int | None:
    """``row[field]``, an int >= ``low`` (``default`` when absent); ValueError naming the row otherwise."""
    v = row.get(field)
    if v is None:
        return default
    if type(v) is not int or v < low:
        what = "a positive int" if low == 1 else f"an int >= {low}"
        raise ValueError(f"{where}: {field} must be {what}, got {v!r}")
    return v


def _hashes(value: Any, where: str) -> list[bytes]:
    if not isinstance(value, list) or not value:
        raise ValueError(f"{where}: hashes must be a non-empty list of hex strings")
    out = []
    for j, h in enumerate(value):
        try:
            out.append(bytes.fromhex(h))
        except (TypeError, ValueError):
            raise ValueError(f"{where}: hashes[{j}]: expected a hex string, got {h!r}") from None
    return out
