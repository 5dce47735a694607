"""The lookup snapshot of a ``local_disk`` directory's index: every block key the SQLite index listed at one
point of its change log, as a sorted array of fixed-width records in a file beside it
(``<index>.keys``) that every process maps read-only, so a batch lookup is one vectorised binary search
(numpy ``searchsorted``) in shared pages: about 0.2 ms for 1,000 keys at 5 million blocks, where one
LMDB probe per key took 2-4 ms and SQLite's ``IN`` query 5-10 ms (docs/performance.md).  SQLite stays the
index of record; the changes since the snapshot come from its ``changes`` log (``_disk_index``).

Layout: a 4096-byte header, then ``count`` prefixes (``<u8``), then ``count`` records of ``width`` bytes,
both in ascending order.  A record is the key (32 or 48 bytes) rotated to put its block hash before its
namespace digest, zero-padded to ``width - 1``, then one byte holding the key's length: fixed-width
``bytes`` compare exactly (numpy strips trailing zero bytes; the length byte is never zero) and a key of one
length never equals a padded key of another.  A prefix is a record's first 8 bytes read big-endian, so
prefixes ascend with the records: the binary search runs on integers (numpy compares ``bytes`` one byte
at a time: a search of the records themselves took 1.4 ms for 1,000 keys at 1 million, of the prefixes
0.2 ms), then each hit's record is compared whole.  41 bytes a block for 32-byte keys, 57 for 48-byte
keys, in pages shared by every process.  Each process also keeps where each run of prefixes with the same
top bits starts (about 4 prefixes a run, 1 byte a block, its own memory): a search is then a few steps
within one run, not 23 levels of cache misses over the whole array (1.7 ms for 1,000 keys at 5 million,
against about 0.4).

Invariants:
* a snapshot is written to a temp file and renamed into place: a reader never maps a partly written one
  (kill -9 leaves at most the temp file, removed by the next build);
* a mapped snapshot is used only if its header (magic, format version, field checksum) and its records
  (xxh3-64 over them, checked once per process and file) are whole, and it names this boot of the host
  (``/proc/sys/kernel/random/boot_id``): nothing is synced, and SQLite in WAL mode with
  ``synchronous=NORMAL`` may lose its last commits in a power cut, after which the change log could
  number new changes below the snapshot's ``upto``.  Anything else is ignored (lookups ask SQLite) and
  built again;
* the header names the index generation (``meta.id``) and the last change-log id (``upto``) the records
  are as of; the index decides whether that is still usable (``_disk_index``), this module only keeps the
  bytes honest;
* one build at a time per index, across processes (a non-blocking ``flock`` on ``<index>.keys.lock``);
  a build reads the keys from one SQLite read transaction, so the records are one committed state.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import mmap
import os
import struct
from collections.abc import Iterable, Iterator, Sequence

import numpy as np
import xxhash

log = logging.getLogger("kvtier.backends.local_disk")

MAGIC = b"KVTKEYS\x00"
VERSION = 1
HEADER_BYTES = 4096
# magic, version, width, count, upto, generation (32 hex), boot id (36), records' xxh3-64
_FIELDS = struct.Struct("<8sIIQq32s36sQ")
_KEY_LENGTHS = (32, 48)  # a block key in the index: namespace digest + a 16- or 32-byte block hash
_NS = 16  # bytes of the namespace digest


def record(key: bytes, width: int) -> bytes:
    """A key's record (the module's layout)."""
    return (key[_NS:] + key[:_NS]).ljust(width - 1, b"\0") + bytes([len(key)])


def _boot_id() -> str:
    try:
        with open("/proc/sys/kernel/random/boot_id") as f:
            return f.read().strip()
    except OSError:
        return "unknown"


BOOT = _boot_id()


class Snapshot:
    """One mapped snapshot file (shared pages; never written)."""

    def __init__(self, path: str, ident: tuple[int, int, int], gen: str, upto: int, width: int,
                 prefixes: np.ndarray[tuple[int], np.dtype[np.uint64]],
                 keys: np.ndarray[tuple[int], np.dtype[np.bytes_]], mm: mmap.mmap | None):
        self.path, self.ident, self.gen, self.upto, self.width = path, ident, gen, upto, width
        self.prefixes, self.keys = prefixes, keys
        n = int(keys.shape[0])
        # Runs: bucket b holds prefixes[starts[b]:starts[b + 1]], those whose top ``bits`` bits are b.
        self._bits = max(0, n.bit_length() - 3)
        cuts = (np.arange(1, 1 << self._bits, dtype=np.uint64) << np.uint64(64 - self._bits)) if self._bits else \
            np.empty(0, dtype=np.uint64)
        self._starts = np.concatenate(([0], np.searchsorted(prefixes, cuts), [n])).astype(np.int64)
        self._steps = int(np.diff(self._starts).max(initial=0)).bit_length()  # halvings to end any run
        self._mm = mm  # kept open as long as the array over it lives
        self.count = int(keys.shape[0])

    def contains(self, blobs: Sequence[bytes]) -> list[bool]:
        """Whether each key (index form: bytes) is among the records."""
        w = self.width
        if not blobs or self.count == 0:
            return [False] * len(blobs)
        tail = bytes([w - 1])
        if all(len(b) == w - 1 for b in blobs):  # the usual batch: one key length, as stored
            q = np.frombuffer(b"".join([b[_NS:] + b[:_NS] + tail for b in blobs]), dtype=f"S{w}")
        else:  # a key longer than the records' is in no record: a zero-length record, which none is
            q = np.frombuffer(b"".join([record(b, w) if len(b) < w else b"\0" * w for b in blobs]), dtype=f"S{w}")
        qp = _prefixes(q, w)
        b = (qp >> np.uint64(64 - self._bits)).astype(np.int64) if self._bits else np.zeros(len(qp), np.int64)
        lo, hi = self._starts[b], self._starts[b + 1]
        last = self.count - 1
        for _ in range(self._steps):  # binary search of each key's run, all keys at once
            mid = (lo + hi) >> 1
            right = (mid < hi) & (self.prefixes[np.minimum(mid, last)] < qp)
            lo = np.where(right, mid + 1, lo)
            hi = np.where(right, hi, mid)
        i = np.minimum(lo, last)  # the first prefix >= the key's (or past the run: compared, not equal)
        hit = self.keys[i] == q
        # Records sharing a prefix (rare: prefixes are 64 bits of a hash): the key may follow in the run.
        for j in np.flatnonzero(~hit & (self.prefixes[i] == qp)).tolist():
            first = int(i[j])
            end = int(np.searchsorted(self.prefixes, qp[j], side="right"))
            k = first + int(np.searchsorted(self.keys[first:end], q[j]))
            hit[j] = k < end and self.keys[k] == q[j]
        found: list[bool] = hit.tolist()
        return found

    def close(self) -> None:
        self.keys, self.prefixes = np.empty(0, dtype="S1"), np.empty(0, dtype=np.uint64)
        if self._mm is not None:
            with contextlib.suppress(BufferError):  # a view still alive: freed with it
                self._mm.close()
            self._mm = None


def _prefixes(recs: np.ndarray[tuple[int], np.dtype[np.bytes_]], width: int) -> np.ndarray[tuple[int], np.dtype[np.uint64]]:
    """Each record's first 8 bytes as a big-endian number (native integers: the search compares them)."""
    first = np.ascontiguousarray(recs.view(np.uint8).reshape(-1, width)[:, :8])
    out: np.ndarray[tuple[int], np.dtype[np.uint64]] = first.view(">u8").reshape(-1).astype("<u8")
    return out


