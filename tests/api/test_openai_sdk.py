"""The OpenAI-compatible API, driven by the official SDK, through Sluice to a simulated engine."""

from __future__ import annotations

from collections.abc import AsyncIterator

import openai
import pytest

from tests.servers import Gateway, run_gateway


@pytest.fixture
async def gw(sim_url: str) -> AsyncIterator[Gateway]:
    async with run_gateway([sim_url], max_concurrency=4) as g:
        yield g


@pytest.fixture
async def client(gw: Gateway) -> AsyncIterator[openai.AsyncOpenAI]:
    # Closed after the test: its pooled connections would otherwise outlive the gateway.
    async with openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="test-key", max_retries=0) as sdk:
        yield sdk


async def test_chat_non_streaming(client: openai.AsyncOpenAI) -> None:
    r = await client.chat.completions.create(
        model="sim", messages=[{"role": "user", "content": "hello"}], max_tokens=7
    )
    assert r.id.startswith("chatcmpl-") and r.model == "sim"
    assert r.choices[0].message.role == "assistant" and r.choices[0].message.content
    assert r.usage is not None and r.usage.completion_tokens == 7
    assert r.usage.total_tokens == r.usage.prompt_tokens + 7


async def test_chat_streaming_with_usage(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model="sim",
        messages=[{"role": "user", "content": "hello"}],
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
    )
    pieces = []
    usage = None
    async for chunk in stream:
        if chunk.usage is not None:
            usage = chunk.usage
        for choice in chunk.choices:
            if choice.delta.content:
                pieces.append(choice.delta.content)
    assert len(pieces) == 9
    assert usage is not None and usage.completion_tokens == 9


async def test_completions(client: openai.AsyncOpenAI) -> None:
    r = await client.completions.create(model="sim", prompt="once upon a time", max_tokens=5)
    assert r.object == "text_completion" and r.choices[0].text
    assert r.usage is not None and r.usage.completion_tokens == 5
    stream = await client.completions.create(model="sim", prompt="once", max_tokens=4, stream=True)
    texts = [c.choices[0].text async for c in stream if c.choices]
    assert len([t for t in texts if t]) == 4


async def test_models(client: openai.AsyncOpenAI) -> None:
    models = [m.id async for m in client.models.list()]
    assert models == ["sim"]


async def test_unknown_model_is_404(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="nope", messages=[{"role": "user", "content": "x"}])
    assert info.value.code == "model_not_found"


async def test_many_concurrent_requests_all_answered(client: openai.AsyncOpenAI) -> None:
    import asyncio

    async def one(i: int) -> int:
        r = await client.chat.completions.create(
            model="sim", messages=[{"role": "user", "content": f"q{i}"}], max_tokens=3
        )
        assert r.usage is not None
        return r.usage.completion_tokens

    assert await asyncio.gather(*(one(i) for i in range(30))) == [3] * 30
