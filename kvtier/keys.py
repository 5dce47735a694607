"""Block keys: what a block is called, on any host, in any process.

A prompt is cut into full blocks of ``block_size`` tokens.  Block ``i``'s hash is

    h[i] = H(h[i-1] or NONE, tokens[i*B:(i+1)*B], extra[i])

where ``extra[i]`` is a tuple of tagged extra keys, in this order:
``("lora", name, path)``, one ``("mm", identifier, offset - block_start)`` per multimodal item that
overlaps the block, and ``("cache_salt", salt)`` on block 0 only; ``None`` when there are none.

Two algorithms:

* ``sha256_cbor`` is byte-identical to vLLM's (>= 0.33) prefix-caching hash:
  ``H(x) = sha256(cbor2.dumps(x, canonical=True))`` with ``x = (parent, tuple(tokens), extra)`` and
  ``NONE = H(seed)``, seed = ``PYTHONHASHSEED`` if set else ``"vllm-none-hash"``.  We emit the canonical
  CBOR ourselves, vectorised with numpy, so the result is the same bytes at a fraction of the cost.
* ``xxh3_128``: a seeded 128-bit hash of ``parent || int64-LE tokens || cbor(extra)`` for deployments
  that do not need vLLM compatibility.
* ``sglang_sha256`` is byte-identical to SGLang's HiCache page keys (``get_storage_hash_str``):
  ``h[i] = sha256(h[i-1] || uint32-LE tokens)`` (a page holding a token id >= 2**32:
  ``sha256(h[i-1] || 0xff || uint64-LE tokens)``), where the chain starts from nothing, or from SGLang's
  request namespace seed ``sha256("sglang-cache-namespace-v1" || part(extra_key) || part(cache_salt))`` when
  either is set (``part(None) = 0x00``, ``part(s) = 0x01 || u64-LE len(utf8) || utf8``).  The ``seed`` is
  SGLang's ``extra_key`` (its LoRA id appended, as SGLang does); multimodal items and LoRA are not extra
  keys there (SGLang folds them into token ids / ``extra_key``), so they are refused.

Never Python's ``hash()``: it differs per process.
"""

from __future__ import annotations

import array
import bisect
import functools
import hashlib
import operator
import os
import re
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias, cast

import cbor2
import numpy as np
import xxhash

ALGORITHMS = ("sha256_cbor", "xxh3_128")
#: SGLang's HiCache page keys; valid wherever an algorithm name is (listed apart from ALGORITHMS, whose
#: error messages are pinned by tests).
SGLANG_SHA256 = "sglang_sha256"
_SGLANG_NS_TAG = b"sglang-cache-namespace-v1"
VLLM_DEFAULT_SEED = "vllm-none-hash"
_INT64_MAX = 2**63 - 1


@dataclass(frozen=True)
class MMItem:
    """A multimodal item occupying ``tokens[offset : offset + length]`` (e.g. an image's placeholders)."""

    identifier: str
    offset: int
    length: int


@dataclass(frozen=True)
class LoRA:
    name: str
    path: str = ""


#: A block's extra keys, tagged: ``("lora", name, path)``, ``("mm", identifier, offset - block_start)``,
#: ``("cache_salt", salt)``.
LoraKey: TypeAlias = tuple[str, str, str]
SaltKey: TypeAlias = tuple[str, str]
ExtraKey: TypeAlias = LoraKey | tuple[str, str, int] | SaltKey


# --------------------------------------------------------------------------- input validation


