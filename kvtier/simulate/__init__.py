"""``kvtier simulate``: size the tiers before buying them.

A workload (a trace, or ``kvtier run``'s synthetic chat) is replayed through the engine and a byte-free
twin of the tier stack (:mod:`kvtier.simulate.ledger_stack`: the stack's own planner, no bytes),
once per point of a grid of config overrides, and reports hit rate per tier, prefill tokens saved,
traffic per tier and evictions for each point.
"""

from .ledger import LedgerBackend
from .ledger_stack import SimulatedStack
from .replay import NullModel, SimResult, block_nbytes, simulate

__all__ = ["LedgerBackend", "NullModel", "SimResult", "SimulatedStack", "block_nbytes", "simulate"]
