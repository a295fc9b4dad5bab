"""The Redis broker on a real Redis Cluster (three masters, a replica each): its
scripts run there as on one Redis, each model's queue is on the master of its own hash tag (so the
models of one queue spread over the masters), a stale slot map is corrected by MOVED, and kill -9 of
the master that serves a model lets its replica take over with nothing accepted lost (WAIT, on by
default with a cluster) while the other masters go on serving their models, to the same worker
when it serves models of several masters.
"""

from __future__ import annotations

import asyncio
import logging
import time
from collections.abc import Iterator

import pytest

from sluice.broker.base import BrokerSettings, BrokerUnavailable, EventType
from sluice.broker.redis import RedisBroker
from sluice.broker.redis_keys import QueueKeys
from sluice.broker.redis_shards import shard_of_job, shard_of_model, shard_queue
from sluice.core.job import JobState
from tests.failures.failover_load import FailoverLoad, load_settings
from tests.helpers import FakeClock, make_job, wait_until
from tests.redis_server import RedisClusterNodes, RedisServer, wait_replicas

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


def _prefix(model: str) -> str:
    """The hash-tagged prefix of the keys of ``model``'s queue and jobs (queue ``sluice``)."""
    return QueueKeys(shard_queue("sluice", shard_of_model(model))).prefix


def _one_model_per_master(cluster: RedisClusterNodes) -> list[str]:
    """Model names whose queues are on different masters, one per master; the first is not on the
    master of the home shard (the queue-wide keys, ``{sluice}:``)."""
    home = cluster.master_of(QueueKeys().prefix).port
    found: dict[int, str] = {}
    for i in range(1000):
        model = f"model-{i}"
        found.setdefault(cluster.master_of(_prefix(model)).port, model)
        if len(found) == cluster.masters:
            return sorted(found.values(), key=lambda m: cluster.master_of(_prefix(m)).port == home)
    raise AssertionError("no model name found for every master")


def _model_after(cluster: RedisClusterNodes, shard: int, not_on: RedisServer) -> str:
    """A model name whose shard's number is above ``shard`` and whose master is not ``not_on``."""
    for i in range(1000):
        model = f"late-{i}"
        if shard_of_model(model) > shard and cluster.master_of(_prefix(model)) is not not_on:
            return model
    raise AssertionError(f"no model name found in a shard after {shard}")


def _blocked_clients(node: RedisServer) -> int:
    with node.client() as c:
        return int(c.info("clients")["blocked_clients"])


async def test_a_job_runs_through_on_a_cluster(cluster: RedisClusterNodes) -> None:
    async with (
        RedisBroker(cluster.url, load_settings()) as gateway,
        RedisBroker(cluster.url, load_settings()) as worker,
    ):
        assert gateway.durability.replicas == 1  # the default with a cluster
        assert gateway.spread
        master = cluster.master_of(_prefix("m"))
        job = make_job(time.time)
        admission = await gateway.admit(job)
        assert admission.position == 0
        shard = gateway._job_shard(job.id)
        assert shard.number == shard_of_model("m") == shard_of_job(job.id)
        with cluster.replicas_of(master)[0].client() as replica:
            replica.execute_command("READONLY")  # a cluster replica answers reads only when asked to
            assert replica.exists(shard.keys.job(job.id)) == 1  # WAIT: the replica had it first

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

        # Connections sent to a node that does not serve the shard's slot follow its MOVED.
        other = next(m for m in cluster.current_masters() if m is not master)
        await shard.redis.connection_pool.disconnect()
        assert shard.locator is not None
        shard.locator.redirect(("127.0.0.1", other.port))
        again = await gateway.get(job.id)
        assert again is not None and again.state is JobState.SUCCEEDED
        assert shard.locator.current == ("127.0.0.1", master.port)


