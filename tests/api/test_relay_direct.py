"""An OpenAI stream on the memory broker writes its tokens in the broker's call back
(sluice.api.relay.OpenAIStream.relay_tokens): the same bytes as the stream read through
``broker.events`` on any broker, in order when the client's send waits, and its errors raised."""

from __future__ import annotations

import asyncio
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import pytest

from sluice.api.relay import openai_stream
from sluice.api.sse import EventStream
from sluice.bench.broker_cycles import MODEL, make_job, settings
from sluice.broker.base import EventType
from sluice.broker.memory import MemoryBroker
from sluice.core.job import Job, JobError, JobState

SCOPE = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}


class Unfollowed:
    """The memory broker without ``follow``: the stream reads ``events`` as on any broker."""

    def __init__(self, broker: MemoryBroker) -> None:
        self._broker = broker

    def __getattr__(self, name: str) -> Any:
        if name == "follow":
            raise AttributeError(name)
        return getattr(self._broker, name)


class Client:
    """An ASGI client that keeps what is sent; while ``gate`` is clear, a send waits for it."""

    def __init__(self) -> None:
        self.bodies: list[bytes] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.fail: BaseException | None = None

    async def receive(self) -> dict[str, Any]:
        await asyncio.Future()
        raise AssertionError

    async def send(self, message: MutableMapping[str, Any]) -> None:
        if self.fail is not None:
            raise self.fail
        await self.gate.wait()
        if message["type"] == "http.response.body" and message.get("body"):
            self.bodies.append(message["body"])


def token(text: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


Script = Callable[[MemoryBroker, Job, Client], Awaitable[None]]


async def relayed(script: Script, *, follow: bool) -> tuple[list[bytes], Job]:
    """What the client got of a job whose events ``script`` publishes."""
    broker = MemoryBroker(settings())
    async with broker:
        job = make_job(0)
        job.stream_tokens = True
        job.id, job.created_at = "job_relay0", 1_700_000_000.0
        await broker.admit(job)
        claimed = await broker.claim("w", [MODEL], timeout=1.0)
        assert claimed is not None
        client = Client()
        reads = broker if follow else Unfollowed(broker)
        payloads = openai_stream(reads, job, include_usage=True, after=2)  # type: ignore[arg-type]
        writer = asyncio.create_task(EventStream(payloads, ping_s=0)(SCOPE, client.receive, client.send))
        await asyncio.sleep(0)  # the stream is open before the first token
        await script(broker, job, client)
        await asyncio.wait_for(writer, 5)
        return client.bodies, job


async def answered(broker: MemoryBroker, job: Job, client: Client) -> None:
    for text in ("Hel", "lo", " there", "a\nline\r\nbreak\u2028é"):
        await broker.publish(job.id, EventType.TOKEN, token(text))
    usage = {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}
    await broker.finish(job.id, "w", JobState.SUCCEEDED, result={"system_fingerprint": "fp"}, usage=usage)


async def failed_mid_answer(broker: MemoryBroker, job: Job, client: Client) -> None:
    await broker.publish(job.id, EventType.TOKEN, token("a"))
    await broker.release(job.id, "w")  # a retry after a token: the stream ends with an error


async def failed(broker: MemoryBroker, job: Job, client: Client) -> None:
    await broker.publish(job.id, EventType.TOKEN, token("a"))
    await broker.finish(job.id, "w", JobState.FAILED, error=JobError("engine down", "server_error", "x"))


async def test_the_client_gets_the_same_bytes_whether_the_broker_calls_back_or_not() -> None:
    for script in (answered, failed_mid_answer, failed):
        direct, job = await relayed(script, follow=True)
        read, _ = await relayed(script, follow=False)
        assert direct == read, script.__name__
        assert direct[-1] == b"data: [DONE]\n\n"
    assert job.state is JobState.FAILED


async def test_a_token_is_written_in_the_publishers_call() -> None:
    async def one_token(broker: MemoryBroker, job: Job, client: Client) -> None:
        await broker.publish(job.id, EventType.TOKEN, token("now"))
        # No turn of the loop in between: the stream's task has not run since.
        assert len(client.bodies) == 1 and b'"now"' in client.bodies[0]
        await answered(broker, job, client)

    bodies, _ = await relayed(one_token, follow=True)
    assert len(bodies) == 7  # five tokens, the usage, [DONE]


async def test_tokens_that_come_while_a_send_waits_follow_it_in_order() -> None:
    async def held_back(broker: MemoryBroker, job: Job, client: Client) -> None:
        await broker.publish(job.id, EventType.TOKEN, token("0"))
        client.gate.clear()  # the connection's buffer is full: the next send waits
        for i in range(1, 4):
            await broker.publish(job.id, EventType.TOKEN, token(str(i)))
        for _ in range(20):  # turns of the loop for the stream's task: none may send past the gate
            await asyncio.sleep(0)
        assert len(client.bodies) <= 1  # the first token's (read through events: not yet sent)
        client.gate.set()
        await broker.publish(job.id, EventType.TOKEN, token("4"))
        await broker.finish(job.id, "w", JobState.SUCCEEDED, result={}, usage={})

    bodies, _ = await relayed(held_back, follow=True)
    texts = [b.split(b'"content": "')[1][:1] for b in bodies[:5]]
    assert texts == [b"0", b"1", b"2", b"3", b"4"]
    assert bodies == (await relayed(held_back, follow=False))[0]


async def test_a_send_that_fails_ends_the_stream_with_its_error_and_cancels_the_job() -> None:
    seen: list[Job] = []

    async def broken(broker: MemoryBroker, job: Job, client: Client) -> None:
        seen.append(job)
        client.fail = ConnectionResetError("gone")
        await broker.publish(job.id, EventType.TOKEN, token("a"))  # the publisher does not see it

    with pytest.raises(ConnectionResetError):
        await relayed(broken, follow=True)
    assert seen[0].state is JobState.CANCELLED
