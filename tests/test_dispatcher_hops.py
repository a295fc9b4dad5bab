"""What runs first once a job is claimed: its engine request's write, before the rest of the turn's
wake-ups (the successor claim loop's first claim, the readers of the STARTED event). aiohttp on
Python 3.11 writes a request's body in a task it makes as the request is sent, which runs after
every task woken before it; the time to the first token waits for that write."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import Any

from sluice.backends.base import Backend
from sluice.broker.base import BrokerSettings, EventType
from sluice.broker.memory import MemoryBroker
from sluice.core.job import Job, JobState
from sluice.dispatcher import Dispatcher
from tests.helpers import make_job, wait_until


class WriterTaskBackend(Backend):
    """Sends its request as aiohttp does: the body written by a task made as the request goes out,
    the answer's head awaited meanwhile; ``order`` records when the body was written."""

    def __init__(self, order: list[str]) -> None:
        super().__init__("a", max_concurrency=4, models=["m"])
        self.order = order
        self.answer = asyncio.Event()

    async def discover_models(self) -> list[str]:
        return ["m"]

    async def healthy(self) -> bool:
        return True

    async def stream(self, job: Job) -> AsyncIterator[dict[str, Any]]:
        async def write() -> None:
            self.order.append("request written")

        writer = asyncio.create_task(write())
        await self.answer.wait()  # the answer's head and first token
        await writer
        yield {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "stop"}]}


class RecordingBroker(MemoryBroker):
    """Records each claim a claim loop makes."""

    def __init__(self, order: list[str]) -> None:
        super().__init__(BrokerSettings())
        self.order = order

    async def _claim(self, worker_id: str, models: Sequence[str], timeout: float) -> Job | None:
        self.order.append("claim")
        return await super()._claim(worker_id, models, timeout)


async def test_the_engine_request_is_written_before_the_turns_other_wake_ups() -> None:
    order: list[str] = []
    broker = RecordingBroker(order)
    await broker.start()
    backend = WriterTaskBackend(order)
    dispatcher = Dispatcher(broker, [backend])
    job = make_job()
    job.stream_tokens = True
    await broker.admit(job)

    # A reader waiting for the job's events before it is claimed, as a streaming client's relay is.
    seen: list[EventType] = []

    async def read() -> None:
        async for event in broker.events(job.id):
            if event.type is EventType.STARTED:
                order.append("started read")
            seen.append(event.type)

    reader = asyncio.create_task(read())
    await wait_until(lambda: seen == [EventType.QUEUED])
    await dispatcher.start()
    try:
        steps = ("request written", "started read")
        await wait_until(lambda: all(step in order for step in steps) and order.count("claim") >= 2)
        assert order.index("request written") < order.index("started read"), order
        # The first claim took the job; the successor loop's first claim comes after the write.
        first, second = [i for i, step in enumerate(order) if step == "claim"][:2]
        assert first < order.index("request written") < second, order
        backend.answer.set()
        done = await broker.wait(job.id, 10)
        assert done is not None and done.state is JobState.SUCCEEDED
        await asyncio.wait_for(reader, 10)
        assert seen == [EventType.QUEUED, EventType.STARTED, EventType.TOKEN, EventType.DONE]
    finally:
        reader.cancel()
        await dispatcher.stop()
        await broker.close()
