"""The head of an answer as sluice.roles.http_limits.LeanCycle writes it: byte for byte, and state
for state, what uvicorn's own RequestResponseCycle.send writes and leaves, errors included."""

from __future__ import annotations

import asyncio
import logging
from typing import Any

import pytest
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from sluice.roles.http_limits import LeanCycle


class Recorded:
    def __init__(self) -> None:
        self.writes: list[bytes] = []

    def write(self, data: bytes) -> None:
        self.writes.append(data)

    def is_closing(self) -> bool:
        return False

    def pause_reading(self) -> None: ...

    def resume_reading(self) -> None: ...


DEFAULTS = [(b"date", b"Thu, 03 Dec 2026 19:00:00 GMT"), (b"server", b"uvicorn")]


def cycle(kind: type[RequestResponseCycle], method: str, keep_alive: bool, defaults: Any) -> Any:
    transport = Recorded()
    made = kind(
        scope={"type": "http", "method": method},  # type: ignore[typeddict-item]
        transport=transport,  # type: ignore[arg-type]
        flow=FlowControl(transport),  # type: ignore[arg-type]
        logger=logging.getLogger("test"),
        access_logger=logging.getLogger("test.access"),
        access_log=False,
        default_headers=defaults,
        message_event=asyncio.Event(),
        expect_100_continue=False,
        keep_alive=keep_alive,
        on_response=lambda: None,
    )
    return made, transport


STATE = (
    "response_started",
    "chunked_encoding",
    "expected_content_length",
    "keep_alive",
    "waiting_for_100_continue",
)

HEADS: list[Any] = [
    # A whole answer's, a refusal's, a stream's (no length), and each of uvicorn's special names.
    [
        (b"x-sluice-job-id", b"job_a"),
        (b"x-request-id", b"job_a"),
        (b"content-length", b"12"),
        (b"content-type", b"application/json"),
    ],
    [
        (b"retry-after", b"2"),
        (b"retry-after-ms", b"1500"),
        (b"x-should-retry", b"true"),
        (b"content-length", b"90"),
        (b"content-type", b"application/json"),
        (b"x-request-id", b"req_1"),
    ],
    [(b"content-type", b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")],
    [(b"Content-Length", b"3"), (b"X-Mixed", b"\xfc"), (b"content-length", b"4")],
    [(b"transfer-encoding", b"Chunked")],
    [(b"connection", b"keep-alive, Close"), (b"content-length", b"0")],
    [(b"Connection", b"upgrade")],
    [],
    # What uvicorn refuses, each at its own header (after the headers before it were taken).
    [(b"content-length", b"5"), (b"bad name", b"x")],
    [(b"content-length", b"5"), (b"x-a", b"line\r\nbreak")],
    [(b"x-a", b"tab\tis fine"), (b"x-b", b"\x7f")],
    [(b"content-length", b"five")],
    [("x-str", b"a")],
    [(b"x-a", b"1", b"extra")],
    ((b"x-tuple", b"1"),),
]


@pytest.mark.parametrize("headers", HEADS)
@pytest.mark.parametrize("status", [200, 204, 304, 429, 999])
@pytest.mark.parametrize("method", ["POST", "HEAD"])
@pytest.mark.parametrize("keep_alive", [True, False])
@pytest.mark.parametrize("defaults", [DEFAULTS, [], [(b"x server", b"bad")]])
async def test_the_head_is_uvicorns(
    headers: Any, status: int, method: str, keep_alive: bool, defaults: Any
) -> None:
    outcomes = []
    for kind in (RequestResponseCycle, LeanCycle):
        made, transport = cycle(kind, method, keep_alive, defaults)
        message = {"type": "http.response.start", "status": status, "headers": headers}
        try:
            await made.send(message)
            error: Any = None
        except Exception as exc:
            error = (type(exc), str(exc))
        outcomes.append((transport.writes, error, [getattr(made, name) for name in STATE]))
    assert outcomes[1] == outcomes[0]


async def test_the_body_and_what_follows_are_uvicorns() -> None:
    outcomes = []
    for kind in (RequestResponseCycle, LeanCycle):
        made, transport = cycle(kind, "POST", True, DEFAULTS)
        await made.send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-length", b"2")]}
        )
        await made.send({"type": "http.response.body", "body": b"ok"})
        with pytest.raises(RuntimeError):
            await made.send({"type": "http.response.start", "status": 200, "headers": []})
        outcomes.append((transport.writes, made.response_complete))
    assert outcomes[1] == outcomes[0]
    assert outcomes[0][1] is True


async def test_a_plain_head_is_written_without_uvicorns_send(monkeypatch: pytest.MonkeyPatch) -> None:
    # So that the comparisons above compare two ways, not uvicorn's with itself.
    made, transport = cycle(LeanCycle, "POST", True, DEFAULTS)

    async def refused(self: Any, message: Any) -> None:
        raise AssertionError("uvicorn's send was used")

    monkeypatch.setattr(RequestResponseCycle, "send", refused)
    await made.send({"type": "http.response.start", "status": 200, "headers": HEADS[0]})
    assert transport.writes[0].startswith(b"HTTP/1.1 200 OK\r\ndate: ")
