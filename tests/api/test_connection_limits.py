"""The connection bounds (``max_header_bytes``, ``header_timeout_s``, ``body_timeout_s``,
``keep_alive_s``): a huge header is refused with 431 and its connection dropped, and a crowd of
slow clients (slowloris) is shed while a normal request still gets its answer.

The clients are raw sockets, so that a test can send what no HTTP library would: a head that never
ends, a body that stops half-way. Every wait is bounded; nothing is timed beyond that.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator

import httpx
import pytest

from tests.api.sluice_server import Served, serve_as_sluice
from tests.helpers import wait_until

LIMITS = {"max_header_bytes": 16 * 1024, "header_timeout_s": 1.0, "body_timeout_s": 1.0, "keep_alive_s": 1.0}
#: How long a test waits for the server to act on a bound of about a second (never a measurement).
WITHIN_S = 15.0
HEAD = b"GET /healthz HTTP/1.1\r\nHost: sluice\r\n"


@pytest.fixture
async def served(sim_url: str) -> AsyncIterator[Served]:
    async with serve_as_sluice([sim_url], **LIMITS) as s:
        yield s


async def connect(served: Served) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
    return await asyncio.open_connection(served.host, served.port)


async def until_closed(reader: asyncio.StreamReader) -> bytes:
    """Everything the server sends until it closes the connection (bounded)."""
    received = b""
    async with asyncio.timeout(WITHIN_S):
        with contextlib.suppress(ConnectionError):
            while chunk := await reader.read(65536):
                received += chunk
    return received


def status_of(response: bytes) -> int:
    return int(response.split(b" ", 2)[1])


def error_of(response: bytes) -> dict[str, str]:
    error: dict[str, str] = json.loads(response.split(b"\r\n\r\n", 1)[1])["error"]
    return error


async def test_a_16_mb_header_gets_431_and_its_connection_is_dropped(served: Served) -> None:
    reader, writer = await connect(served)
    sent = 0

    async def send_huge_header() -> None:
        nonlocal sent
        writer.write(HEAD + b"X-Big: ")
        with contextlib.suppress(ConnectionError):
            for _ in range(256):  # 16 MiB, 64 KiB at a time
                writer.write(b"a" * 65536)
                await writer.drain()
                sent += 65536
            writer.write(b"\r\n\r\n")
            await writer.drain()

    sender = asyncio.create_task(send_huge_header())
    response = await until_closed(reader)
    sender.cancel()
    await asyncio.gather(sender, return_exceptions=True)
    writer.close()
    assert status_of(response) == 431, response[:200]
    error = error_of(response)
    assert error["code"] == "request_header_fields_too_large" and error["type"] == "invalid_request_error"
    assert f"{LIMITS['max_header_bytes']} bytes" in error["message"]
    # The server let go of the connection, and of what it had buffered with it.
    await wait_until(lambda: served.connections == 0, timeout=WITHIN_S)


async def test_twenty_unfinished_large_headers_are_all_refused(served: Served) -> None:
    clients = [await connect(served) for _ in range(20)]
    for _, writer in clients:
        writer.write(HEAD + b"X-Big: " + b"a" * (1024 * 1024))  # 1 MiB each, never finished
    responses = await asyncio.gather(*(until_closed(reader) for reader, _ in clients))
    for _, writer in clients:
        writer.close()
    assert [status_of(r) for r in responses] == [431] * 20
    await wait_until(lambda: served.connections == 0, timeout=WITHIN_S)


async def test_headers_within_the_bound_are_served(served: Served, http: httpx.AsyncClient) -> None:
    r = await http.get(served.url + "/healthz", headers={"X-Padding": "p" * 8000})
    assert r.status_code == 200


async def test_a_slowloris_crowd_is_shed_while_a_normal_request_is_answered(
    sim_url: str, http: httpx.AsyncClient
) -> None:
    # Heads get 3 s here, so that the whole crowd is in before any of it is shed, however slowly
    # this machine opens 200 connections.
    async with serve_as_sluice([sim_url], **{**LIMITS, "header_timeout_s": 3.0}) as served:
        await _slowloris(served, http)


async def _slowloris(served: Served, http: httpx.AsyncClient) -> None:
    async def opened(head: bytes) -> tuple[asyncio.StreamReader, asyncio.StreamWriter]:
        reader, writer = await connect(served)
        writer.write(head)
        return reader, writer

    # 150 send a header line now and then, never the end of the head; 50 send nothing at all.
    trickling = await asyncio.gather(*(opened(HEAD) for _ in range(150)))
    silent = await asyncio.gather(*(opened(b"") for _ in range(50)))
    stop = asyncio.Event()

    async def trickle(writer: asyncio.StreamWriter) -> None:
        with contextlib.suppress(ConnectionError):
            while not stop.is_set():
                await asyncio.sleep(0.2)
                writer.write(b"X-Slow: 1\r\n")
                await writer.drain()

    tricklers = [asyncio.create_task(trickle(w)) for _, w in trickling]
    try:
        await wait_until(lambda: served.connections >= 200, timeout=WITHIN_S)
        # While the crowd holds its connections, a real client gets its answer.
        body = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}
        r = await http.post(served.url + "/v1/chat/completions", json=body)
        assert r.status_code == 200, r.text
        # And the server closes every slow socket itself: each read ends, with a 408 for those
        # that had begun a request.
        answers = await asyncio.gather(*(until_closed(reader) for reader, _ in trickling))
        assert {status_of(a) for a in answers} == {408}
        assert error_of(answers[0])["code"] == "timeout"
        assert await asyncio.gather(*(until_closed(reader) for reader, _ in silent)) == [b""] * 50
    finally:
        stop.set()
        await asyncio.gather(*tricklers, return_exceptions=True)
        for _, writer in trickling + silent:
            writer.close()
    await wait_until(lambda: served.connections <= 1, timeout=WITHIN_S)  # at most httpx's own


async def test_a_body_that_stops_half_way_gets_408(served: Served) -> None:
    reader, writer = await connect(served)
    writer.write(
        b"POST /v1/chat/completions HTTP/1.1\r\nHost: sluice\r\nContent-Type: application/json\r\n"
        b"Content-Length: 1000\r\n\r\n" + b'{"model": "sim", '
    )
    response = await until_closed(reader)
    writer.close()
    assert status_of(response) == 408, response[:200]
    assert error_of(response)["code"] == "timeout"
    # The server is not hurt by it.
    await wait_until(lambda: served.connections == 0, timeout=WITHIN_S)


async def test_an_idle_keep_alive_connection_is_closed(served: Served) -> None:
    reader, writer = await connect(served)
    writer.write(HEAD + b"\r\n")
    response = await until_closed(reader)  # the answer, then nothing until the server closes
    writer.close()
    assert status_of(response) == 200
    assert response.count(b"HTTP/1.1 ") == 1


async def test_a_slow_head_after_answered_requests_on_one_connection_gets_408(served: Served) -> None:
    """The head's time-out is a deadline the one timer re-checks: after requests that moved it
    (each head and body its own), the next slow head is still refused in time."""
    reader, writer = await connect(served)
    for _ in range(3):
        writer.write(HEAD + b"\r\n")
        async with asyncio.timeout(WITHIN_S):
            head = await reader.readuntil(b"\r\n\r\n")
            length = int(head.lower().split(b"content-length: ", 1)[1].split(b"\r\n", 1)[0])
            await reader.readexactly(length)
        assert status_of(head) == 200
    writer.write(HEAD)  # a head that never ends
    response = await until_closed(reader)
    writer.close()
    assert status_of(response) == 408, response[:200]
    assert error_of(response)["code"] == "timeout"
