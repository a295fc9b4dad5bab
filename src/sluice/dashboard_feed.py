"""The gateway's side of the dashboard: once a second it publishes this gateway's report, reads the
fleet from the broker (queue stats, the breakdown by class and tenant, every process's report,
through the sampler it shares with the scaling signal: :mod:`sluice.fleet_sampler`) and builds the
snapshot (:mod:`sluice.dashboard`); it keeps the recent history, bounded, and wakes the
open feeds. It also exports the fleet's engines and queue bounds to ``/metrics``
(:class:`FleetCollector`), for the Prometheus alerts in ``deploy/``.

It runs from the app's start to its stop, whether or not anyone watches, so that a page opened
under a burst has the minutes before it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from sluice.broker.base import Broker
from sluice.broker.signal import Signal
from sluice.dashboard import (
    HISTORY_TICKS,
    POINT_WINDOW_S,
    FleetInput,
    History,
    chart_point,
    snapshot,
)
from sluice.fleet_sampler import FleetSampler
from sluice.metrics import Metrics
from sluice.reports import REPORT_EVERY_S, Reporter, gateway_body, new_process_id
from sluice.scaling_signal import ScalingSignal

log = logging.getLogger("sluice.dashboard")


class DashboardFeed:
    """Samples the fleet every ``every_s`` and keeps the latest snapshot and the history.

    Args:
        broker: the queue every gateway and worker shares.
        metrics: this gateway's counters, which it reports for the others' dashboards too.
        every_s: the tick.
        keep: ticks of history kept.
        scaling: this gateway's scaling signal, whose findings the snapshot shows; None: none.
            The feed reads the broker through the signal's sampler, so that one reading a second
            serves both.
        sampler: where the feed reads the broker, when it is given; else the signal's (on the same
            broker), else its own.
    """

    def __init__(
        self,
        broker: Broker,
        metrics: Metrics,
        *,
        scaling: ScalingSignal | None = None,
        sampler: FleetSampler | None = None,
        every_s: float = REPORT_EVERY_S,
        keep: int = HISTORY_TICKS,
    ) -> None:
        self.broker = broker
        self.scaling = scaling
        if sampler is None and scaling is not None and scaling.sampler.broker is broker:
            sampler = scaling.sampler
        self.sampler = sampler or FleetSampler(broker)
        self.every_s = every_s
        self.history = History(keep)
        self.reporter = Reporter(broker, new_process_id("gateway"), "gateway", gateway_body(metrics))
        #: the latest snapshot, None before the first tick
        self.latest: dict[str, Any] | None = None
        #: how many ticks were taken (the SSE event id)
        self.seq = 0
        self._ticked = Signal()
        self._task: asyncio.Task[None] | None = None
        self._lock = asyncio.Lock()
        self._failing = False

    @property
    def running(self) -> bool:
        return self._task is not None and not self._task.done()

    async def start(self) -> None:
        if not self.running:
            self._task = asyncio.create_task(self._forever(), name="dashboard-feed")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _forever(self) -> None:
        while True:
            try:
                await self.tick()
            except asyncio.CancelledError:
                raise
            except Exception as exc:  # the broker is away: the page says it is stale, and we go on
                if not self._failing:
                    log.warning("dashboard not updated: %s", exc)
                self._failing = True
            else:
                self._failing = False
            await asyncio.sleep(self.every_s)

    async def tick(self) -> dict[str, Any]:
        """Publish this gateway's report, read the fleet, and take one tick of history."""
        async with self._lock:
            broker = self.broker
            await self.reporter.publish()
            reading = await self.sampler.read()
            fleet = FleetInput(
                at=reading.at,
                stats=reading.stats,
                breakdown=reading.breakdown,
                reports=reading.reports,
                classes=list(broker.classes),
                limits=broker.settings.limits_for,
                draining=reading.draining,
                desired=self.desired(),
            )
            tick = self.history.advance(fleet.at, fleet.reports)
            tick.point = chart_point(fleet.at, reading.stats, tick, self.history.window(POINT_WINDOW_S)[0])
            self.latest = snapshot(fleet, self.history)
            self.seq += 1
            self._ticked.notify()
            return self.latest

    def desired(self) -> dict[str, tuple[int, tuple[str, ...]]]:
        """Per model, what this gateway's scaling signal last found: its desired engines, and the
        classes whose deadlines are at risk (empty without a signal, or before its first reading)."""
        if self.scaling is None:
            return {}
        return {
            model: (
                signal.desired_engines,
                tuple(sorted(c for c, risky in signal.assessment.at_risk.items() if risky)),
            )
            for model, signal in self.scaling.signals.items()
        }

    async def next_after(self, seq: int, timeout: float) -> tuple[int, dict[str, Any]] | None:
        """The first snapshot after tick ``seq`` (at once if there is one), or None after ``timeout``."""
        while self.seq <= seq or self.latest is None:
            ticked = self._ticked.current()
            if self.seq > seq and self.latest is not None:
                break
            try:
                async with asyncio.timeout(timeout):
                    await ticked.wait()
            except TimeoutError:
                return None
        return self.seq, self.latest


def _labels(row: dict[str, Any]) -> list[str]:
    return [str(row.get("name")), str(row.get("worker"))]


class FleetCollector:
    """Exports the fleet's engines and queue bounds from the feed's latest snapshot, so that
    Prometheus sees what the dashboard sees: every gateway exports the whole fleet (take the max
    over gateways). Nothing before the first tick."""

    def __init__(self, feed: DashboardFeed) -> None:
        self.feed = feed

    def describe(self) -> list[Metric]:
        return []  # registered without a first collect: the feed has nothing yet

    def collect(self) -> Iterator[Metric]:
        snap = self.feed.latest
        if snap is None:
            return
        engine = ["backend", "worker"]
        gauges = {
            "inflight": GaugeMetricFamily(
                "sluice_backend_inflight", "Sequences running on the backend", labels=engine
            ),
            "limit": GaugeMetricFamily(
                "sluice_backend_limit", "Sequences the backend may run at once", labels=engine
            ),
            "failures": GaugeMetricFamily(
                "sluice_backend_failures", "Connection errors in a row on the backend", labels=engine
            ),
            "cooldown_s": GaugeMetricFamily(
                "sluice_backend_cooldown_seconds",
                "How long the backend still sits out after errors (ejected while above 0)",
                labels=engine,
            ),
        }
        up = GaugeMetricFamily(
            "sluice_backend_up",
            "1 while the backend takes work or drains; 0 ejected or unreported",
            labels=engine,
        )
        draining = GaugeMetricFamily("sluice_backend_draining", "1 while the backend drains", labels=engine)
        for row in snap["engines"]:
            labels = _labels(row)
            for field, family in gauges.items():
                family.add_metric(labels, float(row.get(field) or 0))
            up.add_metric(labels, 0.0 if row["state"] in ("ejected", "stale") else 1.0)
            draining.add_metric(labels, 1.0 if row.get("draining") else 0.0)
        yield from gauges.values()
        yield up
        yield draining
        max_jobs = GaugeMetricFamily(
            "sluice_queue_max_jobs", "The model's bound on queued jobs", labels=["model"]
        )
        max_tokens = GaugeMetricFamily(
            "sluice_queue_max_tokens", "The model's bound on queued cost (tokens)", labels=["model"]
        )
        for model in snap["models"]:
            if model["max_queued_jobs"] is not None:
                max_jobs.add_metric([model["name"]], float(model["max_queued_jobs"]))
            if model["max_queued_tokens"] is not None:
                max_tokens.add_metric([model["name"]], float(model["max_queued_tokens"]))
        yield max_jobs
        yield max_tokens
