"""``sluice gateway``: the HTTP API alone, on a Redis broker shared with workers and other gateways.

Any number of gateways and workers share one Redis: gateways admit and answer, workers claim and
run. A job submitted through one gateway can be read, streamed and cancelled through any other.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from sluice import aio, drain, runtime
from sluice.config import ConfigError
from sluice.logs import setup_logging
from sluice.roles import flags
from sluice.roles.http import accept_of, bind, check_exposure, serve_http


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run a gateway only (no dispatcher): it admits requests into the Redis broker given by --broker "
        "and answers from it. Run any number of them, behind a load balancer; workers (sluice worker) "
        "run the jobs. On SIGTERM it drains: /readyz says 503 at once, open requests and streams "
        "finish within the grace period, then it exits 0."
    )
    flags.add_config(parser)
    flags.add_insecure_open(parser)
    flags.add_flags(parser, flags.COMMON, flags.HTTP, flags.ADMISSION)


def run(args: argparse.Namespace) -> int:
    try:
        settings = flags.shared_settings(args, "gateway")
        setup_logging(settings.log_level, settings.log_format)
        check_exposure(settings)
        grace_s, accept_s = drain.grace_of(settings), accept_of(settings)
        sock = bind(settings.host, settings.port)
    except ConfigError as exc:
        print(f"sluice gateway: {exc}", file=sys.stderr)
        return 2
    app = runtime.build_app(settings)
    with sock, contextlib.suppress(KeyboardInterrupt):
        aio.run(serve_http(app, sock, settings, "gateway", grace_s=grace_s, accept_s=accept_s))
    return 0
