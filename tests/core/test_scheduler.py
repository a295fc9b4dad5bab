from __future__ import annotations

from collections import Counter

from sluice.core.scheduler import ClassScheduler, ClassSpec, Entry, FairQueue


def drain(q: FairQueue) -> list[str]:
    out = []
    while (e := q.pop()) is not None:
        out.append(e.job_id)
    return out


def test_fifo_within_one_tenant() -> None:
    q = FairQueue()
    for i in range(5):
        q.push(Entry(f"j{i}", "a", 10))
    assert drain(q) == [f"j{i}" for i in range(5)]
    assert q.jobs == 0 and q.tokens == 0


def test_flooder_delays_newcomer_by_at_most_one_job() -> None:
    q = FairQueue()
    for i in range(100):
        q.push(Entry(f"flood{i}", "flood", 100))
    for _ in range(10):  # the flooder has been served for a while
        q.pop()
    q.push(Entry("polite", "polite", 100))
    first, second = q.pop(), q.pop()
    assert "polite" in (first.job_id, second.job_id)  # type: ignore[union-attr]


def test_equal_share_by_cost() -> None:
    q = FairQueue()
    for i in range(50):
        q.push(Entry(f"big{i}", "big", 400))  # few large jobs
        q.push(Entry(f"s{i}a", "small", 100))
        q.push(Entry(f"s{i}b", "small", 100))
        q.push(Entry(f"s{i}c", "small", 100))
        q.push(Entry(f"s{i}d", "small", 100))
    served: Counter[str] = Counter()
    for _ in range(100):
        e = q.pop()
        assert e is not None
        served[e.tenant] += e.cost
    # Tokens, not requests, are shared equally.
    assert abs(served["big"] - served["small"]) <= 400


def test_weights() -> None:
    q = FairQueue()
    for i in range(60):
        q.push(Entry(f"a{i}", "a", 10, weight=2.0))
        q.push(Entry(f"b{i}", "b", 10, weight=1.0))
    first = [q.pop().tenant for _ in range(30)]  # type: ignore[union-attr]
    assert 18 <= first.count("a") <= 22


def test_remove_and_front() -> None:
    q = FairQueue()
    for i in range(3):
        q.push(Entry(f"j{i}", "a", 10))
    assert q.remove("j1", "a") is not None
    assert q.remove("j1", "a") is None
    assert q.remove("j1", "nobody") is None
    q.push(Entry("back", "a", 10), front=True)
    assert drain(q) == ["back", "j0", "j2"]


def test_position_interleaves_tenants() -> None:
    q = FairQueue()
    for i in range(3):
        q.push(Entry(f"a{i}", "a", 10))
    q.push(Entry("b0", "b", 10))
    assert q.position("a0", "a") == 0
    assert q.position("b0", "b") in (0, 1)
    assert q.position("a2", "a") == 3
    assert q.position("zzz", "a") is None


def test_strict_priority_between_classes() -> None:
    s = ClassScheduler([ClassSpec("high"), ClassSpec("low")])
    s.push("low", Entry("l", "t", 1))
    s.push("high", Entry("h", "t", 1))
    assert s.pop() == ("high", Entry("h", "t", 1))
    assert s.pop() == ("low", Entry("l", "t", 1))
    assert s.pop() is None


def test_low_class_is_never_starved() -> None:
    s = ClassScheduler([ClassSpec("high", 0.0), ClassSpec("low", 0.1)])
    for i in range(1000):
        s.push("high", Entry(f"h{i}", "t", 1))
    for i in range(100):
        s.push("low", Entry(f"l{i}", "t", 1))
    served = Counter(s.pop()[0] for _ in range(500))  # type: ignore[index]
    # Under contention the low class keeps about its minimum share, and no more.
    assert 40 <= served["low"] <= 70


def test_ahead_and_position_count_higher_classes() -> None:
    s = ClassScheduler()
    s.push("high", Entry("h", "t", 5))
    s.push("normal", Entry("n", "t", 7))
    s.push("low", Entry("l", "t", 11))
    assert s.ahead("high") == (1, 5)
    assert s.ahead("normal") == (2, 12)
    assert s.ahead("low") == (3, 23)
    assert s.position("low", "l", "t") == 2
    assert s.jobs == 3 and s.tokens == 23


def test_min_share_does_not_jump_ahead_early() -> None:
    s = ClassScheduler([ClassSpec("high"), ClassSpec("normal", 0.1), ClassSpec("low", 0.05)])
    for i in range(3):
        s.push("normal", Entry(f"n{i}", "t", 1))
    s.push("low", Entry("l", "t", 1))
    s.push("high", Entry("h", "t", 1))
    assert [s.pop()[1].job_id for _ in range(5)] == ["h", "n0", "n1", "n2", "l"]  # type: ignore[index]


def test_idle_class_banks_no_credit() -> None:
    s = ClassScheduler([ClassSpec("high"), ClassSpec("low", 0.5)])
    s.push("low", Entry("l0", "t", 1))
    for i in range(4):
        s.push("high", Entry(f"h{i}", "t", 1))
    assert [s.pop()[1].job_id for _ in range(3)] == ["h0", "h1", "l0"]  # type: ignore[index]
    assert s.credit["low"] == 0.0  # emptied: nothing carried over
    s.push("low", Entry("l1", "t", 1))
    assert s.pop()[1].job_id == "h2"  # type: ignore[index]


def test_blocked_tenants_are_passed_over_in_order() -> None:
    q = FairQueue()
    for i in range(2):
        q.push(Entry(f"a{i}", "a", 10))
        q.push(Entry(f"b{i}", "b", 10))
    assert q.peek(blocked={"a"}).job_id == "b0"  # type: ignore[union-attr]
    assert q.peek().job_id == "a0"  # type: ignore[union-attr]  # peeking changed nothing
    assert q.pop(blocked={"a"}).job_id == "b0"  # type: ignore[union-attr]
    assert q.has_eligible(blocked={"a"})
    assert q.pop(blocked={"a"}).job_id == "b1"  # type: ignore[union-attr]
    assert not q.has_eligible(blocked={"a"}) and q.pop(blocked={"a"}) is None
    assert [q.pop().job_id for _ in range(2)] == ["a0", "a1"]  # type: ignore[union-attr]
