"""The dispatcher against in-process fake backends (a unit test of the dispatcher alone)."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

from sluice.backends.base import Backend
from sluice.broker.base import BrokerSettings
from sluice.broker.memory import MemoryBroker
from sluice.core.job import Job, JobState
from sluice.dispatcher import Dispatcher
from tests.helpers import make_job, wait_until


class FakeBackend(Backend):
    def __init__(
        self, name: str, concurrency: int, *, tokens: int | None = None, delay: float = 0.02
    ) -> None:
        super().__init__(name, max_concurrency=concurrency, max_inflight_tokens=tokens, models=["m"])
        self.delay = delay
        self.active = 0
        self.peak = 0
        self.active_cost = 0
        self.peak_cost = 0
        self.served = 0

    async def discover_models(self) -> list[str]:
        return ["m"]

    async def healthy(self) -> bool:
        return True

    async def stream(self, job: Job) -> AsyncIterator[dict[str, Any]]:
        self.active += 1
        self.active_cost += job.cost
        self.peak = max(self.peak, self.active)
        self.peak_cost = max(self.peak_cost, self.active_cost)
        try:
            await asyncio.sleep(self.delay)
            yield {"choices": [{"index": 0, "delta": {"content": "x"}, "finish_reason": "stop"}]}
            self.served += 1
        finally:
            self.active -= 1
            self.active_cost -= job.cost


async def run_jobs(backends: list[FakeBackend], jobs: list[Job]) -> MemoryBroker:
    broker = MemoryBroker(BrokerSettings())
    await broker.start()
    dispatcher = Dispatcher(broker, backends)
    await dispatcher.start()
    try:
        for job in jobs:
            await broker.admit(job)
        for job in jobs:
            done = await broker.wait(job.id, 10)
            assert done is not None and done.state is JobState.SUCCEEDED
    finally:
        await dispatcher.stop()
        await broker.close()
    return broker


async def test_never_more_than_max_concurrency() -> None:
    backend = FakeBackend("a", 3)
    await run_jobs([backend], [make_job() for _ in range(30)])
    assert backend.peak == 3 and backend.served == 30


async def test_token_budget_bounds_inflight_cost() -> None:
    backend = FakeBackend("a", 8, tokens=100)
    await run_jobs([backend], [make_job(prompt_tokens=10, max_tokens=30) for _ in range(12)])
    assert backend.peak_cost <= 100 and backend.peak == 2


async def test_backends_share_by_free_capacity() -> None:
    big, small = FakeBackend("big", 6), FakeBackend("small", 2)
    await run_jobs([big, small], [make_job() for _ in range(64)])
    assert big.peak == 6 and small.peak == 2
    assert big.served > small.served > 0


async def test_finished_jobs_feed_the_drain_rate() -> None:
    backend = FakeBackend("a", 2)
    broker = MemoryBroker(BrokerSettings())
    await broker.start()
    dispatcher = Dispatcher(broker, [backend])
    await dispatcher.start()
    try:
        job = make_job()
        await broker.admit(job)
        await broker.wait(job.id, 10)
        await wait_until(lambda: _measured(broker))
        stats = (await broker.stats())["m"]
        assert stats.slots == 2 and stats.drain_rate > 0
    finally:
        await dispatcher.stop()
        await broker.close()


async def _measured(broker: MemoryBroker) -> bool:
    return (await broker.stats())["m"].measured
