"""The backend conformance suite against the simulator (``sluice sim``), in the test's event loop."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from sluice.backends.openai import OpenAIBackend
from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.backends.conformance import BackendConformance, Target, open_backend

# The fast preset with a slower step: 8 tokens take 8 ms, a 30,000-token answer 30 s.
PARAMS = preset("fast", model="sim", base_step_s=0.001)


class SimTarget(Target):
    """A simulator, read through its ``/sim/stats``."""

    long_tokens = 30_000

    def __init__(self, url: str, model: str, http: httpx.AsyncClient) -> None:
        self.url = url
        self.model = model
        self._http = http

    async def _stats(self) -> dict[str, Any]:
        response = await self._http.get(self.url + "/sim/stats")
        response.raise_for_status()
        stats: dict[str, Any] = response.json()
        return stats

    async def in_flight(self) -> int:
        stats = await self._stats()
        return int(stats["running"]) + int(stats["waiting"])

    async def aborted(self) -> int | None:
        return int((await self._stats())["aborted_total"])


@pytest.fixture
async def target() -> AsyncIterator[SimTarget]:
    async with (
        serve_in_background(PARAMS) as url,
        httpx.AsyncClient(trust_env=False, timeout=5) as http,
    ):
        yield SimTarget(url, PARAMS.model, http)


@pytest.fixture
async def backend(target: SimTarget) -> AsyncIterator[OpenAIBackend]:
    async with open_backend(target) as b:
        yield b


class TestSimulator(BackendConformance):
    pass
