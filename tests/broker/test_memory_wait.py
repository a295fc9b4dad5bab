"""The memory broker's wait for a job's end (``MemoryBroker.wait``): a future a waiter, set by the
end; waiters that gave up neither hold back nor cancel the others."""

from __future__ import annotations

import asyncio
import contextlib
import random
from collections.abc import Callable
from typing import Any

from sluice.broker import memory
from sluice.broker.memory import MemoryBroker
from sluice.core.admission import Refused
from sluice.core.job import JobState
from sluice.core.ratelimit import TenantLimits
from tests.broker.brokers import make_settings
from tests.helpers import FakeClock, make_job

W = "worker-1"


async def test_waiters_that_gave_up_leave_the_others_waiting_for_the_end() -> None:
    clock = FakeClock()
    broker = MemoryBroker(make_settings(clock))
    job = make_job(clock)
    await broker.admit(job)
    assert await broker.claim(W, ["m"], timeout=1.0) is not None
    for _ in range(20):  # long polls that time out before the end
        got = await broker.wait(job.id, 0.001)
        assert got is not None and got.state is JobState.RUNNING
    rec = broker._records[job.id]
    assert rec.enders is not None and len(rec.enders) <= 8  # the given-up ones dropped
    waiters = [asyncio.create_task(broker.wait(job.id, 10)) for _ in range(3)]
    cancelled = asyncio.create_task(broker.wait(job.id, 10))
    await asyncio.sleep(0)
    cancelled.cancel()
    await asyncio.sleep(0)
    assert not any(w.done() for w in waiters)
    # Each waiter's bound is a timer of its own; the cancelled one took its timer with it.
    assert live_timers(memory._gave_up) == 3
    await broker.finish(job.id, W, JobState.SUCCEEDED, result={})
    done = await asyncio.wait_for(asyncio.gather(*waiters), 5)
    assert [d.state for d in done if d is not None] == [JobState.SUCCEEDED] * 3
    assert live_timers(memory._gave_up) == 0  # the end's waiters leave no timer armed
    assert cancelled.cancelled() and broker._records[job.id].enders is None
    ended = await broker.wait(job.id, 10)  # ended already: at once
    assert ended is not None and ended.state is JobState.SUCCEEDED


# A claim's wait for work: a future a claim, woken by an admission, bounded by a timer.


def live_timers(callback: Callable[..., Any]) -> int:
    """The running loop's timers still armed to call ``callback``: a wait that ended without
    cancelling its timer leaves one (a handle the loop holds until it is due, per claim or stream).
    Read off the asyncio loop's heap of timers, which these tests run on."""
    loop: Any = asyncio.get_running_loop()
    return sum(not h.cancelled() and getattr(h, "_callback", None) is callback for h in loop._scheduled)


async def test_claims_that_ran_out_or_were_cancelled_leave_nothing_waiting_and_miss_no_job() -> None:
    clock = FakeClock()
    broker = MemoryBroker(make_settings(clock))
    for _ in range(20):  # an idle dispatcher's claims, each running out
        assert await broker.claim(W, ["m"], timeout=0.001) is None
    assert broker._claimers == []
    cancelled = asyncio.create_task(broker.claim(W, ["m"], timeout=10))
    first, second = (asyncio.create_task(broker.claim(W, ["m"], timeout=10)) for _ in range(2))
    await asyncio.sleep(0)
    cancelled.cancel()
    await asyncio.sleep(0)
    # The cancelled claim took its future off the list and its timer with it.
    assert len(broker._claimers) == 2 and not first.done() and not second.done()
    assert cancelled.cancelled() and live_timers(memory._ran_out) == 2
    job = make_job(clock)
    await broker.admit(job)
    # The one job goes to one live claim; the other looks, finds none and waits on.
    done, pending = await asyncio.wait({first, second}, timeout=5, return_when=asyncio.FIRST_COMPLETED)
    assert [task.result().id for task in done] == [job.id]  # type: ignore[union-attr]
    (waiting,) = pending
    assert cancelled.cancelled() and len(broker._claimers) == 1 and not waiting.done()
    later = make_job(clock)
    await broker.admit(later)
    claimed = await asyncio.wait_for(waiting, 5)
    assert claimed is not None and claimed.id == later.id and broker._claimers == []
    assert live_timers(memory._ran_out) == 0  # the claims that got a job cancelled their timers


