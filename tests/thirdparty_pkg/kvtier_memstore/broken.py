"""A plugin whose import fails, as a vendor package with a missing dependency would."""

import kvtier_memstore_missing_dependency  # noqa: F401

BrokenBackend = None
