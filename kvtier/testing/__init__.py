"""Test support for kvtier and for third-party backends.

* ``BackendConformance`` (``kvtier.testing.conformance``): the suite every storage backend must pass.
  A third party inherits it and provides one fixture::

      from kvtier.testing import BackendConformance
      class TestMyBackend(BackendConformance):
          @pytest.fixture
          def backend(self, tmp_path): return MyBackend({"path": str(tmp_path)})

* ``kvtier.testing.redis_server`` / ``moto_server``: real servers for backend tests.

Importing this package needs nothing beyond kvtier; ``BackendConformance`` (loaded on first use) needs
pytest.
"""

from __future__ import annotations

from typing import Any

__all__ = ["BackendConformance"]


def __getattr__(name: str) -> Any:
    # Lazy, so that importing kvtier.testing.redis_server does not require pytest.
    if name == "BackendConformance":
        from .conformance import BackendConformance

        return BackendConformance
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
