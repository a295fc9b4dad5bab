"""The ASGI app. State (settings, broker, dispatcher) is built in the lifespan and kept on ``app.state``."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator, Callable, Sequence
from typing import Any

from fastapi import FastAPI

from sluice import __version__
from sluice.api import admin, errors, health, jobs, openai, ws
from sluice.api.auth import KeyRing
from sluice.api.gateway import Gateway
from sluice.api.limits import BodySizeLimit
from sluice.backends.base import Backend
from sluice.broker import BrokerSettings, create_broker
from sluice.config import Settings
from sluice.dispatcher import Dispatcher
from sluice.metrics import Metrics


def broker_settings(settings: Settings) -> BrokerSettings:
    per_model, default = settings.limits()
    return BrokerSettings(
        classes=settings.class_specs(),
        limits=per_model,
        default_limits=default,
        lease_s=settings.lease_s,
        result_ttl_s=settings.result_ttl_s,
        drain_prior_per_slot=settings.drain_prior_per_slot,
        policy=settings.policy(),
    )


def webhook_options(settings: Settings) -> dict[str, Any]:
    """What a dispatcher needs to sign and send webhooks: each tenant's secret, and the SSRF policy."""
    secrets = {k.tenant: k.webhook_secret for k in settings.keys if k.webhook_secret}
    return {"webhook_secrets": secrets, "webhooks_allow_private": settings.webhooks_allow_private}


def create_app(
    settings: Settings,
    *,
    backends: Callable[[], Sequence[Backend]] | None = None,
) -> FastAPI:
    """The gateway; with ``backends``, also a dispatcher feeding them in the same process."""

    @contextlib.asynccontextmanager
    async def lifespan(app: FastAPI) -> AsyncIterator[None]:
        metrics = Metrics()
        broker = create_broker(settings.broker, broker_settings(settings))
        await broker.start()
        dispatcher = None
        engines: Sequence[Backend] = backends() if backends else ()
        try:
            if engines:
                dispatcher = Dispatcher(broker, engines, metrics=metrics, **webhook_options(settings))
                await dispatcher.start()
            app.state.gateway = Gateway(settings, broker, metrics)
            app.state.keyring = KeyRing(settings, broker)
            app.state.dispatcher = dispatcher
            yield
        finally:
            if dispatcher is not None:
                await dispatcher.stop()
            for engine in engines:
                await engine.aclose()
            await broker.close()

    app = FastAPI(
        title="Sluice",
        version=__version__,
        description="A queue-scheduling gateway for LLM inference, with an OpenAI-compatible API.",
        lifespan=lifespan,
    )
    errors.install(app)
    app.include_router(openai.router)
    app.include_router(jobs.router)
    app.include_router(ws.router)
    app.include_router(health.router)
    app.include_router(admin.router)
    app.add_middleware(BodySizeLimit, max_bytes=settings.max_body_bytes)
    return app
