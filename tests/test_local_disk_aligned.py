"""local_disk's aligned values: payloads of whole pages start at offset 4096 of their file (block format 1,
4096-byte header), cold ones are read with O_DIRECT into page-aligned buffers and checked in place, the
filesystem's refusal of O_DIRECT falls back to buffered reads, and values of the 88-byte layout written
before keep loading."""

from __future__ import annotations

import errno
import mmap
import os
import struct

import pytest

from kvtier.backends import _disk_files
from kvtier.backends.local_disk import LocalDiskBackend
from kvtier.format import blockformat
from kvtier.keys import Namespace
from kvtier.tools.commands import _storage_tools as st
from kvtier.tools.commands.verify import Checker

NS = Namespace("m", "bfloat16", 8, 2, 64, 16)  # 64 KiB blocks: the smallest stored aligned
LID = NS.layout_id
BLOCK = 8 * 2 * 2 * 64 * 16 * 2  # layers x (K, V) x kv heads x head dim x tokens x bf16 = 64 KiB
PAGE = blockformat.ALIGNED_HEADER_SIZE


def mk(tmp_path, **opts):
    return LocalDiskBackend({"path": str(tmp_path / "d"), "capacity": "1GiB", "threads": 1, **opts})


def aligned_bufs(n, size=BLOCK):
    """``n`` page-aligned buffers (host slots are so): what O_DIRECT reads into."""
    m = mmap.mmap(-1, n * size)
    return [memoryview(m)[i * size:(i + 1) * size] for i in range(n)]


