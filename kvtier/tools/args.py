"""Argument types the subcommands and benchmarks share: an out-of-range number is argparse's own error, naming the flag
(``argument --jobs: expected an integer >= 0, got '-1'``), before anything runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable
from pathlib import Path


def int_at_least(low: int) -> Callable[[str], int]:
    """An argparse ``type``: an integer >= ``low``."""

    def parse(text: str) -> int:
        try:
            value = int(text)
        except ValueError:
            value = low - 1
        if value < low:
            raise argparse.ArgumentTypeError(f"expected an integer >= {low}, got {text!r}")
        return value

    parse.__name__ = f"integer >= {low}"  # what argparse says of a value it could not convert
    return parse


positive_int = int_at_least(1)
non_negative_int = int_at_least(0)


def positive_size(text: str) -> int:
    """An argparse ``type``: a size of at least one byte (``"1GiB"``, ``"4096"``)."""
    from ..units import parse_size

    try:
        value = parse_size(text)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"expected a size of at least 1 byte, got {text!r}")
    return value


positive_size.__name__ = "size"


def positive_sizes(text: str) -> list[int]:
    """An argparse ``type``: comma-separated sizes of at least one byte each (``"2MiB,256KiB"``)."""
    sizes = [positive_size(part.strip()) for part in text.split(",") if part.strip()]
    if not sizes:
        raise argparse.ArgumentTypeError(f"expected comma-separated sizes, got {text!r}")
    return sizes


positive_sizes.__name__ = "sizes"


def _creatable_dir(text: str, path: Path) -> None:
    """``path`` is a directory, or can be made one: its nearest existing ancestor is a directory."""
    here = path
    while not here.exists() and here != here.parent:
        here = here.parent
    if not here.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r}: {str(here)!r} is not a directory")


def out_dir(text: str) -> str:
    """An argparse ``type``: a directory to write into, there already or creatable, checked before the
    work whose results it receives; ``~`` expanded."""
    path = Path(text).expanduser()
    _creatable_dir(text, path)
    return str(path)


def out_file(text: str) -> str:
    """An argparse ``type``: a file to write, not a directory, in a directory there already or creatable
    (the writer makes it: :func:`write_out`), checked before the work; ``~`` expanded."""
    path = Path(text).expanduser()
    if path.is_dir():
        raise argparse.ArgumentTypeError(f"{text!r} is a directory")
    _creatable_dir(text, path.parent)
    return str(path)


out_dir.__name__, out_file.__name__ = "directory", "file"


def make_out_dir(flag: str, text: str) -> Path:
    """Create the output directory now, before the work that fills it; a ``UserError`` naming the flag
    when the system refuses (what :func:`out_dir` cannot see: permissions, read-only mounts)."""
    from .cli import UserError

    path = Path(text).expanduser()
    try:
        path.mkdir(parents=True, exist_ok=True)
    except OSError as e:
        raise UserError(f"{flag} {text}: cannot create the directory: {e.strerror or e}") from None
    return path


def write_out(flag: str, text: str, write: Callable[[Path], object]) -> None:
    """``write(path)`` for an :func:`out_file` argument, its directory made first; a ``ValueError`` naming
    the flag when the system refuses."""
    path = Path(text).expanduser()
    try:
        path.parent.mkdir(parents=True, exist_ok=True)
        write(path)
    except OSError as e:
        raise ValueError(f"{flag} {text}: {e.strerror or e}") from None
