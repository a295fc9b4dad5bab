"""The spike's ceiling (bench/spike_ceiling.py): the most on-time jobs of the fluid relaxation, and
its place above what codel and a clairvoyant admission get on the model's engine."""

from __future__ import annotations

import itertools
import random

import pytest

from sluice.bench.engine_family import Engine, draw_engine
from sluice.bench.policy_model import run
from sluice.bench.spike_ceiling import ceiling, full_rate_tokens, most_on_time, spike_profile
from sluice.core.policy import POLICIES, FifoPolicy, make_policy


def _feasible(windows: list[tuple[float, float, float]], rate: float) -> bool:
    """Whether first-come order finishes every job in its window."""
    t = float("-inf")
    for release, deadline, work in windows:
        t = max(t, release) + work / rate
        if t > deadline + 1e-9:
            return False
    return True


def test_a_long_job_gives_way_to_two_short_ones() -> None:
    """By hand, one server of 1 work a second: a 3-s job at 0 and two 1-s jobs at 1 and 1.5, all due
    at 3. First come first served takes the long one and is late with either short one; the most
    on time is the two short ones (1 → 2, 2 → 3), and the long one is the one dropped."""
    windows = [(0.0, 3.0, 3.0), (1.0, 3.0, 1.0), (1.5, 3.0, 1.0)]
    assert most_on_time(windows, 1.0) == [1, 2]
    # Twice as fast, all three fit: 0 → 1.5, 1.5 → 2, 2 → 2.5.
    assert most_on_time(windows, 2.0) == [0, 1, 2]


def test_the_drop_that_ends_soonest_is_not_always_the_longest() -> None:
    """A job released late saves less when dropped than its length: jobs (0, 2.5, 2), (1.9, 4.4,
    1.5), (2, 4.5, 1.2) at rate 1. The third is late behind the first two (it would end at 4.7);
    dropping the first, the longest, ends at 4.6 (the second cannot start before 1.9), still late,
    dropping the second at 3.2, so the second goes (dropping the longest, as Moore and Hodgson's
    rule without releases does, keeps the second and third and misses)."""
    assert most_on_time([(0.0, 2.5, 2.0), (1.9, 4.4, 1.5), (2.0, 4.5, 1.2)], 1.0) == [0, 2]


def test_it_is_the_most_on_time_of_every_subset() -> None:
    """Against brute force over every subset, on small random agreeable cases (one patience for
    all, deadlines cut at the run's end as the spike's are), half of them on a grid where ties
    abound."""
    rng = random.Random(7)
    for case in range(600):
        n = rng.randint(1, 8)
        patience, end = rng.uniform(0.5, 4.0), rng.uniform(5.0, 12.0)
        if case % 2:  # on a grid of half seconds: ties in releases, deadlines and the drops' ends
            patience = 0.5 * rng.randint(1, 8)
            releases = sorted(0.5 * rng.randint(0, 20) for _ in range(n))
            windows = [(r, min(r + patience, end), 0.5 * rng.randint(1, 6)) for r in releases]
        else:
            releases = sorted(rng.uniform(0.0, 10.0) for _ in range(n))
            windows = [(r, min(r + patience, end), rng.uniform(0.1, 3.0)) for r in releases]
        chosen = most_on_time(windows, 1.0)
        assert _feasible([windows[i] for i in chosen], 1.0)
        best = max(
            (
                k
                for k in range(n + 1)
                for c in itertools.combinations(range(n), k)
                if _feasible([windows[i] for i in c], 1.0)
            ),
            default=0,
        )
        assert len(chosen) == best


def test_windows_must_be_agreeable() -> None:
    with pytest.raises(ValueError, match="agreeable"):
        most_on_time([(0.0, 5.0, 1.0), (1.0, 4.0, 1.0)], 1.0)


def test_the_full_batch_decodes_the_most_tokens_a_second() -> None:
    """4 slots, a step of 10 ms + 5 ms a sequence: 4 tokens in 30 ms."""
    engine = Engine(slots=4, step0=0.01, step1=0.005)
    assert full_rate_tokens(engine) == pytest.approx(4 / 0.03)
    assert all(b / (0.01 + 0.005 * b) <= full_rate_tokens(engine) for b in range(1, 5))


def test_the_ceiling_is_above_what_any_admission_got() -> None:
    """On a family engine codel misses 73 % on (seed 2: 7 slots, KV-short, fixed answers), the
    ceiling bounds codel's goodput and every clairvoyant admission's, and the clairvoyant one,
    run again without the jobs it saw miss, passes 73 % keeping every promise. Its first run (the
    answers unseen: here all max_tokens, the same set) is the fluid server's set and breaks some:
    the engine serves side by side, not one job at a time."""
    c = ceiling(2, draw_engine(2), retrying=False)
    assert c is not None
    assert max(c.codel, c.unseen.goodput, c.cautious.goodput, c.known.goodput) <= c.ceiling
    assert c.codel < 73.0 <= c.known.goodput
    assert c.known.broken == 0 < c.unseen.broken
    assert c.known.wasted <= 2.0


@pytest.mark.parametrize("seed", [0, 97])
def test_no_policy_gets_past_the_ceiling(seed: int) -> None:
    """The ceiling bounds every admission, not only codel's: each configured policy and a queue
    that refuses nobody, run on the same trace (every client trying once), get no more (seed 0:
    58 slots, fixed answers, prefill free; seed 97: 5 slots, answers ending early). Seed 0's
    deadline check comes within 4 points of it (82.5 % against 86.2 %): a bound drawn at 90 % of
    the full batch's rate (79.5 %) fails here; the brute force above checks the count itself."""
    engine = draw_engine(seed)
    cap, profile, full_rate = spike_profile(engine)
    c = ceiling(seed, engine, retrying=False)
    assert c is not None
    policies = [make_policy(name) for name in POLICIES] + [FifoPolicy(max_queued=10**6)]
    for policy in policies:
        result = run(policy, profile, seed, engine=engine, retriers=0.0, full_rate=full_rate)
        assert 100 * result.goodput / cap <= c.ceiling, policy.name
