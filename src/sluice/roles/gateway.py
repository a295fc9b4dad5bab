"""``sluice gateway``: the HTTP API alone, on a Redis broker shared with workers and other gateways.

Any number of gateways and workers share one Redis: gateways admit and answer, workers claim and
run. A job submitted through one gateway can be read, streamed and cancelled through any other.
"""

from __future__ import annotations

import argparse
import contextlib
import sys

from sluice import aio, runtime
from sluice.config import ConfigError
from sluice.logs import setup_logging
from sluice.roles import flags
from sluice.roles.http import bind, check_exposure, serve_http


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run a gateway only (no dispatcher): it admits requests into the Redis broker given by --broker "
        "and answers from it. Run any number of them, behind a load balancer; workers (sluice worker) "
        "run the jobs."
    )
    flags.add_config(parser)
    flags.add_insecure_open(parser)
    flags.add_flags(parser, flags.COMMON, flags.HTTP, flags.ADMISSION)


def run(args: argparse.Namespace) -> int:
    try:
        settings = flags.shared_settings(args, "gateway")
        setup_logging(settings.log_level, settings.log_format)
        check_exposure(settings)
        sock = bind(settings.host, settings.port)
    except ConfigError as exc:
        print(f"sluice gateway: {exc}", file=sys.stderr)
        return 2
    with sock, contextlib.suppress(KeyboardInterrupt):
        aio.run(serve_http(runtime.build_app(settings), sock, settings, "gateway"))
    return 0