async def test_models_spread_over_the_masters(cluster: RedisClusterNodes) -> None:
    models = _one_model_per_master(cluster)
    masters = [cluster.master_of(_prefix(m)) for m in models]
    assert len({m.port for m in masters}) == 3
    async with (
        RedisBroker(cluster.url, load_settings()) as gateway,
        RedisBroker(cluster.url, load_settings()) as worker,
    ):
        jobs = [make_job(time.time, model=model) for model in models]
        for job in jobs:
            assert (await gateway.admit(job)).position == 0
        for job, model, master in zip(jobs, models, masters, strict=True):
            assert shard_of_job(job.id) == shard_of_model(model)
            keys = gateway._job_shard(job.id).keys
            with master.client() as c:  # any other master would answer MOVED
                assert (
                    c.exists(keys.job(job.id), keys.state(model), keys.tq(model, job.priority, job.tenant))
                    == 3
                )
                slot = int(c.execute_command("CLUSTER", "KEYSLOT", keys.prefix))
                assert int(c.execute_command("CLUSTER", "COUNTKEYSINSLOT", slot)) > 0
        await worker.register("w", dict.fromkeys(models, 2))  # (a registration lasts a lease: 2 s)
        stats = await gateway.stats()
        assert {m: (stats[m].queued_jobs, stats[m].slots) for m in models} == dict.fromkeys(models, (1, 2))

        # A broker that never saw these models finds each job from its id alone.
        async with RedisBroker(cluster.url, load_settings()) as stranger:
            found = [await stranger.get(job.id) for job in jobs]
            assert [j.model if j else None for j in found] == models

        claimed = [await worker.claim("w", models, timeout=2) for _ in models]
        assert sorted(j.id for j in claimed if j is not None) == sorted(j.id for j in jobs)
        # An idle claim over models on three masters blocks on all three and wakes for any of them.
        waiting = asyncio.create_task(worker.claim("w", models, timeout=30))
        await wait_until(lambda: all(_blocked_clients(m) >= 1 for m in masters), timeout=10)
        late = make_job(time.time, model=models[1])
        await gateway.admit(late)
        woken = await asyncio.wait_for(waiting, 10)
        assert woken is not None and woken.id == late.id
        for job in [*claimed, woken]:
            assert job is not None
            done = await worker.finish(job.id, "w", JobState.SUCCEEDED, result={"ok": True})
            assert done is not None and done.state is JobState.SUCCEEDED
        stats = await gateway.stats()
        assert {m: (stats[m].queued_jobs, stats[m].running_jobs) for m in models} == dict.fromkeys(
            models, (0, 0)
        )


async def test_a_tenants_jobs_are_listed_from_every_master(cluster: RedisClusterNodes) -> None:
    # A tenant's list is in the home shard: admit.lua writes it for a model there, the broker
    # (_list_job) for a model on another master; list_jobs reads the one list back.
    models = _one_model_per_master(cluster)
    home = cluster.master_of(QueueKeys().prefix)
    assert any(cluster.master_of(_prefix(m)) is home for m in models)  # both writers are used
    clock = FakeClock(time.time())

    def tick() -> float:
        clock.advance(0.001)  # distinct created_at: the list's order is defined
        return clock()

    async with RedisBroker(cluster.url, load_settings()) as gateway:
        admitted = []
        for i in range(7):
            job = make_job(tick, model=models[i % len(models)], tenant="a")
            await gateway.admit(job)
            admitted.append(job.id)
            await gateway.admit(make_job(tick, model=models[i % len(models)], tenant="b"))
        newest_first = admitted[::-1]
        page = await gateway.list_jobs("a", limit=10)
        assert [j.id for j in page.jobs] == newest_first and not page.has_more
        assert {j.model for j in page.jobs} == set(models)
        # Page by page, from another broker that never saw these models or jobs.
        async with RedisBroker(cluster.url, load_settings()) as stranger:
            seen: list[str] = []
            after = None
            while True:
                page = await stranger.list_jobs("a", limit=3, after=after)
                seen += [j.id for j in page.jobs]
                if not page.has_more:
                    break
                after = seen[-1]
            assert seen == newest_first

        # An admission whose first try got through but was not listed (its answer lost on the way
        # back, before the broker listed it: a connection dropped, retried at once): the retry is
        # answered "already admitted", and the job is listed then.
        away = next(m for m in models if cluster.master_of(_prefix(m)) is not home)
        job = make_job(tick, model=away, tenant="a")
        await gateway.admit(job)
        with home.client() as c:
            assert c.zrem(QueueKeys().tenant_jobs_us("a"), job.id) == 1
        again = await gateway.admit(job)
        assert again.job.id == job.id
        page = await gateway.list_jobs("a", limit=10)
        assert [j.id for j in page.jobs] == [job.id, *newest_first]


