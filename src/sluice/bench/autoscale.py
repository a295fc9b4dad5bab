"""A simulated cluster that scales its engines: ``python -m sluice.bench.autoscale``.

No cluster runs here, so the question "does scaling on Sluice's signal beat scaling on the engine's
waiting queue?" is answered in simulated time, on one seeded set of arrivals shared by every
strategy:

* ``fixed-peak``: a fixed fleet sized for the day's peak, behind Sluice's queue;
* ``keda-waiting``: engines behind a plain load balancer (least outstanding requests, no shared
  queue: each engine queues for itself, FCFS as vLLM does), scaled by KEDA on
  ``vllm:num_requests_waiting`` summed over the engines (AverageValue target, 5 per engine);
* ``keda-waiting-behind-sluice``: the same scaler behind Sluice, whose queue keeps the engines'
  own waiting queues empty: the metric stays at 0 and the fleet at its minimum (why the signal is
  needed);
* ``keda-sluice``: behind Sluice, scaled by KEDA on ``max(sluice_desired_engines)`` (target 1),
  computed every 5 s by :mod:`sluice.core.scaling` from the queue as the gateway sees it, with
  the slot rate learned by :class:`sluice.core.capacity.DrainRate` from the finished jobs.

**Engines.** Each runs ``max_num_seqs`` sequences at once (continuous batching). A job's service
is its prefill plus its output tokens at the step time of the batch it joins
(:func:`sluice.sim.model.step_duration_s` of the ``article`` preset: 16 sequences, ~23 ms a step
when full): the batch size when it starts stands for its whole life (a fluid approximation of
:class:`sluice.sim.model.BatchModel`, which steps every token and would take hours for a day of
traffic). A new engine is billed from the moment it is asked for and serves ``cold_start_s``
later (60 s by default; 43-90 s is published for a 32B model on one H100 from a warm disk). An
engine scaled in stops taking work and is billed until its running (and, behind a plain balancer,
its waiting) requests are done.

**Autoscaler** (:class:`Hpa`): KEDA feeds the metric to Kubernetes' HPA, which every
``poll_s`` computes ``desired = ceil(metric / target)``, skips changes within its 10 % tolerance,
scales up at most by max(4 pods, 100 %) per period, and down only to the highest recommendation
of the last ``down_window_s`` (300 s by default), within ``min_replicas``..``max_replicas``.

**Deadlines.** Every job has a deadline by class; a client gives up at its deadline (the gateway
or the engine then drops the job: queued, it expires; running, it is aborted), and only jobs
finished within it count as goodput (their output tokens).
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import json
import math
import random
import sys
from collections import deque
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from enum import StrEnum
from pathlib import Path
from typing import Any

from sluice.core.capacity import DrainRate
from sluice.core.scaling import (
    ArrivalEstimator,
    ClassObjective,
    ClassQueue,
    Demand,
    ScalingPolicy,
    Stabiliser,
    Supply,
    assess,
    throughput,
    urgent_tokens,
)
from sluice.sim.model import SimParams, preset, step_duration_s


@dataclass(frozen=True)
class JobClass:
    """One priority class of the traffic.

    Attributes:
        name: the class (highest first in :data:`CLASSES`).
        share: its share of the arrivals.
        deadline_s: how long after arriving its client waits for the whole answer.
        objective_s: the wait before starting that Sluice's signal holds it to; None: best effort.
        max_tokens: the ``max_tokens`` its requests ask for.
    """

    name: str
    share: float
    deadline_s: float
    objective_s: float | None
    max_tokens: int


#: interactive, standard and batch traffic
CLASSES: tuple[JobClass, ...] = (
    JobClass("high", 0.3, 20.0, 8.0, 256),
    JobClass("normal", 0.5, 60.0, 30.0, 256),
    JobClass("low", 0.2, 1800.0, None, 512),
)


class Routing(StrEnum):
    """Where a job waits for an engine."""

    #: in Sluice's shared queue, by class then arrival; dispatched when a slot is free
    SLUICE = "sluice"
    #: in the engine it was sent to on arrival (least outstanding requests), FCFS
    DIRECT = "direct"


class Scaler(StrEnum):
    """What sets the number of engines."""

    FIXED = "fixed"
    WAITING = "waiting"
    SLUICE = "sluice"


@dataclass(frozen=True)
class Strategy:
    """One way of running the cluster.

    Attributes:
        name: its name in the report.
        routing: where jobs wait.
        scaler: what sets the engines.
        target: the HPA's AverageValue target per engine (waiting requests, or desired engines).
    """

    name: str
    routing: Routing
    scaler: Scaler
    target: float = 1.0


STRATEGIES: tuple[Strategy, ...] = (
    Strategy("fixed-peak", Routing.SLUICE, Scaler.FIXED),
    Strategy("keda-waiting", Routing.DIRECT, Scaler.WAITING, 5.0),
    Strategy("keda-waiting-behind-sluice", Routing.SLUICE, Scaler.WAITING, 5.0),
    Strategy("keda-sluice", Routing.SLUICE, Scaler.SLUICE, 1.0),
)


@dataclass(frozen=True)
class Config:
    """The simulated day and cluster.

    Attributes:
        seed: seeds the arrivals and the jobs' sizes.
        day_s: a day of traffic compressed into this many simulated seconds.
        peak_rps: the requests per second at the day's (diurnal) peak, before the burst.
        trough: the night's rate as a share of the peak.
        burst_at: when the burst starts, as a share of the day.
        burst_s: how long it lasts (it ramps up and down over ``ramp_s`` each side).
        burst_factor: the rate during the burst over the diurnal rate at that time.
        ramp_s: see ``burst_s``.
        cold_start_s: from asking for an engine to its serving.
        poll_s: the autoscaler's period (KEDA polls, the HPA syncs).
        down_window_s: the HPA's scale-down stabilisation window.
        min_replicas, max_replicas: the HPA's bounds (max 0: twice the peak-sized fleet).
        signal_every_s: how often the gateway computes ``sluice_desired_engines`` (and Prometheus
            scrapes the metrics).
        scrape_lag_s: how old the value KEDA reads is (Prometheus scrapes, then KEDA queries).
        signal_down_window_s: the signal's own scale-down window (``ScalingPolicy.down_window_s``):
            short, since the HPA stabilises on top of it.
        headroom: the signal's headroom (``ScalingPolicy.headroom``).
        engine: the engines' timing (a :mod:`sluice.sim.model` preset).
        sample_s: the period of the timelines in the report.
        peak_utilisation: the fixed fleet runs at most this busy at the burst's peak.
    """

    seed: int = 1
    day_s: float = 7200.0
    peak_rps: float = 30.0
    trough: float = 0.15
    burst_at: float = 0.62
    burst_s: float = 360.0
    burst_factor: float = 1.8
    ramp_s: float = 60.0
    cold_start_s: float = 60.0
    poll_s: float = 15.0
    down_window_s: float = 300.0
    min_replicas: int = 1
    max_replicas: int = 0
    signal_every_s: float = 5.0
    scrape_lag_s: float = 15.0
    signal_down_window_s: float = 60.0
    headroom: float = 0.2
    engine: str = "article"
    sample_s: float = 30.0
    peak_utilisation: float = 0.85

    def rate(self, t: float) -> float:
        """Arrivals per second at ``t``: a diurnal cosine from trough to peak, times the burst."""
        phase = t / self.day_s
        diurnal = self.peak_rps * (
            self.trough + (1 - self.trough) * 0.5 * (1 - math.cos(2 * math.pi * phase))
        )
        start = self.burst_at * self.day_s
        if start - self.ramp_s < t < start + self.burst_s + self.ramp_s:
            rise = min(max((t - (start - self.ramp_s)) / self.ramp_s, 0.0), 1.0)
            fall = min(max((start + self.burst_s + self.ramp_s - t) / self.ramp_s, 0.0), 1.0)
            diurnal *= 1 + (self.burst_factor - 1) * min(rise, fall)
        return diurnal

    def peak_rate(self) -> float:
        return max(self.rate(i * self.day_s / 2000) for i in range(2001))


@dataclass(slots=True)
class SimJob:
    """One request."""

    id: int
    cls: int
    arrival: float
    deadline: float
    prompt: int
    max_tokens: int
    output: int

    @property
    def cost(self) -> int:
        """What Sluice counts it as: prompt + max_tokens."""
        return self.prompt + self.max_tokens


def arrivals(config: Config) -> list[SimJob]:
    """The day's requests: an inhomogeneous Poisson process (thinning), sizes from the same seed."""
    rng = random.Random(config.seed)
    top = config.peak_rate() * 1.01
    weights = [c.share for c in CLASSES]
    out: list[SimJob] = []
    t = 0.0
    while True:
        t += rng.expovariate(top)
        if t >= config.day_s:
            return out
        if rng.random() * top > config.rate(t):
            continue
        k = rng.choices(range(len(CLASSES)), weights)[0]
        c = CLASSES[k]
        output = min(c.max_tokens, 1 + int(rng.expovariate(1 / 150)))
        out.append(SimJob(len(out), k, t, t + c.deadline_s, rng.randint(50, 600), c.max_tokens, output))


