"""Tier codes: where a block is, one small int everywhere (index columns, lookups, load results), and
the backend bitmasks the index keeps per entry."""

from __future__ import annotations

import enum
from collections import Counter
from collections.abc import Iterable
from dataclasses import dataclass

MAX_BACKENDS = 32


class Tier(enum.IntEnum):
    """Where a block is, the one word for it everywhere (index columns, lookups, load results): an int
    enum, so tiers pack into an ``int8`` column; lower is faster to serve from.  Backend ``i`` of a
    deployment is the member ``Tier.backend(i)`` (``BACKEND_i`` = ``2 + i``); what a deployment *calls*
    its tiers (a backend's configured name) is :class:`TierNames`, for people and metric labels."""

    _ignore_ = ["_members", "_i"]
    MISSING = -1
    DEVICE = 0
    HOST = 1
    _members = vars()
    for _i in range(MAX_BACKENDS):
        _members[f"BACKEND_{_i}"] = 2 + _i

    @staticmethod
    def backend(i: int) -> Tier:
        """The tier of backend index ``i`` (0 <= i < 32)."""
        check_backend(i)
        return Tier(2 + i)

    @staticmethod
    def backend_index(code: int) -> int | None:
        """Backend index of a tier, or None for DEVICE / HOST / MISSING."""
        return code - 2 if code >= 2 else None

    @property
    def is_backend(self) -> bool:
        return self >= 2

    def as_backend_index(self) -> int:
        """The backend index of a backend tier (``ValueError`` for DEVICE / HOST / MISSING)."""
        if self < 2:
            raise ValueError(f"{self.name} is not a backend tier")
        return int(self) - 2

    @staticmethod
    def label(code: int) -> str:
        """"missing", "device", "host" or "backend[i]" (a deployment's own names: :class:`TierNames`)."""
        code = int(code)
        return _MEMORY_LABELS.get(code) or f"backend[{code - 2}]"


_MEMORY_LABELS = {-1: "missing", 0: "device", 1: "host"}

# Tier of an index column code (int8, -1..33), without Tier()'s per-call lookup.
TIER_OF_CODE: tuple[Tier, ...] = tuple(Tier(c) for c in range(-1, 2 + MAX_BACKENDS))


def tier_of(code: int) -> Tier:
    return TIER_OF_CODE[code + 1]


@dataclass(frozen=True)
class TierNames:
    """What one deployment calls its tiers: ``"device"``, ``"host"`` and each backend's configured name
    by index.  For reports, logs and metric labels; code compares :class:`Tier` members."""

    backends: tuple[str, ...] = ()

    def __call__(self, tier: int) -> str:
        i = Tier.backend_index(tier)
        return Tier.label(tier) if i is None or i >= len(self.backends) else self.backends[i]

    def count(self, tiers: Iterable[int]) -> dict[str, int]:
        """{name: how many of ``tiers``}, in the order the names first appear (per-tier figures for people)."""
        out: dict[str, int] = {}
        for t, n in Counter(tiers).items():  # each tier named once (a Counter keeps first appearances first)
            name = self(t)
            out[name] = out.get(name, 0) + n
        return out

    def tier(self, name: str) -> Tier:
        """The tier a name means (``ValueError`` naming the known ones when there is none)."""
        if name in ("device", "host"):
            return Tier.DEVICE if name == "device" else Tier.HOST
        if name in self.backends:
            return Tier.backend(self.backends.index(name))
        raise ValueError(f"no tier named {name!r}: expected device, host or one of {list(self.backends)}")


def check_backend(i: int) -> None:
    if not isinstance(i, int) or not 0 <= i < MAX_BACKENDS:
        raise ValueError(f"backend index must be an int in [0, {MAX_BACKENDS}), got {i!r}")


def mask_of(backends: Iterable[int]) -> int:
    mask = 0
    for i in backends:
        check_backend(i)
        mask |= 1 << i
    return mask


def mask_bits(mask: int) -> tuple[int, ...]:
    out = []
    while mask:
        low = mask & -mask
        out.append(low.bit_length() - 1)
        mask ^= low
    return tuple(out)


def tier_backend(tier: int) -> int:
    i = Tier.backend_index(tier)
    if i is None or i >= MAX_BACKENDS:
        raise ValueError(f"unknown tier code {tier!r}: expected DEVICE (0), HOST (1) or Tier.backend(i)")
    return i
