"""Waiting on a job for a synchronous client, and turning a finished job into an HTTP answer."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
import types
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, Generic, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.requests import HTTPConnection
from starlette.types import Message, Receive, Scope, Send

from sluice.api import auth
from sluice.api.errors import APIError
from sluice.api.sse import client_watch, disconnected, resumed
from sluice.broker.base import Broker, Event, EventType
from sluice.core.job import Job, JobState
from sluice.protocol import TokenChunks, chunk, chunk_fields, compact_json, error_body

T = TypeVar("T")

# How long past its deadline a synchronous client keeps waiting for the dispatcher's final word.
DEADLINE_SLACK_S = 5.0


async def until_client_leaves(
    scope: Scope, receive: Receive, awaitable: Awaitable[T]
) -> tuple[bool, T | None]:
    """``(True, what awaitable gives)``, or ``(False, None)`` as soon as the client disconnects,
    ``awaitable`` then cancelled. With the server's :class:`ClientWatch` the awaitable runs in this
    task, which the watch cancels; elsewhere a task reads the disconnect from ``receive``."""
    watch = client_watch(scope)
    if watch is None:
        return await _until_disconnect_read(receive, awaitable)
    task = asyncio.current_task()
    assert task is not None
    left = False

    def gone() -> None:
        nonlocal left
        left = True
        task.cancel()

    stop = watch.watch(gone)
    try:
        return True, await awaitable
    except asyncio.CancelledError:
        # Ours, and only ours: the client left. Anyone else's cancellation goes on.
        if not left or task.uncancel() > 0:
            raise
        return False, None
    finally:
        stop()


async def _until_disconnect_read(receive: Receive, awaitable: Awaitable[T]) -> tuple[bool, T | None]:
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.create_task(disconnected(receive))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watcher):
            task.cancel()
    if work.done() and not work.cancelled():
        return True, work.result()
    return False, None


async def while_connected(request: Request, awaitable: Awaitable[T]) -> T | None:
    """What ``awaitable`` gives, or None as soon as the client disconnects (it is then cancelled):
    a long poll must not outlive its client, nor keep the connection slot it holds."""
    _, result = await until_client_leaves(request.scope, request.receive, awaitable)
    return result


async def cancel_quietly(broker: Broker, job_id: str) -> None:
    with contextlib.suppress(Exception):
        await asyncio.shield(broker.cancel(job_id))


async def wait_for_client(request: Request, broker: Broker, job: Job) -> Job | None:
    """Wait until the job is terminal; cancel it and return None if the client goes away first."""
    budget = max(job.deadline - job.created_at, 0) + DEADLINE_SLACK_S
    stayed, finished = await until_client_leaves(request.scope, request.receive, broker.wait(job.id, budget))
    if stayed:
        return finished
    await cancel_quietly(broker, job.id)
    return None


def failure(job: Job) -> APIError:
    """The HTTP error for a job that ended without a result. An engine's refusal is a 400 with the
    parameter it named; an engine failure a 502, which tells the client not to retry once Sluice
    has retried it already (the SDKs would retry every one of Sluice's attempts again)."""
    err = job.error
    message = err.message if err else f"The job ended in state {job.state.value}."
    code = err.code if err else None
    if job.state is JobState.EXPIRED:
        return APIError(504, message, code or "deadline_exceeded", should_retry=False)
    if job.state is JobState.CANCELLED:
        return APIError(409, message, code or "cancelled", should_retry=False)
    if err is not None and err.type == "invalid_request_error":
        return APIError(400, message, code, param=err.param)
    retried = job.attempts > 1
    return APIError(502, message, code or "engine_error", should_retry=False if retried else None)


async def failure_of(broker: Broker, job: Job) -> APIError:
    """The error of ``job``, just ended without an answer (its ERROR event read): :func:`failure`
    of the job as the broker has it now (its error and state), named by its id. A stream whose job
    ends so before its first token is answered with it, its status rather than a stream."""
    error = failure(await broker.get(job.id) or job)
    error.job_id = job.id
    return error


#: How long a stream's headers wait for the engine to take the job (its first token, or its end):
#: the route's default (``/v1/chat/completions``, ``/v1/completions`` and ``/v1/responses``).
ACCEPT_WAIT_S = 5.0


async def engine_accepted(broker: Broker, job: Job, within_s: float = ACCEPT_WAIT_S) -> int:
    """Return once the engine has taken ``job`` (its first token, or its successful end), or after
    ``within_s`` seconds; raise the job's failure as an :class:`APIError` if it ended without an
    answer before that, so that it is answered with its status rather than inside a stream.
    Retried attempts before the first token are waited through.

    Returns the id of the last event it read before the token or the end: every event up to it
    is one a stream skips (queued, started, a retry before any token), so that the stream reads
    on after it (:func:`openai_stream`'s ``after``) rather than walking them again.

    On a broker that calls its readers back (``follow``: the memory broker) the events are taken
    as the broker calls with each, in the publisher's own turn: the job's start, published in the
    dispatcher's turn that claims it, wakes no task of this route's (its wake-up ran ahead of the
    engine request's write, which aiohttp leaves to the next turn), and the first token wakes it
    by a future alone, without an async generator's frames. The same events, read the same way."""
    follow = getattr(broker, "follow", None)
    if follow is not None:
        followed = await _accepted_followed(follow, broker, job, within_s)
        if followed is not None:
            return followed
    events = broker.events(job.id)
    skipped = 0
    #: the event that ended the wait (the token, the end); None: none yet
    ended: EventType | None = None

    async def read() -> None:
        nonlocal skipped, ended
        try:
            async for event in events:
                if event.type in _ACCEPTING:
                    ended = event.type
                    if event.type is EventType.ERROR:
                        raise await failure_of(broker, job)
                    return
                skipped = event.id
        finally:
            await events.aclose()  # type: ignore[attr-defined]

    # The events read in a task of their own that the wait's end does not cancel once one has ended
    # it: an error read in the very turn the wait runs out is still raised (asyncio.timeout's
    # cancellation would throw it away, and the refusal would go out as a 200 whose stream holds it).
    reading = asyncio.ensure_future(read())
    try:
        await asyncio.wait({reading}, timeout=within_s)
    finally:
        if ended is None:
            reading.cancel()
        await asyncio.gather(reading, return_exceptions=True)
    if ended is not None:
        reading.result()  # the job's failure, raised
    return skipped


async def _accepted_followed(follow: Any, broker: Broker, job: Job, within_s: float) -> int | None:
    """:func:`engine_accepted` through ``broker.follow``; None where the broker will not call
    back for this job (it has a follower already, or is not known): the caller reads the events."""
    loop = asyncio.get_running_loop()
    #: the event that ended the wait; None: the wait ran out
    accepted: asyncio.Future[EventType | None] = loop.create_future()
    skipped = 0

    def follower(event_id: int, type: EventType, data: Any) -> bool:
        nonlocal skipped
        if accepted.done():  # timed out or cancelled meanwhile
            return False
        if type in _ACCEPTING:
            accepted.set_result(type)
            return False
        skipped = event_id
        return True

    stop = follow(job.id, 0, follower)
    if stop is None:
        return None
    # The wait's end as a timer that settles the future, not asyncio.timeout's cancellation of
    # this task (its context manager, the task's cancel count, the CancelledError turned into a
    # TimeoutError): the same bound, a few calls a stream fewer.
    timer = None if accepted.done() else loop.call_later(within_s, _ran_out, accepted)
    try:
        outcome = await accepted
    finally:
        stop()
        if timer is not None:
            timer.cancel()
    if outcome is EventType.ERROR:
        raise await failure_of(broker, job)
    return skipped


def _ran_out(waiting: asyncio.Future[Any]) -> None:
    """A wait's timer: the future settled with None (the wait ran out) unless an event, or the
    waiter's cancellation, settled it first. One for every such wait (the responses stream's
    too), so that a test counts the timers left by looking for this one callback."""
    if not waiting.done():
        waiting.set_result(None)


#: the events that end :func:`engine_accepted`'s wait: the first token, the end (the job's answer,
#: or its failure: the terminal events). A stream that ends with any other would be read through.
_ACCEPTING = frozenset({EventType.TOKEN, EventType.DONE, EventType.ERROR})


#: What starlette's JSONResponse adds after the given headers: its media type, as it sends it
#: (here for a whole answer, and for the lean routes' errors: :func:`sluice.api.lean.send_error`).
JSON_TYPE = (b"content-type", b"application/json")
#: The headers' names as they go out (lowercase latin-1), made once per name: a whole answer has
#: the same few, all Sluice's own (the job's id twice, a rate limit's six).
_RAW_NAMES: dict[str, bytes] = {}
#: The most names :data:`_RAW_NAMES` keeps: Sluice's own are a few, but WholeAnswer takes any
#: headers, and a caller passing names of its own must not grow the cache for ever (past it a
#: name is lowered and encoded on each answer, as starlette does).
RAW_NAMES_KEPT = 64


class WholeAnswer(JSONResponse):
    """starlette's ``JSONResponse(content, headers=headers)``: the same status, body and raw
    headers, in the same order, made without its steps (``render`` through a JSONEncoder made per
    answer, ``init_headers``' scans for a Content-Length or Content-Type among headers that never
    carry one, the ``super()`` chain). Still a Response, so that the FastAPI routes send it as any
    other; the lean routes send its two messages to the server themselves
    (:func:`sluice.api.lean.serve`).

    ``headers`` must not name ``content-length`` or ``content-type`` (JSONResponse would then send
    them instead of its own): a job's answer carries its ids and its rate limit's headers only."""

    def __init__(self, content: Any, headers: dict[str, str] | None = None) -> None:
        self.status_code = 200
        self.background = None
        self.body = body = compact_json(content)
        raw: list[tuple[bytes, bytes]] = []
        if headers:
            names = _RAW_NAMES
            for k, v in headers.items():
                name = names.get(k)
                if name is None:
                    name = k.lower().encode("latin-1")
                    if len(names) < RAW_NAMES_KEPT:
                        names[k] = name
                raw.append((name, v.encode("latin-1")))
        raw += ((b"content-length", str(len(body)).encode()), JSON_TYPE)
        self.raw_headers = raw


def answer(job: Job | None, headers: dict[str, str] | None = None) -> JSONResponse:
    """The whole answer of a finished job, with ``headers`` (given to the response as it is made:
    setting them afterwards went through starlette's MutableHeaders, a scan of the list for each)."""
    if job is None:
        raise APIError(404, "The job no longer exists.", "job_not_found")
    if job.state is JobState.SUCCEEDED and job.result is not None:
        return WholeAnswer(job.result, headers)
    if not job.terminal:
        raise APIError(504, "The job did not finish in time.", "deadline_exceeded", should_retry=False)
    raise failure(job)


async def bounded(events: AsyncIterator[Event], seconds: float) -> AsyncIterator[Event]:
    """The events, until ``seconds`` have passed: no stream a client holds open lives forever."""
    deadline = asyncio.get_running_loop().time() + seconds
    try:
        while True:
            try:
                async with asyncio.timeout_at(deadline):
                    event = await anext(events)
            except (StopAsyncIteration, TimeoutError):
                return
            yield event
    finally:
        await events.aclose()  # type: ignore[attr-defined]


class KeyRevoked(Exception):
    """The key that opened a stream was revoked: the stream ends."""


#: Whether the caller's key is still valid (``KeyRing.still_valid`` of the caller).
KeyCheck = Callable[[], Awaitable[bool]]

log = logging.getLogger("sluice.gateway")


def key_check(connection: HTTPConnection, caller: auth.Caller) -> KeyCheck | None:
    """How an open stream of ``caller`` asks whether its key still stands; None where no key can be
    revoked while the gateway runs (open mode, or keys from the configuration file only)."""
    keyring: auth.KeyRing = connection.app.state.keyring
    if not caller.keyed or not keyring.settings.key_store:
        return None
    return functools.partial(keyring.still_valid, caller)


def revocable(events: AsyncIterator[Event], alive: KeyCheck | None) -> AsyncIterator[Event]:
    """The events while the caller's key stands: ``alive`` is asked every STORED_KEY_CACHE_S, also
    while no event comes, and the stream ends with :class:`KeyRevoked` once it says no. A revoked
    key's streams end as fast as its new requests are refused. With None, the events as they are."""
    return events if alive is None else _revocable(events, alive)


async def _revocable(events: AsyncIterator[Event], alive: KeyCheck) -> AsyncIterator[Event]:
    loop = asyncio.get_running_loop()
    period = auth.STORED_KEY_CACHE_S
    check_at = loop.time() + period
    # The next event is awaited in a task that outlives each check: cancelling it would end the
    # event stream itself.
    pending: asyncio.Future[Event] | None = None
    try:
        while True:
            if pending is None:
                pending = asyncio.ensure_future(anext(events))
            done, _ = await asyncio.wait({pending}, timeout=max(check_at - loop.time(), 0))
            if done:
                finished, pending = pending, None
                try:
                    event = finished.result()
                except StopAsyncIteration:
                    return
                yield event
            if loop.time() >= check_at:
                if not await _still_valid(alive):
                    raise KeyRevoked
                check_at = loop.time() + period
    finally:
        if pending is not None:
            pending.cancel()
            await asyncio.gather(pending, return_exceptions=True)
        await events.aclose()  # type: ignore[attr-defined]


async def _still_valid(alive: KeyCheck) -> bool:
    try:
        return await alive()
    except Exception:
        # The key store did not answer: asked again at the next period rather than cutting every
        # stream of a gateway on one broker hiccup.
        log.warning("could not check an open stream's key; will ask again", exc_info=True)
        return True


REVOKED = {"message": "The API key was revoked.", "type": "invalid_request_error", "code": "invalid_api_key"}


def openai_stream(
    broker: Broker,
    job: Job,
    include_usage: bool,
    held: contextlib.AsyncExitStack | None = None,
    alive: KeyCheck | None = None,
    after: int = 0,
    accept_within: float | None = None,
) -> OpenAIStream:
    """SSE payloads (each one event's ``data``) of an OpenAI stream, fed by the job's events, for
    :class:`EventStream`, which bounds the stream's time. Cancels the job if the stream ends before
    the job does (the client left, the stream's time is up), or if the caller's key is revoked
    meanwhile (``alive``, see :func:`revocable`: an error payload ends it).

    ``held`` (the caller's connection slot) is released when the stream ends, however it ends.
    ``after``: the events up to this id are not read (what :func:`engine_accepted` read and this
    stream would skip).

    ``accept_within``: the stream itself waits, for up to this many seconds, until the engine
    has taken the job, as :func:`engine_accepted` waits, before its head goes out: the
    :class:`EventStream` then raises the job's failure as an :class:`APIError`, before any byte
    is sent, where it ends without an answer first (:meth:`OpenAIStream.relay_tokens`). None: the
    caller waited already.
    """
    return OpenAIStream(broker, job, include_usage, held, alive, after, accept_within)


#: A stream's error when its engine failed after some of its tokens were sent.
MID_ANSWER = {
    "message": "The engine failed mid-answer; retry the request.",
    "code": "engine_error",
    "type": "server_error",
    "param": None,
}

#: The events an OpenAI stream passes over (it reads tokens, a retry, the end).
_PASSED_OVER = frozenset(EventType) - {EventType.TOKEN, EventType.RETRY, EventType.DONE, EventType.ERROR}


class Payloads(Generic[T]):
    """A stream's payloads read once, by one generator (:meth:`_read`, made on first use), and its
    end's work (:meth:`_end`, once) done however it ends: read through, closed, or never read.
    :class:`OpenAIStream`'s and :class:`~sluice.api.responses.ResponseStream`'s."""

    _payloads: AsyncIterator[T] | None = None

    def __aiter__(self) -> AsyncIterator[T]:
        # The generator itself: ``async for`` then resumes no coroutine of this class per payload.
        if self._payloads is None:
            self._payloads = self._read()
        return self._payloads

    async def __anext__(self) -> T:
        return await anext(self.__aiter__())

    def _read(self) -> AsyncIterator[T]:
        raise NotImplementedError

    async def _end(self) -> None:
        raise NotImplementedError

    async def aclose(self) -> None:
        """Close the payloads; the end's work is done whether they were read or not."""
        try:
            if self._payloads is not None:
                await self._payloads.aclose()  # type: ignore[attr-defined]
        finally:
            await self._end()


class OpenAIStream(Payloads[str]):
    """:func:`openai_stream`'s payloads: an async iterator of each event's ``data``, which
    :meth:`relay_tokens` may take the first tokens of straight to the client.

    On a broker that calls its readers back (one with ``follow``: the memory broker), the stream's
    tokens do not wake the stream's task: the broker calls it back with each token as the
    dispatcher publishes it, and the token's frame is written in that call (:meth:`relay_tokens`).
    Anything but a token (a retry, the end, an error) and whatever follows it is read by the
    iterator, as on any broker, from the event after the last token relayed so."""

    def __init__(
        self,
        broker: Broker,
        job: Job,
        include_usage: bool,
        held: contextlib.AsyncExitStack | None,
        alive: KeyCheck | None,
        after: int,
        accept_within: float | None = None,
    ) -> None:
        self.broker = broker
        self.job = job
        self.include_usage = include_usage
        self.held = held
        self.alive = alive
        #: the id of the last event read (or skipped)
        self.after = after
        #: how long the stream's head waits for the engine to take the job (:func:`openai_stream`);
        #: None: it does not wait (the caller did)
        self.accept_within = accept_within
        self.tokens = TokenChunks(job)
        self.sent_tokens = False
        self.finished = False
        self._closed = False

    async def _read(self) -> AsyncIterator[str]:
        try:
            async for event in revocable(self.broker.events(self.job.id, self.after), self.alive):
                self.after = event.id
                if event.type is EventType.TOKEN:
                    self.sent_tokens = True
                    yield self.tokens.encode(event.data)
                elif event.type is EventType.RETRY and self.sent_tokens:
                    # Tokens already sent cannot be taken back: end this stream with an error.
                    self.finished = True
                    yield json.dumps({"error": MID_ANSWER})
                    yield "[DONE]"
                    await cancel_quietly(self.broker, self.job.id)
                    return
                elif event.type is EventType.DONE:
                    self.finished = True
                    if self.include_usage:
                        # The answer's own fields (the engine's latest system_fingerprint, ...) ride
                        # with the usage, as on OpenAI's last chunk.
                        result = event.data.get("result")
                        fields = chunk_fields(result) if isinstance(result, dict) else None
                        usage = event.data.get("usage")
                        yield json.dumps(chunk(self.job, [], usage=usage, fields=fields))
                    yield "[DONE]"
                    return
                elif event.type is EventType.ERROR:
                    self.finished = True
                    final = await self.broker.get(self.job.id)
                    error = failure(final or self.job)
                    yield json.dumps(error_body(error.message, error.type, error.code, error.param))
                    yield "[DONE]"
                    return
        except KeyRevoked:
            yield json.dumps({"error": REVOKED})
        finally:
            await self._end()

    async def _end(self) -> None:
        """The end, however it came (once): the job cancelled if it has not ended, the slot
        released."""
        if self._closed:
            return
        self._closed = True
        if not self.finished:
            await cancel_quietly(self.broker, self.job.id)
        if self.held is not None:
            await self.held.aclose()

    async def relay_tokens(
        self, send: Send, start: Message | None = None, began: Callable[[], None] | None = None
    ) -> None:
        """Write the stream's tokens to ``send`` as the broker calls back with each, until
        anything but a token comes (which the iterator then reads, and what follows it). Returns at
        once where the broker does not call back (no ``follow``), where the key is to be checked
        as the stream goes (``alive``), or once the iterator has begun.

        Each token's frame is written in the broker's call, by running ``send`` at once: the
        server's ``send`` (uvicorn's) returns without waiting unless the connection's buffer is
        full. When one waits, the frames after it are kept in order, and this task finishes the
        waiting ``send`` and writes them, then takes the callbacks again.

        ``start``: the stream's head, not sent yet, which waits for the engine to take the job
        (``accept_within``): it is sent with the first token's frame, in the broker's call (no
        turn of the loop for this task between the token and its bytes), or as the wait runs out,
        ``began`` called as it is handed to ``send``. A job that ends without an answer before
        raises its failure (an :class:`APIError`), the head unsent; one that ends with its answer
        and no token returns with the head unsent, for the caller to send and read on. On a broker
        without ``follow`` the wait is :func:`engine_accepted`'s. With ``alive``, the first token
        is written so and the rest read by the iterator (its key checks)."""
        follow = getattr(self.broker, "follow", None)
        if start is not None and self.accept_within is not None:
            followable = follow is not None and self._payloads is None and not self._closed
            if followable and await self._relay(follow, send, start, began, self.accept_within):
                return
            # No calls back for this job: the wait reads its events, as engine_accepted does.
            self.after = max(self.after, await engine_accepted(self.broker, self.job, self.accept_within))
            return
        if follow is None or self.alive is not None or self._payloads is not None or self._closed:
            return
        await self._relay(follow, send, None, None, None)

    async def _relay(
        self,
        follow: Any,
        send: Send,
        start: Message | None,
        began: Callable[[], None] | None,
        accept_within: float | None,
    ) -> bool:
        """:meth:`relay_tokens` through ``follow``; False where the broker will not call back for
        this job (it has a follower already, or is not known): nothing was done."""
        loop = asyncio.get_running_loop()
        wake: asyncio.Future[None] = loop.create_future()
        #: the head while it waits for the engine (None: sent, or not this stream's to send)
        opening = start
        #: messages that came while a send waited, in order; None: none waits
        queued: list[Message] | None = None
        #: the rest of a send that waits
        waiting: Awaitable[None] | None = None
        failed: BaseException | None = None
        #: the event handed to the iterator (None: none yet)
        handed: EventType | None = None
        encode = self.tokens.encode
        first_only = self.alive is not None  # the key's checks: the iterator reads on

        def write(message: Message) -> None:
            # send run at once, by hand, up to its first wait (if it waits at all)
            nonlocal queued, waiting, failed
            if failed is not None:
                return
            if queued is not None:
                queued.append(message)
                return
            writing = send(message)
            if isinstance(writing, types.CoroutineType):
                try:
                    pending = writing.send(None)
                except StopIteration:
                    return
                except BaseException as exc:  # the send's own error: the stream's task raises it
                    failed = exc
                else:
                    waiting, queued = resumed(writing, pending), []
            else:  # an awaitable that is not a coroutine: the stream's task awaits it
                waiting, queued = writing, []

        def open_stream(head: Message) -> None:
            nonlocal opening
            opening = None
            if began is not None:
                began()
            write(head)

        def follower(event_id: int, type: EventType, data: Any) -> bool:
            nonlocal handed
            if type is EventType.TOKEN:
                self.after = event_id
                self.sent_tokens = True
                if opening is not None:
                    open_stream(opening)
                # sse_frame's, without its look for line breaks: json.dumps escapes every one
                frame = b"data: " + encode(data).encode() + b"\n\n"
                write({"type": "http.response.body", "body": frame, "more_body": True})
                if first_only:
                    handed = type
                elif waiting is None and failed is None:
                    return True
            elif type in _PASSED_OVER or (type is EventType.RETRY and not self.sent_tokens):
                # a retry before any token is waited through, as engine_accepted does
                self.after = event_id
                return True
            else:
                handed = type
            if not wake.done():
                wake.set_result(None)
            return failed is None and handed is None

        def ran_out() -> None:
            # the engine has not taken the job in time: the stream starts without it. Not if an
            # event came first in this turn (an error before the head must stay unsent: its status)
            if opening is not None and handed is None:
                open_stream(opening)
                if (waiting is not None or failed is not None) and not wake.done():
                    wake.set_result(None)

        stop = follow(self.job.id, self.after, follower)
        if stop is None:
            return False
        timer = None
        if opening is not None and handed is None and accept_within is not None:
            timer = loop.call_later(accept_within, ran_out)
        try:
            while True:
                await wake
                if failed is not None:
                    raise failed
                if waiting is not None:
                    rest, waiting = waiting, None
                    await rest
                    while queued:
                        messages, queued = queued, []
                        for message in messages:
                            await send(message)
                    queued = None
                if handed is not None:
                    break
                wake = loop.create_future()
        finally:
            stop()
            if timer is not None:
                timer.cancel()
        if handed is EventType.ERROR and opening is not None:
            # Ended before its first token, nothing sent: answered with its status, not a stream.
            self.finished = True
            raise await failure_of(self.broker, self.job)
        return True
