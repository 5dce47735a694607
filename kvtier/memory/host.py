"""Host tier: one pre-allocated slab of fixed-size block slots in CPU memory.

The slab is a ``[num_slots, block_nbytes]`` uint8 tensor allocated once (page-locked when CUDA is
available, so host<->device copies are asynchronous DMA).  Each slot holds one block's canonical payload
(:mod:`kvtier.format.layout`).  Backends read and write a slot through :meth:`HostTier.slot_view`, a writable
buffer over the slab (no copy).

Slot states and their life cycle are :class:`~kvtier.memory.host_slots.SlotTable`'s, which this class extends
with the bytes.  The slab keeps slots and their states only (and the key a READY slot was committed with, so a copy can
check that a slot still holds what its caller looked up).  Which block to evict, and when, and whether
a block's bytes are in use, is decided by the owner of the blocks (the stack's
:class:`~kvtier.index.BlockIndex`, whose reference counts are the only pins, and its eviction policy):
there is no second LRU and no second pin count here.

Invariants:
* nothing here waits: ``allocate`` returns what it can at once (``skipped`` counts the rest);
* only READY slots hold a valid block; WRITING slots are being filled and are never readable;
* freeing a slot whose bytes a copy or a backend still uses is the caller's error: the stack frees a
  host block only when the index says nobody references it and no copy down is in flight.

``pin_memory`` is about page-locked memory (fast GPU copies), nothing else.  All methods are thread-safe.
"""

from __future__ import annotations

import contextlib
import dataclasses
import os
import weakref
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import torch

from .host_slots import FREE, READY, WRITING, Allocation, SlotCounts, SlotState, SlotTable


@dataclass(frozen=True)
class HostTierStats(SlotCounts):
    """The slot table's counts, and the size of a slot."""

    block_nbytes: int = 0


def resolve_pin_memory(pinned: bool | str) -> bool:
    """``"auto"`` -> whether CUDA is available; True without CUDA is an error (it cannot be honoured)."""
    if pinned == "auto":
        return torch.cuda.is_available()
    if pinned is True:
        if not torch.cuda.is_available():
            raise ValueError("host.pinned: true needs CUDA (page-locked memory is a CUDA feature); "
                             "use \"auto\" or false on a machine without a GPU")
        return True
    if pinned is False:
        return False
    raise ValueError(f'host.pinned: expected "auto", true or false, got {pinned!r}')


class HostTier(SlotTable):
    """The slab, a free list (lowest slot first, so fresh allocations are contiguous runs that copy in
    one piece), per-slot state and key.  No recency, no pins: see the module docstring."""

    def __init__(self, block_nbytes: int, *, capacity_bytes: int | None = None, num_slots: int | None = None,
                 pinned: bool | str = "auto", prefault: bool = True):
        if block_nbytes < 1:
            raise ValueError(f"block_nbytes: expected >= 1, got {block_nbytes}")
        if capacity_bytes is not None and num_slots is None:
            num_slots = int(capacity_bytes) // block_nbytes
            if num_slots < 1:
                raise ValueError(f"host capacity {capacity_bytes} B holds no block of {block_nbytes} B "
                                 "(raise host.capacity)")
        elif num_slots is None or capacity_bytes is not None:
            raise ValueError("HostTier: give exactly one of capacity_bytes and num_slots")
        if num_slots < 1:
            raise ValueError(f"num_slots: expected >= 1, got {num_slots}")
        self.block_nbytes = block_nbytes
        self.num_slots = num_slots
        self.pin_memory = resolve_pin_memory(pinned)
        self.slab = _checked_slab(num_slots, block_nbytes, self.pin_memory)
        if prefault and not self.pin_memory:
            # Touch every page now: the kernel's first-touch faults and zeroing cost ~0.2 s a GiB here,
            # which would otherwise land on the first loads into each slot (measured: a 512 MiB load
            # from local_disk took 225 ms into fresh slots, 50 ms into touched memory).  Page-locked
            # memory is already resident.
            self.slab.zero_()
        self._np = self.slab.numpy()  # numpy view of the same memory: slot_view builds on it
        self._finalizer = weakref.finalize(self, _release_slab, self.slab, self.pin_memory)
        super().__init__(num_slots)

    @classmethod
    def from_config(cls, host: Any, block_nbytes: int) -> HostTier:
        """From a config ``host`` section (``capacity`` in bytes, ``pinned``: "auto" / true / false)."""
        return cls(block_nbytes, capacity_bytes=int(host.capacity), pinned=host.pinned,
                   prefault=getattr(host, "prefault", True))

    @property
    def capacity_bytes(self) -> int:
        return self.num_slots * self.block_nbytes

    # ------------------------------------------------------------------ buffers (no lock: views only)

    def slot_view(self, slot: int) -> memoryview:
        """A writable buffer over slot ``slot`` (no copy): what a backend reads into or writes from."""
        return memoryview(self._np[self.check_slot(slot)])

    def slot_views(self, slots: Sequence[int]) -> list[memoryview]:
        return [self.slot_view(s) for s in slots]

    def rows(self, start: int, stop: int) -> torch.Tensor:
        """Slots ``start..stop-1`` as a ``[n, block_nbytes]`` tensor view of the slab."""
        return self.slab[start:stop]

    def stats(self) -> HostTierStats:
        c = self.counts()
        return HostTierStats(**dataclasses.asdict(c), block_nbytes=self.block_nbytes)

    def close(self) -> None:
        """Release the slab (unregistering page-locked memory).  The tier is unusable afterwards."""
        self._finalizer()


