"""The tier stack's room: one planner decides, executors run its decisions.

* :mod:`~kvtier.tiering.planner`: every placement decision (host slots, victims, what is written where,
  where a load's blocks come from) and the state they read; torch-free, never waits on I/O;
* :mod:`~kvtier.tiering.manager`: the scheduler half (lookups, backend probes), sharing the planner's
  index and lock in one process, on its own in vLLM's scheduler;
* the executors, which run the planner's decisions against device memory, host memory and backends:
  :mod:`~kvtier.tiering.store_path` (store, write-down, write-back), :mod:`~kvtier.tiering.load_path`
  (load, prefetch), :mod:`~kvtier.tiering.reads` (every backend read), :mod:`~kvtier.tiering.writes`
  (every put), over :mod:`~kvtier.tiering.parts` (what they share) and
  :mod:`~kvtier.tiering.backend_set` (the backends, used only through their contract);
* :mod:`~kvtier.tiering.results` and :mod:`~kvtier.tiering.load_steps`: what callers and executors hand
  each other.

:class:`kvtier.stack.TierStack` composes them in one process; ``kvtier simulate`` runs the same planner
with a ledger executor (:mod:`kvtier.simulate.ledger_stack`).  Nothing here imports the façade.
"""
