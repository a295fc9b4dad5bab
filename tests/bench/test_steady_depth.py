"""The standing overload's fixed-depth oracle (bench/steady_depth.py)."""

from __future__ import annotations

from sluice.bench.engine_family import draw_engine
from sluice.bench.steady_depth import GOODPUT, P99_S, best_depth, steady
from sluice.core.policy import CoDelPolicy, FifoPolicy


def test_a_deeper_queue_waits_longer() -> None:
    """On one engine and trace (family seed 12: 5 slots), a queue of 12 jobs has an ok p99 above a
    queue of 1's: the depth is what trades latency for goodput."""
    engine = draw_engine(12)
    assert (
        steady(FifoPolicy(max_queued=12), engine, 12).p99 > steady(FifoPolicy(max_queued=1), engine, 12).p99
    )


def test_on_an_engine_codel_misses_a_fixed_depth_reaches_both_targets() -> None:
    """Family seed 12 (5 slots, fixed answers): codel's ok p99 is over 5 s, and some depth of at
    most a batch gets 98 % of the capacity on the jobs served within 5 s."""
    engine = draw_engine(12)
    assert steady(CoDelPolicy(), engine, 12).p99 > P99_S
    best = best_depth(engine, 12, most=engine.slots)
    assert best is not None
    n, d = best
    assert 1 <= n <= engine.slots
    assert d.goodput >= GOODPUT
    assert d.p99 <= P99_S
