"""The harness the Kafka failure tests stand on: Tansu on S3 storage is the same broker after a
SIGKILL and a restart on the same port (its topics, records and committed offsets are in the
bucket), which is what tests/failures/test_kafka_broker_killed.py needs of it."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.kafka.brokers import BUCKET, S3Server, Tansu

aiokafka = pytest.importorskip("aiokafka")
kafka_admin = pytest.importorskip("aiokafka.admin")


@pytest.fixture
def tansu() -> Iterator[Tansu]:
    with S3Server() as s3, Tansu(f"s3://{BUCKET}/", s3.env) as broker:
        yield broker


async def test_records_and_committed_offsets_survive_a_killed_tansu_on_s3(tansu: Tansu) -> None:
    admin = kafka_admin.AIOKafkaAdminClient(bootstrap_servers=tansu.bootstrap)
    await admin.start()
    try:
        await admin.create_topics([kafka_admin.NewTopic("t", 1, 1)])
    finally:
        await admin.close()
    producer = aiokafka.AIOKafkaProducer(bootstrap_servers=tansu.bootstrap, acks="all")
    await producer.start()
    try:
        for i in range(10):
            await producer.send_and_wait("t", f"v{i}".encode(), key=f"k{i}".encode())
    finally:
        await producer.stop()
    tp = aiokafka.TopicPartition("t", 0)
    consumer = aiokafka.AIOKafkaConsumer(
        bootstrap_servers=tansu.bootstrap, group_id="g", enable_auto_commit=False
    )
    await consumer.start()
    try:
        consumer.assign([tp])
        await consumer.commit({tp: 4})
    finally:
        await consumer.stop()

    tansu.kill()
    tansu.start()  # same port, same bucket

    consumer = aiokafka.AIOKafkaConsumer(
        bootstrap_servers=tansu.bootstrap, group_id="g", enable_auto_commit=False, request_timeout_ms=10_000
    )
    await consumer.start()
    try:
        assert await consumer.committed(tp) == 4
        consumer.assign([tp])
        consumer.seek(tp, 0)
        values: list[bytes] = []
        for _ in range(50):  # bounded: 50 polls of at most 200 ms
            for records in (await consumer.getmany(timeout_ms=200)).values():
                values += [r.value for r in records]
            if len(values) >= 10:
                break
        assert values == [f"v{i}".encode() for i in range(10)]
    finally:
        await consumer.stop()
