"""The OpenAI-compatible synchronous API: the request is queued and scheduled like any job."""

from __future__ import annotations

import contextlib
from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from sluice.api.auth import Caller, Who
from sluice.api.errors import APIError
from sluice.api.gateway import client_retry, gateway, rate_headers
from sluice.api.openapi import ADMIT, ANSWER, KEYED, errors, events
from sluice.api.relay import answer, key_check, openai_stream, wait_for_client
from sluice.api.schemas import ChatRequest, CompletionRequest
from sluice.core.job import Endpoint

router = APIRouter(tags=["openai"])

PING_S = 15


async def _complete(request: Request, who: Caller, endpoint: Endpoint, body: dict[str, Any]) -> Response:
    gw = gateway(request)
    job = await gw.build_job(request, who, endpoint, body)
    job.stream_tokens = bool(body.get("stream"))
    # A synchronous request holds a connection until it ends: count it before queueing anything.
    async with contextlib.AsyncExitStack() as stack:
        await stack.enter_async_context(gw.connection(who))
        admission = await gw.admit(job, who, client_retry(request))
        job = admission.job
        if body.get("stream"):
            options = body.get("stream_options")
            include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
            held = stack.pop_all()  # the stream's generator releases the connection when it ends
            return EventSourceResponse(
                openai_stream(
                    gw.broker,
                    job,
                    include_usage,
                    gw.settings.max_stream_s,
                    held,
                    alive=key_check(request, who),
                ),
                ping=PING_S,
                sep="\n",
                headers={"x-sluice-job-id": job.id, **rate_headers(admission)},
            )
        finished = await wait_for_client(request, gw.broker, job)
        try:
            response = answer(finished)
        except APIError as exc:
            exc.job_id = job.id
            raise
        response.headers.update({"x-sluice-job-id": job.id, **rate_headers(admission)})
        return response


@router.post(
    "/v1/chat/completions",
    response_model=None,
    responses={
        **errors(*KEYED, *ADMIT, *ANSWER),
        **events("With stream: true: chat.completion.chunk objects, then [DONE]."),
    },
)
async def chat_completions(request: Request, body: ChatRequest, who: Who) -> Response:
    return await _complete(request, who, Endpoint.CHAT, body.model_dump(exclude_none=True, mode="json"))


@router.post(
    "/v1/completions",
    response_model=None,
    responses={
        **errors(*KEYED, *ADMIT, *ANSWER),
        **events("With stream: true: text_completion objects, then [DONE]."),
    },
)
async def completions(request: Request, body: CompletionRequest, who: Who) -> Response:
    return await _complete(
        request, who, Endpoint.COMPLETIONS, body.model_dump(exclude_none=True, mode="json")
    )


@router.get("/v1/models", responses=errors(*KEYED))
async def models(request: Request, who: Who) -> JSONResponse:
    served = await gateway(request).broker.served_models()
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "sluice"} for m in sorted(served)]
    return JSONResponse({"object": "list", "data": data})
