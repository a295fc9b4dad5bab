"""A Redis Cluster master that hangs (SIGSTOP: its port still accepts connections, nothing is
answered) rather than refuses: a worker whose models span the masters goes on taking the healthy
masters' jobs one after the other, and takes the hung master's job once it answers again.

A call to the hung master fails only by its timeout (the command timeout, 2 s). A claim over
several masters that waited that long on it at every round held each healthy master's next job
back by as much; the claim skips a master known to be down and has it probed meanwhile
(``RedisCore._probe``), so only the round that found it down pays the timeout.

The invariant each test asserts is a count, not a time: while the master hangs, the worker sends
it one command at most from each of its loops (the one that found it down), its probes apart. The
wall-clock bounds are waits with room (a loaded machine), which the count does not need.
"""

from __future__ import annotations

import asyncio
import contextlib
import os
import signal
import time
from collections.abc import Iterator
from typing import Any

import pytest

from sluice.broker.base import BrokerSettings
from sluice.broker.redis import RedisBroker
from sluice.broker.redis_keys import QueueKeys
from sluice.broker.redis_shards import shard_of_model, shard_queue
from sluice.core.job import Job, JobState
from tests.helpers import make_job, wait_until
from tests.redis_server import RedisClusterNodes, RedisServer

pytestmark = pytest.mark.slow

#: jobs admitted on the healthy masters, one at a time (each after the one before has finished)
ONE_BY_ONE = 10
#: the wait for all of them: a bound with room, not the test's measure (the count of commands sent
#: to the hung master is); with the hung master skipped, a job is claimed as soon as it is admitted
ALL_DONE_BOUND_S = 60.0


@pytest.fixture
def patient_cluster() -> Iterator[RedisClusterNodes]:
    """Three masters and no replicas, whose nodes take two minutes to declare a silent master
    failed: the stopped master's slots are neither failed over nor taken off while the test runs
    (once a master is declared failed, the whole cluster refuses, cluster-require-full-coverage)."""
    with RedisClusterNodes(masters=3, replicas=0, node_timeout_ms=120_000) as cluster:
        yield cluster


def _prefix(model: str) -> str:
    return QueueKeys(shard_queue("sluice", shard_of_model(model))).prefix


def _models(cluster: RedisClusterNodes) -> tuple[str, list[str]]:
    """A model on a master that is not the home shard's (the queue-wide keys), and one model on
    each of the two others."""
    home = cluster.master_of(QueueKeys().prefix).port
    found: dict[int, str] = {}
    for i in range(1000):
        found.setdefault(cluster.master_of(_prefix(f"model-{i}")).port, f"model-{i}")
        if len(found) == cluster.masters:
            break
    hung = next(m for port, m in found.items() if port != home)
    return hung, [m for m in found.values() if m != hung]


def _sent_to(worker: RedisBroker, model: str) -> list[tuple[Any, ...]]:
    """The commands ``worker`` sends to ``model``'s shard from now on (its claims, registrations,
    heartbeats, and its upkeep's rounds), but its probes of a shard known down (``RedisCore._probe``)."""
    shard = worker._shard(shard_of_model(model))
    sent: list[tuple[Any, ...]] = []
    add = shard.batch._add

    def counted(entry: Any, loop: asyncio.AbstractEventLoop) -> None:
        task = asyncio.current_task()
        if task is None or task.get_name() not in _NOT_COUNTED:
            sent.extend(entry.commands())
        add(entry, loop)

    shard.batch._add = counted  # type: ignore[method-assign]
    return sent


#: the names of the broker's own tasks whose calls :func:`_sent_to` leaves out
_NOT_COUNTED = frozenset({"redis-shard-probe"})


@contextlib.contextmanager
def _stopped(node: RedisServer) -> Iterator[None]:
    assert node.proc is not None
    os.kill(node.proc.pid, signal.SIGSTOP)
    try:
        yield
    finally:
        os.kill(node.proc.pid, signal.SIGCONT)


async def _work(worker: RedisBroker, models: list[str], done: list[str]) -> None:
    """One slot's loop, as the dispatcher's: claim, finish, claim again."""
    while True:
        job = await worker.claim("w", models, timeout=30)
        if job is None:
            continue
        ended = await worker.finish(job.id, "w", JobState.SUCCEEDED, result={"ok": True})
        assert ended is not None and ended.state is JobState.SUCCEEDED
        done.append(job.id)