def as_token_array(tokens: Any, what: str = "tokens") -> np.ndarray:
    """Return ``tokens`` as a 1-D uint32 or int64 numpy array of non-negative ids, or raise ValueError
    naming the bad position."""
    if hasattr(tokens, "detach") and hasattr(tokens, "cpu"):  # torch.Tensor, without importing torch
        if tokens.is_floating_point() or tokens.is_complex():
            raise ValueError(f"{what}: expected integer token ids, got a {tokens.dtype} tensor")
        tokens = tokens.detach().cpu().numpy()
    if isinstance(tokens, np.ndarray):
        arr = tokens
        if arr.ndim != 1:
            raise ValueError(f"{what}: expected a 1-D sequence of token ids, got shape {arr.shape}")
        if arr.dtype.kind == "b" or arr.dtype.kind not in "iu":
            raise ValueError(f"{what}: expected integer token ids, got dtype {arr.dtype}")
        if arr.dtype.kind == "u" and arr.size and int(arr.max()) > _INT64_MAX:
            i = int(np.argmax(arr > _INT64_MAX))
            raise ValueError(f"{what}[{i}] = {int(arr[i])}: token ids must be < 2**63")
        if arr.dtype != np.uint32:
            arr = arr.astype(np.int64, copy=False)
    elif isinstance(tokens, (list, tuple, range)):
        # array.array converts in C and, unlike np.fromiter, refuses floats and strings.
        # Token ids almost always fit in uint32, whose conversion is ~2.5x faster than int64's.
        try:
            arr = np.frombuffer(array.array("I", tokens), dtype=np.uint32)
        except (TypeError, OverflowError):
            arr = _int64_tokens(tokens, what)
        if not isinstance(tokens, range):
            _refuse_bools(tokens, arr, what)
    else:
        raise ValueError(f"{what}: expected a list, tuple, numpy array or torch tensor of token ids, "
                         f"got {type(tokens).__name__}")
    if arr.dtype.kind == "i" and arr.size and int(arr.min()) < 0:
        i = int(np.argmax(arr < 0))
        raise ValueError(f"{what}[{i}] = {int(arr[i])}: token ids must be non-negative")
    return arr


def _refuse_bools(tokens: Sequence[Any], arr: np.ndarray, what: str) -> None:
    """array.array takes ``True`` / ``False`` as 1 / 0; a bool is a caller's bug, not a token id (numpy
    bool arrays are refused too).  Only positions holding 0 or 1 can be bools, so the Python-level look
    is limited to those (a few special tokens in a real prompt)."""
    for i in np.flatnonzero(arr <= 1).tolist():
        t = tokens[i]
        if isinstance(t, bool):
            raise ValueError(f"{what}[{i}] = {t!r}: token ids must be integers, got bool")


def _int64_tokens(tokens: Sequence[Any], what: str) -> np.ndarray:
    """Slow path of ``as_token_array`` for sequences that do not fit uint32: convert or name the culprit."""
    try:
        return np.frombuffer(array.array("q", tokens), dtype=np.int64)
    except (TypeError, OverflowError):
        for i, t in enumerate(tokens):
            if isinstance(t, bool) or not isinstance(t, (int, np.integer)):
                raise ValueError(f"{what}[{i}] = {t!r}: token ids must be integers, "
                                 f"got {type(t).__name__}") from None
            if not 0 <= int(t) <= _INT64_MAX:
                raise ValueError(f"{what}[{i}] = {t}: token ids must be in [0, 2**63)") from None
        raise


