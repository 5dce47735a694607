"""2-D copies between host memory and a CUDA device: a byte range of each of many rows, as one DMA call
(``cudaMemcpy2DAsync`` from the CUDA runtime torch loaded), for layer-wise and grouped whole-block copies."""

from __future__ import annotations

import ctypes
import functools
import os
from typing import Any

import torch

_H2D, _D2H = 1, 2  # cudaMemcpyKind
FORCE_TORCH_2D = os.environ.get("KVTIER_NO_MEMCPY2D", "") not in ("", "0")


def copy_2d(dst: torch.Tensor, src: torch.Tensor) -> None:
    """``dst.copy_(src, non_blocking=True)`` for 2-D uint8 views whose rows are contiguous but whose row
    pitch may differ, on the current CUDA stream.

    torch copies a strided host<->device view through a pageable temporary (a host-side copy that
    blocks); ``cudaMemcpy2DAsync`` lets the DMA engine walk the pitch itself, one call per view.  The
    runtime is the one torch already loaded (found in ``/proc/self/maps``), so streams and pointers are
    shared; without it we fall back to torch's copy, which is correct but slower."""
    if dst.shape != src.shape or dst.dtype != torch.uint8 or src.dtype != torch.uint8:
        raise ValueError(f"copy_2d: {list(dst.shape)} {dst.dtype} <- {list(src.shape)} {src.dtype}")
    if dst.numel() == 0:
        return
    fn = None if FORCE_TORCH_2D else _memcpy2d_fn()
    cross = dst.device.type != src.device.type
    if fn is None or not cross or dst.stride(1) != 1 or src.stride(1) != 1 or (
            src.device.type == "cpu" and not src.is_pinned()) or (
            dst.device.type == "cpu" and not dst.is_pinned()):
        dst.copy_(src, non_blocking=True)
        return
    kind = _H2D if dst.device.type == "cuda" else _D2H
    dev = dst.device if dst.device.type == "cuda" else src.device
    stream = torch.cuda.current_stream(dev).cuda_stream
    height, width = src.shape
    dpitch = dst.stride(0) if height > 1 else width
    spitch = src.stride(0) if height > 1 else width
    err = fn(ctypes.c_void_p(dst.data_ptr()), ctypes.c_size_t(dpitch), ctypes.c_void_p(src.data_ptr()),
             ctypes.c_size_t(spitch), ctypes.c_size_t(width), ctypes.c_size_t(height), ctypes.c_int(kind),
             ctypes.c_void_p(stream))
    if err != 0:
        raise RuntimeError(f"cudaMemcpy2DAsync failed with cudaError {err} "
                           f"({height} rows x {width} B, pitches {dpitch}/{spitch})")


@functools.lru_cache(maxsize=1)
def _memcpy2d_fn() -> Any:
    if not torch.cuda.is_available():
        return None
    try:
        with open("/proc/self/maps") as f:
            paths = {line.split()[-1] for line in f if "libcudart" in line and "/" in line}
    except OSError:
        return None
    for path in sorted(paths):
        try:
            fn = ctypes.CDLL(path).cudaMemcpy2DAsync
        except (OSError, AttributeError):
            continue
        fn.restype = ctypes.c_int
        fn.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_void_p, ctypes.c_size_t, ctypes.c_size_t,
                       ctypes.c_size_t, ctypes.c_int, ctypes.c_void_p]
        return fn
    return None


def memcpy2d_available() -> bool:
    """Whether layer-wise host<->device copies use ``cudaMemcpy2DAsync`` (else a strided ``copy_``)."""
    return not FORCE_TORCH_2D and _memcpy2d_fn() is not None
