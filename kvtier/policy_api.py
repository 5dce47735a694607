"""Policy base classes: what a write, prefetch or eviction plugin implements.

A policy is a pure decision on counters and keys.  It never touches bytes, never does I/O and never
blocks: the tier stack calls it under its own lock and acts on the answer (copies, waits, evictions).
Each policy has an ``Options`` pydantic model (unknown keys are errors), validated from the YAML
``policies.<kind>.options`` mapping; plugins register in the entry-point groups of
:mod:`kvtier.plugins` (``kvtier.write_policies``, ``kvtier.prefetch_policies``,
``kvtier.eviction_policies``), exactly as the built-ins in ``kvtier.policies`` do.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any, ClassVar

from pydantic import BaseModel, ConfigDict

from .index import BlockIndex
from .plugins import strict_options


class PolicyOptions(BaseModel):
    """Base of every policy's options.  Unknown keys are errors."""

    model_config = ConfigDict(extra="forbid")


class Policy:
    """Holds validated options.  ``options`` may be an ``Options`` instance, a mapping or None."""

    # A plain pydantic BaseModel works too: strict_options makes its unknown keys errors all the same.
    Options: ClassVar[type[BaseModel]] = PolicyOptions

    def __init__(self, options: BaseModel | dict[str, Any] | None = None):
        strict = strict_options(self.Options)  # unknown keys are errors even for a plain BaseModel
        # A subclass declares ``options: <its Options>`` for the precise type (policies/write.py does).
        self.options: BaseModel
        if isinstance(options, self.Options):
            self.options = options
        elif isinstance(options, BaseModel):  # another model: its fields, validated as this policy's
            self.options = strict.model_validate(options.model_dump())
        else:
            self.options = strict.model_validate({} if options is None else options)

    def __repr__(self) -> str:
        return f"{type(self).__name__}({self.options!r})"


class WritePolicy(Policy):
    """When a block held in the host tier is copied down to the writable backends.

    Three moments, each answered True ("copy it down now") or False; the stack skips a copy when the
    block is already in every writable backend, so a policy only states intent:

    * ``on_store(key)``: the block has just landed in host memory from the device;
    * ``on_hit(key, hits)``: the block was served again (stored again or loaded); ``hits`` is its hit
      count including this one;
    * ``on_evict(key)``: the block is about to leave host memory.  True means the eviction completes
      the copy first and frees the slot only once a backend holds the block (write-back).
    """

    def on_store(self, key: bytes) -> bool:
        return False

    def on_hit(self, key: bytes, hits: int) -> bool:
        return False

    def on_evict(self, key: bytes) -> bool:
        return False

    def sends_on_store(self, keys: Sequence[bytes]) -> list[bytes]:
        """The blocks of a store's batch ``keys`` that ``on_store`` sends down, in order: the stack asks
        once per store.  A policy whose answer is the same for every block may override it to answer
        without a call per block; its answer must be ``on_store``'s."""
        on_store = self.on_store
        return [key for key in keys if on_store(key)]


class PrefetchPolicy(Policy):
    """How long :meth:`kvtier.stack.PrefetchHandle.wait` waits for blocks coming up from the backends.

    ``wait_seconds(num_tokens)``: 0 = take what has arrived and stop the rest; a number = wait at
    most that long, then take what has arrived; None = wait until the prefetch is complete (it is
    bounded by the backends' own timeouts).  The stack only starts a prefetch when the storage hit is
    at least ``policies.prefetch.threshold_tokens``; that threshold lives in the config, not here.
    """

    def wait_seconds(self, num_tokens: int) -> float | None:
        return 0.0


class EvictionPolicy(Policy):
    """Which blocks leave a full memory tier first.

    ``victims(index, tier, n)`` returns up to ``n`` keys present in ``tier`` with ref count 0 (never a
    pinned block: the stack pins every block a transfer or backend I/O uses), best to evict first.  It
    is called under the stack's lock with the stack's :class:`~kvtier.index.BlockIndex`, which it may
    read but must not change.  The ``on_*`` hooks let a policy keep its own order (ARC, S3-FIFO);
    they are called under the same lock.
    """

    def victims(self, index: BlockIndex, tier: int, n: int) -> list[bytes]:
        raise NotImplementedError

    def on_insert(self, tier: int, keys: Sequence[bytes]) -> None:
        """``keys`` entered ``tier``."""

    def on_access(self, tier: int, keys: Sequence[bytes]) -> None:
        """``keys`` were served from ``tier``."""

    def on_remove(self, tier: int, keys: Sequence[bytes]) -> None:
        """``keys`` left ``tier``."""


__all__ = ["EvictionPolicy", "Policy", "PolicyOptions", "PrefetchPolicy", "WritePolicy"]