async def _events(broker: RedisBroker, job_id: str) -> list[EventType]:
    return [e.type async for e in broker.events(job_id, timeout=10)]


#: the sum of its bounds: the cluster made (60 s), 150 accepted (60 s), the promotion and the old
#: master back (each its own bound), 100 accepted on the promoted master (80 s), every job ended (60 s)
@pytest.mark.timeout(360)
async def test_killing_a_models_master_loses_no_accepted_job(cluster: RedisClusterNodes) -> None:
    models = _one_model_per_master(cluster)
    # the default with a cluster: one replica confirms every admission
    load = FailoverLoad(cluster.url, min_replicas=None, models=models)
    await load.start()
    book = load.ledger
    lost_shard = shard_of_model(models[0])

    def on_lost_master(job_id: str) -> bool:
        return shard_of_job(job_id) == lost_shard

    def elsewhere(job_id: str) -> bool:
        return not on_lost_master(job_id)

    try:
        await load.wait_accepted(150, timeout=60)  # counted; the bound is for a loaded machine
        master = cluster.master_of(_prefix(models[0]))
        assert all(cluster.master_of(_prefix(m)) is not master for m in models[1:])
        # Not the home shard's master: every admission also writes the tenant's job list there.
        assert cluster.master_of(QueueKeys().prefix) is not master
        killed_at = time.monotonic()
        master.kill()
        # (The helpers block: in threads, so that the load goes on meanwhile.)
        promoted = await asyncio.to_thread(cluster.wait_promoted, master, _prefix(models[0]))
        promoted_s = time.monotonic() - killed_at
        # Meanwhile the other masters went on taking their models' jobs.
        served_elsewhere = book.accepted_since(killed_at, elsewhere)
        assert served_elsewhere > 0
        # The promoted replica has no replica of its own until the old master is back (as one):
        # until then WAIT cannot be met and admissions are answered 503, as they should.
        await asyncio.to_thread(master.start)
        await asyncio.to_thread(wait_replicas, promoted, 1)
        resumed_s = await load.assert_nothing_lost_since(
            killed_at, resume_bound_s=RESUME_BOUND_S, answer_bound_s=ANSWER_BOUND_S, resumed=on_lost_master
        )
        on_lost = sum(1 for job_id in book.accepted if on_lost_master(job_id))
        print(
            f"\ncluster failover, durable, {len(models)} models on {len(models)} masters: "
            f"{len(book.accepted)} accepted ({on_lost} on the killed master), 0 lost; "
            f"{served_elsewhere} accepted by the other masters before the promotion; replica promoted after "
            f"{promoted_s:.2f} s, admissions resumed after {resumed_s:.2f} s (with the old master back as a "
            f"replica); {len(book.unavailable_at)} admissions answered 503 and {book.refused} refused "
            f"meanwhile, the slowest answer {book.admit_latency_s:.2f} s; "
            f"{len(book.claimed_twice)} job(s) claimed twice"
        )
    finally:
        await load.stop()


@pytest.fixture
def patient_cluster() -> Iterator[RedisClusterNodes]:
    """A cluster whose nodes take two minutes to declare a silent master failed: a killed master is
    not failed over while a test runs, so its slots stay down and the other masters keep serving
    theirs (with the default, cluster-require-full-coverage, the whole cluster refuses once a
    master is declared failed and until its replica is promoted)."""
    with RedisClusterNodes(masters=3, replicas=1, node_timeout_ms=120_000) as cluster:
        yield cluster


