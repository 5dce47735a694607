"""The stored block format v1: layout, and a precise reason for every way a header can be wrong."""

import os
import struct

import pytest
import xxhash

from kvtier.format import blockformat as bf
from kvtier.keys import Namespace

NS = Namespace("m", "bfloat16", 32, 8, 128, 16)
OTHER = Namespace("m", "float8_e4m3fn", 32, 8, 128, 16)
HASH = bytes(range(16))
PAYLOAD = os.urandom(1000)


def header(payload=PAYLOAD, ns=NS, h=HASH):
    return bf.encode_header(ns.digest, h, ns.layout_id, payload)


def forge(hdr: bytes, offset: int, new: bytes) -> bytes:
    """Change a field and recompute the header checksum, so the field's own check must catch it."""
    b = bytearray(hdr)
    b[offset : offset + len(new)] = new
    b[80:88] = struct.pack("<Q", xxhash.xxh3_64_intdigest(bytes(b[:80])))
    return bytes(b)


def check(hdr, payload=PAYLOAD, ns=NS, h=HASH):
    return bf.check_block(hdr, payload, ns.digest, h, ns.layout_id)


def test_layout_is_frozen():
    hdr = header()
    assert len(hdr) == bf.HEADER_SIZE == 88
    assert hdr[:4] == b"KVTB"
    assert struct.unpack_from("<HHQ", hdr, 4) == (1, 88, len(PAYLOAD))
    assert hdr[16:32] == NS.digest
    assert hdr[32] == 16 and hdr[33:49] == HASH and hdr[49:65] == bytes(16)
    assert hdr[65:68] == bytes(3)
    assert struct.unpack_from("<IQQ", hdr, 68) == (NS.layout_id, xxhash.xxh3_64_intdigest(PAYLOAD),
                                                   xxhash.xxh3_64_intdigest(hdr[:80]))


@pytest.mark.parametrize("h", [HASH, bytes(range(32))])
def test_round_trip_both_hash_lengths(h):
    assert check(header(h=h), h=h) is None
    assert bf.check_header(header(h=h), NS.digest, h, NS.layout_id, len(PAYLOAD)) is None


def test_accepts_any_buffer_type():
    hdr = header()
    assert check(memoryview(bytearray(hdr)), memoryview(bytearray(PAYLOAD))) is None
    assert check(bytearray(hdr), bytes(PAYLOAD)) is None


def test_a_payload_in_segments_checks_as_the_same_bytes_back_to_back():
    """A block read straight into an engine's KV tensors lies in several buffers (Segments): its checksum
    is the one of the bytes back to back, and a flipped byte in any part fails it."""
    cuts = [0, 1, 300, 301, 999, len(PAYLOAD)]
    parts = [bytearray(PAYLOAD[a:b]) for a, b in zip(cuts, cuts[1:])]
    seg = bf.Segments([memoryview(p) for p in parts])
    assert seg.nbytes == len(PAYLOAD) and seg.checksum() == xxhash.xxh3_64_intdigest(PAYLOAD)
    assert bf.check_block(header(), seg, NS.digest, HASH, NS.layout_id) is None
    assert b"".join(bytes(p) for p in seg.tail(300)) == PAYLOAD[300:]
    assert b"".join(bytes(p) for p in seg.tail(999)) == PAYLOAD[999:] and seg.tail(len(PAYLOAD)) == []
    parts[3][5] ^= 1
    assert bf.check_block(header(), seg, NS.digest, HASH, NS.layout_id) == "payload checksum mismatch"


class _Source:
    """A stored value served by ``read(buffers, offset)`` (preadv's contract), recording each call; ``cap``:
    at most that many bytes a call (a short read, as a network filesystem gives)."""

    calls: list[list[int]]

    def __init__(self, data: bytes, cap: int | None = None):
        self.data, self.cap, self.calls = data, cap, []

    def __call__(self, bufs, offset):
        n = 0
        for b in bufs:
            chunk = self.data[offset + n: offset + n + b.nbytes]
            if self.cap is not None:
                chunk = chunk[: max(0, self.cap - n)]
            b[: len(chunk)] = chunk
            n += len(chunk)
            if len(chunk) < b.nbytes:
                break
        self.calls.append([b.nbytes for b in bufs])
        return n


