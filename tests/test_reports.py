"""A process's report: its samples, collected from the reported families' metrics alone, say what
collecting the whole registry and keeping those families says, in the same order."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

from prometheus_client.core import GaugeMetricFamily, Metric

from sluice.metrics import Metrics
from sluice.reports import GATEWAY_FAMILIES, WORKER_FAMILIES, metric_samples


def whole_registry(metrics: Metrics, families: frozenset[str]) -> list[list[Any]]:
    return [
        [s.name, dict(s.labels), float(s.value)]
        for family in metrics.registry.collect()
        if family.name in families
        for s in family.samples
        if not s.name.endswith("_created")
    ]


class Collected:
    """A collector without a describe, as the fleet's is (:class:`FleetCollector`): counts its
    collections."""

    def __init__(self, name: str = "sluice_backend_inflight") -> None:
        self.name = name
        self.collections = 0

    def describe(self) -> list[Metric]:
        return []

    def collect(self) -> Iterator[Metric]:
        self.collections += 1
        family = GaugeMetricFamily(self.name, "a gauge of the fleet's", labels=["backend"])
        family.add_metric(["a"], 1.0)
        yield family


def test_samples_come_from_the_reported_metrics_alone() -> None:
    metrics = Metrics()
    fleet = Collected()
    metrics.registry.register(fleet)
    metrics.admissions.labels("admitted", "").inc(3)
    metrics.admissions.labels("refused", "queue_full").inc()
    metrics.retry_after.labels("queue_full").observe(2.5)
    metrics.jobs.labels("m", "succeeded").inc(2)
    metrics.queue_wait.labels("m").observe(0.03)
    metrics.tokens.labels("m").inc(8)
    metrics.queued_jobs.labels("m").set(4)  # a gauge: no family reported
    for families in (GATEWAY_FAMILIES, WORKER_FAMILIES, frozenset({"sluice_jobs"})):
        for _ in range(2):  # found at the first, reused at the second
            assert metric_samples(metrics, families) == whole_registry(metrics, families)
            assert metric_samples(metrics, set(families)) == whole_registry(metrics, families)
    samples = metric_samples(metrics, WORKER_FAMILIES)
    assert ["sluice_jobs_total", {"model": "m", "status": "succeeded"}, 2.0] in samples
    assert not any(name.endswith("_created") for name, _, _ in samples)
    before = fleet.collections
    metric_samples(metrics, GATEWAY_FAMILIES)
    assert fleet.collections == before  # the fleet's collector is not collected for a report


def test_a_family_registered_otherwise_is_still_reported() -> None:
    metrics = Metrics()
    metrics.registry.register(Collected("sluice_extra"))
    families = frozenset({"sluice_jobs", "sluice_extra"})
    metrics.jobs.labels("m", "failed").inc()
    assert metric_samples(metrics, families) == whole_registry(metrics, families)
    assert ["sluice_extra", {"backend": "a"}, 1.0] in metric_samples(metrics, families)