@pytest.mark.timeout(240)
async def test_a_worker_serves_the_other_masters_models_while_one_master_is_down(
    patient_cluster: RedisClusterNodes, caplog: pytest.LogCaptureFixture
) -> None:
    cluster = patient_cluster
    models = _one_model_per_master(cluster)
    lost, healthy = models[0], models[1]
    masters = [cluster.master_of(_prefix(m)) for m in models]
    down, up = masters[0], masters[1]
    # Leases and registrations far longer than the test: nothing runs out on a loaded machine.
    settings = BrokerSettings(lease_s=60.0, result_ttl_s=600.0)
    async with (
        RedisBroker(cluster.url, settings) as gateway,
        RedisBroker(cluster.url, settings) as worker,
    ):
        await worker.register("w", dict.fromkeys(models, 4))
        stranded = make_job(time.time, model=lost)  # running on the master that will die
        await gateway.admit(stranded)
        claimed = await worker.claim("w", [lost], timeout=5)
        assert claimed is not None and claimed.id == stranded.id
        healthy_keys = QueueKeys(shard_queue("sluice", shard_of_model(healthy)))
        with up.client() as c:
            registered_before = c.zscore(healthy_keys.workers, "w")
        assert registered_before is not None

        # A claim blocked on the three masters when one of them dies goes on waiting on the two
        # others and takes a job admitted on one of them.
        waiting = asyncio.create_task(worker.claim("w", models, timeout=60))
        await wait_until(lambda: all(_blocked_clients(m) >= 1 for m in masters), timeout=10)
        caplog.set_level(logging.WARNING, logger="sluice.broker.redis")
        down.kill()
        first = make_job(time.time, model=healthy)
        await gateway.admit(first)
        woken = await asyncio.wait_for(waiting, 20)
        assert woken is not None and woken.id == first.id

        # Fresh claims over the three take the healthy masters' jobs at once, whichever shard their
        # round starts from (the shard of the dead master, known down, goes last).
        jobs = [make_job(time.time, model=m) for m in (healthy, models[2], healthy)]
        for job in jobs:
            await gateway.admit(job)
        got = [await asyncio.wait_for(worker.claim("w", models, timeout=10), 20) for _ in jobs]
        assert sorted(j.id for j in got if j is not None) == sorted(j.id for j in jobs)
        # Nothing to take on the healthy masters: the claim waits its time out and answers None.
        assert await asyncio.wait_for(worker.claim("w", models, timeout=2.5), 20) is None
        # A claim whose every shard is down says so.
        with pytest.raises(BrokerUnavailable):
            await asyncio.wait_for(worker.claim("w", [lost], timeout=5), 20)

        # Registration and heartbeats go on on the masters that answer.
        await worker.register("w", dict.fromkeys(models, 4))
        with up.client() as c:
            registered_after = c.zscore(healthy_keys.workers, "w")
            lease_before = c.zscore(healthy_keys.active, first.id)
        assert registered_after is not None and registered_after > registered_before
        running = [stranded.id, first.id, *(j.id for j in jobs)]
        assert await worker.heartbeat("w", running) == set()  # the stranded job is not given up
        with up.client() as c:
            lease_after = c.zscore(healthy_keys.active, first.id)
        assert lease_before is not None and lease_after is not None and lease_after > lease_before
        for job in [first, *jobs]:
            done = await worker.finish(job.id, "w", JobState.SUCCEEDED, result={"ok": True})
            assert done is not None and done.state is JobState.SUCCEEDED

        # Upkeep goes on past the dead master's shard: a lease lost on a healthy master, in a shard
        # that upkeep walks after the dead one (shards go in number order), is reaped, its job queued
        # again.
        late = _model_after(cluster, shard_of_model(lost), down)
        async with RedisBroker(cluster.url, BrokerSettings(lease_s=1.0, result_ttl_s=600.0)) as brief:
            lapsing = make_job(time.time, model=late)
            await gateway.admit(lapsing)
            taken = await brief.claim("b", [late], timeout=5)
            assert taken is not None and taken.id == lapsing.id  # and never renewed

        async def requeued() -> bool:
            job = await gateway.get(lapsing.id)
            return job is not None and job.state is JobState.QUEUED

        await wait_until(requeued, timeout=30)
        # And so do webhooks: an ended job's in a shard after the dead one is handed out.
        hooked = make_job(time.time, model=late)
        hooked.callback_url = "https://example.com/hook"
        await gateway.admit(hooked)
        await gateway.cancel(hooked.id)
        assert await asyncio.wait_for(worker.ended_callbacks("w", timeout=5), 20) == [hooked.id]

        # The dead master's outage was logged once, not at each of the rounds above.
        said = [r for r in caplog.records if f"shard {_prefix(lost).rstrip(':')} " in r.getMessage()]
        assert len(said) == 1, [r.getMessage() for r in said]
        # All of it happened before any failover: the dead master still holds its slots.
        assert cluster.master_of(_prefix(lost)) is down