def cool(path):
    """Drop a file from the page cache, so the next read goes to the device."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fdatasync(fd)
        os.posix_fadvise(fd, 0, 0, os.POSIX_FADV_DONTNEED)
    finally:
        os.close(fd)


class DirectCalls:
    """Counts the switches of a read's descriptor to O_DIRECT; ``refuse``: answer them EINVAL, as a
    filesystem without direct I/O does."""

    def __init__(self, monkeypatch, refuse=False):
        self.n, self.refuse, real = 0, refuse, _disk_files.fcntl.fcntl

        def fcntl(fd, cmd, arg=0):
            if cmd == _disk_files.fcntl.F_SETFL and arg & os.O_DIRECT:
                self.n += 1
                if self.refuse:
                    raise OSError(errno.EINVAL, "Invalid argument")
            return real(fd, cmd, arg)

        monkeypatch.setattr(_disk_files.fcntl, "fcntl", fcntl)


def direct_io_here(path) -> bool:
    try:
        os.close(os.open(path, os.O_RDONLY | os.O_DIRECT))
        return True
    except OSError as e:
        assert e.errno == errno.EINVAL
        return False


def test_payloads_of_whole_pages_are_stored_aligned_others_as_before(tmp_path):
    b = mk(tmp_path)
    keys = NS.keys([os.urandom(16) for _ in range(4)])
    sizes = [BLOCK, BLOCK + 100, 32 << 10, 2 * BLOCK]  # aligned, not whole pages, too small, aligned
    data = [os.urandom(n) for n in sizes]
    assert all(b.put(keys, data, LID))
    for k, d, aligned in zip(keys, data, [True, False, False, True]):
        with open(b._where(k)[1], "rb") as f:
            raw = f.read()
        ns, h = bytes.fromhex(k[:32]), bytes.fromhex(k[33:])
        head = blockformat.encode_header(ns, h, LID, d, aligned=aligned)
        assert raw == head + d and b.stored_size(len(d)) == len(raw)
        assert struct.unpack_from("<H", raw, 6)[0] == (PAGE if aligned else blockformat.HEADER_SIZE)
    assert b.stats().extra["bytes"] == sum(b.stored_size(n) for n in sizes)
    off = mk(tmp_path / "off", aligned_values=False)
    assert off.put(keys[:1], data[:1], LID) == [True]
    assert os.path.getsize(off._where(keys[0])[1]) == blockformat.HEADER_SIZE + BLOCK
    b.close()
    off.close()


@pytest.mark.parametrize("cold", [False, True])
def test_values_of_the_88_byte_layout_keep_loading(tmp_path, cold):
    """A value as every kvtier before wrote it (golden: the 88-byte header, the payload right after),
    planted as a file, and one written with aligned_values off, read by the default backend."""
    b = mk(tmp_path)
    k1, k2 = NS.keys([os.urandom(16) for _ in range(2)])
    d1, d2 = os.urandom(BLOCK), os.urandom(BLOCK)
    d, path = b._where(k1)
    os.makedirs(d, exist_ok=True)
    with open(path, "wb") as f:
        f.write(blockformat.encode_header(bytes.fromhex(k1[:32]), bytes.fromhex(k1[33:]), LID, d1) + d1)
    old = mk(tmp_path, aligned_values=False)
    assert old.put([k2], [d2], LID) == [True]
    old.close()
    for k in (k1, k2):
        assert os.path.getsize(b._where(k)[1]) == blockformat.HEADER_SIZE + BLOCK
        if cold:
            cool(b._where(k)[1])
    bufs = aligned_bufs(2)
    assert b.get_into([k1, k2], bufs, LID) == [True, True]
    assert bufs[0] == d1 and bufs[1] == d2 and b.stats().corrupt == 0
    b.close()


def test_cold_reads_go_direct_into_aligned_buffers_and_are_verified(tmp_path, monkeypatch):
    b = mk(tmp_path)
    keys = NS.keys([os.urandom(16) for _ in range(5)])
    data = [os.urandom(BLOCK) for _ in keys]
    assert all(b.put(keys, data, LID))
    calls = DirectCalls(monkeypatch)
    bufs = aligned_bufs(5)
    assert b.get_into(keys, bufs, LID) == [True] * 5 and calls.n == 0  # in the page cache: buffered
    direct = direct_io_here(b._where(keys[0])[1])
    paths = [b._where(k)[1] for k in keys]
    with open(paths[1], "r+b") as f:  # a payload bit flipped
        f.seek(PAGE + BLOCK // 2)
        byte = f.read(1)
        f.seek(-1, 1)
        f.write(bytes([byte[0] ^ 1]))
    with open(paths[2], "r+b") as f:  # a padding byte set: nothing unchecked is served
        f.seek(100)
        f.write(b"\x01")
    with open(paths[3], "r+b") as f:  # torn
        f.truncate(PAGE + BLOCK - 4096)
    for p in paths[:3] + paths[4:]:
        cool(p)
    for buf in bufs:
        buf[:] = bytes(BLOCK)
    assert b.get_into(keys, bufs, LID) == [True, False, False, False, True]
    assert bufs[0] == data[0] and bufs[4] == data[4]
    assert b.stats().corrupt == 3 and not any(os.path.exists(p) for p in paths[1:4])
    # Where the filesystem takes O_DIRECT the cold values went through it; elsewhere it was refused once
    # and reads went on buffered.
    assert (calls.n >= 2) if direct else (calls.n == 1 and not b._direct.enabled)
    # A caller's buffer that is not page aligned, and one given as segments: both read and checked.
    cool(paths[0])
    odd = memoryview(bytearray(BLOCK + 1))[1:]
    assert b.get_into(keys[:1], [odd], LID) == [True] and odd == data[0]
    cool(paths[4])
    seg = aligned_bufs(2, BLOCK // 2)
    assert b.get_into(keys[4:], [blockformat.Segments(seg)], LID) == [True]
    assert bytes(seg[0]) + bytes(seg[1]) == data[4]
    b.close()


@pytest.mark.parametrize("where", ["fcntl", "read"])
def test_o_direct_refused_falls_back_to_buffered_reads(tmp_path, monkeypatch, where):
    """tmpfs (before Linux 6.6), some network and FUSE filesystems answer O_DIRECT with EINVAL, at the
    switch or at the read: the value is read buffered, and the backend stops asking."""
    b = mk(tmp_path)
    keys = NS.keys([os.urandom(16) for _ in range(3)])
    data = [os.urandom(BLOCK) for _ in keys]
    assert all(b.put(keys, data, LID))
    calls = DirectCalls(monkeypatch, refuse=where == "fcntl")
    if where == "read":
        real = os.preadv

        def preadv(fd, bufs, offset, *flags):
            if _disk_files.fcntl.fcntl(fd, _disk_files.fcntl.F_GETFL) & os.O_DIRECT:
                raise OSError(errno.EINVAL, "Invalid argument")
            return real(fd, bufs, offset, *flags)

        monkeypatch.setattr(_disk_files.os, "preadv", preadv)
    bufs = aligned_bufs(3)
    # A cold value is what makes a read try O_DIRECT.  On a loaded machine one DONTNEED sometimes left
    # every file cached (the reads went buffered, never asking): cool them again until a read asked.
    for _ in range(5):
        for k in keys:
            cool(b._where(k)[1])
        assert b.get_into(keys, bufs, LID) == [True] * 3
        assert [bytes(x) for x in bufs] == data and b.stats().corrupt == 0
        if calls.n:
            break
    assert not b._direct.enabled and calls.n == 1  # refused once, never asked again


def test_verify_tool_checks_aligned_values_padding_included(tmp_path):
    b = mk(tmp_path)
    b.put_manifest(NS)
    keys = NS.keys([os.urandom(16) for _ in range(3)])
    assert all(b.put(keys, [os.urandom(BLOCK) for _ in keys], LID))
    with open(b._where(keys[1])[1], "r+b") as f:
        f.seek(PAGE - 1)
        f.write(b"\x07")
    checker = Checker(b, {NS.id: st.namespace_info(b, NS.id)})
    found = checker.check(list(b.scan(NS.id)))
    assert found == [(keys[1], "padding after the header's fields is not zero")] and checker.ok == 2
    b.close()
