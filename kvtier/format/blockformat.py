"""The stored block: one self-describing value per block, format version 1.

    offset size  field
    0      4     magic  b"KVTB"
    4      2     format version (1)
    6      2     header length (88)
    8      8     payload length in bytes
    16     16    namespace digest (kvtier.keys.Namespace.digest)
    32     1     block hash length (16 or 32)
    33     32    block hash, zero padded
    65     3     reserved, zero
    68     4     layout id (kvtier.keys.Namespace.layout_id)
    72     8     xxh3-64 of the payload
    80     8     xxh3-64 of bytes 0..80 of this header
    88     ...   payload: the block's K and V for all layers, contiguous

All integers little-endian.  A reader knows what it asked for (namespace, key, layout, length), so every
field is checked against an expectation; the header checksum also covers the reserved bytes.  This layout
is frozen: a change is a new version number, and readers keep accepting the versions they know.

Aligned values (still version 1): the header length field may say 4096 (``ALIGNED_HEADER_SIZE``) instead
of 88.  Then bytes 88..4096 are zero and the payload starts at offset 4096, so a reader can take it with
``O_DIRECT`` straight into page-aligned memory (``local_disk`` writes payloads of whole pages so).  Bytes
0..88 are the same fields as above, the header checksum covers the length field as before, and the
padding must be zero (a reader checks it: nothing unchecked rides along).  No new version number: no
reader of the 88-byte values misreads one — kvtier's readers before this checked the length field and
refused 4096 as a wrong value (a miss), and only the two lengths 88 and 4096 are accepted now.

Format version 2: a sealed block (``kvtier.security``: modes ``authenticate`` and ``encrypt``), 112 bytes
of header.  Written and read only by a backend whose security mode is not ``none``; version 1 stays the
format of mode ``none`` (what every kvtier before it wrote and reads).

    offset size  field
    0      4     magic  b"KVTB"
    4      2     format version (2)
    6      2     header length (112)
    8      8     payload length in bytes
    16     16    namespace digest
    32     1     block hash length (16 or 32)
    33     32    block hash, zero padded
    65     1     mode: 1 authenticate (payload in clear), 2 encrypt (payload is AES-256-GCM ciphertext)
    66     2     key id (``security.keys[].id`` of the deployment key the value was sealed with)
    68     4     layout id (the same offset as version 1: tools read it without a key)
    72     12    nonce, random per value
    84     4     reserved, zero
    88     16    AES-GCM tag over bytes 0..88 and the payload (see kvtier.security for the construction)
    104    8     xxh3-64 of bytes 0..104: damage to the header is told apart from a forgery without a key
    112    ...   payload

There is no payload checksum: the tag covers every payload byte, and a keyless xxh3 would only say what
anyone who can write the store can recompute.
"""

from __future__ import annotations

import struct
from collections.abc import Callable, Sequence
from typing import TYPE_CHECKING

import xxhash

if TYPE_CHECKING:
    from typing_extensions import Buffer  # collections.abc.Buffer from Python 3.12 on

MAGIC = b"KVTB"
FORMAT_VERSION = 1
_HEADER = struct.Struct("<4sHHQ16sB32s3xIQ")
_HCHECK = struct.Struct("<Q")
HEADER_SIZE = _HEADER.size + _HCHECK.size
assert HEADER_SIZE == 88
ALIGNED_HEADER_SIZE = 4096  # an aligned value's header length: 88 bytes of fields, zeros to the page end
_PADDING = bytes(ALIGNED_HEADER_SIZE - HEADER_SIZE)
HEADER_SIZES = (HEADER_SIZE, ALIGNED_HEADER_SIZE)  # the lengths a version 1 header may have


# ---- format version 2 (sealed values); the fields are described in the module docstring
FORMAT_VERSION_SEALED = 2
_HEADER2 = struct.Struct("<4sHHQ16sB32sBHI12s4x")
SEALED_AAD_SIZE = _HEADER2.size  # bytes 0..88: what the tag covers besides the payload
assert SEALED_AAD_SIZE == 88
TAG_SIZE = 16
SEALED_HEADER_SIZE = SEALED_AAD_SIZE + TAG_SIZE + _HCHECK.size
assert SEALED_HEADER_SIZE == 112
MODE_AUTHENTICATE = 1
MODE_ENCRYPT = 2


def stored_version(header: Buffer) -> int | None:
    """The format version a stored value's header says it has (None: too short, or no magic)."""
    mv = memoryview(header).cast("B")
    if mv.nbytes < 6 or bytes(mv[:4]) != MAGIC:
        return None
    return int.from_bytes(mv[4:6], "little")


