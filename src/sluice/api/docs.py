"""The API's description, ``/openapi.json``, and its pages, ``/docs`` (Swagger UI) and ``/redoc``.

Who may read them: anyone in open mode (no keys, loopback only) or with ``docs_public``; otherwise
any valid key (401 without one). Whoever reads them, the ``/admin`` routes are listed to admin keys
only, so that the description never maps the surface an admin key hides from everyone else.
"""

from __future__ import annotations

from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.openapi.docs import get_redoc_html, get_swagger_ui_html
from fastapi.responses import HTMLResponse, JSONResponse

from sluice.api.auth import KeyRing, bearer
from sluice.api.gateway import gateway
from sluice.api.openapi import document, schema_refs

router = APIRouter(include_in_schema=False)

OPENAPI_URL = "/openapi.json"
#: The tag of the routes listed to admin keys only.
ADMIN_TAG = "admin"


async def _reader_is_admin(request: Request) -> bool:
    """Whether the reader is an admin; raises the 401 of a missing or wrong key where one is needed."""
    keyring: KeyRing = request.app.state.keyring
    if keyring.open:
        return False  # admin routes answer 404 in open mode: nothing to list
    if gateway(request).settings.docs_public and bearer(request) is None:
        return False
    return (await keyring.authenticate(request)).admin


def without_admin(schema: dict[str, Any]) -> dict[str, Any]:
    """``schema`` less the operations tagged admin, and less the component schemas only they use."""
    paths = {
        path: operations
        for path, operations in schema.get("paths", {}).items()
        if not any(ADMIN_TAG in op.get("tags", ()) for op in operations.values() if isinstance(op, dict))
    }
    defined = schema.get("components", {}).get("schemas", {})
    used: set[str] = set()
    todo = list(schema_refs(paths))
    while todo:
        name = todo.pop()
        if name not in used and name in defined:
            used.add(name)
            todo.extend(schema_refs(defined[name]))
    out = {**schema, "paths": paths}
    if "components" in schema:
        out["components"] = {
            **schema["components"],
            "schemas": {name: spec for name, spec in defined.items() if name in used},
        }
    return out


def description(app: FastAPI, *, admin: bool) -> dict[str, Any]:
    """The OpenAPI description of ``app``: every route for an admin, all but the admin routes for
    anyone else (the second built once)."""
    full = document(app)  # built once
    if admin:
        return full
    public: dict[str, Any] | None = getattr(app.state, "openapi_public", None)
    if public is None:
        public = app.state.openapi_public = without_admin(full)
    return public


@router.get(OPENAPI_URL)
async def openapi(request: Request) -> JSONResponse:
    admin = await _reader_is_admin(request)
    return JSONResponse(description(request.app, admin=admin))


@router.get("/docs")
async def swagger(request: Request) -> HTMLResponse:
    await _reader_is_admin(request)
    return get_swagger_ui_html(openapi_url=OPENAPI_URL, title=f"{request.app.title} - Swagger UI")


@router.get("/redoc")
async def redoc(request: Request) -> HTMLResponse:
    await _reader_is_admin(request)
    return get_redoc_html(openapi_url=OPENAPI_URL, title=f"{request.app.title} - ReDoc")
