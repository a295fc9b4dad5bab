"""Asynchronous jobs: submit, poll (or long-poll), stream events, cancel; and the article's aliases.

Every job belongs to the tenant whose key created it; anyone else gets 404, as for an unknown id.
"""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse

from sluice.api.auth import Caller, Who
from sluice.api.errors import APIError
from sluice.api.gateway import Gateway, client_retry, gateway, rate_headers
from sluice.api.openapi import ADMIT, KEYED, errors, events
from sluice.api.relay import KeyRevoked, bounded, key_check, revocable, while_connected
from sluice.api.schemas import JobRequest, SubmitRequest
from sluice.api.sse import EventStream, EventStreamResponse, sse_event
from sluice.core.job import Endpoint, Job, JobState
from sluice.protocol import plain_json
from sluice.views import job_view

router = APIRouter(tags=["jobs"])

PING_S = 15


async def own_job(gw: Gateway, who: Caller, job_id: str) -> Job:
    return gw.job_for(who, await gw.broker.get(job_id), job_id)


async def view(gw: Gateway, job: Job) -> dict[str, Any]:
    out = job_view(job)
    if job.state is JobState.QUEUED:
        out["position"] = await gw.broker.position(job.id)
    return out


@router.post(
    "/v1/jobs",
    status_code=202,
    responses={
        200: {
            "description": "A repeat of an earlier request with the same Idempotency-Key: its job.",
            "content": {"application/json": {"schema": {}}},
        },
        **errors(*KEYED, *ADMIT),
    },
)
async def submit_job(request: Request, body: JobRequest, who: Who) -> JSONResponse:
    gw = gateway(request)
    data = body.model_dump(exclude_none=True, mode="json")
    if (body.messages is None) == (body.prompt is None):
        raise APIError(
            400, "A job needs either 'messages' (chat) or 'prompt' (completions), not both.", "invalid_value"
        )
    endpoint = Endpoint.CHAT if body.messages is not None else Endpoint.COMPLETIONS
    data.pop("stream", None)  # a job's output is read through its events, never inline
    job = await gw.build_job(request, who, endpoint, data)
    admission = await gw.admit(job, who, client_retry(request))
    job = admission.job
    payload = {
        "id": job.id,
        "object": "job",
        "status": job.state.value,
        "position": admission.position,
        "estimated_start_s": round(admission.estimated_start_s, 3),
    }
    headers = {"Location": f"/v1/jobs/{job.id}", "x-sluice-job-id": job.id, **rate_headers(admission)}
    return JSONResponse(payload, status_code=200 if admission.duplicate else 202, headers=headers)


#: The most jobs one page of ``GET /v1/jobs`` holds, and how many it holds unless told.
MAX_PAGE = 100
DEFAULT_PAGE = 20


@router.get("/v1/jobs", responses=errors(*KEYED, 400))
async def list_jobs(
    request: Request,
    who: Who,
    limit: Annotated[int, Query(ge=1, le=MAX_PAGE, description="Jobs per page.")] = DEFAULT_PAGE,
    after: Annotated[
        str | None, Query(max_length=200, description="The last job id of the previous page.")
    ] = None,
) -> JSONResponse:
    """The caller's own jobs (its tenant's) whose records are still kept, newest first, in
    OpenAI's list shape; the next page starts ``after`` the last id of this one."""
    gw = gateway(request)
    page = await gw.broker.list_jobs(who.tenant, limit, after)
    data = [await view(gw, job) for job in page.jobs]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": page.has_more,
        }
    )


@router.get("/v1/jobs/{job_id}", responses=errors(*KEYED, 400, 404, 429))
async def get_job(
    request: Request,
    job_id: str,
    who: Who,
    wait: Annotated[float, Query(ge=0, description="Long-poll: seconds to wait for the job to finish.")] = 0,
) -> JSONResponse:
    gw = gateway(request)
    job = await own_job(gw, who, job_id)
    if wait > 0 and not job.terminal:
        async with gw.connection(who):
            ended = await while_connected(
                request, gw.broker.wait(job_id, min(wait, gw.settings.max_poll_wait_s))
            )
            job = ended or job
    return JSONResponse(await view(gw, job))