def _ident(st: os.stat_result) -> tuple[int, int, int]:
    return st.st_ino, st.st_mtime_ns, st.st_size


def stat_ident(path: str) -> tuple[int, int, int] | None:
    """What tells a snapshot file from the next one at the same path (None: there is none)."""
    try:
        return _ident(os.stat(path))
    except OSError:
        return None


def load(path: str) -> Snapshot | None:
    """Map the snapshot at ``path`` if it is whole and of this boot; None otherwise (logged when damaged)."""
    try:
        fd = os.open(path, os.O_RDONLY | os.O_CLOEXEC | os.O_NOFOLLOW)
    except OSError:
        return None
    try:
        st = os.fstat(fd)
        head = os.pread(fd, HEADER_BYTES, 0)
        why = _check_header(head, st.st_size)
        if why is not None:
            log.warning("local_disk: lookup snapshot %s %s; lookups ask SQLite until it is built again", path, why)
            return None
        magic, version, width, count, upto, gen, boot, digest = _FIELDS.unpack_from(head)
        if boot.decode(errors="replace") != BOOT:
            return None  # of another boot: see the module's invariants (not damage: not logged)
        mm = mmap.mmap(fd, st.st_size, prot=mmap.PROT_READ) if count else None
    except (OSError, ValueError) as e:
        log.warning("local_disk: lookup snapshot %s unreadable (%s); lookups ask SQLite", path, e)
        return None
    finally:
        os.close(fd)
    if mm is None:
        keys: np.ndarray[tuple[int], np.dtype[np.bytes_]] = np.empty(0, dtype=f"S{width}")
        prefixes: np.ndarray[tuple[int], np.dtype[np.uint64]] = np.empty(0, dtype="<u8")
    else:
        body = memoryview(mm)[HEADER_BYTES:]
        ok = xxhash.xxh3_64_intdigest(body) == digest
        body.release()
        if not ok:
            mm.close()
            log.warning("local_disk: lookup snapshot %s: its records fail their checksum; lookups ask SQLite "
                        "until it is built again", path)
            return None
        prefixes = np.frombuffer(mm, dtype="<u8", count=count, offset=HEADER_BYTES)
        keys = np.frombuffer(mm, dtype=f"S{width}", count=count, offset=HEADER_BYTES + 8 * count)
    return Snapshot(path, _ident(st), gen.decode(), int(upto), int(width), prefixes, keys, mm)


