from __future__ import annotations

import dataclasses
import math
import random

import pytest

from sluice.core import capacity
from sluice.core.capacity import DrainRate


def test_prior_until_measured() -> None:
    d = DrainRate(prior_per_slot=40, slots=2)
    assert not d.measured and d.rate == 80


def test_ewma_follows_load() -> None:
    d = DrainRate(slots=4, alpha=2.0, weigh_per_slot=True)  # 0.5 a job, per slot of the four
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


def test_the_moving_averages_weigh_a_job_per_slot() -> None:
    """On 64 slots one finished job is 1/64 of a batch: a job twice as fast moves the rate by a
    sixty-fourth of what it moves a single slot's."""
    one, many = DrainRate(slots=1, weigh_per_slot=True), DrainRate(slots=64, weigh_per_slot=True)
    for d in (one, many):
        d.observe(100, 1.0)
        d.observe(100, 0.5)
    assert one.slot_rate == pytest.approx(100 / (1 - 0.2 * 0.5), rel=1e-6)
    assert 100 < many.slot_rate < 100.5
    assert many.weight == pytest.approx(0.2 / 64)


def test_a_rate_learnt_at_light_load_is_a_full_batchs() -> None:
    """A job takes 1 s when a quarter of the slots are busy and 2 s when all are (the line
    t = 0.667 + 1.333 u per 100 cost units): after a spell of both, a run of light-load jobs still
    gives the full batch's rate and promise, since a queue only forms once every slot is busy."""
    d = DrainRate(slots=8, weigh_per_slot=True)
    for i in range(600):
        full = i % 2 == 0
        d.observe(100, 2.0 if full else 1.0, running=8 if full else 2)
    for _ in range(200):
        d.observe(100, 1.0, running=2)
    assert d.per_slot == pytest.approx(100, rel=0.05)  # as measured, at light load
    assert d.slowdown == pytest.approx(2.0, rel=0.15)
    assert d.slot_rate == pytest.approx(50, rel=0.15)  # a full batch's
    assert d.slow_service_s(100) >= 1.7


def test_no_slowdown_is_assumed_when_none_is_seen_or_told() -> None:
    told = DrainRate(slots=4)
    for i in range(300):
        told.observe(100, 1.0, running=1 + i % 4)  # as fast whatever the fill
    assert told.slowdown == pytest.approx(1.0, abs=0.02)
    untold = DrainRate(slots=4)
    for _ in range(50):
        untold.observe(100, 1.0)
    assert untold.slowdown == 1.0 and untold.fills == 0
    # A batch that seems to speed up as it fills is not believed: never faster than measured.
    faster = DrainRate(slots=4)
    for i in range(300):
        faster.observe(100, 2.0 if i % 2 else 1.0, running=1 if i % 2 else 4)
    assert faster.slowdown == 1.0


def test_a_promise_is_made_between_the_fitted_line_and_the_most_a_full_batch_can_slow() -> None:
    """Measured at a quarter's fill and as fast whatever the fill, the line says no slowdown; a
    batch can at most drain no faster in all than that quarter did (a slowdown of 4). Where the
    jobs' times spread (a burst's first finishers in a full batch are then its short ones, which
    flatten the line), the wait is promised part of the way toward that bound, the more the more
    they spread; where every job takes the same, or the rate was measured at a full batch, the
    promise is the line's."""
    # the spread's part alone (the fill gap's: the next tests)
    even = DrainRate(slots=8, weigh_per_slot=True, fill_gap_share=0.0)
    spread = DrainRate(slots=8, weigh_per_slot=True, fill_gap_share=0.0)
    for i in range(600):
        even.observe(100, 1.0, running=1 + i % 3)  # fills of 1/8 to 3/8, as fast at each
        spread.observe(100, 0.1 if i % 4 else 3.7, running=1 + i % 3)  # the same mean, spread
    for d in (even, spread):
        assert d.slowdown == pytest.approx(1.0, abs=0.1)
        assert d.fill == pytest.approx(0.25, abs=0.03)
    assert even.spread < 0.05 and even.promise_slowdown == pytest.approx(even.slowdown, rel=0.05)
    assert spread.spread > 0.5
    share = min(0.5 * spread.spread, 1.0)  # capacity.EXTRAPOLATION_SHARE per unit of spread
    assert spread.promise_slowdown == pytest.approx(
        spread.slowdown * (4.0 / spread.slowdown) ** share, rel=0.02
    )
    assert 1.3 < spread.promise_slowdown <= 4.0
    full = DrainRate(slots=8, weigh_per_slot=True)
    for i in range(600):
        full.observe(100, 0.1 if i % 4 else 3.7, running=8)
    assert full.promise_slowdown == pytest.approx(full.slowdown)
    # Never told a fill: nothing to extrapolate from, as before.
    untold = DrainRate(slots=8)
    untold.observe(100, 1.0)
    assert untold.promise_slowdown == 1.0