class HostMemoryUnavailable(ValueError):
    """The host tier's capacity cannot be had on this machine: more than its memory, or the allocation
    failed.  A ValueError: the configured value (``host.capacity``) is what must change."""


def memory_total() -> int | None:
    """Physical memory of this machine in bytes (None where unknown)."""
    with contextlib.suppress(OSError, ValueError, AttributeError):
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    return None


def memory_available() -> int | None:
    """Memory the kernel says can be had now without swapping (``MemAvailable``), in bytes; None where
    unknown (not Linux)."""
    with contextlib.suppress(OSError, ValueError), open("/proc/meminfo", encoding="ascii") as f:
        for line in f:
            if line.startswith("MemAvailable:"):
                return int(line.split()[1]) * 1024
    return None


def _checked_slab(num_slots: int, block_nbytes: int, pin: bool) -> torch.Tensor:
    """The slab, or :class:`HostMemoryUnavailable` naming ``host.capacity``.  Checked against physical
    memory first: where the kernel overcommits, a slab bigger than the machine is granted, and the
    prefault that touches it then gets the process killed, with no error to report."""
    from ..units import format_size

    want = num_slots * block_nbytes
    total = memory_total()
    what = f"host.capacity: {format_size(want)} of host memory ({num_slots} slots of {block_nbytes} B)"
    if total is not None and want > total:
        raise HostMemoryUnavailable(f"{what} is more than this machine has ({format_size(total)})")
    try:
        return _alloc_slab(num_slots, block_nbytes, pin)
    except (RuntimeError, MemoryError) as e:
        first = str(e).splitlines()[0] if str(e) else type(e).__name__
        raise HostMemoryUnavailable(f"{what} could not be allocated: {first}") from None


_PAGE = 4096


def _page_aligned_empty(num_slots: int, block_nbytes: int) -> torch.Tensor:
    """An uninitialised ``[num_slots, block_nbytes]`` uint8 tensor starting on a page (torch's allocator
    gives 64-byte alignment): slots of whole pages are then page aligned, and a storage backend can read
    a cold block into one with O_DIRECT (local_disk's aligned values).  One page more is allocated."""
    raw = torch.empty(num_slots * block_nbytes + _PAGE, dtype=torch.uint8)
    off = -raw.data_ptr() % _PAGE
    return raw[off:off + num_slots * block_nbytes].view(num_slots, block_nbytes)


def _alloc_slab(num_slots: int, block_nbytes: int, pin: bool) -> torch.Tensor:
    if not pin:
        return _page_aligned_empty(num_slots, block_nbytes)
    # Register an ordinary allocation rather than use pin_memory=True: torch's caching host allocator
    # rounds every request up to a power of two, which would page-lock up to twice the capacity.
    slab = _page_aligned_empty(num_slots, block_nbytes)
    err = int(torch.cuda.cudart().cudaHostRegister(slab.data_ptr(), slab.numel(), 0))
    if err == 0:
        slab._kvtier_registered = True  # type: ignore[attr-defined]
        return slab
    return torch.empty((num_slots, block_nbytes), dtype=torch.uint8, pin_memory=True)


def _release_slab(slab: torch.Tensor, pin: bool) -> None:
    if pin and getattr(slab, "_kvtier_registered", False):
        # At interpreter exit CUDA may already be gone; the memory is released with the process anyway.
        with contextlib.suppress(Exception):
            torch.cuda.cudart().cudaHostUnregister(slab.data_ptr())
        slab._kvtier_registered = False  # type: ignore[attr-defined]


__all__ = ["FREE", "READY", "WRITING", "Allocation", "HostMemoryUnavailable", "HostTier", "HostTierStats",
           "SlotState", "memory_available", "memory_total", "resolve_pin_memory"]
