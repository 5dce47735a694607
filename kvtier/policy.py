"""Deprecated name of :mod:`kvtier.policy_api` (renamed so that the policy bases are not one letter away
from the ``kvtier.policies`` package of built-ins).  Importing it still works, warns once, and gives the
very same module."""

import sys
import warnings

from . import policy_api as _api

warnings.warn("kvtier.policy is deprecated: import kvtier.policy_api (same names)", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _api
