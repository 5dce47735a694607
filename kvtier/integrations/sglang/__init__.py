"""kvtier inside SGLang: ``KvtierStorage``, a HiCache storage backend (``--hicache-storage-backend dynamic``
with ``"module_path":"kvtier.integrations.sglang","class_name":"KvtierStorage"``).

``KvtierStorage`` (``.storage``) imports SGLang; it is imported on first use, so ``.store`` (kvtier's page
store under it: keys, config checks, the stack) imports without SGLang installed.  The rest of kvtier
never imports SGLang.
"""

from __future__ import annotations

from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from .storage import KvtierStorage


def __getattr__(name: str) -> Any:
    # SGLang's dynamic backend factory does import_module(module_path) then getattr(module, class_name).
    if name == "KvtierStorage":
        from .storage import KvtierStorage

        return KvtierStorage
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")


__all__ = ["KvtierStorage"]
