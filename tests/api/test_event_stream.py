"""The SSE writer (sluice.api.relay.EventStream): frames, keep-alive comments, the stream's one
deadline, and a client that leaves, over plain ASGI callables."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from sluice.api.relay import SSE_HEADERS, EventStream, sse_frame


class Client:
    """An ASGI client: records what is sent; ``leave()`` makes ``receive`` answer a disconnect."""

    def __init__(self) -> None:
        self.sent: list[dict[str, Any]] = []
        self.left = asyncio.Event()
        self.changed = asyncio.Event()

    async def receive(self) -> dict[str, Any]:
        await self.left.wait()
        return {"type": "http.disconnect"}

    async def send(self, message: dict[str, Any]) -> None:
        self.sent.append(message)
        self.changed.set()

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.sent if m["type"] == "http.response.body"]

    async def until(self, predicate: Any, within_s: float = 5.0) -> None:
        async with asyncio.timeout(within_s):
            while not predicate():
                self.changed.clear()
                await self.changed.wait()


SCOPE = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}


def test_a_payload_with_newlines_is_one_event_of_several_data_lines() -> None:
    assert sse_frame('{"a":1}') == b'data: {"a":1}\n\n'
    assert sse_frame("one\ntwo") == b"data: one\ndata: two\n\n"


async def test_frames_pings_while_waiting_then_the_end() -> None:
    client = Client()
    release = asyncio.Event()

    async def payloads() -> AsyncIterator[str]:
        yield "first"
        await release.wait()
        yield "[DONE]"

    stream = EventStream(payloads(), {"x-sluice-job-id": "job_1"}, ping_s=0.01)
    writer = asyncio.create_task(stream(SCOPE, client.receive, client.send))
    await client.until(lambda: any(b.startswith(b": ping - ") for b in client.bodies()))
    release.set()
    await asyncio.wait_for(writer, 5)
    start = client.sent[0]
    assert start["status"] == 200
    assert start["headers"][0] == (b"x-sluice-job-id", b"job_1")
    assert set(SSE_HEADERS) <= set(start["headers"])
    bodies = client.bodies()
    assert bodies[0] == b"data: first\n\n"
    assert bodies[-2:] == [b"data: [DONE]\n\n", b""]
    assert client.sent[-1]["more_body"] is False
    assert all(b.endswith(b"\n\n") for b in bodies[:-1])


async def test_a_client_that_leaves_closes_the_payloads_and_gets_nothing_more() -> None:
    client = Client()
    closed = asyncio.Event()

    async def payloads() -> AsyncIterator[str]:
        try:
            yield "first"
            await asyncio.Event().wait()  # the job never answers
            yield "never"
        finally:
            closed.set()

    writer = asyncio.create_task(EventStream(payloads(), ping_s=0)(SCOPE, client.receive, client.send))
    await client.until(lambda: client.bodies() == [b"data: first\n\n"])
    client.left.set()
    await asyncio.wait_for(writer, 5)
    assert closed.is_set()
    assert client.bodies() == [b"data: first\n\n"]  # no end: nobody is there to read it


async def test_a_stream_past_its_time_ends_and_closes_its_payloads() -> None:
    client = Client()
    closed = asyncio.Event()

    async def payloads() -> AsyncIterator[str]:
        try:
            await asyncio.Event().wait()
            yield "never"
        finally:
            closed.set()

    await asyncio.wait_for(
        EventStream(payloads(), ping_s=0, limit_s=0.05)(SCOPE, client.receive, client.send), 5
    )
    assert closed.is_set()
    assert client.bodies() == [b""]
    assert client.sent[-1]["more_body"] is False


async def test_someone_elses_cancellation_is_not_swallowed() -> None:
    client = Client()
    started = asyncio.Event()

    async def payloads() -> AsyncIterator[str]:
        started.set()
        await asyncio.Event().wait()
        yield "never"

    writer = asyncio.create_task(EventStream(payloads(), ping_s=0)(SCOPE, client.receive, client.send))
    await asyncio.wait_for(started.wait(), 5)
    writer.cancel()
    done, _ = await asyncio.wait({writer}, timeout=5)
    assert done and writer.cancelled()
