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
    assert cancelled.cancelled() and rec.enders is None
    ended = await broker.wait(job.id, 10)  # ended already: at once
    assert ended is not None and ended.state is JobState.SUCCEEDED
