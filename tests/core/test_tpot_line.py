"""TpotLine on its own: the line it fits, when it declines to fit one, and how it forgets."""

from __future__ import annotations

import copy

import pytest

from sluice.core.tpot_line import CHANGE_MIN_COUNT, TpotLine


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def _fed(line: TpotLine, clock: Clock, points: dict[int, float], times: int = 1) -> None:
    for _ in range(times):
        for n, tpot in points.items():
            clock.now += 0.1
            line.fold(n, tpot, clock.now)


def test_no_line_from_too_narrow_a_span() -> None:
    clock = Clock()
    line = TpotLine(60.0, clock)
    assert line.fit() is None
    _fed(line, clock, {4: 0.02, 5: 0.021})  # one in-flight apart: no slope to trust
    assert line.fit() is None


def test_the_fit_recovers_a_straight_line() -> None:
    clock = Clock()
    line = TpotLine(60.0, clock)
    _fed(line, clock, {n: 0.01 + 0.001 * n for n in (1, 4, 8, 16)}, times=3)
    fit = line.fit()
    assert fit is not None
    assert fit.a == pytest.approx(0.01, rel=1e-6) and fit.b == pytest.approx(0.001, rel=1e-6)
    assert fit.at(32) == pytest.approx(0.042, rel=1e-6)
    # elasticity b*n / (a + b*n): at 10 in flight, half of a token's time is the batch's
    assert fit.elasticity(10) == pytest.approx(0.5, rel=1e-6)


def test_a_line_through_zero_keeps_a_positive_intercept() -> None:
    clock = Clock()
    line = TpotLine(60.0, clock)
    _fed(line, clock, {2: 0.0, 4: 0.02, 8: 0.06}, times=3)  # least squares crosses below zero
    fit = line.fit()
    assert fit is not None and fit.a > 0 and fit.b >= 0


def test_stale_buckets_leave_the_fit() -> None:
    clock = Clock()
    line = TpotLine(10.0, clock)
    _fed(line, clock, {1: 0.01, 8: 0.02})
    assert line.fit() is not None
    clock.now += 11.0  # both buckets older than memory_s
    assert line.fit() is None


def test_a_bucket_far_from_the_line_drops_the_others() -> None:
    """The engine changed under the line (another tenant on the GPU): what it was fitted on no
    longer holds, so only the bucket that showed it is kept."""
    clock = Clock()
    line = TpotLine(60.0, clock)
    _fed(line, clock, {1: 0.01, 8: 0.017, 16: 0.025}, times=CHANGE_MIN_COUNT)
    assert line.fit() is not None
    _fed(line, clock, {8: 0.1}, times=CHANGE_MIN_COUNT * 2)  # 8 in flight now runs ~5x slower
    assert line.fit() is None  # one bucket left: no line until more in-flight counts come


def _fresh_fit(line: TpotLine, now: float) -> tuple[float, float] | None:
    """The fit made afresh, nothing reused: a new TpotLine, which keeps no fit yet, on copies of
    ``line``'s buckets (so that asking it leaves ``line``'s kept fit as it was), asked at ``now``."""
    fresh = TpotLine(line._memory_s, lambda: now)
    fresh._buckets = copy.deepcopy(line._buckets)
    got = fresh.fit()
    return None if got is None else (got.a, got.b)


def test_the_kept_fit_is_the_fresh_fit() -> None:
    """The fit is kept between samples; at every step, folds and clock jumps past ``memory_s``
    (buckets going stale one by one) among them, it equals to the bit one made afresh."""
    import random

    rng = random.Random(7)
    clock = Clock()
    line = TpotLine(5.0, clock)
    fitted = 0
    for step in range(3000):
        clock.now += rng.choice((0.0, 0.01, 0.3, 1.0, 2.5)) if step % 50 else 6.0
        if rng.random() < 0.7:
            n = rng.randint(1, 40)
            line.fold(n, 0.01 + 0.0005 * n * rng.uniform(0.8, 1.2), clock.now)
        for _ in range(rng.randint(0, 2)):  # asked again, as the limit asks after each sample
            got = line.fit()
            want = _fresh_fit(line, clock.now)
            assert (None if got is None else (got.a, got.b)) == want
            fitted += got is not None
    assert fitted > 500  # the comparison met lines, not only Nones
