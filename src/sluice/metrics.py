"""Prometheus metrics, in a registry owned by the app (no module globals)."""

from __future__ import annotations

from bisect import bisect_left
from collections.abc import Callable
from typing import Any

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram

from sluice.broker.base import ModelStats
from sluice.core.job import Job

LATENCY_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2, 4, 8, 15, 30, 60, 120)
#: Retry-After runs from 0.5 s to 120 s (sluice.core.admission.clamp_retry_after)
RETRY_AFTER_BUCKETS = (0.5, 1, 2, 5, 10, 20, 30, 60, 120)
#: The most label sets :meth:`Metrics.observe_job` keeps the children of, per metric: a deployment
#: serves a few models and a job ends in one of a handful of states; past it a cache starts again.
CHILDREN_MAX = 1_000


def _values_direct() -> bool:
    """Whether a Counter's child keeps its count where :func:`counted` reads it (``_value``, whose
    ``inc`` adds): prometheus_client's private layout, checked once on a counter of its own, and
    an increment through it must show in the exposition. Where it does not, the public ``inc``."""
    try:
        registry = CollectorRegistry()
        child = Counter("sluice_probe", "", ["a"], registry=registry).labels("x")
        child._value.inc(2)
        return registry.get_sample_value("sluice_probe_total", {"a": "x"}) == 2.0
    except Exception:
        return False


_DIRECT = _values_direct()


def counted(child: Any) -> Any:
    """What a counter's child is counted through, by ``.inc(n)`` with n >= 0: its value itself where
    prometheus_client keeps it as :func:`_values_direct` found, so that an increment is one call
    and a lock, not three calls more (``inc``'s checks that a child of a labelled metric always
    passes, and its test for a negative amount); else the child."""
    return child._value if _DIRECT else child


def _observations_direct() -> bool:
    """Whether a Histogram's child keeps its sum and buckets where :class:`_Observed` reads them
    (``_sum`` and ``_buckets``, MutexValues with their ``_lock`` and ``_value``; ``_upper_bounds``
    ascending to +Inf): prometheus_client's private layout, checked once, as :func:`_values_direct`
    checks a counter's: observations made through it must read in the exposition as ``observe()``'s
    do. Where they do not, the public ``observe``."""
    try:
        # Imported here, not at the top: a private module that an upgrade may move or rename must
        # cost only this way (the probe fails, observe() is used), never the import of metrics.
        from prometheus_client.values import MutexValue

        registries, children = [], []
        for _ in range(2):
            registry = CollectorRegistry()
            histogram = Histogram("sluice_probe", "", ["a"], buckets=(0.5, 1.0), registry=registry)
            registries.append(registry)
            children.append(histogram.labels("x"))
        direct = _Observed(children[0])
        for amount in (0.25, 0.5, 0.75, 2.0, -1.0):
            direct.observe(amount)
            children[1].observe(amount)
        if not all(type(value) is MutexValue for value in (children[0]._sum, *children[0]._buckets)):
            return False
        # All but the children's creation times, which differ by the microseconds between them.
        samples = [
            [
                (s.name, s.labels, s.value)
                for m in r.collect()
                for s in m.samples
                if not s.name.endswith("_created")
            ]
            for r in registries
        ]
        return samples[0] == samples[1] and len(samples[0]) > 0
    except Exception:
        return False


class _Observed:
    """A Histogram child observed through its values: the sum, and the one bucket the amount falls
    in (the first bound it does not pass, as ``observe()``'s loop finds it, here by a bisection),
    each added under its own lock as ``MutexValue.inc`` adds: 4 calls an observation, where
    ``observe()`` makes 7 (sys.setprofile's call and c_call events, prometheus_client 0.26: its
    observability check, ``enumerate``, two ``inc``). A NaN, which ``observe()`` adds to the sum
    and to no bucket, goes through ``observe()``; an exemplar cannot be given here (observe the
    child itself for one)."""

    __slots__ = ("_bounds", "_buckets", "_child", "_sum")

    def __init__(self, child: Any) -> None:
        self._child = child
        self._sum = child._sum
        self._buckets = child._buckets
        self._bounds = child._upper_bounds

    def observe(self, amount: float) -> None:
        if amount != amount:  # NaN
            self._child.observe(amount)
            return
        total = self._sum
        with total._lock:
            total._value += amount
        bucket = self._buckets[bisect_left(self._bounds, amount)]
        with bucket._lock:
            bucket._value += 1