@pytest.mark.parametrize("segmented", [False, True])
def test_read_hashed_reads_in_groups_and_takes_the_checksum_of_what_landed(segmented):
    payload = os.urandom(3 * bf.HASH_GROUP_BYTES + 1000)
    hdr = header(payload)
    src = _Source(hdr + payload)
    head = memoryview(bytearray(bf.HEADER_SIZE))
    dest: bf.Segments | memoryview
    if segmented:  # parts of uneven sizes, one larger than a group
        cuts = [0, 1000, 1000 + 2 * bf.HASH_GROUP_BYTES + 7, len(payload)]
        bufs = [bytearray(b - a) for a, b in zip(cuts, cuts[1:])]
        dest = bf.Segments([memoryview(b) for b in bufs])
    else:
        buf = bytearray(len(payload))
        dest = memoryview(buf)
    probe = memoryview(bytearray(1))
    n, digest = bf.read_hashed(src, head, dest, (probe,))
    got = b"".join(bytes(b) for b in bufs) if segmented else bytes(buf)
    assert (n, digest, got, bytes(head)) == (len(hdr) + len(payload), xxhash.xxh3_64_intdigest(payload), payload, hdr)
    # the header rides with the first group, the probe with the last; no group's payload exceeds the bound
    assert src.calls[0][0] == bf.HEADER_SIZE and src.calls[-1][-1] == 1
    payload_per_call = [sum(c) - (bf.HEADER_SIZE if i == 0 else 0) - (1 if i == len(src.calls) - 1 else 0)
                        for i, c in enumerate(src.calls)]
    assert max(payload_per_call) <= bf.HASH_GROUP_BYTES and sum(payload_per_call) == len(payload)
    assert len(src.calls) >= 4
    assert bf.check_block(head, dest, NS.digest, HASH, NS.layout_id, digest) is None


def test_read_hashed_reports_a_longer_value_and_gives_no_checksum_for_a_short_read():
    payload = os.urandom(bf.HASH_GROUP_BYTES + 10)
    hdr = header(payload)
    head = memoryview(bytearray(bf.HEADER_SIZE))
    probe = memoryview(bytearray(1))
    n, digest = bf.read_hashed(_Source(hdr + payload + b"x"), head, memoryview(bytearray(len(payload))), (probe,))
    assert n == len(hdr) + len(payload) + 1 and digest == xxhash.xxh3_64_intdigest(payload)
    n, digest = bf.read_hashed(_Source(hdr + payload, cap=1000), head, memoryview(bytearray(len(payload))), (probe,))
    assert (n, digest) == (1000, None)


