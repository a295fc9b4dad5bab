"""The Python calls of one dashboard tick, counted with a profile hook: a figure that the machine's
other load does not move, and that says whether a tick's cost grows with the load it reports.

A gateway's periodic work (:meth:`sluice.dashboard_feed.DashboardFeed.tick`: publish its report,
read the fleet, take a tick of history, build the snapshot; and, in ``sluice serve``, the worker's
report) runs whether or not anyone watches. Its cost should not grow with the requests served:
:mod:`sluice.bench.overhead_calls` counts whatever a busy tick costs above an idle one as the
requests' own.

Here everything runs in one process on a memory broker with a clock of its own: the history is
filled with ``--ticks`` ticks (one a second), at each of which ``--jobs`` jobs were admitted and
finished (their queue waits and times to first token spread over the latency buckets) and a tenth
as many refused (with a Retry-After), the fleet's collector registered as the app has it; then the
next tick is counted: every Python and C call
(``call`` and ``c_call`` events) from the worker's report to the snapshot.

Usage: python -m sluice.bench.dashboard_tick [--jobs 0,10,100] [--ticks 600] [--models 1]
       [--by-function N]
"""

from __future__ import annotations

import argparse
import asyncio
import random
import sys
from collections import Counter
from collections.abc import Callable, Sequence
from types import FrameType
from typing import Any

from sluice.broker.base import BrokerSettings
from sluice.broker.memory import MemoryBroker
from sluice.dashboard_feed import DashboardFeed, FleetCollector
from sluice.metrics import Metrics
from sluice.reports import WORKER_FAMILIES, Reporter, metric_samples

CODES = ("queue_full", "rate_limited")


def _engine_rows(models: Sequence[str]) -> list[dict[str, Any]]:
    return [
        {
            "name": f"engine-{i}",
            "models": [model],
            "pool": None,
            "limit": 256,
            "limit_source": "configured",
            "ceiling": None,
            "inflight": 3,
            "inflight_tokens": 300,
            "max_inflight_tokens": None,
            "failures": 0,
            "health": "healthy",
            "cooldown_s": 0.0,
            "draining": False,
            "leaving": False,
            "ttft_s": 0.01,
        }
        for i, model in enumerate(models)
    ]


def _record(metrics: Metrics, rng: random.Random, jobs: int, models: Sequence[str]) -> None:
    """One second's load: ``jobs`` admitted and finished per model, a tenth as many refused."""
    for model in models:
        for _ in range(jobs):
            metrics.admissions.labels("admitted", "").inc()
            metrics.jobs.labels(model, "succeeded").inc()
            metrics.queue_wait.labels(model).observe(rng.expovariate(1 / 0.05))
            metrics.ttft.labels(model).observe(rng.expovariate(1 / 0.2))
            metrics.tokens.labels(model).inc(8)
        for _ in range(jobs // 10):
            code = CODES[rng.randrange(len(CODES))]
            metrics.admissions.labels("refused", code).inc()
            metrics.retry_after.labels(code).observe(rng.uniform(0.5, 30))


async def _one(
    jobs: int, ticks: int, models: Sequence[str], by_function: int
) -> tuple[int, list[tuple[str, int]], dict[str, Any]]:
    now = [1_000_000.0]
    broker = MemoryBroker(BrokerSettings(clock=lambda: now[0]))
    await broker.register("worker-1", dict.fromkeys(models, 256))
    metrics = Metrics()
    rows = _engine_rows(models)
    worker = Reporter(
        broker,
        "worker-1",
        "worker",
        lambda: {"engines": rows, "samples": metric_samples(metrics, WORKER_FAMILIES)},
    )
    feed = DashboardFeed(broker, metrics)
    metrics.registry.register(FleetCollector(feed))  # as the app's /metrics has it
    rng = random.Random(42)
    for _ in range(ticks):
        _record(metrics, rng, jobs, models)
        await worker.publish()
        await feed.tick()
        now[0] += 1.0
    _record(metrics, rng, jobs, models)

    calls = [0]
    each: Counter[str] = Counter()

    def count(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" or event == "c_call":
            calls[0] += 1

    def count_each(frame: FrameType, event: str, arg: Any) -> None:
        if event == "call":
            calls[0] += 1
            code = frame.f_code
            each[f"{code.co_qualname} ({code.co_filename.rsplit('/', 1)[-1]}:{code.co_firstlineno})"] += 1
        elif event == "c_call":
            calls[0] += 1
            each[f"{getattr(arg, '__qualname__', arg)} (C)"] += 1

    hook: Callable[[FrameType, str, Any], None] = count_each if by_function else count
    # Nothing in the tick waits (a memory broker, an uncontended lock): no other task runs inside.
    sys.setprofile(hook)
    await worker.publish()
    snap = await feed.tick()
    sys.setprofile(None)
    return calls[0], each.most_common(by_function), snap


def main(jobs: Sequence[int], ticks: int, models: int, by_function: int) -> None:
    names = [f"model-{i}" for i in range(models)]
    print(f"one dashboard tick after {ticks} ticks of history, {models} model(s); calls (Python + C)")
    for n in jobs:
        calls, top, _ = asyncio.run(_one(n, ticks, names, by_function))
        print(f"{n:>6} jobs a second   {calls:>8,} calls")
        for name, count in top:
            print(f"    {count:>7,}  {name}")


def _cli(argv: Sequence[str] | None = None) -> None:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", default="0,10,100", help="jobs a second in the history, comma-separated")
    parser.add_argument("--ticks", type=int, default=600, help="ticks of history before the one counted")
    parser.add_argument("--models", type=int, default=1)
    parser.add_argument("--by-function", type=int, default=0, help="list the N functions called most")
    args = parser.parse_args(argv)
    main([int(j) for j in args.jobs.split(",")], args.ticks, args.models, args.by_function)


if __name__ == "__main__":
    _cli()
