"""OpenAI's Batch API: ``POST /v1/batches``, ``GET /v1/batches/{id}``, ``GET /v1/batches``,
``POST /v1/batches/{id}/cancel``. The routes only write and read records; the batch runner
(:mod:`sluice.batches`) validates the file, runs the lines and writes the output files. Only the
tenant that created a batch sees it."""

from __future__ import annotations

import time
from typing import Annotated, Any

from fastapi import APIRouter, Query, Request
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ConfigDict, Field, StrictStr, StringConstraints

from sluice.api.auth import Who
from sluice.api.batch_records import ENDPOINTS, BatchRunning, batch_object, new_batch, window_seconds
from sluice.api.errors import APIError
from sluice.api.files import batch_store, caller_file
from sluice.api.gateway import gateway
from sluice.api.openapi import KEYED, errors
from sluice.filestore.base import TERMINAL_BATCH_STATUSES, new_batch_id

router = APIRouter(tags=["batches"])

MetadataKey = Annotated[str, StringConstraints(max_length=64)]
MetadataValue = Annotated[str, StringConstraints(max_length=512)]


class BatchRequest(BaseModel):
    """``POST /v1/batches``."""

    model_config = ConfigDict(extra="allow")

    input_file_id: StrictStr = Field(description="A file uploaded with purpose 'batch'.")
    endpoint: StrictStr = Field(description="/v1/chat/completions or /v1/completions.")
    completion_window: StrictStr = Field(description='"24h" (the server may allow others).')
    metadata: dict[MetadataKey, MetadataValue] | None = Field(default=None, max_length=16)


def runner(request: Request) -> BatchRunning:
    found: BatchRunning = request.app.state.batches
    return found


@router.post("/v1/batches", responses=errors(*KEYED, 400, 404))
async def create(request: Request, body: BatchRequest, who: Who) -> JSONResponse:
    """Create a batch from an uploaded file; it starts in ``validating``."""
    settings = gateway(request).settings
    if body.endpoint not in ENDPOINTS:
        raise APIError(
            400,
            f"Unsupported endpoint '{body.endpoint}'; use one of {', '.join(ENDPOINTS)}.",
            "invalid_value",
            param="endpoint",
        )
    window = window_seconds(body.completion_window)
    if body.completion_window not in settings.batch_completion_windows or window is None:
        allowed = ", ".join(f"'{w}'" for w in settings.batch_completion_windows)
        raise APIError(
            400,
            f"Invalid completion_window '{body.completion_window}'; this server takes {allowed}.",
            "invalid_value",
            param="completion_window",
        )
    store = batch_store(request)
    meta = await caller_file(store, who, body.input_file_id)
    if meta.purpose != "batch":
        raise APIError(
            400,
            f"The file {meta.id} has purpose '{meta.purpose}'; a batch's input needs purpose 'batch'.",
            "invalid_value",
            param="input_file_id",
        )
    record = new_batch(
        new_batch_id(),
        who,
        input_file_id=meta.id,
        endpoint=body.endpoint,
        completion_window=body.completion_window,
        window_s=window,
        metadata=body.metadata,
        now=time.time(),
    )
    await store.put_batch(record)
    runner(request).poke()
    return JSONResponse(await batch_object(store, record))


async def _own(request: Request, batch_id: str, tenant: str) -> dict[str, Any]:
    record = await batch_store(request).get_batch(batch_id)
    if record is None or record["_sluice"]["tenant"] != tenant:
        raise APIError(404, f"No batch found with id '{batch_id}'.", "batch_not_found", param="batch_id")
    return record


@router.get("/v1/batches/{batch_id}", responses=errors(*KEYED, 404))
async def retrieve(request: Request, batch_id: str, who: Who) -> JSONResponse:
    record = await _own(request, batch_id, who.tenant)
    return JSONResponse(await batch_object(batch_store(request), record))


@router.get("/v1/batches", responses=errors(*KEYED, 400))
async def list_batches(
    request: Request,
    who: Who,
    limit: Annotated[int, Query(ge=1, le=100)] = 20,
    after: str | None = None,
) -> JSONResponse:
    """The caller's batches, newest first; the next page starts ``after`` this one's last id."""
    store = batch_store(request)
    page = await store.list_batches(who.tenant, limit=limit, after=after)
    data = [await batch_object(store, item) for item in page.items]
    return JSONResponse(
        {
            "object": "list",
            "data": data,
            "first_id": data[0]["id"] if data else None,
            "last_id": data[-1]["id"] if data else None,
            "has_more": page.has_more,
        }
    )


@router.post("/v1/batches/{batch_id}/cancel", responses=errors(*KEYED, 404, 409))
async def cancel(request: Request, batch_id: str, who: Who) -> JSONResponse:
    """Cancel a batch: it turns ``cancelling`` at once, stops dispatching, and ends ``cancelled``
    with what had finished in its output file."""
    record = await _own(request, batch_id, who.tenant)
    store = batch_store(request)
    if record["status"] in TERMINAL_BATCH_STATUSES:
        raise APIError(
            409,
            f"Cannot cancel a batch with status '{record['status']}'.",
            "batch_not_cancellable",
            param="batch_id",
        )
    await store.request_cancel(batch_id, time.time())
    runner(request).poke()
    return JSONResponse(await batch_object(store, record))
