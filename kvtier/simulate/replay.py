"""One simulation: a workload replayed through the engine and the byte-free stack of one config.

The engine is :class:`~kvtier.integrations.engine.CachedEngine`, the same object ``kvtier run`` drives
(device block pool reuse, what to look up, load and store), with a model that computes nothing; the
stack is :class:`~kvtier.simulate.ledger_stack.SimulatedStack`.  So a simulated request takes the path a real
one takes, minus the bytes.
"""

from __future__ import annotations

import time
from collections import OrderedDict
from collections.abc import Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any

import numpy as np

from ..config import KvtierConfig
from ..integrations.engine import CachedEngine
from ..keys import BlockHasher
from ..memory.blockpool import BlockPool
from ..workload import ChatWorkload, Request
from .ledger_stack import SimulatedStack


def block_nbytes(config: KvtierConfig) -> int:
    """Bytes of one block's KV payload in this deployment (what host memory and backends hold)."""
    from ..format.layout import KVLayout

    return KVLayout.from_namespace(config.namespace(), 1, config.device.layout).block_nbytes


class NullModel:
    """Computes nothing: ``generate`` returns seeded random token ids (a chat's next turn extends them)."""

    def __init__(self, block_size: int, vocab_size: int = 2048, seed: int = 0):
        self.block_size = block_size
        self.vocab_size = vocab_size
        self._rng = np.random.default_rng(seed)
        # Drawn ahead in bulk: the generator's stream is the same whether read 32 or 64 Ki values a call
        # (numpy draws them one by one), and a call a request cost more than the request's index work.
        self._ahead: list[int] = []
        self._pos = 0

    def generate(self, prompt: list[int], table: list[int], cached_tokens: int,
                 max_new_tokens: int) -> tuple[list[int], list[Any]]:
        p, n = self._pos, max_new_tokens
        if p + n > len(self._ahead):
            self._ahead = self._ahead[p:] + self._rng.integers(0, self.vocab_size, max(n, 1 << 16)).tolist()
            p = 0
        self._pos = p + n
        return self._ahead[p:p + n], []


@dataclass
class SimResult:
    """What one configuration did with the workload."""

    requests: int = 0
    prompt_tokens: int = 0
    prompt_blocks: int = 0
    saved_tokens: int = 0
    hit_blocks: dict[str, int] = field(default_factory=dict)   # tier -> prompt blocks served from it
    block_nbytes: int = 0
    value_nbytes: int = 0                                       # a stored value: header + payload
    tiers: list[str] = field(default_factory=list)             # device, host?, backends in config order
    written: dict[str, int] = field(default_factory=dict)      # tier -> blocks written into it
    read: dict[str, int] = field(default_factory=dict)         # tier -> blocks read out of it
    evicted: dict[str, int] = field(default_factory=dict)
    skipped: dict[str, int] = field(default_factory=dict)      # stores refused for lack of room
    writes_per_s: dict[str, list[int]] = field(default_factory=dict)  # backend -> values / s, per second
    duration_s: float = 0.0                                     # trace time covered
    block_ops: int = 0                                          # blocks looked up + loaded + stored
    sim_s: float = 0.0                                          # wall time of the replay, hashing excluded
    hash_s: float = 0.0
    # The raw ceiling, when asked for: the same prompt keys through a bare OrderedDict LRU in this run.
    ceiling_ops: int = 0
    ceiling_s: float = 0.0

    def hit_rate(self, tier: str) -> float:
        return self.hit_blocks.get(tier, 0) / max(self.prompt_blocks, 1)

    @property
    def ops_per_s(self) -> float:
        return self.block_ops / max(self.sim_s, 1e-9)

    @property
    def ceiling_ops_per_s(self) -> float:
        """Lookups + updates a second of the bare LRU (0 when not measured)."""
        return self.ceiling_ops / self.ceiling_s if self.ceiling_s else 0.0


def bare_lru(cache: OrderedDict[bytes, None], capacity: int, keys: Sequence[bytes]) -> int:
    """The raw ceiling of a simulated request's bookkeeping: each key looked up in a plain LRU of
    ``capacity`` keys and made most recent, inserted (evicting the least recent) where absent; the
    lookups + updates made (two a key).  No tiers, pins, policies or backends: what Python does at
    the least per block, to read the simulator's own figure against on a noisy machine."""
    move, pop = cache.move_to_end, cache.popitem
    for key in keys:
        if key in cache:
            move(key)
        else:
            cache[key] = None
            if len(cache) > capacity:
                pop(last=False)
    return 2 * len(keys)


