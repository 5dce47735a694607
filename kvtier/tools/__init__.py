"""The tools room: the ``kvtier`` command line (:mod:`~kvtier.tools.cli`), its subcommands
(:mod:`~kvtier.tools.commands`) and the benchmarks behind ``kvtier bench`` (:mod:`~kvtier.tools.bench`).

Invariant: tools sit on top: they import the library's rooms, and nothing outside this room imports them
(an engine integration never needs the command line).
"""
