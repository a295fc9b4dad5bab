"""``Broker.admit``'s contract on the job passed in, on every broker and on a spread Redis queue:
queued, the job is ``Admission.job`` itself and its id (changed by the spread Redis broker, which
prefixes the shard) is the one every later call finds it by; a duplicate's ``Admission.job`` is the
first job's record."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from sluice.broker.base import Broker
from sluice.broker.redis import RedisBroker
from sluice.broker.redis_shards import shard_of_job, shard_of_model
from sluice.core.job import JobState
from tests.broker.brokers import make_broker
from tests.helpers import FakeClock, make_job

W = "worker-1"
MODEL = "org/llama:8b"


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["memory", "redis", "redis-spread"])
async def broker(request: pytest.FixtureRequest, clock: FakeClock) -> AsyncIterator[Broker]:
    async with await make_broker(request.param, request, clock) as impl:
        yield impl


def _spread(broker: Broker) -> bool:
    return isinstance(broker, RedisBroker) and broker.spread


async def test_the_admitted_job_is_the_one_passed_in(broker: Broker, clock: FakeClock) -> None:
    job = make_job(clock, model=MODEL)
    before = job.id
    adm = await broker.admit(job)
    assert adm.job is job and not adm.duplicate and job.state is JobState.QUEUED
    if _spread(broker):  # the shard's prefix, so that a lookup by id finds the shard
        assert job.id != before and shard_of_job(job.id) == shard_of_model(MODEL)
        assert job.id.endswith(before.removeprefix("job_"))
    else:
        assert job.id == before
    got = await broker.get(job.id)
    assert got is not None and got.id == job.id and got.state is JobState.QUEUED
    assert await broker.position(job.id) == 0
    claimed = await broker.claim(W, [MODEL], timeout=1.0)
    assert claimed is not None and claimed.id == job.id
    assert await broker.finish(job.id, W, JobState.SUCCEEDED, result={"ok": True}) is not None
    page = await broker.list_jobs(job.tenant, 10)
    assert [j.id for j in page.jobs] == [job.id]


async def test_a_duplicate_answers_with_the_first_job(broker: Broker, clock: FakeClock) -> None:
    first = make_job(clock, model=MODEL, idempotency_key="k1")
    await broker.admit(first)
    again = make_job(clock, model=MODEL, idempotency_key="k1")
    adm = await broker.admit(again)
    assert adm.duplicate and adm.job is not again and adm.job.id == first.id
    assert await broker.get(again.id) is None  # the job passed in names no job, whatever its id