@pytest.mark.parametrize("hashed", [True, False])
@pytest.mark.parametrize("stored, cap", [("exact", None), ("longer", None), ("short", 1000)])
def test_read_hashed_one_buffer_in_one_group_reads_once_as_the_grouped_path_would(hashed, stored, cap):
    """A payload in one buffer no larger than a group (how local_disk reads a value) is read in one call
    with the header and the probe, and gives what the grouped path gives for it: the bytes, the count
    (a longer value's probe byte included, a short read's count), the checksum only when whole."""
    payload = os.urandom(256 << 10)
    hdr = header(payload)
    data = hdr + payload + (b"x" if stored == "longer" else b"")
    got = []
    for group in (len(hdr) + len(payload), len(payload) // 3):  # one group; several (the general path)
        src, head, buf, probe = _Source(data, cap), memoryview(bytearray(bf.HEADER_SIZE)), bytearray(len(payload)), \
            memoryview(bytearray(1))
        n, digest = bf.read_hashed(src, head, memoryview(buf), (probe,), group, hashed)
        got.append((n, digest, bytes(head), bytes(buf) if cap is None else None, len(src.calls)))
    one, grouped = got
    assert one[:4] == grouped[:4] and one[4] == 1 and (grouped[4] > 1 or stored == "short")  # short: stops at once
    whole = len(hdr) + len(payload)
    assert one[0] == {"exact": whole, "longer": whole + 1, "short": 1000}[stored]
    assert one[1] == (xxhash.xxh3_64_intdigest(payload) if hashed and cap is None else None)


def test_read_hashed_unhashed_fills_the_same_buffers_and_gives_no_checksum():
    """``hashed=False`` (a sealed value's read: its tag covers the payload) reads the same bytes in the same
    calls, and never claims a checksum."""
    payload = os.urandom(bf.HASH_GROUP_BYTES + 10)
    hdr = header(payload)
    head = memoryview(bytearray(bf.HEADER_SIZE))
    buf = bytearray(len(payload))
    n, digest = bf.read_hashed(_Source(hdr + payload), head, memoryview(buf), (), bf.HASH_GROUP_BYTES, hashed=False)
    assert (n, digest, bytes(buf), bytes(head)) == (len(hdr) + len(payload), None, payload, hdr)


def test_check_block_uses_the_checksum_the_reader_took():
    """The reader's checksum is what is compared: a wrong one fails an intact block (so a reader that took
    it from other bytes than those landed cannot pass a damaged one)."""
    good = xxhash.xxh3_64_intdigest(PAYLOAD)
    assert bf.check_block(header(), PAYLOAD, NS.digest, HASH, NS.layout_id, good) is None
    assert bf.check_block(header(), PAYLOAD, NS.digest, HASH, NS.layout_id, good ^ 1) == "payload checksum mismatch"


# Each field changed (with a valid header checksum, so the field check itself fires) -> its reason.
FORGED = [
    ("magic", 0, b"XXXX", "bad magic"),
    ("version", 4, struct.pack("<H", 2), "unsupported format version 2"),
    ("header length", 6, struct.pack("<H", 96), "header length 96, expected 88"),
    ("payload length", 8, struct.pack("<Q", 999), "payload length 999, expected 1000"),
    ("namespace", 16, OTHER.digest, f"namespace {OTHER.digest.hex()}, expected {NS.digest.hex()}"),
    ("hash length", 32, b"\x20", "block hash"),
    ("hash", 33, b"\xff", "block hash ff0102"),
    ("layout id", 68, struct.pack("<I", OTHER.layout_id), f"layout id {OTHER.layout_id:#x}"),
    ("payload checksum", 72, b"\x00" * 8, "payload checksum mismatch"),
]


@pytest.mark.parametrize("name,offset,new,reason", FORGED, ids=[f[0] for f in FORGED])
def test_each_forged_field_names_its_reason(name, offset, new, reason):
    why = check(forge(header(), offset, new))
    assert why is not None and reason in why, (name, why)


@pytest.mark.parametrize("offset", [*range(0, 4), 4, 6, 8, 16, 31, 32, 33, 64, 65, 67, 68, 72, 80, 87])
def test_any_flipped_header_byte_is_refused(offset):
    b = bytearray(header())
    b[offset] ^= 0x01
    why = check(bytes(b))
    assert why is not None
    # The magic and version are read before the checksum; everything after is caught by it.
    if offset >= 6:
        assert why == "header checksum mismatch"


def test_reserved_bytes_are_covered_by_the_header_checksum():
    b = bytearray(header())
    b[66] = 7
    assert check(bytes(b)) == "header checksum mismatch"


@pytest.mark.parametrize("pos", [0, 500, 999])
def test_flipped_payload_byte(pos):
    p = bytearray(PAYLOAD)
    p[pos] ^= 0x80
    assert check(header(), bytes(p)) == "payload checksum mismatch"


def test_expectations_that_differ():
    hdr = header()
    assert "namespace" in check(hdr, ns=Namespace("m2", "bfloat16", 32, 8, 128, 16))
    assert "block hash" in check(hdr, h=bytes(16))
    reason = bf.check_block(hdr, PAYLOAD, NS.digest, HASH, NS.layout_id ^ 1)
    assert reason is not None and "layout id" in reason
    assert "payload length" in check(hdr, PAYLOAD[:-1])


@pytest.mark.parametrize("n", [0, 10, 87, 89])
def test_wrong_header_size(n):
    hdr = (header() + b"\x00")[:n]
    assert bf.check_header(hdr, NS.digest, HASH, NS.layout_id, len(PAYLOAD)) == \
        f"header is {n} bytes, expected 88"


def test_empty_payload():
    assert check(header(b""), b"") is None


def test_golden_aligned_header_and_the_88_byte_one_beside_it():
    """Stored bytes outlive code: an aligned value's header (version 1, header length 4096, zeros to the
    page end) and the 88-byte one for the same block, pinned.  They differ in the length field and so in
    the header checksum, nowhere else."""
    payload = bytes(range(256)) * 256
    aligned = bf.encode_header(NS.digest, HASH, NS.layout_id, payload, aligned=True)
    plain = bf.encode_header(NS.digest, HASH, NS.layout_id, payload)
    assert len(aligned) == bf.ALIGNED_HEADER_SIZE == 4096 and aligned[88:] == bytes(4008)
    assert aligned[:88].hex() == (
        "4b5654420100001000000100000000006f88244fc73b1b4e890ee45f0b5861e610000102030405060708090a0b0c0d0e0f"
        "000000000000000000000000000000000000002a1cabea16550a616db51d9ad8f9aae1735eb972")
    assert plain.hex() == (
        "4b5654420100580000000100000000006f88244fc73b1b4e890ee45f0b5861e610000102030405060708090a0b0c0d0e0f"
        "000000000000000000000000000000000000002a1cabea16550a616db51d9a613f0cc7c05074e0")
    assert bf.stated_header_size(aligned) == 4096 and bf.stated_header_size(plain) == 88
    assert bf.check_block(aligned, payload, NS.digest, HASH, NS.layout_id) is None
    assert bf.check_block(plain, payload, NS.digest, HASH, NS.layout_id) is None
    # An aligned header read as an 88-byte one (a reader of the old layout) is refused, never misread.
    assert bf.check_block(aligned[:88], payload, NS.digest, HASH, NS.layout_id) == "header length 4096, expected 88"
    bad = bytearray(aligned)
    bad[4095] = 1
    assert bf.check_block(bytes(bad), payload, NS.digest, HASH, NS.layout_id) == \
        "padding after the header's fields is not zero"
    assert bf.check_header(bytes(bad)[:2048], NS.digest, HASH, NS.layout_id, len(payload)) == \
        "header is 2048 bytes, expected 88"