def validate_mm_items(items: Sequence[Any], num_tokens: int | None) -> tuple[MMItem, ...]:
    """Normalise and check multimodal items: sorted by offset, non-overlapping, inside the tokens."""
    if isinstance(items, str | bytes | dict):  # iterable, but not a list of items
        raise ValueError(f"mm: expected a list of {{identifier, offset, length}} items, got {items!r}")
    out: list[MMItem] = []
    for i, it in enumerate(items or ()):
        if isinstance(it, MMItem):
            item = it
        elif isinstance(it, dict):
            missing = {"identifier", "offset", "length"} - set(it)
            if missing:
                raise ValueError(f"mm[{i}]: missing field(s) {sorted(missing)}")
            unknown = set(it) - {"identifier", "offset", "length"}
            if unknown:
                raise ValueError(f"mm[{i}]: unknown field(s) {sorted(unknown)}; "
                                 "allowed: identifier, offset, length")
            item = MMItem(it["identifier"], it["offset"], it["length"])
        elif isinstance(it, (tuple, list)) and len(it) == 3:
            item = MMItem(*it)
        else:
            raise ValueError(f"mm[{i}]: expected {{identifier, offset, length}}, got {it!r}")
        if not isinstance(item.identifier, str) or not item.identifier:
            raise ValueError(f"mm[{i}].identifier: expected a non-empty string, got {item.identifier!r}")
        for field in ("offset", "length"):
            v = getattr(item, field)
            if isinstance(v, bool) or not isinstance(v, (int, np.integer)):
                raise ValueError(f"mm[{i}].{field}: expected an integer, got {v!r}")
        if item.offset < 0:
            raise ValueError(f"mm[{i}].offset = {item.offset}: must be >= 0")
        if item.length < 1:
            raise ValueError(f"mm[{i}].length = {item.length}: must be >= 1")
        if num_tokens is not None and item.offset + item.length > num_tokens:
            raise ValueError(f"mm[{i}] ({item.identifier!r}) covers tokens [{item.offset}, "
                             f"{item.offset + item.length}) but the sequence has {num_tokens} tokens")
        if out:
            prev = out[-1]
            if item.offset < prev.offset:
                raise ValueError(f"mm[{i}].offset = {item.offset}: items must be sorted by offset "
                                 f"(mm[{i - 1}].offset = {prev.offset})")
            if item.offset < prev.offset + prev.length:
                raise ValueError(f"mm[{i}] starts at token {item.offset}, inside mm[{i - 1}] "
                                 f"[{prev.offset}, {prev.offset + prev.length}): items must not overlap")
        out.append(MMItem(item.identifier, int(item.offset), int(item.length)))
    return tuple(out)


# --------------------------------------------------------------------------- canonical CBOR frames


def _cbor_uint_head(major: int, n: int) -> bytes:
    """Head of a CBOR item with major type ``major`` and argument ``n`` (shortest form, as canonical)."""
    m = major << 5
    if n < 24:
        return bytes([m | n])
    if n < 1 << 8:
        return bytes([m | 24, n])
    if n < 1 << 16:
        return bytes([m | 25]) + n.to_bytes(2, "big")
    if n < 1 << 32:
        return bytes([m | 26]) + n.to_bytes(4, "big")
    return bytes([m | 27]) + n.to_bytes(8, "big")


_PAD = 4  # scratch bytes in front of the buffer for the first token's don't-care writes


def sha256_cbor_frames(arr: np.ndarray, block_size: int, suffixes: list[bytes] | None,
                       ) -> tuple[np.ndarray, list[int], list[int]]:
    """Lay out ``cbor2.dumps((parent, tuple(block), extra), canonical=True)`` for every full block,
    back to back in one buffer, with the 32 parent bytes left for the caller to fill in chain order.

    Returns (buffer, frame starts, frame ends).  Token ids must be < 2**32.

    Each token is written as its canonical CBOR uint (1, 2, 3 or 5 bytes) by five vectorised scatters,
    one per byte counted from the token's end, from the fifth-last to the last.  A short token's
    "fifth-last" byte lands in an earlier token's bytes; that earlier token's own, later scatter
    overwrites it, so the result is exact without any per-token branching or compaction pass.
    """
    B = block_size
    n = arr.size
    nb = n // B
    v = arr.astype(np.uint32)
    be = v.byteswap().view(np.uint8).reshape(n, 4)  # big-endian bytes, most significant first
    ge24, ge256, ge64k = v >= 24, v >= 256, v >= 65536
    width = 1 + ge24.view(np.int8) + ge256.view(np.int8) + 2 * ge64k.view(np.int8)
    pre = 35 + len(_cbor_uint_head(4, B))  # 0x83, 0x58 0x20, parent(32), array head
    suf_len = np.ones(nb, dtype=np.int64) if suffixes is None else np.array([len(x) for x in suffixes])
    # int64 offsets (huge prompts exceed 2**31); widening first is 2x faster than cumsum(dtype=int64).
    end = np.cumsum(width.astype(np.int64))
    tok_bytes = end[B - 1 :: B].copy()
    tok_bytes[1:] -= end[B - 1 : -B : B]
    # Shift each block's tokens past the frames before it and its own prefix.
    frame_shift = np.zeros(nb, dtype=np.int64)
    np.cumsum(pre + suf_len[:-1], out=frame_shift[1:])
    end += np.repeat(frame_shift + pre + _PAD, B)
    frame_end = end[B - 1 :: B] + suf_len
    frame_start = frame_end - (tok_bytes + pre + suf_len)
    out = np.empty(int(frame_end[-1]), dtype=np.uint8)
    last = end - 1
    out[last - 4] = 0x1A
    out[last - 3] = be[:, 0]
    out[last - 2] = be[:, 1] | (ge256 & ~ge64k).view(np.uint8) * np.uint8(0x19)
    out[last - 1] = be[:, 2] | (ge24 & ~ge256).view(np.uint8) * np.uint8(0x18)
    out[last] = be[:, 3]
    head = np.frombuffer(b"\x83\x58\x20" + bytes(32) + _cbor_uint_head(4, B), dtype=np.uint8)
    for j in (*range(3), *range(35, pre)):  # the parent bytes (3..35) are the caller's
        out[frame_start + j] = head[j]
    if suffixes is None:
        out[frame_end - 1] = 0xF6
    else:
        tok_end = (frame_end - suf_len).tolist()
        for i, sfx in enumerate(suffixes):
            out[tok_end[i] : tok_end[i] + len(sfx)] = np.frombuffer(sfx, dtype=np.uint8)
    return out, frame_start.tolist(), frame_end.tolist()


