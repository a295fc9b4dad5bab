from __future__ import annotations

import pytest

from sluice.core.capacity import DrainRate


def test_prior_until_measured() -> None:
    d = DrainRate(prior_per_slot=40, slots=2)
    assert not d.measured and d.rate == 80


def test_ewma_follows_load() -> None:
    d = DrainRate(slots=4, alpha=0.5)
    d.observe(200, 1.0)
    assert d.rate == pytest.approx(800)
    d.observe(100, 1.0)
    assert d.slot_rate == pytest.approx(150)
    assert d.service_s(300) == pytest.approx(2.0)
    assert d.wait_s(600) == pytest.approx(1.0)


def test_ignores_degenerate_samples_and_never_divides_by_zero() -> None:
    d = DrainRate(slots=0)
    d.observe(0, 1.0)
    d.observe(10, 0.0)
    assert not d.measured and d.rate > 0


def test_a_slots_rate_is_a_ratio_of_averages_not_an_average_of_ratios() -> None:
    """Half the answers stop at a tenth of their max_tokens: the queue drains at the cost of all
    over the time of all, not at the mean of each job's cost per second (5.5 times too fast)."""
    d = DrainRate(slots=1, alpha=0.05)
    for i in range(400):
        d.observe(100, 0.1 if i % 2 else 1.0)
    assert d.slot_rate == pytest.approx(200 / 1.1, rel=0.05)


def test_a_job_is_promised_as_slow_as_most_jobs_have_been() -> None:
    d = DrainRate(slots=4)
    # Per cost unit, one job in five took 4 times the others' time.
    for i in range(500):
        d.observe(100, 4.0 if i % 5 == 0 else 1.0)
    assert 3.0 <= d.slow_service_s(100) <= 4.5  # about the slow ones' time
    assert d.slow_service_s(100) > d.service_s(100)
    # Before any measurement, the mean at the prior rate.
    assert DrainRate(prior_per_slot=10).slow_service_s(100) == pytest.approx(10.0)
    # Never below the mean: after a run of fast jobs the quantile comes down, not under the mean.
    for _ in range(2000):
        d.observe(100, 0.5)
    assert d.slow_service_s(100) >= d.service_s(100)
