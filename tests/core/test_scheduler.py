from __future__ import annotations

import random
from collections import Counter

from sluice.core.scheduler import Backlog, ClassScheduler, ClassSpec, Entry, FairQueue, work_before


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


# --- where the fair order puts a new job: what admission counts as ahead ---------------------


def _backlog(jobs: int, tokens: int, tag: float, head: int = 100, weight: float = 1.0) -> Backlog:
    return Backlog("u", jobs, tokens, tag, head, weight, "newest", 100)


def test_work_before_counts_the_jobs_whose_start_tags_come_first() -> None:
    ten = _backlog(10, 1000, tag=500.0)  # tags 500, 600, ..., 1400
    assert work_before(ten, 499.0) == (0, 0)
    assert work_before(ten, 500.0) == (1, 100)  # a tie: its head is in the heap already
    assert work_before(ten, 550.0) == (1, 100)
    assert work_before(ten, 600.0) == (1, 100)  # the second one starts at 600, not before
    assert work_before(ten, 601.0) == (2, 200)
    assert work_before(ten, 1401.0) == (10, 1000)
    assert work_before(ten, 10**6) == (10, 1000)
    # A weight of 2 halves the virtual time each job takes: twice the jobs before the same tag.
    assert work_before(_backlog(10, 1000, tag=500.0, weight=2.0), 601.0) == (3, 300)
    # Uneven costs: the head is exact, the rest spread evenly.
    assert work_before(_backlog(3, 1100, tag=0.0, head=1000), 1.0) == (1, 1000)
    assert work_before(_backlog(3, 1100, tag=0.0, head=1000), 1099.0) == (3, 1100)
    assert work_before(_backlog(3, 1100, tag=0.0, head=1000), 700.0) == (2, 1050)


def test_a_light_tenant_lands_near_the_head_whatever_a_heavy_one_queued() -> None:
    s = ClassScheduler()
    for i in range(100):
        s.push("normal", Entry(f"h{i}", "heavy", 100))
    for _ in range(5):
        s.pop()
    light = s.fair_view("normal", "light", {})
    # Nothing is ahead: the heavy tenant's next job starts one job after the virtual time, which
    # is where the light one's starts.
    assert (light.ahead_jobs, light.ahead_tokens) == (0, 0)
    assert light.runnable_tokens == 95 * 100
    # The heavy tenant's own next job waits for all its own, and it is the backlog that gives way.
    heavy = s.fair_view("normal", "heavy", {})
    assert (heavy.ahead_jobs, heavy.ahead_tokens) == (95, 9500)
    assert light.victim is not None and light.victim.tenant == "heavy" and light.victim.newest_id == "h99"
    assert heavy.victim is None
    # A higher class is ahead whatever its tenants.
    s.push("high", Entry("x", "other", 40))
    assert s.fair_view("normal", "light", {}).ahead_tokens == 40
    assert s.fair_view("high", "light", {}).ahead_tokens == 40


def test_the_victim_is_only_a_much_heavier_backlog() -> None:
    s = ClassScheduler()
    for i in range(3):
        s.push("normal", Entry(f"a{i}", "a", 10))
    s.push("normal", Entry("b0", "b", 10))
    assert s.fair_view("normal", "c", {}).victim.tenant == "a"  # type: ignore[union-attr]
    assert s.fair_view("normal", "b", {}).victim.tenant == "a"  # type: ignore[union-attr]  # 3 >= 1 + 2
    s.push("normal", Entry("b1", "b", 10))
    assert s.fair_view("normal", "b", {}).victim is None  # 3 < 2 + 2: equals do not evict each other
    # A tie in jobs goes to the larger backlog in tokens, then to the greater name.
    s.push("normal", Entry("b2", "b", 20))
    assert s.fair_view("normal", "c", {}).victim.tenant == "b"  # type: ignore[union-attr]
    s.remove("normal", "b2", "b")
    s.push("normal", Entry("b2", "b", 10))
    assert s.fair_view("normal", "c", {}).victim.tenant == "b"  # type: ignore[union-attr]


def test_a_capped_tenant_is_ahead_only_as_far_as_its_cap_lets_it_run() -> None:
    s = ClassScheduler()
    s.push("normal", Entry("o0", "o", 1000))  # o's next job starts at tag 1000
    for i in range(4):
        s.push("normal", Entry(f"c{i}", "c", 100))
    both = s.fair_view("normal", "o", {})
    assert (both.ahead_jobs, both.ahead_tokens) == (1 + 4, 1000 + 400)
    capped = s.fair_view("normal", "o", {"c": 1})
    assert (capped.ahead_jobs, capped.ahead_tokens) == (1 + 1, 1000 + 100)
    assert capped.runnable_tokens == 1400 - 300
    # The capped tenant's own next job waits for all its jobs, but the engine's queue is only what
    # its cap lets run (codel reads that: a capped backlog is not a standing queue).
    own = s.fair_view("normal", "c", {"c": 1})
    assert (own.ahead_jobs, own.ahead_tokens) == (1 + 4, 1000 + 400)
    assert own.runnable_tokens == 1400 - 300