# --------------------------------------------------------------------------- the hasher


def known_algo(algo: object) -> bool:
    """Whether ``algo`` names a block-key algorithm (``ALGORITHMS`` or ``sglang_sha256``)."""
    return algo in ALGORITHMS or algo == SGLANG_SHA256


def _algo_problem(what: str, algo: object) -> str:
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


def sha256_cbor(obj: Any) -> bytes:
    """vLLM's ``sha256_cbor``: the reference construction, used for NONE and for checking."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()


class BlockHasher:
    """Chained block hashing with one algorithm, block size and seed.

    Invariant: the hash of block ``i`` depends only on (algo, seed, block_size, tokens[:(i+1)*B],
    the extra keys of blocks 0..i); never on the process, host, or how the sequence was split into calls.
    """

    def __init__(self, block_size: int, algo: str = "sha256_cbor", seed: str | int | None = None):
        if isinstance(block_size, bool) or not isinstance(block_size, int) or block_size < 1:
            raise ValueError(f"block_size: expected an integer >= 1, got {block_size!r}")
        if not known_algo(algo):
            raise ValueError(_algo_problem("algo", algo))
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


# --------------------------------------------------------------------------- namespaces

# 2: the payload of vLLM's CPU build became the canonical one.  Version 1 values written by vLLM CPU held
# its kernel's own arrangement of K (dim-major, or VNNI-packed with V on AMX) where the payload is
# token-major; nothing in them says so, so every version 1 namespace is left behind (a miss, never
# permuted KV), GPU and SGLang deployments' included.
BLOCK_FORMAT_VERSION = 2

#: ``Namespace.payload`` of values laid out as the canonical block payload (see kvtier.layout).
CANONICAL_PAYLOAD = "canonical"
#: Engine layouts (kvtier.layout kinds) that keep a block in an arrangement of their own, not the canonical
#: payload's: a value can hold either (``Namespace.payload``).  Every other kind's block is the payload.
HEAD_MAJOR_KINDS = ("cpu_attn", "cpu_attn_amx")


@dataclass(frozen=True)
class Namespace:
    """Everything that makes two deployments' block bytes interchangeable.

    Invariant: two namespaces share a digest iff every field is equal, so blocks of a bf16 and an fp8
    deployment (or of TP rank 0 and 1, or of two hash seeds) can never be confused.  The digest is a
    pure function of the fields (canonical CBOR of the manifest -> sha256), stable across processes,
    hosts and kvtier versions; changing how it is computed means bumping ``BLOCK_FORMAT_VERSION``.
    """

    model: str
    kv_dtype: str
    num_layers: int
    num_kv_heads: int
    head_dim: int
    block_size: int
    attention: str = "mha"  # "mha" (K and V) or "mla" (one latent vector per token)
    tp_rank: int = 0
    tp_size: int = 1
    pp_rank: int = 0
    pp_size: int = 1
    hash_algo: str = "sha256_cbor"
    hash_seed: str | int | None = None
    format_version: int = BLOCK_FORMAT_VERSION
    # Engine blocks per stored value (``storage.block_tokens / block_size``).  Values of different group
    # sizes must never be confused, so it is part of the digest, but only when > 1: the namespaces (and
    # so every key) of deployments that store one block per value are unchanged.
    storage_blocks: int = 1
    # How a stored payload is arranged: "canonical" (token, head, dim: any engine reads it), or the name
    # of an engine layout whose own arrangement the values keep as is (``storage.payload: engine`` on vLLM
    # CPU: "cpu_attn_amx", "cpu_attn"); only instances whose KV cache is arranged the same read them.
    # Part of the digest, but only when not canonical, for the reason ``storage_blocks`` gives.
    payload: str = CANONICAL_PAYLOAD

    def __post_init__(self) -> None:
        if self.attention not in ("mha", "mla"):
            raise ValueError(f"attention: expected 'mha' or 'mla', got {self.attention!r}")
        if not isinstance(self.payload, str) or not re.fullmatch(r"[a-z][a-z0-9_]*", self.payload):
            raise ValueError(f"payload: expected 'canonical' or an engine layout name, got {self.payload!r}")
        if not known_algo(self.hash_algo):
            raise ValueError(_algo_problem("hash_algo", self.hash_algo))
        for f in ("num_layers", "num_kv_heads", "head_dim", "block_size", "tp_size", "pp_size", "storage_blocks"):
            v = getattr(self, f)
            if isinstance(v, bool) or not isinstance(v, int) or v < 1:
                raise ValueError(f"{f}: expected an integer >= 1, got {v!r}")
        if not 0 <= self.tp_rank < self.tp_size:
            raise ValueError(f"tp_rank: expected 0 <= tp_rank < tp_size={self.tp_size}, got {self.tp_rank}")
        if not 0 <= self.pp_rank < self.pp_size:
            raise ValueError(f"pp_rank: expected 0 <= pp_rank < pp_size={self.pp_size}, got {self.pp_rank}")
        # Resolve the seed now (PYTHONHASHSEED / default) so the digest pins the seed actually used.
        object.__setattr__(self, "hash_seed", none_hash_seed(self.hash_algo, self.hash_seed))

    def manifest(self) -> dict[str, Any]:
        """The fields as a plain dict (JSON-able): what a tool shows for a namespace."""
        out = {f: getattr(self, f) for f in self.__dataclass_fields__}
        if out["storage_blocks"] == 1:
            del out["storage_blocks"]  # see the field: keys from before grouping existed stay the same
        if out["payload"] == CANONICAL_PAYLOAD:
            del out["payload"]  # likewise: canonical namespaces keep the keys they had
        return out

    @classmethod
    def from_manifest(cls, manifest: dict[str, Any]) -> Namespace:
        return cls(**manifest)

    # Computed once per (immutable) namespace: backend keys are built per block, and a cbor + sha256 of
    # the manifest per key was a measurable share of a simulated replay.
    @functools.cached_property
    def digest(self) -> bytes:
        """16 bytes; goes into every stored block's header."""
        return hashlib.sha256(cbor2.dumps(self.manifest(), canonical=True)).digest()[:16]

    @functools.cached_property
    def id(self) -> str:
        """The digest in hex: the prefix of every backend key."""
        return self.digest.hex()

    @functools.cached_property
    def layout_id(self) -> int:
        """A u32 naming dtype + layout, stored in the block header (a second check beside the digest)."""
        spec: tuple[str | int, ...] = (self.kv_dtype, self.num_layers, self.num_kv_heads, self.head_dim,
                                       self.block_size, self.attention)
        if self.payload != CANONICAL_PAYLOAD:
            spec += (self.payload,)
        return int.from_bytes(hashlib.sha256(cbor2.dumps(spec, canonical=True)).digest()[:4], "little")

    def hasher(self) -> BlockHasher:
        return BlockHasher(self.block_size, self.hash_algo, self.hash_seed)

    def key(self, block_hash: bytes) -> str:
        """The string a backend sees: ``<namespace id>/<block hash hex>``."""
        return f"{self.id}/{block_hash.hex()}"

    def keys(self, block_hashes: Sequence[bytes]) -> list[str]:
        prefix = self.id + "/"
        return [prefix + h.hex() for h in block_hashes]


