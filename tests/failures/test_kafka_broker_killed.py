"""The Kafka broker SIGKILLed under a running ``sluice kafka``: requests in a topic, the bridge (a real
process) admitting them and writing answers, and Tansu killed mid-run and started again on the same
port and storage (S3: see tests/kafka/brokers.py). The same bridge process rides the outage out:
every request is answered, none is lost, a request answered twice is answered under the same key by
the same job, and the committed offset never passes a request whose answer is not in the topic."""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterator

import pytest

from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.failures.procs import Proc, start_worker
from tests.helpers import wait_until
from tests.kafka.brokers import BUCKET, S3Server, Tansu
from tests.kafka.load import (
    Answer,
    committed,
    create_topics,
    in_system,
    produce_requests,
    read_answers,
    request_ids,
    start_bridge,
)
from tests.redis_server import RedisServer

N = 60
KILL_AFTER = 15  # answers in the topic before the broker is killed
ENV = {"SLUICE_LEASE_S": "2"}

pytestmark = [pytest.mark.slow, pytest.mark.timeout(420)]


@pytest.fixture
def tansu() -> Iterator[Tansu]:
    """Tansu on S3 storage: killed and started again, it is the same broker."""
    with S3Server() as s3, Tansu(f"s3://{BUCKET}/", s3.env) as broker:
        yield broker


async def answered(bootstrap: str, at_least: int) -> bool:
    return len({a.key for a in await read_answers(bootstrap)}) >= at_least


async def drained(redis_url: str) -> bool:
    return await in_system(redis_url) == 0


async def group_at(bootstrap: str, offset: int) -> bool:
    return await committed(bootstrap) == offset


async def assert_committed_only_answered(bootstrap: str) -> int:
    """The group's committed offset C, read before the answers: every request below C is answered."""
    upto = await committed(bootstrap)
    keys = {a.key for a in await read_answers(bootstrap)}
    missing = [r for r in request_ids(N)[:upto] if r not in keys]
    assert not missing, f"committed up to {upto} with no answer for {missing}"
    return upto


def assert_duplicates_same_key_same_job(answers: list[Answer]) -> int:
    """Every answer is keyed by a request's id, its line names the same id, and the answers of one id
    are of one job (a record read again found its job, not a second run); returns the duplicates."""
    ids = set(request_ids(N))
    jobs: dict[str, set[str]] = {}
    for a in answers:
        assert a.key in ids, a
        assert a.value["custom_id"] == a.key, a
        assert a.value["response"]["status_code"] == 200, a
        jobs.setdefault(a.key, set()).add(a.value["response"]["request_id"])
    ran_twice = {k: v for k, v in jobs.items() if len(v) > 1}
    assert not ran_twice, f"requests run as more than one job: {ran_twice}"
    return sum(n - 1 for n in Counter(a.key for a in answers).values())


async def test_requests_from_a_topic_are_all_answered_through_a_killed_kafka_broker(
    redis: RedisServer, tansu: Tansu
) -> None:
    bootstrap = tansu.bootstrap
    await create_topics(bootstrap)  # the topics exist before the bridge subscribes
    await produce_requests(bootstrap, N)
    procs: list[Proc] = []
    async with serve_in_background(preset("fast", model="sim", base_step_s=0.05)) as engine:
        try:
            procs.append(start_worker(redis.url, engine, concurrency=4, env=ENV))
            bridge = start_bridge(redis.url, bootstrap, max_inflight=4, env=ENV)
            procs.append(bridge)
            await wait_until(lambda: answered(bootstrap, KILL_AFTER), timeout=120)
            before = await assert_committed_only_answered(bootstrap)

            tansu.kill()  # mid-run: some answered, some admitted, the rest unread
            at_kill = await in_system(redis.url)
            # The jobs the bridge admitted go on and end; their answers cannot be written, so
            # nothing commits and nothing more is admitted than the bridge's bound.
            await wait_until(lambda: drained(redis.url), timeout=60)
            assert bridge.alive, bridge.output()

            tansu.start()  # the same port, the same bucket
            after = await assert_committed_only_answered(bootstrap)
            assert after >= before  # the commits made before the kill were kept
            await wait_until(lambda: answered(bootstrap, N), timeout=180)
            assert bridge.alive, bridge.output()  # the same bridge process, never restarted
            await wait_until(lambda: group_at(bootstrap, N), timeout=30)
            answers = await read_answers(bootstrap)
        finally:
            for proc in procs:
                proc.stop()
    assert sorted({a.key for a in answers}) == sorted(request_ids(N))  # none lost
    duplicates = assert_duplicates_same_key_same_job(answers)
    print(
        f"produced {N}, answer records {len(answers)}, distinct ids {len({a.key for a in answers})}, "
        f"duplicates {duplicates}, committed {before} before the kill and {after} after the restart, "
        f"{at_kill} requests in the system at the kill (their jobs ended while the broker was away)"
    )