def header_size(version: int) -> int:
    return SEALED_HEADER_SIZE if version == FORMAT_VERSION_SEALED else HEADER_SIZE


def encode_sealed_aad(namespace_digest: bytes, block_hash: bytes, layout_id: int, payload_len: int, mode: int,
                      key_id: int, nonce: bytes) -> bytes:
    """Bytes 0..88 of a version 2 header: what the tag covers besides the payload."""
    return _HEADER2.pack(MAGIC, FORMAT_VERSION_SEALED, SEALED_HEADER_SIZE, payload_len, namespace_digest,
                         len(block_hash), block_hash, mode, key_id, layout_id, nonce)


def finish_sealed_header(aad: bytes, tag: Buffer) -> bytes:
    """The whole 112-byte version 2 header: ``aad``, the tag, the header checksum."""
    head = aad + bytes(tag)
    return head + _HCHECK.pack(xxhash.xxh3_64_intdigest(head))


def parse_sealed_header(header: Buffer, namespace_digest: bytes, block_hash: bytes, layout_id: int,
                        payload_len: int) -> tuple[str, str | tuple[int, int, bytes, bytes]]:
    """Check a version 2 header against what was asked for.  Returns ("damaged", why) when the header
    checksum or length fails (damage: no writer would leave it so), ("wrong", why) when an intact header
    describes another block (what a copy under another key or an old value looks like), else
    ("ok", (mode, key id, nonce, tag)): the tag is still to be checked."""
    header = bytes(header)
    if len(header) != SEALED_HEADER_SIZE:
        return "damaged", f"header is {len(header)} bytes, expected {SEALED_HEADER_SIZE}"
    if _HCHECK.unpack_from(header, SEALED_AAD_SIZE + TAG_SIZE)[0] != \
            xxhash.xxh3_64_intdigest(header[: SEALED_AAD_SIZE + TAG_SIZE]):
        return "damaged", "header checksum mismatch"
    magic, version, hlen, plen, ns, klen, key, mode, key_id, layout, nonce = _HEADER2.unpack_from(header)
    if magic != MAGIC or version != FORMAT_VERSION_SEALED:
        return "damaged", f"not a version {FORMAT_VERSION_SEALED} header"
    if hlen != SEALED_HEADER_SIZE:
        return "damaged", f"header length {hlen}, expected {SEALED_HEADER_SIZE}"
    if header[84:88] != bytes(4):
        return "wrong", "reserved bytes are not zero"
    if plen != payload_len:
        return "wrong", f"payload length {plen}, expected {payload_len}"
    if ns != namespace_digest:
        return "wrong", f"namespace {ns.hex()}, expected {namespace_digest.hex()}"
    if klen != len(block_hash) or key[:klen] != block_hash:
        return "wrong", f"block hash {key[:klen].hex()}, expected {block_hash.hex()}"
    if layout != layout_id:
        return "wrong", f"layout id {layout:#x}, expected {layout_id:#x}"
    return "ok", (mode, key_id, nonce, header[SEALED_AAD_SIZE: SEALED_AAD_SIZE + TAG_SIZE])


def payload_checksum(payload: Buffer) -> int:
    return xxhash.xxh3_64_intdigest(payload)


def encode_header(namespace_digest: bytes, block_hash: bytes, layout_id: int, payload: Buffer | Segments,
                  aligned: bool = False) -> bytes:
    """The 88-byte header for ``payload`` (any buffer, or :class:`Segments`: one payload in several buffers;
    it is only hashed, never copied), or with ``aligned`` the 4096-byte one (header length 4096, zeros
    after byte 88: the payload starts on a page)."""
    if isinstance(payload, Segments):
        nbytes, checksum = payload.nbytes, payload.checksum()
    else:
        mv = memoryview(payload).cast("B")
        nbytes, checksum = mv.nbytes, payload_checksum(mv)
    hlen = ALIGNED_HEADER_SIZE if aligned else HEADER_SIZE
    head = _HEADER.pack(MAGIC, FORMAT_VERSION, hlen, nbytes, namespace_digest,
                        len(block_hash), block_hash, layout_id, checksum)
    head += _HCHECK.pack(xxhash.xxh3_64_intdigest(head))
    return head + _PADDING if aligned else head


def stated_header_size(header: Buffer) -> int | None:
    """The header length a version 1 header's first 88 bytes state (88 or 4096), or None when they are no
    version 1 header with one of those lengths (what it is exactly, ``check_header`` says).  A reader of
    raw values uses it to find where the payload starts; the value is still checked in full."""
    mv = memoryview(header).cast("B")
    if mv.nbytes < HEADER_SIZE or bytes(mv[:4]) != MAGIC or int.from_bytes(mv[4:6], "little") != FORMAT_VERSION:
        return None
    n = int.from_bytes(mv[6:8], "little")
    return n if n in HEADER_SIZES else None