# --------------------------------------------------------------------------- stored keys

MANIFEST_NAME = "manifest.json"
KEY_FORMAT = "'<32 hex namespace>/<32 or 64 hex hash>' (lower-case hex, nothing else)"
_KEY = re.compile(r"[0-9a-f]{32}/(?:[0-9a-f]{32}|[0-9a-f]{64})")
_MANIFEST_KEY = re.compile(r"[0-9a-f]{32}/manifest\.json")
_HEX = b"0123456789abcdef"
_CHAR_32 = operator.itemgetter(32)


def show_key(key: object) -> str:
    """``repr(key)``, cut short when long (a garbage key may be megabytes; an error message must not be)."""
    r = repr(key)
    return r if len(r) <= 512 else f"{r[:400]}...{r[-40:]} ({len(r)} characters)"


def key_problem(key: object, *, manifest: bool = False) -> str | None:
    """Why ``key`` is not a canonical stored key (``manifest``: or ``<namespace>/manifest.json``); None if it
    is.  The definition of a valid key; ``invalid_key`` is its fast form for batches."""
    if isinstance(key, str) and (_KEY.fullmatch(key) or (manifest and _MANIFEST_KEY.fullmatch(key))):
        return None
    expected = f"expected {KEY_FORMAT}" + (f" or '<namespace>/{MANIFEST_NAME}'" if manifest else "")
    if not isinstance(key, str):
        return f"{expected}, got a {type(key).__name__}"
    if not key:
        return f"{expected}, got an empty string"
    for bad, what in (("\x00", "a NUL byte"), ("\\", "a backslash"), ("..", "'..'")):
        if bad in key:
            return f"{expected}; it contains {what}"
    if key != key.strip():
        return f"{expected}; it has leading or trailing whitespace"
    if key.startswith("/"):
        return f"{expected}; it is an absolute path"
    if key.count("/") != 1:
        return f"{expected}; it has {key.count('/')} '/' separators"
    if _KEY.fullmatch(key.lower()):
        return f"{expected}; it has upper-case hex (never folded: two spellings would be two blocks)"
    return expected