@dataclass
class Engine:
    """One engine of the fleet."""

    id: int
    started_at: float
    ready_at: float
    running: int = 0
    #: its own queue (direct routing only), FCFS
    waiting: deque[SimJob] = field(default_factory=deque)
    draining: bool = False
    stopped_at: float | None = None

    def ready(self, now: float) -> bool:
        return self.ready_at <= now and not self.draining and self.stopped_at is None


class Hpa:
    """Kubernetes' HPA as KEDA drives it, for an AverageValue target on an external metric.

    Args:
        target: the metric's value per replica.
        min_replicas, max_replicas: bounds.
        down_window_s: scale down only to the highest recommendation of this window.
        tolerance: changes whose ratio to the current replicas is within this are skipped.
    """

    def __init__(
        self,
        target: float,
        min_replicas: int,
        max_replicas: int,
        down_window_s: float,
        tolerance: float = 0.1,
    ) -> None:
        self.target = target
        self.min_replicas = min_replicas
        self.max_replicas = max_replicas
        self.down_window_s = down_window_s
        self.tolerance = tolerance
        self._recommendations: deque[tuple[float, int]] = deque()

    def desired(self, metric: float, current: int, now: float) -> int:
        """The replicas after one sync, given the metric summed over the replicas."""
        if current > 0 and abs(metric / self.target / current - 1) <= self.tolerance:
            raw = current
        else:
            raw = math.ceil(metric / self.target - 1e-9)
        raw = min(max(raw, self.min_replicas), self.max_replicas)
        self._recommendations.append((now, raw))
        while self._recommendations[0][0] < now - self.down_window_s:
            self._recommendations.popleft()
        if raw < current:  # scale-down stabilisation: the highest recommendation of the window
            raw = min(current, max(r for _, r in self._recommendations))
        else:  # the default scale-up policy: at most max(4 pods, 100 %) per period
            raw = min(raw, current + max(4, current))
        return raw


