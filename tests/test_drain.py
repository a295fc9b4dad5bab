"""The drain of one dispatcher (a unit test: the memory broker and an in-process engine whose
answers wait until the test lets them go). The real processes and signals are in
tests/failures/test_worker_sigterm.py."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator
from typing import Any

import pytest

from sluice import drain
from sluice.backends.base import Backend
from sluice.broker.base import BrokerSettings
from sluice.broker.memory import MemoryBroker
from sluice.config import ConfigError, load_settings
from sluice.core.job import Job, JobState
from sluice.dispatcher import Dispatcher
from tests.helpers import make_job, wait_until


class HeldBackend(Backend):
    """An engine whose answers end only once ``go`` is set; counts what it started and finished."""

    def __init__(self, concurrency: int, tokens: int | None = None) -> None:
        super().__init__("held", max_concurrency=concurrency, max_inflight_tokens=tokens, models=["m"])
        self.go = asyncio.Event()
        self.active = 0
        self.started: list[str] = []
        self.finished: list[str] = []

    async def discover_models(self) -> list[str]:
        return ["m"]

    async def healthy(self) -> bool:
        return True

    async def stream(self, job: Job) -> AsyncIterator[dict[str, Any]]:
        self.active += 1
        self.started.append(job.id)
        try:
            yield {"choices": [{"index": 0, "delta": {"content": "x"}}]}
            await self.go.wait()
            yield {"choices": [{"index": 0, "delta": {}, "finish_reason": "stop"}]}
            self.finished.append(job.id)
        finally:
            self.active -= 1


async def started(backend: HeldBackend, jobs: int = 3) -> tuple[MemoryBroker, Dispatcher, list[Job]]:
    """A dispatcher whose first job runs and whose second is claimed but waits for room in the
    token budget (each job costs 30 of its 40); the third stays queued."""
    broker = MemoryBroker(BrokerSettings())
    await broker.start()
    dispatcher = Dispatcher(broker, [backend])
    await dispatcher.start()
    queued = [make_job() for _ in range(jobs)]
    for job in queued:
        await broker.admit(job)
    await wait_until(lambda: backend.active == 1 and len(dispatcher.running) == 2)
    return broker, dispatcher, queued


async def test_running_jobs_finish_within_the_grace_and_nothing_more_is_claimed() -> None:
    backend = HeldBackend(concurrency=2, tokens=40)
    broker, dispatcher, (a, b, c) = await started(backend)
    try:
        shutdown = drain.Drain(grace_s=30)
        shutdown.signal()
        draining = asyncio.create_task(drain.drain_dispatcher(dispatcher, shutdown))
        await wait_until(lambda: drain.claim_loop(dispatcher) is None)
        backend.go.set()  # the running job ends; the waiting one then takes its room, and ends too
        outcome = await asyncio.wait_for(draining, 10)
        assert (outcome.finished, outcome.released, outcome.unreleased) == (2, 0, [])
        assert backend.finished == [a.id, b.id]
        for job in (a, b):
            got = await broker.get(job.id)
            assert got is not None and got.state is JobState.SUCCEEDED and got.attempts == 1
        left = await broker.get(c.id)
        assert left is not None and left.state is JobState.QUEUED  # never claimed after the signal
    finally:
        await dispatcher.stop()
        await broker.close()


async def test_what_the_grace_leaves_is_handed_back_in_claim_order_ahead_of_the_queue() -> None:
    backend = HeldBackend(concurrency=2, tokens=40)
    broker, dispatcher, (a, b, c) = await started(backend)
    try:
        shutdown = drain.Drain(grace_s=0.2)
        shutdown.signal()
        outcome = await asyncio.wait_for(drain.drain_dispatcher(dispatcher, shutdown), 10)
        # The running job and the claimed one that waited for room: both handed back.
        assert (outcome.finished, outcome.released, outcome.unreleased) == (0, 2, [])
        assert backend.active == 0 and backend.finished == []  # its engine stream was closed
        assert dispatcher.running == {}
        for job in (a, b, c):
            got = await broker.get(job.id)
            assert got is not None and got.state is JobState.QUEUED and got.attempts == 0
        assert [await broker.position(j.id) for j in (a, b, c)] == [0, 1, 2]
    finally:
        await dispatcher.stop()
        await broker.close()


async def test_a_second_signal_hands_back_at_once() -> None:
    backend = HeldBackend(concurrency=1)
    broker, dispatcher, (a,) = await started_one(backend)
    try:
        shutdown = drain.Drain(grace_s=3600)
        shutdown.signal()
        draining = asyncio.create_task(drain.drain_dispatcher(dispatcher, shutdown))
        await wait_until(lambda: drain.claim_loop(dispatcher) is None)
        assert not draining.done() and shutdown.phase is drain.DrainPhase.DRAINING
        shutdown.signal()
        assert shutdown.phase is drain.DrainPhase.HURRYING
        outcome = await asyncio.wait_for(draining, 10)
        assert outcome.released == 1
        got = await broker.get(a.id)
        assert got is not None and got.state is JobState.QUEUED
    finally:
        await dispatcher.stop()
        await broker.close()


async def started_one(backend: HeldBackend) -> tuple[MemoryBroker, Dispatcher, list[Job]]:
    broker = MemoryBroker(BrokerSettings())
    await broker.start()
    dispatcher = Dispatcher(broker, [backend])
    await dispatcher.start()
    job = make_job()
    await broker.admit(job)
    await wait_until(lambda: backend.active == 1)
    return broker, dispatcher, [job]


async def test_a_job_cancelled_meanwhile_is_not_handed_back() -> None:
    backend = HeldBackend(concurrency=1)
    broker, dispatcher, (a,) = await started_one(backend)
    try:
        await broker.cancel(a.id)  # the broker's view: cancelled, while the worker still runs it
        assert await broker.release(a.id, dispatcher.worker_id) is False
        got = await broker.get(a.id)
        assert got is not None and got.state is JobState.CANCELLED
    finally:
        await dispatcher.stop()
        await broker.close()


def test_the_grace_comes_from_the_settings_and_their_environment_variable() -> None:
    assert drain.grace_of(load_settings(environ={})) == drain.DEFAULT_GRACE_S
    assert drain.grace_of(load_settings(environ={drain.GRACE_ENV: "12.5"})) == 12.5
    assert drain.grace_of(load_settings(overrides={"drain_grace_s": 7.0}, environ={})) == 7.0
    for bad in ("soon", "-1", "nan"):
        with pytest.raises(ConfigError, match="drain_grace_s"):
            load_settings(environ={drain.GRACE_ENV: bad})


def test_the_phases_and_the_time_left() -> None:
    now = [100.0]
    shutdown = drain.Drain(grace_s=10, clock=lambda: now[0])
    assert not shutdown.draining and shutdown.remaining() == 10
    shutdown.signal()
    now[0] += 4
    assert shutdown.phase is drain.DrainPhase.DRAINING and shutdown.remaining() == 6
    now[0] += 20
    assert shutdown.remaining() == 0 and not shutdown.hurry.is_set()
    shutdown.signal()
    assert shutdown.phase is drain.DrainPhase.HURRYING and shutdown.hurry.is_set()
