"""local_disk's batched get path: payloads land in the caller's buffers, a block that fails any check is
never served (also when the batch is split across the pool's threads), and reads keep the LRU index."""

import os
from typing import Any

import numpy as np

from kvtier.backends.local_disk import LocalDiskBackend
from kvtier.format import blockformat
from kvtier.keys import Namespace

NS = Namespace("m", "bfloat16", 2, 2, 64, 16)
LID = NS.layout_id
BLOCK = 256 << 10  # 16 blocks = 4 MiB: split across 4 threads (pieces of >= 512 KiB)


def mk(tmp_path, name="d", **opts):
    return LocalDiskBackend({"path": str(tmp_path / name), "capacity": "1GiB", "threads": 4, **opts})


def test_split_batch_serves_only_verified_blocks(tmp_path):
    b = mk(tmp_path)
    keys = NS.keys([os.urandom(16) for _ in range(16)])
    payloads = [os.urandom(BLOCK) for _ in keys]
    assert all(b.put(keys, payloads, LID))
    path = lambda k: b._where(k)[1]  # noqa: E731
    with open(path(keys[3]), "r+b") as f:  # one payload bit flipped
        f.seek(blockformat.HEADER_SIZE + BLOCK // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    with open(path(keys[7]), "r+b") as f:  # a header field changed
        f.seek(20)
        f.write(b"\xff")
    os.unlink(path(keys[9]))  # vanished (another process evicted it)
    with open(path(keys[12]), "r+b") as f:  # torn: one byte short
        f.truncate(blockformat.HEADER_SIZE + BLOCK - 1)
    bufs = [bytearray(BLOCK) for _ in keys]
    ok = b.get_into(keys, bufs, LID)
    bad = {3, 7, 9, 12}
    assert ok == [i not in bad for i in range(16)]
    assert all(bytes(bufs[i]) == payloads[i] for i in range(16) if i not in bad)
    assert b.stats().corrupt == 3
    assert [os.path.exists(path(keys[i])) for i in sorted(bad)] == [False] * 4  # corrupt ones deleted
    assert not ({keys[i] for i in bad} & {s.key for s in b._eviction_order()})  # and forgotten
    b.close()


def test_verified_blocks_are_reported_from_the_threads_that_read_them(tmp_path):
    """A split batch reports each verified block from the pool thread that read it, right after its
    checksum (so the caller can copy it on while it is in cache), never the failed ones."""
    import threading

    b = mk(tmp_path)
    keys = NS.keys([os.urandom(16) for _ in range(16)])
    payloads = [os.urandom(BLOCK) for _ in keys]
    assert all(b.put(keys, payloads, LID))
    os.unlink(b._where(keys[5])[1])
    bufs = [bytearray(BLOCK) for _ in keys]
    told: list[tuple[int, int, bool]] = []
    ok = b.get_into(keys, bufs, LID, on_verified=lambda i: told.append(
        (i, threading.get_ident(), bytes(bufs[i]) == payloads[i])))
    assert ok == [i != 5 for i in range(16)]
    assert sorted(i for i, _, _ in told) == [i for i in range(16) if i != 5]
    assert all(good for _, _, good in told)  # each buffer was complete when reported
    # The batch is cut into 4 strided shares (block i in share i % 4): the caller reads share 0, pool threads
    # the others, one thread a share.  Each share is reported from one thread, the caller's only for its
    # own.  (How many distinct pool threads run shares 1-3 is the scheduler's choice: one may take two.)
    threads_of: dict[int, set[int]] = {}
    for i, t, _ in told:
        threads_of.setdefault(i % 4, set()).add(t)
    me = threading.get_ident()
    assert sorted(threads_of) == [0, 1, 2, 3] and all(len(ts) == 1 for ts in threads_of.values())
    assert threads_of[0] == {me} and all(me not in threads_of[j] for j in (1, 2, 3))
    b.close()


def test_payload_lands_in_the_callers_buffer_of_any_shape(tmp_path):
    b = mk(tmp_path)
    keys = NS.keys([os.urandom(16) for _ in range(4)])
    payloads = [np.random.default_rng(i).integers(0, 2**16, BLOCK // 2, dtype=np.uint16) for i in range(4)]
    assert all(b.put(keys, payloads, LID))
    slab = np.zeros((4, BLOCK // 2), dtype=np.uint16)  # host memory: rows of a slab, 16-bit elements
    assert b.get_into(keys, list(slab), LID) == [True] * 4
    assert all((slab[i] == payloads[i]).all() for i in range(4))
    b.close()


def test_reads_keep_lru_order_and_adopt_other_writers_blocks(tmp_path):
    b = mk(tmp_path)
    keys = NS.keys([os.urandom(16) for _ in range(6)])
    assert all(b.put(keys[:4], [os.urandom(4096) for _ in range(4)], LID))
    other = mk(tmp_path)  # another process on the same directory
    assert all(other.put(keys[4:], [os.urandom(4096) for _ in range(2)], LID))
    assert b.get_into([keys[1], keys[5], keys[0]], [bytearray(4096) for _ in range(3)], LID) == [True] * 3
    order = [s.key for s in b._eviction_order()]
    # One index for the directory: the other writer's blocks are in it, read = most recent, in batch order
    assert order == [keys[2], keys[3], keys[4], keys[1], keys[5], keys[0]]
    b.close()
    other.close()


def test_check_block_hashes_the_payload_once_and_names_the_reason():
    ns, h = NS.digest, bytes(range(16))
    # Any: numpy's stubs give ndarray a __buffer__ only for Python 3.12+ (it is a buffer at runtime)
    payload: Any = np.arange(BLOCK // 4, dtype=np.uint32)
    head = blockformat.encode_header(ns, h, LID, payload)
    assert blockformat.check_block(head, payload, ns, h, LID) is None
    assert blockformat.check_block(memoryview(bytearray(head)), memoryview(payload), ns, h, LID) is None
    payload[5] += 1
    assert blockformat.check_block(head, payload, ns, h, LID) == "payload checksum mismatch"
    reason = blockformat.check_block(head[:87], payload, ns, h, LID)
    assert reason is not None and "header is 87 bytes" in reason
