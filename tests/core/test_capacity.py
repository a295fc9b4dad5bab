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
