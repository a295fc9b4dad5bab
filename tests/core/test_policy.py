"""The queue policies, one decision at a time, on an injected clock."""

from __future__ import annotations

import contextlib
import itertools
import math

import pytest

from sluice.core.admission import Bounds, QueueLimits, QueueView, Refused
from sluice.core.capacity import DrainRate
from sluice.core.policy import (
    LEARNING_BATCHES,
    POLICIES,
    RISE_WINDOW,
    Candidate,
    CapPolicy,
    CoDelPolicy,
    DeadlinePolicy,
    FifoPolicy,
    PolicyState,
    learning,
    make_policy,
)
from tests.helpers import FakeClock

COST = 100


def drain(per_slot: float = 100.0, slots: int = 4, *, learnt: bool = True) -> DrainRate:
    """A measured drain: ``per_slot`` cost units per second per slot (one job of COST = 1 s);
    ``learnt``: counted as having seen its first batches finish (``policy.learning`` is false)."""
    d = DrainRate(slots=slots)
    d.observe(int(per_slot), 1.0)
    if learnt:
        d.samples = LEARNING_BATCHES * slots
    return d


def queue(jobs: int, running: int = 0) -> QueueView:
    return QueueView(jobs, jobs * COST, jobs, jobs * COST, jobs, jobs * COST, running)


def candidate(
    now: float, jobs: int = 0, *, running: int = 0, deadline: float = 60.0, d: DrainRate | None = None
) -> Candidate:
    return Candidate(COST, "normal", now, now + deadline, queue(jobs, running), QueueLimits(), d or drain())


# -- cap -------------------------------------------------------------------------------------------


def test_cap_takes_jobs_only_while_a_slot_is_free() -> None:
    p, s = CapPolicy(), PolicyState()
    p.admit(candidate(0, jobs=0, running=3), s)
    p.admit(candidate(0, jobs=1, running=2), s)  # the queued one starts at once
    with pytest.raises(Refused) as e:
        p.admit(candidate(0, jobs=1, running=3), s)
    assert e.value.status == 429 and e.value.code == "queue_full"
    # a slot frees every service time / slots = 1 s / 4
    assert e.value.retry_after_s == pytest.approx(0.5)  # clamped up to the minimum


def test_cap_ignores_deadlines() -> None:
    CapPolicy().admit(candidate(0, running=0, deadline=0.1), PolicyState())


# -- fifo ------------------------------------------------------------------------------------------


def test_fifo_is_a_bounded_buffer_whatever_the_deadline() -> None:
    p, s = FifoPolicy(max_queued=3), PolicyState()
    p.admit(candidate(0, jobs=2, deadline=0.5), s)  # 2 s of wait ahead, 0.5 s deadline: taken anyway
    with pytest.raises(Refused) as e:
        p.admit(candidate(0, jobs=3), s)
    assert e.value.code == "queue_full"
    # one job must drain first: 100 units at 400 units/s
    assert e.value.retry_after_s == pytest.approx(0.5)


@pytest.mark.parametrize("max_queued", [0, -1, 0.5])
def test_fifo_of_no_buffer_is_refused_when_made_not_a_zero_division_when_it_admits(max_queued: float) -> None:
    """A fifo of 0 jobs took the empty queue's 0 jobs as the divisor of its Retry-After
    (ZeroDivisionError on the first admission): now it is refused where it is made, by name and
    as ``make_policy`` (the config's path) reports bad parameters."""
    with pytest.raises(ValueError, match="max_queued >= 1"):
        FifoPolicy(max_queued=max_queued)  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="max_queued >= 1"):
        make_policy("fifo", max_queued=max_queued)
    FifoPolicy(max_queued=1).admit(candidate(0, jobs=0), PolicyState())  # the least buffer: taken


def test_every_policy_keeps_the_hard_bounds() -> None:
    limits = QueueLimits(Bounds(max_jobs=2))
    for name in POLICIES:
        c = Candidate(COST, "normal", 0.0, 60.0, queue(2), limits, drain(slots=100))
        with pytest.raises(Refused) as e:
            make_policy(name).admit(c, PolicyState())
        assert e.value.code == "queue_full", name


# -- deadline --------------------------------------------------------------------------------------


