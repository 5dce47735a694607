"""SGLang's real HiCache classes on a CPU, driven the way its engine drives them: for the kvtier tests.

What is real: SGLang 0.5.23's ``MHATokenToKVPool`` / ``MLATokenToKVPool`` (device pools, on ``cpu``), its
page allocator, ``MHATokenToKVPoolHost`` / ``MLATokenToKVPoolHost`` (``device="cpu"``, ``pin_memory=False``)
in any host layout, and ``HiCacheController`` (or ``HybridCacheController`` over a ``HostPoolGroup``, what
SGLang's unified radix cache runs) with its storage threads, which load kvtier through SGLang's own backend
factory (``--hicache-storage-backend dynamic``).  What this module plays is the part of
SGLang's scheduler around the controller (the radix cache): it asks for backups (``write_storage``),
starts prefetches (``prefetch``), allocates host slots for a storage hit and queues the transfer
(``prefetch_buffer``), and collects the acknowledgements, exactly through the controller's queues.

Page data is written into / read out of the host pool here per token, by an implementation of SGLang's
host layouts that shares nothing with kvtier's page codec (the oracle).

``torchvision``: SGLang's config package imports it at module level for two image-preprocessing modules
(``sglang.srt.multimodal.internvl_utils`` and ``sglang.srt.configs.deepseek_ocr``), and the index's
torchvision does not import against the CPU torch, so it is not installed here.  Importing this module
first gives exactly those two modules a torchvision placeholder *while they execute* (its attributes are
placeholders that raise ImportError if ever called); it is removed from ``sys.modules`` right after, so
nothing else (transformers checks for torchvision) ever sees it.  Nothing is done when torchvision imports.
"""

from __future__ import annotations

import importlib.abc
import importlib.machinery
import importlib.util
import sys
import threading
import time
import types
from dataclasses import dataclass, field
from queue import Empty
from typing import Any

_NEEDS_TORCHVISION = ("sglang.srt.multimodal.internvl_utils", "sglang.srt.configs.deepseek_ocr")
_TV_MODULES = ("torchvision", "torchvision.transforms", "torchvision.transforms.functional",
               "torchvision.transforms.v2")


