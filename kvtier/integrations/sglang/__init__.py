"""kvtier inside SGLang: ``KvtierStorage``, a HiCache storage backend (``--hicache-storage-backend dynamic``
with ``"module_path":"kvtier.integrations.sglang","class_name":"KvtierStorage"``).

Importing this package imports SGLang; the rest of kvtier never does.
"""

from .storage import KvtierStorage

__all__ = ["KvtierStorage"]
