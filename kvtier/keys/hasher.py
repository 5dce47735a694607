"""The chained block hashers: :class:`BlockHasher` (a prompt's blocks, one algorithm, block size and seed),
:class:`SequenceHasher` (a growing sequence, block by block) and SGLang's page-key chain.  The key scheme
itself is the package's docstring (:mod:`kvtier.keys`)."""

from __future__ import annotations

import bisect
import hashlib
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import cbor2
import numpy as np
import xxhash

from .cbor import sha256_cbor, sha256_cbor_frames
from .tokens import ExtraKey, LoRA, LoraKey, MMItem, SaltKey, as_token_array, validate_mm_items

ALGORITHMS = ("sha256_cbor", "xxh3_128")
#: SGLang's HiCache page keys; valid wherever an algorithm name is (listed apart from ALGORITHMS, whose
#: error messages are pinned by tests).
SGLANG_SHA256 = "sglang_sha256"
_SGLANG_NS_TAG = b"sglang-cache-namespace-v1"
VLLM_DEFAULT_SEED = "vllm-none-hash"


# --------------------------------------------------------------------------- the hasher


def known_algo(algo: object) -> bool:
    """Whether ``algo`` names a block-key algorithm (``ALGORITHMS`` or ``sglang_sha256``)."""
    return algo in ALGORITHMS or algo == SGLANG_SHA256


def algo_problem(what: str, algo: object) -> str:
    return (f"{what}: expected one of {', '.join(ALGORITHMS)}, got {algo!r} "
            f"(or {SGLANG_SHA256!r}: SGLang's HiCache page keys)")


def none_hash_seed(algo: str, seed: str | int | None) -> str | int | None:
    """The seed NONE is derived from: the explicit one, else PYTHONHASHSEED, else vLLM's default.
    ``sglang_sha256``: SGLang's ``extra_key`` as given (None = no extra key; never PYTHONHASHSEED)."""
    if seed is not None or algo == SGLANG_SHA256:
        return seed
    env = os.environ.get("PYTHONHASHSEED")
    if algo == "sha256_cbor":
        return env if env is not None else VLLM_DEFAULT_SEED
    return int(env) if env is not None and env.isdigit() else 0


