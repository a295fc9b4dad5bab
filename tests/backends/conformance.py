"""The backend conformance suite: :class:`OpenAIBackend` against every engine it is meant to drive.

It covers what the dispatcher relies on: the models an engine lists, answers (streamed or whole)
that :class:`sluice.protocol.Assembler` turns into an OpenAI response with the engine's usage, an
abort that really stops the generation inside the engine, errors classed as retryable or not, and
``aclose``.

A test module subclasses :class:`BackendConformance` and provides two fixtures: ``target`` (a
running engine, as a :class:`Target`) and ``backend`` (an :class:`OpenAIBackend` for it, from
:func:`open_backend`).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
from abc import ABC, abstractmethod
from collections.abc import AsyncGenerator, AsyncIterator
from typing import Any

import pytest

from sluice.backends.base import BackendError
from sluice.backends.openai import OpenAIBackend
from sluice.core.job import Endpoint, Job
from sluice.protocol import Assembler, response_id
from tests.helpers import make_job, wait_until

# Tokens of a short answer: ignore_eos makes the engine generate exactly this many.
SHORT = 8

ENDPOINTS = pytest.mark.parametrize("endpoint", list(Endpoint), ids=[e.name.lower() for e in Endpoint])
MODES = pytest.mark.parametrize("stream_tokens", [True, False], ids=["streamed", "whole"])


class Target(ABC):
    """A running OpenAI-compatible engine for the suite.

    Attributes:
        url: the engine's base URL, without ``/v1``.
        model: the one model it serves.
        long_tokens: a ``max_tokens`` that fits the engine's context and keeps one request
            generating for several times ``abort_notice_s``, so that a request that was not
            aborted cannot pass for one that was.
        abort_notice_s: how long the engine may take to notice that a client left.
    """

    url: str
    model: str
    long_tokens: int
    abort_notice_s: float = 3.0

    @abstractmethod
    async def in_flight(self) -> int:
        """Requests the engine is working on right now, read from the engine itself."""

    async def aborted(self) -> int | None:
        """Requests the engine counts as abandoned by their client; None where it keeps no count."""
        return None


@contextlib.asynccontextmanager
async def open_backend(target: Target) -> AsyncIterator[OpenAIBackend]:
    # The trailing /v1 is how configurations usually name an engine; the backend strips it.
    backend = OpenAIBackend(target.url + "/v1", max_concurrency=2)
    try:
        yield backend
    finally:
        await backend.aclose()


def engine_job(model: str, endpoint: Endpoint, *, max_tokens: int, stream_tokens: bool = True) -> Job:
    """A job for ``model`` that makes the engine generate exactly ``max_tokens`` tokens."""
    body: dict[str, Any] = {
        "model": model,
        "max_tokens": max_tokens,
        # llama-server (like vLLM) then generates until max_tokens; the simulator always does.
        "ignore_eos": True,
    }
    if endpoint is Endpoint.CHAT:
        body["messages"] = [{"role": "user", "content": "Say hello."}]
    else:
        body["prompt"] = "Once upon a time"
    job = make_job(model=model, max_tokens=max_tokens)
    return dataclasses.replace(job, endpoint=endpoint, body=body, stream_tokens=stream_tokens)


def open_stream(backend: OpenAIBackend, job: Job) -> AsyncGenerator[dict[str, Any], None]:
    stream = backend.stream(job)
    # The dispatcher aborts a generation by closing its stream: it must be closeable.
    assert isinstance(stream, AsyncGenerator)
    return stream


async def assemble(backend: OpenAIBackend, job: Job) -> tuple[Assembler, int]:
    """The whole stream through an assembler, as the dispatcher runs it; and how many chunks came."""
    assembler = Assembler(job)
    count = 0
    async with contextlib.aclosing(open_stream(backend, job)) as stream:
        async for data in stream:
            assembler.add(data)
            count += 1
    return assembler, count


async def read_tokens(stream: AsyncIterator[dict[str, Any]], assembler: Assembler, tokens: int) -> None:
    """Read ``stream`` until ``tokens`` content chunks have come: the engine is then generating."""
    async for data in stream:
        assembler.add(data)
        if assembler.tokens >= tokens:
            return
    raise AssertionError(f"the stream ended before {tokens} tokens")


async def until_idle(target: Target) -> None:
    async def idle() -> bool:
        return await target.in_flight() == 0

    await wait_until(idle, timeout=target.abort_notice_s)


class BackendConformance:
    async def test_discover_models_lists_the_served_model(
        self, backend: OpenAIBackend, target: Target
    ) -> None:
        assert await backend.discover_models() == [target.model]
        assert await backend.healthy()

    @ENDPOINTS
    @MODES
    async def test_an_answer_assembles_into_an_openai_response_with_the_engines_usage(
        self, backend: OpenAIBackend, target: Target, endpoint: Endpoint, stream_tokens: bool
    ) -> None:
        job = engine_job(target.model, endpoint, max_tokens=SHORT, stream_tokens=stream_tokens)
        assembler, chunks = await assemble(backend, job)
        if stream_tokens:
            # One chunk per token at most (an engine may hold back a partial character), and the
            # usage is the engine's own, asked for although the job's body did not.
            assert 0 < assembler.tokens <= SHORT
            assert assembler.usage is not None, "the engine's usage, not the assembler's count"
        else:
            assert chunks == 1, "a whole answer comes as one chunk"
            assert assembler.usage is not None
        response = assembler.response()
        chat = endpoint is Endpoint.CHAT
        assert response["object"] == ("chat.completion" if chat else "text_completion")
        assert response["id"] == response_id(job) and response["model"] == job.model
        [choice] = response["choices"]
        assert choice["index"] == 0 and choice["finish_reason"] == "length"
        if chat:
            assert choice["message"]["role"] == "assistant"
            text = choice["message"]["content"]
        else:
            text = choice["text"]
        assert isinstance(text, str) and text
        usage = response["usage"]
        assert usage["completion_tokens"] == SHORT
        assert usage["prompt_tokens"] > 0
        assert usage["total_tokens"] == usage["prompt_tokens"] + usage["completion_tokens"]

    @ENDPOINTS
    async def test_closing_a_stream_mid_way_ends_the_engine_request(
        self, backend: OpenAIBackend, target: Target, endpoint: Endpoint
    ) -> None:
        aborted = await target.aborted()
        job = engine_job(target.model, endpoint, max_tokens=target.long_tokens)
        stream = open_stream(backend, job)
        try:
            await read_tokens(stream, Assembler(job), 3)
            assert await target.in_flight() == 1
        finally:
            await stream.aclose()
        await until_idle(target)
        if aborted is not None:
            assert await target.aborted() == aborted + 1

    async def test_cancelling_a_whole_answer_ends_the_engine_request(
        self, backend: OpenAIBackend, target: Target
    ) -> None:
        # A whole answer has no chunk to stop at: the dispatcher aborts it by cancelling its task.
        aborted = await target.aborted()
        job = engine_job(target.model, Endpoint.CHAT, max_tokens=target.long_tokens, stream_tokens=False)
        stream = open_stream(backend, job)

        async def first_chunk() -> dict[str, Any]:
            return await anext(stream)

        waiting = asyncio.create_task(first_chunk())

        async def generating() -> bool:
            return await target.in_flight() == 1

        try:
            await wait_until(generating)
            assert not waiting.done()
        finally:
            waiting.cancel()
            await asyncio.gather(waiting, return_exceptions=True)
            await stream.aclose()
        await until_idle(target)
        if aborted is not None:
            assert await target.aborted() == aborted + 1

    @MODES
    async def test_a_request_the_engine_refuses_is_not_retryable(
        self, backend: OpenAIBackend, target: Target, stream_tokens: bool
    ) -> None:
        job = engine_job(target.model, Endpoint.CHAT, max_tokens=SHORT, stream_tokens=stream_tokens)
        job.body["messages"] = "not a list"
        with pytest.raises(BackendError) as info:
            await assemble(backend, job)
        error = info.value
        assert not error.retryable and error.status == 400
        assert error.type == "invalid_request_error" and error.code == "engine_rejected"
        assert "messages" in error.message, "the message is the engine's own"
        # The refusal leaves the backend usable.
        good = engine_job(target.model, Endpoint.CHAT, max_tokens=SHORT, stream_tokens=stream_tokens)
        assembler, _ = await assemble(backend, good)
        assert assembler.final_usage()["completion_tokens"] == SHORT

    async def test_aclose_ends_the_engine_requests_it_has_open(
        self, backend: OpenAIBackend, target: Target
    ) -> None:
        job = engine_job(target.model, Endpoint.CHAT, max_tokens=target.long_tokens)
        stream = open_stream(backend, job)
        try:
            await read_tokens(stream, Assembler(job), 3)
            assert await target.in_flight() == 1
            await backend.aclose()
            await until_idle(target)
            # The open stream fails as a lost connection does: another attempt may succeed.
            with pytest.raises(BackendError) as info:
                async for _ in stream:
                    pass
            assert info.value.retryable
        finally:
            await stream.aclose()