def check_header(header: Buffer, namespace_digest: bytes, block_hash: bytes, layout_id: int,
                 payload_len: int) -> str | None:
    """Why ``header`` (the whole stored header: 88 bytes, or 4096 for an aligned value) does not describe
    the expected block, or None if it does (payload not checked)."""
    header = bytes(header)
    if len(header) not in HEADER_SIZES:
        return f"header is {len(header)} bytes, expected {HEADER_SIZE}"  # (or 4096: an aligned value's)
    magic, version, hlen, plen, ns, klen, key, layout, _ = _HEADER.unpack_from(header)
    if magic != MAGIC:
        return f"bad magic {magic!r}"
    if version != FORMAT_VERSION:
        return f"unsupported format version {version} (this kvtier reads {FORMAT_VERSION})"
    if _HCHECK.unpack_from(header, _HEADER.size)[0] != xxhash.xxh3_64_intdigest(header[: _HEADER.size]):
        return "header checksum mismatch"
    if hlen != len(header):
        return f"header length {hlen}, expected {len(header)}"
    if header[HEADER_SIZE:] != _PADDING[: len(header) - HEADER_SIZE]:
        return "padding after the header's fields is not zero"
    if plen != payload_len:
        return f"payload length {plen}, expected {payload_len}"
    if ns != namespace_digest:
        return f"namespace {ns.hex()}, expected {namespace_digest.hex()}"
    if klen != len(block_hash) or key[:klen] != block_hash:
        return f"block hash {key[:klen].hex()}, expected {block_hash.hex()}"
    if layout != layout_id:
        return f"layout id {layout:#x}, expected {layout_id:#x}"
    return None


def stored_checksum(header: Buffer) -> int:
    return int(_HEADER.unpack_from(bytes(header))[8])


class Segments:
    """One payload that lies in several buffers, in order (``parts``: byte memoryviews).  Read: a block
    read straight into an engine's KV tensors, whose layers are apart in memory (the parts writable).
    Written: a value of several engine blocks (``kvtier.format.groups``) put from the host slots that
    hold them, which need not be adjacent.  Only a backend that says it reads (``reads_segments``) or
    writes (``writes_segments``) them is ever handed one in place of a buffer (``StorageBackend``).
    The stored value is the same either way: the header, then the parts' bytes back to back."""

    __slots__ = ("nbytes", "parts")

    def __init__(self, parts: list[memoryview]):
        self.parts = [p if p.format == "B" and p.ndim == 1 else p.cast("B") for p in parts]
        self.nbytes = sum(p.nbytes for p in self.parts)

    def head(self, n: int) -> list[memoryview]:
        """The parts that hold the payload's first ``n`` bytes, the last one cut to fit."""
        out = []
        for p in self.parts:
            if n <= 0:
                break
            out.append(p[:n])
            n -= out[-1].nbytes
        return out

    def tail(self, offset: int) -> list[memoryview]:
        """The parts from byte ``offset`` of the payload on (what a short read still has to fill)."""
        out = []
        for p in self.parts:
            if offset >= p.nbytes:
                offset -= p.nbytes
                continue
            out.append(p[offset:])
            offset = 0
        return out

    def checksum(self) -> int:
        """xxh3-64 of the parts' bytes back to back: the payload's checksum."""
        if len(self.parts) == 1:
            return xxhash.xxh3_64_intdigest(self.parts[0])
        h = xxhash.xxh3_64()
        for p in self.parts:
            h.update(p)
        return h.intdigest()

    def joined(self) -> memoryview:
        """The parts' bytes as one buffer: the only part itself, else one copy of them all back to back
        (for a writer that needs one buffer: ``StorageBackend.put`` for a backend that does not write
        segments)."""
        if len(self.parts) == 1:
            return self.parts[0]
        out = bytearray(self.nbytes)
        view, at = memoryview(out), 0
        for p in self.parts:
            view[at:at + p.nbytes] = p
            at += p.nbytes
        return view


# A reader that hashes as it reads (read_hashed) reads this many payload bytes at a time into segments:
# small enough that the bytes one read brought in are still in the core's L2 cache when they are hashed.
# Measured on 4 MiB values from the page cache into vLLM CPU's KV (2 cores): one read of the whole value,
# then its hash (from L3 / memory): 86 ms per 512 MiB; 512 KiB at a time: 76 ms; 1 MiB: 82 ms.  Into one
# buffer (a host slot, copied to the device right after), one read was faster on the same machine (178-194
# vs 208-236 ms a 512 MiB prefix: a syscall per group costs more there than the cache misses it saves).
HASH_GROUP_BYTES = 512 << 10


