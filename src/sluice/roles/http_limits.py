"""Bounds on each HTTP connection, below the app: how large a request's head may be and how long a
client may take to send it, its body, or its next request.

uvicorn's HTTP parser here is httptools, which buffers a header of any size and waits for it for
ever (uvicorn's ``h11_max_incomplete_event_size`` applies to its h11 parser only, and it has no read
timeout at all), so one client could hold megabytes per connection, or hundreds of connections
that never finish a request. The protocol below is uvicorn's own with the bounds added:

- a request line and headers larger than ``max_header_bytes`` get ``431`` in OpenAI's error shape,
  and the connection is closed: what was buffered goes with the parser;
- a connection that has not sent a whole request head within ``header_timeout_s`` (from its
  opening, or from the first byte of its next request) is closed, with ``408`` when anything came;
- a body not received within ``body_timeout_s`` of its head gets ``408`` and the connection is
  closed; the app sees the client as gone;
- an idle keep-alive connection is closed after ``keep_alive_s`` (uvicorn's own timer).

Each request's scope also carries a :class:`ClientGone` (``extensions["sluice.client_gone"]``,
:data:`sluice.api.sse.CLIENT_GONE`): the app registers a callback that runs when the client leaves,
which watches a waiting request with no task or read of its own (``sluice.api.relay``).

A refused client is answered, then the connection half-closed and drained for ``LINGER_S`` so that
the answer reaches it rather than being lost to a reset, and then closed.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from uvicorn.protocols.http.httptools_impl import HttpToolsProtocol, RequestResponseCycle

from sluice.api.sse import CLIENT_GONE
from sluice.protocol import error_body

#: How long a refused connection is drained before it is closed (seconds).
LINGER_S = 1.0
#: How early a time-out's timer may fire and still count as on time (seconds): the event loop's
#: timers have a millisecond's resolution.
TIMER_SLACK_S = 0.001


@dataclass(frozen=True)
class ConnectionLimits:
    """The bounds of one connection.

    Args:
        max_header_bytes: the most bytes of request line and headers; more is a 431.
        header_timeout_s: seconds to send a whole request head, from the connection's opening or
            from the first byte of the next request on it.
        body_timeout_s: seconds to send the body, once the head is in.
        keep_alive_s: seconds an idle connection stays open between requests.
    """

    max_header_bytes: int = 64 * 1024
    header_timeout_s: float = 10.0
    body_timeout_s: float = 60.0
    keep_alive_s: float = 5.0


def _response(status: int, reason: str, message: str, code: str) -> bytes:
    body = json.dumps(error_body(message, "invalid_request_error", code)).encode()
    head = (
        f"HTTP/1.1 {status} {reason}\r\n"
        "content-type: application/json\r\n"
        f"content-length: {len(body)}\r\n"
        "connection: close\r\n\r\n"
    )
    return head.encode("ascii") + body


class ClientGone:
    """Calls back when the client of one request has left (its connection lost, or its body too
    slow) before the answer was complete: :class:`sluice.api.sse.ClientWatch`.

    Attributes:
        cycle: uvicorn's request/response cycle of the request.
    """

    __slots__ = ("_callbacks", "_loop", "cycle")

    def __init__(self, cycle: RequestResponseCycle, loop: asyncio.AbstractEventLoop) -> None:
        self.cycle = cycle
        self._loop = loop
        self._callbacks: list[Callable[[], None]] = []

    def watch(self, callback: Callable[[], None]) -> Callable[[], None]:
        if self.cycle.disconnected:
            handle = self._loop.call_soon(callback)
            return handle.cancel
        self._callbacks.append(callback)
        return lambda: self._discard(callback)

    def _discard(self, callback: Callable[[], None]) -> None:
        if callback in self._callbacks:
            self._callbacks.remove(callback)

    def fire(self) -> None:
        """The client left: call every callback once."""
        callbacks, self._callbacks = self._callbacks, []
        for callback in callbacks:
            callback()


class OneWrite:
    """The transport one request's answer is written through, with fewer writes (each one trip
    through the kernel), none of them held past the end of its turn of the event loop:

    - the answer's head is held until its body's first write, as long as that comes in the same
      turn of the event loop (an answer sent whole does: its two ``send`` calls never wait), so
      that both go out in one write; a head whose body comes later (a stream) goes out at the end
      of the turn;
    - a write goes out at once when it is the first of its turn; what else is written in the same
      turn (a stream's tokens that came together, its end after its last token) is gathered and
      written in one go at the end of the turn. A stream's first token, and any token alone in
      its turn, is therefore not delayed at all; one that came with others waits only for the
      rest of the turn (the others' ``send``), which it would have spent in that many writes.

    Everything else is the connection's transport itself.

    Attributes:
        transport: the connection's transport.
    """

    __slots__ = ("_first", "_gathered", "_head", "_loop", "transport")

    def __init__(self, transport: asyncio.Transport, loop: asyncio.AbstractEventLoop) -> None:
        self.transport = transport
        self._loop = loop
        #: the head, held until the body's first write or the end of its turn
        self._head: bytes | None = None
        #: what this turn wrote after its first write, for its end; None: no write this turn yet
        self._gathered: list[bytes] | None = None
        self._first = True

    def write(self, data: bytes) -> None:
        gathered = self._gathered
        if gathered is not None:  # not the turn's first write: it joins the turn's end
            head, self._head = self._head, None
            if head is not None:  # the body right after its head: both at once
                self.transport.write(head + data)
            else:
                gathered.append(data)
            return
        self._gathered = []
        self._loop.call_soon(self.flush)
        if self._first:
            self._first = False
            self._head = data
            return
        self.transport.write(data)

    def flush(self) -> None:
        """Write what is held or gathered, if anything; the next write is a turn's first again."""
        head, self._head = self._head, None
        gathered, self._gathered = self._gathered, None
        # A held head and gathered writes never meet: the turn's second write takes the head with it.
        data = head if head is not None else b"".join(gathered) if gathered else b""
        if data and not self.transport.is_closing():
            self.transport.write(data)

    def close(self) -> None:
        self.flush()
        self.transport.close()

    def is_closing(self) -> bool:
        return self.transport.is_closing()

    def __getattr__(self, name: str) -> Any:
        return getattr(self.transport, name)


class BoundedHttpToolsProtocol(HttpToolsProtocol):
    """uvicorn's httptools protocol with :class:`ConnectionLimits` (a subclass of it per set of
    limits is made by :func:`bounded_protocol`, as uvicorn takes a class)."""

    limits = ConnectionLimits()

    def __init__(self, *args: Any, **kwargs: Any) -> None:
        super().__init__(*args, **kwargs)
        # uvicorn's keep-alive timer reads this attribute; it takes fractions of a second too.
        self.timeout_keep_alive = self.limits.keep_alive_s  # type: ignore[assignment]
        #: bytes received of the request head now being read
        self._head_bytes = 0
        self._in_head = True
        # One timer for the head's and the body's time-outs, set lazily: a phase's change moves
        # ``_deadline`` (and what it calls), and the timer, when it fires, re-arms itself for a
        # deadline that moved later. A request changes phase three times; arming and cancelling
        # a timer each time were three timers made and three cancelled for every request.
        self._timer: asyncio.TimerHandle | None = None
        #: when the pending timer fires (loop time), if there is one
        self._timer_at = 0.0
        #: when the current phase's time is up (loop time); None: no time-out runs
        self._deadline: float | None = None
        #: what the deadline calls, a function of the protocol (not a bound method: kept here, one
        #: would be a cycle through the protocol)
        self._on_deadline: Callable[[BoundedHttpToolsProtocol], None] = BoundedHttpToolsProtocol._head_timeout
        self._refused = False
        #: the watches of this connection's requests that may still be answering
        self._gone: list[ClientGone] = []

    # --- timers -------------------------------------------------------------------------------

    def _arm(self, seconds: float, handler: Callable[[BoundedHttpToolsProtocol], None]) -> None:
        deadline = self.loop.time() + seconds
        self._deadline = deadline
        self._on_deadline = handler
        timer = self._timer
        if timer is None or self._timer_at > deadline:
            if timer is not None:
                timer.cancel()
            self._timer_at = deadline
            self._timer = self.loop.call_at(deadline, self._deadline_passed)

    def _disarm(self) -> None:
        # The timer stays, if one is pending: it fires for nothing, or finds a later deadline.
        self._deadline = None

    def _cancel_timer(self) -> None:
        """No time-out from now on, and no timer left to keep the protocol alive."""
        self._deadline = None
        if self._timer is not None:
            self._timer.cancel()
            self._timer = None

    def _deadline_passed(self) -> None:
        self._timer = None
        deadline = self._deadline
        if deadline is None:
            return
        # A millisecond early counts (the loop's timers are that coarse), so that a timer due
        # now is not armed again for a fraction of one.
        if self.loop.time() < deadline - TIMER_SLACK_S:
            self._timer_at = deadline
            self._timer = self.loop.call_at(deadline, self._deadline_passed)
            return
        self._deadline = None
        self._on_deadline(self)

    def _head_timeout(self) -> None:
        if self._head_bytes:
            self._refuse(
                _response(408, "Request Timeout", "The request's headers came too slowly.", "timeout")
            )
        elif not self.transport.is_closing():
            self.transport.close()

    def _body_timeout(self) -> None:
        cycle = self.cycle
        if cycle is None or cycle.response_complete:
            return
        answer = b""
        if not cycle.response_started:
            answer = _response(408, "Request Timeout", "The request's body came too slowly.", "timeout")
        # The app reads a disconnect from now on, and anything it still sends is dropped.
        cycle.disconnected = True
        cycle.message_event.set()
        self._fire_gone()
        self._refuse(answer)

    def _fire_gone(self) -> None:
        gone, self._gone = self._gone, []
        for watch in gone:
            if watch.cycle.disconnected:
                watch.fire()

    def _refuse(self, answer: bytes) -> None:
        """Answer (if there is anything to say), stop parsing, and close after a short drain."""
        if self._refused or self.transport.is_closing():
            return
        self._refused = True
        self._cancel_timer()
        self._unset_keepalive_if_required()
        if answer:
            self.transport.write(answer)
        self.flow.resume_reading()  # drained, not parsed: nothing more is kept
        if self.transport.can_write_eof():
            self.transport.write_eof()
        self.loop.call_later(LINGER_S, self.transport.close)

    # --- the protocol -------------------------------------------------------------------------

    def connection_made(self, transport: asyncio.Transport) -> None:  # type: ignore[override]
        super().connection_made(transport)
        self._arm(self.limits.header_timeout_s, BoundedHttpToolsProtocol._head_timeout)

    def connection_lost(self, exc: Exception | None) -> None:
        self._cancel_timer()
        super().connection_lost(exc)
        for watch in self._gone:
            if not watch.cycle.response_complete:
                watch.cycle.disconnected = True  # a pipelined request's too: its client is gone
        self._fire_gone()

    def data_received(self, data: bytes) -> None:
        if self._refused:
            return  # drained
        if self._in_head:
            self._head_bytes += len(data)
        super().data_received(data)
        # Checked after parsing, so that a body in the same read is not taken for headers; the
        # parser holds at most one read (256 KiB) beyond the bound.
        if self._in_head and self._head_bytes > self.limits.max_header_bytes:
            message = f"The request's headers exceed {self.limits.max_header_bytes} bytes."
            self._refuse(
                _response(431, "Request Header Fields Too Large", message, "request_header_fields_too_large")
            )

    def on_message_begin(self) -> None:
        super().on_message_begin()
        self._in_head = True
        if self._deadline is None:  # the next request on a kept-alive connection
            self._arm(self.limits.header_timeout_s, BoundedHttpToolsProtocol._head_timeout)

    def on_headers_complete(self) -> None:
        self._in_head = False
        self._head_bytes = 0
        self._disarm()
        super().on_headers_complete()
        if not (self.parser.should_upgrade() and self._should_upgrade()):
            self._arm(self.limits.body_timeout_s, BoundedHttpToolsProtocol._body_timeout)
            cycle = self.cycle
            if cycle is not None and cycle.scope is self.scope:
                cycle.transport = OneWrite(self.transport, self.loop)  # type: ignore[assignment]
                watch = ClientGone(cycle, self.loop)
                self._gone = [w for w in self._gone if not w.cycle.response_complete]
                self._gone.append(watch)
                extensions: dict[str, Any] = self.scope.setdefault("extensions", {})
                extensions[CLIENT_GONE] = watch

    def on_message_complete(self) -> None:
        self._disarm()
        self._in_head = True
        super().on_message_complete()


def bounded_protocol(limits: ConnectionLimits) -> type[BoundedHttpToolsProtocol]:
    """The protocol class to give uvicorn (``Config(http=...)``) for these limits."""
    return type("BoundedHttpToolsProtocol", (BoundedHttpToolsProtocol,), {"limits": limits})
