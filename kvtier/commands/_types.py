"""Argument types the subcommands share: an out-of-range number is argparse's own error, naming the flag
(``argument --jobs: expected an integer >= 0, got '-1'``), before anything runs."""

from __future__ import annotations

import argparse
from collections.abc import Callable


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
