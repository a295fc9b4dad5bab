"""The metrics a gateway exports from what the broker counts."""

from __future__ import annotations

from prometheus_client import generate_latest

from sluice.bench.load import parse_prometheus
from sluice.broker.base import ModelStats
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
