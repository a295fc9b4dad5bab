from __future__ import annotations

import math
from fractions import Fraction
from typing import cast

import pytest

from sluice.core.admission import (
    MAX_RETRY_AFTER_S,
    RETRY_PATIENCE_S,
    Admitted,
    Bounds,
    QueueLimits,
    QueueView,
    Refused,
    Reservations,
    clamp_retry_after,
    reserve,
)
from sluice.core.capacity import DrainRate
from sluice.core.policy import Candidate, CoDelPolicy, DeadlinePolicy, PolicyState
from sluice.core.scheduler import ClassScheduler, Entry


def check(
    *,
    cost: int,
    priority: str,
    now: float,
    deadline: float,
    view: QueueView,
    limits: QueueLimits,
    drain: DrainRate,
) -> Admitted:
    """Admission's checks as the brokers run them: the bounds, then the deadline (``deadline`` policy)."""
    candidate = Candidate(cost, priority, now, deadline, view, limits, drain)
    return DeadlinePolicy().admit(candidate, PolicyState())


def view(jobs: int = 0, tokens: int = 0) -> QueueView:
    return QueueView(jobs, tokens, jobs, tokens, jobs, tokens)


def measured(per_slot: float = 100.0, slots: int = 2) -> DrainRate:
    d = DrainRate(slots=slots)
    d.observe(int(per_slot), 1.0)
    return d


def test_admits_into_empty_queue() -> None:
    ok = check(
        cost=100, priority="normal", now=0, deadline=60, view=view(), limits=QueueLimits(), drain=measured()
    )
    assert ok.position == 0 and ok.estimated_start_s == 0


def test_estimated_start_follows_drain_rate() -> None:
    ok = check(
        cost=100,
        priority="normal",
        now=0,
        deadline=60,
        view=view(5, 1000),
        limits=QueueLimits(),
        drain=measured(),
    )
    assert ok.position == 5 and ok.estimated_start_s == pytest.approx(5.0)


def test_queue_full_on_jobs_with_sane_retry_after() -> None:
    limits = QueueLimits(model=Bounds(max_jobs=10))
    with pytest.raises(Refused) as info:
        check(
            cost=100,
            priority="normal",
            now=0,
            deadline=60,
            view=view(10, 1000),
            limits=limits,
            drain=measured(),
        )
    assert info.value.status == 429 and info.value.code == "queue_full"
    # One job of ~100 tokens must drain at 200 tokens/s: half a second.
    assert info.value.retry_after_s == pytest.approx(0.5)


def test_class_bounds() -> None:
    limits = QueueLimits(model=Bounds(max_jobs=100), classes={"low": Bounds(max_tokens=500)})
    v = QueueView(
        model_jobs=3, model_tokens=450, class_jobs=3, class_tokens=450, ahead_jobs=3, ahead_tokens=450
    )
    with pytest.raises(Refused) as info:
        check(cost=100, priority="low", now=0, deadline=60, view=v, limits=limits, drain=measured())
    assert "'low'" in info.value.message and 0 < info.value.retry_after_s < 5
    check(cost=100, priority="normal", now=0, deadline=60, view=v, limits=limits, drain=measured())


def test_deadline_unmeetable() -> None:
    with pytest.raises(Refused) as info:
        check(
            cost=100,
            priority="normal",
            now=0,
            deadline=10,
            view=view(20, 4000),
            limits=QueueLimits(),
            drain=measured(),
        )
    # 20 s of work ahead, 10 s budget, 1 s of own service: it would fit once 11 s of work has
    # drained, but the requests arriving meanwhile would take that room; it is told to come back
    # when the 20 s of work queued ahead has started.
    assert info.value.status == 503 and info.value.code == "deadline_unmeetable"
    assert info.value.retry_after_s == pytest.approx(20.0)
    assert info.value.should_retry


