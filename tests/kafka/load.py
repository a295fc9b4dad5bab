"""What the Kafka failure tests do around a real ``sluice kafka``: produce requests to a topic, start
the bridge, read the answers topic back whole."""

from __future__ import annotations

import json
import time
from dataclasses import dataclass
from typing import Any

import pytest

from sluice.broker.base import BrokerSettings
from sluice.broker.redis import RedisBroker
from tests.failures.procs import Proc

aiokafka = pytest.importorskip("aiokafka")
kafka_admin = pytest.importorskip("aiokafka.admin")

REQUESTS = "requests"
ANSWERS = "answers"
GROUP = "g"
# Each read of a whole topic and each admin call is bounded (a broker that is away answers nothing).
READ_TIMEOUT_S = 30.0


@dataclass(frozen=True)
class Answer:
    """One record of the answers topic.

    Attributes:
        key: the record's key, the request's id.
        value: the batch output line the bridge wrote.
        offset: its offset in the answers topic.
    """

    key: str
    value: dict[str, Any]
    offset: int


def request_ids(n: int) -> list[str]:
    """The ids of ``produce_requests(n)``, in offset order (request ``r{i}`` is at offset ``i``)."""
    return [f"r{i}" for i in range(n)]


async def create_topics(bootstrap: str) -> None:
    admin = kafka_admin.AIOKafkaAdminClient(bootstrap_servers=bootstrap)
    await admin.start()
    try:
        await admin.create_topics([kafka_admin.NewTopic(t, 1, 1) for t in (REQUESTS, ANSWERS)])
    finally:
        await admin.close()


async def produce_requests(bootstrap: str, n: int, max_tokens: int = 20) -> None:
    """``n`` chat requests to one partition of ``REQUESTS``, acknowledged by all replicas."""
    producer = aiokafka.AIOKafkaProducer(bootstrap_servers=bootstrap, acks="all")
    await producer.start()
    try:
        for i, request_id in enumerate(request_ids(n)):
            body = {
                "model": "sim",
                "messages": [{"role": "user", "content": f"q{i}"}],
                "max_tokens": max_tokens,
            }
            await producer.send_and_wait(REQUESTS, json.dumps({"id": request_id, "body": body}).encode())
    finally:
        await producer.stop()


async def read_answers(bootstrap: str) -> list[Answer]:
    """Every record of ``ANSWERS`` from its start to its end now (a consumer of no group)."""
    tp = aiokafka.TopicPartition(ANSWERS, 0)
    consumer = aiokafka.AIOKafkaConsumer(bootstrap_servers=bootstrap, request_timeout_ms=10_000)
    await consumer.start()
    try:
        consumer.assign([tp])
        end = (await consumer.end_offsets([tp]))[tp]
        consumer.seek(tp, 0)
        answers: list[Answer] = []
        deadline = time.monotonic() + READ_TIMEOUT_S
        while await consumer.position(tp) < end:
            assert time.monotonic() < deadline, f"read {len(answers)} of {end} answers"
            for records in (await consumer.getmany(tp, timeout_ms=200)).values():
                for r in records:
                    assert r.key is not None, "an answer without its request's id as key"
                    answers.append(Answer(r.key.decode(), json.loads(r.value), r.offset))
        return answers
    finally:
        await consumer.stop()


async def committed(bootstrap: str) -> int:
    """The offset the bridge's group has committed on ``REQUESTS`` (0 before any commit)."""
    consumer = aiokafka.AIOKafkaConsumer(
        bootstrap_servers=bootstrap, group_id=GROUP, enable_auto_commit=False, request_timeout_ms=10_000
    )
    await consumer.start()
    try:
        return int(await consumer.committed(aiokafka.TopicPartition(REQUESTS, 0)) or 0)
    finally:
        await consumer.stop()


def start_bridge(redis_url: str, bootstrap: str, max_inflight: int, env: dict[str, str]) -> Proc:
    """``sluice kafka`` as a process: ``REQUESTS`` in, ``ANSWERS`` out, as the group ``GROUP``."""
    return Proc(
        [
            "kafka", "--broker", redis_url, "--bootstrap", bootstrap, "--topic", REQUESTS,
            "--output-topic", ANSWERS, "--group", GROUP, "--max-inflight", str(max_inflight),
        ],
        env,
    )  # fmt: skip


async def in_system(redis_url: str) -> int:
    """Jobs of the model ``sim`` queued or running on the Redis broker."""
    async with RedisBroker(redis_url, BrokerSettings()) as broker:
        stats = (await broker.stats()).get("sim")
        return stats.queued_jobs + stats.running_jobs if stats is not None else 0
