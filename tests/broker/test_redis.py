from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from sluice.broker.redis import RedisBroker
from tests.broker.conformance import BrokerConformance, make_settings
from tests.helpers import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def broker(clock: FakeClock, redis_url: str) -> AsyncIterator[RedisBroker]:
    async with RedisBroker(redis_url, make_settings(clock)) as b:
        yield b


class TestRedisBroker(BrokerConformance):
    pass
