from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from hypothesis import settings

from sluice.sim.model import preset
from sluice.sim.server import serve_in_background

# No example database: a test run leaves no .hypothesis/ folder in the checkout.
settings.register_profile("sluice", database=None)
settings.load_profile("sluice")


@pytest.fixture
async def sim_url() -> AsyncIterator[str]:
    """A fast simulated engine serving model 'sim'."""
    async with serve_in_background(preset("fast", model="sim")) as url:
        yield url


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30) as client:
        yield client
