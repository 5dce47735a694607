"""``KvtierStorage``: kvtier as an SGLang HiCache storage backend (L3).

Enable it with::

    --enable-hierarchical-cache --hicache-storage-backend dynamic --hicache-storage-backend-extra-config
      '{"backend_name":"kvtier","module_path":"kvtier.integrations.sglang","class_name":"KvtierStorage",
        "interface_v1":1,"kvtier_config":"PATH.yaml"}'

SGLang builds it as ``KvtierStorage(storage_config, {})`` (its backend factory), then hands it the host
pool (``register_mem_pool_host``); only then are the page shape and so the kvtier namespace known, so the
backends are opened there.  ``interface_v1`` (recommended) moves pages between kvtier and the host pool's
slots directly (``batch_get_v1`` / ``batch_set_v1``); without it SGLang copies each page through a flat
tensor (``batch_get`` / ``batch_set``).  Both store the same canonical payload under the same keys.

Every SGLang-facing method answers a fault with a miss (``0``, ``False``, ``None``) and a log line, never
an exception: for a cache, a page that cannot be read is recomputed.
"""

from __future__ import annotations

import logging
from typing import Any

import torch
from sglang.srt.mem_cache.hicache_storage import HiCacheStorage, HiCacheStorageConfig, HiCacheStorageExtraInfo

from .facts import kvtier_config, refuse_unsupported
from .pages import PageCodec
from .store import PageStore, guarded

log = logging.getLogger("kvtier.sglang")


class KvtierStorage(HiCacheStorage):
    """kvtier's backends (local disk, Redis, S3, plugins), integrity checks and metrics behind SGLang's
    ``HiCacheStorage`` API."""

    def __init__(self, storage_config: HiCacheStorageConfig, kwargs: dict[str, Any] | None = None):
        refuse_unsupported(storage_config)
        self.storage_config = storage_config
        self.store: PageStore | None = None

    def register_mem_pool_host(self, mem_pool_host: Any) -> None:
        super().register_mem_pool_host(mem_pool_host)
        if self.store is not None:
            self.store.close()
            self.store = None
        codec = PageCodec(mem_pool_host, mla=bool(self.storage_config.is_mla_model))
        cfg = kvtier_config(self.storage_config, codec.geo)
        self.store = PageStore(cfg, codec)
        sc = self.storage_config
        if cfg.metrics.prometheus_port:
            self.store.serve_metrics(cfg.metrics.prometheus_port + sc.pp_rank * sc.tp_size + sc.tp_rank)
        log.info("kvtier: SGLang storage up: %s; %s; namespace %s%s", codec.describe(),
                 " -> ".join(f"{b.name} ({b.type}{'' if b.write else ', read-only'})" for b in cfg.backends)
                 or "no backends", self.store.namespace.id, " (read-only)" if self.store.read_only else "")

    def _store(self) -> PageStore:
        if self.store is None:
            raise RuntimeError("register_mem_pool_host was not called")
        return self.store

    def _page_ids(self, keys: list[str], host_indices: torch.Tensor) -> torch.Tensor:
        ids = self._store().codec.page_ids(host_indices, len(keys))
        if ids is None:
            raise ValueError(f"{len(keys)} pages but host indices that are not {len(keys)} whole, aligned pages "
                             f"({host_indices.numel()} slots)")
        return ids

    # ------------------------------------------------------------------ interface_v1 (zero-copy to slots)

    @guarded(lambda keys, *_: 0)
    def batch_exists(self, keys: list[str], extra_info: HiCacheStorageExtraInfo | None = None) -> int:
        return self._store().exists(keys)

    @guarded(lambda keys, *_: [False] * len(keys))
    def batch_get_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._store().get_pages(keys, self._page_ids(keys, host_indices))

    @guarded(lambda keys, *_: [False] * len(keys))
    def batch_set_v1(self, keys: list[str], host_indices: torch.Tensor,
                     extra_info: HiCacheStorageExtraInfo | None = None) -> list[bool]:
        return self._store().put_pages(keys, self._page_ids(keys, host_indices))

    # ------------------------------------------------------------------ SGLang's generic API (flat pages)

    @guarded(lambda *_: False)
    def exists(self, key: str) -> bool:
        return self._store().exists([key]) == 1

    @guarded(lambda *_: None)
    def get(self, key: str, target_location: Any = None, target_sizes: Any = None) -> torch.Tensor | None:
        return self._get_flat([key], [target_location])[0]

    @guarded(lambda keys, *_: [None] * len(keys))
    def batch_get(self, keys: list[str], target_locations: Any = None,
                  target_sizes: Any = None) -> list[torch.Tensor | None]:
        return self._get_flat(keys, list(target_locations or [None] * len(keys)))

    def _get_flat(self, keys: list[str], targets: list[Any]) -> list[torch.Tensor | None]:
        store = self._store()
        out: list[torch.Tensor | None] = [None] * len(keys)
        for a, b in store.chunks(len(keys)):
            rows = store.staging(b - a)
            for j, ok in enumerate(store.get_rows(keys[a:b], rows)):
                if not ok:
                    continue
                t = targets[a + j]
                if t is None:
                    t = self.mem_pool_host.get_dummy_flat_data_page()
                store.codec.row_to_flat(rows[j], t)
                out[a + j] = t
        return out

    @guarded(lambda *_: False)
    def set(self, key: str, value: Any = None, target_location: Any = None, target_sizes: Any = None) -> bool:
        return self._set_flat([key], [value])

    @guarded(lambda *_: False)
    def batch_set(self, keys: list[str], values: Any = None, target_locations: Any = None,
                  target_sizes: Any = None) -> bool:
        return self._set_flat(keys, list(values or []))

    def _set_flat(self, keys: list[str], values: list[Any]) -> bool:
        if len(values) != len(keys):
            raise ValueError(f"{len(keys)} keys but {len(values)} values")
        store = self._store()
        ok = True
        for a, b in store.chunks(len(keys)):
            rows = store.staging(b - a)
            for j in range(b - a):
                store.codec.flat_to_row(values[a + j], rows[j])
            ok = all(store.put_rows(keys[a:b], rows)) and ok
        return ok

    # ------------------------------------------------------------------ lifecycle

    def clear(self) -> None:
        """SGLang's flush: kvtier's storage is shared by every instance, so nothing is deleted here (use
        ``kvtier gc`` / ``kvtier verify --fix`` on the deployment's YAML)."""
        log.info("kvtier: SGLang asked to clear storage; kvtier's backends are shared, nothing deleted")

    def get_stats(self) -> None:
        return None  # SGLang's StorageMetrics has no room for kvtier's counters: see kvtier_stats()

    def kvtier_stats(self) -> dict[str, Any]:
        """kvtier's counters: per backend hits, misses, bytes, failures, latency; the namespace."""
        return self._store().stats()

    def close(self) -> None:
        if self.store is not None:
            self.store.close()
            self.store = None