def test_a_promised_wait_leaves_room_for_the_rates_error() -> None:
    """The rate is a mean of about 2 / weight jobs: on 4 slots with answers that vary a lot, the
    promised wait is well above the mean; on 64 slots, or with answers that never vary, near it."""
    few, many, same = (DrainRate(slots=n, weigh_per_slot=True) for n in (4, 64, 4))
    for i in range(3000):
        spread = 0.2 if i % 2 else 1.8  # the same cost, a time that varies ninefold
        few.observe(100, spread, running=4)
        many.observe(100, spread, running=64)
        same.observe(100, 1.0, running=4)
    assert few.wait_margin > 1.1  # 1 + 2 * (1.8 / 1.0 - 1) / 2 / sqrt(39)
    assert 1.0 < many.wait_margin < 1 + (few.wait_margin - 1) / 3
    assert same.wait_margin == pytest.approx(1.0, abs=0.01)
    assert few.promised_wait_s(1000) == pytest.approx(1000 / few.promise_rate)
    assert few.promised_wait_s(1000) > few.wait_s(1000) * few.wait_margin * 0.99
    assert DrainRate(slots=4).wait_margin == 1.0  # nothing measured: the prior, as it was


def test_a_wait_behind_few_jobs_leaves_room_for_their_own_spread() -> None:
    """The jobs queued ahead are a sample too: behind k of them the margin adds their mean's error
    (variance residual_spread² / k) to the rate's. Behind a long queue it is the rate's error
    alone; behind few it is wider; where every job takes the same there is none either way. An
    admission passes down the slowdown it read once, and the promise is the same as when the rate
    reads it."""
    spread, same = (DrainRate(slots=4, weigh_per_slot=True) for _ in range(2))
    for i in range(3000):
        spread.observe(100, 0.2 if i % 2 else 1.8, running=4)
        same.observe(100, 1.0, running=4)
    rate_error = spread.wait_margin - 1.0
    jobs = min(spread.samples, (2.0 - spread.weight) / spread.weight)
    own = 2.0 * spread.residual_spread  # capacity.WAIT_MARGIN_Z standard deviations of one job
    for k in (1, 10, 100):
        margin = spread.batch_rate / spread.promise_rate_behind(k) - 1.0
        assert margin == pytest.approx(math.sqrt(rate_error**2 + own**2 / k), rel=1e-6)
    assert rate_error == pytest.approx(2.0 * spread.spread / math.sqrt(jobs), rel=1e-9)
    assert spread.promise_rate_behind(1) < spread.promise_rate_behind(100) < spread.promise_rate
    assert spread.promise_rate_behind(0) == spread.promise_rate  # no jobs ahead: no such term
    assert spread.promise_rate_behind(10_000) == pytest.approx(spread.promise_rate, rel=0.01)
    assert same.promise_rate_behind(1) == pytest.approx(same.batch_rate, rel=0.02)
    assert spread.promised_wait_s(1000, 10) == pytest.approx(1000 / spread.promise_rate_behind(10))
    slowdown = spread.slowdown
    assert spread.promised_wait_s(1000, 10, slowdown=slowdown) == spread.promised_wait_s(1000, 10)
    assert spread.wait_s(1000, slowdown=slowdown) == spread.wait_s(1000)
    assert spread.slow_service_s(100, slowdown=slowdown) == spread.slow_service_s(100)


def test_the_promises_constants_are_the_rates_own() -> None:
    """A what-if of the promise's constants is a rate made with them, not the module's changed:
    at 0 the promise is the mean at the fitted line, and the default rate is unchanged beside it."""
    plain, flat = (
        DrainRate(slots=8, weigh_per_slot=True),
        DrainRate(
            slots=8, weigh_per_slot=True, extrapolation_share=0.0, wait_margin_z=0.0, fill_gap_share=0.0
        ),
    )
    for i in range(600):
        for d in (plain, flat):
            d.observe(100, 0.1 if i % 4 else 3.7, running=1 + i % 3)
    assert flat.promise_rate_behind(5) == pytest.approx(flat.rate)
    assert plain.promise_rate_behind(5) < 0.7 * plain.rate