def test_deadline_refuses_what_cannot_finish_in_time() -> None:
    p, s = DeadlinePolicy(), PolicyState()
    p.admit(candidate(0, jobs=8, deadline=3.5), s)  # 8 jobs / 4 per s = 2 s wait + 1 s service
    with pytest.raises(Refused) as e:
        p.admit(candidate(0, jobs=12, deadline=3.5), s)
    assert e.value.status == 503 and e.value.code == "deadline_unmeetable"


# -- codel -----------------------------------------------------------------------------------------


def test_codel_good_queue_grows_as_deep_as_deadlines_allow() -> None:
    clock, p, s = FakeClock(0), CoDelPolicy(target_s=0.5, interval_s=2.5, early_s=0.5), PolicyState()
    # A steep rise: 4 s of delay within 1 s is a burst; nothing limits it inside the interval.
    for i, jobs in enumerate((4, 8, 12, 16)):
        clock.t = i * 0.33
        p.admit(candidate(clock.t, jobs=jobs), s)
    assert s.standing_since is None
    assert p.delay_limit(s, clock.t, 0.5) == math.inf


def test_codel_slow_rise_is_standing_early_and_held_to_the_target() -> None:
    p, s = (
        CoDelPolicy(target_s=0.5, interval_s=2.5, early_s=0.5, burst_rise=2.0, half_life_s=10.0),
        PolicyState(),
    )
    p.admit(candidate(0.0, jobs=3), s)  # 0.75 s: above the target from now on
    assert s.above_since == 0.0 and s.standing_since is None
    # 1.0 s after 0.6 s: rose 0.5 s, less than 2 s/s times 0.6 s. A mild overload: the queue it
    # built is only latency, so the limit is the target at once, and this job (1 s behind) is refused
    # with a true Retry-After: when the work ahead of it has started.
    with pytest.raises(Refused) as e:
        p.admit(candidate(0.6, jobs=4), s)
    assert s.standing_since == 0.6 and s.limit_s == pytest.approx(0.5)
    assert e.value.status == 429 and e.value.code == "queue_full"
    assert e.value.retry_after_s == pytest.approx(1.0)
    assert s.refused_at == 0.6
    assert p.delay_limit(s, 30.0, 0.5) == pytest.approx(0.5)  # no decay to wait for
    p.admit(candidate(0.7, jobs=2), s)  # 0.5 s behind: within the limit


def test_codel_limit_decays_to_the_target_with_its_half_life() -> None:
    p = CoDelPolicy(target_s=0.5, half_life_s=10.0)
    s = PolicyState(above_since=0.0, standing_since=1.0, limit_s=2.5)
    assert p.delay_limit(s, 1.0, 0.5) == pytest.approx(2.5)
    assert p.delay_limit(s, 11.0, 0.5) == pytest.approx(1.5)
    assert p.delay_limit(s, 201.0, 0.5) == pytest.approx(0.5, abs=1e-3)


def test_codel_steep_rise_is_standing_after_the_interval() -> None:
    p, s = CoDelPolicy(target_s=0.5, interval_s=2.5, early_s=0.5, burst_rise=2.0), PolicyState()
    t = 0.0
    jobs = 4
    while s.standing_since is None:
        p.admit(candidate(t, jobs=jobs, deadline=600), s)
        t += 0.25
        jobs += 6  # 1.5 s of delay per 0.25 s: a burst
    assert s.standing_since == pytest.approx(2.5)
    assert s.limit_s > 10  # the burst keeps the deep queue it built


