from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from sluice.sim.model import preset
from sluice.sim.server import serve_in_background


@pytest.fixture
async def sim_url() -> AsyncIterator[str]:
    """A fast simulated engine serving model 'sim'."""
    async with serve_in_background(preset("fast", model="sim")) as url:
        yield url


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=30) as client:
        yield client
