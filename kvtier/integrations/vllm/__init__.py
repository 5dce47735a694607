"""kvtier inside vLLM: ``KvtierConnector`` (``kv_connector_module_path = "kvtier.integrations.vllm"``).

Importing this package imports vLLM; the rest of kvtier never does.
"""

from .connector import KvtierConnector, KvtierMetadata, KvtierWorkerMetadata
from .early import check_at_import

# vLLM imports this package while it builds its config from the command line: kvtier's YAML is checked
# there, before the model loads (kvtier.integrations.vllm.early).
check_at_import()

__all__ = ["KvtierConnector", "KvtierMetadata", "KvtierWorkerMetadata"]
