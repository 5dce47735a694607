"""kvtier as a secondary tier of vLLM's own KV offloading (``OffloadingConnector``'s tiering).

vLLM loads an out-of-tree tier by class name and module path from its offloading config::

    --kv-transfer-config '{"kv_connector": "OffloadingConnector", "kv_role": "kv_both",
        "kv_connector_extra_config": {"spec_name": "TieringOffloadingSpec", "cpu_bytes_to_use": 8589934592,
            "secondary_tiers": [{"type": "KvtierTier", "module_path": "kvtier.integrations.vllm_tier",
                                 "kvtier_config": "configs/vllm-tier.yaml"}]}}'

Importing this package imports vLLM; the rest of kvtier never does.  See docs/vllm-tier.md.
"""

from .naming import TierNaming, tier_naming
from .tier import KvtierTier, TierMetrics

__all__ = ["KvtierTier", "TierMetrics", "TierNaming", "tier_naming"]