def read_hashed(read: Callable[[list[memoryview], int], int], header: memoryview,
                payload: memoryview | Segments, tail: Sequence[memoryview] = (),
                group_bytes: int = HASH_GROUP_BYTES, hashed: bool = True) -> tuple[int, int | None]:
    """Fill ``header`` then ``payload`` from offset 0 through ``read(buffers, offset) -> bytes read`` (a
    ``preadv`` on an open file, say), ``group_bytes`` of payload at a time, taking the payload's
    xxh3-64 as each group lands.  ``tail``: buffers read after the payload in the last call (a probe
    byte that tells a longer value).  Returns (bytes read, the payload's checksum); the checksum is None
    when a read came back short (the caller goes on from there and the checksum is taken afterwards).
    The checksum is of the bytes in the buffers once read, as :func:`check_block` would take it, in
    the same pass as the read instead of a second one over memory.  ``hashed`` False: no checksum is
    taken (always None), for a sealed value, whose tag covers the payload (a keyless xxh3 adds nothing)."""
    if not isinstance(payload, Segments) and payload.nbytes <= group_bytes:
        # One buffer that fits one group (every value local_disk reads into a caller's or a landing
        # buffer): the same single read and result as the general path below, without building its
        # groups (about 2 us a value under the GIL: read_file's own work beside open / fstat / preadv /
        # close went from 2.9-4.2 to 1.2-1.4 us at 256 KiB).
        flat = payload if payload.format == "B" and payload.ndim == 1 else payload.cast("B")
        n = read([header, flat, *tail], 0)
        if n < header.nbytes + flat.nbytes:
            return n, None
        return n, xxhash.xxh3_64_intdigest(flat) if hashed else None
    parts = payload.parts if isinstance(payload, Segments) else [
        payload if payload.format == "B" and payload.ndim == 1 else payload.cast("B")]
    groups: list[list[memoryview]] = [[]]
    size = 0
    group_bytes = max(1, group_bytes)
    for p in parts:
        for a in range(0, p.nbytes, group_bytes):
            piece = p[a:a + group_bytes]
            if size and size + piece.nbytes > group_bytes:
                groups.append([])
                size = 0
            groups[-1].append(piece)
            size += piece.nbytes
    h = xxhash.xxh3_64() if hashed else None
    done = 0
    last = len(groups) - 1
    for i, group in enumerate(groups):
        head = [header] if i == 0 else []
        want = sum(b.nbytes for b in head + group)  # the tail's bytes may not be there: not wanted
        n = read(head + group + (list(tail) if i == last else []), done)
        done += n
        if n < want:
            return done, None
        if h is not None:
            for b in group:
                h.update(b)
    return done, None if h is None else h.intdigest()


def check_block(header: Buffer, payload: Buffer | Segments, namespace_digest: bytes, block_hash: bytes,
                layout_id: int, checksum: int | None = None) -> str | None:
    """Why (header, payload) is not the expected block, or None if every field and the checksum hold.

    One pass over the payload (its xxh3-64, computed once, also on the failure path); ``checksum``: that
    xxh3-64 when the reader took it as the bytes landed (:func:`read_hashed`).  The header is compared
    as one string against the exact header this block must have (88 bytes, or 4096 for an aligned
    value: the fields, then zeros)."""
    if isinstance(payload, Segments):
        nbytes = payload.nbytes
        if checksum is None:
            checksum = payload.checksum()
    else:
        mv = payload if isinstance(payload, memoryview) and payload.format == "B" else memoryview(payload).cast("B")
        nbytes = mv.nbytes
        if checksum is None:
            checksum = xxhash.xxh3_64_intdigest(mv)
    # Fast path (the common, intact case): the exact header this block must have, compared as bytes.
    # Only a mismatch pays for check_header's field-by-field walk, which names the reason.
    hmv = memoryview(header).cast("B")
    hlen = hmv.nbytes
    if hlen in HEADER_SIZES:
        head = _HEADER.pack(MAGIC, FORMAT_VERSION, hlen, nbytes, namespace_digest, len(block_hash),
                            block_hash, layout_id, checksum)
        # As bytes: a memoryview compares byte by byte through its format (20 us for the padding).
        if hmv[:HEADER_SIZE].tobytes() == head + _HCHECK.pack(xxhash.xxh3_64_intdigest(head)) and (
                hlen == HEADER_SIZE or hmv[HEADER_SIZE:].tobytes() == _PADDING):
            return None
    why = check_header(header, namespace_digest, block_hash, layout_id, nbytes)
    if why is None and stored_checksum(header) != checksum:
        why = "payload checksum mismatch"
    return why