class _Absent:
    """A torchvision name used at import time only (a default argument, a base class): raises if called."""

    def __init__(self, name: str):
        self._name = name

    def __getattr__(self, attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Absent(f"{self._name}.{attr}")

    def __call__(self, *args: Any, **kwargs: Any) -> Any:
        raise ImportError(f"{self._name} needs torchvision, which is not installed")


def _placeholder(name: str) -> types.ModuleType:
    mod = types.ModuleType(name)
    mod.__path__ = []

    def __getattr__(attr: str) -> Any:
        if attr.startswith("__"):
            raise AttributeError(attr)
        return _Absent(f"{name}.{attr}")

    mod.__getattr__ = __getattr__  # type: ignore[method-assign]
    return mod


class _ScopedLoader(importlib.abc.Loader):
    def __init__(self, real: importlib.abc.Loader):
        self.real = real

    def create_module(self, spec):
        return self.real.create_module(spec)

    def exec_module(self, module):
        for n in _TV_MODULES:
            sys.modules[n] = _placeholder(n)
        try:
            self.real.exec_module(module)
        finally:
            for n in _TV_MODULES:
                sys.modules.pop(n, None)


class _Finder(importlib.abc.MetaPathFinder):
    def find_spec(self, name, path, target=None):
        if name not in _NEEDS_TORCHVISION:
            return None
        spec = importlib.machinery.PathFinder.find_spec(name, path)
        if spec is not None and spec.loader is not None:
            spec.loader = _ScopedLoader(spec.loader)
        return spec


def install_torchvision_workaround() -> None:
    if importlib.util.find_spec("torchvision") is not None:
        return
    if not any(isinstance(f, _Finder) for f in sys.meta_path):
        sys.meta_path.insert(0, _Finder())


install_torchvision_workaround()

import torch  # noqa: E402
from sglang.srt.managers.cache_controller import HiCacheController  # noqa: E402
from sglang.srt.mem_cache.allocator.paged import PagedTokenToKVPoolAllocator  # noqa: E402
from sglang.srt.mem_cache.base_prefix_cache import CacheRequestHandle  # noqa: E402
from sglang.srt.mem_cache.hicache_storage import PoolName  # noqa: E402
from sglang.srt.mem_cache.hybrid_cache.hybrid_cache_controller import HybridCacheController  # noqa: E402
from sglang.srt.mem_cache.memory_pool import MHATokenToKVPool, MLATokenToKVPool  # noqa: E402
from sglang.srt.mem_cache.pool_host.group import HostPoolGroup, PoolEntry  # noqa: E402
from sglang.srt.mem_cache.pool_host.mha import MHATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.pool_host.mla import MLATokenToKVPoolHost  # noqa: E402
from sglang.srt.mem_cache.utils import get_storage_hash_str  # noqa: E402
from sglang.srt.runtime_context import get_parallel  # noqa: E402

LAYOUTS = ("layer_first", "page_first", "page_first_direct", "page_head")
MLA_LAYOUTS = ("layer_first", "page_first", "page_first_direct")


def extra_config(kvtier_yaml: str | None, v1: bool = True) -> dict[str, Any]:
    """What a user passes as ``--hicache-storage-backend-extra-config``."""
    cfg: dict[str, Any] = {"backend_name": "kvtier", "module_path": "kvtier.integrations.sglang",
                           "class_name": "KvtierStorage", "interface_v1": int(v1)}
    if kvtier_yaml is not None:
        cfg["kvtier_config"] = str(kvtier_yaml)
    return cfg


@dataclass
class Engine:
    ctrl: HiCacheController
    host: Any
    layout: str
    page_size: int
    mla: bool
    shape: tuple[int, ...]  # one page's canonical shape: (L, C, P, H, D)
    dtype: torch.dtype
    rids: list[str] = field(default_factory=list)

    @property
    def storage(self) -> Any:
        """The backend SGLang built (kvtier's KvtierStorage, or SGLang's fault-injecting proxy around it)."""
        return self.ctrl.storage_backend

    @property
    def kvtier(self) -> Any:
        b = self.storage
        return getattr(b, "_backend", b)

    def close(self) -> None:
        self.ctrl.detach_storage_backend()


_LOCK = threading.Lock()  # get_parallel() is process-wide: one controller is attached at a time


def make_engine(kvtier_yaml: str | None, *, layout: str = "layer_first", model: str | None = "tiny-llama",
                tp_rank: int = 0, tp_size: int = 1, v1: bool = True, mla: bool = False, page_size: int = 4,
                layers: int = 3, heads: int = 2, head_dim: int = 8, dtype: torch.dtype = torch.bfloat16,
                tokens: int = 1024, extra: dict[str, Any] | None = None, hybrid: bool = False) -> Engine:
    """A device pool, its allocator, a host pool in ``layout`` and SGLang's HiCacheController with kvtier
    attached through SGLang's backend factory, exactly as ``--hicache-storage-backend dynamic`` does.
    ``hybrid``: SGLang's ``HybridCacheController`` over a one-entry ``HostPoolGroup`` (the KV pool as anchor)."""
    if mla:
        dev = MLATokenToKVPool(tokens, page_size, dtype, head_dim - 4, 4, layers, "cpu", False,
                               start_layer=0, end_layer=layers)
        host = MLATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, layout,
                                    pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                                    start_layer=0, end_layer=layers, target_layer_num=layers)
        shape: tuple[int, ...] = (layers, 1, page_size, 1, head_dim)
    else:
        dev = MHATokenToKVPool(tokens, page_size, dtype, heads, head_dim, layers, "cpu", False,
                               start_layer=0, end_layer=layers)
        host = MHATokenToKVPoolHost(dev.get_device_pool_infos()[0].buffer_info, 2.0, 0, page_size, layout,
                                    pin_memory=False, device="cpu", device_capacity_tokens=dev.size,
                                    start_layer=0, end_layer=layers)
        shape = (layers, 2, page_size, heads, head_dim)
    alloc = PagedTokenToKVPoolAllocator(tokens, page_size, dtype, "cpu", dev, False)
    cfg = {**extra_config(kvtier_yaml, v1), **(extra or {})}
    with _LOCK:
        get_parallel().override_permanently(tp_rank=tp_rank, tp_size=tp_size, pp_rank=0, pp_size=1,
                                            attn_dcp_size=1, attn_dcp_rank=0)
        kind, pool = HiCacheController, host
        if hybrid:
            kind, pool = HybridCacheController, HostPoolGroup([PoolEntry(PoolName.KV, host, dev, lambda i: i,
                                                                        is_primary_index_anchor=True)])
        ctrl = kind(alloc, pool, page_size, None, threading.Event(), io_backend="direct",
                    storage_backend="dynamic", model_name=model, storage_backend_extra_config=cfg)
    # An fp8 cache is raw bytes in SGLang's pools (uint8): pages are moved and compared as such.
    return Engine(ctrl, host, layout, page_size, mla, shape, host.dtype)


# ---------------------------------------------------------------------- the oracle: SGLang's host layouts