def observed(child: Any) -> Any:
    """What a histogram's child is observed through, by ``.observe(amount)``: an :class:`_Observed`
    where :func:`_observations_direct` found prometheus_client's layout, else the child."""
    return _Observed(child) if _OBSERVED_DIRECT else child


_OBSERVED_DIRECT = _observations_direct()


class Metrics:
    def __init__(self) -> None:
        self.registry = CollectorRegistry()
        r = self.registry
        self.admissions = Counter(
            "sluice_admissions", "Admission decisions by outcome and code", ["outcome", "code"], registry=r
        )
        self.client_retries = Counter(
            "sluice_client_retries",
            "Requests that clients marked as their retries (x-stainless-retry-count), by admission outcome",
            ["outcome"],
            registry=r,
        )
        self.jobs = Counter(
            "sluice_jobs", "Finished jobs by model and status", ["model", "status"], registry=r
        )
        self.queue_wait = Histogram(
            "sluice_queue_wait_seconds", "Admission to start", ["model"], buckets=LATENCY_BUCKETS, registry=r
        )
        self.ttft = Histogram(
            "sluice_time_to_first_token_seconds",
            "Admission to first token",
            ["model"],
            buckets=LATENCY_BUCKETS,
            registry=r,
        )
        self.tokens = Counter("sluice_completion_tokens", "Tokens generated", ["model"], registry=r)
        self.aborted = Counter("sluice_engine_aborts", "Generations aborted on the engine", registry=r)
        self.queued_jobs = Gauge("sluice_queued_jobs", "Jobs waiting", ["model"], registry=r)
        self.queued_tokens = Gauge("sluice_queued_tokens", "Cost (tokens) waiting", ["model"], registry=r)
        self.running_jobs = Gauge("sluice_running_jobs", "Jobs on engines", ["model"], registry=r)
        self.slots = Gauge("sluice_slots", "Engine slots serving the model", ["model"], registry=r)
        self.drain_rate = Gauge(
            "sluice_drain_rate_tokens_per_second", "Measured drain rate", ["model"], registry=r
        )
        # Counted by the broker (every gateway of a Redis queue reports the same total: take their
        # max, not their sum); this process follows it by the increments it sees.
        self.broken_promises = Counter(
            "sluice_broken_promises",
            "Jobs admitted that then ended past their deadline (deadline_exceeded), counted by the broker",
            ["model"],
            registry=r,
        )
        self._broken_seen: dict[str, int] = {}
        # observe_job's children per label values, each made on its first observation (as labels()
        # makes it): labels() takes a lock and builds its key on every call, for every finished job.
        self._jobs_by = _Children(self.jobs, counted)
        self._queue_wait_by = _Children(self.queue_wait, observed)
        self._ttft_by = _Children(self.ttft, observed)
        self._tokens_by = _Children(self.tokens, counted)
        # The scaling signal (sluice.scaling_signal; docs/autoscaling.md): every gateway computes it
        # from the shared broker state, so on Redis they all agree: scrape any one, or take the max.
        self.desired_engines = Gauge(
            "sluice_desired_engines",
            "Engines needed to serve the model's demand within its deadline objectives (with headroom "
            "and hysteresis)",
            ["model"],
            registry=r,
        )
        self.pool_desired_engines = Gauge(
            "sluice_pool_desired_engines",
            "Engines a pool needs: each model's desired engines split over the pools serving it, in "
            "proportion to their engines",
            ["pool"],
            registry=r,
        )
        self.engines = Gauge("sluice_engines", "Engines serving the model now", ["model"], registry=r)
        self.oldest_queued_age = Gauge(
            "sluice_oldest_queued_age_seconds",
            "Age of the oldest queued job (at most)",
            ["model"],
            registry=r,
        )
        self.predicted_wait = Gauge(
            "sluice_predicted_wait_seconds",
            "Wait a job queued now in the class would see: tokens queued at or above it over the capacity",
            ["model", "class"],
            registry=r,
        )
        self.arrival_rate = Gauge(
            "sluice_arrival_tokens_per_second",
            "Tokens (cost) arriving per second in the urgent classes, smoothed",
            ["model"],
            registry=r,
        )
        self.capacity = Gauge(
            "sluice_engine_capacity_tokens_per_second",
            "Tokens (cost) per second the engines serving the model drain together, as learned",
            ["model"],
            registry=r,
        )
        self.engine_capacity = Gauge(
            "sluice_engine_capacity_per_engine_tokens_per_second",
            "Tokens (cost) per second one engine drains, as learned (its slots times a slot's rate)",
            ["model", "engine"],
            registry=r,
        )
        self.deadlines_at_risk = Gauge(
            "sluice_deadlines_at_risk",
            "1 when the class's predicted wait exceeds its deadline objective, else 0",
            ["model", "class"],
            registry=r,
        )
        self.retry_after = Histogram(
            "sluice_retry_after_seconds",
            "Retry-After given with refusals, by code",
            ["code"],
            buckets=RETRY_AFTER_BUCKETS,
            registry=r,
        )

    def update_queues(self, stats: dict[str, ModelStats]) -> None:
        for model, s in stats.items():
            self.queued_jobs.labels(model).set(s.queued_jobs)
            self.queued_tokens.labels(model).set(s.queued_tokens)
            self.running_jobs.labels(model).set(s.running_jobs)
            self.slots.labels(model).set(s.slots)
            self.drain_rate.labels(model).set(s.drain_rate)
            seen, broken = self._broken_seen.get(model, 0), self.broken_promises.labels(model)
            if s.broken_promises > seen:
                broken.inc(s.broken_promises - seen)
            self._broken_seen[model] = s.broken_promises

    def observe_job(self, job: Job) -> None:
        model = job.model
        self._jobs_by[model, job.state.value].inc(1)
        # ``w if not w < 0 else 0``: max(w, 0) without its call (a NaN stays a NaN, -0.0 stays).
        if job.started_at is not None:
            wait = job.started_at - job.created_at
            self._queue_wait_by[model].observe(wait if not wait < 0 else 0)
        if job.first_token_at is not None:
            ttft = job.first_token_at - job.created_at
            self._ttft_by[model].observe(ttft if not ttft < 0 else 0)
        if job.usage and isinstance(tokens := job.usage.get("completion_tokens"), int):
            if tokens >= 0:
                self._tokens_by[model].inc(tokens)
            else:
                self.tokens.labels(model).inc(tokens)  # the ValueError it always raised


class _Children(dict[Any, Any]):
    """A metric's children by their label values (one value, or a tuple of them), each made by
    ``labels()`` on its first lookup; a lookup that finds one is a plain dict's, no call of
    Python's. Emptied when full (:data:`CHILDREN_MAX`), and made again as looked up."""

    def __init__(self, metric: Any, kept: Callable[[Any], Any] | None = None) -> None:
        super().__init__()
        self.metric = metric
        #: what is kept of a child (:func:`counted`); None: the child itself
        self.kept = kept

    def __missing__(self, key: Any) -> Any:
        if len(self) >= CHILDREN_MAX:
            self.clear()
        child = self.metric.labels(*key) if isinstance(key, tuple) else self.metric.labels(key)
        found = self[key] = child if self.kept is None else self.kept(child)
        return found
