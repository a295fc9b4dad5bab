"""``sluice kafka``: requests from a Kafka topic, answers to another, on a shared Redis broker."""

from __future__ import annotations

import argparse
import asyncio
import signal
import sys

from sluice import aio, runtime
from sluice.config import ConfigError, Settings
from sluice.logs import setup_logging
from sluice.roles import flags


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Consume requests from a Kafka topic as a consumer group, run them as jobs of the batch class on "
        "the Redis broker given by --broker (workers run them), and write each answer to --output-topic "
        "keyed by the request's id; offsets are committed only once the answers are written."
    )
    flags.add_config(parser)
    flags.add_flags(parser, flags.COMMON)
    parser.add_argument("--bootstrap", required=True, help="Kafka bootstrap servers, host:port[,...]")
    parser.add_argument("--topic", required=True, help="the topic requests are read from")
    parser.add_argument("--output-topic", required=True, help="the topic answers are written to")
    parser.add_argument("--group", default="sluice", help="the consumer group (default sluice)")
    parser.add_argument("--tenant", default="kafka", help="the tenant the requests run as (default kafka)")
    parser.add_argument("--priority", help="the class they run in (default: batch_class)")
    parser.add_argument(
        "--max-inflight", type=int, default=16, help="requests admitted and not yet answered, at most"
    )


async def bridge(settings: Settings, args: argparse.Namespace) -> None:
    from sluice.api.auth import Caller
    from sluice.api.gateway import Gateway
    from sluice.core.ratelimit import TenantLimits
    from sluice.kafka.bridge import KafkaBridge
    from sluice.metrics import Metrics

    broker = runtime.build_broker(settings)
    await broker.start()
    try:
        gateway = Gateway(settings, broker, Metrics())
        kafka = KafkaBridge(
            gateway,
            Caller(TenantLimits(args.tenant), keyed=False),
            bootstrap=args.bootstrap,
            topic=args.topic,
            output_topic=args.output_topic,
            group=args.group,
            priority=args.priority or settings.batch_class,
            max_inflight=args.max_inflight,
        )
        task = asyncio.create_task(kafka.run())
        stop = asyncio.Event()
        loop = asyncio.get_running_loop()
        for sig in (signal.SIGINT, signal.SIGTERM):
            loop.add_signal_handler(sig, stop.set)
        waiter = asyncio.create_task(stop.wait())
        await asyncio.wait({task, waiter}, return_when=asyncio.FIRST_COMPLETED)
        task.cancel()
        waiter.cancel()
        await asyncio.gather(task, waiter, return_exceptions=True)
    finally:
        await broker.close()


def run(args: argparse.Namespace) -> int:
    try:
        settings = flags.shared_settings(args, "kafka")
    except ConfigError as exc:
        print(f"sluice kafka: {exc}", file=sys.stderr)
        return 2
    classes = [c.name for c in settings.queue_classes()]
    if args.priority is not None and args.priority not in classes:
        # refused at start, not as an error answer to every record of the topic
        print(
            f"sluice kafka: --priority {args.priority!r} is not a class ({', '.join(classes)})",
            file=sys.stderr,
        )
        return 2
    setup_logging(settings.log_level, settings.log_format)
    aio.run(bridge(settings, args))
    return 0
