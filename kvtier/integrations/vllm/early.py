"""kvtier's part of a vLLM command line, checked before vLLM loads the model.

vLLM hands a KV connector its config only once the model's weights are loaded and its KV cache is sized:
each worker builds its side in ``initialize_from_config``, the EngineCore its scheduler side after that.
A typo in kvtier's YAML would be found only then (70 s into the start of the test model here, minutes for
a real one), among vLLM's tracebacks.  vLLM imports the connector's *module* much earlier, though: while it
builds its ``VllmConfig`` from the command line (``KVConnectorFactory.get_connector_class``, asking whether
the connector supports the hybrid KV cache manager), in the server's first process, before any engine
process or model exists.  At that import :func:`check_at_import` finds the ``KVTransferConfig`` being
built on the importer's stack and checks kvtier's part of it: the extra config's keys and values, the YAML
as vLLM will fill it (every key, every plugin's options; ``kvtier.config.load_config_as_deployed``), and
that an explicit ``keys.seed`` agrees with the seed of vLLM's own block hashes.

Invariants:
* a problem found here stops the server before the model loads, as one ``ERROR ... kvtier: ...`` line
  that ends its log, with no traceback (the process exits with status 2, as ``kvtier config check``);
  used as a library (``vllm.LLM(...)``) it raises ``ValueError`` with that line instead of exiting;
* when the config is not found on the stack (another vLLM version, the module imported some other way),
  nothing is checked here and the connector checks the same things when vLLM builds it;
* nothing here touches the model, a backend or the network: the YAML is read, never the stores it names.
"""

from __future__ import annotations

import logging
import sys
from types import FrameType
from typing import Any

from ...config import ConfigError, load_config_as_deployed
from .facts import check_extra_config, key_seed_problem
from .logs import join_vllm_logging
from .scheduler import LoadMode
from .worker import idle_wait_ms

log = logging.getLogger("kvtier.vllm")
CONNECTOR = "KvtierConnector"
MAX_FRAMES = 64  # how far up the importer's stack to look (the config is about 10 frames up in vLLM 0.32)


def configs_on_stack(frame: FrameType | None) -> tuple[Any, Any]:
    """The ``KVTransferConfig`` naming this connector and the ``VllmConfig`` being built, found in the
    frames from ``frame`` up (by type name: importing vLLM's config classes here would import them
    before vLLM is ready); None for what is not there."""
    ktc = vc = None
    for _ in range(MAX_FRAMES):
        if frame is None:
            break
        local = frame.f_locals
        cand = local.get("kv_transfer_config")
        if ktc is None and type(cand).__name__ == "KVTransferConfig" and \
                getattr(cand, "kv_connector", None) == CONNECTOR:
            ktc = cand
        me = local.get("self")
        if vc is None and type(me).__name__ == "VllmConfig":
            vc = me
        frame = frame.f_back
    return ktc, vc


def problem(kv_transfer_config: Any, vllm_config: Any) -> str | None:
    """The first problem with kvtier's part of vLLM's config, as one line; None when there is none."""
    extra = kv_transfer_config.kv_connector_extra_config or {}
    try:
        check_extra_config(extra)
        LoadMode.from_extra_config(extra)
        idle_wait_ms(extra)
    except ValueError as e:
        return str(e)
    try:
        cfg, _ = load_config_as_deployed(extra.get("kvtier_config"), "vllm")
    except ConfigError as e:
        return f"kvtier: {e.source}: " + "; ".join(e.problems)
    cache = getattr(vllm_config, "cache_config", None)
    seed = key_seed_problem(cfg, getattr(cache, "prefix_caching_hash_algo", None))
    return None if seed is None else f"kvtier: {extra.get('kvtier_config')}: {seed}"


def _serving() -> bool:
    """Whether this process is vLLM's server (``python -m vllm.entrypoints...`` or ``vllm serve``), where
    exiting is the way to stop; a library user gets an exception."""
    main = sys.modules.get("__main__")
    spec = getattr(main, "__spec__", None)
    name = getattr(spec, "name", "") or ""
    return name.startswith("vllm.") or sys.argv[0].rsplit("/", 1)[-1] == "vllm"


def check_at_import() -> None:
    """Run at this package's import: see the module docstring."""
    ktc, vc = configs_on_stack(sys._getframe(1))
    if ktc is None:
        return
    line = problem(ktc, vc)
    if line is None:
        return
    if not _serving():
        raise ValueError(line)
    join_vllm_logging()
    log.error("%s (checked before the model loads; the server stops)", line)
    raise SystemExit(2)
