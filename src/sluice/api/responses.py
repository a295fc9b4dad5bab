"""OpenAI's Responses API on the queue: each response is a chat-completions job.

``POST /v1/responses`` translates the request (:mod:`sluice.core.response_request`) and queues it like
``/v1/chat/completions``: the same admission, priorities, deadlines and rate limits, and a client
that disconnects cancels it, unless it asked for ``background``. A stream's headers wait, as chat's
do, until the engine has taken the job, so that a rejection before the first token is an error
with its status rather than a ``response.failed`` event; the stream waits itself
(:class:`ResponseStream`), so a client that leaves meanwhile cancels the job at once, and on the
memory broker the head goes out with the first token's events in the broker's call.
``GET /v1/responses/{id}`` reads the job back as a Response (``?stream=true&starting_after=N``
replays its events from the job's event log), ``POST /v1/responses/{id}/cancel`` cancels it,
``DELETE`` cancels it if it is still running. Only the key that created a response sees it.
What is and is not translated: docs/responses.md.
"""

from __future__ import annotations

import asyncio
import contextlib
import types
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, StringConstraints
from starlette.types import Message, Send

from sluice.api import relay
from sluice.api.auth import Caller, Who
from sluice.api.errors import APIError
from sluice.api.gateway import Gateway, client_retry, gateway, rate_headers
from sluice.api.openapi import ADMIT, ANSWER, KEYED, errors, events
from sluice.api.relay import (
    KeyCheck,
    KeyRevoked,
    Payloads,
    bounded,
    cancel_quietly,
    engine_accepted,
    failure,
    failure_of,
    key_check,
    revocable,
    wait_for_client,
)
from sluice.api.schemas import PositiveTimeout
from sluice.api.sse import EventStream, EventStreamResponse, resumed, sse_event
from sluice.broker.base import Broker, EventType
from sluice.core.job import Endpoint, Job, JobState
from sluice.core.request import RequestRejected
from sluice.core.response_request import RECORD_KEY, chat_plan, follow_up, job_id_of
from sluice.core.responses import ResponseEvents, response_object
from sluice.protocol import plain_json

router = APIRouter(tags=["responses"])

PING_S = 15

