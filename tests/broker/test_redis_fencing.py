"""Leases across a failover: a claim the old primary had and the new one never got leaves its job
queued there, while a worker runs it. When another worker claims the job, the lease token fences
the first run off: its heartbeat is told to abort and its finish is refused, so the job is settled
once, by the run that holds its lease.

Redis's side of a lost claim is made here without a failover: the claim is handed back by the
release script, as if it had never reached the replica, while the broker still holds its token."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

from sluice.broker.redis import STREAM_MAXLEN, RedisBroker
from sluice.broker.redis_shards import Shard
from sluice.core.job import JobState
from tests.broker.brokers import make_settings
from tests.helpers import FakeClock, make_job


async def _lose_the_claim(broker: RedisBroker, job_id: str, worker_id: str) -> None:
    """Queue ``job_id`` again as the new primary would have it, leaving the broker's token as it was."""
    k = broker.keys
    token = broker._tokens[(worker_id, job_id)]
    await broker._call(
        "release",
        [k.job(job_id), k.out(job_id), k.active, k.deadline, k.running, k.blocked],
        [k.prefix, job_id, worker_id, token, STREAM_MAXLEN],
    )


async def test_another_workers_claim_fences_the_first_run(redis_url: str) -> None:
    clock = FakeClock()
    async with (
        RedisBroker(redis_url, make_settings(clock)) as gateway,
        RedisBroker(redis_url, make_settings(clock)) as a,
        RedisBroker(redis_url, make_settings(clock)) as b,
    ):
        job = make_job(clock)
        await gateway.admit(job)
        assert (await a.claim("a", ["m"], timeout=1)) is not None
        await _lose_the_claim(a, job.id, "a")
        claimed = await b.claim("b", ["m"], timeout=1)
        assert claimed is not None and claimed.id == job.id
        assert await a.heartbeat("a", [job.id]) == {job.id}  # a's run is told to stop
        assert await a.finish(job.id, "a", JobState.SUCCEEDED, result={"by": "a"}) is None
        done = await b.finish(job.id, "b", JobState.SUCCEEDED, result={"by": "b"})
        assert done is not None and done.result == {"by": "b"}


async def test_a_heartbeat_told_to_abort_keeps_the_token_of_a_claim_made_meanwhile(redis_url: str) -> None:
    """The queue hands a job back to the worker that runs it while that worker's heartbeat, sent with
    the old token, is on its way: the heartbeat is told to abort the old run, and the new lease's
    token stays, so the adopted run's finish is accepted."""
    clock = FakeClock()
    async with (
        RedisBroker(redis_url, make_settings(clock)) as gateway,
        RedisBroker(redis_url, make_settings(clock)) as a,
    ):
        job = make_job(clock)
        await gateway.admit(job)
        assert (await a.claim("a", ["m"], timeout=1)) is not None
        old = a._tokens[("a", job.id)]
        call = a._call

        async def racing(
            name: str, keys: Sequence[str], args: Sequence[str | int | float], shard: Shard | None = None
        ) -> Any:
            if name == "heartbeat":  # its args hold the old token already
                await _lose_the_claim(a, job.id, "a")
                again = await a.claim("a", ["m"], timeout=1)
                assert again is not None and again.id == job.id
            return await call(name, keys, args, shard)

        a._call = racing  # type: ignore[method-assign]
        assert await a.heartbeat("a", [job.id]) == {job.id}  # the old run is told to stop
        a._call = call  # type: ignore[method-assign]
        assert a._tokens[("a", job.id)] != old
        done = await a.finish(job.id, "a", JobState.SUCCEEDED, result={"by": "adopted"})
        assert done is not None and done.result == {"by": "adopted"}
