"""``sluice serve``: the gateway, the broker (embedded by default) and a dispatcher in one process.

With no backend configured, the local engine (llama.cpp's llama-server with a small model) is built
once and started, and the dispatcher feeds it.
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import socket
import sys
from collections.abc import AsyncIterator

import uvicorn

from sluice import aio, runtime
from sluice.config import BackendConfig, ConfigError, Settings
from sluice.logs import setup_logging
from sluice.roles import flags
from sluice.roles.http import bind, check_exposure, serve_http
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


# codel's burst_rise in front of the local engine, unless configured. llama-server on a CPU slows each
# sequence down ~2.7x as its batch fills, so the drain rate learnt at light load is optimistic and a
# burst from light load seems to rise half as steeply as it does (docs/configuration.md, Queue policy).
LOCAL_ENGINE_BURST_RISE = 1.0


def local_engine_defaults(settings: Settings) -> Settings:
    """Queue defaults that suit the local engine, where the settings do not choose."""
    if "queue_burst_rise" in settings.model_fields_set:
        return settings
    return settings.model_copy(update={"queue_burst_rise": LOCAL_ENGINE_BURST_RISE})


def with_local_engine(settings: Settings, url: str, model: str, slots: int) -> Settings:
    """The settings with the local engine as their one backend, and queue defaults that suit it."""
    backend = BackendConfig(url=url, name="local", models=[model], max_concurrency=slots)
    return local_engine_defaults(settings).model_copy(update={"backends": [backend]})


async def serve(settings: Settings, sock: socket.socket) -> int:
    """Serve until SIGINT/SIGTERM; with no backend configured, answer while the local engine is
    provisioned (``/readyz`` and requests say how far along it is). 1 if the engine failed."""
    if settings.backends:
        await serve_http(runtime.build_app(settings, dispatch=True), sock, settings, "serve")
        return 0
    settings = local_engine_defaults(settings)
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
    await serve_http(app, sock, settings, "serve", on_server=server.append)
    if failure:
        print(f"sluice: the local engine failed: {failure[0]}", file=sys.stderr)
        return 1
    return 0


def run(args: argparse.Namespace) -> int:
    try:
        settings = flags.settings_from_args(args)
        setup_logging(settings.log_level, settings.log_format)
        check_exposure(settings)
        sock = bind(settings.host, settings.port)
    except ConfigError as exc:
        print(f"sluice: {exc}", file=sys.stderr)
        return 2
    with sock, contextlib.suppress(KeyboardInterrupt):
        return aio.run(serve(settings, sock))
    return 0