class BlockHasher:
    """Chained block hashing with one algorithm, block size and seed.

    Invariant: the hash of block ``i`` depends only on (algo, seed, block_size, tokens[:(i+1)*B],
    the extra keys of blocks 0..i); never on the process, host, or how the sequence was split into calls.
    """

    def __init__(self, block_size: int, algo: str = "sha256_cbor", seed: str | int | None = None):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size: expected an integer >= 1, got {block_size!r}")
        if not known_algo(algo):
            raise ValueError(algo_problem("algo", algo))
        if seed is not None and (isinstance(seed, bool) or not isinstance(seed, str | int)):
            raise ValueError(f"seed: expected a string, an integer or None, got {seed!r}")
        self.block_size = block_size
        self.algo = algo
        self.seed = none_hash_seed(algo, seed)
        if algo == SGLANG_SHA256:
            if self.seed is not None and not isinstance(self.seed, str):
                raise ValueError(f"seed: sglang_sha256 takes SGLang's extra_key (a string) or None, "
                                 f"got {self.seed!r}")
            self.none_hash = b""  # the chain starts from nothing (or a per-request namespace seed)
            self.digest_size = 32
        elif algo == "sha256_cbor":
            self.none_hash = sha256_cbor(self.seed)
            self.digest_size = 32
        else:
            if isinstance(self.seed, str):
                self._xxh_seed = int.from_bytes(hashlib.sha256(self.seed.encode()).digest()[:8], "little")
            else:
                self._xxh_seed = int(self.seed or 0) & (2**64 - 1)
            self.none_hash = xxhash.xxh3_128_digest(b"kvtier-xxh3-128-none", seed=self._xxh_seed)
            self.digest_size = 16

    # -- public API ---------------------------------------------------------------------------

    def hash_blocks(
        self,
        tokens: Any,
        *,
        mm: Sequence[Any] = (),
        lora: LoRA | tuple[str, str] | dict[str, Any] | None = None,
        cache_salt: str | None = None,
    ) -> list[bytes]:
        """Hashes of every full block of ``tokens`` (a partial trailing block is ignored)."""
        arr = as_token_array(tokens)
        ex = Extras.checked(mm, lora, cache_salt, arr.size)
        self._refuse_sglang_extras(ex.items, ex.lora_key)
        return self._hash_range(arr, 0, None, ex.items, ex.lora_key, ex.salt_key)

    def _refuse_sglang_extras(self, items: tuple[MMItem, ...], lora_key: LoraKey | None) -> None:
        if self.algo != SGLANG_SHA256:
            return
        if items:
            raise ValueError("mm: sglang_sha256 page keys carry no multimodal items (SGLang puts them in "
                             "the token ids); hash the token ids SGLang sees")
        if lora_key is not None:
            raise ValueError("lora: sglang_sha256 page keys carry no LoRA; SGLang appends the LoRA id to "
                             "extra_key: pass extra_key + lora_id as the seed")

    def extra_keys(self, block_index: int, items: Sequence[MMItem], lora_key: LoraKey | None,
                   salt_key: SaltKey | None) -> tuple[ExtraKey, ...] | None:
        """Extra keys of one block, in the documented order; ``None`` when there are none."""
        start = block_index * self.block_size
        end = start + self.block_size
        extra: list[ExtraKey] = []
        if lora_key is not None:
            extra.append(lora_key)
        if items:
            # First item that may overlap: the one before the first starting at/after `start`.
            j = max(bisect.bisect_left([it.offset for it in items], start) - 1, 0)
            for it in items[j:]:
                if it.offset >= end:
                    break
                if it.offset + it.length > start:
                    extra.append(("mm", it.identifier, it.offset - start))
        if salt_key is not None and block_index == 0:
            extra.append(salt_key)
        return tuple(extra) if extra else None

    # -- internals ----------------------------------------------------------------------------

    def _hash_range(self, arr: np.ndarray, first_block: int, parent: bytes | None,
                    items: tuple[MMItem, ...], lora_key: LoraKey | None, salt_key: SaltKey | None) -> list[bytes]:
        """Hash full blocks of ``arr`` (tokens of blocks first_block, first_block+1, ...)."""
        B = self.block_size
        nblocks = arr.size // B
        if nblocks == 0:
            return []
        arr = arr[: nblocks * B]
        if self.algo == SGLANG_SHA256:
            if parent is None:
                extra_key = self.seed if isinstance(self.seed, str) else None
                parent = sglang_namespace_seed(extra_key, None if salt_key is None else salt_key[1])
            return sglang_sha256_chain(arr, B, parent)
        extras = self._extras_for(first_block, nblocks, items, lora_key, salt_key)
        parent = parent if parent is not None else self.none_hash
        if self.algo == "sha256_cbor":
            return self._sha256_cbor_chain(arr, parent, extras)
        return self._xxh3_chain(arr, parent, extras)

    def _extras_for(self, first_block: int, nblocks: int, items: tuple[MMItem, ...],
                    lora_key: LoraKey | None, salt_key: SaltKey | None) -> list[bytes] | None:
        """CBOR of each block's extra keys, or None when every block has none (the common case)."""
        if not items and lora_key is None and (salt_key is None or first_block > 0):
            return None
        return [cbor2.dumps(self.extra_keys(first_block + i, items, lora_key, salt_key), canonical=True)
                for i in range(nblocks)]

    def _sha256_cbor_chain(self, arr: np.ndarray, parent: bytes, extras: list[bytes] | None) -> list[bytes]:
        if arr.dtype != np.uint32 and arr.size and int(arr.max()) >= 1 << 32:
            return self._sha256_cbor_reference(arr, parent, extras)
        buf, starts, ends = sha256_cbor_frames(arr, self.block_size, extras)
        mv = buf.data
        sha = hashlib.sha256
        out: list[bytes] = []
        append = out.append
        h = parent
        for s, e in zip(starts, ends):
            mv[s + 3 : s + 35] = h
            h = sha(mv[s:e]).digest()
            append(h)
        return out

    def _sha256_cbor_reference(self, arr: np.ndarray, parent: bytes, extras: list[bytes] | None
                               ) -> list[bytes]:
        """vLLM's own construction, block by block (token ids >= 2**32 are rare enough for this)."""
        B = self.block_size
        toks = arr.tolist()
        out: list[bytes] = []
        h = parent
        for i in range(len(toks) // B):
            extra = None if extras is None else cbor2.loads(extras[i])
            h = sha256_cbor((h, tuple(toks[i * B : (i + 1) * B]), extra))
            out.append(h)
        return out

    def _xxh3_chain(self, arr: np.ndarray, parent: bytes, extras: list[bytes] | None) -> list[bytes]:
        step = self.block_size * 8
        raw = arr.astype("<i8", copy=False).tobytes()
        xxh = xxhash.xxh3_128_digest
        seed = self._xxh_seed
        out: list[bytes] = []
        append = out.append
        h = parent
        n = len(raw) // step
        if extras is None:
            for i in range(n):
                h = xxh(h + raw[i * step : (i + 1) * step] + b"\xf6", seed)
                append(h)
        else:
            for i in range(n):
                h = xxh(h + raw[i * step : (i + 1) * step] + extras[i], seed)
                append(h)
        return out


def sglang_namespace_seed(extra_key: str | None, cache_salt: str | None) -> bytes | None:
    """SGLang's ``storage_namespace_seed`` (the prior digest of a request's first page), as bytes; None
    when the request has neither an extra key nor a cache salt."""
    if extra_key is None and cache_salt is None:
        return None
    h = hashlib.sha256(_SGLANG_NS_TAG)
    for part in (extra_key, cache_salt):
        if part is None:
            h.update(b"\x00")
        else:
            enc = part.encode("utf-8")
            h.update(b"\x01" + len(enc).to_bytes(8, "little") + enc)
    return h.digest()


def sglang_sha256_chain(arr: np.ndarray, block_size: int, parent: bytes | None) -> list[bytes]:
    """SGLang's page-key chain over the full pages of ``arr`` (``parent``: the prior digest, or None)."""
    B = block_size
    n = arr.size // B
    if n == 0:
        return []
    arr = arr[: n * B]
    narrow = arr.dtype == np.uint32 or int(arr.max()) <= 0xFFFFFFFF
    raw = memoryview(arr.astype("<u4" if narrow else "<u8", copy=False).tobytes())
    sha = hashlib.sha256
    out: list[bytes] = []
    h = parent or b""
    if narrow:
        step = B * 4
        for i in range(n):
            h = sha(h + raw[i * step:(i + 1) * step]).digest()
            out.append(h)
        return out
    wide = arr.reshape(n, B) > 0xFFFFFFFF
    for i in range(n):
        block = arr[i * B:(i + 1) * B]
        # A page holding a token id >= 2**32 is hashed wide, tagged by an odd byte count (0xff first).
        data = (b"\xff" + block.astype("<u8").tobytes()) if wide[i].any() else block.astype("<u4").tobytes()
        h = sha(h + data).digest()
        out.append(h)
    return out


def _lora_key(lora: LoRA | tuple[str, str] | dict[str, Any] | None) -> LoraKey | None:
    if lora is None:
        return None
    if isinstance(lora, dict):
        unknown = set(lora) - {"name", "path"}
        if unknown or "name" not in lora:
            raise ValueError(f"lora: expected {{name, path}}, got {lora!r}")
        lora = LoRA(lora["name"], lora.get("path", ""))
    elif isinstance(lora, (tuple, list)) and len(lora) in (1, 2):
        lora = LoRA(*lora)
    if not isinstance(lora, LoRA):
        raise ValueError(f"lora: expected {{name, path}} or [name, path], got {lora!r}")
    if not isinstance(lora.name, str) or not lora.name:
        raise ValueError(f"lora.name: expected a non-empty string, got {lora.name!r}")
    if not isinstance(lora.path, str):
        raise ValueError(f"lora.path: expected a string, got {lora.path!r}")
    return ("lora", lora.name, lora.path)


def _salt_key(salt: str | None) -> SaltKey | None:
    if salt is None:
        return None
    if not isinstance(salt, str) or not salt:
        raise ValueError(f"cache_salt: expected a non-empty string, got {salt!r}")
    return ("cache_salt", salt)


@dataclass(frozen=True)
class Extras:
    """A request's extra keys, checked and normalised: its multimodal items (sorted, inside the prompt)
    and its LoRA and salt keys (None when absent)."""

    items: tuple[MMItem, ...]
    lora_key: LoraKey | None
    salt_key: SaltKey | None

    @classmethod
    def checked(cls, mm: Sequence[Any], lora: LoRA | tuple[str, str] | dict[str, Any] | None, cache_salt: str | None,
                num_tokens: int | None) -> Extras:
        """ValueError naming the field (``mm[2].offset``, ``lora.name``, ``cache_salt``) that is wrong;
        ``num_tokens``: the prompt length the items must lie in (None: not checked)."""
        return cls(validate_mm_items(mm, num_tokens), _lora_key(lora), _salt_key(cache_salt))


class SequenceHasher:
    """Incremental hashing of one growing sequence (a request whose decode appends tokens).

    Invariant: ``hashes`` always equals ``hasher.hash_blocks(all tokens so far, ...)``, and each call to
    ``extend`` hashes only the blocks that became full in that call.
    """

    def __init__(self, hasher: BlockHasher, tokens: Any = (), *, mm: Sequence[Any] = (),
                 lora: LoRA | tuple[str, str] | dict[str, Any] | None = None, cache_salt: str | None = None):
        self.hasher = hasher
        arr = as_token_array(tokens)
        # Multimodal items belong to the prompt: they must lie inside the tokens given up front.
        ex = Extras.checked(mm, lora, cache_salt, arr.size)
        self._items, self._lora, self._salt = ex.items, ex.lora_key, ex.salt_key
        hasher._refuse_sglang_extras(self._items, self._lora)
        self._tail = np.empty(0, dtype=np.int64)
        self._num_tokens = 0
        self.hashes: list[bytes] = []
        self.extend(arr)

    @property
    def num_tokens(self) -> int:
        return self._num_tokens

    def extend(self, tokens: Any) -> list[bytes]:
        arr = as_token_array(tokens, what=f"tokens (appended at position {self._num_tokens})")
        self._num_tokens += arr.size
        pending = np.concatenate((self._tail, arr)) if self._tail.size else arr
        B = self.hasher.block_size
        nfull = pending.size // B
        new = self.hasher._hash_range(pending[: nfull * B], len(self.hashes),
                                      self.hashes[-1] if self.hashes else None,
                                      self._items, self._lora, self._salt)
        self.hashes.extend(new)
        self._tail = pending[nfull * B :].copy()
        return new
