"""Deprecated name of :mod:`kvtier.format.blockformat` (the stored value's format moved into the format room
beside the layouts and grouped values).  Third-party backends that read into :class:`Segments` imported it
from here (the backends page documented that path); importing it still works, warns once, and gives the
very same module, so ``isinstance`` checks keep matching."""

import sys
import warnings

from .format import blockformat as _format

warnings.warn("kvtier.blockformat is deprecated: import kvtier.format.blockformat (same names)", DeprecationWarning,
              stacklevel=2)
sys.modules[__name__] = _format
