"""The Broker conformance suite: every test runs against every broker implementation (the
``broker`` fixture is parametrized over them: ``-k memory`` or ``-k redis`` picks one)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from sluice.broker import memory
from sluice.broker.base import Broker, EventType
from sluice.broker.memory import MemoryBroker
from sluice.broker.redis import RedisBroker
from sluice.core.admission import RETRY_SHARE, Refused
from sluice.core.job import Job, JobError, JobState
from sluice.core.model_info import ModelInfo
from sluice.core.ratelimit import TenantLimits
from tests.broker.brokers import claims_waiting, make_broker
from tests.helpers import FakeClock, make_job, wait_until

W = "worker-1"

#: Every broker implementation, by the name its tests carry.
IMPLEMENTATIONS = ["memory", "redis"]


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=IMPLEMENTATIONS)
async def broker(request: pytest.FixtureRequest, clock: FakeClock) -> AsyncIterator[Broker]:
    """A started broker of each implementation, built with ``make_settings(clock)``; Redis is
    started (and emptied) only for the Redis broker's runs."""
    async with await make_broker(request.param, request, clock) as impl:
        yield impl


async def drain_events(broker: Broker, job_id: str, after: int = 0) -> list[Any]:
    return [e async for e in broker.events(job_id, after=after, timeout=2.0)]


async def test_admit_claim_finish(broker: Broker, clock: FakeClock) -> None:
    job = make_job(clock)
    adm = await broker.admit(job)
    assert not adm.duplicate and adm.position == 0
    assert (await broker.get(job.id)).state is JobState.QUEUED  # type: ignore[union-attr]
    claimed = await broker.claim(W, ["m"], timeout=1.0)
    assert claimed is not None and claimed.id == job.id
    assert claimed.state is JobState.RUNNING and claimed.attempts == 1
    await broker.publish(job.id, EventType.TOKEN, {"choices": [{"index": 0, "delta": {"content": "a"}}]})
    clock.advance(2.0)
    done = await broker.finish(
        job.id, W, JobState.SUCCEEDED, result={"object": "chat.completion"}, usage={"total_tokens": 3}
    )
    assert done is not None and done.state is JobState.SUCCEEDED
    got = await broker.get(job.id)
    assert got is not None and got.result == {"object": "chat.completion"}
    assert got.first_token_at is not None and got.finished_at is not None
    types = [e.type for e in await drain_events(broker, job.id)]
    assert types == [EventType.QUEUED, EventType.STARTED, EventType.TOKEN, EventType.DONE]


async def test_a_finish_said_to_be_at_once_awaits_nothing(broker: Broker, clock: FakeClock) -> None:
    """``finish_at_once`` lets the dispatcher await ``finish`` unshielded: it must then settle at
    its coroutine's first step, whatever the outcome (settled, or ignored for a lost lease)."""
    if not broker.finish_at_once:
        pytest.skip("this broker's finish may await: the dispatcher shields it")
    job, other = make_job(clock), make_job(clock)
    await broker.admit(job)
    await broker.admit(other)
    assert (await broker.claim(W, ["m"], timeout=1.0)) is not None
    assert (await broker.claim(W, ["m"], timeout=1.0)) is not None
    for job_id, worker, state in (
        (job.id, W, JobState.SUCCEEDED),
        (other.id, "worker-2", JobState.SUCCEEDED),  # not its lease: ignored
        (other.id, W, JobState.FAILED),
        (job.id, W, JobState.SUCCEEDED),  # ended already: ignored
    ):
        settle = broker.finish(job_id, worker, state, result={}, error=None)
        with pytest.raises(StopIteration):
            settle.send(None)
    assert (await broker.get(job.id)).state is JobState.SUCCEEDED  # type: ignore[union-attr]
    assert (await broker.get(other.id)).state is JobState.FAILED  # type: ignore[union-attr]


async def test_events_replay_and_resume(broker: Broker, clock: FakeClock) -> None:
    job = make_job(clock)
    await broker.admit(job)
    await broker.claim(W, ["m"], timeout=1.0)
    for i in range(3):
        await broker.publish(job.id, EventType.TOKEN, {"i": i})
    await broker.finish(job.id, W, JobState.SUCCEEDED, result={})
    events = await drain_events(broker, job.id)
    assert [e.id for e in events] == [1, 2, 3, 4, 5, 6]
    resumed = await drain_events(broker, job.id, after=3)
    assert [e.id for e in resumed] == [4, 5, 6]
    assert [e.data.get("i") for e in resumed[:2]] == [1, 2]
    assert await drain_events(broker, job.id, after=6) == []


async def test_a_reader_that_is_slow_to_take_each_event_still_gets_all_of_them(
    broker: Broker, clock: FakeClock
) -> None:
    """Events published while a live reader is suspended between two of them (its consumer busy
    with the last one), the terminal one among them, are read before it waits again: the
    stream of a job that ended meanwhile still ends with its terminal event, not cut short."""
    job = make_job(clock)
    await broker.admit(job)
    await broker.claim(W, ["m"], timeout=1.0)
    await broker.publish(job.id, EventType.TOKEN, {"i": 0})
    seen: list[Any] = []
    async for event in broker.events(job.id, timeout=2.0):
        seen.append(event)
        if event.type is EventType.TOKEN and event.data.get("i") == 0:
            # While the reader holds this event, the rest of the job happens.
            for i in range(1, 3):
                await broker.publish(job.id, EventType.TOKEN, {"i": i})
            await broker.finish(job.id, W, JobState.SUCCEEDED, result={})
    assert [e.type for e in seen][-1] is EventType.DONE
    assert [e.data.get("i") for e in seen if e.type is EventType.TOKEN] == [0, 1, 2]
    assert [e.id for e in seen] == list(range(1, len(seen) + 1))


