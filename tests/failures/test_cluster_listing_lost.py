"""The master of the home shard (the queue-wide keys, the tenants' job lists) dies while a gateway
admits jobs of a model on another master: each job is queued there before the broker lists it in
the home shard, so the admission is answered by what happened to the job, accepted (a 503 would
have the client send it again and run it twice), and the listing is repaired by upkeep once the
home master is back (``RedisJobs._repair_listing``): ``GET /v1/jobs`` does not miss it for good.
"""

from __future__ import annotations

import time
from collections.abc import Iterator

import pytest

from sluice.broker.base import BrokerSettings
from sluice.broker.redis import RedisBroker
from sluice.broker.redis_jobs import LIST_REPAIR_AFTER_S
from sluice.broker.redis_keys import QueueKeys
from sluice.broker.redis_shards import shard_of_model, shard_queue
from sluice.core.job import JobState
from tests.helpers import make_job, wait_until
from tests.redis_server import RedisClusterNodes

pytestmark = pytest.mark.slow


@pytest.fixture
def patient_cluster() -> Iterator[RedisClusterNodes]:
    """Three masters, no replicas, a two-minute node timeout: the killed master is not declared
    failed while the test runs, so the others go on serving their slots."""
    with RedisClusterNodes(masters=3, replicas=0, node_timeout_ms=120_000) as cluster:
        yield cluster


def _away_model(cluster: RedisClusterNodes) -> str:
    home = cluster.master_of(QueueKeys().prefix)
    for i in range(1000):
        model = f"model-{i}"
        if cluster.master_of(QueueKeys(shard_queue("sluice", shard_of_model(model))).prefix) is not home:
            return model
    raise AssertionError("no model on another master than the home shard's")


@pytest.mark.timeout(180)
async def test_a_job_admitted_while_the_home_master_is_down_is_accepted_and_listed_later(
    patient_cluster: RedisClusterNodes,
) -> None:
    cluster = patient_cluster
    model = _away_model(cluster)
    home = cluster.master_of(QueueKeys().prefix)
    settings = BrokerSettings(lease_s=60.0, result_ttl_s=600.0)
    async with RedisBroker(cluster.url, settings, min_replicas=0) as gateway:
        before = make_job(time.time, model=model, tenant="a")
        await gateway.admit(before)  # (its shard announced in the home shard, once)
        home.kill()
        job = make_job(time.time, model=model, tenant="a")
        admission = await gateway.admit(job)
        assert admission.job is job and not admission.duplicate
        queued = await gateway.get(job.id)
        assert queued is not None and queued.state is JobState.QUEUED

        home.start()  # with its AOF: the list and the slots it had

        async def listed() -> bool:
            try:
                page = await gateway.list_jobs("a", limit=10)
            except Exception:
                return False
            return [j.id for j in page.jobs] == [job.id, before.id]

        # Upkeep lists it once its admission's own listing has had its time.
        await wait_until(listed, timeout=LIST_REPAIR_AFTER_S + 30.0)
