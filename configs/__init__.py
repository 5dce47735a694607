"""Example deployment configs; local.yaml is the embedded default."""
