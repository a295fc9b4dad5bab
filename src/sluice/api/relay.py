"""Waiting on a job for a synchronous client, and turning a finished job into an HTTP answer."""

from __future__ import annotations

import asyncio
import contextlib
import functools
import json
import logging
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from fastapi import Request
from fastapi.responses import JSONResponse
from starlette.requests import HTTPConnection

from sluice.api import auth
from sluice.api.errors import APIError
from sluice.broker.base import Broker, Event, EventType
from sluice.core.job import Job, JobState
from sluice.protocol import chunk, chunk_fields, error_body

T = TypeVar("T")

# How long past its deadline a synchronous client keeps waiting for the dispatcher's final word.
DEADLINE_SLACK_S = 5.0


async def _disconnected(request: Request) -> None:
    # The body was read already, so the next message is the disconnect, whenever it comes.
    while True:
        message = await request.receive()
        if message["type"] == "http.disconnect":
            return


async def while_connected(request: Request, awaitable: Awaitable[T]) -> T | None:
    """What ``awaitable`` gives, or None as soon as the client disconnects (it is then cancelled):
    a long poll must not outlive its client, nor keep the connection slot it holds."""
    work = asyncio.ensure_future(awaitable)
    watcher = asyncio.create_task(_disconnected(request))
    try:
        await asyncio.wait({work, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (work, watcher):
            task.cancel()
    return work.result() if work.done() and not work.cancelled() else None


async def cancel_quietly(broker: Broker, job_id: str) -> None:
    with contextlib.suppress(Exception):
        await asyncio.shield(broker.cancel(job_id))


async def wait_for_client(request: Request, broker: Broker, job: Job) -> Job | None:
    """Wait until the job is terminal; cancel it and return None if the client goes away first."""
    budget = max(job.deadline - job.created_at, 0) + DEADLINE_SLACK_S
    waiter = asyncio.create_task(broker.wait(job.id, budget))
    watcher = asyncio.create_task(_disconnected(request))
    try:
        done, _ = await asyncio.wait({waiter, watcher}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for task in (waiter, watcher):
            task.cancel()
    if waiter in done and not waiter.cancelled():
        return waiter.result()
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


#: How long a stream's headers wait for the engine to take the job (its first token, or its end):
#: the route's default (``/v1/chat/completions``, ``/v1/completions`` and ``/v1/responses``).
ACCEPT_WAIT_S = 5.0


async def engine_accepted(broker: Broker, job: Job, within_s: float = ACCEPT_WAIT_S) -> None:
    """Return once the engine has taken ``job`` (its first token, or its successful end), or after
    ``within_s`` seconds; raise the job's failure as an :class:`APIError` if it ended without an
    answer before that, so that it is answered with its status rather than inside a stream.
    Retried attempts before the first token are waited through."""
    events = broker.events(job.id)
    try:
        async with asyncio.timeout(within_s):
            async for event in events:
                if event.type in (EventType.TOKEN, EventType.DONE):
                    return
                if event.type is EventType.ERROR:
                    error = failure(await broker.get(job.id) or job)
                    error.job_id = job.id
                    raise error
    except TimeoutError:
        return
    finally:
        await events.aclose()  # type: ignore[attr-defined]


def answer(job: Job | None) -> JSONResponse:
    if job is None:
        raise APIError(404, "The job no longer exists.", "job_not_found")
    if job.state is JobState.SUCCEEDED and job.result is not None:
        return JSONResponse(job.result)
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


async def openai_stream(
    broker: Broker,
    job: Job,
    include_usage: bool,
    max_stream_s: float,
    held: contextlib.AsyncExitStack | None = None,
    alive: KeyCheck | None = None,
) -> AsyncIterator[dict[str, Any]]:
    """SSE payloads of an OpenAI stream, fed by the job's events. Cancels the job if the client leaves,
    or if its key is revoked meanwhile (``alive``, see :func:`revocable`: an error payload ends it).

    ``held`` (the caller's connection slot) is released when the stream ends, however it ends.
    """
    sent_tokens = False
    finished = False
    try:
        async for event in bounded(revocable(broker.events(job.id), alive), max_stream_s):
            if event.type is EventType.TOKEN:
                sent_tokens = True
                data = event.data
                yield {"data": json.dumps(chunk(job, data.get("choices") or [], fields=chunk_fields(data)))}
            elif event.type is EventType.RETRY and sent_tokens:
                # Tokens already sent cannot be taken back: end this stream with an error.
                finished = True
                err = {"message": "The engine failed mid-answer; retry the request.", "code": "engine_error"}
                yield {"data": json.dumps({"error": {**err, "type": "server_error", "param": None}})}
                yield {"data": "[DONE]"}
                await cancel_quietly(broker, job.id)
                return
            elif event.type is EventType.DONE:
                finished = True
                if include_usage:
                    # The answer's own fields (the engine's latest system_fingerprint, ...) ride
                    # with the usage, as on OpenAI's last chunk.
                    result = event.data.get("result")
                    fields = chunk_fields(result) if isinstance(result, dict) else None
                    usage = event.data.get("usage")
                    yield {"data": json.dumps(chunk(job, [], usage=usage, fields=fields))}
                yield {"data": "[DONE]"}
                return
            elif event.type is EventType.ERROR:
                finished = True
                final = await broker.get(job.id)
                error = failure(final or job)
                yield {"data": json.dumps(error_body(error.message, error.type, error.code, error.param))}
                yield {"data": "[DONE]"}
                return
    except KeyRevoked:
        yield {"data": json.dumps({"error": REVOKED})}
    finally:
        if not finished:
            await cancel_quietly(broker, job.id)
        if held is not None:
            await held.aclose()
