"""``kvtier`` command line.  Each subcommand lives in ``kvtier/tools/commands/<name>.py`` and exposes
``add_parser(subparsers)``; this file only discovers and dispatches them."""

from __future__ import annotations

import argparse
import importlib
import pkgutil
import sys

from .. import __version__


class UserError(Exception):
    """An error the user can fix (bad file, bad flag); printed without a traceback, exit 2."""


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="kvtier", description="Tiered KV-cache block storage for LLM serving engines.")
    parser.add_argument("--version", action="version", version=f"kvtier {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    from . import commands

    for mod in sorted(pkgutil.iter_modules(commands.__path__), key=lambda m: m.name):
        if not mod.name.startswith("_"):
            importlib.import_module(f"{commands.__name__}.{mod.name}").add_parser(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if not getattr(args, "func", None):
        parser.print_help()
        return 2
    try:
        return int(args.func(args) or 0)
    except (UserError, ValueError) as e:
        print(f"kvtier {args.command}: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
    except BrokenPipeError:  # `kvtier ... | head`: the reader left, which is not an error
        sys.stdout = None  # keep the interpreter from flushing again
        return 0


if __name__ == "__main__":
    sys.exit(main())
