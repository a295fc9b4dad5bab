"""The OpenAI-compatible synchronous API: the request is queued and scheduled like any job.

A streamed answer's headers wait until the engine has taken the job (its first token, or its end)
for up to ACCEPT_WAIT_S: a request the engine refuses before any token is then an error with its
proper status (the engine's 400 and the parameter it names; see
:func:`sluice.api.relay.engine_accepted`, and the stream's ``accept_within``), which an SDK raises
as such, rather than an HTTP 200 whose stream holds an error. A job still queued after that wait streams as
before, and an error after the first token is an error event in the stream.
"""

from __future__ import annotations

import contextlib
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response

from sluice.api.auth import Caller, Who
from sluice.api.errors import APIError
from sluice.api.gateway import Gateway, client_retry, gateway, rate_headers
from sluice.api.openapi import ADMIT, ANSWER, KEYED, errors, events
from sluice.api.relay import ACCEPT_WAIT_S, KeyCheck, answer, key_check, openai_stream, wait_for_client
from sluice.api.request_id import HEADER as REQUEST_ID
from sluice.api.schemas import ChatRequest, CompletionRequest, SchedulingOptions
from sluice.api.sse import EventStream, EventStreamResponse
from sluice.broker.base import Broker
from sluice.core.job import Endpoint, Job
from sluice.core.model_info import ModelInfo

router = APIRouter(tags=["openai"])

PING_S = 15


async def complete(
    request: Request,
    who: Caller,
    endpoint: Endpoint,
    body: dict[str, Any],
    opts: SchedulingOptions,
    gw: Gateway | None = None,
) -> EventStream | Response:
    """The answer to a chat or completions request whose body ``opts`` validated (``body`` is its
    dump): a JSON answer, or with ``stream`` an :class:`EventStream`. Raises the APIError of a
    refusal. Both the FastAPI routes below and the lean ones (:mod:`sluice.api.lean`) answer so.
    ``gw``: the app's gateway where the caller holds it already (the lean routes)."""
    if gw is None:
        gw = gateway(request)
    job = await gw.build_job(request, who, endpoint, body, opts)
    stream = bool(body.get("stream"))
    job.stream_tokens = stream
    if not who.keyed or who.key_sha256 is None:
        # No per-key connection cap to count against (open mode): no slot to hold, nor a stack.
        return await _answer(request, who, gw, job, body, None)
    # A synchronous request holds a connection until it ends: count it before queueing anything.
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(gw.connection(who))
        return await _answer(request, who, gw, job, body, stack)


async def _answer(
    request: Request,
    who: Caller,
    gw: Gateway,
    job: Job,
    body: dict[str, Any],
    stack: contextlib.AsyncExitStack | None,
) -> EventStream | Response:
    """Admit the job and answer it; ``stack`` holds the caller's connection slot (None: none),
    handed to the stream's generator when the answer is a stream."""
    stream = job.stream_tokens
    admission = await gw.admit(job, who, client_retry(request))
    job = admission.job
    # x-request-id is the job's id (sluice.api.request_id), set here rather than by a wrapper.
    headers = {"x-sluice-job-id": job.id, REQUEST_ID: job.id, **rate_headers(admission)}
    if stream:
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        alive = key_check(request, who)
        return stream_answer(gw.broker, job, headers, include_usage, stack, alive, gw.settings.max_stream_s)
    finished = await wait_for_client(request, gw.broker, job)
    try:
        return answer(finished, headers)
    except APIError as exc:
        exc.job_id = job.id
        raise


def stream_answer(
    broker: Broker,
    job: Job,
    headers: dict[str, str],
    include_usage: bool,
    stack: contextlib.AsyncExitStack | None,
    alive: KeyCheck | None,
    limit_s: float | None,
) -> EventStream:
    """The stream of an admitted job that streams, with the answer's ``headers``; ``stack`` holds
    the caller's connection slot (None: none), which the stream releases when it ends.

    The stream's head waits for the engine to take the job (up to ACCEPT_WAIT_S), and the
    stream raises the job's failure as an APIError, before anything is sent, where the job ends
    without an answer first (``openai_stream``'s ``accept_within``); on the memory broker the head
    goes out with the first token's frame in the broker's call, no turn of the loop between."""
    # The stream releases the connection when it ends.
    held = stack.pop_all() if stack is not None else None
    return EventStream(
        openai_stream(broker, job, include_usage, held, alive=alive, accept_within=ACCEPT_WAIT_S),
        headers,
        ping_s=PING_S,
        limit_s=limit_s,
    )


async def _complete(request: Request, who: Caller, endpoint: Endpoint, body: SchedulingOptions) -> Response:
    answered = await complete(request, who, endpoint, body.model_dump(exclude_none=True, mode="json"), body)
    return EventStreamResponse(answered) if isinstance(answered, EventStream) else answered


@router.post(
    "/v1/chat/completions",
    response_model=None,
    responses={
        **errors(*KEYED, *ADMIT, *ANSWER),
        **events("With stream: true: chat.completion.chunk objects, then [DONE]."),
    },
)
async def chat_completions(request: Request, body: ChatRequest, who: Who) -> Response:
    return await _complete(request, who, Endpoint.CHAT, body)


@router.post(
    "/v1/completions",
    response_model=None,
    responses={
        **errors(*KEYED, *ADMIT, *ANSWER),
        **events("With stream: true: text_completion objects, then [DONE]."),
    },
)
async def completions(request: Request, body: CompletionRequest, who: Who) -> Response:
    return await _complete(request, who, Endpoint.COMPLETIONS, body)


@router.get("/v1/models", responses=errors(*KEYED))
async def models(request: Request, who: Who) -> JSONResponse:
    gw = gateway(request)
    served = await gw.broker.served_models()
    info = await gw.broker.model_info()
    data = [model_object(m, info.get(m)) for m in sorted(served)]
    return JSONResponse({"object": "list", "data": data})


@router.get("/v1/models/{model_id:path}", responses=errors(*KEYED, 404))
async def model(request: Request, model_id: str, who: Who) -> JSONResponse:
    gw = gateway(request)
    if model_id not in await gw.broker.served_models():
        raise APIError(
            404,
            f"The model '{model_id}' does not exist or is not served right now.",
            "model_not_found",
            param="model",
        )
    return JSONResponse(model_object(model_id, (await gw.broker.model_info()).get(model_id)))


def model_object(name: str, info: ModelInfo | None) -> dict[str, Any]:
    """OpenAI's model object for a served model, with the context window as vLLM reports it
    (``max_model_len``) where the engine gave one; ``created`` is the engine's, or when a worker
    first served the model."""
    info = info or ModelInfo()
    out: dict[str, Any] = {"id": name, "object": "model", "created": info.created, "owned_by": "sluice"}
    if info.context_window is not None:
        out["max_model_len"] = info.context_window
    return out