def _token_view(e: Engine, slot: int, layer: int, comp: int) -> torch.Tensor:
    """Where one token's K (comp 0) / V (comp 1) of one layer lives in the host pool: a [H, D] view."""
    kv, P = e.host.kv_buffer, e.page_size
    p, t = divmod(slot, P)
    view: torch.Tensor
    if e.mla:
        view = {"layer_first": lambda: kv[layer, slot], "page_first": lambda: kv[slot, layer],
                "page_first_direct": lambda: kv[p, layer, t]}[e.layout]()
        return view
    view = {"layer_first": lambda: kv[comp, layer, slot], "page_first": lambda: kv[comp, slot, layer],
            "page_first_direct": lambda: kv[comp, p, layer, t],
            "page_head": lambda: kv[comp, p, :, t, layer]}[e.layout]()
    return view


def write_pages(e: Engine, slots: torch.Tensor, pages: torch.Tensor) -> None:
    """Put ``pages`` ([n, L, C, P, H, D]) into the host pool's token ``slots``, token by token."""
    L, C, P = e.shape[0], e.shape[1], e.shape[2]
    s = slots.tolist()
    for i in range(pages.shape[0]):
        for t in range(P):
            for layer in range(L):
                for c in range(C):
                    _token_view(e, s[i * P + t], layer, c).copy_(pages[i, layer, c, t])


def read_pages(e: Engine, slots: torch.Tensor) -> torch.Tensor:
    """The pages at token ``slots`` ([n, L, C, P, H, D]), token by token."""
    L, C, P = e.shape[0], e.shape[1], e.shape[2]
    s = slots.tolist()
    out = torch.empty((len(s) // P, *e.shape), dtype=e.dtype)
    for i in range(out.shape[0]):
        for t in range(P):
            for layer in range(L):
                for c in range(C):
                    out[i, layer, c, t] = _token_view(e, s[i * P + t], layer, c)
    return out


def random_pages(e: Engine, n: int, seed: int) -> torch.Tensor:
    """``n`` pages of random KV: every bit pattern of the dtype (NaNs and all), not just nice numbers."""
    g = torch.Generator().manual_seed(seed)
    raw = torch.randint(0, 256, (n, *e.shape, e.dtype.itemsize), generator=g, dtype=torch.uint8)
    return raw.view(e.dtype).reshape(n, *e.shape)


def page_keys(tokens: list[int], page_size: int) -> list[str]:
    """SGLang's own page keys for ``tokens`` (its native hash, as the controller computes them)."""
    return list(get_storage_hash_str(tokens, None, page_size=page_size))


# ---------------------------------------------------------------------- the scheduler's part


def _wait(q, what: str, timeout: float = 60.0):
    deadline = time.monotonic() + timeout
    while True:
        try:
            return q.get(timeout=0.05)
        except Empty:
            if time.monotonic() > deadline:
                raise TimeoutError(f"SGLang's controller never answered: {what}") from None


def backup(e: Engine, tokens: list[int], pages: torch.Tensor) -> tuple[int, torch.Tensor]:
    """Put ``pages`` into host memory and have the controller back them up to storage (its backup thread
    calls the backend), as the radix cache does for a node written to host.  Returns (tokens the
    controller reports stored, the host slots)."""
    P = e.page_size
    slots = e.host.alloc(len(tokens))
    assert slots is not None, "host pool full"
    write_pages(e, slots, pages)
    op_id = e.ctrl.write_storage(slots, tokens, hash_value=page_keys(tokens, P))
    while True:
        op = _wait(e.ctrl.ack_backup_queue, "backup ack")
        if op.id == op_id:
            return op.completed_tokens, slots


@dataclass
class Prefetch:
    hit_tokens: int  # what the storage hit query (batch_exists) found
    loaded_tokens: int  # what the transfer (batch_get*) delivered into host slots
    slots: torch.Tensor | None


def prefetch(e: Engine, tokens: list[int]) -> Prefetch:
    """A prefetch as the radix cache runs it: the controller's prefetch thread asks storage how many leading
    pages exist; on a hit, host slots are allocated and the transfer queued for its I/O thread, which
    reads the pages into those slots; the acks say how many tokens arrived."""
    c = e.ctrl
    rid = f"req-{len(e.rids)}"
    e.rids.append(rid)
    op = c.prefetch(CacheRequestHandle(rid, 0) if isinstance(c, HybridCacheController) else rid, tokens)
    got = _wait(c.prefetch_hit_queue, "storage hit query")
    assert got is op
    hit = op.storage_hit_count
    if hit == 0:
        return Prefetch(0, 0, None)
    slots = c.alloc_prefetch_host_buffers(op, hit)
    assert slots is not None, "host pool full"
    op.host_indices = slots
    c.prefetch_buffer.put(op)
    done = 0
    while True:
        ack = _wait(c.ack_prefetch_queue, "prefetch ack")
        if ack.operation is not op:
            continue
        if ack.completed_tokens is not None:
            done = max(done, ack.completed_tokens)
        if ack.completed_req:
            return Prefetch(hit, done, slots)
