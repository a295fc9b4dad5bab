"""Admin endpoints, behind an admin key: queue statistics, draining backends, dead letters.

Without an admin key every path here answers 404, so the surface stays invisible to others.
"""

from __future__ import annotations

from dataclasses import asdict
from typing import Annotated, Any

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from sluice.api.auth import Caller, admin
from sluice.api.errors import APIError
from sluice.api.intake import Gateway
from sluice.broker.base import job_view

router = APIRouter(prefix="/admin", tags=["admin"])
Admin = Annotated[Caller, Depends(admin)]


def gateway(request: Request) -> Gateway:
    gw: Gateway = request.app.state.gateway
    return gw


@router.get("/queues")
async def queues(request: Request, _: Admin) -> JSONResponse:
    gw = gateway(request)
    stats = {model: asdict(s) for model, s in (await gw.broker.stats()).items()}
    dispatcher = request.app.state.dispatcher
    body: dict[str, Any] = {"models": stats, "draining": sorted(await gw.broker.draining())}
    if dispatcher is not None:
        body["backends"] = dispatcher.backends()
    return JSONResponse(body)


async def _drain(request: Request, name: str, draining: bool) -> JSONResponse:
    gw = gateway(request)
    dispatcher = request.app.state.dispatcher
    if dispatcher is not None and name not in {b["name"] for b in dispatcher.backends()}:
        raise APIError(404, f"No backend named '{name}'.", "backend_not_found")
    await gw.broker.set_draining(name, draining)
    if dispatcher is not None:
        dispatcher.apply_draining(await gw.broker.draining())
    return JSONResponse({"backend": name, "draining": draining})


@router.post("/backends/{name:path}/drain")
async def drain(request: Request, name: str, _: Admin) -> JSONResponse:
    return await _drain(request, name, True)


@router.post("/backends/{name:path}/undrain")
async def undrain(request: Request, name: str, _: Admin) -> JSONResponse:
    return await _drain(request, name, False)


@router.get("/dead-letters")
async def dead_letters(request: Request, _: Admin) -> JSONResponse:
    gw = gateway(request)
    out = []
    for job_id, failed_at in sorted((await gw.broker.dead_letters()).items(), key=lambda kv: kv[1]):
        job = await gw.broker.get(job_id)
        out.append({"id": job_id, "failed_at": failed_at, "job": job_view(job) if job else None})
    return JSONResponse({"object": "list", "data": out})


@router.delete("/dead-letters")
async def purge_all(request: Request, _: Admin) -> JSONResponse:
    return JSONResponse({"purged": await gateway(request).broker.purge_dead_letters()})


@router.delete("/dead-letters/{job_id}")
async def purge_one(request: Request, job_id: str, _: Admin) -> JSONResponse:
    purged = await gateway(request).broker.purge_dead_letters([job_id])
    if not purged:
        raise APIError(404, f"No dead letter with id '{job_id}'.", "job_not_found")
    return JSONResponse({"purged": purged})
