"""kvtier inside vLLM: ``KvtierConnector`` (``kv_connector_module_path = "kvtier.integrations.vllm"``).

Importing this package imports vLLM; the rest of kvtier never does.
"""

from .connector import KvtierConnector, KvtierMetadata, KvtierWorkerMetadata

__all__ = ["KvtierConnector", "KvtierMetadata", "KvtierWorkerMetadata"]
