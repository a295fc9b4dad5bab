"""The server-sent-events writer: an SSE answer written straight to the ASGI ``send``
(:class:`EventStream`), its framing (:func:`sse_frame`, :func:`sse_event`, the keep-alive
comment), and the server's watch of a request's client (:data:`CLIENT_GONE`), by which a stream
learns that its client left without a task per request."""

from __future__ import annotations

import asyncio
import contextlib
import re
import types
from collections.abc import AsyncIterator, Callable, Coroutine, Generator
from datetime import UTC, datetime
from typing import Any, Protocol

from fastapi.responses import Response
from starlette.types import Message, Receive, Scope, Send

#: The ASGI scope extension through which the server calls back when a request's client leaves
#: (sluice.roles.http_limits adds it): the cheap way to watch a client, no task per request.
CLIENT_GONE = "sluice.client_gone"


class ClientWatch(Protocol):
    """``scope["extensions"][CLIENT_GONE]``: calls ``callback`` once the request's client has
    disconnected (at once, soon, if it has already); the call returned stops watching."""

    def watch(self, callback: Callable[[], None]) -> Callable[[], None]: ...


def client_watch(scope: Scope) -> ClientWatch | None:
    """The server's :class:`ClientWatch` for this request, if it offers one."""
    extensions = scope.get("extensions")
    return extensions.get(CLIENT_GONE) if extensions else None


async def disconnected(receive: Receive) -> None:
    """Returns once the client has left (its ``http.disconnect``); the request's body was read
    already, so the next message is the disconnect, whenever it comes."""
    while True:
        message = await receive()
        if message["type"] == "http.disconnect":
            return


@types.coroutine
def resumed(writing: Coroutine[Any, Any, None], pending: Any) -> Generator[Any, None, None]:
    """The rest of a coroutine run by hand (``send(None)``) up to its first wait, as an awaitable:
    the task waits for what it waited on (``pending``, the future it yielded), then runs it on."""
    try:
        yield pending
    except BaseException:
        writing.close()
        raise
    yield from writing


#: SSE headers, as sse-starlette sent them: no cache may keep the stream, nor a proxy buffer it.
SSE_HEADERS = (
    (b"cache-control", b"no-store"),
    (b"connection", b"keep-alive"),
    (b"x-accel-buffering", b"no"),
    (b"content-type", b"text/event-stream; charset=utf-8"),
)
_END: Message = {"type": "http.response.body", "body": b"", "more_body": False}


def sse_frame(data: str) -> bytes:
    """One event of ``data`` (one ``data:`` line per line of it), as sse-starlette framed it."""
    if "\n" not in data and "\r" not in data:
        return b"data: " + data.encode() + b"\n\n"
    lines = data.replace("\r\n", "\n").replace("\r", "\n").split("\n")
    return "".join(f"data: {line}\n" for line in lines).encode() + b"\n"


#: What may not stand inside an ``id:`` or ``event:`` line (sse-starlette removed it, as here).
_LINE_BREAK = re.compile(r"\r\n|\r|\n")


def sse_event(data: str, *, event: str | None = None, id: str | None = None) -> bytes:
    """One whole event with its ``id:`` and ``event:`` lines (each without line breaks), then its
    ``data:`` lines, the bytes sse-starlette wrote for ``{"id": id, "event": event, "data": data}``
    with ``sep="\n"``: what :class:`EventStream` sends as it is when a payload is bytes."""
    head = ""
    if id is not None:
        head = "id: " + _one_line(id) + "\n"
    if event is not None:
        head += "event: " + _one_line(event) + "\n"
    return head.encode() + sse_frame(data)


def _one_line(text: str) -> str:
    """``text`` without its line breaks; an id or event type has none, and is not scanned by the
    regex then (this runs for every token of a job's or a response's event stream)."""
    if "\n" not in text and "\r" not in text:
        return text
    return _LINE_BREAK.sub("", text)


def ping_frame() -> bytes:
    """The keep-alive comment, as sse-starlette wrote it."""
    return f": ping - {datetime.now(UTC)}\n\n".encode()


