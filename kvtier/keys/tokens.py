"""What a block is made of: token ids and its extra keys (multimodal items, LoRA), checked as they come in:
every error names the token index or item that is wrong."""

from __future__ import annotations

import array
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, TypeAlias

import numpy as np

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
