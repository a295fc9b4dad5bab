"""What each process tells the fleet about itself: a report in the broker, renewed every second.

A gateway reports the counters only it keeps (admissions, refusals, the Retry-After it gave); a
worker reports its engines (in-flight work, limit, failures, cooldown, draining) and the counters
only it keeps (finished jobs, tokens, queue wait and time to first token). Every gateway's dashboard
reads all the reports (:meth:`sluice.broker.base.Broker.reports`), so on Redis it shows the whole
fleet; ``sluice serve`` runs both in one process, each reporting its own families of the one
:class:`~sluice.metrics.Metrics`, so that nothing is counted twice.

A report is plain JSON::

    {"role": "gateway" | "worker", "host": ..., "pid": ..., "started_at": t, "at": t,
     "samples": [[metric sample name, {label: value}, value], ...],
     "engines": [...]}                         # workers only; see engine_rows
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import socket
import time
import uuid
import weakref
from collections.abc import Callable, Collection, Iterator
from typing import Any

from prometheus_client.metrics import MetricWrapperBase
from prometheus_client.metrics_core import Metric

from sluice.broker.base import Broker
from sluice.dispatcher import Dispatcher
from sluice.metrics import Metrics

log = logging.getLogger("sluice.reports")

#: how often a process renews its report (and a dashboard redraws)
REPORT_EVERY_S = 1.0
#: a process silent this long drops out of the fleet's view
REPORT_TTL_S = 10.0

#: the metric families a gateway counts (and so reports)
GATEWAY_FAMILIES = frozenset({"sluice_admissions", "sluice_client_retries", "sluice_retry_after_seconds"})
#: the metric families a worker's dispatcher counts
WORKER_FAMILIES = frozenset(
    {
        "sluice_jobs",
        "sluice_completion_tokens",
        "sluice_engine_aborts",
        "sluice_queue_wait_seconds",
        "sluice_time_to_first_token_seconds",
    }
)


def new_process_id(role: str) -> str:
    return f"{role}-{uuid.uuid4().hex[:12]}"


def _collected(metrics: Metrics, families: Collection[str]) -> Iterator[Metric]:
    """Every family of ``metrics``' registry that is in ``families``, in the registry's order."""
    return (family for family in metrics.registry.collect() if family.name in families)


#: per Metrics, per set of families: its metrics that make them, found at the first report
_FOUND: weakref.WeakKeyDictionary[Metrics, dict[frozenset[str], list[MetricWrapperBase] | None]] = (
    weakref.WeakKeyDictionary()
)


def _metrics_of(metrics: Metrics, families: frozenset[str]) -> list[MetricWrapperBase] | None:
    """The metrics of ``metrics`` (its attributes, made in the registry's order) whose families are
    ``families``, checked once against the whole registry's collection: their families, in the
    same order. None when they are not (a family registered otherwise): then the whole registry
    is collected each time."""
    found = [
        m
        for m in vars(metrics).values()
        if isinstance(m, MetricWrapperBase) and any(d.name in families for d in m.describe())
    ]
    names = [f.name for m in found for f in m.collect()]
    return found if names == [f.name for f in _collected(metrics, families)] else None


def metric_samples(metrics: Metrics, families: Collection[str]) -> list[list[Any]]:
    """The current samples of ``families`` in ``metrics``: counters' totals and histograms'
    cumulative buckets, counts and sums (never the ``_created`` timestamps).

    Collected from those families' metrics alone, not the whole registry (its gauges, the fleet's
    collector, which builds a family per engine), found once per Metrics and set of families."""
    key = families if isinstance(families, frozenset) else frozenset(families)
    by_families = _FOUND.get(metrics)
    if by_families is None:
        by_families = _FOUND[metrics] = {}
    if key not in by_families:
        by_families[key] = _metrics_of(metrics, key)
    found = by_families[key]
    out: list[list[Any]] = []
    for family in (f for m in found for f in m.collect()) if found is not None else _collected(metrics, key):
        for sample in family.samples:
            if sample.name[-8:] != "_created":
                out.append([sample.name, dict(sample.labels), float(sample.value)])
    return out


def engine_rows(dispatcher: Dispatcher) -> list[dict[str, Any]]:
    """Each engine the dispatcher feeds, as the dashboard shows it (:meth:`sluice.fleet.Engine.row`)."""
    now = time.monotonic()
    return [e.row(now) for e in dispatcher.fleet.engines]


class Reporter:
    """Publishes one process's report every ``every_s`` until stopped.

    Args:
        broker: where the report goes.
        process_id: the process's name in the fleet (a worker's is its dispatcher's worker id).
        role: ``gateway`` or ``worker``.
        body: what the report says now (its ``samples``, ``engines``), called at each publication.
    """

    def __init__(
        self,
        broker: Broker,
        process_id: str,
        role: str,
        body: Callable[[], dict[str, Any]],
        *,
        every_s: float = REPORT_EVERY_S,
        ttl_s: float = REPORT_TTL_S,
    ) -> None:
        self.broker = broker
        self.process_id = process_id
        self.role = role
        self.body = body
        self.every_s = every_s
        self.ttl_s = ttl_s
        self.started_at = broker.now()
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    def report(self) -> dict[str, Any]:
        return {
            "role": self.role,
            "host": socket.gethostname(),
            "pid": os.getpid(),
            "started_at": self.started_at,
            "at": self.broker.now(),
            **self.body(),
        }

    async def publish(self) -> None:
        """Publish the report once; a broker that cannot be reached is logged once per outage."""
        try:
            await self.broker.put_report(self.process_id, self.report(), self.ttl_s)
        except asyncio.CancelledError:
            raise
        except Exception as exc:
            if not self._failing:
                log.warning("fleet report not published (the dashboard misses %s): %s", self.role, exc)
            self._failing = True
        else:
            self._failing = False

    async def start(self) -> None:
        if self._task is None:
            await self.publish()
            self._task = asyncio.create_task(self._forever(), name=f"report-{self.role}")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _forever(self) -> None:
        while True:
            await asyncio.sleep(self.every_s)
            await self.publish()


def worker_reporter(broker: Broker, dispatcher: Dispatcher) -> Reporter:
    """The report of a worker: its engines, and its dispatcher's counters."""

    def body() -> dict[str, Any]:
        metrics = dispatcher.metrics
        samples = metric_samples(metrics, WORKER_FAMILIES) if metrics is not None else []
        return {"engines": engine_rows(dispatcher), "samples": samples}

    return Reporter(broker, dispatcher.worker_id, "worker", body)


def gateway_body(metrics: Metrics) -> Callable[[], dict[str, Any]]:
    """What a gateway reports: its admission counters and the Retry-After it gave."""
    return lambda: {"samples": metric_samples(metrics, GATEWAY_FAMILIES)}
