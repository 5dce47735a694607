"""kvtier's log lines in a vLLM server's output.

vLLM configures only its own ``vllm`` logger (a handler on it, ``propagate=False``) and leaves the root
logger bare.  Inside ``vllm serve`` every INFO line kvtier writes (the tiers it runs, the load-failure
policy it sets, each failed load) was therefore dropped, and warnings reached stderr through Python's
last-resort handler without a time or a process name.  :func:`join_vllm_logging` gives the ``kvtier``
logger a handler of its own that writes where vLLM's does, in vLLM's format, so an operator reads
``(EngineCore pid=414) INFO ... [connector.py:118] kvtier: scheduler side up ...`` beside vLLM's lines.
"""

from __future__ import annotations

import logging
import os

ENV_LEVEL = "KVTIER_LOG_LEVEL"
_LEVELS = ("DEBUG", "INFO", "WARNING", "ERROR", "CRITICAL")


def log_level(default: str) -> str:
    """``KVTIER_LOG_LEVEL`` (a level name, any case), else ``default``; ValueError naming the variable."""
    raw = os.environ.get(ENV_LEVEL, "").strip()
    if not raw:
        return default
    if raw.upper() not in _LEVELS:
        raise ValueError(f"{ENV_LEVEL}={raw!r}: expected one of {', '.join(_LEVELS)}")
    return raw.upper()


def join_vllm_logging() -> bool:
    """Give the ``kvtier`` logger a handler like vLLM's (same stream, same formatter) at
    ``KVTIER_LOG_LEVEL``, else vLLM's own level.  Returns whether it attached one.

    It leaves logging alone where someone already set it up: the ``kvtier`` logger has a handler (an
    earlier call in this process, or the application's), or the root logger has one (a script's
    ``logging.basicConfig``: kvtier's records reach it by propagation), or vLLM configured no handler
    of its own (``VLLM_CONFIGURE_LOGGING=0``: the user wants no library to touch logging)."""
    ours = logging.getLogger("kvtier")
    if ours.handlers or logging.getLogger().handlers:
        return False
    vllm = logging.getLogger("vllm")
    theirs = next((h for h in vllm.handlers if isinstance(h, logging.StreamHandler)), None)
    if theirs is None:
        return False
    handler = logging.StreamHandler(theirs.stream)
    handler.setFormatter(theirs.formatter)
    ours.setLevel(log_level(logging.getLevelName(vllm.getEffectiveLevel())))
    ours.addHandler(handler)
    ours.propagate = False  # the root logger has no handler; an application adding one later gets no doubles
    return True


__all__ = ["ENV_LEVEL", "join_vllm_logging", "log_level"]
