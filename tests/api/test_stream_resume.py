"""A stream reads on from where engine_accepted stopped (sluice.api.relay): the same payloads as a
stream that read every event from the first, without walking the skipped ones again."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from sluice.api import relay
from sluice.api.errors import APIError
from sluice.api.relay import engine_accepted, openai_stream
from sluice.bench.broker_cycles import MODEL, make_job, settings
from sluice.broker.base import Event, EventType
from sluice.broker.memory import MemoryBroker
from sluice.core.job import Endpoint, Job, JobError, JobState
from tests.broker.test_memory_wait import live_timers


def _token(text: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


class _Broker:
    """The three calls the relay makes, over a fixed list of events; records what it was asked."""

    def __init__(self, events: list[Event]) -> None:
        self._events = events
        self.read: list[int] = []

    async def events(self, job_id: str, after: int = 0, timeout: float | None = None) -> AsyncIterator[Event]:
        for event in self._events:
            if event.id > after:
                self.read.append(event.id)
                yield event

    async def get(self, job_id: str) -> None:
        return None

    async def cancel(self, job_id: str) -> None:
        return None


def _job() -> Job:
    return Job(
        id="job_x",
        model="m",
        endpoint=Endpoint.CHAT,
        body={},
        tenant="t",
        priority="normal",
        prompt_tokens=1,
        max_tokens=2,
        created_at=1.0,
        deadline=100.0,
    )


async def _payloads(broker: _Broker, after: int) -> list[str]:
    return [p async for p in openai_stream(broker, _job(), False, after=after)]  # type: ignore[arg-type]


async def test_the_stream_starts_after_what_engine_accepted_skipped() -> None:
    events = [
        Event(1, EventType.QUEUED, {"position": 0}),
        Event(2, EventType.STARTED, {}),
        Event(3, EventType.RETRY, {"attempt": 2}),  # before any token: a stream skips it
        Event(4, EventType.TOKEN, _token("a")),
        Event(5, EventType.TOKEN, _token("b")),
        Event(6, EventType.DONE, {}),
    ]
    broker = _Broker(events)
    skipped = await engine_accepted(broker, _job())  # type: ignore[arg-type]
    assert skipped == 3
    broker.read.clear()
    resumed = await _payloads(broker, skipped)
    assert broker.read == [4, 5, 6]
    assert resumed == await _payloads(_Broker(events), 0)
    assert resumed[-1] == "[DONE]" and len(resumed) == 3


async def test_an_end_without_tokens_is_not_skipped() -> None:
    events = [Event(1, EventType.QUEUED, {}), Event(2, EventType.DONE, {})]
    broker = _Broker(events)
    assert await engine_accepted(broker, _job()) == 1  # type: ignore[arg-type]
    assert await _payloads(broker, 1) == ["[DONE]"]


# On the memory broker engine_accepted follows the job (broker.follow) rather than reading its
# events: the same answers, and the job's start wakes no task of the route's while it waits.


async def _claimed(broker: MemoryBroker) -> Job:
    job = make_job(0)
    await broker.admit(job)  # queued (1)
    claimed = await broker.claim("w", [MODEL], timeout=1.0)  # started (2)
    assert claimed is not None
    return claimed


async def _waiting(broker: MemoryBroker, job: Job, within_s: float = 5.0) -> asyncio.Task[int]:
    task = asyncio.ensure_future(engine_accepted(broker, job, within_s))
    for _ in range(3):
        await asyncio.sleep(0)
    assert not task.done()
    return task


async def test_on_the_memory_broker_it_follows_the_job_and_skips_what_reading_would() -> None:
    broker = MemoryBroker(settings())
    async with broker:
        followed_job, read_job = await _claimed(broker), await _claimed(broker)
        # The second job has a follower already: engine_accepted reads its events instead.
        other = broker.follow(read_job.id, 0, lambda *_: True)
        assert other is not None
        followed, read = await _waiting(broker, followed_job), await _waiting(broker, read_job)
        followed_record = broker._records[followed_job.id]
        # Waiting as a follower, not a reader: a published event wakes no task of the route's.
        assert followed_record.follower is not None and followed_record.readers == []
        assert broker._records[read_job.id].readers != []
        for job in (followed_job, read_job):
            await broker.publish(job.id, EventType.RETRY, {"attempt": 2})  # (3) skipped too
            await broker.publish(job.id, EventType.TOKEN, _token("a"))
        assert await followed == await read == 3
        # It stopped following at the token: the stream may follow the job from there; and the
        # wait's timer went with it (not left armed for the 5 s, one per stream).
        assert broker._records[followed_job.id].follower is None and live_timers(relay._ran_out) == 0
        other()


async def test_on_the_memory_broker_a_failure_before_the_token_is_raised() -> None:
    broker = MemoryBroker(settings())
    async with broker:
        job = await _claimed(broker)
        waiting = await _waiting(broker, job)
        error = JobError("the engine refused it", "invalid_request_error", None, None)
        await broker.finish(job.id, "w", JobState.FAILED, error=error)
        with pytest.raises(APIError) as raised:
            await waiting
        assert raised.value.job_id == job.id and "refused" in raised.value.message


async def test_on_the_memory_broker_a_wait_that_runs_out_returns_what_it_skipped_and_stops_following() -> (
    None
):
    broker = MemoryBroker(settings())
    async with broker:
        job = await _claimed(broker)
        assert await engine_accepted(broker, job, 0.05) == 2
        assert broker._records[job.id].follower is None
        # ... and a token already published is taken at once.
        await broker.publish(job.id, EventType.TOKEN, _token("a"))
        assert await engine_accepted(broker, job, 0.0) == 2


async def test_on_the_memory_broker_a_cancelled_wait_is_cancelled_and_leaves_no_follower_or_timer() -> None:
    broker = MemoryBroker(settings())
    async with broker:
        job = await _claimed(broker)
        waiting = await _waiting(broker, job)
        assert broker._records[job.id].follower is not None and live_timers(relay._ran_out) == 1
        waiting.cancel()
        with pytest.raises(asyncio.CancelledError):
            await waiting
        assert broker._records[job.id].follower is None and live_timers(relay._ran_out) == 0
        # The job goes on, and a later wait takes its token.
        await broker.publish(job.id, EventType.TOKEN, _token("a"))
        assert await engine_accepted(broker, job, 0.0) == 2


async def test_on_the_memory_broker_a_job_cancelled_before_it_starts_is_raised_waited_on_or_not() -> None:
    broker = MemoryBroker(settings())
    async with broker:
        gone, queued = make_job(0), make_job(1)
        await broker.admit(gone)
        await broker.admit(queued)
        await broker.cancel(gone.id)
        with pytest.raises(APIError) as at_once:  # cancelled already: raised without a wait
            await engine_accepted(broker, gone, 5.0)
        assert at_once.value.job_id == gone.id and at_once.value.code == "cancelled"
        assert live_timers(relay._ran_out) == 0
        waiting = await _waiting(broker, queued)  # queued, never started
        await broker.cancel(queued.id)
        with pytest.raises(APIError) as raised:
            await waiting
        assert raised.value.job_id == queued.id and raised.value.code == "cancelled"
        assert broker._records[queued.id].follower is None and live_timers(relay._ran_out) == 0
