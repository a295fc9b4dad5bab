"""``sluice serve``: the gateway, the broker (embedded by default) and a dispatcher in one process.

With no backend configured, the local engine (llama.cpp's llama-server with a small model) is built
once and started, and the dispatcher feeds it.

On SIGTERM it drains as a gateway does (:mod:`sluice.roles.http`), and its dispatcher with it. On
the embedded broker no other worker could take its queue: the dispatcher goes on claiming until the
queue is empty or the grace period ends, and what is still queued or running then is reported in the
log (it ends with the process). On Redis the dispatcher drains as ``sluice worker`` does: no more
claims, its jobs finish within the grace period, the rest are handed back to the queue.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import functools
import logging
import socket
import sys
from collections.abc import AsyncIterator

import uvicorn

from sluice import aio, drain, runtime
from sluice.broker.memory import MemoryBroker
from sluice.config import ConfigError, Settings
from sluice.config_tables import BackendConfig
from sluice.dispatcher import Dispatcher
from sluice.logs import setup_logging
from sluice.roles import flags
from sluice.roles.http import accept_of, bind, check_exposure, serve_http
from sluice.startup import EngineStartup

log = logging.getLogger("sluice.serve")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run the whole system in one process: the gateway (OpenAI-compatible API and async jobs), "
        "the broker (embedded by default) and a dispatcher feeding the backends. With no backend "
        "configured, a local llama-server with a small model is built (once) and started. "
        "Settings come from defaults, then --config, then SLUICE_* environment variables, then flags."
    )
    flags.add_config(parser)
    flags.add_backends(parser)
    flags.add_insecure_open(parser)
    flags.add_flags(parser, flags.COMMON, flags.HTTP, flags.DISPATCH, flags.ADMISSION, flags.LOCAL_ENGINE)


@contextlib.asynccontextmanager
async def local_engine(settings: Settings, startup: EngineStartup) -> AsyncIterator[Settings]:
    """Provision and supervise the local llama-server; the settings with it as their backend."""
    from sluice.local_engine.server import LocalEngine

    engine = LocalEngine(
        port=settings.engine_port,
        slots=settings.engine_slots,
        ctx_per_slot=settings.engine_ctx_per_slot,
        startup=startup,
    )
    async with engine:
        log.info("local engine ready", extra={"fields": {"url": engine.url, "slots": engine.slots}})
        yield with_local_engine(settings, engine.url, engine.model, engine.slots)


def with_local_engine(settings: Settings, url: str, model: str, slots: int) -> Settings:
    """The settings with the local engine as their one backend."""
    backend = BackendConfig(url=url, name="local", models=[model], max_concurrency=slots)
    return settings.model_copy(update={"backends": [backend]})


#: how often the queue of the embedded broker is read while the drain waits for it to empty
SETTLE_POLL_S = 0.1


def dispatcher_of(app: object) -> Dispatcher | None:
    """The dispatcher the app runs (that of the local engine once it is up), if any."""
    control = getattr(getattr(app, "state", None), "backends", None)
    if isinstance(control, Dispatcher):
        return control
    local = getattr(control, "dispatcher", None)
    return local if isinstance(local, Dispatcher) else None


async def settle_jobs(app: object, shutdown: drain.Drain) -> None:
    """The drain of the process's dispatcher (see the module docstring)."""
    dispatcher = dispatcher_of(app)
    if dispatcher is None:
        return
    if not isinstance(dispatcher.broker, MemoryBroker):
        await drain.drain_dispatcher(dispatcher, shutdown)
        return
    broker = dispatcher.broker
    queued = running = 0
    while True:
        stats = await broker.stats()
        queued = sum(s.queued_jobs for s in stats.values())
        running = sum(s.running_jobs for s in stats.values())
        if queued + running == 0 or shutdown.remaining() <= 0 or shutdown.hurry.is_set():
            break
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(min(SETTLE_POLL_S, shutdown.remaining())):
                await shutdown.hurry.wait()
    if queued + running:
        log.warning(
            "shutting down with jobs left: the embedded broker ends with the process, and they with it",
            extra={"fields": {"queued": queued, "running": running, "grace_s": shutdown.grace_s}},
        )


async def serve(
    settings: Settings,
    sock: socket.socket,
    *,
    grace_s: float = drain.DEFAULT_GRACE_S,
    accept_s: float = 0.0,
) -> int:
    """Serve until SIGINT/SIGTERM and the drain after it; with no backend configured, answer while
    the local engine is provisioned (``/readyz`` and requests say how far along it is). 1 if the
    engine failed."""
    drained = functools.partial(serve_http, grace_s=grace_s, accept_s=accept_s, settle=settle_jobs)
    if settings.has_engines:
        await drained(runtime.build_app(settings, dispatch=True), sock, settings, "serve")
        return 0
    startup = EngineStartup()
    failure: list[str] = []
    server: list[uvicorn.Server] = []

    def failed(reason: str) -> None:
        failure.append(reason)
        log.error("local engine failed", extra={"fields": {"error": reason}})
        for s in server:
            s.should_exit = True

    pending = runtime.PendingEngine(startup, lambda: local_engine(settings, startup), failed)
    app = runtime.build_app(settings, dispatch=True, pending=pending)
    await drained(app, sock, settings, "serve", on_server=server.append)
    if failure:
        print(f"sluice: the local engine failed: {failure[0]}", file=sys.stderr)
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        settings = flags.settings_from_args(args)
        setup_logging(settings.log_level, settings.log_format)
        check_exposure(settings)
        grace_s, accept_s = drain.grace_of(settings), accept_of(settings)
        sock = bind(settings.host, settings.port)
    except ConfigError as exc:
        print(f"sluice: {exc}", file=sys.stderr)
        return 2
    with sock, contextlib.suppress(KeyboardInterrupt):
        return aio.run(serve(settings, sock, grace_s=grace_s, accept_s=accept_s))
    return 0
