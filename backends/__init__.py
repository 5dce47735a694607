"""Built-in storage backends, installed as ``kvtier.backends`` and registered by entry point."""
