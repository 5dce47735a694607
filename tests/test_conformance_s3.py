"""s3 passes the backend conformance suite against moto's server over HTTP."""

import pytest

pytest.importorskip("boto3")
pytest.importorskip("moto")

from kvtier.backends.s3 import S3Backend  # noqa: E402
from kvtier.testing import BackendConformance  # noqa: E402


class TestS3Conformance(BackendConformance):
    @pytest.fixture
    def backend(self, moto_server, s3_bucket):
        return S3Backend({"bucket": s3_bucket, "endpoint_url": moto_server.endpoint_url, "timeout_s": 10})


class TestS3PrefixedOneWorker(BackendConformance):
    """A key prefix, path-style addressing and no request concurrency pass it too."""

    @pytest.fixture
    def backend(self, moto_server, s3_bucket):
        return S3Backend({"bucket": s3_bucket, "endpoint_url": moto_server.endpoint_url, "prefix": "kv/",
                          "max_workers": 1, "addressing_style": "path", "timeout_s": 10})