class EventStream:
    """An SSE answer written straight to the ASGI ``send``: each payload one event, a keep-alive
    comment every ``ping_s``, one deadline for the whole stream (``limit_s``, after which it ends as
    if the payloads had) rather than a timer per event; and if the client leaves, the payloads are
    closed (their ``finally`` cancels the job) and nothing more is sent. A ``HEAD`` request gets the
    headers alone, and the payloads are not started.

    Args:
        payloads: in order, each event's data (a ``str``: one ``data:`` event, :func:`sse_frame`),
            or a whole event already framed (``bytes``: :func:`sse_event`); closed however the
            stream ends.
        headers: the answer's own headers (before the SSE ones; one of them that names an SSE
            header, ``Cache-Control`` say, stands instead of it).
        ping_s: seconds between keep-alive comments; 0: none.
        limit_s: the longest the stream may last from its head; None: unbounded. Payloads whose
            head waits for the engine (:class:`OpenAIStream`'s ``accept_within``) wait that out
            first, as the route once did before the stream began.
    """

    def __init__(
        self,
        payloads: AsyncIterator[str | bytes],
        headers: dict[str, str] | None = None,
        *,
        ping_s: float = 15.0,
        limit_s: float | None = None,
    ) -> None:
        self.payloads = payloads
        self.headers = headers or {}
        self.ping_s = ping_s
        self.limit_s = limit_s
        #: whether the answer has begun (its head handed to ``send``): it cannot become an error now
        self.started = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        head = [(k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in self.headers.items()]
        if head:
            named = {name for name, _ in head}
            head.extend(h for h in SSE_HEADERS if h[0] not in named)
        else:
            head = list(SSE_HEADERS)
        start: Message = {"type": "http.response.start", "status": 200, "headers": head}
        relay_tokens = getattr(self.payloads, "relay_tokens", None)
        # Payloads whose head waits for the engine to take the job (OpenAIStream's accept_within)
        # send it themselves, with the first token's frame, in the broker's call back.
        opens = relay_tokens is not None and getattr(self.payloads, "accept_within", None) is not None
        if not opens or scope.get("method") == "HEAD":
            opens = False
            self.started = True
            await send(start)
            if scope.get("method") == "HEAD":
                await self.payloads.aclose()  # type: ignore[attr-defined]
                await send(_END)
                return
        task = asyncio.current_task()
        assert task is not None
        loop = asyncio.get_running_loop()
        left = False

        def gone() -> None:
            nonlocal left
            if not left:
                left = True
                task.cancel()

        watch = client_watch(scope)
        stop: Callable[[], None] | None = None
        reader: asyncio.Task[None] | None = None
        if watch is not None:
            stop = watch.watch(gone)
        else:
            reader = asyncio.create_task(_call_when_gone(receive, gone))
        pings = _Pings(loop, send, self.ping_s, begun=not opens)
        limit_s = self.limit_s
        # The stream's time counts from its head, as when the route waited for the engine before
        # the stream (engine_accepted): a head that waits for the engine (up to its accept_within)
        # is bounded by that wait, and the stream's limit_s then starts. The deadline while it
        # waits is the most the two could last together, in case the wait's own bound fails.
        wait_s = getattr(self.payloads, "accept_within", None) if opens else None
        first_s = limit_s + wait_s if limit_s is not None and wait_s is not None else limit_s
        deadline: asyncio.Timeout | None = None

        def began() -> None:
            self.started = True
            pings.begin()
            # (not once expired: its cancellation is on the way, and reschedule would raise in the
            # broker's call back)
            if opens and deadline is not None and limit_s is not None and not deadline.expired():
                deadline.reschedule(loop.time() + limit_s)

        try:
            async with asyncio.timeout(first_s) as deadline:
                if relay_tokens is not None:
                    # The payloads write their first tokens themselves, as the broker hands them
                    # (OpenAIStream), then the rest comes through here.
                    if opens:
                        await relay_tokens(send, start, began)
                    else:
                        await relay_tokens(send)
                if not self.started:
                    # The head still unsent: the job ended with its answer and no token, or the
                    # broker did not call back and the wait read the job's events.
                    began()
                    await send(start)
                async for data in self.payloads:
                    frame = data if isinstance(data, bytes) else sse_frame(data)
                    await send({"type": "http.response.body", "body": frame, "more_body": True})
        except TimeoutError:
            pass  # the stream's time is up: it ends as a finished one does, the job cancelled
        except asyncio.CancelledError:
            if not left or task.uncancel() > 0:
                raise
        finally:
            if stop is not None:
                stop()
            if reader is not None:
                reader.cancel()
            await pings.stop()
            await self.payloads.aclose()  # type: ignore[attr-defined]
        if not left:
            if not self.started:  # the most time the head's wait and the stream had ran out
                self.started = True
                await send(start)
            await send(_END)


class EventStreamResponse(Response):
    """An :class:`EventStream` as the Response a FastAPI route returns; as a route's
    ``response_class`` it documents the route's answer as ``text/event-stream``."""

    media_type = "text/event-stream"

    # ``status_code`` is read by FastAPI (the default of this parameter) for the route's schema.
    def __init__(self, stream: EventStream, status_code: int = 200) -> None:
        self.stream = stream
        self.status_code = status_code
        self.background = None

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await self.stream(scope, receive, send)
        if self.background is not None:
            await self.background()


async def _call_when_gone(receive: Receive, gone: Callable[[], None]) -> None:
    await disconnected(receive)
    gone()


class _Pings:
    """A keep-alive comment every ``every`` seconds, sent by a short task when it is due (none
    runs in between)."""

    def __init__(
        self, loop: asyncio.AbstractEventLoop, send: Send, every: float, *, begun: bool = True
    ) -> None:
        self._loop = loop
        self._send = send
        self._every = every
        self._sending: asyncio.Task[None] | None = None
        self._timer: asyncio.TimerHandle | None = None
        if begun:
            self.begin()

    def begin(self) -> None:
        """The first ping due ``every`` seconds from now (once the stream's head is sent: none may
        come before it)."""
        if self._every > 0 and self._timer is None and self._sending is None:
            self._timer = self._loop.call_later(self._every, self._due)

    def _due(self) -> None:
        self._sending = self._loop.create_task(self._ping())

    async def _ping(self) -> None:
        await self._send({"type": "http.response.body", "body": ping_frame(), "more_body": True})
        self._timer = self._loop.call_later(self._every, self._due)

    async def stop(self) -> None:
        """No more pings; one being sent is let finish, so that the stream's end comes after it."""
        if self._timer is not None:
            self._timer.cancel()
        sending = self._sending
        if sending is not None and not sending.done():
            with contextlib.suppress(Exception):
                await asyncio.shield(sending)
        if self._timer is not None:
            self._timer.cancel()
