"""The scaling signal's edge: reads the shared broker state every few seconds, asks
:mod:`sluice.core.scaling` how many engines each model needs, and sets the gauges an autoscaler
(KEDA through Prometheus) reads: ``sluice_desired_engines`` and what it is made of
(docs/autoscaling.md lists every one).

Everything comes from the broker, which every gateway of a Redis queue shares: the queue per class
(:meth:`~sluice.broker.base.Broker.queue_breakdown`), the running jobs, slots and learned slot rate
(:meth:`~sluice.broker.base.Broker.stats`), and the engines of each model from the workers'
reports (:meth:`~sluice.broker.base.Broker.reports`). So every gateway computes the same answer
from the same state; what differs between them is only when each read it (the smoothed arrival
rate and the oldest job's age come from each one's own readings): scrape any one, or take the max.

The reading is shared with the dashboard's feed (:mod:`sluice.fleet_sampler`): the signal makes the
sampler, the feed given the signal reads through it once a second, and the signal takes the feed's
latest reading when it is at most :data:`READING_MAX_AGE_S` old, reading the broker itself only
when no feed has.

Wiring (the gateway's app)::

    signal = ScalingSignal(broker, metrics)
    await signal.start()      # with the app's lifespan, after the broker starts
    await signal.stop()       # before the broker closes
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import math
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from sluice.broker.base import Broker, ModelStats, QueueBreakdown
from sluice.core.scaling import (
    ArrivalEstimator,
    Assessment,
    ClassQueue,
    Demand,
    ScalingPolicy,
    Stabiliser,
    Supply,
    assess,
    pool_shares,
    split_by_pool,
    throughput,
    urgent_tokens,
)
from sluice.fleet_sampler import FleetReading, FleetSampler
from sluice.metrics import Metrics

log = logging.getLogger("sluice.scaling")

#: how often the signal is computed: well under KEDA's polling interval (30 s by default)
SIGNAL_EVERY_S = 5.0
#: how old a reading may be and still serve the signal: the dashboard's feed reads once a second,
#: and two of its ticks let a tick that is late under load still serve (the signal itself is read
#: every 30 s by KEDA)
READING_MAX_AGE_S = 2.0


@dataclass(frozen=True)
class EngineView:
    """One engine serving a model, as a worker reports it.

    Attributes:
        name: the engine's name (its backend's).
        slots: its in-flight limit (configured or learned).
        pool: the pool it belongs to (None: an engine configured outside pools).
    """

    name: str
    slots: int
    pool: str | None = None


@dataclass(frozen=True)
class ModelSignal:
    """What the signal found for one model at one reading.

    Attributes:
        model: the model.
        desired_engines: the answer, after hysteresis.
        demand: what was queued, running and arriving.
        supply: what served it.
        assessment: the raw answer and its parts (predicted waits, risk per class).
        engines: the engines serving it, by name, when the workers report them.
    """

    model: str
    desired_engines: int
    demand: Demand
    supply: Supply
    assessment: Assessment
    engines: tuple[EngineView, ...] = ()


@dataclass
class _ModelState:
    """What the signal remembers of one model between readings."""

    arrivals: ArrivalEstimator
    stabiliser: Stabiliser
    #: when its queue was last seen empty (the oldest queued job arrived after it)
    empty_at: float
    #: an engine's slots, last seen (used when the model is scaled to zero)
    slots_per_engine: float | None = None
    engine_names: set[str] = field(default_factory=set)
    #: each pool's share of the model's engines, last seen while any served it
    pool_shares: dict[str, float] = field(default_factory=dict)


def engines_by_model(reports: Mapping[str, Mapping[str, Any]]) -> dict[str, list[EngineView]]:
    """The engines each model is served by, from the workers' reports (``sluice.reports``): an
    engine that is draining, leaving (its address gone from its pool's DNS) or ejected after
    failures is not counted. An engine whose models
    are not listed (asked of the engine) is counted under the key ``""``."""
    out: dict[str, list[EngineView]] = {}
    for report in reports.values():
        if report.get("role") != "worker":
            continue
        for row in report.get("engines") or []:
            if not isinstance(row, Mapping) or row.get("draining") or row.get("leaving"):
                continue
            if (row.get("cooldown_s") or 0) > 0:  # ejected after failures: not serving now
                continue
            limit = row.get("limit")
            slots = int(limit) if isinstance(limit, (int, float)) and limit > 0 else 0
            pool = row.get("pool")
            view = EngineView(str(row.get("name", "")), slots, str(pool) if pool else None)
            for model in row.get("models") or [""]:
                out.setdefault(str(model), []).append(view)
    return out


class ScalingSignal:
    """Computes the scaling signal of every model on ``broker`` and sets it in ``metrics``.

    Args:
        broker: the shared queue (started by whoever built it).
        metrics: where the gauges go.
        policy: objectives, headroom, bounds and hysteresis (:class:`ScalingPolicy`).
        every_s: how often :meth:`run` reads.
        arrival_tau_s: the arrival rate's smoothing time constant.
        sampler: where it reads the broker, shared with the dashboard's feed
            (:attr:`sluice.dashboard_feed.DashboardFeed.sampler`); its own unless given.
    """

    def __init__(
        self,
        broker: Broker,
        metrics: Metrics,
        policy: ScalingPolicy | None = None,
        *,
        every_s: float = SIGNAL_EVERY_S,
        arrival_tau_s: float = 30.0,
        sampler: FleetSampler | None = None,
    ) -> None:
        self.broker = broker
        self.metrics = metrics
        self.policy = policy or ScalingPolicy()
        self.every_s = every_s
        self.arrival_tau_s = arrival_tau_s
        self.sampler = sampler or FleetSampler(broker)
        self.signals: dict[str, ModelSignal] = {}
        #: per pool, the engines it needs for the models it serves (split_by_pool)
        self.pools: dict[str, int] = {}
        self._models: dict[str, _ModelState] = {}
        self._pools_published: set[str] = set()
        self._task: asyncio.Task[None] | None = None
        self._failing = False

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self.run(), name="scaling-signal")

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def run(self) -> None:
        """Read every ``every_s`` until cancelled; a broker outage is logged once and waited out
        (the gauges keep their last values: an autoscaler should not scale down on a blind spot)."""
        while True:
            try:
                await self.update()
            except asyncio.CancelledError:
                raise
            except Exception as exc:
                if not self._failing:
                    log.warning("scaling signal not updated: %s", exc)
                self._failing = True
            else:
                self._failing = False
            await asyncio.sleep(self.every_s)

    async def poll(self) -> dict[str, ModelSignal]:
        """One fresh reading of the broker: every model's signal, also set in the gauges."""
        return self.observe(await self.sampler.read())

    async def update(self) -> dict[str, ModelSignal]:
        """As :meth:`poll`, from the sampler's latest reading when it is at most
        :data:`READING_MAX_AGE_S` old (the dashboard feed's), else from a fresh one."""
        return self.observe(await self.sampler.recent(READING_MAX_AGE_S))

    def observe(self, reading: FleetReading) -> dict[str, ModelSignal]:
        """Every model's signal from one reading, also set in the gauges."""
        stats, breakdown, now = reading.stats, reading.breakdown, reading.at
        engines = engines_by_model(reading.reports)
        anywhere = engines.get("", [])
        out: dict[str, ModelSignal] = {}
        for model in sorted(set(stats) | set(breakdown)):
            views = engines.get(model, []) + anywhere
            out[model] = self._model(model, stats.get(model), breakdown.get(model), views, now)
        self.signals = out
        shares = {model: self._models[model].pool_shares for model in out}
        self.pools = split_by_pool({m: s.desired_engines for m, s in out.items()}, shares)
        self._publish(out)
        return out

    def _state(self, model: str, now: float) -> _ModelState:
        state = self._models.get(model)
        if state is None:
            state = _ModelState(ArrivalEstimator(self.arrival_tau_s), Stabiliser(self.policy), now)
            self._models[model] = state
        return state

    def _model(
        self,
        model: str,
        stats: ModelStats | None,
        breakdown: QueueBreakdown | None,
        views: list[EngineView],
        now: float,
    ) -> ModelSignal:
        state = self._state(model, now)
        classes = {
            name: ClassQueue(depth.jobs, depth.tokens)
            for name, depth in (breakdown.classes.items() if breakdown is not None else ())
        }
        queued_jobs = stats.queued_jobs if stats is not None else sum(q.jobs for q in classes.values())
        queued_tokens = stats.queued_tokens if stats is not None else sum(q.tokens for q in classes.values())
        running = stats.running_jobs if stats is not None else 0
        slots = stats.slots if stats is not None else 0
        # ModelStats.drain_rate is the slot rate times max(slots, 1) (DrainRate.rate)
        slot_rate = stats.drain_rate / max(slots, 1) if stats is not None else 0.0
        if queued_jobs == 0:
            state.empty_at = now
        # Engines from the workers' reports; without reports (an older worker), the slots in
        # engines of the size last seen, or of the policy's default size.
        if views:
            engine_count = len(views)
            by_pool: dict[str, int] = {}
            for v in views:
                if v.pool is not None:
                    by_pool[v.pool] = by_pool.get(v.pool, 0) + 1
            if by_pool:
                state.pool_shares = pool_shares(by_pool)
        elif slots > 0:
            size = state.slots_per_engine or float(self.policy.default_slots_per_engine)
            engine_count = max(math.ceil(slots / size - 1e-9), 1)
        else:
            engine_count = 0
        if engine_count > 0 and slots > 0:
            state.slots_per_engine = slots / engine_count
        rate = state.arrivals.observe(
            now,
            urgent_tokens(classes, self.policy.objectives),
            throughput(running, slots, slot_rate),
            slot_rate,
        )
        # the smoothed slot rate, the one the arrival rate was smoothed with (ArrivalEstimator)
        supply = Supply(engine_count, slots, state.arrivals.slot_rate, state.slots_per_engine)
        demand = Demand(
            queued_jobs=queued_jobs,
            queued_tokens=queued_tokens,
            running_jobs=running,
            arrival_tokens_per_s=rate,
            oldest_queued_age_s=max(now - state.empty_at, 0.0) if queued_jobs else 0.0,
            classes=classes,
        )
        assessment = assess(demand, supply, self.policy)
        desired = state.stabiliser.update(assessment.raw_engines, now, assessment.needed)
        return ModelSignal(model, desired, demand, supply, assessment, tuple(views))

    def _publish(self, signals: Mapping[str, ModelSignal]) -> None:
        m = self.metrics
        for model, s in signals.items():
            m.desired_engines.labels(model).set(s.desired_engines)
            m.engines.labels(model).set(s.supply.engines)
            m.queued_jobs.labels(model).set(s.demand.queued_jobs)
            m.queued_tokens.labels(model).set(s.demand.queued_tokens)
            m.running_jobs.labels(model).set(s.demand.running_jobs)
            m.oldest_queued_age.labels(model).set(s.demand.oldest_queued_age_s)
            m.arrival_rate.labels(model).set(s.demand.arrival_tokens_per_s)
            m.capacity.labels(model).set(s.assessment.capacity)
            for name, wait in s.assessment.predicted_wait_s.items():
                # Prometheus takes +Inf; a wait with nothing serving is one
                m.predicted_wait.labels(model, name).set(wait)
            for name, risk in s.assessment.at_risk.items():
                m.deadlines_at_risk.labels(model, name).set(1 if risk else 0)
            state = self._models[model]
            names = {v.name for v in s.engines}
            for gone in state.engine_names - names:
                with contextlib.suppress(KeyError):
                    m.engine_capacity.remove(model, gone)
            for v in s.engines:
                if v.slots > 0:
                    m.engine_capacity.labels(model, v.name).set(v.slots * s.supply.slot_rate)
            state.engine_names = names
        for gone in self._pools_published - set(self.pools):
            with contextlib.suppress(KeyError):
                m.pool_desired_engines.remove(gone)
        for pool, engines in self.pools.items():
            m.pool_desired_engines.labels(pool).set(engines)
        self._pools_published = set(self.pools)
