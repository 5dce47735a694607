"""The redis backend passes the backend conformance suite on a real single server and a real 3-node
Redis Cluster (both started by kvtier.testing.redis_server and flushed before every test)."""

import pytest

from kvtier.backends.redis import RedisBackend
from kvtier.testing import BackendConformance


class TestRedisConformance(BackendConformance):
    @pytest.fixture
    def backend(self, redis_server):  # noqa: F811 - the fixture above
        return RedisBackend({"url": redis_server.url})


class TestRedisSmallWindowsTTL(BackendConformance):
    """Pipelined batches split into many windows, a TTL on every SET, no key prefix."""

    @pytest.fixture
    def backend(self, redis_server):  # noqa: F811
        return RedisBackend({"url": redis_server.url, "window_bytes": 65536, "ttl_s": 600,
                             "key_prefix": ""})


class TestRedisClusterConformance(BackendConformance):
    @pytest.fixture
    def backend(self, redis_cluster):  # noqa: F811
        return RedisBackend({"url": redis_cluster.url})  # cluster mode is detected