def _check_header(head: bytes, size: int) -> str | None:
    if len(head) < _FIELDS.size + 8:
        return "is shorter than its header"
    if xxhash.xxh3_64_intdigest(head[:_FIELDS.size]) != int.from_bytes(head[_FIELDS.size:_FIELDS.size + 8], "little"):
        return "has a damaged header (checksum)"
    magic, version, width, count, _, _, _, _ = _FIELDS.unpack_from(head)
    if magic != MAGIC:
        return "is not a lookup snapshot (magic)"
    if version != VERSION:
        return f"has format version {version}, this build reads {VERSION}"
    if width - 1 not in _KEY_LENGTHS:
        return f"has records of {width} bytes"
    if size != HEADER_BYTES + (8 + width) * count:
        return f"is {size} bytes, its header says {HEADER_BYTES + (8 + width) * count}"
    return None


@contextlib.contextmanager
def exclusive(path: str) -> Iterator[bool]:
    """The build lock of the snapshot at ``path``: yields whether this process holds it (never waits)."""
    fd = os.open(path + ".lock", os.O_RDWR | os.O_CREAT | os.O_CLOEXEC | os.O_NOFOLLOW, 0o644)
    try:
        try:
            fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            yield False
            return
        yield True
    finally:
        os.close(fd)  # (releases the flock)


def _drop_dead_temps(path: str) -> None:
    """Temp files of builds killed before their rename (``<name>.<pid>.tmp``; the index is per host)."""
    d, name = os.path.split(path)
    with contextlib.suppress(OSError):
        for e in os.scandir(d or "."):
            if e.name.startswith(name + ".") and e.name.endswith(".tmp"):
                pid = e.name[len(name) + 1: -len(".tmp")]
                if pid.isdigit() and int(pid) != os.getpid() and not os.path.exists(f"/proc/{pid}"):
                    with contextlib.suppress(OSError):
                        os.unlink(e.path)


def write(path: str, gen: str, upto: int, pages: Iterable[Sequence[bytes]]) -> int:
    """Write (temp file, then rename) the snapshot of the keys ``pages`` yields, in any order, as of index
    generation ``gen`` and change-log id ``upto`` (the caller read them all in one read transaction); the
    keys written.  Its memory while building: about twice the file's size."""
    _drop_dead_temps(path)
    parts: dict[int, bytearray] = {n: bytearray() for n in _KEY_LENGTHS}
    for page in pages:
        for k in page:
            p = parts.get(len(k))
            if p is None:
                raise ValueError(f"lookup snapshot {path}: the index lists a key of {len(k)} bytes (32 or 48 expected)")
            p += k
    counts = {n: len(parts[n]) // n for n in _KEY_LENGTHS}
    width = max([n for n in _KEY_LENGTHS if counts[n]], default=_KEY_LENGTHS[0]) + 1
    count = sum(counts.values())
    arr = np.zeros((count, width), dtype=np.uint8)
    row = 0
    for n in _KEY_LENGTHS:
        if counts[n]:
            keys = np.frombuffer(bytes(parts.pop(n)), dtype=np.uint8).reshape(counts[n], n)
            arr[row:row + counts[n], :n - _NS] = keys[:, _NS:]
            arr[row:row + counts[n], n - _NS:n] = keys[:, :_NS]
            del keys
            arr[row:row + counts[n], width - 1] = n
            row += counts[n]
    recs = arr.reshape(-1).view(f"S{width}")
    recs.sort()  # (in place: arr is sorted too)
    pre = _prefixes(recs, width).data
    body = arr.reshape(-1).data
    digest = xxhash.xxh3_64()
    digest.update(pre)
    digest.update(body)
    fields = _FIELDS.pack(MAGIC, VERSION, width, count, upto, gen.encode().ljust(32)[:32],
                          BOOT.encode().ljust(36)[:36], digest.intdigest())
    head = (fields + xxhash.xxh3_64_intdigest(fields).to_bytes(8, "little")).ljust(HEADER_BYTES, b"\0")
    tmp = f"{path}.{os.getpid()}.tmp"
    try:
        with open(tmp, "wb") as f:
            f.write(head)
            f.write(pre)
            f.write(body)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
    return count


def remove(path: str) -> None:
    for suffix in ("", ".lock"):
        with contextlib.suppress(FileNotFoundError):
            os.unlink(path + suffix)


__all__ = ["BOOT", "Snapshot", "exclusive", "load", "remove", "stat_ident", "write"]
