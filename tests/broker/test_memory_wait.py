"""The memory broker's wait for a job's end (``MemoryBroker.wait``): a future a waiter, set by the
end; waiters that gave up neither hold back nor cancel the others."""

from __future__ import annotations

import asyncio

from sluice.broker.memory import MemoryBroker
from sluice.core.job import JobState
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
    await broker.finish(job.id, W, JobState.SUCCEEDED, result={})
    done = await asyncio.wait_for(asyncio.gather(*waiters), 5)
    assert [d.state for d in done if d is not None] == [JobState.SUCCEEDED] * 3
    assert cancelled.cancelled() and broker._records[job.id].enders is None
    ended = await broker.wait(job.id, 10)  # ended already: at once
    assert ended is not None and ended.state is JobState.SUCCEEDED


# A claim's wait for work: a future a claim, woken by an admission, bounded by a timer.


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
    assert len(broker._claimers) == 3 and not first.done() and not second.done()
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
