"""Gateway.build_job's own steps: the registry and the models' info read as kept while fresh (the
broker asked only once they are stale), and the engine body without Sluice's own fields."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import pytest
from starlette.requests import Request

from sluice.api.auth import Caller
from sluice.api.errors import APIError
from sluice.api.gateway import Gateway
from sluice.api.schemas import ChatRequest
from sluice.broker.memory import MemoryBroker
from sluice.config import Settings
from sluice.core.job import Endpoint
from sluice.core.model_info import ModelInfo
from sluice.core.ratelimit import TenantLimits
from sluice.metrics import Metrics
from sluice.runtime import broker_settings

CALLER = Caller(TenantLimits("t"), keyed=False)
FAR = float("inf")


@pytest.fixture
async def gw() -> AsyncIterator[Gateway]:
    settings = Settings()
    yield Gateway(settings, MemoryBroker(broker_settings(settings)), Metrics())


def _request() -> Request:
    scope: dict[str, Any] = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
    return Request(scope)


async def _build(gw: Gateway, body: dict[str, Any]) -> Any:
    opts = ChatRequest.model_validate(body)
    return await gw.build_job(_request(), CALLER, Endpoint.CHAT, opts.model_dump(exclude_none=True), opts)


MSG = [{"role": "user", "content": "hi"}]


async def test_a_fresh_registry_is_read_as_kept_and_a_stale_one_asks_the_broker(gw: Gateway) -> None:
    # The broker has no worker: asked, it serves nothing, and the model is unknown.
    gw._served = (FAR, {"sim": 1})
    job = await _build(gw, {"model": "sim", "messages": MSG, "max_tokens": 4})
    assert job.model == "sim"
    gw._served = (0.0, {"sim": 1})  # stale: the broker is asked, and says none
    with pytest.raises(APIError) as refused:
        await _build(gw, {"model": "sim", "messages": MSG, "max_tokens": 4})
    assert refused.value.code == "model_not_found"


async def test_a_model_not_in_the_kept_registry_goes_the_whole_way(gw: Gateway) -> None:
    gw._served = (FAR, {"sim": 1})
    with pytest.raises(APIError) as refused:
        await _build(gw, {"model": "other", "messages": MSG})
    assert refused.value.code == "model_not_found"
    assert "sim" in refused.value.message  # the models served, as resolve_model names them


async def test_the_kept_model_info_is_read_while_fresh(gw: Gateway) -> None:
    gw._served = (FAR, {"sim": 1})
    gw._info = (FAR, {"sim": ModelInfo(output_tokens=7)})
    job = await _build(gw, {"model": "sim", "messages": MSG})  # no limit: the model's measured 7
    assert job.max_tokens == 7
    gw._info = (0.0, {"sim": ModelInfo(output_tokens=7)})  # stale: the broker knows nothing of it
    job = await _build(gw, {"model": "sim", "messages": MSG})
    assert job.max_tokens == gw.settings.max_tokens_cap


async def test_the_engine_body_is_a_copy_without_sluices_own_fields(gw: Gateway) -> None:
    gw._served = (FAR, {"sim": 1})
    plain = {"model": "sim", "messages": MSG, "max_tokens": 4, "temperature": 0.5}
    opts = ChatRequest.model_validate(plain)
    body = opts.model_dump(exclude_none=True)
    job = await gw.build_job(_request(), CALLER, Endpoint.CHAT, body, opts)
    assert job.body == body and job.body is not body
    assert list(job.body) == list(body)  # the same keys in the same order: the same bytes
    own = {**plain, "priority": "high", "timeout": 30}
    opts = ChatRequest.model_validate(own)
    body = opts.model_dump(exclude_none=True)
    job = await gw.build_job(_request(), CALLER, Endpoint.CHAT, body, opts)
    assert "priority" not in job.body and "timeout" not in job.body
    assert list(job.body) == [k for k in body if k not in ("priority", "timeout")]
    assert job.priority == "high"


def _request_with(headers: dict[str, str]) -> Request:
    raw = [(k.encode(), v.encode()) for k, v in headers.items()]
    return Request({"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": raw})


async def test_each_option_reaches_its_own_rule(gw: Gateway) -> None:
    # What was asked is made by place: two options of one type swapped would pass the type check,
    # so each pair is told apart here by the rule that reads it.
    gw._served = (FAR, {"sim": 1})

    async def build(body: dict[str, Any], headers: dict[str, str] | None = None) -> Any:
        opts = ChatRequest.model_validate({"model": "sim", "messages": MSG, **body})
        dumped = opts.model_dump(exclude_none=True)
        return await gw.build_job(_request_with(headers or {}), CALLER, Endpoint.CHAT, dumped, opts)

    assert (await build({"max_tokens": 5, "max_completion_tokens": 3})).max_tokens == 3  # the later name
    assert (await build({"priority": "low"}, {"x-priority": "high"})).priority == "low"  # body first
    assert (await build({}, {"x-priority": "high"})).priority == "high"
    assert (await build({"n": 2})).sequences == 2
    assert (await build({"n": 1, "best_of": 3})).sequences == 3
    with pytest.raises(APIError) as refused:  # X-Request-Timeout is checked ...
        await build({}, {"x-request-timeout": "soon"})
    assert refused.value.param == "X-Request-Timeout"
    job = await build({}, {"x-stainless-timeout": "soon"})  # ... the SDK's own is ignored when bad
    assert job.deadline - job.created_at == gw.settings.request_limits().default_timeout_s
    job = await build({}, {"x-stainless-read-timeout": "7"})
    assert job.deadline - job.created_at == pytest.approx(7)
    job = await build({"timeout": 9}, {"x-request-timeout": "8"})  # the body's first
    assert job.deadline - job.created_at == pytest.approx(9)
