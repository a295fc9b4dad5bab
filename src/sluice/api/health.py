"""Liveness, readiness and metrics.

``/healthz`` and ``/readyz`` answer anyone (load balancers ask them). ``/metrics`` is the operator's:
with keys it needs an admin key (401 without a key, 404 for other keys, as ``/admin``), unless
``metrics_public``; open mode serves it to all.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sluice.api.auth import KeyRing, admin
from sluice.api.gateway import gateway

router = APIRouter(tags=["health"])


@router.get("/healthz")
async def healthz() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@router.get("/readyz")
async def readyz(request: Request) -> JSONResponse:
    gw = gateway(request)
    try:
        served = await gw.broker.served_models()
    except Exception as exc:
        return JSONResponse(
            {"status": "unavailable", "reason": f"broker: {type(exc).__name__}"}, status_code=503
        )
    if not served:
        starting = gw.starting()
        if starting is not None and gw.startup is not None:
            return JSONResponse(
                {"status": "starting", "reason": starting.message, "engine": gw.startup.view()},
                status_code=503,
                headers=starting.headers(),
            )
        return JSONResponse(
            {"status": "unavailable", "reason": "no backend serves any model"}, status_code=503
        )
    return JSONResponse({"status": "ready", "models": served})


@router.get("/metrics")
async def metrics(request: Request) -> Response:
    gw = gateway(request)
    keyring: KeyRing = request.app.state.keyring
    if not (keyring.open or gw.settings.metrics_public):
        await admin(request)
    stats = await gw.broker.stats()
    gw.metrics.update_queues(stats)
    return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)
