"""Byte sizes with units, as written in config files: ``4GiB``, ``512MiB``, ``1.5GB``, ``100kB``, ``0``.

* Binary units are powers of 1024 (``KiB MiB GiB TiB PiB``), decimal units powers of 1000
  (``kB MB GB TB PB``); ``B`` is bytes.  Units are case-insensitive (``4gib`` == ``4GiB``), so ``KB``
  means 1000 like ``kB``; a space between number and unit is allowed.
* A bare number (int, or a string of digits) is bytes.  A fraction is allowed with a unit
  (``1.5GiB``); the result is rounded down to whole bytes.
* Single-letter units (``4G``, ``512M``) are refused: whether they mean 1000 or 1024 is exactly the
  ambiguity that makes a "4G" cache 7% smaller than its author thought.

``ByteSize`` is the pydantic type for such fields; backends can use it for their own ``capacity``
options so every size in a config file is spelled the same way.
"""

from __future__ import annotations

import re
from decimal import Decimal, InvalidOperation
from typing import Annotated, Any

from pydantic import BeforeValidator, Field, WithJsonSchema
from pydantic_core import PydanticCustomError

UNITS: dict[str, int] = {
    "b": 1,
    "kb": 1000, "mb": 1000**2, "gb": 1000**3, "tb": 1000**4, "pb": 1000**5,
    "kib": 1024, "mib": 1024**2, "gib": 1024**3, "tib": 1024**4, "pib": 1024**5,
}
UNIT_NAMES = ("B", "KiB", "MiB", "GiB", "TiB", "PiB", "kB", "MB", "GB", "TB", "PB")
SIZE_PATTERN = r"^\s*([0-9]+(\.[0-9]*)?|\.[0-9]+)\s*(([kKmMgGtTpP][iI]?)?[bB])?\s*$"
_SIZE = re.compile(r"^\s*(?P<num>[0-9]+(?:\.[0-9]*)?|\.[0-9]+)\s*(?P<unit>[A-Za-z]*)\s*$")


def parse_size(value: Any) -> int:
    """``value`` (int bytes or a string with a unit) as int bytes; ``ValueError`` naming the value.

    Invariant: the result is an int >= 0; floats are accepted only when whole (YAML ``1.0e9``).
    """
    if isinstance(value, bool):
        raise ValueError(f'expected a size like "4GiB", got {str(value).lower()}')
    if isinstance(value, int):
        if value < 0:
            raise ValueError(f'expected a size >= 0 like "4GiB", got {value}')
        return value
    if isinstance(value, float):
        if value.is_integer() and value >= 0:
            return int(value)
        raise ValueError(f'expected a size like "4GiB" (whole bytes), got {value!r}')
    if not isinstance(value, str):
        raise ValueError(f'expected a size like "4GiB", got {type(value).__name__} {value!r}')
    m = _SIZE.match(value)
    if not m:
        raise ValueError(f'expected a size like "4GiB", got "{value}"')
    unit = m["unit"].lower()
    if unit and unit not in UNITS:
        raise ValueError(f'expected a size like "4GiB", got "{value}": unknown unit "{m["unit"]}" '
                         f"(use one of {', '.join(UNIT_NAMES)})")
    if not unit and "." in m["num"]:
        raise ValueError(f'expected a size like "4GiB", got "{value}": bytes must be a whole number')
    try:
        number = Decimal(m["num"])
    except InvalidOperation:  # pragma: no cover - the regex admits only valid decimals
        raise ValueError(f'expected a size like "4GiB", got "{value}"') from None
    return int(number * (UNITS[unit] if unit else 1))


def format_size(n: int) -> str:
    """``n`` bytes in the largest binary unit that keeps it short: 268435456 -> ``"256MiB"``."""
    for name in ("PiB", "TiB", "GiB", "MiB", "KiB"):
        scale = UNITS[name.lower()]
        if n >= scale:
            q = n / scale
            return f"{q:.0f}{name}" if n % scale == 0 else f"{q:.1f}{name}"
    return f"{n}B"


def _validate(value: Any) -> int:
    try:
        return parse_size(value)
    except ValueError as e:
        # A custom error type lets the config layer print the message as is, without "Value error, ".
        raise PydanticCustomError("size", str(e)) from None


ByteSize = Annotated[
    int,
    BeforeValidator(_validate),
    Field(ge=0),
    WithJsonSchema({
        "anyOf": [
            {"type": "integer", "minimum": 0},
            {"type": "string", "pattern": SIZE_PATTERN},
        ],
        "description": 'A size: int bytes, or a number with a unit: "4GiB", "512MiB", "1.5GB", "100kB", "0". '
                       "Binary units KiB/MiB/GiB/TiB are powers of 1024, decimal kB/MB/GB/TB powers of "
                       "1000; units are case-insensitive.",
    }),
]
