"""The metrics a gateway exports from what the broker counts."""

from __future__ import annotations

import prometheus_client
import prometheus_client.values
import pytest
from prometheus_client import generate_latest

import sluice.metrics as metrics_module
from sluice.bench.load import parse_prometheus
from sluice.broker.base import ModelStats
from sluice.core.job import Endpoint, Job, JobState
from sluice.metrics import Metrics


def _stats(broken: int) -> dict[str, ModelStats]:
    return {"m": ModelStats(0, 0, 0, 4, 100.0, True, broken)}


def test_broken_promises_follow_the_brokers_count() -> None:
    metrics = Metrics()
    values = []
    for broken in (0, 2, 2, 5, 1, 3):  # the broker's count (1: its state began again)
        metrics.update_queues(_stats(broken))
        values.append(
            parse_prometheus(generate_latest(metrics.registry).decode())[
                'sluice_broken_promises_total{model="m"}'
            ]
        )
    # A counter: it rises by what the broker's count rose, and never falls.
    assert values == [0, 2, 2, 5, 5, 7]


def test_every_scaling_gauge_is_documented() -> None:
    """docs/autoscaling.md names every gauge the scaling signal sets, with its labels."""
    from pathlib import Path

    doc = (Path(__file__).resolve().parents[1] / "docs" / "autoscaling.md").read_text()
    metrics = Metrics()
    gauges = [
        metrics.desired_engines,
        metrics.pool_desired_engines,
        metrics.engines,
        metrics.queued_jobs,
        metrics.queued_tokens,
        metrics.running_jobs,
        metrics.oldest_queued_age,
        metrics.predicted_wait,
        metrics.arrival_rate,
        metrics.capacity,
        metrics.engine_capacity,
        metrics.deadlines_at_risk,
    ]
    for gauge in gauges:
        name = gauge._name
        assert f"`{name}`" in doc, name
        row = next(line for line in doc.splitlines() if line.startswith(f"| `{name}`"))
        for label in gauge._labelnames:
            assert f"`{label}`" in row, (name, label)


def _finished(model: str, state: str, *, started: bool, token: bool, usage: object) -> Job:
    job = Job("job_x", model, Endpoint.CHAT, {}, "t", "normal", 1, 8, created_at=100.0, deadline=200.0)
    job.state = JobState(state)
    job.started_at = 100.25 if started else None
    job.first_token_at = 100.5 if token else None
    job.usage = {"completion_tokens": usage} if usage is not None else None
    return job


def _reference(metrics: Metrics, job: Job) -> None:
    """What observe_job did before it kept its children: a labels() lookup for each observation."""
    metrics.jobs.labels(job.model, job.state.value).inc()
    if job.started_at is not None:
        metrics.queue_wait.labels(job.model).observe(max(job.started_at - job.created_at, 0))
    if job.first_token_at is not None:
        metrics.ttft.labels(job.model).observe(max(job.first_token_at - job.created_at, 0))
    if job.usage and isinstance(job.usage.get("completion_tokens"), int):
        metrics.tokens.labels(job.model).inc(job.usage["completion_tokens"])


def test_observe_job_exports_what_a_lookup_per_observation_did(monkeypatch: pytest.MonkeyPatch) -> None:
    """Kept children (a small bound, so the caches start again mid-way) export the same series and
    values, and no series for an observation never made (a job that never started has no wait)."""
    monkeypatch.setattr(metrics_module, "CHILDREN_MAX", 2)
    kept, looked_up = Metrics(), Metrics()
    jobs = [
        _finished(model, state, started=started, token=token, usage=usage)
        for model in ("a", "b", "c")
        for state, started, token, usage in (
            ("succeeded", True, True, 7),
            ("failed", False, False, None),
            ("succeeded", True, False, "7"),
            ("cancelled", True, True, 3),
        )
    ]
    jobs.append(_finished("d", "failed", started=False, token=False, usage=None))
    for job in jobs * 2:
        kept.observe_job(job)
        _reference(looked_up, job)
    assert _series(kept) == _series(looked_up)
    assert all(len(cache) <= 2 for cache in (kept._jobs_by, kept._queue_wait_by, kept._ttft_by))
    assert 'sluice_queue_wait_seconds_count{model="d"}' not in _series(kept)
    assert 'sluice_jobs_total{model="d",status="failed"} 2.0' in _series(kept)


