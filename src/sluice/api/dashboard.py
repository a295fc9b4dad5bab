"""The live dashboard, for operators: who is waiting for which engine, what was refused and why.

- ``GET /dashboard``: the page (its script and style under ``/dashboard/assets/``, shipped in the
  package: no CDN, no build step); ``/dashboard?key=KEY`` checks the key once, sets a session
  cookie and redirects to ``/dashboard``, so that the key does not stay in the address bar;
- ``GET /dashboard/feed``: server-sent events, a ``history`` event (the charts' last minutes) and
  then a ``snapshot`` event each second (:mod:`sluice.dashboard` builds them);
- ``GET /dashboard/snapshot``: the latest snapshot as JSON, for scripts.

Who may look: an admin key, or the read-only ``dashboard_key_sha256``, as a bearer token or by the
session cookie (HttpOnly, SameSite=Strict, for ``/dashboard`` only, signed with HMAC-SHA256 and
expiring after SESSION_S; a revoked key's session and open feeds end); in open mode, everyone.
Anyone else gets a 401 page that says how to open it. docs/dashboard.md tells the rest.
"""

from __future__ import annotations

import asyncio
import contextlib
import hashlib
import hmac
import json
import math
import secrets
import time
from collections.abc import AsyncIterator, Mapping
from contextlib import AbstractAsyncContextManager
from pathlib import Path
from typing import Any

from fastapi import APIRouter, FastAPI, Request
from fastapi.responses import HTMLResponse, RedirectResponse, Response

from sluice.api.auth import KeyRing, bearer, hash_key
from sluice.api.errors import APIError
from sluice.api.gateway import Gateway, gateway
from sluice.api.sse import EventStream, EventStreamResponse, sse_event
from sluice.dashboard_feed import DashboardFeed, FleetCollector

router = APIRouter(prefix="/dashboard", include_in_schema=False)

#: the page and its assets, inside the package
STATIC = Path(__file__).parent / "static"
#: the assets served, and their types (nothing else in the folder is)
ASSETS = {
    "dashboard.js": "text/javascript; charset=utf-8",
    "dashboard.css": "text/css; charset=utf-8",
    "icon.svg": "image/svg+xml",
}
#: assets served without a key
PUBLIC_ASSETS = frozenset({"icon.svg"})
COOKIE = "sluice_dashboard"
#: how long a session cookie lasts (seconds)
SESSION_S = 8 * 3600
#: open feeds per gateway: each costs a task and a JSON encoding a second
MAX_FEEDS = 16
#: how often an open feed checks that its key is still valid (seconds)
RECHECK_S = 5.0
#: SSE comment lines that keep idle proxies from closing a feed (seconds)
PING_S = 15

# The page loads only its own script and style, from here; nothing may frame it, and no address
# (with a ?key= in it) is sent on as a referrer.
HEADERS = {
    "Cache-Control": "no-store",
    "Content-Security-Policy": "default-src 'none'; script-src 'self'; style-src 'self'; img-src 'self'; "
    "connect-src 'self'; base-uri 'none'; form-action 'none'; frame-ancestors 'none'",
    "Referrer-Policy": "no-referrer",
    "X-Content-Type-Options": "nosniff",
    "X-Frame-Options": "DENY",
}

DENIED = """<!doctype html>
<html lang="en"><head><meta charset="utf-8"><title>Sluice dashboard</title>
<link rel="icon" href="/dashboard/assets/icon.svg" type="image/svg+xml"></head>
<body><h1>Sluice dashboard</h1>
<p>Open <code>/dashboard?key=YOUR_KEY</code> once with an admin key or the dashboard key
(<code>dashboard_key_sha256</code>); the browser then keeps a session for it.</p>
</body></html>
"""


class DashboardAccess:
    """Who may see the dashboard, and the session cookies that remember it."""

    def __init__(self, gw: Gateway, keyring: KeyRing) -> None:
        self.settings = gw.settings
        self.keyring = keyring
        secret = gw.settings.dashboard_session_secret
        self._secret = secret.encode() if secret else secrets.token_bytes(32)

    async def allows(self, key_sha256: str) -> bool:
        """Whether the key with this SHA-256 opens the dashboard: the dashboard key, or an admin key."""
        if self.keyring.open:
            return True
        own = self.settings.dashboard_key_sha256
        if own is not None and hmac.compare_digest(own, key_sha256):
            return True
        key = await self.keyring.lookup(key_sha256)
        return key is not None and key.admin

    def _sign(self, body: str) -> str:
        return hmac.new(self._secret, body.encode(), hashlib.sha256).hexdigest()

    def session(self, key_sha256: str, now: float) -> str:
        """A cookie value: its expiry, the key's SHA-256 (so that revoking the key ends it) and
        their signature."""
        body = f"{int(now + SESSION_S)}.{key_sha256}"
        return f"{body}.{self._sign(body)}"

    async def session_allows(self, value: str, now: float) -> bool:
        expires, _, rest = value.partition(".")
        digest, _, signature = rest.partition(".")
        if not (expires.isascii() and expires.isdigit() and len(expires) <= 12) or int(expires) < now:
            return False
        if not hmac.compare_digest(signature, self._sign(f"{expires}.{digest}")):
            return False
        return await self.allows(digest)

    async def check(self, request: Request) -> bool:
        """Whether this request may see the dashboard: open mode, a bearer key that may, or a
        valid session cookie."""
        if self.keyring.open:
            return True
        token = bearer(request)
        if token is not None:
            return await self.allows(hash_key(token))
        cookie = request.cookies.get(COOKIE)
        return cookie is not None and await self.session_allows(cookie, time.time())


