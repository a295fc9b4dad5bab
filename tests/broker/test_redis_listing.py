"""A tenant's job list on a spread queue, when the write that lists an admitted job fails: the list
is in the home shard, the job's queue in another (on a cluster another master), so the job is
queued by the admit script first and listed by a second write (``RedisJobs._list_job``). The
admission is answered by what happened to the job: queued, it is accepted (a 503 would make the
client send it again and run it twice), and the listing is repaired by upkeep from the record the
admit script left in the job's own shard, however long the home shard takes to take the write."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis
from redis.exceptions import ResponseError

from sluice.broker.redis import RedisBroker
from sluice.broker.redis_jobs import LIST_REPAIR_AFTER_S
from sluice.core.job import JobState
from tests.broker.brokers import make_settings
from tests.helpers import FakeClock, make_job, wait_until


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


async def test_a_job_queued_but_not_listed_is_accepted_and_listed_later(
    redis_url: str, clock: FakeClock
) -> None:
    async with RedisBroker(redis_url, make_settings(clock), spread=True) as broker:
        listed_before = make_job(clock, model="m", tenant="a")
        await broker.admit(listed_before)
        list_key = broker.keys.tenant_jobs_us("a")
        raw = Redis.from_url(redis_url)
        try:
            # The home shard refuses the listing (a key of another type in its place: WRONGTYPE,
            # as a failover's CLUSTERDOWN or a dead master's refused connection would).
            members = await raw.zrange(list_key, 0, -1)
            await raw.delete(list_key)
            await raw.set(list_key, "not a sorted set")
            clock.advance(0.001)
            job = make_job(clock, model="m", tenant="a")
            admission = await broker.admit(job)
            assert admission.job is job and not admission.duplicate
            queued = await broker.get(job.id)
            assert queued is not None and queued.state is JobState.QUEUED
            claimed = await broker.claim("w", ["m"], timeout=0)
            assert claimed is not None and claimed.id == listed_before.id

            pending = broker._job_shard(job.id).keys.unlisted
            assert await raw.zscore(pending, job.id) is not None

            # While the home shard still refuses, upkeep's repair fails and keeps the job to list.
            clock.advance(LIST_REPAIR_AFTER_S + 1.0)
            with pytest.raises(ResponseError):
                await broker.maintain()
            assert await raw.zscore(pending, job.id) is not None

            # The home shard takes writes again: upkeep lists the job, only once its admission's
            # own listing has had its time.
            await raw.zadd(pending, {job.id: clock()})  # as if admitted just now (before the list
            # takes writes: the broker's own upkeep loop runs meanwhile too)
            await raw.delete(list_key)
            await raw.zadd(list_key, {m.decode(): float(listed_before.created_at * 1e6) for m in members})
            await broker.maintain()
            assert [j.id for j in (await broker.list_jobs("a", limit=10)).jobs] == [listed_before.id]
            clock.advance(LIST_REPAIR_AFTER_S + 1.0)
            await broker.maintain()
            assert await raw.zscore(pending, job.id) is None
            page = await broker.list_jobs("a", limit=10)
            assert [j.id for j in page.jobs] == [job.id, listed_before.id]
            # Listed once: nothing is left to repair, and a second round changes nothing.
            await broker.maintain()
            assert [j.id for j in (await broker.list_jobs("a", limit=10)).jobs] == [job.id, listed_before.id]
        finally:
            await raw.aclose()


async def test_a_listing_that_succeeds_leaves_nothing_to_repair(redis_url: str, clock: FakeClock) -> None:
    async with RedisBroker(redis_url, make_settings(clock), spread=True) as broker:
        jobs = [make_job(clock, model=f"m{i}", tenant="a") for i in range(3)]
        for job in jobs:
            clock.advance(0.001)
            await broker.admit(job)
        raw = Redis.from_url(redis_url)

        async def unnoted(job_id: str) -> bool:
            return await raw.zscore(broker._job_shard(job_id).keys.unlisted, job_id) is None

        try:
            for job in jobs:
                # Waited on, bounded: the admission's ZREM is not awaited (its pipeline goes out at
                # the next turn), and this reads on a connection of its own, which may come first.
                await wait_until(lambda job_id=job.id: unnoted(job_id), timeout=5.0)  # type: ignore[misc]
        finally:
            await raw.aclose()
