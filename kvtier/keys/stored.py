"""Stored keys: ``<namespace>/<hash>`` as backends see them, and the one check every backend hook relies on
(canonical lower-case hex, nothing that could name a path)."""

from __future__ import annotations

import operator
import re
from collections.abc import Sequence
from typing import cast

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
    # One key: ``key_problem``'s own definition (``_KEY``) answers in a regex call, where ``invalid_key``'s
    # batch form costs three times that (it runs per value on a sealed read's path); the error path asks it.
    if isinstance(key, str) and _KEY.fullmatch(key):
        return bytes.fromhex(key[:32]), bytes.fromhex(key[33:])
    bad = invalid_key([key])
    if bad is not None:
        raise ValueError(f"block key {show_key(key)}: {bad[1]}")
    return bytes.fromhex(key[:32]), bytes.fromhex(key[33:])
