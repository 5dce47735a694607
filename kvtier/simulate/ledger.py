"""A byte-free stand-in for a configured storage backend: which keys it holds, in what recency order,
and how many bytes that is, so a simulation sees the backend's capacity evictions and its traffic.

It is a real :class:`~kvtier.backend_api.StorageBackend` (so the manager's lookup probes it through the same
``BackendSet.longest_prefix`` as a real deployment), but it keeps no bytes.  The simulator records puts
and reads with :meth:`LedgerBackend.record_put` / :meth:`LedgerBackend.record_get`.

Capacity follows ``local_disk``'s rule, the one built-in backend with a capacity: every stored value
counts header + payload bytes; a put that does not fit evicts least recently used values first (a put
or a verified read makes a value most recent); a value bigger than the whole capacity is refused; the
evicted keys are told to the backend's ``on_evicted`` listener, so the manager forgets them there.  A
backend whose options have no ``capacity`` (Redis, S3: bounded by the server) is unbounded here.
"""

from __future__ import annotations

from collections import OrderedDict
from collections.abc import Iterator, Sequence
from typing import Any

from ..backend_api import StorageBackend, StoredBlock


class LedgerBackend(StorageBackend):
    """Keys and sizes only.  ``value_nbytes``: bytes one stored block takes (header + payload);
    ``capacity``: bytes kept (None = unbounded)."""

    def __init__(self, *, name: str, value_nbytes: int, capacity: int | None = None):
        super().__init__(None, name=name)
        if value_nbytes < 1:
            raise ValueError(f"{name}: value_nbytes must be >= 1, got {value_nbytes}")
        self.value_nbytes = value_nbytes
        self.capacity = capacity
        self._keys: OrderedDict[str, None] = OrderedDict()  # least recently used first
        self._held: dict[str, int] = {}  # keys a load will read: never evicted (local_disk's _inflight)
        self.puts = self.gets = self.evictions = self.refused = 0

    @classmethod
    def for_config(cls, backend: Any, payload_nbytes: int) -> LedgerBackend:
        """The ledger of a config ``backends[i]`` entry (its ``options.capacity`` if the plugin has one)."""
        cap = getattr(backend.options, "capacity", None)
        # The plugin's own framing (local_disk's aligned values take a page of header; sealed values a
        # longer one), so the ledger fills up after as many values as the real directory.
        value = backend.plugin().stored_value_nbytes(backend.options, payload_nbytes, backend.security != "none")
        return cls(name=backend.name or backend.type, value_nbytes=value, capacity=None if cap is None else int(cap))

    @property
    def nbytes(self) -> int:
        return len(self._keys) * self.value_nbytes

    @property
    def max_values(self) -> int | None:
        return None if self.capacity is None else self.capacity // self.value_nbytes

    def record_put(self, keys: Sequence[str]) -> list[bool]:
        """Store ``keys`` (in order): each becomes most recent, evicting the least recent to make room.
        The evicted keys go to ``on_evicted``, as local_disk's do."""
        cap = self.max_values
        evicted: list[str] = []
        if cap and not self._held:
            # Nothing held (no load in flight): every put that finds the ledger full evicts the least
            # recent value, the loop below without its checks (a full disk evicts on every put).
            held, first = self._keys, self._keys.popitem
            for key in keys:
                if key in held:  # a rewrite: it moves to the most recent end (cheaper than pop(key, None))
                    del held[key]
                if len(held) >= cap:
                    evicted.append(first(last=False)[0])
                held[key] = None
            self.puts += len(keys)
            self.evictions += len(evicted)
            if evicted:
                self._evicted(evicted)
            return [True] * len(keys)
        out = []
        for key in keys:
            if cap == 0:
                self.refused += 1
                out.append(False)
                continue
            self._keys.pop(key, None)
            if cap is not None and len(self._keys) >= cap and not self._make_room(cap, evicted):
                self.refused += 1  # the room is held by values being read (local_disk refuses too)
                out.append(False)
                continue
            self._keys[key] = None
            self.puts += 1
            out.append(True)
        if evicted:
            self._evicted(evicted)
        return out

    def _make_room(self, cap: int, evicted: list[str]) -> bool:
        """Evict least recent values not held until one more fits; False when only held ones are left."""
        while len(self._keys) >= cap:
            if not self._held:
                evicted.append(self._keys.popitem(last=False)[0])
            else:
                victim = next((k for k in self._keys if k not in self._held), None)
                if victim is None:
                    return False
                del self._keys[victim]
                evicted.append(victim)
            self.evictions += 1
        return True

    def hold(self, keys: Sequence[str]) -> None:
        for key in keys:
            self._held[key] = self._held.get(key, 0) + 1

    def release(self, keys: Sequence[str]) -> None:
        for key in keys:
            n = self._held.pop(key, 0) - 1
            if n > 0:
                self._held[key] = n

    def record_get(self, keys: Sequence[str]) -> list[bool]:
        """Read ``keys``: per key whether it was there (then it becomes most recent)."""
        out = []
        for key in keys:
            if key in self._keys:
                self._keys.move_to_end(key)
                self.gets += 1
                out.append(True)
            else:
                out.append(False)
        return out

    # ------------------------------------------------------------------ the StorageBackend hooks

    def _exists(self, keys: Sequence[str]) -> list[bool]:
        return [k in self._keys for k in keys]

    def contains_prefix(self, keys: Sequence[str]) -> int:
        # The base class validates every key string first; the simulator's keys come from the namespace,
        # so the walk alone is what a real probe answers.
        n = 0
        for k in keys:
            if k not in self._keys:
                break
            n += 1
        return n

    def _write(self, keys: Sequence[str], values: Sequence[tuple[bytes, memoryview]]) -> list[bool]:
        return self.record_put(keys)

    def _read_into(self, keys: Sequence[str], headers: Sequence[memoryview],
                   payloads: Sequence[memoryview]) -> list[int | None]:
        raise NotImplementedError(f"{self.name}: a simulated backend holds no bytes to read")

    def _delete(self, keys: Sequence[str]) -> int:
        return sum(self._keys.pop(k, 0) is None for k in keys)

    def _scan(self, prefix: str) -> Iterator[StoredBlock]:
        for k in list(self._keys):
            if k.startswith(prefix):
                yield StoredBlock(k, self.value_nbytes)


__all__ = ["LedgerBackend"]