async def test_a_claim_that_ran_out_just_as_a_job_came_is_not_woken_twice_and_the_job_waits() -> None:
    """The timer settled the claim's future, and a job is admitted before the claim has run on:
    the admission's wake-up passes over the settled future (no InvalidStateError in the admission),
    the claim ends empty at its bound, and the job is the next claim's."""
    clock = FakeClock()
    broker = MemoryBroker(make_settings(clock))
    ran_out = asyncio.create_task(broker.claim(W, ["m"], timeout=0))
    for _ in range(100):  # bounded: the timer is due at once
        if broker._claimers and broker._claimers[0].done():
            break
        await asyncio.sleep(0)
    assert broker._claimers and broker._claimers[0].done() and not ran_out.done()
    job = make_job(clock)
    await broker.admit(job)
    assert await asyncio.wait_for(ran_out, 5) is None and broker._claimers == []
    claimed = await broker.claim(W, ["m"], timeout=0)
    assert claimed is not None and claimed.id == job.id


async def test_a_claim_woken_by_a_job_cancelled_before_it_ran_waits_on_for_the_next() -> None:
    clock = FakeClock()
    broker = MemoryBroker(make_settings(clock))
    waiting = asyncio.create_task(broker.claim(W, ["m"], timeout=10))
    await asyncio.sleep(0)
    gone = make_job(clock)
    await broker.admit(gone)  # wakes the claim ...
    await broker.cancel(gone.id)  # ... which finds it gone when it runs
    for _ in range(3):
        await asyncio.sleep(0)
    assert not waiting.done() and len(broker._claimers) == 1 and broker._queued == 0
    job = make_job(clock)
    await broker.admit(job)
    claimed = await asyncio.wait_for(waiting, 5)
    assert claimed is not None and claimed.id == job.id and broker._claimers == []
    assert live_timers(memory._ran_out) == 0


async def test_a_claim_waiting_while_the_broker_closes_ends_at_its_bound_and_leaves_nothing() -> None:
    clock = FakeClock()
    broker = MemoryBroker(make_settings(clock))
    await broker.start()
    waiting = asyncio.create_task(broker.claim(W, ["m"], timeout=0.05))
    await asyncio.sleep(0)
    await broker.close()
    assert not waiting.done() and len(broker._claimers) == 1
    assert await asyncio.wait_for(waiting, 5) is None
    assert broker._claimers == [] and live_timers(memory._ran_out) == 0


async def test_a_claim_woken_by_work_it_cannot_take_waits_on_until_its_bound() -> None:
    clock = FakeClock()
    broker = MemoryBroker(make_settings(clock))
    assert await broker.claim(W, ["m"], timeout=0.05) is None
    waiting = asyncio.create_task(broker.claim(W, ["m"], timeout=0.2))
    await asyncio.sleep(0)
    other = make_job(clock, model="other")  # work of another model wakes it, and it waits on
    await broker.admit(other)
    await asyncio.sleep(0)
    await asyncio.sleep(0)
    assert not waiting.done() and len(broker._claimers) == 1
    assert await asyncio.wait_for(waiting, 5) is None and broker._claimers == []


async def test_the_queued_count_a_claim_looks_at_first_is_the_jobs_queued_through_every_change() -> None:
    """The broker's count of queued jobs (a claim walks the queues only when it is not 0) against
    the records' states, over random admissions (some refused: the small queue holds 3, a tenant
    capped at 1 running), claims, releases, cancellations, finishes, expired leases and deadlines."""
    clock = FakeClock()
    broker = MemoryBroker(make_settings(clock))
    rng = random.Random(20)
    capped = TenantLimits(tenant="capped", max_concurrent=1)
    running: list[str] = []

    def queued() -> int:
        return sum(rec.job.state is JobState.QUEUED for rec in broker._records.values())

    for step in range(3_000):
        move = rng.random()
        if move < 0.35:
            model, tenant = rng.choice(["m", "small"]), rng.choice(["a", "b", "capped"])
            job = make_job(clock, model=model, tenant=tenant, timeout=rng.choice([2.0, 600.0]))
            with contextlib.suppress(Refused):
                await broker.admit(job, capped if tenant == "capped" else None)
        elif move < 0.6:
            got = await broker.claim(W, rng.choice([["m"], ["small"], ["m", "small"]]), timeout=0)
            if got is not None:
                running.append(got.id)
        elif move < 0.7 and running:
            await broker.release(running.pop(rng.randrange(len(running))), W)
        elif move < 0.8 and broker._records:
            await broker.cancel(rng.choice(list(broker._records)))
        elif move < 0.9 and running:
            state = rng.choice([JobState.SUCCEEDED, JobState.FAILED])
            await broker.finish(running.pop(rng.randrange(len(running))), W, state, result={})
        else:
            clock.advance(rng.choice([0.5, 3.0, 6.0]))  # leases (5 s) and deadlines (2 s) run out
            await broker.maintain()
            running = [j for j in running if j in broker._leases]
            if rng.random() < 0.3:  # dead letters purged: their records go before their time
                await broker.purge_dead_letters()
        assert broker._queued == queued() == sum(t.queued for t in broker._tenants.values()), step
        # What the claim's look relies on: with the count at 0, no queue holds an entry.
        assert broker._queued == sum(q.jobs for q in broker._queues.values()), step
    # And with none queued a claim still finds what is admitted next.
    waiting = asyncio.create_task(broker.claim(W, ["m"], timeout=5))
    await asyncio.sleep(0)
    job = make_job(clock)
    await broker.admit(job)
    claimed = await asyncio.wait_for(waiting, 5)
    assert claimed is not None


