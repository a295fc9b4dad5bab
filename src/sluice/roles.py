"""``sluice gateway`` and ``sluice worker``: the two roles of a scaled-out deployment on Redis.

Any number of gateways and workers share one Redis: gateways admit and answer, workers claim and
run. A job submitted through one gateway can be read, streamed and cancelled through any other.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import logging
import signal
import sys

import uvicorn

from sluice import aio
from sluice.api.app import broker_settings, create_app, webhook_options
from sluice.broker import create_broker
from sluice.config import ConfigError, Settings
from sluice.dispatcher import Dispatcher
from sluice.logs import setup_logging
from sluice.serve import build_backends, check_exposure, settings_from_args
from sluice.serve import configure_parser as configure_serve

log = logging.getLogger("sluice.roles")


def configure_gateway(parser: argparse.ArgumentParser) -> None:
    configure_serve(parser)
    parser.description = (
        "Run a gateway only (no dispatcher): it admits requests into the Redis broker given by --broker "
        "and answers from it. Run any number of them, behind a load balancer."
    )


def configure_worker(parser: argparse.ArgumentParser) -> None:
    configure_serve(parser)
    parser.description = (
        "Run a worker only (no HTTP API): it claims jobs from the Redis broker given by --broker and runs "
        "them on its --backend engines, at most --max-concurrency at once on each. Run any number of them."
    )


def _settings(args: argparse.Namespace, role: str) -> Settings | None:
    try:
        settings = settings_from_args(args)
    except ConfigError as exc:
        print(f"sluice {role}: {exc}", file=sys.stderr)
        return None
    if not settings.broker.startswith(("redis://", "rediss://", "unix://")):
        print(
            f"sluice {role}: needs --broker redis://HOST:PORT (the roles share a Redis broker)",
            file=sys.stderr,
        )
        return None
    return settings


def run_gateway(args: argparse.Namespace) -> int:
    settings = _settings(args, "gateway")
    if settings is None:
        return 2
    setup_logging(settings.log_level, settings.log_format)
    try:
        check_exposure(settings)
    except ConfigError as exc:
        print(f"sluice gateway: {exc}", file=sys.stderr)
        return 2
    config = uvicorn.Config(
        create_app(settings), host=settings.host, port=settings.port, log_level="warning", access_log=False
    )
    with contextlib.suppress(KeyboardInterrupt):
        uvicorn.Server(config).run()
    return 0


async def _work(settings: Settings) -> None:
    backends = build_backends(settings)
    if not backends:
        raise ConfigError("a worker needs at least one --backend")
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    broker = create_broker(settings.broker, broker_settings(settings))
    await broker.start()
    dispatcher = Dispatcher(broker, backends, **webhook_options(settings))
    try:
        await dispatcher.start()
        log.info(
            "worker running",
            extra={"fields": {"worker": dispatcher.worker_id, "models": dispatcher.models()}},
        )
        await stop.wait()
    finally:
        await dispatcher.stop()
        for backend in backends:
            await backend.aclose()
        await broker.close()


def run_worker(args: argparse.Namespace) -> int:
    settings = _settings(args, "worker")
    if settings is None:
        return 2
    setup_logging(settings.log_level, settings.log_format)
    try:
        aio.run(_work(settings))
    except ConfigError as exc:
        print(f"sluice worker: {exc}", file=sys.stderr)
        return 2
    return 0