#: The largest event id a client may name. Ids count a job's events, so none comes near it, and
#: Redis refuses stream ids from 2^64 on: a larger one would break the stream instead of being a 400.
MAX_EVENT_ID = 2**63 - 1


def event_id(raw: str) -> int | None:
    """The event id a client names (Last-Event-ID, ``after``): a whole number, a negative one read
    as 0; None when it is not one, or is larger than MAX_EVENT_ID."""
    try:
        value = int(raw)  # refuses more than 4300 digits, like any other non-number
    except ValueError:
        return None
    return max(value, 0) if value <= MAX_EVENT_ID else None


def _after(request: Request) -> int:
    """The last event the client has seen: the Last-Event-ID header, else the ``after`` query
    parameter; an error names whichever of the two it came from."""
    header = request.headers.get("last-event-id")
    name, raw = ("Last-Event-ID", header) if header else ("after", request.query_params.get("after") or "0")
    after = event_id(raw)
    if after is None:
        shown = raw if len(raw) <= 40 else raw[:40] + "..."
        raise APIError(
            400,
            f"{name} must be an event id (an integer from 0 to {MAX_EVENT_ID}), not '{shown}'.",
            "invalid_value",
            param=name,
        )
    return after


@router.get(
    "/v1/jobs/{job_id}/events",
    response_class=EventStreamResponse,
    responses={
        **errors(*KEYED, 400, 404, 429),
        **events("The job's events (queued, started, token, retry, done, error), each with its id."),
    },
)
async def job_events(request: Request, job_id: str, who: Who) -> EventStreamResponse:
    gw = gateway(request)
    await own_job(gw, who, job_id)
    after = _after(request)
    held = await gw.hold(who)
    events = revocable(gw.broker.events(job_id, after=after), key_check(request, who))

    async def stream() -> AsyncIterator[bytes]:
        try:
            async for event in bounded(events, gw.settings.max_stream_s):
                yield sse_event(plain_json(event.data), event=event.type.value, id=str(event.id))
        except KeyRevoked:
            return  # a reconnect (EventSource does it by itself) gets the 401
        finally:
            await held.aclose()

    return EventStreamResponse(EventStream(stream(), ping_s=PING_S))


@router.delete("/v1/jobs/{job_id}", responses=errors(*KEYED, 404, 405, 409))
async def cancel_job(request: Request, job_id: str, who: Who) -> JSONResponse:
    gw = gateway(request)
    before = await own_job(gw, who, job_id)
    if before.terminal:
        raise APIError(
            409, f"The job already ended ({before.state.value}); nothing to cancel.", "job_finished"
        )
    job = await gw.broker.cancel(job_id)
    if job is None:
        raise APIError(404, f"No job with id '{job_id}'.", "job_not_found")
    if job.state is not JobState.CANCELLED:
        raise APIError(409, f"The job already ended ({job.state.value}); nothing to cancel.", "job_finished")
    return JSONResponse(await view(gw, job))


# --- the article's endpoints, so its clients can switch without changes -------------------------


@router.post("/submit", tags=["article"], responses=errors(*KEYED, *ADMIT))
async def submit(request: Request, body: SubmitRequest, who: Who) -> JSONResponse:
    gw = gateway(request)
    data = body.model_dump(exclude_none=True, mode="json")
    prompt = data.pop("prompt")
    data["messages"] = [{"role": "user", "content": prompt}]
    job = await gw.build_job(request, who, Endpoint.CHAT, data)
    admission = await gw.admit(job, who, client_retry(request))
    return JSONResponse({"job_id": admission.job.id, "status": "queued"}, headers=rate_headers(admission))


@router.get("/result/{job_id}", tags=["article"], responses=errors(*KEYED, 404))
async def result(request: Request, job_id: str, who: Who) -> JSONResponse:
    job = await own_job(gateway(request), who, job_id)
    if job.state is JobState.SUCCEEDED and job.result:
        choices = job.result.get("choices") or [{}]
        first = choices[0]
        text = first.get("message", {}).get("content") if "message" in first else first.get("text")
        return JSONResponse({"status": "done", "result": {"answer": text}})
    if job.terminal:
        return JSONResponse(
            {"status": "failed", "result": None, "error": job.error.to_dict() if job.error else None}
        )
    return JSONResponse({"status": "processing", "result": None})