def test_hopeless_deadline_says_do_not_retry() -> None:
    with pytest.raises(Refused) as info:
        check(
            cost=1000,
            priority="normal",
            now=0,
            deadline=2,
            view=view(),
            limits=QueueLimits(),
            drain=measured(),
        )
    assert not info.value.should_retry and info.value.retry_after_s > 0


def slowed(slowdown_seen: float) -> DrainRate:
    """A measured drain rate whose fill line says a full batch runs jobs ``slowdown_seen`` times
    slower than the light load every job so far finished at."""
    drain = measured()
    for u, t in [(0.1, 0.01), (0.2, 0.01 * slowdown_seen)] * 200:
        drain.observe_fill(u, t)
    return drain


def test_a_job_with_nothing_ahead_is_promised_the_pace_measured_not_a_full_batch() -> None:
    # A fill line can say a full batch is far slower than anything seen. Were a lone job promised
    # that pace, a job that fits at the measured pace would be refused as never fitting, every
    # job alike: nothing would be admitted, nothing would finish, and the line would never be
    # corrected. With nothing queued ahead the job starts at once and is promised what was measured.
    drain = slowed(8.0)
    assert drain.slowdown > 2
    alone = drain.slow_service_s(100, behind_queue=False)
    assert drain.slow_service_s(100) > 2 * alone
    budget = 1.5 * alone
    admitted = check(
        cost=100, priority="normal", now=0, deadline=budget, view=view(), limits=QueueLimits(), drain=drain
    )
    assert admitted.position == 0
    # Behind a queue it is the full batch's pace, and the refusal says when to come back, not to
    # give up: the job fits once the queue has drained.
    with pytest.raises(Refused) as info:
        check(
            cost=100,
            priority="normal",
            now=0,
            deadline=budget,
            view=view(1, 10),
            limits=QueueLimits(),
            drain=drain,
        )
    assert info.value.code == "deadline_unmeetable" and info.value.should_retry


def test_no_deadline_refusal_before_any_measurement() -> None:
    ok = check(
        cost=100,
        priority="normal",
        now=0,
        deadline=1,
        view=view(100, 10**6),
        limits=QueueLimits(),
        drain=DrainRate(),
    )
    assert ok.position == 100


def test_retry_after_is_bounded() -> None:
    assert clamp_retry_after(0.0) > 0
    assert clamp_retry_after(1e12) == MAX_RETRY_AFTER_S
    assert clamp_retry_after(float("nan")) == MAX_RETRY_AFTER_S


# --- what is ahead: jobs held back by their tenant's concurrency cap are not ------------------


def _scheduler_with(tenant: str, jobs: list[tuple[str, int]]) -> ClassScheduler:
    q = ClassScheduler()
    for i, (cls, cost) in enumerate(jobs):
        q.push(cls, Entry(f"{tenant}-{i}", tenant, cost))
    return q


def test_held_back_is_what_a_tenant_cannot_start_before_its_cap_frees() -> None:
    q = _scheduler_with("c", [("normal", 500), ("normal", 2000), ("normal", 3000), ("high", 100)])
    # Room for two: its high job, then its first normal one; the other two wait for its cap.
    assert q.held_back("c", 2) == [(0, 0), (2, 5000), (0, 0)]
    assert q.held_back("c", 0) == [(1, 100), (3, 5500), (0, 0)]
    assert q.held_back("c", 4) == [(0, 0), (0, 0), (0, 0)]
    assert q.held_back("nobody", 0) == [(0, 0), (0, 0), (0, 0)]
    # The counts follow the queue: a dispatched or removed job is no longer held back.
    q.pop()  # the high one
    q.remove("normal", "c-0", "c")
    assert q.held_back("c", 1) == [(0, 0), (1, 3000), (0, 0)]


