"""Gateway.model_info's keeping of the workers' model info: a described model's info is kept for
SERVED_CACHE_S, and an empty answer too, for the shorter EMPTY_INFO_CACHE_S (it was read from the
broker on every request), so that a worker that has just registered is described soon. The
broker's reads are counted; the gateway's clock is a fake one."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator
from types import SimpleNamespace
from typing import Any

import pytest
from starlette.requests import Request

from sluice.api import gateway as gateway_module
from sluice.api.auth import Caller
from sluice.api.gateway import EMPTY_INFO_CACHE_S, SERVED_CACHE_S, Gateway
from sluice.api.schemas import ChatRequest
from sluice.broker.memory import MemoryBroker
from sluice.config import Settings
from sluice.core.job import Endpoint
from sluice.core.model_info import ModelInfo
from sluice.core.ratelimit import TenantLimits
from sluice.metrics import Metrics
from sluice.runtime import broker_settings

CALLER = Caller(TenantLimits("t"), keyed=False)
MSG = [{"role": "user", "content": "hi"}]


def _request() -> Request:
    return Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []})


class CountingBroker(MemoryBroker):
    """The memory broker, counting its reads of the models' info."""

    info_reads = 0

    async def model_info(self) -> dict[str, ModelInfo]:
        self.info_reads += 1
        return await super().model_info()


class Clock:
    def __init__(self) -> None:
        self.t = 1000.0

    def __call__(self) -> float:
        return self.t


@pytest.fixture
def clock(monkeypatch: pytest.MonkeyPatch) -> Clock:
    """The gateway module's monotonic clock (its wall clock stays the real one)."""
    fake = Clock()
    monkeypatch.setattr(gateway_module, "time", SimpleNamespace(monotonic=fake, time=time.time))
    return fake


@pytest.fixture
async def gw(clock: Clock) -> AsyncIterator[Gateway]:
    settings = Settings()
    yield Gateway(settings, CountingBroker(broker_settings(settings)), Metrics())


def reads(gw: Gateway) -> int:
    assert isinstance(gw.broker, CountingBroker)
    return gw.broker.info_reads


async def test_an_empty_answer_is_kept_for_the_shorter_time(gw: Gateway, clock: Clock) -> None:
    assert EMPTY_INFO_CACHE_S < SERVED_CACHE_S
    for _ in range(50):  # no worker describes a model: one read for the lot
        assert await gw.model_info() == {}
    assert reads(gw) == 1
    clock.t += EMPTY_INFO_CACHE_S * 0.9
    assert await gw.model_info() == {} and reads(gw) == 1
    # A worker registers and describes its model: seen once the empty answer is stale.
    await gw.broker.register("w1", {"sim": 1})
    await gw.broker.describe_models("w1", {"sim": ModelInfo(output_tokens=7)})
    clock.t += EMPTY_INFO_CACHE_S * 0.2
    assert await gw.model_info() == {"sim": ModelInfo(output_tokens=7)}
    assert reads(gw) == 2
    clock.t += SERVED_CACHE_S * 0.9  # a described model's info is kept the longer time
    for _ in range(50):
        assert await gw.model_info() == {"sim": ModelInfo(output_tokens=7)}
    assert reads(gw) == 2
    clock.t += SERVED_CACHE_S * 0.2
    await gw.model_info()
    assert reads(gw) == 3


async def test_requests_of_a_deployment_without_model_info_read_it_once(gw: Gateway, clock: Clock) -> None:
    """build_job reads the kept info itself while fresh: an empty one kept, 50 requests ask once."""
    gw._served = (float("inf"), {"sim": 1})
    body: dict[str, Any] = {"model": "sim", "messages": MSG, "max_tokens": 4}
    for _ in range(50):
        opts = ChatRequest.model_validate(body)
        job = await gw.build_job(_request(), CALLER, Endpoint.CHAT, opts.model_dump(exclude_none=True), opts)
        assert job.model == "sim"
    assert reads(gw) == 1
    clock.t += EMPTY_INFO_CACHE_S * 1.1
    opts = ChatRequest.model_validate(body)
    await gw.build_job(_request(), CALLER, Endpoint.CHAT, opts.model_dump(exclude_none=True), opts)
    assert reads(gw) == 2
