"""kvtier-memstore: an in-memory storage backend, written only against kvtier's public contract."""

from __future__ import annotations

import threading
from collections.abc import Iterator, Sequence
from typing import Any

from kvtier.backend_api import BackendOptions, StorageBackend, StoredBlock


class MemStoreOptions(BackendOptions):
    max_values: int = 1_000_000


class MemStoreBackend(StorageBackend):
    """Values live in a dict guarded by one lock; each value is replaced as a whole (atomic per key)."""

    Options = MemStoreOptions
    options: MemStoreOptions  # the validated options, typed as this backend's own

    def __init__(self, options: MemStoreOptions | dict[str, Any] | None = None, *, name: str | None = None):
        super().__init__(options, name=name)
        self._values: dict[str, bytes] = {}
        self._mu = threading.Lock()

    def _write(self, keys: Sequence[str], values: Sequence[tuple[bytes, memoryview]]) -> list[bool]:
        ok = []
        with self._mu:
            for key, (header, payload) in zip(keys, values):
                if key not in self._values and len(self._values) >= self.options.max_values:
                    ok.append(False)
                    continue
                self._values[key] = bytes(header) + bytes(payload)
                ok.append(True)
        return ok

    def _read_into(self, keys: Sequence[str], headers: Sequence[memoryview],
                   payloads: Sequence[memoryview]) -> list[int | None]:
        out: list[int | None] = []
        with self._mu:
            for key, h, p in zip(keys, headers, payloads):
                v = self._values.get(key)
                if v is None:
                    out.append(None)
                    continue
                n = min(len(h), len(v))
                h[:n] = v[:n]
                m = min(len(p), len(v) - n)
                p[:m] = v[n : n + m]
                out.append(len(v))
        return out

    def _exists(self, keys: Sequence[str]) -> list[bool]:
        with self._mu:
            return [k in self._values for k in keys]

    def _delete(self, keys: Sequence[str]) -> int:
        with self._mu:
            return sum(self._values.pop(k, None) is not None for k in keys)

    def _scan(self, prefix: str) -> Iterator[StoredBlock]:
        with self._mu:
            items = [(k, len(v)) for k, v in self._values.items() if k.startswith(prefix)]
        for k, n in items:
            yield StoredBlock(k, n)

    def _usage(self) -> dict[str, Any]:
        with self._mu:
            return {"blocks": len(self._values), "bytes": sum(map(len, self._values.values()))}

