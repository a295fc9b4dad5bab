from __future__ import annotations

import itertools
import math
import random

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

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

POLICY = ScalingPolicy(headroom=0.2, horizon_s=60.0)
#: 4 engines of 16 slots, 50 tokens/s a slot: 800 tokens/s an engine, 3200 in all
SUPPLY = Supply(engines=4, slots=64, slot_rate=50.0)


def demand(rate: float = 0.0, running: int = 0, **classes: int) -> Demand:
    queues = {name: ClassQueue(1 if tokens else 0, tokens) for name, tokens in classes.items()}
    return Demand(
        queued_jobs=sum(q.jobs for q in queues.values()),
        queued_tokens=sum(q.tokens for q in queues.values()),
        running_jobs=running,
        arrival_tokens_per_s=rate,
        classes=queues,
    )


def test_the_arrival_rate_with_headroom_sets_the_engines() -> None:
    a = assess(demand(rate=2000, running=40), SUPPLY, POLICY)
    assert a.per_engine_rate == pytest.approx(800)
    assert a.needed == pytest.approx(2000 * 1.2 / 800)
    assert a.raw_engines == 3
    assert a.capacity == pytest.approx(3200)


def test_a_premium_backlog_at_risk_asks_for_more_engines_than_serve() -> None:
    # 40 000 tokens of high work ahead: 12.5 s at 3200 tokens/s, over high's 10 s objective
    a = assess(demand(rate=2000, running=64, high=40_000), SUPPLY, POLICY)
    assert a.at_risk == {"high": True, "normal": False}  # normal may wait 60 s
    assert a.predicted_wait_s["high"] == pytest.approx(12.5)
    assert a.raw_engines > SUPPLY.engines
    # cleared within high's objective: (2000*1.2 + 40000/10*1.2)/800
    assert a.needed == pytest.approx((2400 + 4800) / 800)


def test_a_best_effort_backlog_alone_adds_no_engine() -> None:
    """The engines run full on the batch: their throughput reads as arrivals, held without headroom."""
    full = throughput(64, 64, 50.0)
    a = assess(demand(rate=full, running=64, low=10_000_000), SUPPLY, POLICY)
    assert a.raw_engines == SUPPLY.engines
    assert a.at_risk == {"high": False, "normal": False}
    assert a.predicted_wait_s["low"] > 3000
    # and with nothing running on a fleet scaled to zero, the batch still gets one engine
    idle = assess(demand(low=1000), Supply(0, 0, 50.0), POLICY)
    assert idle.raw_engines == POLICY.busy_floor


def test_no_demand_asks_for_the_minimum() -> None:
    assert assess(demand(), SUPPLY, POLICY).raw_engines == 0
    assert assess(demand(), SUPPLY, ScalingPolicy(min_engines=2)).raw_engines == 2
    capped = assess(demand(rate=1e9), SUPPLY, ScalingPolicy(max_engines=7))
    assert capped.raw_engines == 7


def test_scaled_to_zero_uses_the_last_engine_size_or_the_default() -> None:
    zero = Supply(engines=0, slots=0, slot_rate=50.0)
    assert assess(demand(rate=1600), zero, POLICY).per_engine_rate == pytest.approx(800)
    remembered = Supply(engines=0, slots=0, slot_rate=50.0, slots_per_engine=32)
    a = assess(demand(rate=1600, high=100), remembered, POLICY)
    assert a.per_engine_rate == pytest.approx(1600)
    assert a.predicted_wait_s["high"] == math.inf and a.at_risk["high"]


def test_unknown_queued_class_is_best_effort() -> None:
    a = assess(demand(bulk=5000), SUPPLY, POLICY)
    assert "bulk" in a.predicted_wait_s and "bulk" not in a.at_risk
    assert a.raw_engines == 1  # the busy floor only


def test_policy_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        ScalingPolicy(horizon_s=0)
    with pytest.raises(ValueError):
        ScalingPolicy(min_engines=3, max_engines=2)
    with pytest.raises(ValueError):
        ScalingPolicy(objectives=(ClassObjective("x", 0.0),))


amounts = st.integers(min_value=0, max_value=2_000_000)