@pytest.mark.parametrize("direct", [True, False])
def test_counted_children_export_what_inc_does(monkeypatch: pytest.MonkeyPatch, direct: bool) -> None:
    """Counted through their values (prometheus_client's layout, as the probe found it) or, where
    the probe fails, through inc(): the same series; a negative count still raises inc()'s error."""
    assert metrics_module._DIRECT  # the probe passes on the prometheus_client this project runs
    monkeypatch.setattr(metrics_module, "_DIRECT", direct)
    kept, looked_up = Metrics(), Metrics()
    for job in [_finished("a", "succeeded", started=True, token=True, usage=n) for n in (0, 5, True)]:
        kept.observe_job(job)
        _reference(looked_up, job)
    metrics_module.counted(kept.admissions.labels("refused", "queue_full")).inc(1)
    looked_up.admissions.labels("refused", "queue_full").inc()
    assert _series(kept) == _series(looked_up)
    assert 'sluice_completion_tokens_total{model="a"} 6.0' in _series(kept)
    with pytest.raises(ValueError):
        kept.observe_job(_finished("a", "succeeded", started=True, token=True, usage=-1))


def _series(metrics: Metrics) -> list[str]:
    """The exported lines, less the ``_created`` ones (when each child was made: they differ)."""
    lines = generate_latest(metrics.registry).decode().splitlines()
    return [line for line in lines if "_created" not in line]


@pytest.mark.parametrize("direct", [True, False])
def test_observed_children_export_what_observe_does(monkeypatch: pytest.MonkeyPatch, direct: bool) -> None:
    """Observed through their sum and buckets (the probe's layout) or through observe(): the same
    series for amounts on, between and past the bounds, negative, infinite, and NaN (in the sum,
    in no bucket, as observe() has it)."""
    assert metrics_module._OBSERVED_DIRECT  # the probe passes on the prometheus_client this project runs
    monkeypatch.setattr(metrics_module, "_OBSERVED_DIRECT", direct)
    kept, looked_up = Metrics(), Metrics()
    amounts = [0.0, -0.0, 0.005, 0.0051, 0.3, 1, 120, 121.5, -2.0, float("inf"), float("-inf"), 7]
    for amount in amounts:
        metrics_module.observed(kept.retry_after.labels("queue_full")).observe(amount)
        looked_up.retry_after.labels("queue_full").observe(amount)
    assert _series(kept) == _series(looked_up)
    nan = float("nan")
    metrics_module.observed(kept.ttft.labels("m")).observe(nan)
    looked_up.ttft.labels("m").observe(nan)
    assert _series(kept) == _series(looked_up)
    assert 'sluice_time_to_first_token_seconds_count{model="m"} 0.0' in _series(kept)
    assert isinstance(metrics_module.observed(kept.ttft.labels("m")), metrics_module._Observed) is direct


def test_a_wait_below_zero_is_observed_as_zero_and_a_nan_as_itself() -> None:
    # observe_job's conditional is max(w, 0)'s answer: 0 for a clock that stepped back, the
    # NaN itself (in the sum, no bucket), -0.0 as it came; each for the queue wait and the TTFT.
    kept, looked_up = Metrics(), Metrics()
    for started, first in ((-1.0, float("nan")), (-0.0, 0.5), (2.0, -3.0), (float("nan"), 1.0)):
        job = _finished("a", "succeeded", started=True, token=True, usage=1)
        job.started_at = job.created_at + started
        job.first_token_at = job.created_at + first
        kept.observe_job(job)
        _reference(looked_up, job)
    assert _series(kept) == _series(looked_up)
    assert 'sluice_queue_wait_seconds_bucket{le="0.005",model="a"} 2.0' in _series(kept)


def _observe_one_bucket_up(self: prometheus_client.Histogram, amount: float, exemplar: object = None) -> None:
    # An observe() of another rule (the bucket after the one the bound gives): the probe must see it.
    self._sum.inc(amount)
    bounds = self._upper_bounds
    index = next(i for i, bound in enumerate(bounds) if amount <= bound)
    self._buckets[min(index + 1, len(bounds) - 1)].inc(1)


class _OtherValue(prometheus_client.values.MutexValue):
    """A value of another class than MutexValue (as multiprocess mode's MmapedValue is)."""


@pytest.mark.parametrize(
    "layout",
    [
        ("delattr", "prometheus_client.values.MutexValue", None),
        ("setattr", "prometheus_client.values.ValueClass", _OtherValue),
        ("setattr", "prometheus_client.Histogram.observe", _observe_one_bucket_up),
    ],
    ids=["no MutexValue", "values of another class", "observe by another rule"],
)
def test_the_probe_falls_back_to_observe_where_the_layout_is_not_its_own(
    monkeypatch: pytest.MonkeyPatch, layout: tuple[str, str, object]
) -> None:
    """A prometheus_client whose private layout differs (an upgrade, multiprocess mode): the probe
    says so, so that observed() hands back the child and observe() is what counts."""
    assert metrics_module._observations_direct()
    how, target, value = layout
    if how == "delattr":
        monkeypatch.delattr(target)
    else:
        monkeypatch.setattr(target, value)
    assert not metrics_module._observations_direct()
