"""The composition root: every part a role runs is built here, from the settings, and nowhere else.

- ``sluice serve``: the gateway's app with a worker in the same process (:func:`build_app` with
  ``dispatch=True``), on the embedded broker or on Redis;
- ``sluice gateway``: the app alone, on a shared Redis broker (:func:`build_app`);
- ``sluice worker``: a dispatcher and the webhook delivery beside it, on a shared Redis broker
  (:func:`running_worker`).

The web framework is imported only inside :func:`build_app`, so a worker process, which imports
this module, never loads it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import AsyncIterator, Callable
from contextlib import AbstractAsyncContextManager
from dataclasses import dataclass
from typing import TYPE_CHECKING

from sluice.backends.base import Backend
from sluice.backends.openai import OpenAIBackend
from sluice.broker import BrokerSettings, create_broker
from sluice.broker.base import Broker
from sluice.config import Settings
from sluice.dispatcher import Dispatcher
from sluice.fleet import Fleet, PoolSpec, Resolver, resolve_system
from sluice.metrics import Metrics
from sluice.reports import worker_reporter
from sluice.scaling_signal import ScalingSignal
from sluice.startup import EngineStartup, StartupPhase
from sluice.webhook_delivery import WebhookDelivery

if TYPE_CHECKING:
    from fastapi import FastAPI

    from sluice.api.auth import KeyRing
    from sluice.api.gateway import Gateway
    from sluice.batches import BatchRunner

log = logging.getLogger("sluice.serve")


def broker_settings(settings: Settings) -> BrokerSettings:
    """What the broker needs of the settings: classes, queue bounds, lease, result TTL, policy."""
    per_model, default = settings.limits()
    return BrokerSettings(
        classes=settings.queue_classes(),
        limits=per_model,
        default_limits=default,
        lease_s=settings.lease_s,
        result_ttl_s=settings.result_ttl_s,
        drain_prior_per_slot=settings.drain_prior_per_slot,
        policy=settings.policy(),
    )


def build_broker(settings: Settings) -> Broker:
    return create_broker(
        settings.broker,
        broker_settings(settings),
        min_replicas=settings.redis_min_replicas,
        wait_timeout_ms=settings.redis_wait_timeout_ms,
    )


def build_backends(settings: Settings) -> list[Backend]:
    """One OpenAI-compatible backend per configured ``[[backends]]`` engine."""
    return [
        OpenAIBackend(
            b.url,
            name=b.name,
            max_concurrency=b.max_concurrency or settings.max_concurrency,
            max_inflight_tokens=b.max_inflight_tokens,
            models=b.models,
            api_key=b.api_key,
        )
        for b in settings.backends
    ]


def pool_specs(settings: Settings) -> list[PoolSpec]:
    """The configured ``[[pools]]``, as the fleet builds their engines."""
    return [
        PoolSpec(
            p.name,
            addresses=tuple(p.engines),
            models=tuple(p.models),
            max_concurrency=p.max_concurrency,
            adaptive=p.adaptive,
            tpot_objective_s=p.tpot_objective_s,
            max_inflight_tokens=p.max_inflight_tokens,
            priority=p.priority,
            api_key=p.api_key,
        )
        for p in settings.pools
    ]


def pool_backend(spec: PoolSpec, url: str, name: str) -> Backend:
    """The adapter of one engine of a pool (one that joins by DNS too)."""
    return OpenAIBackend(
        url,
        name=name,
        max_concurrency=spec.connections,
        max_inflight_tokens=spec.max_inflight_tokens,
        models=list(spec.models),
        api_key=spec.api_key,
        priority_map=spec.priority,
    )


def build_fleet(settings: Settings, *, resolver: Resolver = resolve_system) -> Fleet:
    """The engines: each ``[[backends]]`` entry a pool of one (its limit fixed unless it sets
    ``adaptive``), the ``[[pools]]``, and the ``[[aliases]]``."""
    engines = [
        (
            backend,
            PoolSpec(
                backend.name,
                # Learning, the limit's ceiling is the one set for this engine (None: none).
                max_concurrency=b.max_concurrency if b.adaptive else backend.max_concurrency,
                adaptive=b.adaptive,
                max_inflight_tokens=b.max_inflight_tokens,
            ),
        )
        for b, backend in zip(settings.backends, build_backends(settings), strict=True)
    ]
    aliases = {a.name: [(t.model, t.weight) for t in a.targets] for a in settings.aliases}
    return Fleet(
        pool_specs(settings), engines=engines, factory=pool_backend, aliases=aliases, resolver=resolver
    )


def webhook_secrets(settings: Settings) -> dict[str, str]:
    """The configured keys' webhook secrets, by the key's SHA-256 (a job is signed with the secret
    of the key that submitted it)."""
    return {k.key_sha256: k.webhook_secret for k in settings.keys if k.webhook_secret}


class Worker:
    """What a worker runs: a dispatcher feeding its backends, and webhook delivery beside it.

    Attributes:
        broker: the queue it claims from (started and closed by whoever built it).
        dispatcher: claims, runs and settles jobs on the engines of its fleet (whose adapters
            :meth:`stop` closes).
        webhooks: delivers the callbacks of ended jobs; None when the broker keeps none.
    """

    def __init__(
        self,
        broker: Broker,
        dispatcher: Dispatcher,
        webhooks: WebhookDelivery | None,
    ) -> None:
        self.broker = broker
        self.dispatcher = dispatcher
        self.webhooks = webhooks
        #: tells every gateway's dashboard about this worker's engines and counters
        self.reporter = worker_reporter(broker, dispatcher)

    async def start(self) -> None:
        await self.dispatcher.start()
        if self.webhooks is not None:
            await self.webhooks.start()
        await self.reporter.start()

    async def stop(self) -> None:
        await self.reporter.stop()
        if self.webhooks is not None:
            await self.webhooks.stop()
        await self.dispatcher.stop()
        for engine in self.dispatcher.fleet.engines:
            await engine.backend.aclose()

    @property
    def backends(self) -> list[Backend]:
        """The adapters of the engines in the fleet now."""
        return [e.backend for e in self.dispatcher.fleet.engines]


def build_worker(settings: Settings, broker: Broker, metrics: Metrics | None = None) -> Worker:
    """A worker on ``broker`` for the configured engines (backends and pools, at least one)."""
    # A worker of its own (``sluice worker``) counts too: its dashboard report carries the counts.
    dispatcher = Dispatcher(
        broker,
        fleet=build_fleet(settings),
        routing=settings.routing,
        prefix_affinity=settings.prefix_affinity,
        router=settings.router(),
        dns_refresh_s=settings.dns_refresh_s,
        unreached_grace_s=settings.unreached_grace_s,
        metrics=metrics if metrics is not None else Metrics(),
    )
    webhooks = None
    if broker.supports_callbacks:
        webhooks = WebhookDelivery(
            broker,
            dispatcher.worker_id,
            secrets=webhook_secrets(settings),
            allow_private=settings.webhooks_allow_private,
        )
    return Worker(broker, dispatcher, webhooks)


@contextlib.asynccontextmanager
async def running_worker(settings: Settings) -> AsyncIterator[Worker]:
    """The ``sluice worker`` role: its broker connected and its worker started, until the block ends."""
    broker = build_broker(settings)
    await broker.start()
    try:
        worker = build_worker(settings, broker)
        try:
            await worker.start()
            yield worker
        finally:
            await worker.stop()
    finally:
        await broker.close()


@dataclass
class PendingEngine:
    """An engine still being provisioned when the app starts (``sluice serve`` with no backend).

    Attributes:
        startup: its progress, which ``/readyz`` and the requests that arrive first report.
        provision: provisions and supervises the engine; yields the settings with it as their
            backend, and stops it when the block ends.
        on_failed: called when provisioning fails (``sluice serve`` then exits with the error).
    """

    startup: EngineStartup
    provision: Callable[[], AbstractAsyncContextManager[Settings]]
    on_failed: Callable[[str], None]


class _LocalBackends:
    """The admin routes' view of a dispatcher that may not exist yet (its engine still starting)."""

    def __init__(self) -> None:
        self.dispatcher: Dispatcher | None = None

    def backends(self) -> list[dict[str, object]]:
        return self.dispatcher.backends() if self.dispatcher is not None else []

    def apply_draining(self, names: set[str]) -> None:
        if self.dispatcher is not None:
            self.dispatcher.apply_draining(names)


