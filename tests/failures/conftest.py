from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.redis_server import RedisServer


@pytest.fixture
def redis() -> Iterator[RedisServer]:
    """A fresh, durable Redis for each failure test: AOF with fsync on every write."""
    with RedisServer(aof=True, appendfsync="always") as server:
        yield server