# A capped tenant's queued job, held back while its running job holds the cap's one slot: the end
# of that running job wakes the claims waiting, as an admission does.

CAPPED = TenantLimits(tenant="capped", max_concurrent=1)


async def _turns_until_done(task: asyncio.Task[Any], turns: int = 20) -> bool:
    """Whether ``task`` ends within ``turns`` turns of the event loop: a woken claim ends in a few,
    one left to its bound (10 s here) in none."""
    for _ in range(turns):
        if task.done():
            return True
        await asyncio.sleep(0)
    return task.done()


async def _capped_claim_waiting(broker: MemoryBroker, clock: FakeClock) -> tuple[str, str, asyncio.Task[Any]]:
    """The capped tenant's one running job, its queued one held back, and a claim waiting."""
    running = make_job(clock, tenant="capped", max_attempts=1)
    await broker.admit(running, CAPPED)
    assert (await broker.claim(W, ["m"], timeout=0)) is not None
    held = make_job(clock, tenant="capped")
    await broker.admit(held, CAPPED)
    waiting = asyncio.create_task(broker.claim(W, ["m"], timeout=10))
    assert not await _turns_until_done(waiting)  # the admission's wake-up found it held back
    assert len(broker._claimers) == 1 and broker._queued == 1
    return running.id, held.id, waiting


async def _lose_lease(broker: MemoryBroker, clock: FakeClock, job_id: str) -> None:
    clock.advance(broker.settings.lease_s + 1)  # its one attempt's lease runs out: failed
    await broker.maintain()
    assert broker._records[job_id].job.state is JobState.FAILED


async def test_a_capped_tenants_held_job_goes_to_the_waiting_claim_when_its_running_job_ends() -> None:
    ends: dict[str, Callable[[MemoryBroker, FakeClock, str], Any]] = {
        "finish": lambda b, c, j: b.finish(j, W, JobState.SUCCEEDED, result={}),
        "cancel": lambda b, c, j: b.cancel(j),
        "lease lost": _lose_lease,
    }
    for how, end in ends.items():
        clock = FakeClock()
        broker = MemoryBroker(make_settings(clock))
        running, held, waiting = await _capped_claim_waiting(broker, clock)
        try:
            await end(broker, clock, running)
            assert await _turns_until_done(waiting), how  # not left to its 10 s bound
            claimed = waiting.result()
            assert claimed is not None and claimed.id == held, how
            assert broker._claimers == [] and live_timers(memory._ran_out) == 0, how
        finally:
            waiting.cancel()


async def test_an_end_that_frees_no_held_job_wakes_no_claim() -> None:
    """An uncapped tenant's end, and a capped one's with nothing queued, leave the claim waiting:
    the wake-up is for a slot that lets a held-back job run, not for every end."""
    clock = FakeClock()
    broker = MemoryBroker(make_settings(clock))
    free = make_job(clock, model="other")
    await broker.admit(free)
    capped = make_job(clock, model="other", tenant="capped")
    await broker.admit(capped, CAPPED)
    for _ in (free, capped):
        assert (await broker.claim(W, ["other"], timeout=0)) is not None
    waiting = asyncio.create_task(broker.claim(W, ["m"], timeout=10))
    try:
        assert not await _turns_until_done(waiting)
        (woken,) = broker._claimers
        await broker.finish(free.id, W, JobState.SUCCEEDED, result={})
        await broker.finish(capped.id, W, JobState.SUCCEEDED, result={})
        assert not woken.done() and broker._claimers == [woken]
    finally:
        waiting.cancel()
