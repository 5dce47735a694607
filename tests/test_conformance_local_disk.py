"""local_disk passes the backend conformance suite (the same one a third-party backend runs)."""

import pytest

from kvtier.backends.local_disk import LocalDiskBackend
from kvtier.testing import BackendConformance


class TestLocalDiskConformance(BackendConformance):
    @pytest.fixture
    def backend(self, tmp_path):
        return LocalDiskBackend({"path": str(tmp_path / "disk"), "capacity": "1GiB"})


class TestLocalDiskOneThreadFsync(BackendConformance):
    """The inline (no pool) and fsync paths pass it too."""

    @pytest.fixture
    def backend(self, tmp_path):
        return LocalDiskBackend({"path": str(tmp_path / "disk"), "capacity": "1GiB", "threads": 1,
                                 "fsync": True})