def test_codel_burst_whose_queue_stops_growing_keeps_it_until_the_interval() -> None:
    """A burst that has built 2 s of excess delay half a second in, then stops growing (the
    deadline admits no deeper queue), has an average rise that falls below ``burst_rise`` as the
    seconds pass. Its rise is judged over at most RISE_WINDOW early_s's, so it is still a burst's
    at 2.2 s (judged over all 2.2 s it read as slow and was held to the target mid-burst), and it
    keeps its queue when the interval ends."""
    p, s = CoDelPolicy(target_s=0.5, interval_s=2.5, early_s=0.5, burst_rise=1.0), PolicyState()
    assert RISE_WINDOW * p.early_s == 1.0
    p.admit(candidate(0.0, jobs=4), s)  # 1 s of delay (a job is 0.25 s): above the target
    p.admit(candidate(0.5, jobs=10), s)  # 2.5 s: 2 s of excess in 0.5 s, a burst
    for t in (1.0, 1.5, 2.0, 2.2):  # the queue holds at 2.5 s: 2 s of excess, under 1 s/s x 2.2 s
        p.admit(candidate(t, jobs=10), s)
        assert s.standing_since is None, t
    p.admit(candidate(2.5, jobs=10), s)
    assert s.standing_since == 2.5 and s.limit_s == pytest.approx(2.5)  # the burst keeps its queue
    # A rise that has gained less than burst_rise x 1 s is still slow after that long.
    p2, s2 = CoDelPolicy(target_s=0.5, interval_s=2.5, early_s=0.5, burst_rise=1.0), PolicyState()
    p2.admit(candidate(0.0, jobs=3), s2)  # 0.75 s
    p2.admit(candidate(0.4, jobs=4), s2)  # before early_s
    with contextlib.suppress(Refused):
        p2.admit(candidate(1.5, jobs=5), s2)  # 1.25 s: 0.75 s of excess, under 1 s/s x 1 s
    assert s2.standing_since == 1.5 and s2.limit_s == pytest.approx(0.5)


def test_codel_steep_rise_while_the_rate_is_learning_is_held_to_the_target() -> None:
    """Before the rate has seen two batches finish, the delay's rise is partly the rate's own
    learning: the same steep rise is standing after ``early_s``, held to the target as it is
    then (a limit with no excess over it), not kept as a burst's queue."""
    p, s = CoDelPolicy(target_s=0.5, interval_s=2.5, early_s=0.5, burst_rise=2.0), PolicyState()
    young = drain(learnt=False)
    assert learning(young) and not learning(drain())
    t, jobs = 0.0, 4
    while s.standing_since is None:
        with contextlib.suppress(Refused):
            p.admit(candidate(t, jobs=jobs, deadline=600, d=young), s)
        t += 0.25
        jobs += 6
    assert s.standing_since == pytest.approx(0.5)  # above from the start, early_s later (learnt: 2.5)
    assert s.limit_s == 0.0
    assert p.delay_limit(s, 5.0, 0.5) == pytest.approx(0.5)  # the target, whatever it is then
    with pytest.raises(Refused) as e:
        p.admit(candidate(1.0, jobs=4, d=young), s)
    assert e.value.code == "queue_full"


def test_codel_stays_standing_through_a_lull_and_recovers_after_a_half_life() -> None:
    p, s = CoDelPolicy(target_s=0.5, half_life_s=10.0), PolicyState()
    p.admit(candidate(0.0, jobs=3), s)
    with pytest.raises(Refused):
        p.admit(candidate(1.0, jobs=4), s)
    assert s.standing_since == 1.0
    p.admit(candidate(2.0, jobs=1), s)  # a lull: the queue dips under the target
    assert s.standing_since == 1.0 and s.above_since is None
    p.admit(candidate(11.2, jobs=1), s)  # no refusal for a half-life, still under the target
    assert s.standing_since is None
    assert p.delay_limit(s, 11.2, 0.5) == math.inf


def test_codel_admits_a_high_priority_job_over_a_full_normal_class() -> None:
    p, s = CoDelPolicy(target_s=0.5, half_life_s=10.0), PolicyState()
    p.admit(candidate(0.0, jobs=3), s)
    with pytest.raises(Refused):
        p.admit(candidate(1.0, jobs=4), s)
    # 8 normal jobs queued, none of the high class: the high job waits only for the running ones.
    vip = Candidate(COST, "high", 1.1, 61.1, QueueView(8, 800, 0, 0, 0, 0), QueueLimits(), drain())
    assert p.admit(vip, s).position == 0


def test_codel_keeps_deadline_admission() -> None:
    with pytest.raises(Refused) as e:
        CoDelPolicy().admit(candidate(0, jobs=0, deadline=0.5), PolicyState())
    assert e.value.code == "deadline_unmeetable" and not e.value.should_retry


def test_codel_bad_parameters_are_refused() -> None:
    with pytest.raises(ValueError):
        CoDelPolicy(interval_s=0.1, early_s=0.5)
    with pytest.raises(ValueError):
        CoDelPolicy(half_life_s=0)


