"""The Redis broker on a real Redis Cluster (three masters, a replica each, made by redis-cli): its
scripts run there as on one Redis, a stale slot map is corrected by MOVED, and kill -9 of the master
that serves the queue lets its replica take over with nothing accepted lost (WAIT, on by default
with a cluster).

One queue is one hash tag, so one slot, so one master (and its replica) at a time: the other masters
serve other queues (docs/redis.md says what spreading one queue's models over masters would take).
"""

from __future__ import annotations

import asyncio
import time
from collections.abc import Iterator

import pytest

from sluice.broker.base import EventType
from sluice.broker.redis import RedisBroker
from sluice.core.job import JobState
from tests.failures.failover_load import FailoverLoad, load_settings
from tests.helpers import make_job, wait_until
from tests.redis_server import RedisClusterNodes, wait_replicas

#: each test starts its own replicated Redis and waits out a failover
pytestmark = pytest.mark.slow

#: how soon admissions must be accepted again after the kill: the cluster's node timeout (1 s), the
#: replica's election, and the old master's restart as a replica (WAIT needs one)
RESUME_BOUND_S = 20.0
#: the longest any admission may take meanwhile: the command timeout (2 s) and the WAIT timeout (1 s),
#: plus room for a loaded machine
ANSWER_BOUND_S = 5.0


@pytest.fixture
def cluster() -> Iterator[RedisClusterNodes]:
    with RedisClusterNodes(masters=3, replicas=1) as cluster:
        yield cluster


async def test_a_job_runs_through_on_a_cluster(cluster: RedisClusterNodes) -> None:
    async with (
        RedisBroker(cluster.url, load_settings()) as gateway,
        RedisBroker(cluster.url, load_settings()) as worker,
    ):
        assert gateway.durability.replicas == 1  # the default with a cluster
        master = cluster.master_of(gateway.keys.prefix)
        job = make_job(time.time)
        admission = await gateway.admit(job)
        assert admission.position == 0
        with cluster.replicas_of(master)[0].client() as replica:
            replica.execute_command("READONLY")  # a cluster replica answers reads only when asked to
            assert replica.exists(gateway.keys.job(job.id)) == 1  # WAIT: the replica had it first

        claimed = await worker.claim("w", ["m"], timeout=2)
        assert claimed is not None and claimed.id == job.id
        events = asyncio.create_task(_events(gateway, job.id))
        await worker.publish(job.id, EventType.TOKEN, {"text": "hi"})
        done = await worker.finish(job.id, "w", JobState.SUCCEEDED, result={"ok": True})
        assert done is not None and done.state is JobState.SUCCEEDED
        assert await asyncio.wait_for(events, 10) == [
            EventType.QUEUED,
            EventType.STARTED,
            EventType.TOKEN,
            EventType.DONE,
        ]

        # Connections sent to a node that does not serve the queue's slot follow its MOVED.
        other = next(m for m in cluster.current_masters() if m is not master)
        await gateway._redis.connection_pool.disconnect()
        assert gateway._locator is not None
        gateway._locator.redirect(("127.0.0.1", other.port))
        again = await gateway.get(job.id)
        assert again is not None and again.state is JobState.SUCCEEDED
        assert gateway._locator.current == ("127.0.0.1", master.port)


async def _events(broker: RedisBroker, job_id: str) -> list[EventType]:
    return [e.type async for e in broker.events(job_id, timeout=10)]


async def test_killing_the_queues_master_loses_no_accepted_job(cluster: RedisClusterNodes) -> None:
    load = FailoverLoad(cluster.url, min_replicas=None)  # the default with a cluster: one replica
    await load.start()
    book = load.ledger
    try:
        await wait_until(lambda: len(book.accepted) >= 100, timeout=30)
        master = cluster.master_of("{sluice}:")
        killed_at = time.monotonic()
        master.kill()
        # (The helpers block: in threads, so that the load goes on meanwhile.)
        promoted = await asyncio.to_thread(cluster.wait_promoted, master, "{sluice}:")
        promoted_s = time.monotonic() - killed_at
        # The promoted replica has no replica of its own until the old master is back (as one):
        # until then WAIT cannot be met and admissions are answered 503, as they should.
        await asyncio.to_thread(master.start)
        await asyncio.to_thread(wait_replicas, promoted, 1)
        resumed_s = await load.assert_nothing_lost_since(
            killed_at, resume_bound_s=RESUME_BOUND_S, answer_bound_s=ANSWER_BOUND_S
        )
        print(
            f"\ncluster failover, durable: {len(book.accepted)} accepted, 0 lost; replica promoted after "
            f"{promoted_s:.2f} s, admissions resumed after {resumed_s:.2f} s (with the old master back as a "
            f"replica); {len(book.unavailable_at)} admissions answered 503 and {book.refused} refused "
            f"meanwhile, the slowest answer {book.admit_latency_s:.2f} s; "
            f"{len(book.claimed_twice)} job(s) claimed twice"
        )
    finally:
        await load.stop()
