"""The third-party package's backend runs kvtier's conformance suite, as a vendor's CI would."""

import pytest

from kvtier.testing import BackendConformance
from kvtier_memstore import MemStoreBackend


class TestMemStoreConformance(BackendConformance):
    @pytest.fixture
    def backend(self):
        return MemStoreBackend({"max_values": 10_000}, name="memstore")