def test_the_jobs_aheads_margin_is_the_predictions_measured_error_not_a_quantiles() -> None:
    """The margin for the jobs ahead is how far a job's time strays from what its cost predicts,
    measured (the residual's root mean square over the mean time), not read off the 95th
    percentile of the time per cost unit as two standard deviations above the mean. One job in 25
    taking 20 times the others' time lies above that percentile, which then says no spread, though
    a wait behind such jobs strays by twice its mean. And where prompts of ~250 tokens vary
    (lognormal, sigma 1) in front of long-tailed answers of at most 64 (seed 7 of the policy
    model's family), the percentile lies in the corner of short prompts with long answers, and
    reads far more spread than a wait predicted from the cost queued ahead strays by."""
    rare = DrainRate(slots=4, weigh_per_slot=True)
    for i in range(3000):
        rare.observe(100, 20.0 if i % 25 == 0 else 1.0, running=4)
    assert rare.spread == 0.0
    assert rare.residual_spread > 1.5  # sqrt(24 * 0.76² + 18.24²) / 5 / 1.76 = 2.2, as the EWMA lands
    assert rare.batch_rate / rare.promise_rate_behind(10) > 1.0 + 2 * 1.5 / math.sqrt(10)
    varied = DrainRate(slots=4, weigh_per_slot=True)
    rng = random.Random(7)
    read: list[tuple[float, float]] = []  # each a snapshot of some 40 jobs: their mean over many
    for i in range(8000):
        prompt = min(int(246 * math.exp(rng.gauss(0, 0.98))), 8 * 246)
        answer = max(1, min(64, int(15 * math.exp(rng.gauss(0, 0.72)))))
        varied.observe(prompt + 64, 0.03 * answer, running=4)
        if i >= 2000:
            read.append((varied.spread, varied.residual_spread))
    per_cost, residual = (sum(r[k] for r in read) / len(read) for k in (0, 1))
    assert per_cost > 1.5 and residual < 0.7 * per_cost
    # The promise's slowdown, and the rate the Retry-After book spreads over, read the percentile's
    # spread as before: only the wait's margin changed.
    assert varied.batch_rate == pytest.approx(varied._batch_rate(varied.spread, varied.slowdown))


def test_the_residual_spread_is_a_service_times_around_what_its_cost_predicts() -> None:
    """One cost, times of 1 s and 3 s in turn: the rate predicts 2 s, each job strays by 1 s, half
    the mean (a residual spread of 0.5). Before a second job has finished there is no residual, and
    the margin reads the spread per cost unit as it did before (a state kept without the field
    reads the same)."""
    d = DrainRate(slots=1, weigh_per_slot=True, alpha=0.02)
    d.observe(100, 1.0)
    assert d.resid == 0.0 and d.residual_spread == d.spread
    for i in range(3000):
        d.observe(100, 3.0 if i % 2 == 0 else 1.0)
    assert d.residual_spread == pytest.approx(0.5, rel=0.1)
    jobs = min(d.samples, (2.0 - d.weight) / d.weight)
    behind_one = d.batch_rate / d.promise_rate_behind(1)
    assert behind_one == pytest.approx(
        1 + 2.0 * math.sqrt(d.spread**2 / jobs + d.residual_spread**2), rel=1e-9
    )
    kept_without = DrainRate(slots=1, per_slot=d.per_slot, samples=d.samples, service=d.service, slow=d.slow)
    assert kept_without.residual_spread == kept_without.spread


def test_an_extrapolation_floor_moves_an_even_promise_part_of_the_way_to_its_bound() -> None:
    """``extrapolation_floor`` (a what-if of the policy model, 0 for the brokers): where every job
    takes the same the promise follows the line (no spread, no extrapolation); with a floor it goes
    that share of the way toward the bound (1 / fill) all the same, on a log scale; where the
    spread asks for more than the floor, the spread decides."""
    even = DrainRate(slots=8, weigh_per_slot=True, fill_gap_share=0.0)
    floored = DrainRate(slots=8, weigh_per_slot=True, extrapolation_floor=0.25, fill_gap_share=0.0)
    spread = DrainRate(slots=8, weigh_per_slot=True, extrapolation_floor=0.25, fill_gap_share=0.0)
    for i in range(600):
        even.observe(100, 1.0, running=1 + i % 3)
        floored.observe(100, 1.0, running=1 + i % 3)
        spread.observe(100, 0.1 if i % 4 else 3.7, running=1 + i % 3)
    assert floored.spread < 0.05
    assert even.promise_slowdown == pytest.approx(even.slowdown, rel=0.05)
    bound = 1.0 / floored.fill
    assert floored.promise_slowdown == pytest.approx(
        floored.slowdown * (bound / floored.slowdown) ** 0.25, rel=1e-9
    )
    assert floored.promise_slowdown > 1.3 * even.promise_slowdown
    share = min(0.5 * spread.spread, 1.0)
    assert share > 0.25
    assert spread.promise_slowdown == pytest.approx(
        spread.slowdown * (min(1.0 / spread.fill, 4.0) / spread.slowdown) ** share, rel=1e-9
    )


