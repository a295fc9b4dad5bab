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
from typing import Any

from sluice import aio, runtime
from sluice.config import BackendConfig, ConfigError, Settings
from sluice.logs import setup_logging
from sluice.roles import flags
from sluice.roles.http import bind, check_exposure, serve_http

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
    flags.add_flags(parser, flags.COMMON, flags.HTTP, flags.DISPATCH, flags.ADMISSION)


@contextlib.asynccontextmanager
async def local_engine(settings: Settings) -> AsyncIterator[Settings]:
    """With no backend configured, provision and supervise the local llama-server."""
    if settings.backends:
        yield settings
        return
    from sluice.local_engine.server import LocalEngine

    async with LocalEngine() as engine:
        log.info("local engine ready", extra={"fields": {"url": engine.url, "slots": engine.slots}})
        yield with_local_engine(settings, engine.url, engine.model, engine.slots)


# codel's burst_rise in front of the local engine, unless configured. llama-server on a CPU slows each
# sequence down ~2.7x as its batch fills, so the drain rate learnt at light load is optimistic and a
# burst from light load seems to rise half as steeply as it does (docs/configuration.md, Queue policy).
LOCAL_ENGINE_BURST_RISE = 1.0


def with_local_engine(settings: Settings, url: str, model: str, slots: int) -> Settings:
    """The settings with the local engine as their one backend, and queue defaults that suit it."""
    backend = BackendConfig(url=url, name="local", models=[model], max_concurrency=slots)
    update: dict[str, Any] = {"backends": [backend]}
    if "queue_burst_rise" not in settings.model_fields_set:
        update["queue_burst_rise"] = LOCAL_ENGINE_BURST_RISE
    return settings.model_copy(update=update)


async def serve(settings: Settings, sock: socket.socket) -> None:
    async with local_engine(settings) as effective:
        await serve_http(runtime.build_app(effective, dispatch=True), sock, effective, "serve")


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
        aio.run(serve(settings, sock))
    return 0