def invalid_key(keys: Sequence[object], *, manifest: bool = False) -> tuple[int, str] | None:
    """The first key of ``keys`` that is not canonical, as (index, why); None when all are.  Every place
    that accepts a stored key (``split_key``, every public ``StorageBackend`` method, the disk backend's
    paths) asks this."""
    if not keys:
        return None
    strs = cast("Sequence[str]", keys)  # if the join below succeeds they are
    try:
        joined: str | None = "".join(strs)
    except TypeError:  # not all str
        joined = None
    # Fast path, C-level passes over the whole batch (~100 ns a key; a regex per key costs ~500 ns, on
    # every lookup of a long chain).  It accepts exactly what _KEY does: only [0-9a-f/], one '/' per key,
    # at index 32 of a key of 65 or 97 characters.
    if (joined is not None and joined.isascii()
            and joined.encode().translate(None, _HEX) == b"/" * len(keys)
            and set(map(len, strs)) <= {65, 97} and set(map(_CHAR_32, strs)) == {"/"}):
        return None
    for i, key in enumerate(keys):
        why = key_problem(key, manifest=manifest)
        if why is not None:
            return i, why
    return None


def split_key(key: str) -> tuple[bytes, bytes]:
    """``"<ns hex>/<hash hex>"`` -> (namespace digest, block hash); ValueError naming the key otherwise."""
    bad = invalid_key([key])
    if bad is not None:
        raise ValueError(f"block key {show_key(key)}: {bad[1]}")
    return bytes.fromhex(key[:32]), bytes.fromhex(key[33:])