# --- what the fair queue remembers of tenants that drained --------------------------------------


def test_forgetting_drained_tenants_changes_no_order_view_or_position() -> None:
    """A queue that forgets its drained tenants (``forget_drained``) at random moments decides
    exactly as its twin that forgets none, through pushes (front ones too), pops with tenants
    blocked, and removals of 60 tenants' jobs: every pop, backlog, start tag, fair view and position
    the same; and it remembers only tenants with jobs, or whose finish tag is ahead of it."""
    rng = random.Random(5)
    forgets, keeps = ClassScheduler(), ClassScheduler()
    tenants = [f"t{i}" for i in range(60)]
    queued: list[tuple[str, str, str]] = []  # (class, job id, tenant)
    forgotten = 0
    for step in range(6_000):
        r = rng.random()
        if r < 0.45:
            cls, tenant = rng.choice(["high", "normal", "low"]), rng.choice(tenants)
            entry = Entry(f"j{step}", tenant, rng.choice([5, 20, 80]), rng.choice([1.0, 2.0]))
            front = rng.random() < 0.1
            for s in (forgets, keeps):
                s.push(cls, Entry(entry.job_id, entry.tenant, entry.cost, entry.weight), front=front)
            queued.append((cls, entry.job_id, tenant))
        elif r < 0.85:
            blocked = set(rng.sample(tenants, rng.choice([0, 0, 3, 20])))
            got = [s.pop(blocked) for s in (forgets, keeps)]
            assert [g and (g[0], g[1].job_id) for g in got] == [g and (g[0], g[1].job_id) for g in got[::-1]]
            if got[0] is not None:
                queued.remove((got[0][0], got[0][1].job_id, got[0][1].tenant))
        elif r < 0.92 and queued:
            cls, job_id, tenant = queued.pop(rng.randrange(len(queued)))
            for s in (forgets, keeps):
                assert s.remove(cls, job_id, tenant) is not None
        else:
            forgotten += forgets.forget_drained()
        cls, tenant = rng.choice(["high", "normal", "low"]), rng.choice(tenants)
        rooms = {t: rng.randrange(3) for t in rng.sample(tenants, 2)}
        assert forgets.fair_view(cls, tenant, rooms) == keeps.fair_view(cls, tenant, rooms), step
        for c in ("high", "normal", "low"):
            a, b = forgets.queues[c], keeps.queues[c]
            assert sorted(a.backlogs(), key=repr) == sorted(b.backlogs(), key=repr), step
            assert a.start_tag(tenant) == b.start_tag(tenant), step
            assert a.vtime == b.vtime
        if queued:
            cls, job_id, tenant = rng.choice(queued)
            assert forgets.position(cls, job_id, tenant) == keeps.position(cls, job_id, tenant)
    assert forgotten > 500  # the forgetting happened, often
    forgets.forget_drained()
    for q in forgets.queues.values():
        assert all(t.jobs or t.finish > q.vtime for t in q._tenants.values())
    assert sum(len(q._tenants) for q in forgets.queues.values()) < sum(
        len(q._tenants) for q in keeps.queues.values()
    )


def test_a_tenant_draining_again_and_again_behind_a_capped_one_is_kept_in_mind_once() -> None:
    """A capped tenant's queued head holds the floor of forgetting back (the virtual time goes back
    to its tag when it is popped), so a tenant that drains after each of its jobs stays remembered
    meanwhile: as one entry of the drained list, not one per drain (which grew with every job the
    queue served for as long as a capped tenant kept a backlog)."""
    q = FairQueue()
    q.push(Entry("a1", "capped", 10, 1.0))
    q.push(Entry("a2", "capped", 10, 1.0))
    popped = q.pop()
    assert popped is not None and popped.job_id == "a1"  # a2 waits for the cap, its tag 10
    for i in range(1_000):
        q.push(Entry(f"b{i}", "b", 5, 1.0))
        got = q.pop({"capped"})
        assert got is not None and got.job_id == f"b{i}"
        if i % 50 == 0:
            q.forget_drained()
    q.forget_drained()
    assert set(q._tenants) == {"capped", "b"}  # b's finish tag is ahead of the floor: kept
    assert len(q._drained) <= len(q._tenants)  # 998 entries before
    # and it is forgotten once the capped tenant's head has gone and the floor passed b's finish
    assert q.pop() is not None and q.jobs == 0
    q.push(Entry("c1", "c", 10_000, 1.0))
    q.push(Entry("c2", "c", 10_000, 1.0))
    assert q.pop() is not None and q.pop() is not None  # the virtual time past b's finish tag
    q.forget_drained()
    assert set(q._tenants) == {"c"} and len(q._drained) == 1
