"""The ASGI app: the routes over parts built elsewhere (:mod:`sluice.runtime`), kept on ``app.state``."""

from __future__ import annotations

import contextlib
from collections.abc import Callable
from contextlib import AbstractAsyncContextManager

from fastapi import FastAPI
from starlette.types import Receive, Scope, Send

from sluice import __version__
from sluice.api import (
    admin,
    batches,
    dashboard,
    docs,
    errors,
    files,
    health,
    jobs,
    lean,
    openai,
    responses,
    ws,
)
from sluice.api.admin import BackendControl
from sluice.api.auth import KeyRing
from sluice.api.gateway import Gateway
from sluice.api.limits import Guard
from sluice.scaling_signal import ScalingSignal


class SluiceApp(FastAPI):
    """FastAPI, with the hot routes (:mod:`sluice.api.lean`) answered before the framework: they
    reach it only for what the framework must answer (an invalid body)."""

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if lean.is_lean(scope):
            scope["app"] = self
            await lean.serve(self, scope, receive, send, super().__call__)
            return
        await super().__call__(scope, receive, send)


def create_app(
    gateway: Gateway,
    keyring: KeyRing,
    *,
    backends: BackendControl | None = None,
    lifespan: Callable[[], AbstractAsyncContextManager[None]] | None = None,
    scaling: ScalingSignal | None = None,
) -> FastAPI:
    """The gateway's app.

    Args:
        gateway: what the routes share (settings, broker, metrics).
        keyring: who may call.
        backends: the backends a dispatcher in this process feeds, for the admin routes; None
            when the process runs no dispatcher.
        lifespan: starts the parts (broker, dispatcher) before the first request and stops them
            after the last.
        scaling: the scaling signal this gateway computes, which the dashboard shows; None: none.
    """

    def app_lifespan(app: FastAPI) -> AbstractAsyncContextManager[None]:
        return lifespan() if lifespan is not None else contextlib.nullcontext()

    app = SluiceApp(
        title="Sluice",
        version=__version__,
        description="A queue-scheduling gateway for LLM inference, with an OpenAI-compatible API.",
        lifespan=app_lifespan,
        # Served by sluice.api.docs, which decides who may read them (docs_public).
        openapi_url=None,
        docs_url=None,
        redoc_url=None,
    )
    app.state.gateway = gateway
    app.state.keyring = keyring
    app.state.backends = backends
    app.state.scaling = scaling
    dashboard.install(app)
    errors.install(app)
    app.include_router(openai.router)
    app.include_router(responses.router)
    app.include_router(files.router)
    app.include_router(batches.router)
    app.include_router(jobs.router)
    app.include_router(ws.router)
    app.include_router(health.router)
    app.include_router(admin.router)
    app.include_router(docs.router)
    # One layer: the request id (on every answer, the body limit's 413 too), the body limit, the
    # last resort for a bug.
    app.add_middleware(Guard, max_bytes=gateway.settings.max_body_bytes, exempt=[files.UPLOAD_PATH])
    return app
