"""The memory broker calls a follower back with each event as it is published (MemoryBroker.follow):
the events ``events`` reads, in order, with the same ids, and no more once it stops."""

from __future__ import annotations

from typing import Any

from sluice.bench.broker_cycles import MODEL, make_job, settings
from sluice.broker.base import EventType
from sluice.broker.memory import MemoryBroker
from sluice.core.job import Job, JobState


async def running_job(broker: MemoryBroker) -> Job:
    """A job admitted and claimed: running, its events queued (1) and started (2)."""
    job = make_job(0)
    await broker.admit(job)
    claimed = await broker.claim("w", [MODEL], timeout=1.0)
    assert claimed is not None
    return claimed


class Seen:
    """A follower that keeps what it was called with, and says to go on while ``keep`` does."""

    def __init__(self, keep: int = 1_000) -> None:
        self.calls: list[tuple[int, EventType, Any]] = []
        self.keep = keep

    def __call__(self, event_id: int, type: EventType, data: Any) -> bool:
        self.calls.append((event_id, type, data))
        return len(self.calls) < self.keep


async def test_a_follower_gets_the_events_published_and_those_to_come_as_events_reads_them() -> None:
    broker = MemoryBroker(settings())
    async with broker:
        job = await running_job(broker)  # queued (1), started (2)
        await broker.publish(job.id, EventType.TOKEN, {"choices": ["a"]})
        seen = Seen()
        stop = broker.follow(job.id, 1, seen)
        assert stop is not None
        assert [(i, t) for i, t, _ in seen.calls] == [(2, EventType.STARTED), (3, EventType.TOKEN)]
        await broker.publish(job.id, EventType.TOKEN, {"choices": ["b"]})
        await broker.finish(job.id, "w", JobState.SUCCEEDED, result={}, usage={})
        read = [(e.id, e.type, e.data) for e in [e async for e in broker.events(job.id, 1)]]
        assert seen.calls == read
        assert seen.calls[-1][1] is EventType.DONE
        # The end was its last call: a new follower may follow the job, from the end on.
        late = Seen()
        assert broker.follow(job.id, len(read) + 1, late) is not None and late.calls == []


async def test_a_follower_is_called_no_more_once_it_says_so_or_stops() -> None:
    broker = MemoryBroker(settings())
    async with broker:
        job = await running_job(broker)
        first = Seen(keep=1)
        assert broker.follow(job.id, 2, first) is not None
        await broker.publish(job.id, EventType.TOKEN, {"n": 1})
        await broker.publish(job.id, EventType.TOKEN, {"n": 2})
        assert [d for _, _, d in first.calls] == [{"n": 1}]
        second = Seen()
        stop = broker.follow(job.id, 4, second)
        assert stop is not None
        # One follower a job: another reader reads events() instead.
        assert broker.follow(job.id, 4, Seen()) is None
        stop()
        await broker.publish(job.id, EventType.TOKEN, {"n": 3})
        assert second.calls == []
        assert broker.follow("job_unknown", 0, Seen()) is None


async def test_a_follower_that_raises_is_dropped_and_the_publisher_goes_on() -> None:
    broker = MemoryBroker(settings())
    async with broker:
        job = await running_job(broker)
        calls = []

        def broken(event_id: int, type: EventType, data: Any) -> bool:
            calls.append(event_id)
            raise RuntimeError("a follower's own failure")

        assert broker.follow(job.id, 2, broken) is not None
        await broker.publish(job.id, EventType.TOKEN, {"n": 1})
        await broker.publish(job.id, EventType.TOKEN, {"n": 2})
        assert calls == [3]
        assert [e.id async for e in broker.events(job.id, 2, timeout=0.01)] == [3, 4]
