from __future__ import annotations

from collections.abc import AsyncIterator, Iterator

import pytest

from tests.broker.brokers import empty_redis
from tests.redis_server import RedisServer


@pytest.fixture(scope="package")
def redis_server() -> Iterator[RedisServer]:
    """One throw-away ``redis-server`` for the broker tests (never the shared one on 6379); it goes
    when they are done, so that no other test finds a stray child process."""
    with RedisServer() as server:
        yield server


@pytest.fixture
async def redis_url(redis_server: RedisServer) -> AsyncIterator[str]:
    """The server's URL, emptied before the test."""
    yield await empty_redis(redis_server)
