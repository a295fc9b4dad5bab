"""Admin endpoints, behind an admin key: queue statistics, draining backends (an engine or a pool),
dead letters, API keys.

Without an admin key every path here answers 404, so the surface stays invisible to others.
"""

from __future__ import annotations

import secrets
from dataclasses import asdict
from typing import Annotated, Any, Protocol

from fastapi import APIRouter, Depends, Request
from fastapi.responses import JSONResponse

from sluice.api.auth import Caller, admin, hash_key
from sluice.api.errors import APIError
from sluice.api.gateway import Gateway, gateway
from sluice.api.openapi import ADMIN, errors
from sluice.config_tables import KeyGrant
from sluice.views import job_view

router = APIRouter(prefix="/admin", tags=["admin"], responses=errors(*ADMIN))
Admin = Annotated[Caller, Depends(admin)]


class BackendControl(Protocol):
    """The backends a dispatcher in this process feeds (the dispatcher is one)."""

    def backends(self) -> list[dict[str, object]]:
        """Each backend's name, pool, models, limit, in-flight work and health."""
        ...

    def apply_draining(self, names: set[str]) -> None:
        """Stop giving new work to the backends named, or whose pool is named (and resume the
        others)."""
        ...


def local_backends(request: Request) -> BackendControl | None:
    """The app's local backends, or None when this process runs no dispatcher."""
    control: BackendControl | None = request.app.state.backends
    return control


@router.get("/queues")
async def queues(request: Request, _: Admin) -> JSONResponse:
    gw = gateway(request)
    stats = {model: asdict(s) for model, s in (await gw.broker.stats()).items()}
    local = local_backends(request)
    body: dict[str, Any] = {"models": stats, "draining": sorted(await gw.broker.draining())}
    if local is not None:
        body["backends"] = local.backends()
    return JSONResponse(body)


async def _drain(request: Request, name: str, draining: bool) -> JSONResponse:
    gw = gateway(request)
    local = local_backends(request)
    # An engine, or a whole pool (engines that join it later are drained too).
    if local is not None:
        known = {str(b[key]) for b in local.backends() for key in ("name", "pool") if b.get(key)}
        if name not in known:
            raise APIError(404, f"No backend or pool named '{name}'.", "backend_not_found")
    await gw.broker.set_draining(name, draining)
    if local is not None:
        local.apply_draining(await gw.broker.draining())
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


def _store_enabled(request: Request) -> Gateway:
    gw = gateway(request)
    if not gw.settings.key_store:
        raise APIError(
            400, "The key store is off; set key_store = true to keep keys in the broker.", "unsupported"
        )
    return gw


@router.post("/keys", status_code=201, responses=errors(400))
async def create_key(request: Request, body: KeyGrant, _: Admin) -> JSONResponse:
    gw = _store_enabled(request)
    names = [c.name for c in gw.settings.classes]
    if body.max_priority is not None and body.max_priority not in names:
        raise APIError(400, f"Unknown priority '{body.max_priority}'.", param="max_priority")
    key = "sk-sluice-" + secrets.token_urlsafe(32)
    digest = hash_key(key)
    await gw.broker.put_key(digest, body.model_dump())
    return JSONResponse({"key": key, "key_sha256": digest, "tenant": body.tenant}, status_code=201)


@router.get("/keys", responses=errors(400))
async def list_keys(request: Request, _: Admin) -> JSONResponse:
    gw = _store_enabled(request)
    data = [
        {"key_sha256": digest, **{k: v for k, v in record.items() if k != "webhook_secret"}}
        for digest, record in sorted((await gw.broker.list_keys()).items())
    ]
    return JSONResponse({"object": "list", "data": data})


@router.delete("/keys/{key_sha256}", responses=errors(400))
async def delete_key(request: Request, key_sha256: str, _: Admin) -> JSONResponse:
    gw = _store_enabled(request)
    if not await gw.broker.delete_key(key_sha256):
        raise APIError(404, "No stored key with that hash.", "key_not_found")
    return JSONResponse({"deleted": key_sha256})
