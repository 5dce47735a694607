"""kvtier: keep LLM KV-cache blocks beyond GPU memory (pinned host, local disk, Redis, S3), keyed by
chained block hashes so a prefix stored by one process is found by another, on any host."""

__version__ = "0.1.0"

from .keys import BlockHasher, LoRA, MMItem, Namespace, SequenceHasher  # noqa: E402

__all__ = ["BlockHasher", "LoRA", "MMItem", "Namespace", "SequenceHasher", "__version__"]
