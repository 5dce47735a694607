"""``kvtier config check [FILE]`` and ``kvtier config schema``."""

from __future__ import annotations

import argparse
import json
import sys

from ..args import non_negative_int
from ._storage_tools import add_engine_argument, engine_model_line, engine_tiers


def add_parser(sub: argparse._SubParsersAction[argparse.ArgumentParser]) -> None:
    p = sub.add_parser("config", help="validate a config file, or print its JSON Schema",
                       description="Validate a kvtier YAML config, or print the JSON Schema editors use.")
    csub = p.add_subparsers(dest="config_command", metavar="ACTION", required=True)

    c = csub.add_parser(
        "check", help="validate a config file (exit 0 if valid, 2 if not)",
        description="Load FILE as kvtier would (environment overrides KVTIER_... included), validate every "
                    "key and every plugin's options, and print a one-line summary of the tiers.  A YAML "
                    "whose model section vLLM or SGLang fills (absent or incomplete; --engine) is checked as "
                    "that engine will fill it, and the output says so.  Each problem is printed as "
                    "`path: problem`.  Exit status 0 when valid, 2 otherwise.")
    c.add_argument("files", nargs="*", metavar="FILE",
                   help="YAML config file(s) (default: the embedded default, configs/local.yaml); give a "
                        "P/D pair to compare their namespace ids")
    c.add_argument("--no-env", action="store_true", help="ignore KVTIER_... environment overrides")
    add_engine_argument(c)
    c.set_defaults(func=_check)

    s = csub.add_parser(
        "schema", help="print the JSON Schema of the config file",
        description="Print the JSON Schema of kvtier's YAML config, for editors (e.g. the YAML language "
                    "server: `# yaml-language-server: $schema=kvtier.schema.json`).  Plugin options are "
                    "free objects here; `kvtier config check` validates them.")
    s.add_argument("--indent", type=non_negative_int, default=2, help="JSON indentation (default 2)")
    s.set_defaults(func=_schema)


def _check(args: argparse.Namespace) -> int:
    """Exit 0 when every file is valid, 2 when any is not (all are checked either way)."""
    from ...config import ConfigError, load_config_as_deployed

    rc = 0
    for path in args.files or [None]:
        name = path or "(embedded default config)"
        try:
            cfg, filled = load_config_as_deployed(path, args.engine, env={} if args.no_env else None)
        except ConfigError as e:
            n = len(e.problems)
            print(f"{name}: invalid ({n} problem{'s' if n != 1 else ''})", file=sys.stderr)
            for line in e.problems:
                print(f"  {line}", file=sys.stderr)
            rc = 2
            continue
        print(f"{name}: ok")
        if filled is None:
            print(f"  tiers: {cfg.summary()}")
            print(f"  namespace: {cfg.namespace().id} ({cfg.model.id}, {cfg.model.kv_dtype}, {cfg.keys.algo})")
            continue
        print(f"  tiers: {engine_tiers(cfg, args.engine)}")
        print(f"  {engine_model_line(cfg, args.engine, filled)}")
        keys = f"{cfg.keys.algo} keys" if args.engine != "auto" or "algo" in cfg.keys.model_fields_set else \
            "sha256_cbor keys under vLLM, sglang_sha256 under SGLang"
        print(f"  namespace: set at start-up from the engine's model ({keys})")
    return rc


def _schema(args: argparse.Namespace) -> int:
    from ...config import json_schema

    print(json.dumps(json_schema(), indent=args.indent if args.indent > 0 else None))
    return 0