def test_codel_observes_the_work_a_job_at_the_tail_waits_for() -> None:
    """A queue whose backlog is all held back by a tenant's cap is not a standing queue: codel's
    delay is what a new job would wait for (runnable_tokens), not every queued token."""
    policy = CoDelPolicy(target_s=0.5, interval_s=2.0, early_s=0.5)
    state = PolicyState()
    backlog = QueueView(50, 200_000, 50, 200_000, 0, 0, runnable_tokens=0)
    for step in range(20):  # ten seconds of a backlog of 100 s
        now = step * 0.5
        candidate = Candidate(100, "normal", now, now + 30, backlog, QueueLimits(), measured())
        policy.admit(candidate, state)
    assert state.standing_since is None and state.above_since is None
    assert QueueView(1, 10, 1, 10, 1, 10).tail_tokens == 10  # nothing held back: every queued token


# --- at a bound, the heaviest backlog gives way ------------------------------------------------


def test_at_a_bound_the_newest_job_of_a_much_heavier_backlog_gives_way() -> None:
    limits = QueueLimits(model=Bounds(max_jobs=10, max_tokens=1000))
    full = QueueView(10, 1000, 10, 1000, 1, 100, victim_tokens=100)
    ok = check(cost=100, priority="normal", now=0, deadline=60, view=full, limits=limits, drain=measured())
    assert ok.evict and ok.position == 1
    # Nobody much heavier: the job itself is refused.
    with pytest.raises(Refused) as info:
        check(
            cost=100,
            priority="normal",
            now=0,
            deadline=60,
            view=QueueView(10, 1000, 10, 1000, 1, 100),
            limits=limits,
            drain=measured(),
        )
    assert info.value.code == "queue_full"
    # The victim's job is too small to make room for this one's tokens: refused too.
    with pytest.raises(Refused):
        check(cost=200, priority="normal", now=0, deadline=60, view=full, limits=limits, drain=measured())
    # Room enough: nobody is evicted.
    roomy = QueueView(5, 500, 5, 500, 1, 100, victim_tokens=100)
    ok = check(cost=100, priority="normal", now=0, deadline=60, view=roomy, limits=limits, drain=measured())
    assert not ok.evict
    # A job the queue takes in another's place still has to meet its deadline.
    with pytest.raises(Refused) as late:
        check(cost=100, priority="normal", now=0, deadline=1, view=full, limits=limits, drain=measured())
    assert late.value.code == "deadline_unmeetable"


# --- Retry-After is a reservation ---------------------------------------------------------------


def _refused(retry_after: float, should_retry: bool = True) -> Refused:
    return Refused(429, "queue_full", "full", retry_after, should_retry=should_retry)


def test_refusals_in_a_burst_get_distinct_times_over_the_capacity_that_frees() -> None:
    drain = measured(per_slot=100.0, slots=2)  # 200 cost units a second
    book = Reservations()
    times = [
        reserve(_refused(2.0), cost=100, now=10.0, drain=drain, book=book).retry_after_s for _ in range(4)
    ]
    # Each reserves its 100 units at half the drain rate: one a second, from when room first frees.
    assert times == pytest.approx([2.0, 3.0, 4.0, 5.0])
    # Later, a refusal whose own room frees after the book's frontier gets its own time.
    assert reserve(_refused(9.0), cost=100, now=11.0, drain=drain, book=book).retry_after_s == 9.0
    # Never sooner than room can free, though the book has nothing promised then.
    late = reserve(_refused(0.5), cost=100, now=100.0, drain=drain, book=book)
    assert late.retry_after_s == 0.5 and late.should_retry


def test_no_time_within_the_clients_patience_says_do_not_retry() -> None:
    drain = measured(per_slot=100.0, slots=1)
    book = Reservations(next_free=10.0 + RETRY_PATIENCE_S + 1)
    far = reserve(_refused(1.0), cost=100, now=10.0, drain=drain, book=book)
    assert not far.should_retry and far.retry_after_s == pytest.approx(RETRY_PATIENCE_S + 1)
    assert book.next_free == 10.0 + RETRY_PATIENCE_S + 1  # nothing reserved
    hopeless = _refused(5.0, should_retry=False)
    assert reserve(hopeless, cost=100, now=10.0, drain=drain, book=Reservations()) is hopeless