@dataclass
class Outcome:
    """One strategy's day."""

    strategy: str
    jobs: int = 0
    #: jobs finished within their deadline
    done: int = 0
    offered_tokens: int = 0
    goodput_tokens: int = 0
    misses: dict[str, int] = field(default_factory=lambda: {c.name: 0 for c in CLASSES})
    engine_seconds: float = 0.0
    peak_engines: int = 0
    #: per sample: [t, arrivals/s, engines billed, engines serving, metric the scaler read, queued]
    timeline: list[list[float]] = field(default_factory=list)
    #: per sample: deadline misses whose client gave up from that sample to the next
    misses_timeline: list[int] = field(default_factory=list)

    @property
    def goodput_share(self) -> float:
        return self.goodput_tokens / self.offered_tokens if self.offered_tokens else 1.0

    def row(self) -> dict[str, Any]:
        return {
            "strategy": self.strategy,
            "jobs": self.jobs,
            "done": self.done,
            "goodput_share": round(self.goodput_share, 4),
            "misses": sum(self.misses.values()),
            "misses_by_class": dict(self.misses),
            "engine_seconds": round(self.engine_seconds),
            "peak_engines": self.peak_engines,
        }


class Cluster:
    """One strategy's run over the day's arrivals (an event loop in simulated time)."""

    def __init__(self, config: Config, strategy: Strategy, fleet_peak: int) -> None:
        self.config = config
        self.strategy = strategy
        self.params: SimParams = preset(config.engine)
        self.slots = self.params.max_num_seqs
        self.engines: list[Engine] = []
        self.ids = itertools.count()
        self.events: list[tuple[float, int, str, Any]] = []
        self.seq = itertools.count()
        self.queues: list[deque[SimJob]] = [deque() for _ in CLASSES]
        self.queued_tokens = [0 for _ in CLASSES]
        self.outcome = Outcome(strategy.name)
        self.drain = DrainRate(slots=0)
        self.policy = ScalingPolicy(
            objectives=tuple(ClassObjective(c.name, c.objective_s) for c in CLASSES),
            default_slots_per_engine=self.slots,
            down_window_s=config.signal_down_window_s,
            headroom=config.headroom,
        )
        self.stabiliser = Stabiliser(self.policy)
        self.estimator = ArrivalEstimator(30.0)
        self.signal = 0
        self.metric = 0.0
        self.fleet_peak = fleet_peak
        max_replicas = config.max_replicas or 2 * fleet_peak
        self.hpa = Hpa(strategy.target, config.min_replicas, max_replicas, config.down_window_s)
        self._miss_buckets: dict[int, int] = {}
        #: (time, value) of the scaled-on metric as Prometheus scraped it
        self.scraped: deque[tuple[float, float]] = deque()

    # --- the fleet ------------------------------------------------------------------------------

    def add_engine(self, now: float, warm: bool = False) -> None:
        ready = now if warm else now + self.config.cold_start_s
        engine = Engine(next(self.ids), now, ready)
        self.engines.append(engine)
        if not warm:
            self.at(ready, "ready", engine)

    def live(self) -> list[Engine]:
        """Engines billed and not scaled in (starting or serving)."""
        return [e for e in self.engines if not e.draining and e.stopped_at is None]

    def scale_to(self, want: int, now: float) -> None:
        live = self.live()
        for _ in range(want - len(live)):
            self.add_engine(now)
        if want < len(live):
            # as a ReplicaSet does: pods not ready go first, then the least busy
            order = sorted(live, key=lambda e: (e.ready_at <= now, e.running + len(e.waiting)))
            for engine in order[: len(live) - want]:
                engine.draining = True
                self.maybe_stop(engine, now)

    def maybe_stop(self, engine: Engine, now: float) -> None:
        if engine.draining and engine.stopped_at is None and engine.running == 0 and not engine.waiting:
            engine.stopped_at = now

    # --- events ---------------------------------------------------------------------------------

    def at(self, t: float, kind: str, data: Any = None) -> None:
        heapq.heappush(self.events, (t, next(self.seq), kind, data))

    def miss(self, job: SimJob, now: float) -> None:
        """Count a missed deadline, in the timeline's sample where the client gave up."""
        self.outcome.misses[CLASSES[job.cls].name] += 1
        at = int(min(job.deadline, now) // self.config.sample_s)
        self._miss_buckets[at] = self._miss_buckets.get(at, 0) + 1

    def start(self, job: SimJob, engine: Engine, now: float) -> None:
        engine.running += 1
        step = step_duration_s(self.params, engine.running, 0)
        service = self.params.prefill_s_per_token * job.prompt + job.output * step
        end = now + service
        if end > job.deadline:  # its client gives up first: aborted at its deadline
            self.at(job.deadline, "abort", (job, engine))
        else:
            self.at(end, "done", (job, engine, service))

    def next_queued(self, now: float) -> SimJob | None:
        for k, q in enumerate(self.queues):
            while q:
                job = q.popleft()
                self.queued_tokens[k] -= job.cost
                if job.deadline > now:
                    return job
                self.miss(job, now)  # expired while queued
        return None

    def dispatch(self, now: float) -> None:
        """Sluice's dispatcher: queued jobs, highest class first, to the engine with most room."""
        if not any(self.queues):
            return
        room = [e for e in self.engines if e.ready(now) and e.running < self.slots]
        while room:
            engine = min(room, key=lambda e: e.running)
            job = self.next_queued(now)
            if job is None:
                return
            self.start(job, engine, now)
            if engine.running >= self.slots:
                room.remove(engine)

    def route(self, job: SimJob, now: float) -> None:
        """A plain balancer: the ready engine with the fewest outstanding requests."""
        ready = [e for e in self.engines if e.ready(now)]
        if not ready:
            self.miss(job, now)  # no endpoint: the connection is refused
            return
        engine = min(ready, key=lambda e: e.running + len(e.waiting))
        if engine.running < self.slots:
            self.start(job, engine, now)
        else:
            engine.waiting.append(job)

    def engine_next(self, engine: Engine, now: float) -> None:
        while engine.waiting and engine.running < self.slots:
            job = engine.waiting.popleft()
            if job.deadline > now:
                self.start(job, engine, now)
            else:
                self.miss(job, now)

    def free(self, engine: Engine, now: float) -> None:
        engine.running -= 1
        if self.strategy.routing is Routing.DIRECT:
            self.engine_next(engine, now)
        else:
            self.dispatch(now)
        self.maybe_stop(engine, now)

    # --- what the scalers read ------------------------------------------------------------------

    def waiting_metric(self, now: float) -> float:
        """``sum(vllm:num_requests_waiting)`` over the serving engines (their clients still there)."""
        total = 0
        for engine in self.engines:
            if engine.stopped_at is not None or engine.ready_at > now:
                continue
            kept = deque(j for j in engine.waiting if j.deadline > now)
            for job in engine.waiting:
                if job.deadline <= now:
                    self.miss(job, now)
            engine.waiting = kept
            total += len(kept)
        return float(total)

    def compute_signal(self, now: float) -> None:
        """What the gateway's ScalingSignal computes, from the queue and the learned slot rate."""
        serving = [e for e in self.engines if e.ready(now)]
        slots = len(serving) * self.slots
        self.drain.slots = slots
        slot_rate = self.drain.slot_rate
        classes = {
            c.name: ClassQueue(len(q), t)
            for c, q, t in zip(CLASSES, self.queues, self.queued_tokens, strict=True)
        }
        running = sum(e.running for e in serving)
        rate = self.estimator.observe(
            now,
            urgent_tokens(classes, self.policy.objectives),
            throughput(running, slots, slot_rate),
            slot_rate,
        )
        slot_rate = self.estimator.slot_rate
        demand = Demand(
            queued_jobs=sum(len(q) for q in self.queues),
            queued_tokens=sum(self.queued_tokens),
            running_jobs=running,
            arrival_tokens_per_s=rate,
            classes=classes,
        )
        a = assess(demand, Supply(len(serving), slots, slot_rate, float(self.slots)), self.policy)
        self.signal = self.stabiliser.update(a.raw_engines, now, a.needed)

    def scrape(self, now: float) -> None:
        """What Prometheus stores at ``now``: the metric the strategy scales on."""
        s = self.strategy
        if s.scaler is Scaler.WAITING:
            value = self.waiting_metric(now) if s.routing is Routing.DIRECT else 0.0
        else:
            value = float(self.signal)
        self.scraped.append((now, value))

    def autoscale(self, now: float) -> None:
        if self.strategy.scaler is Scaler.FIXED:
            return
        # KEDA's query answers with what Prometheus scraped ``scrape_lag_s`` ago (or earlier)
        while len(self.scraped) > 1 and self.scraped[1][0] <= now - self.config.scrape_lag_s:
            self.scraped.popleft()
        self.metric = self.scraped[0][1] if self.scraped else 0.0
        current = len(self.live())
        self.scale_to(self.hpa.desired(self.metric, current, now), now)

    def sample(self, now: float, rate: float) -> None:
        live = self.live()
        serving = sum(1 for e in live if e.ready_at <= now)
        billed = sum(1 for e in self.engines if e.stopped_at is None)
        queued = sum(len(q) for q in self.queues) + sum(len(e.waiting) for e in self.engines)
        metric = float(self.signal) if self.strategy.scaler is Scaler.SLUICE else self.metric
        self.outcome.timeline.append([round(now, 1), round(rate, 2), billed, serving, metric, queued])

    # --- the day --------------------------------------------------------------------------------

    def run(self, jobs: Sequence[SimJob]) -> Outcome:
        c = self.config
        if self.strategy.scaler is Scaler.FIXED:
            initial = self.fleet_peak
        else:
            initial = max(c.min_replicas, math.ceil(self.fleet_peak * c.rate(0) / c.peak_rate()))
        for _ in range(initial):
            self.add_engine(0.0, warm=True)
        self.at(0.0, "signal")
        self.at(0.0, "poll")
        self.at(0.0, "sample")
        arrived = 0
        window: deque[float] = deque()
        end = c.day_s + max(cl.deadline_s for cl in CLASSES)
        out = self.outcome
        while True:
            t_event = self.events[0][0] if self.events else math.inf
            if arrived < len(jobs) and jobs[arrived].arrival <= t_event:
                job = jobs[arrived]
                arrived += 1
                now = job.arrival
                window.append(now)
                out.jobs += 1
                out.offered_tokens += job.output
                if self.strategy.routing is Routing.DIRECT:
                    self.route(job, now)
                else:
                    self.queues[job.cls].append(job)
                    self.queued_tokens[job.cls] += job.cost
                    self.dispatch(now)
                continue
            if t_event > end:
                break
            now, _, kind, data = heapq.heappop(self.events)
            if kind == "done":
                job, engine, service = data
                out.goodput_tokens += job.output
                out.done += 1
                self.drain.observe(job.cost, service)
                self.free(engine, now)
            elif kind == "abort":
                job, engine = data
                self.miss(job, now)
                self.free(engine, now)
            elif kind == "ready":
                if self.strategy.routing is Routing.SLUICE:
                    self.dispatch(now)
            elif kind == "signal":
                self.compute_signal(now)
                self.scrape(now)
                self.at(now + c.signal_every_s, "signal")
            elif kind == "poll":
                self.autoscale(now)
                self.at(now + c.poll_s, "poll")
            elif kind == "sample":
                while window and window[0] < now - c.sample_s:
                    window.popleft()
                self.sample(now, len(window) / c.sample_s)
                out.peak_engines = max(out.peak_engines, sum(1 for e in self.engines if e.stopped_at is None))
                if now < c.day_s:
                    self.at(now + c.sample_s, "sample")
        # what is still queued when the last client has given up is a miss; engines stop billing
        for q in self.queues:
            for job in q:
                self.miss(job, job.deadline)
        for engine in self.engines:
            for job in engine.waiting:
                self.miss(job, job.deadline)
        samples = len(out.timeline)
        out.misses_timeline = [self._miss_buckets.get(i, 0) for i in range(samples)]
        out.misses_timeline[-1] += sum(n for i, n in self._miss_buckets.items() if i >= samples)
        stop = c.day_s
        out.engine_seconds = sum(
            (min(e.stopped_at, stop) if e.stopped_at is not None else stop) - e.started_at
            for e in self.engines
            if e.started_at < stop
        )
        return out


def engine_rps(config: Config) -> float:
    """Requests per second one engine finishes with every slot busy, for the day's mean job."""
    params = preset(config.engine)
    prompt = 325
    output = sum(c.share * min(c.max_tokens, 150) for c in CLASSES)
    service = params.prefill_s_per_token * prompt + output * step_duration_s(params, params.max_num_seqs, 0)
    return params.max_num_seqs / service


def peak_fleet(config: Config) -> int:
    """The fixed fleet: the burst's peak rate at ``peak_utilisation``."""
    return math.ceil(config.peak_rate() / (engine_rps(config) * config.peak_utilisation))


def run(config: Config, strategies: Sequence[Strategy] = STRATEGIES) -> dict[str, Any]:
    """Every strategy on the same arrivals; the report (JSON-ready)."""
    jobs = arrivals(config)
    fleet = peak_fleet(config)
    outcomes = []
    for strategy in strategies:
        fresh = [SimJob(j.id, j.cls, j.arrival, j.deadline, j.prompt, j.max_tokens, j.output) for j in jobs]
        outcomes.append(Cluster(config, strategy, fleet).run(fresh))
    base = next((o for o in outcomes if o.strategy == "fixed-peak"), outcomes[0])
    rows = []
    for o in outcomes:
        row = o.row()
        row["goodput_vs_fixed"] = (
            round(o.goodput_share / base.goodput_share, 4) if base.goodput_share else None
        )
        row["engine_seconds_vs_fixed"] = (
            round(o.engine_seconds / base.engine_seconds, 4) if base.engine_seconds else None
        )
        rows.append(row)
    return {
        "config": asdict(config),
        "peak_fleet": fleet,
        "engine_rps": round(engine_rps(config), 3),
        "rows": rows,
        "timelines": {o.strategy: {"samples": o.timeline, "misses": o.misses_timeline} for o in outcomes},
    }


def table(report: dict[str, Any]) -> str:
    """The report's rows as a Markdown table."""
    lines = [
        "| strategy | goodput | vs fixed | deadline misses (high/normal/low) | engine-seconds | vs fixed "
        "| peak engines |",
        "|---|---:|---:|---:|---:|---:|---:|",
    ]
    for r in report["rows"]:
        m = r["misses_by_class"]
        lines.append(
            f"| {r['strategy']} | {r['goodput_share']:.2%} | {r['goodput_vs_fixed']:.3f} | "
            f"{r['misses']} ({m['high']}/{m['normal']}/{m['low']}) | {r['engine_seconds']} | "
            f"{r['engine_seconds_vs_fixed']:.2f} | {r['peak_engines']} |"
        )
    return "\n".join(lines)


def plot(report: dict[str, Any], path: Path) -> bool:
    """Arrivals, engines and deadline misses over the day, per strategy; False without matplotlib."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        return False
    timelines = report["timelines"]
    fig, axes = plt.subplots(3, 1, figsize=(10, 9), sharex=True)
    first = next(iter(timelines.values()))["samples"]
    axes[0].plot([s[0] for s in first], [s[1] for s in first], color="black")
    axes[0].set_ylabel("arrivals / s")
    for name, tl in timelines.items():
        t = [s[0] for s in tl["samples"]]
        axes[1].step(t, [s[2] for s in tl["samples"]], where="post", label=name)
        axes[2].plot(t, tl["misses"], label=name)
    axes[1].set_ylabel("engines billed")
    axes[2].set_yscale("symlog", linthresh=10)
    axes[1].legend(fontsize=8)
    axes[2].set_ylabel(f"deadline misses / {report['config']['sample_s']:.0f} s")
    axes[2].set_xlabel("simulated seconds (a day compressed)")
    axes[2].legend(fontsize=8)
    fig.suptitle(
        f"Autoscaling a simulated fleet (seed {report['config']['seed']}, cold start "
        f"{report['config']['cold_start_s']:.0f} s)"
    )
    fig.tight_layout()
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=90)
    plt.close(fig)
    return True


def main(argv: Sequence[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m sluice.bench.autoscale", description=__doc__.split("\n")[0])
    defaults = Config()
    p.add_argument("--seed", type=int, default=defaults.seed)
    p.add_argument(
        "--day-s", type=float, default=defaults.day_s, help="a day compressed into this many seconds"
    )
    p.add_argument("--peak-rps", type=float, default=defaults.peak_rps)
    p.add_argument("--burst-factor", type=float, default=defaults.burst_factor)
    p.add_argument("--cold-start-s", type=float, default=defaults.cold_start_s)
    p.add_argument("--poll-s", type=float, default=defaults.poll_s)
    p.add_argument("--down-window-s", type=float, default=defaults.down_window_s)
    p.add_argument("--scrape-lag-s", type=float, default=defaults.scrape_lag_s)
    p.add_argument("--signal-down-window-s", type=float, default=defaults.signal_down_window_s)
    p.add_argument("--headroom", type=float, default=defaults.headroom)
    p.add_argument("--json", type=Path, help="write the whole report (with timelines) here")
    p.add_argument("--plot", type=Path, help="write the plot (PNG) here")
    args = p.parse_args(argv)
    config = Config(
        seed=args.seed,
        day_s=args.day_s,
        peak_rps=args.peak_rps,
        burst_factor=args.burst_factor,
        cold_start_s=args.cold_start_s,
        poll_s=args.poll_s,
        down_window_s=args.down_window_s,
        signal_down_window_s=args.signal_down_window_s,
        scrape_lag_s=args.scrape_lag_s,
        headroom=args.headroom,
    )
    report = run(config)
    print(
        f"peak-sized fleet: {report['peak_fleet']} engines "
        f"({report['engine_rps']} requests/s each at full batch)"
    )
    print(table(report))
    if args.json:
        args.json.write_text(json.dumps(report))
    if args.plot and not plot(report, args.plot):
        print("matplotlib is missing (pip install 'sluice[bench]'): no plot", file=sys.stderr)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