@settings(max_examples=200, deadline=None)
@given(
    rate=st.floats(min_value=0, max_value=1e5),
    more_rate=st.floats(min_value=0, max_value=1e5),
    high=amounts,
    normal=amounts,
    low=amounts,
    more=amounts,
    which=st.sampled_from(["high", "normal", "low", "rate"]),
)
def test_monotone_in_demand(
    rate: float, more_rate: float, high: int, normal: int, low: int, more: int, which: str
) -> None:
    """More of any urgent demand never asks for fewer engines (best effort only when nothing else
    changes: its backlog turns headroom off, by design, but never below the engines it holds)."""
    base = demand(rate=rate, running=1, high=high, normal=normal, low=low)
    grown = {"high": high, "normal": normal, "low": low}
    new_rate = rate
    if which == "rate":
        new_rate = rate + more_rate
    else:
        grown[which] += more
    bigger = demand(rate=new_rate, running=1, **grown)
    a, b = assess(base, SUPPLY, POLICY), assess(bigger, SUPPLY, POLICY)
    if which == "low" and low == 0 and more > 0:
        assert b.raw_engines >= math.ceil(rate / 800 - 1e-9)
    else:
        assert b.raw_engines >= a.raw_engines
        assert all(b.predicted_wait_s[c] >= a.predicted_wait_s[c] for c in a.predicted_wait_s)


def test_stabiliser_goes_up_at_once_and_down_slowly() -> None:
    s = Stabiliser(ScalingPolicy(down_window_s=300, down_step=1, down_period_s=30))
    assert s.update(2, 0) == 2
    assert s.update(8, 15) == 8  # up at once
    assert s.update(9, 20, needed=8.5) == 8  # within the tolerance: no change
    assert s.update(9, 25, needed=8.9) == 9
    t = 30.0
    while t < 325:  # within the window of the 9, nothing goes
        assert s.update(3, t) == 9
        t += 15
    answers = []
    while t < 600:
        answers.append(s.update(3, t))
        t += 15
    assert answers[-1] == 3
    # one engine per 30 s at most
    drops = [x - y for x, y in itertools.pairwise(answers) if y < x]
    assert drops and max(drops) == 1


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_no_flapping_on_steady_noisy_input(seed: int) -> None:
    """Arrivals at a steady mean with 15 % noise, read every 15 s for two hours: after the first
    window, the answer changes at most twice."""
    rng = random.Random(seed)
    policy = ScalingPolicy()
    s, est = Stabiliser(policy), ArrivalEstimator(tau_s=30)
    answers = []
    for i in range(480):
        now = i * 15.0
        served = 4000 * (1 + rng.gauss(0, 0.15))
        rate = est.observe(now, rng.randint(0, 3000), served)
        a = assess(demand(rate=rate, running=50, high=rng.randint(0, 3000)), SUPPLY, policy)
        answers.append(s.update(a.raw_engines, now, a.needed))
    settled = answers[40:]
    changes = sum(1 for x, y in itertools.pairwise(settled) if x != y)
    assert changes <= 2
    assert 5 <= settled[-1] <= 9  # 4000 tokens/s x 1.2 / 800 = 6, plus the noise's peaks


def test_arrival_estimator_counts_service_and_growth() -> None:
    est = ArrivalEstimator(tau_s=1e-6)  # no smoothing: each reading as it is
    assert est.observe(0, 0, 1000) == pytest.approx(1000)
    assert est.observe(10, 5000, 1000) == pytest.approx(1500)  # +500 tokens/s queued
    assert est.observe(20, 0, 1000) == pytest.approx(500)  # the queue drained
    assert est.observe(20, 0, 1000) == pytest.approx(500)  # no time passed: unchanged
    assert est.observe(30, 0, 0) == 0.0  # never negative
    slow = ArrivalEstimator(tau_s=30)
    slow.observe(0, 0, 0)
    assert 0 < slow.observe(30, 0, 1000) < 1000


def test_urgent_tokens_skip_best_effort_classes() -> None:
    classes = {"high": ClassQueue(1, 10), "normal": ClassQueue(1, 20), "low": ClassQueue(1, 40)}
    assert urgent_tokens(classes, POLICY.objectives) == 30


def test_pools_split_a_models_engines_in_proportion_and_sum_their_models() -> None:
    from sluice.core.scaling import pool_shares, split_by_pool

    assert pool_shares({"h100": 3, "a10": 1, "empty": 0}) == {"h100": 0.75, "a10": 0.25}
    assert pool_shares({"x": 0}) == {}
    shares = {"qwen": {"h100": 0.75, "a10": 0.25}, "llama": {"a10": 1.0}}
    assert split_by_pool({"qwen": 6, "llama": 2, "unknown": 4}, shares) == {"h100": 5, "a10": 4}
    assert split_by_pool({"qwen": 0}, shares) == {"h100": 0, "a10": 0}
