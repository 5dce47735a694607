"""One module per ``kvtier`` subcommand, each with ``add_parser(subparsers)``."""
