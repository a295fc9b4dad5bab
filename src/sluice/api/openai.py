"""The OpenAI-compatible synchronous API: the request is queued and scheduled like any job."""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from sse_starlette import EventSourceResponse

from sluice.api.errors import APIError
from sluice.api.intake import Gateway
from sluice.api.relay import answer, openai_stream, wait_for_client
from sluice.api.schemas import ChatRequest, CompletionRequest
from sluice.core.job import Endpoint

router = APIRouter(tags=["openai"])

PING_S = 15


def gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


async def _complete(request: Request, endpoint: Endpoint, body: dict[str, Any]) -> Response:
    gw = gateway(request)
    job = await gw.build_job(request, endpoint, body)
    admission = await gw.admit(job)
    job = admission.job
    if body.get("stream"):
        options = body.get("stream_options")
        include_usage = isinstance(options, dict) and bool(options.get("include_usage"))
        return EventSourceResponse(
            openai_stream(gw.broker, job, include_usage),
            ping=PING_S,
            sep="\n",
            headers={"x-sluice-job-id": job.id},
        )
    finished = await wait_for_client(request, gw.broker, job)
    try:
        response = answer(finished)
    except APIError as exc:
        exc.job_id = job.id
        raise
    response.headers["x-sluice-job-id"] = job.id
    return response


@router.post("/v1/chat/completions", response_model=None)
async def chat_completions(request: Request, body: ChatRequest) -> Response:
    return await _complete(request, Endpoint.CHAT, body.model_dump(exclude_none=True, mode="json"))


@router.post("/v1/completions", response_model=None)
async def completions(request: Request, body: CompletionRequest) -> Response:
    return await _complete(request, Endpoint.COMPLETIONS, body.model_dump(exclude_none=True, mode="json"))


@router.get("/v1/models")
async def models(request: Request) -> JSONResponse:
    served = await gateway(request).broker.served_models()
    data = [{"id": m, "object": "model", "created": 0, "owned_by": "sluice"} for m in sorted(served)]
    return JSONResponse({"object": "list", "data": data})
