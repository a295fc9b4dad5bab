from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from sluice.broker.memory import MemoryBroker
from tests.broker.conformance import (
    BrokerConformance,
    DispatchDeadlineConformance,
    KeyStoreConformance,
    make_settings,
)
from tests.broker.tenant_conformance import TenantLimitsConformance
from tests.helpers import FakeClock


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def broker(clock: FakeClock) -> AsyncIterator[MemoryBroker]:
    async with MemoryBroker(make_settings(clock)) as b:
        yield b


class TestMemoryBroker(
    BrokerConformance, TenantLimitsConformance, DispatchDeadlineConformance, KeyStoreConformance
):
    pass