MetadataKey = Annotated[str, StringConstraints(max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]


class ResponseRequest(BaseModel):
    """``POST /v1/responses``: the fields Sluice translates or checks; any other field is accepted
    and ignored (docs/responses.md lists them)."""

    model_config = ConfigDict(extra="allow")

    model: StrictStr | None = Field(default=None, description="Defaults to the only model served, if one.")
    input: StrictStr | list[dict[str, Any]] | None = Field(
        default=None, description="Text, or items: messages, function_call and function_call_output."
    )
    instructions: StrictStr | None = Field(default=None, description="Sent as a system message first.")
    tools: list[dict[str, Any]] | None = Field(default=None, description="Function tools only.")
    tool_choice: StrictStr | dict[str, Any] | None = None
    parallel_tool_calls: StrictBool | None = None
    max_output_tokens: StrictInt | None = Field(default=None, description="Sent as max_tokens.")
    temperature: Annotated[float, Field(ge=0, le=2, strict=True)] | None = None
    top_p: Annotated[float, Field(ge=0, le=1, strict=True)] | None = None
    metadata: dict[MetadataKey, MetadataValue] | None = Field(default=None, max_length=16)
    stream: StrictBool | None = None
    background: StrictBool | None = Field(
        default=None, description="Answer at once (status queued); read it with GET /v1/responses/{id}."
    )
    store: StrictBool | None = Field(
        default=None, description="Echoed; every response is kept as its job, for result_ttl_s."
    )
    previous_response_id: StrictStr | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    truncation: Literal["auto", "disabled"] | None = None
    user: StrictStr | None = None
    include: list[StrictStr] | None = Field(
        default=None,
        description="message.output_text.logprobs asks for log probabilities; others are ignored.",
    )
    top_logprobs: Annotated[int, Field(ge=0, le=20, strict=True)] | None = Field(
        default=None, description="Sent as logprobs: true and top_logprobs."
    )
    priority: StrictStr | None = Field(default=None, description="A priority class, e.g. high, normal, low.")
    timeout: PositiveTimeout | None = None


# What the chat rules call a field, and what the client called it in the request it sent.
_RENAMED = {
    "max_tokens": "max_output_tokens",
    "max_completion_tokens": "max_output_tokens",
    "messages": "input",
}


def _as_sent(error: APIError) -> APIError:
    """A chat rule's error in the words of the Responses request."""
    name = _RENAMED.get(error.param or "")
    if name is not None:
        error.message = error.message.replace(f"'{error.param}'", f"'{name}'")
        error.param = name
    return error


def _rejected(rejected: RequestRejected) -> APIError:
    return APIError(rejected.status, rejected.message, rejected.code, param=rejected.param)


async def _own(gw: Gateway, who: Caller, rid: str) -> Job:
    """The caller's own response's job, or 404: other tenants' ids, unknown ids and jobs that are
    not responses all read alike."""
    job_id = job_id_of(rid)
    job = await gw.broker.get(job_id) if job_id is not None else None
    if job is None or job.tenant != who.tenant or RECORD_KEY not in job.extra:
        raise APIError(404, f"No response with id '{rid}'.", "response_not_found", param="response_id")
    return job


async def _history(gw: Gateway, who: Caller, previous: str | None) -> list[dict[str, Any]]:
    if previous is None:
        return []
    try:
        job = await _own(gw, who, previous)
    except APIError:
        raise APIError(
            400,
            f"Previous response with id '{previous}' not found (responses are kept for "
            f"{gw.settings.result_ttl_s:g} s).",
            "previous_response_not_found",
            param="previous_response_id",
        ) from None
    if job.state is not JobState.SUCCEEDED:
        raise APIError(
            400,
            f"Previous response '{previous}' has no answer to continue (status {job.state.value}).",
            "invalid_value",
            param="previous_response_id",
        )
    return follow_up(job)


def _sse(event: dict[str, Any]) -> bytes:
    return sse_event(plain_json(event), event=event["type"], id=str(event["sequence_number"]))


class ResponseStream(Payloads[bytes]):
    """The response's events with ``sequence_number`` > ``after``, as SSE events (bytes) for
    :class:`~sluice.api.sse.EventStream`, made from the job's event log from its start (so that
    a replay numbers them as the first stream did): one :class:`ResponseEvents` fed every event
    of the job in order, first by the broker's calls back (:meth:`relay_tokens`), then by the
    iterator, which reads on after the last event fed.

    ``cancel_on_exit``: the client waits on this response, and leaving before its end cancels it.
    ``held`` (the caller's connection slot) is released when the stream ends, however it ends.
    ``alive``: the stream ends when the caller's key is revoked (:func:`sluice.api.relay.revocable`).
    ``limit_s``: the longest the events are read, from the stream's head.

    ``accept_within``: the stream's head waits, for up to this many seconds, until the engine has
    taken the job (its first token, or its end), as chat's does (:class:`~sluice.api.relay.
    OpenAIStream`'s ``accept_within``): a job that fails before is an :class:`APIError` with its
    status, in the request's words, nothing sent. On a broker that calls its readers back (the
    memory broker) the head and the first token's events are written in the broker's call, no turn
    of the loop for this stream's task between; the tokens after it are read by the iterator. None:
    the head does not wait (a replay)."""

    def __init__(
        self,
        broker: Broker,
        job: Job,
        after: int,
        cancel_on_exit: bool,
        held: contextlib.AsyncExitStack | None,
        alive: KeyCheck | None,
        limit_s: float,
        accept_within: float | None = None,
    ) -> None:
        self.broker = broker
        self.job = job
        self.after = after
        self.cancel_on_exit = cancel_on_exit
        self.held = held
        self.alive = alive
        self.limit_s = limit_s
        self.accept_within = accept_within
        self.events = ResponseEvents(job)
        #: the id of the job's last event fed to :attr:`events`
        self.fed = 0
        #: the events made and not sent yet (the opening's, then those of events before a token)
        self.pending = self.events.opening()
        #: the job ended before its first token: the route answers its failure, no cancel due
        self.refused = False
        self._closed = False

    def _feed(self, type: EventType, data: dict[str, Any]) -> list[dict[str, Any]]:
        """The response's events that one of the job's events makes."""
        events = self.events
        if type is EventType.STARTED:
            return events.started()
        if type is EventType.TOKEN:
            return events.chunk(data.get("choices") or [], data)
        if type is EventType.RETRY:
            return events.retried()
        if type is EventType.DONE:
            finished = (data.get("timings") or {}).get("finished_at")
            return events.done(data.get("usage"), data.get("result"), finished)
        if type is EventType.ERROR:
            return events.failed(JobState(data.get("status", "failed")), data.get("error"))
        return []

    def _framed(self, out: list[dict[str, Any]]) -> list[bytes]:
        after = self.after
        return [_sse(event) for event in out if event["sequence_number"] > after]

    async def _read(self) -> AsyncIterator[bytes]:
        try:
            pending, self.pending = self.pending, []
            for frame in self._framed(pending):
                yield frame
            events = revocable(self.broker.events(self.job.id, self.fed), self.alive)
            async for entry in bounded(events, self.limit_s):
                self.fed = entry.id
                for frame in self._framed(self._feed(entry.type, entry.data)):
                    yield frame
                if self.events.ended:
                    if entry.type is EventType.RETRY and self.cancel_on_exit:
                        # The client saw the failure; nobody waits for the retry's answer.
                        await cancel_quietly(self.broker, self.job.id)
                    return
        except KeyRevoked:
            return  # the client's reconnect gets the 401; a response it waited on is cancelled
        finally:
            await self._end()

    async def _end(self) -> None:
        """The end, however it came (once): the job cancelled if the client waited on it and it
        has not ended, the slot released."""
        if self._closed:
            return
        self._closed = True
        try:
            if self.cancel_on_exit and not self.events.ended and not self.refused:
                await cancel_quietly(self.broker, self.job.id)
        finally:
            if self.held is not None:
                await self.held.aclose()

    async def relay_tokens(
        self, send: Send, start: Message | None = None, began: Callable[[], None] | None = None
    ) -> None:
        """The wait of the stream's head (``start``, not sent yet) for the engine to take the job,
        for :class:`~sluice.api.sse.EventStream`: on a broker with ``follow``, the head and the
        first token's events are handed to ``send`` in the broker's call, ``began`` called first;
        elsewhere :func:`~sluice.api.relay.engine_accepted` reads the events (the iterator reads
        them again from the start: their numbering). Returns with the head unsent where the job
        ended with its answer and no token, or the wait ran out; raises the job's failure before
        its first token, in the request's words. Without ``start`` (a replay) it does nothing."""
        if start is None or self.accept_within is None:
            return
        try:
            follow = getattr(self.broker, "follow", None)
            followable = follow is not None and self._payloads is None and not self._closed
            if followable and await self._relay(follow, send, start, began, self.accept_within):
                return
            # No calls back for this job: the wait reads its events, as engine_accepted does.
            await engine_accepted(self.broker, self.job, self.accept_within)
        except APIError as refused:
            self.refused = True
            raise _as_sent(refused) from None

    async def _relay(
        self,
        follow: Any,
        send: Send,
        start: Message,
        began: Callable[[], None] | None,
        within_s: float,
    ) -> bool:
        """:meth:`relay_tokens` through ``follow``; False where the broker will not call back for
        this job (nothing was done)."""
        loop = asyncio.get_running_loop()
        #: settled by the event that ends the wait, or by the wait running out
        wake: asyncio.Future[None] = loop.create_future()
        #: that event (None: the wait ran out)
        ended_by: EventType | None = None
        #: the rest of a send that waits; a send's own error, for this task to raise
        waiting: Awaitable[None] | None = None
        failed: BaseException | None = None

        def follower(event_id: int, type: EventType, data: Any) -> bool:
            nonlocal ended_by, waiting, failed
            if wake.done():  # the wait ran out, or the stream's task was cancelled, meanwhile
                return False
            if type is EventType.DONE or type is EventType.ERROR:
                ended_by = type  # the iterator reads the answer; a failure is the route's error
            elif type is EventType.TOKEN:
                ended_by = type
                self.fed = event_id
                try:  # a follower must not raise: a failure here is the stream's task's
                    out, self.pending = self.pending + self._feed(type, data), []
                    body = b"".join(self._framed(out))
                    if began is not None:
                        began()
                    messages = [start, {"type": "http.response.body", "body": body, "more_body": True}]
                    waiting = _write_now(send, messages)
                except BaseException as exc:
                    failed = exc
            else:
                # Its start, a retry before any token, ...: fed in order, sent with the first token.
                self.fed = event_id
                self.pending += self._feed(type, data)
                return True
            wake.set_result(None)
            return False

        stop = follow(self.job.id, self.fed, follower)
        if stop is None:
            return False
        timer = None if wake.done() else loop.call_later(within_s, relay._ran_out, wake)
        try:
            await wake
        except BaseException:
            if isinstance(waiting, types.CoroutineType):
                waiting.close()  # the client left: the rest of the head's send is not awaited
            raise
        finally:
            stop()
            if timer is not None:
                timer.cancel()
        if failed is not None:
            raise failed
        if waiting is not None:
            await waiting
        if ended_by is EventType.ERROR:
            # Ended before its first token, nothing sent: answered with its status, not a stream.
            self.refused = True
            raise await failure_of(self.broker, self.job)
        return True


def _write_now(send: Send, messages: list[Message]) -> Awaitable[None] | None:
    """Each message handed to ``send`` at once, by hand (uvicorn's returns without waiting unless
    the connection's buffer is full); where one waits, the rest of it and the messages after it as
    an awaitable, for the stream's task (None: all written). A send's own error is raised."""
    for i, message in enumerate(messages):
        writing = send(message)
        if not isinstance(writing, types.CoroutineType):
            return _then(writing, send, messages[i + 1 :])
        try:
            pending = writing.send(None)
        except StopIteration:
            continue
        return _then(resumed(writing, pending), send, messages[i + 1 :])
    return None


async def _then(waiting: Awaitable[None], send: Send, rest: list[Message]) -> None:
    await waiting
    for message in rest:
        await send(message)


def stream_response(
    broker: Broker,
    job: Job,
    headers: dict[str, str],
    held: contextlib.AsyncExitStack | None,
    alive: KeyCheck | None,
    limit_s: float,
    *,
    background: bool = False,
) -> EventStream:
    """The stream of a response just created, with the answer's ``headers``: its head waits for
    the engine to take the job (:class:`ResponseStream`'s ``accept_within``, up to
    :data:`sluice.api.relay.ACCEPT_WAIT_S`); a client that leaves cancels it unless it is a
    ``background`` one."""
    events = ResponseStream(broker, job, -1, not background, held, alive, limit_s, relay.ACCEPT_WAIT_S)
    return EventStream(events, headers, ping_s=PING_S)


def _headers(job: Job) -> dict[str, str]:
    return {"x-sluice-job-id": job.id}


#: What a response's events are, when sent as a stream.
_EVENTS = (
    "The response's typed events (response.created, response.output_text.delta, ..., "
    "response.completed), each with its sequence_number."
)


@router.post(
    "/v1/responses",
    response_model=None,
    responses={**errors(*KEYED, *ADMIT, *ANSWER), **events("With stream: true: " + _EVENTS)},
)
async def create_response(request: Request, body: ResponseRequest, who: Who) -> Response:
    gw = gateway(request)
    sent = body.model_dump(exclude_none=True, mode="json")
    history = await _history(gw, who, body.previous_response_id)
    try:
        plan = chat_plan(sent, history)
    except RequestRejected as rejected:
        raise _rejected(rejected) from None
    try:
        job = await gw.build_job(request, who, Endpoint.CHAT, plan.body)
    except APIError as refused:
        raise _as_sent(refused) from None
    job.extra[RECORD_KEY] = plan.record
    background = bool(body.background)
    # A background response may be read as a stream later: its tokens are kept as they come.
    job.stream_tokens = bool(body.stream) or background
    async with contextlib.AsyncExitStack() as stack:
        if body.stream or not background:  # a client holds a connection until it ends
            await stack.enter_async_context(gw.connection(who))
        admission = await gw.admit(job, who, client_retry(request))
        job = admission.job
        headers = {**_headers(job), **rate_headers(admission)}
        if body.stream:
            # As for chat completions: a rejection before the first token is its status code,
            # raised by the stream before its head (ResponseStream.relay_tokens).
            alive = key_check(request, who)
            held = stack.pop_all()
            stream = stream_response(
                gw.broker, job, headers, held, alive, gw.settings.max_stream_s, background=background
            )
            return EventStreamResponse(stream)
        if background:
            return JSONResponse(response_object(job), headers=headers)
        finished = await wait_for_client(request, gw.broker, job)
    if finished is None:
        raise APIError(404, "The response no longer exists.", "response_not_found")
    if not finished.terminal:
        raise APIError(504, "The response did not finish in time.", "deadline_exceeded", should_retry=False)
    if finished.state is not JobState.SUCCEEDED:
        error = _as_sent(failure(finished))
        error.job_id = job.id
        raise error
    return JSONResponse(response_object(finished), headers=headers)


@router.get(
    "/v1/responses/{response_id}",
    response_model=None,
    responses={**errors(*KEYED, 400, 404, 405, 429), **events("With stream=true: " + _EVENTS)},
)
async def get_response(
    request: Request,
    response_id: str,
    who: Who,
    stream: Annotated[bool, Query(description="Replay the response's events as SSE.")] = False,
    starting_after: Annotated[
        int, Query(ge=-1, description="With stream: send only events after this sequence number.")
    ] = -1,
    include: Annotated[list[str] | None, Query(description="Accepted and ignored.")] = None,
) -> Response:
    gw = gateway(request)
    job = await _own(gw, who, response_id)
    if not stream:
        return JSONResponse(response_object(job), headers=_headers(job))
    after = max(starting_after, _last_event_id(request))
    held = await gw.hold(who)
    events = ResponseStream(
        gw.broker, job, after, False, held, key_check(request, who), gw.settings.max_stream_s
    )
    return EventStreamResponse(EventStream(events, _headers(job), ping_s=PING_S))


def _last_event_id(request: Request) -> int:
    """The Last-Event-ID an EventSource sends when it reconnects (each event's id is its
    sequence number); -1 when there is none."""
    raw = request.headers.get("last-event-id")
    if raw is None:
        return -1
    if not (raw.isascii() and raw.lstrip("-").isdigit()):
        raise APIError(
            400,
            f"Last-Event-ID must be a sequence number, not '{raw}'.",
            "invalid_value",
            param="Last-Event-ID",
        )
    return int(raw)


@router.post("/v1/responses/{response_id}/cancel", responses=errors(*KEYED, 400, 404))
async def cancel_response(request: Request, response_id: str, who: Who) -> JSONResponse:
    gw = gateway(request)
    job = await _own(gw, who, response_id)
    if not job.extra[RECORD_KEY].get("background"):
        raise APIError(
            400,
            "Only responses created with background: true can be cancelled; a client cancels its "
            "own response by closing the connection.",
            "invalid_value",
            param="response_id",
        )
    if not job.terminal:
        job = await gw.broker.cancel(job.id) or job
    return JSONResponse(response_object(job), headers=_headers(job))


@router.delete("/v1/responses/{response_id}", responses=errors(*KEYED, 404, 405))
async def delete_response(request: Request, response_id: str, who: Who) -> JSONResponse:
    gw = gateway(request)
    job = await _own(gw, who, response_id)
    if not job.terminal:
        await gw.broker.cancel(job.id)
    return JSONResponse(
        {"id": response_id, "object": "response.deleted", "deleted": True}, headers=_headers(job)
    )
