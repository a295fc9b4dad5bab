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