def test_a_reserved_refusal_keeps_its_rate_limit_status() -> None:
    from sluice.core.ratelimit import TenantLimiter, TenantLimits

    limiter = TenantLimiter(TenantLimits(tenant="t", rpm=1))
    limiter.take(10, 0.0)
    status = limiter.status(0.0)
    refused = Refused(429, "rate_limit_exceeded", "Rate limit reached.", 60.0, rate=status)
    drain = measured()
    kept = reserve(refused, cost=10, now=0.0, drain=drain, book=Reservations())
    assert kept.reserved and kept.rate is status
    far = reserve(refused, cost=10, now=0.0, drain=drain, book=Reservations(next_free=1000.0))
    assert not far.should_retry and far.rate is status


def test_a_wait_is_promised_at_the_promise_rate_and_the_start_told_at_the_mean() -> None:
    """Measured at a quarter's fill with times that spread: a queue whose wait fits the deadline at
    the mean rate but not at the rate a wait is promised at (DrainRate.promise_rate_behind, below
    the mean) is refused, told to come back once the work queued ahead has started (at the mean rate);
    a queue short enough for the promise is admitted, told its start at the mean rate."""
    drain = DrainRate(slots=8, weigh_per_slot=True)
    for i in range(600):
        drain.observe(100, 0.1 if i % 4 else 3.7, running=1 + i % 3)
    assert drain.promise_rate < 0.7 * drain.rate
    service = drain.slow_service_s(100)
    budget = 30.0

    def behind(tokens: int) -> Admitted:
        """A job of 100 with ``tokens`` of jobs of 100 queued ahead, due in ``budget``."""
        queue = view(tokens // 100, tokens)
        return check(
            cost=100, priority="normal", now=0, deadline=budget, view=queue, limits=QueueLimits(), drain=drain
        )

    ahead = int((budget - service) * drain.rate * 0.9)  # fits at the mean, with a tenth to spare
    with pytest.raises(Refused) as info:
        behind(ahead)
    assert info.value.code == "deadline_unmeetable" and info.value.should_retry
    assert info.value.retry_after_s == pytest.approx(drain.wait_s(ahead))  # the queue ahead started
    # Behind fewer jobs the margin is wider (they are a sample of their own): the queue short
    # enough, found by shortening it until its own promise fits with a tenth to spare.
    shorter = int((budget - service) * drain.promise_rate)
    for _ in range(20):
        shorter = int((budget - service) * drain.promise_rate_behind(shorter // 100) * 0.9)
    assert drain.promise_rate_behind(shorter // 100) < drain.promise_rate
    ok = behind(shorter)
    assert ok.estimated_start_s == pytest.approx(drain.wait_s(shorter))


def test_clamp_retry_after_is_min_of_max() -> None:
    # the conditionals give min(max(s, MIN), MAX)'s values exactly, ties and signed zeros included
    from sluice.core.admission import MAX_RETRY_AFTER_S, MIN_RETRY_AFTER_S, clamp_retry_after

    cases = [-1.0, -0.0, 0.0, 0, 0.49, MIN_RETRY_AFTER_S, 3, 7.25, MAX_RETRY_AFTER_S, 120.5, 1e9]
    # ties of another type than the bound's, the only ties where a <= in place of a < shows: max
    # and min keep their first argument (120, not 120.0; the Fraction, not 0.5)
    cases += [int(MAX_RETRY_AFTER_S), cast(float, Fraction(MIN_RETRY_AFTER_S))]
    assert int(MAX_RETRY_AFTER_S) == MAX_RETRY_AFTER_S and Fraction(MIN_RETRY_AFTER_S) == MIN_RETRY_AFTER_S
    for s in cases:
        want = min(max(s, MIN_RETRY_AFTER_S), MAX_RETRY_AFTER_S)
        got = clamp_retry_after(s)
        assert repr(got) == repr(want) and type(got) is type(want)
    for s in (math.inf, -math.inf, math.nan):
        assert clamp_retry_after(s) == MAX_RETRY_AFTER_S
