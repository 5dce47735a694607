"""Built-in write, prefetch and eviction policies, installed as ``kvtier.policies`` and registered by
entry point."""
