"""Deprecated name of :mod:`kvtier.backend_api` (renamed so that the contract third parties subclass is not
one letter away from the ``kvtier.backends`` package of built-ins).  Importing it still works, warns once,
and gives the very same module, so ``isinstance`` and ``except`` clauses keep matching."""

import sys
import warnings

from . import backend_api as _api

warnings.warn("kvtier.backend is deprecated: import kvtier.backend_api (same names)", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _api
