"""OpenAI's Responses API on the queue: each response is a chat-completions job.

``POST /v1/responses`` translates the request (:mod:`sluice.core.response_request`) and queues it like
``/v1/chat/completions``: the same admission, priorities, deadlines and rate limits, and a client
that disconnects cancels it, unless it asked for ``background``. A stream's headers wait, as chat's
do, until the engine has taken the job, so that a rejection before the first token is an error
with its status rather than a ``response.failed`` event. ``GET /v1/responses/{id}`` reads
the job back as a Response (``?stream=true&starting_after=N`` replays its events from the job's
event log), ``POST /v1/responses/{id}/cancel`` cancels it, ``DELETE`` cancels it if it is still
running. Only the key that created a response sees it. What is and is not translated:
docs/responses.md.
"""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Annotated, Any, Literal

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel, ConfigDict, Field, StrictBool, StrictInt, StrictStr, StringConstraints

from sluice.api import relay
from sluice.api.auth import Caller, Who
from sluice.api.errors import APIError
from sluice.api.gateway import Gateway, client_retry, gateway, rate_headers
from sluice.api.openapi import ADMIT, ANSWER, KEYED, errors, events
from sluice.api.relay import (
    EventStream,
    EventStreamResponse,
    KeyCheck,
    KeyRevoked,
    bounded,
    cancel_quietly,
    engine_accepted,
    failure,
    key_check,
    revocable,
    sse_event,
    wait_for_client,
)
from sluice.api.schemas import PositiveTimeout
from sluice.broker.base import EventType
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


async def _stream(
    gw: Gateway,
    job: Job,
    after: int,
    cancel_on_exit: bool,
    held: contextlib.AsyncExitStack,
    alive: KeyCheck | None = None,
) -> AsyncIterator[bytes]:
    """The response's events with ``sequence_number`` > ``after``, made from the job's event log
    from its start (so that a replay numbers them as the first stream did). ``cancel_on_exit``:
    the client waits on this response, and leaving before its end cancels it. ``held`` (the
    caller's connection slot) is released when the stream ends, however it ends. ``alive``: the
    stream ends when the caller's key is revoked (:func:`sluice.api.relay.revocable`)."""
    events = ResponseEvents(job)
    try:
        for event in events.opening():
            if event["sequence_number"] > after:
                yield _sse(event)
        async for entry in bounded(revocable(gw.broker.events(job.id), alive), gw.settings.max_stream_s):
            if entry.type is EventType.STARTED:
                out = events.started()
            elif entry.type is EventType.TOKEN:
                out = events.chunk(entry.data.get("choices") or [], entry.data)
            elif entry.type is EventType.RETRY:
                out = events.retried()
            elif entry.type is EventType.DONE:
                finished = (entry.data.get("timings") or {}).get("finished_at")
                out = events.done(entry.data.get("usage"), entry.data.get("result"), finished)
            elif entry.type is EventType.ERROR:
                out = events.failed(JobState(entry.data.get("status", "failed")), entry.data.get("error"))
            else:
                out = []
            for event in out:
                if event["sequence_number"] > after:
                    yield _sse(event)
            if events.ended:
                if entry.type is EventType.RETRY and cancel_on_exit:
                    # The client saw the failure; nobody waits for the retry's answer.
                    await cancel_quietly(gw.broker, job.id)
                return
    except KeyRevoked:
        return  # the client's reconnect gets the 401; a response it waited on is cancelled
    finally:
        if not events.ended and cancel_on_exit:
            await cancel_quietly(gw.broker, job.id)
        await held.aclose()


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
            # As for chat completions: a rejection before the first token is its status code.
            try:
                await engine_accepted(gw.broker, job, relay.ACCEPT_WAIT_S)
            except APIError as refused:
                raise _as_sent(refused) from None
            held = stack.pop_all()
            return EventStreamResponse(
                EventStream(
                    _stream(gw, job, -1, not background, held, key_check(request, who)),
                    headers,
                    ping_s=PING_S,
                )
            )
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
    return EventStreamResponse(
        EventStream(
            _stream(gw, job, after, False, held, key_check(request, who)), _headers(job), ping_s=PING_S
        )
    )


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
