"""The test fork server (tests/vllm/forkserver.py), loaded once per test process, for every module that
forks its engine runs from it (test_vllm.py, test_pd.py; test_sglang_vllm.py through test_vllm): one
server, so torch, transformers and vLLM are imported once.  Loaded by path: a ``vllm`` directory on
sys.path would shadow vLLM itself."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from typing import Any


def _load() -> Any:
    spec = importlib.util.spec_from_file_location("kvtier_vllm_forkserver",
                                                  Path(__file__).parent / "vllm" / "forkserver.py")
    assert spec is not None and spec.loader is not None
    mod = sys.modules.get(spec.name)
    if mod is None:
        mod = importlib.util.module_from_spec(spec)
        sys.modules[spec.name] = mod
        spec.loader.exec_module(mod)
    return mod


forkserver = _load()
