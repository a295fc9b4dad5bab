"""The SSE writer (sluice.api.sse.EventStream): frames, keep-alive comments, the stream's one
deadline, and a client that leaves, over plain ASGI callables."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from sluice.api.sse import SSE_HEADERS, EventStream, sse_event, sse_frame


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


def test_an_event_with_its_id_and_name_is_framed_as_sse_starlette_framed_it() -> None:
    # The bytes sse-starlette's ServerSentEvent(data, event=..., id=..., sep="\n").encode() wrote.
    assert sse_event('{"a":1}', event="token", id="3") == b'id: 3\nevent: token\ndata: {"a":1}\n\n'
    assert sse_event("x", event="history") == b"event: history\ndata: x\n\n"
    # Line breaks cannot stand in the id or the name: dropped; the data's make more data lines.
    assert sse_event("a\nb\r\nc\rd", event="e\nv", id="1\r2") == (
        b"id: 12\nevent: ev\ndata: a\ndata: b\ndata: c\ndata: d\n\n"
    )
    assert sse_event("", event="e", id="0") == b"id: 0\nevent: e\ndata: \n\n"


async def test_a_framed_event_is_sent_as_it_is_and_an_own_header_stands_for_the_sse_one() -> None:
    client = Client()

    async def payloads() -> AsyncIterator[bytes]:
        yield sse_event("{}", event="snapshot", id="1")

    headers = {"Cache-Control": "no-store, private", "X-Content-Type-Options": "nosniff"}
    await asyncio.wait_for(EventStream(payloads(), headers, ping_s=0)(SCOPE, client.receive, client.send), 5)
    sent = client.sent[0]["headers"]
    assert [v for k, v in sent if k == b"cache-control"] == [b"no-store, private"]  # once, the route's
    assert (b"x-content-type-options", b"nosniff") in sent
    assert set(SSE_HEADERS) - {h for h in SSE_HEADERS if h[0] == b"cache-control"} <= set(sent)
    assert client.bodies() == [b"id: 1\nevent: snapshot\ndata: {}\n\n", b""]


async def test_a_head_request_gets_the_headers_alone_and_the_payloads_never_start() -> None:
    client = Client()
    started = False

    async def payloads() -> AsyncIterator[str]:
        nonlocal started
        started = True
        yield "never"

    head = {**SCOPE, "method": "HEAD"}
    await asyncio.wait_for(EventStream(payloads(), ping_s=0.01)(head, client.receive, client.send), 5)
    assert client.sent[0]["status"] == 200 and set(SSE_HEADERS) <= set(client.sent[0]["headers"])
    assert client.bodies() == [b""] and client.sent[-1]["more_body"] is False
    assert not started


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