async def test_events_read_long_after_the_end_are_those_read_live(
    broker: Broker, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The memory broker keeps a running job's events as objects and packs them once it ended:
    a reader long after the end, or one that resumes inside them, reads the same events."""
    monkeypatch.setattr(memory, "PACK_AFTER_S", 0.0)
    job = make_job(clock)
    await broker.admit(job)
    await broker.claim(W, ["m"], timeout=1.0)
    for i in range(3):
        await broker.publish(
            job.id, EventType.TOKEN, {"choices": [{"index": 0, "delta": {"content": str(i)}}]}
        )
    await broker.finish(job.id, W, JobState.SUCCEEDED, result={"choices": []}, usage={"total_tokens": 3})
    live = [(e.id, e.type, e.data) for e in await drain_events(broker, job.id)]
    await broker.maintain()  # upkeep packs the memory broker's ended streams
    if isinstance(broker, MemoryBroker):
        assert broker._records[job.id].packed is not None
    later = [(e.id, e.type, e.data) for e in await drain_events(broker, job.id)]
    assert later == live and [t for _, t, _ in live][-1] is EventType.DONE
    resumed = [(e.id, e.type, e.data) for e in await drain_events(broker, job.id, after=3)]
    assert resumed == live[3:]
    assert live[-1][2]["result"] == {"choices": []}


async def test_events_follow_live_job(broker: Broker, clock: FakeClock) -> None:
    job = make_job(clock)
    await broker.admit(job)

    async def produce() -> None:
        await broker.claim(W, ["m"], timeout=1.0)
        await broker.publish(job.id, EventType.TOKEN, {"i": 0})
        await broker.finish(job.id, W, JobState.SUCCEEDED, result={})

    reader = asyncio.create_task(drain_events(broker, job.id))
    await asyncio.sleep(0)
    await produce()
    events = await asyncio.wait_for(reader, 5.0)
    assert events[-1].type is EventType.DONE and len(events) == 4


async def test_claim_waits_bounded(broker: Broker) -> None:
    assert await broker.claim(W, ["m"], timeout=0.2) is None


async def test_claim_wakes_on_admit(broker: Broker, clock: FakeClock) -> None:
    waiter = asyncio.create_task(broker.claim(W, ["m"], timeout=5.0))
    await asyncio.sleep(0.05)
    job = make_job(clock)
    await broker.admit(job)
    claimed = await asyncio.wait_for(waiter, 5.0)
    assert claimed is not None and claimed.id == job.id


async def test_claim_only_requested_models(broker: Broker, clock: FakeClock) -> None:
    await broker.admit(make_job(clock, model="other"))
    assert await broker.claim(W, ["m"], timeout=0.1) is None
    claimed = await broker.claim(W, ["m", "other"], timeout=1.0)
    assert claimed is not None and claimed.model == "other"


async def test_priority_order(broker: Broker, clock: FakeClock) -> None:
    low = make_job(clock, priority="low")
    normal = make_job(clock, priority="normal")
    high = make_job(clock, priority="high")
    for job in (low, normal, high):
        await broker.admit(job)
    order = [(await broker.claim(W, ["m"], timeout=1.0)).id for _ in range(3)]  # type: ignore[union-attr]
    assert order == [high.id, normal.id, low.id]


async def test_fair_between_tenants(broker: Broker, clock: FakeClock) -> None:
    flood = [make_job(clock, tenant="flood") for _ in range(20)]
    for job in flood:
        await broker.admit(job)
    first = await broker.claim(W, ["m"], timeout=1.0)
    assert first is not None and first.tenant == "flood"
    clock.advance(0.1)
    polite = make_job(clock, tenant="polite")
    await broker.admit(polite)
    order = [(await broker.claim(W, ["m"], timeout=1.0)).tenant for _ in range(3)]  # type: ignore[union-attr]
    # The flooder already holds the virtual clock for its next job: at most one more goes first.
    assert "polite" in order[:2]


async def test_queue_full(broker: Broker, clock: FakeClock) -> None:
    for _ in range(3):
        await broker.admit(make_job(clock, model="small"))
    with pytest.raises(Refused) as info:
        await broker.admit(make_job(clock, model="small"))
    assert info.value.status == 429 and info.value.code == "queue_full"
    assert 0 < info.value.retry_after_s <= 120
    assert (await broker.stats())["small"].queued_jobs == 3


async def test_queue_full_by_tokens(broker: Broker, clock: FakeClock) -> None:
    await broker.admit(make_job(clock, model="small", prompt_tokens=400, max_tokens=400))
    with pytest.raises(Refused) as info:
        await broker.admit(make_job(clock, model="small", prompt_tokens=100, max_tokens=200))
    assert info.value.code == "queue_full"


async def test_at_a_bound_the_heaviest_backlog_gives_way(broker: Broker, clock: FakeClock) -> None:
    """fq_codel's rule at the door: a full queue takes a light tenant's job in place of the newest
    job of the tenant with the most queued, which ends as failed (code ``evicted``, heard by its
    waiters); the heavy tenant's own new jobs, and a tenant not much lighter, are refused."""
    heavy = [make_job(clock, model="small", tenant="heavy") for _ in range(3)]
    for job in heavy:
        await broker.admit(job)
    light = make_job(clock, model="small", tenant="light")
    waiter = asyncio.create_task(broker.wait(heavy[2].id, 5.0))
    adm = await broker.admit(light)
    assert not adm.duplicate and adm.position == 1  # behind the heavy tenant's head only
    evicted = await asyncio.wait_for(waiter, 5.0)
    assert evicted is not None and evicted.state is JobState.FAILED
    assert evicted.error is not None and evicted.error.code == "evicted"
    assert (await drain_events(broker, heavy[2].id))[-1].type is EventType.ERROR
    assert (await broker.stats())["small"].queued_jobs == 3
    with pytest.raises(Refused) as own:
        await broker.admit(make_job(clock, model="small", tenant="heavy"))
    assert own.value.code == "queue_full"
    with pytest.raises(Refused):  # light 1, heavy 2: not two more, so nobody gives way
        await broker.admit(make_job(clock, model="small", tenant="light"))
    third = make_job(clock, model="small", tenant="third")
    await broker.admit(third)
    assert (await broker.get(heavy[1].id)).state is JobState.FAILED  # type: ignore[union-attr]
    claimed = [await broker.claim(W, ["small"], timeout=1.0) for _ in range(4)]
    assert sorted(j.id for j in claimed if j) == sorted([heavy[0].id, light.id, third.id])


async def test_refusals_in_a_burst_reserve_distinct_times(broker: Broker, clock: FakeClock) -> None:
    """Retry-After is a reservation: refusals at the same instant get distinct times, one job's cost
    at RETRY_SHARE of the drain rate apart (the prior 50 a second here), the first when room frees;
    a refusal of the tenant's own limits reserves its time from the same book."""
    for _ in range(3):
        await broker.admit(make_job(clock, model="small"))
    times = []
    for _ in range(4):
        with pytest.raises(Refused) as info:
            await broker.admit(make_job(clock, model="small"))
        assert info.value.should_retry
        times.append(info.value.retry_after_s)
    step = 30 / (50 * RETRY_SHARE)
    assert times == pytest.approx([0.6 + i * step for i in range(4)])
    with pytest.raises(Refused) as own:  # the key's own bound on its tenant's queue
        await broker.admit(make_job(clock, model="small"), TenantLimits("t", max_queued=1))
    assert own.value.code == "too_many_queued"
    assert own.value.reserved and own.value.retry_after_s == pytest.approx(0.6 + 4 * step)
    with pytest.raises(Refused) as next_one:
        await broker.admit(make_job(clock, model="small"))
    assert next_one.value.retry_after_s == pytest.approx(0.6 + 5 * step)


async def test_idempotency(broker: Broker, clock: FakeClock) -> None:
    first = make_job(clock, idempotency_key="k1")
    await broker.admit(first)
    again = await broker.admit(make_job(clock, idempotency_key="k1"))
    assert again.duplicate and again.job.id == first.id
    other_tenant = await broker.admit(make_job(clock, idempotency_key="k1", tenant="someone-else"))
    assert not other_tenant.duplicate and other_tenant.job.id != first.id
    assert (await broker.stats())["m"].queued_jobs == 2


@pytest.mark.parametrize(
    ("theirs", "mine"),
    [
        (("acme:eu", "order-1"), ("acme", "eu:order-1")),
        (("acme", "eu:order-1"), ("acme:eu", "order-1")),
        (("a%3Ab", "k"), ("a:b", "k")),  # an escaped spelling is not the separator either
    ],
)
async def test_idempotency_keys_of_two_tenants_never_collide(
    broker: Broker, clock: FakeClock, theirs: tuple[str, str], mine: tuple[str, str]
) -> None:
    """(tenant, key) is a pair: no tenant reaches another's job by folding part of a tenant name
    into its key."""
    first = make_job(clock, tenant=theirs[0], idempotency_key=theirs[1])
    await broker.admit(first)
    other = await broker.admit(make_job(clock, tenant=mine[0], idempotency_key=mine[1]))
    assert not other.duplicate and other.job.id != first.id and other.job.tenant == mine[0]
    repeat = await broker.admit(make_job(clock, tenant=theirs[0], idempotency_key=theirs[1]))
    assert repeat.duplicate and repeat.job.id == first.id


async def _idempotency_key_ttl_s(broker: Broker, tenant: str, key: str) -> float | None:
    """How much longer the broker stores this idempotency key (None: it stores none); the Redis
    key's own TTL is in real time, the memory broker's entry lives until its job's record goes."""
    if isinstance(broker, MemoryBroker):
        stored = broker._idempotency.get((tenant, key))
        return None if stored is None else float("inf")
    assert isinstance(broker, RedisBroker)
    ms = await broker._redis.pttl(broker.keys.idem(tenant, key))
    return None if ms < 0 else ms / 1000


async def test_an_idempotency_key_lives_exactly_as_long_as_its_job(broker: Broker, clock: FakeClock) -> None:
    """A repeat gets the first job while its record is kept (queued, running, and result_ttl_s after
    it ends); once the record is gone the key is gone with it, and a repeat is a new request."""
    first = make_job(clock, idempotency_key="k", timeout=100.0)
    await broker.admit(first)
    ttl = await _idempotency_key_ttl_s(broker, "t", "k")
    # Never a day against a 60 s result: at most the job's time to run, its result's TTL, a lease
    # (a lost worker's job is reaped after it) and the minute the record itself is given.
    s = broker.settings
    assert (ttl is not None and ttl <= 100.0 + s.result_ttl_s + s.lease_s + 60.0) or ttl == float("inf")
    assert await broker.claim(W, ["m"], timeout=1.0) is not None
    await broker.finish(first.id, W, JobState.SUCCEEDED, result={"choices": []})
    clock.advance(s.result_ttl_s - 1)
    await broker.maintain()
    again = await broker.admit(make_job(clock, idempotency_key="k"))
    assert again.duplicate and again.job.id == first.id and again.job.state is JobState.SUCCEEDED
    clock.advance(2)
    await broker.maintain()
    assert await broker.get(first.id) is None
    if isinstance(broker, MemoryBroker):
        assert await _idempotency_key_ttl_s(broker, "t", "k") is None
    later = await broker.admit(make_job(clock, idempotency_key="k"))
    assert not later.duplicate and later.job.id != first.id
    # The key now names the new job, for that job's life.
    assert (await broker.admit(make_job(clock, idempotency_key="k"))).job.id == later.job.id


async def test_cancel_queued(broker: Broker, clock: FakeClock) -> None:
    job = make_job(clock)
    await broker.admit(job)
    cancelled = await broker.cancel(job.id)
    assert cancelled is not None and cancelled.state is JobState.CANCELLED
    assert await broker.claim(W, ["m"], timeout=0.1) is None
    events = await drain_events(broker, job.id)
    assert events[-1].type is EventType.ERROR and events[-1].data["status"] == "cancelled"


async def test_cancel_running_reaches_worker(broker: Broker, clock: FakeClock) -> None:
    job = make_job(clock)
    await broker.admit(job)
    await broker.claim(W, ["m"], timeout=1.0)
    assert await broker.heartbeat(W, [job.id]) == set()
    cancelled = await broker.cancel(job.id)
    assert cancelled is not None and cancelled.state is JobState.CANCELLED
    assert await broker.heartbeat(W, [job.id]) == {job.id}
    # The worker's late answer does not resurrect the job.
    assert await broker.finish(job.id, W, JobState.SUCCEEDED, result={}) is None
    assert (await broker.get(job.id)).state is JobState.CANCELLED  # type: ignore[union-attr]


async def test_cancel_terminal_is_unchanged(broker: Broker, clock: FakeClock) -> None:
    job = make_job(clock)
    await broker.admit(job)
    await broker.claim(W, ["m"], timeout=1.0)
    await broker.finish(job.id, W, JobState.SUCCEEDED, result={})
    after = await broker.cancel(job.id)
    assert after is not None and after.state is JobState.SUCCEEDED
    assert await broker.cancel("job_unknown") is None


async def test_queued_job_expires(broker: Broker, clock: FakeClock) -> None:
    job = make_job(clock, timeout=10)
    await broker.admit(job)
    clock.advance(11)
    await broker.maintain()
    got = await broker.get(job.id)
    assert got is not None and got.state is JobState.EXPIRED
    assert await broker.claim(W, ["m"], timeout=0.1) is None


async def test_a_job_admitted_that_ends_past_its_deadline_is_a_broken_promise(
    broker: Broker, clock: FakeClock
) -> None:
    """Expired queued, dropped at dispatch or stopped while running: each counts in the model's
    broken_promises (sluice_broken_promises_total); an answer, a cancel or a refusal does not."""
    await broker.register(W, {"m": 2})
    queued = make_job(clock, timeout=1)
    await broker.admit(queued)
    clock.advance(2)
    await broker.maintain()
    assert (await broker.stats())["m"].broken_promises == 1
    running = make_job(clock, timeout=5)
    await broker.admit(running)
    assert (await broker.claim(W, ["m"], timeout=1.0)).id == running.id  # type: ignore[union-attr]
    late_error = JobError("late", "timeout", "deadline_exceeded")
    await broker.finish(running.id, W, JobState.EXPIRED, error=late_error)
    ok, cancelled = make_job(clock), make_job(clock)
    for job in (ok, cancelled):
        await broker.admit(job)
    await broker.cancel(cancelled.id)
    assert (await broker.claim(W, ["m"], timeout=1.0)).id == ok.id  # type: ignore[union-attr]
    clock.advance(1)
    await broker.finish(ok.id, W, JobState.SUCCEEDED, result={})
    # Measured now (30 cost units a second): a job with too little time left is dropped at dispatch.
    late = make_job(clock, max_tokens=90, timeout=5)  # needs 3.3 s at that rate
    await broker.admit(late)
    clock.advance(3)  # 2 s left
    assert await broker.claim(W, ["m"], timeout=0.1) is None
    assert (await broker.get(late.id)).state is JobState.EXPIRED  # type: ignore[union-attr]
    assert (await broker.stats())["m"].broken_promises == 3


async def test_expired_job_is_never_claimed(broker: Broker, clock: FakeClock) -> None:
    job = make_job(clock, timeout=10)
    await broker.admit(job)
    clock.advance(11)  # no maintenance round in between: claim itself must check
    assert await broker.claim(W, ["m"], timeout=0.1) is None
    assert (await broker.get(job.id)).state is JobState.EXPIRED  # type: ignore[union-attr]


async def test_lease_expiry_redelivers(broker: Broker, clock: FakeClock) -> None:
    job = make_job(clock, max_attempts=2)
    await broker.admit(job)
    await broker.claim(W, ["m"], timeout=1.0)
    clock.advance(6)
    await broker.maintain()
    assert (await broker.get(job.id)).state is JobState.QUEUED  # type: ignore[union-attr]
    again = await broker.claim("worker-2", ["m"], timeout=1.0)
    assert again is not None and again.id == job.id and again.attempts == 2
    # The first worker's lease is gone: its late result is refused.
    assert await broker.finish(job.id, W, JobState.SUCCEEDED, result={}) is None
    clock.advance(6)
    await broker.maintain()
    dead = await broker.get(job.id)
    assert dead is not None and dead.state is JobState.FAILED
    assert dead.error is not None and dead.error.code == "attempts_exhausted"
    types = [e.type for e in await drain_events(broker, job.id)]
    assert types.count(EventType.RETRY) == 1 and types[-1] is EventType.ERROR


async def test_requeued_job_past_its_deadline_expires(broker: Broker, clock: FakeClock) -> None:
    job = make_job(clock, timeout=8)
    await broker.admit(job)
    await broker.claim(W, ["m"], timeout=1.0)
    clock.advance(10)  # its lease and its deadline both pass while it runs
    await broker.maintain()
    await broker.maintain()
    got = await broker.get(job.id)
    assert got is not None and got.state is JobState.EXPIRED


async def test_heartbeat_keeps_lease(broker: Broker, clock: FakeClock) -> None:
    job = make_job(clock)
    await broker.admit(job)
    await broker.claim(W, ["m"], timeout=1.0)
    for _ in range(4):
        clock.advance(3)
        assert await broker.heartbeat(W, [job.id]) == set()
        await broker.maintain()
    got = await broker.get(job.id)
    assert got is not None and got.state is JobState.RUNNING and got.attempts == 1
    assert await broker.heartbeat("intruder", [job.id]) == {job.id}


async def test_release_hands_a_job_back_to_the_head_of_its_queue(broker: Broker, clock: FakeClock) -> None:
    first, second = make_job(clock), make_job(clock)
    await broker.admit(first)
    clock.advance(1)
    await broker.admit(second)
    claimed = await broker.claim(W, ["m"], timeout=1.0)
    assert claimed is not None and claimed.id == first.id
    await broker.publish(first.id, EventType.TOKEN, {"choices": [{"index": 0, "delta": {"content": "a"}}]})
    # Only the holder of the lease may hand it back.
    assert await broker.release(first.id, "intruder") is False
    assert await broker.release(first.id, W) is True
    got = await broker.get(first.id)
    assert got is not None and got.state is JobState.QUEUED and got.attempts == 0
    assert await broker.position(first.id) == 0  # at the head, ahead of the later job
    assert await broker.release(first.id, W) is False  # not running any more
    # The old lease is void: a late result of the worker that let it go is refused.
    assert await broker.finish(first.id, W, JobState.SUCCEEDED, result={}) is None
    again = await broker.claim("worker-2", ["m"], timeout=1.0)
    assert again is not None and again.id == first.id and again.attempts == 1
    assert await broker.heartbeat("worker-2", [first.id]) == set()
    done = await broker.finish(first.id, "worker-2", JobState.SUCCEEDED, result={})
    assert done is not None and done.state is JobState.SUCCEEDED and done.attempts == 1
    types = [e.type for e in await drain_events(broker, first.id)]
    assert types == [
        EventType.QUEUED,
        EventType.STARTED,
        EventType.TOKEN,
        EventType.RETRY,
        EventType.STARTED,
        EventType.DONE,
    ]
    stats = (await broker.stats())["m"]
    assert stats.running_jobs == 0 and stats.queued_jobs == 1  # the second job, still queued


async def test_results_expire(broker: Broker, clock: FakeClock) -> None:
    job = make_job(clock)
    await broker.admit(job)
    await broker.claim(W, ["m"], timeout=1.0)
    await broker.finish(job.id, W, JobState.FAILED, error=JobError("boom", "server_error", "x"))
    clock.advance(30)
    await broker.maintain()
    assert (await broker.get(job.id)) is not None
    clock.advance(31)
    await broker.maintain()
    assert await broker.get(job.id) is None


async def test_wait(broker: Broker, clock: FakeClock) -> None:
    job = make_job(clock)
    await broker.admit(job)
    pending = await broker.wait(job.id, timeout=0.1)
    assert pending is not None and pending.state is JobState.QUEUED
    waiter = asyncio.create_task(broker.wait(job.id, timeout=5.0))
    await broker.claim(W, ["m"], timeout=1.0)
    await broker.finish(job.id, W, JobState.SUCCEEDED, result={"ok": True})
    done = await asyncio.wait_for(waiter, 5.0)
    assert done is not None and done.state is JobState.SUCCEEDED
    assert await broker.wait("job_unknown", timeout=0.1) is None


async def test_registry(broker: Broker, clock: FakeClock) -> None:
    await broker.register("w1", {"m": 4})
    await broker.register("w2", {"m": 2, "x": 1})
    assert await broker.served_models() == {"m": 6, "x": 1}
    await broker.unregister("w2")
    assert await broker.served_models() == {"m": 4}
    clock.advance(60)  # no heartbeat for longer than a lease: the worker is presumed dead
    assert await broker.served_models() == {}


async def test_what_workers_know_of_their_models_counts_while_they_live(
    broker: Broker, clock: FakeClock
) -> None:
    await broker.register("w1", {"m": 4})
    await broker.describe_models("w1", {"m": ModelInfo(created=100, context_window=4096)})
    await broker.register("w2", {"m": 2, "x": 1})
    learned = ModelInfo(created=50, context_window=8192, output_tokens=99, output_samples=7)
    await broker.describe_models("w2", {"m": learned, "x": ModelInfo(created=7)})
    info = await broker.model_info()
    assert info == {
        "m": ModelInfo(created=50, context_window=4096, output_tokens=99, output_samples=7),
        "x": ModelInfo(created=7),
    }
    # A newer account replaces the worker's previous one.
    await broker.describe_models("w2", {"m": learned})
    assert set(await broker.model_info()) == {"m"}
    await broker.unregister("w2")
    assert await broker.model_info() == {"m": ModelInfo(created=100, context_window=4096)}
    clock.advance(60)  # no heartbeat for longer than a lease: what the worker said goes with it
    assert await broker.model_info() == {}


async def test_a_tenants_jobs_are_listed_newest_first_in_pages(broker: Broker, clock: FakeClock) -> None:
    mine = []
    for _ in range(5):
        mine.append(make_job(clock, tenant="a"))
        await broker.admit(mine[-1])
        clock.advance(0.01)  # little: a queue standing long would refuse the next
    theirs = make_job(clock, tenant="b")
    await broker.admit(theirs)
    newest_first = [j.id for j in reversed(mine)]

    first = await broker.list_jobs("a", 2)
    assert [j.id for j in first.jobs] == newest_first[:2] and first.has_more
    second = await broker.list_jobs("a", 2, after=first.jobs[-1].id)
    assert [j.id for j in second.jobs] == newest_first[2:4] and second.has_more
    last = await broker.list_jobs("a", 2, after=second.jobs[-1].id)
    assert [j.id for j in last.jobs] == newest_first[4:] and not last.has_more
    whole = await broker.list_jobs("a", 5)
    assert [j.id for j in whole.jobs] == newest_first and not whole.has_more
    assert whole.jobs[0].state is JobState.QUEUED and whole.jobs[0].tenant == "a"

    # Only one's own jobs; another tenant's id, or an unknown one, is no cursor.
    assert [j.id for j in (await broker.list_jobs("b", 10)).jobs] == [theirs.id]
    assert (await broker.list_jobs("a", 10, after=theirs.id)).jobs == []
    assert (await broker.list_jobs("a", 10, after="job_unknown")).jobs == []
    assert (await broker.list_jobs("nobody", 10)).jobs == []


async def test_jobs_of_the_same_instant_list_in_one_order(broker: Broker, clock: FakeClock) -> None:
    jobs = [make_job(clock, tenant="a") for _ in range(4)]
    for job in jobs:
        await broker.admit(job)
    expected = sorted((j.id for j in jobs), reverse=True)
    assert [j.id for j in (await broker.list_jobs("a", 10)).jobs] == expected
    page = await broker.list_jobs("a", 2)
    rest = await broker.list_jobs("a", 2, after=page.jobs[-1].id)
    assert [j.id for j in [*page.jobs, *rest.jobs]] == expected


async def test_an_expired_job_leaves_the_list(broker: Broker, clock: FakeClock) -> None:
    old = make_job(clock, tenant="a")
    await broker.admit(old)
    await broker.claim(W, ["m"], timeout=1.0)
    await broker.finish(old.id, W, JobState.SUCCEEDED, result={"ok": True})
    clock.advance(1.0)
    new = make_job(clock, tenant="a")
    await broker.admit(new)
    assert [j.id for j in (await broker.list_jobs("a", 1)).jobs] == [new.id]
    assert (await broker.list_jobs("a", 1)).has_more
    clock.advance(61)  # past the result TTL
    await broker.maintain()
    page = await broker.list_jobs("a", 10)
    assert [j.id for j in page.jobs] == [new.id] and not page.has_more
    assert (await broker.list_jobs("a", 1)).has_more is False


async def test_position(broker: Broker, clock: FakeClock) -> None:
    jobs = [make_job(clock, tenant="a") for _ in range(3)]
    for job in jobs:
        await broker.admit(job)
    assert [await broker.position(j.id) for j in jobs] == [0, 1, 2]
    await broker.claim(W, ["m"], timeout=1.0)
    assert await broker.position(jobs[0].id) is None
    assert await broker.position(jobs[2].id) == 1


async def test_deadline_unmeetable_after_measuring(broker: Broker, clock: FakeClock) -> None:
    await broker.register(W, {"m": 1})
    # Teach the broker the drain rate: 100 cost units per second on one slot.
    for _ in range(3):
        job = make_job(clock, prompt_tokens=50, max_tokens=50)
        await broker.admit(job)
        await broker.claim(W, ["m"], timeout=1.0)
        clock.advance(1.0)
        await broker.finish(job.id, W, JobState.SUCCEEDED, result={})
        await broker.register(W, {"m": 1})
    for _ in range(10):
        await broker.admit(make_job(clock, prompt_tokens=50, max_tokens=50, timeout=600))
    with pytest.raises(Refused) as info:
        await broker.admit(make_job(clock, prompt_tokens=50, max_tokens=50, timeout=5))
    assert info.value.status == 503 and info.value.code == "deadline_unmeetable"
    # 10 queued seconds of work ahead, 5 s of budget, 1 s of own service: it is told to come back
    # when those 10 s of work have started (the requests arriving meanwhile would take the room
    # that frees sooner).
    assert 8 <= info.value.retry_after_s <= 12
    with pytest.raises(Refused) as hopeless:
        await broker.admit(make_job(clock, prompt_tokens=500, max_tokens=500, timeout=5))
    assert hopeless.value.should_retry is False


async def test_abort_signal_wakes_on_cancel(broker: Broker, clock: FakeClock) -> None:
    job = make_job(clock)
    await broker.admit(job)
    await broker.claim(W, ["m"], timeout=1.0)
    waiter = asyncio.create_task(broker.wait_abort_signal(10.0))
    await asyncio.sleep(0.1)
    assert not waiter.done()
    await broker.cancel(job.id)
    await asyncio.wait_for(waiter, 2.0)  # well before its own timeout


async def test_lost_job_goes_first_for_its_tenant(broker: Broker, clock: FakeClock) -> None:
    first, second = make_job(clock, tenant="a"), make_job(clock, tenant="a")
    await broker.admit(first)
    await broker.admit(second)
    assert (await broker.claim(W, ["m"], timeout=1.0)).id == first.id  # type: ignore[union-attr]
    clock.advance(6)
    await broker.maintain()
    assert await broker.position(first.id) == 0 and await broker.position(second.id) == 1
    again = await broker.claim("worker-2", ["m"], timeout=1.0)
    assert again is not None and again.id == first.id and again.attempts == 2


async def test_cancel_and_expiry_free_room(broker: Broker, clock: FakeClock) -> None:
    jobs = [make_job(clock, model="small", timeout=10 + 10 * i) for i in range(3)]
    for job in jobs:
        await broker.admit(job)
    await broker.cancel(jobs[0].id)
    await broker.admit(make_job(clock, model="small"))
    clock.advance(25)  # jobs[1] expires
    await broker.maintain()
    stats = (await broker.stats())["small"]
    assert (stats.queued_jobs, stats.queued_tokens) == (2, 60), stats
    # Room for a third job again. It is a high one: nothing of its class waits ahead of it, so
    # the queue policy (codel would hold a queue that stood still for 25 s to its target) has no
    # say, while the model's bound counts every class.
    await broker.admit(make_job(clock, model="small", priority="high"))
    with pytest.raises(Refused) as full:
        await broker.admit(make_job(clock, model="small", priority="high"))
    assert full.value.code == "queue_full" and "model's queue is full" in full.value.message


async def test_weighted_tenant_gets_its_share(broker: Broker, clock: FakeClock) -> None:
    for _ in range(12):
        for tenant, weight in (("heavy", 2.0), ("light", 1.0)):
            job = make_job(clock, tenant=tenant)
            job.weight = weight
            await broker.admit(job)
    order = [(await broker.claim(W, ["m"], timeout=1.0)).tenant for _ in range(9)]  # type: ignore[union-attr]
    assert order.count("heavy") == 6 and order.count("light") == 3


# --- per-tenant limits, enforced atomically with admission ------------------------------


async def test_requests_per_minute(broker: Broker, clock: FakeClock) -> None:
    policy = TenantLimits("t", rpm=2)
    first = await broker.admit(make_job(clock), policy)
    assert first.rate is not None and first.rate.remaining_requests == 1
    await broker.admit(make_job(clock), policy)
    with pytest.raises(Refused) as info:
        await broker.admit(make_job(clock), policy)
    assert info.value.status == 429 and info.value.code == "rate_limit_exceeded"
    assert info.value.retry_after_s == pytest.approx(30, abs=1)  # two a minute: one every 30 s
    assert info.value.rate is not None
    headers = info.value.rate.headers()
    assert headers["x-ratelimit-limit-requests"] == "2" and headers["x-ratelimit-remaining-requests"] == "0"
    other = await broker.admit(make_job(clock, tenant="other"), TenantLimits("other", rpm=2))
    assert not other.duplicate  # limits are per tenant
    # The three queued jobs start (a queue that stood still for 30 s would be refused as
    # standing, which is the queue policy's business, not this test's).
    for _ in range(3):
        assert await broker.claim(W, ["m"], timeout=1.0) is not None
    clock.advance(30)
    await broker.admit(make_job(clock), policy)


async def test_tokens_per_minute_settled_with_real_usage(broker: Broker, clock: FakeClock) -> None:
    policy = TenantLimits("t", tpm=100)
    job = make_job(clock, prompt_tokens=10, max_tokens=50)
    await broker.admit(job, policy)
    with pytest.raises(Refused) as info:
        await broker.admit(make_job(clock, prompt_tokens=10, max_tokens=50), policy)
    assert info.value.code == "rate_limit_exceeded" and "tokens" in info.value.message
    await broker.claim(W, ["m"], timeout=1.0)
    # It used 20 of the 60 tokens charged: the other 40 come back.
    await broker.finish(job.id, W, JobState.SUCCEEDED, result={}, usage={"total_tokens": 20})
    await broker.admit(make_job(clock, prompt_tokens=10, max_tokens=50), policy)
    with pytest.raises(Refused) as hopeless:
        await broker.admit(make_job(clock, prompt_tokens=100, max_tokens=100), policy)
    assert hopeless.value.should_retry is False  # larger than a whole minute's allowance


async def test_usage_above_the_charge_is_taken_after_the_fact(broker: Broker, clock: FakeClock) -> None:
    policy = TenantLimits("t", tpm=1000)
    job = make_job(clock, prompt_tokens=10, max_tokens=50)
    first = await broker.admit(job, policy)
    assert first.rate is not None and first.rate.remaining_tokens == 940
    await broker.claim(W, ["m"], timeout=1.0)
    # The estimate was short: the engine read and wrote 260 tokens, 200 more than charged.
    await broker.finish(job.id, W, JobState.SUCCEEDED, result={}, usage={"total_tokens": 260})
    after = await broker.admit(make_job(clock, prompt_tokens=10, max_tokens=50), policy)
    assert after.rate is not None and after.rate.remaining_tokens == 940 - 200 - 60


async def test_a_debt_makes_the_next_requests_wait(broker: Broker, clock: FakeClock) -> None:
    policy = TenantLimits("t", tpm=120)  # two a second
    job = make_job(clock, prompt_tokens=10, max_tokens=50)
    await broker.admit(job, policy)
    await broker.claim(W, ["m"], timeout=1.0)
    await broker.finish(job.id, W, JobState.SUCCEEDED, result={}, usage={"total_tokens": 300})
    # 60 left, 240 over the charge: the bucket stands at -180, below zero.
    with pytest.raises(Refused) as info:
        await broker.admit(make_job(clock, prompt_tokens=10, max_tokens=20), policy)
    assert info.value.code == "rate_limit_exceeded" and info.value.should_retry
    assert info.value.retry_after_s == pytest.approx((180 + 30) / 2, abs=1)
    assert info.value.rate is not None and info.value.rate.remaining_tokens == -180
    assert info.value.rate.headers()["x-ratelimit-remaining-tokens"] == "0"
    clock.advance(100)  # 200 refilled: 20 in the bucket, not yet 30
    with pytest.raises(Refused):
        await broker.admit(make_job(clock, prompt_tokens=10, max_tokens=20), policy)
    clock.advance(6)
    await broker.admit(make_job(clock, prompt_tokens=10, max_tokens=20), policy)


async def test_max_queued(broker: Broker, clock: FakeClock) -> None:
    policy = TenantLimits("t", max_queued=2)
    for _ in range(2):
        await broker.admit(make_job(clock), policy)
    with pytest.raises(Refused) as info:
        await broker.admit(make_job(clock), policy)
    assert info.value.status == 429 and info.value.code == "too_many_queued"
    assert 0 < info.value.retry_after_s <= 120
    await broker.claim(W, ["m"], timeout=1.0)  # one starts: room for one more
    await broker.admit(make_job(clock), policy)


async def test_max_concurrent(broker: Broker, clock: FakeClock) -> None:
    capped = TenantLimits("capped", max_concurrent=1)
    a1, a2 = make_job(clock, tenant="capped"), make_job(clock, tenant="capped")
    b = make_job(clock, tenant="free")
    for job, policy in ((a1, capped), (a2, capped), (b, TenantLimits("free"))):
        await broker.admit(job, policy)
    assert (await broker.claim(W, ["m"], timeout=1.0)).id == a1.id  # type: ignore[union-attr]
    assert (await broker.claim(W, ["m"], timeout=1.0)).id == b.id  # type: ignore[union-attr]
    assert await broker.claim(W, ["m"], timeout=0.2) is None  # a2 waits for a1
    await broker.finish(a1.id, W, JobState.SUCCEEDED, result={})
    assert (await broker.claim(W, ["m"], timeout=1.0)).id == a2.id  # type: ignore[union-attr]


async def _a_claim_waits_behind_a_capped_tenant(
    broker: Broker, clock: FakeClock
) -> tuple[Job, Job, asyncio.Task[Job | None]]:
    """A capped tenant (one at a time) with a running job and a held-back queued one, and a claim
    (up to 30 s) that has looked, found nothing it may take, and waits (waited on, not slept on)."""
    capped = TenantLimits("capped", max_concurrent=1)
    running = make_job(clock, tenant="capped", max_attempts=1)
    held = make_job(clock, tenant="capped")
    await broker.admit(running, capped)
    assert (await broker.claim(W, ["m"], timeout=1.0)).id == running.id  # type: ignore[union-attr]
    await broker.admit(held, capped)
    waiting = asyncio.create_task(broker.claim(W, ["m"], timeout=30.0))
    await wait_until(lambda: claims_waiting(broker), timeout=10.0)
    assert not waiting.done()
    return running, held, waiting


@pytest.mark.parametrize("end", ["finish", "cancel", "lost"])
async def test_the_end_of_a_capped_tenants_running_job_wakes_the_claim_its_held_job_waits_for(
    broker: Broker, clock: FakeClock, end: str
) -> None:
    """A claim waiting (up to 30 s) while the only queued job is held back by its tenant's cap gets
    that job when the tenant's running job ends (finished, cancelled, or its lease lost on its last
    attempt), not at the claim's bound (nor, on Redis, at the end of its 10 s BZPOPMIN)."""
    running, held, waiting = await _a_claim_waits_behind_a_capped_tenant(broker, clock)
    try:
        if end == "finish":
            await broker.finish(running.id, W, JobState.SUCCEEDED, result={})
        elif end == "cancel":
            await broker.cancel(running.id)
        else:
            clock.advance(6)  # past its lease, no heartbeat: its one attempt fails
            await broker.maintain()
            assert (await broker.get(running.id)).state is JobState.FAILED  # type: ignore[union-attr]
        claimed = await asyncio.wait_for(waiting, 5.0)
        assert claimed is not None and claimed.id == held.id
    finally:
        waiting.cancel()


async def test_a_job_admitted_while_the_models_queue_holds_only_held_back_jobs_wakes_the_claim(
    broker: Broker, clock: FakeClock
) -> None:
    """A claim waiting (up to 30 s) while the model's only queued job is held back by its tenant's
    cap gets another tenant's job admitted then, not at the claim's bound (nor, on Redis, at the end
    of its 10 s BZPOPMIN): the queue was not empty, but nothing in it could be claimed."""
    _, _, waiting = await _a_claim_waits_behind_a_capped_tenant(broker, clock)
    try:
        other = make_job(clock, tenant="other")
        await broker.admit(other)
        claimed = await asyncio.wait_for(waiting, 5.0)
        assert claimed is not None and claimed.id == other.id
    finally:
        waiting.cancel()


async def test_refused_requests_are_not_charged(broker: Broker, clock: FakeClock) -> None:
    policy = TenantLimits("t", rpm=5, max_queued=1)
    await broker.admit(make_job(clock), policy)
    for _ in range(3):
        with pytest.raises(Refused):
            await broker.admit(make_job(clock), policy)
    ok = await broker.claim(W, ["m"], timeout=1.0)
    assert ok is not None
    adm = await broker.admit(make_job(clock), policy)
    assert adm.rate is not None and adm.rate.remaining_requests == 3


# --- limits that hold: each key's buckets are its own -------------------------------------


async def _admitted(
    broker: Broker, clock: FakeClock, keys: list[TenantLimits], n: int, **job: Any
) -> dict[str, int]:
    """Admit ``n`` jobs of tenant t, sent with ``keys`` in turn at one instant: how many each key got
    in (every refusal is its rate limit). Each admitted job starts at once: the queue stays empty,
    and the queue policy has no say."""
    got = {k.bucket_id: 0 for k in keys}
    for i in range(n):
        limits = keys[i % len(keys)]
        try:
            await broker.admit(make_job(clock, **job), limits)
        except Refused as exc:
            assert exc.code == "rate_limit_exceeded", exc.message
        else:
            got[limits.bucket_id] += 1
            assert await broker.claim(W, ["m"], timeout=1.0) is not None
    return got


async def test_alternating_keys_cannot_reset_their_buckets(broker: Broker, clock: FakeClock) -> None:
    """Two keys of one tenant with different limits, used in turn: each key gets its own minute's
    allowance and no more (the attack: alternating keys let 80 of 80 requests in where 30 were
    allowed, as each request installed its key's limits afresh)."""
    a, b = TenantLimits("t", rpm=10, key="a"), TenantLimits("t", rpm=20, key="b")
    assert await _admitted(broker, clock, [a, b], 80) == {"a": 10, "b": 20}
    # The same with tokens: 30 a job, 300 and 600 a minute.
    c, d = TenantLimits("t", tpm=300, key="c"), TenantLimits("t", tpm=600, key="d")
    got = await _admitted(broker, clock, [c, d], 80, prompt_tokens=10, max_tokens=20)
    assert got == {"c": 10, "d": 20}
    # Any order: three in a row of one key, then the other; nothing refills at this instant.
    assert await _admitted(broker, clock, [a, a, a, b, d, c], 30) == {"a": 0, "b": 0, "c": 0, "d": 0}
    clock.advance(6.0)  # a tenth of a minute: one request for a, two for b
    assert await _admitted(broker, clock, [b, a], 10) == {"a": 1, "b": 2}


async def test_a_changed_limit_keeps_its_bucket_level(broker: Broker, clock: FakeClock) -> None:
    """A key whose limits change in the configuration keeps what its bucket holds: a change never
    hands out a fresh minute; the bucket refills at the new rate up to the new size."""
    ten = TenantLimits("t", rpm=10, tpm=1000, key="k")
    assert await _admitted(broker, clock, [ten], 12) == {"k": 10}
    twenty = TenantLimits("t", rpm=20, tpm=1000, key="k")
    assert await _admitted(broker, clock, [twenty], 5) == {"k": 0}  # still empty, not full
    clock.advance(6.0)  # at the new rate: two
    assert await _admitted(broker, clock, [twenty], 5) == {"k": 2}
    clock.advance(60.0)
    five = TenantLimits("t", rpm=5, tpm=1000, key="k")  # smaller: full is its own size
    assert await _admitted(broker, clock, [five], 8) == {"k": 5}
    # The tokens bucket alike: 300 tokens taken, then the limit doubles.
    clock.advance(60.0)
    small = TenantLimits("t", tpm=300, key="j")
    assert await _admitted(broker, clock, [small], 12, prompt_tokens=10, max_tokens=20) == {"j": 10}
    big = TenantLimits("t", tpm=600, key="j")
    assert await _admitted(broker, clock, [big], 3, prompt_tokens=10, max_tokens=20) == {"j": 0}


async def test_usage_is_settled_with_the_buckets_it_was_charged_to(broker: Broker, clock: FakeClock) -> None:
    a, b = TenantLimits("t", tpm=100, key="a"), TenantLimits("t", tpm=100, key="b")
    job = make_job(clock, prompt_tokens=10, max_tokens=50)
    await broker.admit(job, a)
    await broker.admit(make_job(clock, prompt_tokens=10, max_tokens=50), b)
    assert (await broker.claim(W, ["m"], timeout=1.0)).id == job.id  # type: ignore[union-attr]
    # It used 20 of the 60 tokens charged: a gets 40 back (40 + 40 = 80 left), b nothing (40).
    await broker.finish(job.id, W, JobState.SUCCEEDED, result={}, usage={"total_tokens": 20})
    got = await _admitted(broker, clock, [b, a], 2, prompt_tokens=10, max_tokens=50)
    assert got == {"a": 1, "b": 0}


# --- work that is not ahead does not delay anyone's admission -----------------------------


async def _measured(broker: Broker, clock: FakeClock, slots: int) -> None:
    """A model m on ``slots`` slots whose measured drain is 100 tokens a second per slot."""
    await broker.register(W, {"m": slots})
    warm = make_job(clock, tenant="warm", prompt_tokens=50, max_tokens=50)
    await broker.admit(warm)
    await broker.claim(W, ["m"], timeout=1.0)
    clock.advance(1.0)
    await broker.finish(warm.id, W, JobState.SUCCEEDED, result={})


async def test_jobs_held_back_by_a_tenants_cap_are_not_ahead_of_others(
    broker: Broker, clock: FakeClock
) -> None:
    """A tenant held to one job at a time that queues many long ones delays nobody else: its jobs
    beyond the cap wait for its own running job, not for the queue (the attack: 200 such jobs made
    every other tenant's request a 503 deadline_unmeetable with 15 of 16 slots idle)."""
    await _measured(broker, clock, slots=16)
    capped = TenantLimits("capped", max_concurrent=1)
    for _ in range(50):
        await broker.admit(make_job(clock, tenant="capped", max_tokens=4000), capped)
    first = await broker.claim(W, ["m"], timeout=1.0)
    assert first is not None and first.tenant == "capped"
    # 49 jobs of 4010 tokens wait: 123 s at 1600 tokens a second, had they been ahead.
    other = await broker.admit(make_job(clock, tenant="other", timeout=30), TenantLimits("other"))
    assert (other.position, other.estimated_start_s) == (0, 0.0)
    # Behind other's job, a third tenant's waits for that one only.
    third = await broker.admit(make_job(clock, tenant="third", priority="low", timeout=30))
    assert third.position == 1 and third.estimated_start_s == pytest.approx(30 / 1600)
    # The capped tenant's own jobs are all ahead of its next one.
    own = await broker.admit(make_job(clock, tenant="capped", max_tokens=4000, priority="low"), capped)
    assert own.position == 49 + 2
    # A tenant without a cap that queued three jobs at once: in the fair order only its head job
    # (tied with the newcomer's start tag, and in the heap first) goes before a newcomer's.
    for _ in range(3):
        await broker.admit(make_job(clock, tenant="free", max_tokens=4000), TenantLimits("free"))
    later = await broker.admit(make_job(clock, tenant="later", timeout=300), TenantLimits("later"))
    assert later.position == 1 + 1 and later.estimated_start_s == pytest.approx((30 + 4010) / 1600)


async def test_a_capped_tenant_counts_as_far_as_its_cap_lets_it_run(broker: Broker, clock: FakeClock) -> None:
    """Room for two more of its jobs: those two are ahead (its first two, higher class first), the
    rest are not; once its running jobs end, more of them are."""
    await _measured(broker, clock, slots=16)
    three = TenantLimits("c", max_concurrent=3)
    await broker.admit(make_job(clock, tenant="c", max_tokens=990), three)
    running = await broker.claim(W, ["m"], timeout=1.0)
    assert running is not None and running.tenant == "c"
    for max_tokens, priority in ((490, "normal"), (1990, "normal"), (2990, "normal"), (90, "high")):
        await broker.admit(make_job(clock, tenant="c", max_tokens=max_tokens, priority=priority), three)
    # A newcomer's job goes before all of c's normal ones (c has had its share: its first job ran),
    # so only c's high one (100) is ahead of it.
    adm = await broker.admit(make_job(clock, tenant="o", max_tokens=4990), TenantLimits("o"))
    assert adm.position == 1 and adm.estimated_start_s == pytest.approx(100 / 1600)
    # o's next job comes after its first (5000) and after all of c's normal ones in the fair order,
    # but c may start only one of those (the room its high one leaves): its high one (100), o's
    # first job and c's first normal one (500).
    adm = await broker.admit(make_job(clock, tenant="o", max_tokens=90), TenantLimits("o"))
    assert adm.position == 3 and adm.estimated_start_s == pytest.approx(5600 / 1600)
    # Ahead of a high job: only the high one, though room is left for one more.
    high = await broker.admit(make_job(clock, tenant="h", max_tokens=90, priority="high"))
    assert high.position == 1 and high.estimated_start_s == pytest.approx(100 / 1600)
    await broker.finish(running.id, W, JobState.SUCCEEDED, result={})
    # Room for three now: its high one, then its first two normal ones (500 and 2000); with h's
    # and o's jobs, six ahead of a low one.
    after = await broker.admit(make_job(clock, tenant="a", max_tokens=90, priority="low"))
    assert after.position == 6
    assert after.estimated_start_s == pytest.approx((100 + 100 + 5000 + 100 + 500 + 2000) / 1600)


# --- jobs that cannot finish in time are not dispatched ------------------------------


async def test_job_that_cannot_finish_is_not_dispatched(broker: Broker, clock: FakeClock) -> None:
    await broker.register(W, {"m": 1})
    # Measure: 100 cost units take 1 s on a slot.
    warm = make_job(clock, prompt_tokens=50, max_tokens=50)
    await broker.admit(warm)
    await broker.claim(W, ["m"], timeout=1.0)
    clock.advance(1.0)
    await broker.finish(warm.id, W, JobState.SUCCEEDED, result={})
    short = make_job(clock, prompt_tokens=50, max_tokens=250, timeout=10)  # needs ~3 s
    fine = make_job(clock, prompt_tokens=50, max_tokens=50, timeout=60)
    await broker.admit(short)
    await broker.admit(fine)
    clock.advance(8)  # 2 s left: not enough for 3 s of generation
    claimed = await broker.claim(W, ["m"], timeout=1.0)
    assert claimed is not None and claimed.id == fine.id
    dropped = await broker.get(short.id)
    assert dropped is not None and dropped.state is JobState.EXPIRED and dropped.started_at is None


# --- API keys stored by an administrator ----------------------------------------


async def test_key_store(broker: Broker) -> None:
    assert await broker.get_key("h1") is None
    await broker.put_key("h1", {"tenant": "acme", "rpm": 5})
    await broker.put_key("h2", {"tenant": "beta"})
    assert await broker.get_key("h1") == {"tenant": "acme", "rpm": 5}
    assert set(await broker.list_keys()) == {"h1", "h2"}
    assert await broker.delete_key("h1") and not await broker.delete_key("h1")
    assert await broker.get_key("h1") is None and list(await broker.list_keys()) == ["h2"]


# --- open connections per API key --------------------------------------------------------


async def test_connection_cap_per_key(broker: Broker) -> None:
    assert await broker.open_connection("k1", "c1", 2)
    assert await broker.open_connection("k1", "c2", 2)
    assert not await broker.open_connection("k1", "c3", 2)  # refused, and nothing taken
    assert await broker.open_connections("k1") == 2
    assert await broker.open_connection("k2", "c1", 1)  # every key has its own count
    await broker.close_connection("k1", "c1")
    await broker.close_connection("k1", "c1")  # twice: nothing more happens
    await broker.close_connection("k9", "c1")  # never counted: nothing happens
    assert await broker.open_connections("k1") == 1
    assert await broker.open_connection("k1", "c3", 2)
    assert not await broker.open_connection("k1", "c4", 2)
    # A lower cap (the key's grant changed) refuses until enough have closed.
    assert not await broker.open_connection("k1", "c4", 1)
    for conn in ("c2", "c3"):
        await broker.close_connection("k1", conn)
    await broker.close_connection("k2", "c1")
    assert await broker.open_connections("k1") == await broker.open_connections("k2") == 0


async def test_connection_cap_is_atomic(broker: Broker) -> None:
    # Gateways racing for the last slots: exactly the cap gets one.
    taken = await asyncio.gather(*(broker.open_connection("k", f"c{i}", 3) for i in range(20)))
    assert sum(taken) == 3 and await broker.open_connections("k") == 3


async def test_connection_slots_lapse_unless_renewed(broker: Broker, clock: FakeClock) -> None:
    lease = broker.settings.lease_s
    assert await broker.open_connection("k", "kept", 2)
    assert await broker.open_connection("k", "dead", 2)  # its gateway dies: nobody renews it
    clock.advance(lease * 0.6)
    await broker.renew_connections({"k": ["kept"], "other": []})
    clock.advance(lease * 0.6)
    assert await broker.open_connections("k") == 1  # the dead gateway's slot is back
    assert await broker.open_connection("k", "new", 2)
    assert not await broker.open_connection("k", "more", 2)
    clock.advance(lease * 1.1)  # nobody renews anything now
    assert await broker.open_connections("k") == 0
    # A connection that outlived its lease (its gateway lost the broker for a while) is still
    # open: renewing counts it again.
    await broker.renew_connections({"k": ["kept"]})
    assert await broker.open_connections("k") == 1
    assert not await broker.open_connection("k", "x", 1)