@pytest.mark.timeout(240)
async def test_a_hung_master_holds_up_no_healthy_masters_jobs(patient_cluster: RedisClusterNodes) -> None:
    cluster = patient_cluster
    hung, healthy = _models(cluster)
    stopped = cluster.master_of(_prefix(hung))
    assert all(cluster.master_of(_prefix(m)) is not stopped for m in healthy)
    settings = BrokerSettings(lease_s=60.0, result_ttl_s=600.0)
    async with (
        RedisBroker(cluster.url, settings, min_replicas=0) as gateway,
        RedisBroker(cluster.url, settings, min_replicas=0) as worker,
    ):
        waiting_out = make_job(time.time, model=hung)  # queued on the master about to hang
        await gateway.admit(waiting_out)
        for model in healthy:  # every shard announced and known before the stop
            await gateway.admit(make_job(time.time, model=model))
        done: list[str] = []
        with _stopped(stopped):
            sent = _sent_to(worker, hung)
            loop = asyncio.create_task(_work(worker, [hung, *healthy], done))
            try:
                await wait_until(lambda: len(done) == len(healthy), timeout=30)
                jobs: list[Job] = []
                started = time.monotonic()
                for i in range(ONE_BY_ONE):
                    job = make_job(time.time, model=healthy[i % len(healthy)])
                    await asyncio.wait_for(gateway.admit(job), 10)
                    jobs.append(job)
                    left = ALL_DONE_BOUND_S - (time.monotonic() - started)
                    with contextlib.suppress(AssertionError):
                        await wait_until(lambda job=job: job.id in done, timeout=max(left, 0.01))  # type: ignore[misc]
                    if job.id not in done:
                        break
                finished = sum(1 for j in jobs if j.id in done)
                assert finished == ONE_BY_ONE, (
                    f"{finished} of {ONE_BY_ONE} healthy masters' jobs finished within {ALL_DONE_BOUND_S} s"
                )
                assert waiting_out.id not in done  # its master has not answered
                # Only the first round of the claims, and of upkeep (if this broker held its lock),
                # waited on it (its timeout): every later one passed it over.
                assert len(sent) <= 2, [c[:2] for c in sent]
            except BaseException:
                loop.cancel()
                raise
        # The master answers again: its job is taken too.
        try:
            await wait_until(lambda: waiting_out.id in done, timeout=30)
        finally:
            loop.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await loop
        assert len(done) == len(set(done))  # none ran twice


#: the lease of the test below, and its heartbeat (a third of it, as the dispatcher's): renewals
#: that waited on the hung master twice (2 s each) came 2 + 2 + 2 s apart, the whole lease; skipped,
#: they come a heartbeat apart, 4 s of room
SHORT_LEASE_S = 6.0


@pytest.mark.timeout(240)
async def test_a_hung_master_loses_no_lease_on_the_healthy_masters(
    patient_cluster: RedisClusterNodes,
) -> None:
    """A worker running a job on each master renews its leases (register, then heartbeat, as the
    dispatcher's heartbeat loop does) while one master hangs: the healthy masters' leases hold, and
    their jobs finish on their first attempt. Waiting on the hung master at each registration and
    each heartbeat (its timeout, 2 s, twice) put the renewals 4 s and a heartbeat apart: past the
    lease, and upkeep handed the jobs to another worker. The count: none of them but the first
    registration's (and upkeep's first round) sends the hung master a command."""
    cluster = patient_cluster
    hung, healthy = _models(cluster)
    stopped = cluster.master_of(_prefix(hung))
    models = [hung, *healthy]
    settings = BrokerSettings(lease_s=SHORT_LEASE_S, result_ttl_s=600.0)
    async with (
        RedisBroker(cluster.url, settings, min_replicas=0) as gateway,
        RedisBroker(cluster.url, settings, min_replicas=0) as worker,
    ):
        jobs = [make_job(time.time, model=m) for m in models]
        for job in jobs:
            await gateway.admit(job)
        await worker.register("w", dict.fromkeys(models, 1))
        running = [await worker.claim("w", [m], timeout=5) for m in models]
        assert [j.id if j else None for j in running] == [j.id for j in jobs]
        with _stopped(stopped):
            sent = _sent_to(worker, hung)
            await worker.register("w", dict.fromkeys(models, 1))  # finds it down (its timeout, once)
            beats = 0
            until = time.monotonic() + 3 * SHORT_LEASE_S
            while time.monotonic() < until:  # the dispatcher's heartbeat loop, for three leases
                await asyncio.sleep(SHORT_LEASE_S / 3)
                await worker.register("w", dict.fromkeys(models, 1))
                assert await worker.heartbeat("w", [j.id for j in jobs]) == set()
                beats += 1
            assert beats >= 2
            # The first registration's, which found it down, and upkeep's first round's, if this broker
            # held its lock then (upkeep waited on it at every round before).
            assert 1 <= len(sent) <= 2, [c[:2] for c in sent]
            for job in jobs[1:]:
                ended = await worker.finish(job.id, "w", JobState.SUCCEEDED, result={"ok": True})
                assert ended is not None and ended.state is JobState.SUCCEEDED, job.model
                assert ended.attempts == 1