def simulate(config: KvtierConfig, requests: Iterable[Request] | ChatWorkload, *,
             device_blocks: int | None = None, rate: float = 10.0, seed: int = 0,
             on_request: Callable[[int], None] | None = None, ceiling: bool = False) -> SimResult:
    """Replay ``requests`` (a trace, read lazily) or a synthetic chat through ``config``'s tiers.
    ``rate``: arrivals per second for requests without a timestamp ``t``.  ``ceiling``: also time
    :func:`bare_lru` on each request's prompt keys, apart from the replay (``SimResult.ceiling_*``)."""
    nbytes = block_nbytes(config)
    stack = SimulatedStack(config, nbytes)
    B = stack.block_size
    pool = BlockPool(device_blocks or config.device.num_blocks,
                     on_evict=lambda keys, block_ids: stack.on_device_freed(block_ids))
    vocab = requests.vocab_size if isinstance(requests, ChatWorkload) else 2048
    engine = CachedEngine(stack, NullModel(B, vocab, seed), pool)  # type: ignore[arg-type]
    hasher = stack.namespace.hasher()
    res = SimResult(block_nbytes=nbytes, value_nbytes=stack.ledgers[0].value_nbytes if stack.ledgers else nbytes,
                    tiers=["device", *(["host"] if stack.host_slots else []), *(led.name for led in stack.ledgers)])
    clock = time.perf_counter
    t_first: float | None = None
    lru: OrderedDict[bytes, None] = OrderedDict()
    lru_cap = pool.num_blocks + stack.host_slots

    def serve(req: Request) -> list[int]:
        nonlocal t_first
        i = res.requests
        t = req.t if req.t is not None else i / rate
        t_first = t if t_first is None else t_first
        stack.now = t - t_first
        h0 = clock()
        if req.hashes is not None:
            hashes = req.hashes
            check_hashed_row(hashes, req.num_tokens, hasher, i)
            prompt = [0] * (req.num_tokens or len(hashes) * B)
        else:
            prompt = req.tokens
            hashes = hasher.hash_blocks(prompt, mm=req.mm, cache_salt=req.cache_salt, lora=req.lora)
        h1 = clock()
        try:
            r = engine.run_request(prompt, max_new_tokens=req.max_new_tokens, hashes=hashes)
        except ValueError as e:
            raise ValueError(f"request {i + 1}: {e}") from None
        h2 = clock()
        res.sim_s += h2 - h1
        res.hash_s += h1 - h0
        if ceiling:
            res.ceiling_ops += bare_lru(lru, lru_cap, hashes)
            res.ceiling_s += clock() - h2
        res.requests += 1
        res.prompt_tokens += r.num_prompt_tokens
        res.prompt_blocks += r.num_prompt_blocks
        res.saved_tokens += r.saved_tokens
        res.block_ops += r.num_prompt_blocks + sum(r.loaded_blocks.values()) + r.stored_blocks
        hb = res.hit_blocks
        hb["device"] = hb.get("device", 0) + r.device_blocks
        for tier, n in r.loaded_blocks.items():
            hb[tier] = hb.get(tier, 0) + n
        res.duration_s = max(res.duration_s, stack.now)
        if on_request is not None:
            on_request(res.requests)
        return r.tokens

    try:
        if isinstance(requests, ChatWorkload):
            requests.replay(serve)
        else:
            for req in requests:
                serve(req)
    finally:
        stack.close()
    for name, c in stack.counters.items():
        res.written[name], res.read[name] = c.written, c.read
        res.evicted[name], res.skipped[name] = c.evicted, c.skipped
        if name != "host":
            res.writes_per_s[name] = _per_second(c.writes_per_s, res.duration_s)
    return res


def check_hashed_row(hashes: Sequence[bytes], num_tokens: int | None, hasher: BlockHasher, i: int) -> None:
    """Request ``i`` (0-based) of a trace gives block hashes: they must be the size ``keys.algo`` makes
    (another algorithm's never match), and full blocks of its ``num_tokens`` (when given)."""
    if hashes and len(hashes[0]) != hasher.digest_size:
        raise ValueError(f"trace row {i + 1}: hashes are {len(hashes[0])} bytes, keys.algo {hasher.algo} "
                         f"makes {hasher.digest_size}")
    B = hasher.block_size
    if num_tokens is not None and len(hashes) > num_tokens // B:
        raise ValueError(f"trace row {i + 1}: {len(hashes)} block hashes for num_tokens {num_tokens} "
                         f"(at most {num_tokens // B} full blocks of {B} tokens)")


def _per_second(buckets: dict[int, int], duration_s: float) -> list[int]:
    n = int(duration_s) + 1
    out = [0] * n
    for sec, v in buckets.items():
        if 0 <= sec < n:
            out[sec] += v
    return out


__all__ = ["NullModel", "SimResult", "bare_lru", "block_nbytes", "check_hashed_row", "simulate"]
