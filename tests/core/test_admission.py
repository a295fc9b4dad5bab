from __future__ import annotations

import pytest

from sluice.core.admission import (
    MAX_RETRY_AFTER_S,
    Admitted,
    Bounds,
    QueueLimits,
    QueueView,
    Refused,
    clamp_retry_after,
)
from sluice.core.capacity import DrainRate
from sluice.core.policy import Candidate, DeadlinePolicy, PolicyState


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
    # 20 s of work ahead, 10 s budget, 1 s of own service: it fits once 11 s of work has drained.
    assert info.value.status == 503 and info.value.code == "deadline_unmeetable"
    assert info.value.retry_after_s == pytest.approx(11.0)
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
