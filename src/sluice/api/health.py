"""Liveness, readiness and metrics.

``/healthz`` and ``/readyz`` answer anyone (load balancers ask them). From the first SIGTERM on,
``/readyz`` answers 503 ``draining`` (the process drains, :mod:`sluice.roles.http`) while
``/healthz`` stays 200: the process is alive and finishing its work. ``/metrics`` is the operator's:
with keys it needs an admin key (401 without a key, 404 for other keys, as ``/admin``), unless
``metrics_public``; open mode serves it to all.
"""

from __future__ import annotations

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response
from prometheus_client import CONTENT_TYPE_LATEST, generate_latest

from sluice.api.auth import KeyRing, admin
from sluice.api.gateway import gateway
from sluice.api.openapi import KEYED, errors, plain_text

router = APIRouter(tags=["health"])


@router.get("/healthz", responses=errors())
async def healthz() -> JSONResponse:
    return JSONResponse({"status": "ok"})


@router.get(
    "/readyz",
    responses={
        503: {
            "description": "Not ready: the process is shutting down (draining), the broker is "
            "unreachable, or no backend serves a model yet.",
            "content": {"application/json": {"schema": {}}},
        },
        **errors(),
    },
)
async def readyz(request: Request) -> JSONResponse:
    shutdown = getattr(request.app.state, "drain", None)
    if shutdown is not None and shutdown.draining:
        return JSONResponse({"status": "draining", "reason": "shutting down"}, status_code=503)
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


@router.get(
    "/metrics",
    response_class=PlainTextResponse,
    responses={**errors(*KEYED, 404), **plain_text("Prometheus' text exposition format.")},
)
async def metrics(request: Request) -> Response:
    gw = gateway(request)
    keyring: KeyRing = request.app.state.keyring
    if not (keyring.open or gw.settings.metrics_public):
        await admin(request)
    stats = await gw.broker.stats()
    gw.metrics.update_queues(stats)
    return Response(generate_latest(gw.metrics.registry), media_type=CONTENT_TYPE_LATEST)
