"""``sluice worker``: a dispatcher (and webhook delivery) on a Redis broker, with no HTTP API.

It claims jobs only when one of its backends has room, runs them, and settles them in the broker;
any number of workers share one Redis. This module never imports the web framework.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import signal
import sys

from sluice import aio, runtime
from sluice.config import ConfigError, Settings
from sluice.logs import setup_logging
from sluice.roles import flags

log = logging.getLogger("sluice.worker")


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run a worker only (no HTTP API): it claims jobs from the Redis broker given by --broker and runs "
        "them on its --backend engines, at most --max-concurrency at once on each. Run any number of them."
    )
    flags.add_config(parser)
    flags.add_backends(parser)
    flags.add_flags(parser, flags.COMMON, flags.DISPATCH)


async def work(settings: Settings) -> None:
    """Run until SIGINT or SIGTERM."""
    stop = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        loop.add_signal_handler(sig, stop.set)
    async with runtime.running_worker(settings) as worker:
        log.info(
            "worker running",
            extra={"fields": {"worker": worker.dispatcher.worker_id, "models": worker.dispatcher.models()}},
        )
        await stop.wait()


def run(args: argparse.Namespace) -> int:
    try:
        settings = flags.shared_settings(args, "worker")
        if not settings.backends:
            raise ConfigError("a worker needs at least one --backend")
    except ConfigError as exc:
        print(f"sluice worker: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.log_format)
    aio.run(work(settings))
    return 0
