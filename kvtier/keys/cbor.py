"""Canonical CBOR, emitted by hand: vLLM's ``sha256_cbor`` block hash of many blocks at once, byte-identical to
``cbor2.dumps(x, canonical=True)`` (``sha256_cbor`` here is that reference construction)."""

from __future__ import annotations

import hashlib
from typing import Any

import cbor2
import numpy as np

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


def sha256_cbor(obj: Any) -> bytes:
    """vLLM's ``sha256_cbor``: the reference construction, used for NONE and for checking."""
    return hashlib.sha256(cbor2.dumps(obj, canonical=True)).digest()