def test_a_promise_goes_toward_its_bound_for_the_fills_never_measured() -> None:
    """The line is measured only up to the fills seen (their mean plus FILL_GAP_SD standard
    deviations): where every job takes the same at fills of 1/8 to 3/8 (the line flat), the promise
    goes FILL_GAP_SHARE of the way to the bound per unit of fill beyond them, on a log scale; where
    the fills seen reach a full batch, the line is followed; and where the spread asks for more,
    the spread decides (the larger of the two shares)."""
    low, wide, spread = (DrainRate(slots=8, weigh_per_slot=True) for _ in range(3))
    for i in range(600):
        low.observe(100, 1.0, running=1 + i % 3)  # fills of 1/8 to 3/8
        wide.observe(100, 1.0, running=1 + i % 8)  # fills of 1/8 to 8/8
        spread.observe(100, 0.1 if i % 4 else 3.7, running=1 + i % 3)
    assert (low.fill_gap_share, low.fill_gap_sd) == (capacity.FILL_GAP_SHARE, capacity.FILL_GAP_SD)
    sd = math.sqrt(low.fit_uu - low.fit_u**2)
    gap = 1.0 - low.fit_u - capacity.FILL_GAP_SD * sd
    assert 0.5 < gap < 0.6  # measured up to ~0.45 of a full batch
    assert low.spread < 0.05 and low.slowdown == pytest.approx(1.0, abs=0.01)
    bound = min(1.0 / low.fill, capacity.MAX_FILL_SLOWDOWN)
    assert low.promise_slowdown == pytest.approx(
        low.slowdown * (bound / low.slowdown) ** (capacity.FILL_GAP_SHARE * gap), rel=1e-9
    )
    assert low.promise_slowdown > 1.3  # a wait promised at most 1 / 1.3 of the line's rate
    assert low.batch_rate < low.rate / 1.3
    # fills seen up to a full batch: nothing beyond them to guess
    assert 1.0 - wide.fit_u - capacity.FILL_GAP_SD * math.sqrt(wide.fit_uu - wide.fit_u**2) < 0
    assert wide.promise_slowdown == pytest.approx(wide.slowdown, rel=0.02)
    # the spread's share is larger here: it decides, as without the gap
    share = min(capacity.EXTRAPOLATION_SHARE * spread.spread, 1.0)
    assert share > capacity.FILL_GAP_SHARE * gap
    assert spread.promise_slowdown == pytest.approx(
        spread.slowdown * (min(1.0 / spread.fill, 4.0) / spread.slowdown) ** share, rel=1e-9
    )
    # off, the rule before it: the line
    off = DrainRate(slots=8, weigh_per_slot=True, fill_gap_share=0.0)
    for i in range(600):
        off.observe(100, 1.0, running=1 + i % 3)
    assert off.promise_slowdown == pytest.approx(
        off.slowdown * (bound / off.slowdown) ** (capacity.EXTRAPOLATION_SHARE * off.spread), rel=1e-9
    )
    assert off.promise_slowdown < 1.01 < 1.3 < low.promise_slowdown


def test_a_promise_leaves_room_for_the_slope_a_few_noisy_fills_leave_unknown() -> None:
    """``slope_z`` (a what-if of the policy model, 0 for the brokers): where a few dozen jobs with
    answers that stop early were measured in a narrow band of fills, the line reads flat and the
    spread's share is small, but the slope is unknown to within its own size: the promise goes at
    least to the line at its slope plus ``slope_z`` standard errors (within the bound, 1 / fill);
    with many jobs measured over wide fills that adds nothing, and at 0 it is the rule without it."""
    rng = random.Random(3)
    few = [DrainRate(slots=5, weigh_per_slot=True, slope_z=z) for z in (0.0, 2.0)]
    for _ in range(37):
        running = rng.choice([2, 3, 3, 3, 4])
        per = rng.expovariate(1.0)  # an answer that stops early: no slope to read in the noise
        for d in few:
            d.observe(100, per, running=running)
    off, on = few
    assert off.promise_slowdown < on.promise_slowdown <= min(1.0 / on.fill, capacity.MAX_FILL_SLOWDOWN)
    # slope_residual is read only with slope_z: at 0 (the brokers') it changes nothing; on (below
    # the bound) it reads the larger residual_spread here, not spread, so it promises more
    assert dataclasses.replace(off, slope_residual=True).promise_slowdown == off.promise_slowdown
    assert off.residual_spread > off.spread
    one = dataclasses.replace(on, slope_z=1.0)
    residual = dataclasses.replace(one, slope_residual=True)
    assert one.promise_slowdown < residual.promise_slowdown < 1.0 / one.fill
    assert on.promise_slowdown > 1.3 > off.slowdown
    many = [DrainRate(slots=8, weigh_per_slot=True, slope_z=z) for z in (0.0, 2.0)]
    for i in range(2000):
        for d in many:
            d.observe(100, 1.0 + 0.5 * (1 + i % 8) / 8, running=1 + i % 8)
    assert many[1].promise_slowdown == pytest.approx(many[0].promise_slowdown, rel=0.02)