def _access(request: Request) -> DashboardAccess:
    access: DashboardAccess = request.app.state.dashboard_access
    return access


def dashboard_feed(request: Request) -> DashboardFeed:
    feed: DashboardFeed = request.app.state.dashboard
    return feed


def _denied() -> HTMLResponse:
    return HTMLResponse(DENIED, status_code=401, headers=HEADERS)


async def _allowed(request: Request) -> None:
    if not await _access(request).check(request):
        raise APIError(
            401,
            "The dashboard needs an admin key or the dashboard key: open /dashboard?key=YOUR_KEY once.",
            "invalid_api_key",
            type="invalid_request_error",
        )


@router.get("")
async def page(request: Request) -> Response:
    access = _access(request)
    key = request.query_params.get("key")
    if key is not None:
        if not key or not await access.allows(hash_key(key)):
            return _denied()
        response = RedirectResponse("/dashboard", status_code=303, headers=HEADERS)
        response.set_cookie(
            COOKIE,
            access.session(hash_key(key), time.time()),
            max_age=SESSION_S,
            path="/dashboard",
            httponly=True,
            samesite="strict",
            secure=request.url.scheme == "https",
        )
        return response
    if not await access.check(request):
        return _denied()
    return HTMLResponse((STATIC / "dashboard.html").read_text(encoding="utf-8"), headers=HEADERS)


@router.get("/assets/{name}")
async def asset(request: Request, name: str) -> Response:
    # The icon is anyone's (the 401 page shows it too); the script and the style are the page's.
    if name not in PUBLIC_ASSETS and not await _access(request).check(request):
        return _denied()
    media_type = ASSETS.get(name)
    if media_type is None:
        raise APIError(404, "Not Found", "not_found")
    return Response((STATIC / name).read_bytes(), media_type=media_type, headers=HEADERS)


def _finite(value: Any) -> Any:
    """``value`` with every NaN or infinity made None: JSON has neither, and the page's parser
    would refuse the whole snapshot for one."""
    if isinstance(value, float):
        return value if math.isfinite(value) else None
    if isinstance(value, dict):
        return {k: _finite(v) for k, v in value.items()}
    if isinstance(value, list | tuple):
        return [_finite(v) for v in value]
    return value


def _json(data: Mapping[str, Any]) -> str:
    try:
        return json.dumps(data, allow_nan=False, separators=(",", ":"))
    except ValueError:
        return json.dumps(_finite(data), allow_nan=False, separators=(",", ":"))


@router.get("/snapshot")
async def snapshot(request: Request) -> Response:
    await _allowed(request)
    feed = dashboard_feed(request)
    latest = feed.latest if feed.running and feed.latest is not None else await feed.tick()
    return Response(_json(latest), media_type="application/json", headers=HEADERS)


@router.get("/feed")
async def feed(request: Request) -> Response:
    await _allowed(request)
    access = _access(request)
    dash = dashboard_feed(request)
    if not dash.running:  # an app run without its lifespan (some test clients)
        await dash.start()
    state = request.app.state
    if state.dashboard_feeds >= MAX_FEEDS:
        raise APIError(
            429,
            f"Too many open dashboard feeds ({MAX_FEEDS}); close some first.",
            "too_many_connections",
            retry_after_s=5.0,
        )
    max_s = gateway(request).settings.max_stream_s

    async def stream() -> AsyncIterator[bytes]:
        loop = asyncio.get_running_loop()
        end = loop.time() + max_s
        recheck = loop.time() + RECHECK_S
        seq = 0
        state.dashboard_feeds += 1
        try:
            yield sse_event(_json({"points": dash.history.points()}), event="history")
            while (left := end - loop.time()) > 0:
                got = await dash.next_after(seq, timeout=min(left, RECHECK_S))
                if got is not None:
                    seq, latest = got
                    yield sse_event(_json(latest), event="snapshot", id=str(seq))
                if loop.time() >= recheck:
                    if not await access.check(request):
                        return  # the key was revoked: the reconnect gets the 401
                    recheck = loop.time() + RECHECK_S
        finally:
            state.dashboard_feeds -= 1

    return EventStreamResponse(EventStream(stream(), HEADERS, ping_s=PING_S))


def install(app: FastAPI) -> None:
    """Add the dashboard to the app: its routes, its feed (started and stopped with the app, inside
    the app's own lifespan, so after the broker starts and before it stops) and the fleet's gauges
    on ``/metrics``. Call it once ``app.state`` has the gateway and the keyring."""
    gw: Gateway = app.state.gateway
    feed = DashboardFeed(gw.broker, gw.metrics, scaling=app.state.scaling)
    app.state.dashboard = feed
    app.state.dashboard_access = DashboardAccess(gw, app.state.keyring)
    app.state.dashboard_feeds = 0
    gw.metrics.registry.register(FleetCollector(feed))
    app.include_router(router)
    inner = app.router.lifespan_context

    @contextlib.asynccontextmanager
    async def lifespan(target: FastAPI) -> AsyncIterator[Any]:
        context: AbstractAsyncContextManager[Any] = inner(target)
        async with context as state:
            await feed.start()
            try:
                yield state
            finally:
                await feed.stop()

    app.router.lifespan_context = lifespan
