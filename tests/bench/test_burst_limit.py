"""The what-if of codel's burst limit counted as the promise counts (bench/burst_limit.py)."""

from __future__ import annotations

import dataclasses

from sluice.bench.burst_limit import PromiseTermsCoDel, promise_ratio
from sluice.bench.engine_family import draw_engine, saturated
from sluice.bench.policy_model import loads, run
from sluice.core.capacity import DrainRate
from sluice.core.policy import CoDelPolicy, PolicyState


def _spike(seed: int, policy: CoDelPolicy) -> tuple[float, int, int]:
    engine = draw_engine(seed)
    answers_s, _, full_rate = saturated(engine)
    r = run(
        policy, loads(answers_s)["spike 0.55x-5.5x"], seed, engine=engine, retriers=0.1, full_rate=full_rate
    )
    return r.goodput / answers_s, r.admitted, r.broken


def test_in_the_delay_s_terms_it_is_codel() -> None:
    """``terms="delay"``: the ratio is 1, and a run makes codel's own decisions to the job."""
    engine = draw_engine(3)
    answers_s = saturated(engine)[0]
    spike = loads(answers_s)["spike 0.55x-5.5x"]
    own = run(CoDelPolicy(), spike, 3, engine=engine, retriers=0.1)
    what_if = run(PromiseTermsCoDel(terms="delay"), spike, 3, engine=engine, retriers=0.1)
    assert dataclasses.asdict(own) == dataclasses.asdict(what_if)


def test_a_bursts_limit_is_read_back_at_the_ratio_of_the_moment() -> None:
    """A limit stored as the promised wait reached (4 s at a ratio of 2: 2 s of mean delay) reads
    as 4 s once the promise's margin has closed (ratio 1), and a mild limit (the target) stays the
    target at any ratio."""
    codel = PromiseTermsCoDel(terms="margin", half_life_s=30.0)
    burst = PolicyState(standing_since=10.0, limit_s=4.0)
    assert codel.delay_limit(burst, 10.0, 0.5, ratio=2.0) == 2.0
    assert codel.delay_limit(burst, 10.0, 0.5, ratio=1.0) == 4.0
    mild = PolicyState(standing_since=10.0, limit_s=0.5)
    assert codel.delay_limit(mild, 10.0, 0.5, ratio=1.5) == 0.5
    assert codel.delay_limit(PolicyState(), 10.0, 0.5, ratio=2.0) == float("inf")


def test_the_ratio_is_the_margin_or_the_whole_promise() -> None:
    drain = DrainRate(slots=5, weigh_per_slot=True)
    assert promise_ratio(drain, 10, 1.0, "margin") == 1.0  # nothing measured: no margin
    for cost, seconds, running in ((300, 2.0, 3), (300, 3.5, 5), (300, 1.2, 2), (300, 4.0, 5)) * 5:
        drain.observe(cost, seconds, running)
    slowdown = drain.slowdown
    margin = promise_ratio(drain, 10, slowdown, "margin")
    whole = promise_ratio(drain, 10, slowdown, "promise")
    assert margin > 1.0 and whole >= margin * 0.999
    assert promise_ratio(drain, 10, slowdown, "delay") == 1.0


def test_on_a_small_engine_with_long_tailed_answers_a_burst_keeps_the_deeper_queue_and_its_promises() -> None:
    """Seed 3 of the family (21 slots, long-tailed answers): codel held the spike's queue at what
    the burst's first seconds' margin allowed (71.8 % of capacity); counted with the margin, the
    limit lets it grow as the margin narrows, and no admitted job ends past its deadline."""
    own_share, own_admitted, own_broken = _spike(3, CoDelPolicy())
    share, admitted, broken = _spike(3, PromiseTermsCoDel(terms="margin"))
    assert own_broken == 0 and broken == 0
    assert admitted > own_admitted and share > own_share + 0.005, (own_share, share)