def test_make_policy_names_the_choices() -> None:
    assert isinstance(make_policy("fifo", max_queued=3), FifoPolicy)
    with pytest.raises(ValueError, match="cap, fifo, deadline, codel"):
        make_policy("lifo")
    with pytest.raises(ValueError, match="bad parameters"):
        make_policy("cap", target_s=1)


def test_codel_target_is_at_least_one_jobs_drain_time() -> None:
    """On a slow engine (one slot, a job per second) a 0.5 s target would let a standing queue run
    dry between two completions: the target becomes one job's drain time, 1 s."""
    # burst_rise 2: a rise of 1 s in 0.6 s is slow (the test is of the target, not of the rise).
    p, s = CoDelPolicy(target_s=0.5, half_life_s=10.0, burst_rise=2.0), PolicyState()
    slow = drain(per_slot=100.0, slots=1)
    p.admit(candidate(0.0, jobs=1, d=slow), s)  # 1 s of delay: at the target, not above it
    assert s.above_since is None
    p.admit(candidate(0.1, jobs=2, d=slow), s)
    with pytest.raises(Refused):
        p.admit(candidate(0.7, jobs=2, d=slow), s)  # slow rise: standing, held to 1 s
    assert s.standing_since == 0.7 and s.limit_s == pytest.approx(1.0)
    for t in (100.0, 1000.0):
        assert p.delay_limit(s, t, p.target(candidate(t, d=slow))) >= 1.0
    p.admit(candidate(1000.0, jobs=1, d=slow), s)  # one job ahead: 1 s, within the floor


# -- decide: one rule for every refusal's Retry-After ---------------------------------------------


def test_a_tenants_refusals_take_their_times_from_the_same_book_as_the_queues() -> None:
    """A tenant at its max_queued, refused five times in a second, is told five distinct times,
    each after the one before by its job's cost at half the drain rate (400 a second: 0.5 s), as
    the queue's refusals are; and a queue refusal after them is told a time after theirs."""
    from sluice.core.admission import Reservations
    from sluice.core.policy import decide
    from sluice.core.ratelimit import TenantLimiter, TenantLimits

    d, book, state = drain(), Reservations(), PolicyState()
    capped = TenantLimiter(TenantLimits(tenant="t", max_queued=1))
    told = []
    for i in range(5):
        with pytest.raises(Refused) as refused:
            decide(DeadlinePolicy(), candidate(10.0 + i / 10), state, limiter=capped, queued=1, book=book)
        assert refused.value.code == "too_many_queued" and refused.value.reserved
        told.append(10.0 + i / 10 + refused.value.retry_after_s)
    assert all(b - a == pytest.approx(0.5) for a, b in itertools.pairwise(told)), told
    free = TenantLimiter(TenantLimits(tenant="u"))
    full = Candidate(COST, "normal", 11.0, 71.0, queue(3), QueueLimits(Bounds(max_jobs=3)), d)
    with pytest.raises(Refused) as refused:
        decide(DeadlinePolicy(), full, state, limiter=free, queued=0, book=book)
    assert refused.value.code == "queue_full" and 11.0 + refused.value.retry_after_s == pytest.approx(
        told[-1] + 0.5
    )
    # A job with room is admitted, and reserves nothing.
    ok = decide(DeadlinePolicy(), candidate(12.0), state, limiter=free, queued=0, book=book)
    assert ok.position == 0 and book.next_free == pytest.approx(told[-1] + 1.0)


def test_a_rate_limits_time_is_never_sooner_than_its_bucket_refills() -> None:
    from sluice.core.admission import Reservations
    from sluice.core.policy import decide
    from sluice.core.ratelimit import TenantLimiter, TenantLimits

    limiter = TenantLimiter(TenantLimits(tenant="t", rpm=6))  # a burst of 6, then one every 10 s
    book = Reservations()
    for _ in range(6):
        decide(DeadlinePolicy(), candidate(0.0), PolicyState(), limiter=limiter, queued=0, book=book)
        limiter.take(COST, 0.0)  # the broker takes the admitted job's charge
    with pytest.raises(Refused) as refused:
        decide(DeadlinePolicy(), candidate(0.0), PolicyState(), limiter=limiter, queued=0, book=book)
    assert refused.value.code == "rate_limit_exceeded" and refused.value.retry_after_s >= 9.9
