"""``sluice worker``: a dispatcher (and webhook delivery) on a Redis broker, with no HTTP API.

It claims jobs only when one of its backends has room, runs them, and settles them in the broker;
any number of workers share one Redis. On SIGTERM it drains (:mod:`sluice.drain`): it stops
claiming, lets its jobs finish within the grace period (``SLUICE_DRAIN_GRACE_S``), hands the rest
back to the head of their queues and exits 0; a second SIGTERM hands them back at once. This module
never imports the web framework.
"""

from __future__ import annotations

import argparse
import asyncio
import logging
import sys

from sluice import aio, drain, runtime
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


async def work(settings: Settings, grace_s: float = drain.DEFAULT_GRACE_S) -> None:
    """Run until SIGINT or SIGTERM, then drain (a second signal hurries the drain)."""
    shutdown = drain.Drain(grace_s=grace_s)
    with drain.signals_drain(shutdown, asyncio.get_running_loop()):
        async with runtime.running_worker(settings) as worker:
            log.info(
                "worker running",
                extra={
                    "fields": {"worker": worker.dispatcher.worker_id, "models": worker.dispatcher.models()}
                },
            )
            await shutdown.started.wait()
            try:
                await drain.drain_dispatcher(worker.dispatcher, shutdown)
            except Exception as exc:
                # It still stops: what was not handed back comes back when its lease runs out.
                log.error("drain failed; stopping now", exc_info=exc)


def run(args: argparse.Namespace) -> int:
    try:
        settings = flags.shared_settings(args, "worker")
        if not settings.has_engines:
            raise ConfigError("a worker needs an engine: at least one --backend, or [[pools]] in --config")
        grace_s = drain.grace_of(settings)
    except ConfigError as exc:
        print(f"sluice worker: {exc}", file=sys.stderr)
        return 2
    setup_logging(settings.log_level, settings.log_format)
    aio.run(work(settings, grace_s))
    return 0