async def _serve_when_ready(
    pending: PendingEngine, broker: Broker, metrics: Metrics, local: _LocalBackends
) -> None:
    try:
        async with pending.provision() as effective:
            worker = build_worker(effective, broker, metrics)
            try:
                await worker.start()
                local.dispatcher = worker.dispatcher
                pending.startup.enter(StartupPhase.READY)
                await asyncio.Event().wait()  # until the app stops
            finally:
                local.dispatcher = None
                await worker.stop()
    except asyncio.CancelledError:
        raise
    except Exception as exc:
        pending.startup.enter(StartupPhase.FAILED, str(exc))
        pending.on_failed(str(exc))


def build_app(settings: Settings, *, dispatch: bool = False, pending: PendingEngine | None = None) -> FastAPI:
    """The gateway's ASGI app on its broker; with ``dispatch``, a worker for the configured backends
    runs in the same process (``sluice serve``), and with ``pending`` a worker for an engine that
    is provisioned while the app already answers. The broker and the worker start with the app's
    lifespan and stop with it."""
    from sluice.api.app import create_app
    from sluice.api.auth import KeyRing
    from sluice.api.gateway import Gateway

    metrics = Metrics()
    broker = build_broker(settings)
    # Every gateway computes the scaling signal from the shared broker state, so all agree.
    scaling = ScalingSignal(broker, metrics)
    worker = build_worker(settings, broker, metrics) if dispatch and settings.has_engines else None
    local = _LocalBackends()

    @contextlib.asynccontextmanager
    async def lifespan() -> AsyncIterator[None]:
        await broker.start()
        await scaling.start()
        started: list[asyncio.Task[None]] = []
        await batches.store.start()
        await batches.start()
        try:
            if pending is not None:
                started.append(asyncio.create_task(_serve_when_ready(pending, broker, metrics, local)))
            if worker is None:
                yield
                return
            try:
                await worker.start()
                yield
            finally:
                await worker.stop()
        finally:
            for task in started:
                task.cancel()
            await asyncio.gather(*started, return_exceptions=True)
            await batches.stop()
            await batches.store.close()
            await scaling.stop()
            await broker.close()

    control = worker.dispatcher if worker is not None else local if pending is not None else None
    gw = Gateway(settings, broker, metrics, startup=pending.startup if pending is not None else None)
    keyring = KeyRing(settings, broker)
    batches = build_batch_runner(settings, gw, keyring)
    app = create_app(gw, keyring, backends=control, lifespan=lifespan, scaling=scaling)
    app.state.batches = batches
    return app


def build_batch_runner(settings: Settings, gateway: Gateway, keyring: KeyRing) -> BatchRunner:
    """The Batch API's runner and its store: the broker's Redis, or ``files_dir`` on the local disk."""
    from sluice.batches import BatchRunner
    from sluice.filestore import create_store

    return BatchRunner(create_store(settings.broker, settings.batch_files_dir()), gateway, keyring)
