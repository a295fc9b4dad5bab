"""How the broker tests build brokers: the settings every suite runs with, an emptied Redis, and
one broker of each implementation by its name."""

from __future__ import annotations

import pytest
from redis.asyncio import Redis

from sluice.broker.base import Broker, BrokerSettings
from sluice.broker.memory import MemoryBroker
from sluice.broker.redis import RedisBroker
from sluice.core.admission import Bounds, QueueLimits
from tests.helpers import FakeClock
from tests.redis_server import RedisServer


def make_settings(clock: FakeClock) -> BrokerSettings:
    """A queue ``small`` of 3 jobs and 1000 tokens, roomy ones for other models, 5 s leases and
    results kept 60 s, all on ``clock``."""
    return BrokerSettings(
        limits={"small": QueueLimits(model=Bounds(max_jobs=3, max_tokens=1000))},
        default_limits=QueueLimits(model=Bounds(max_jobs=10_000)),
        lease_s=5.0,
        result_ttl_s=60.0,
        clock=clock,
    )


async def empty_redis(server: RedisServer) -> str:
    """The server's URL, the server started again if a test killed it and emptied."""
    if not server.running:
        server.start()
    client = Redis.from_url(server.url)
    try:
        await client.flushall()
    finally:
        await client.aclose()
    return server.url


async def make_broker(name: str, request: pytest.FixtureRequest, clock: FakeClock) -> Broker:
    """A broker of implementation ``name`` ("memory", "redis", or "redis-spread": each model's
    queue on a shard of its own) with ``make_settings(clock)``, not yet started; Redis is started
    (and emptied) only for the Redis brokers, through the ``redis_server`` fixture."""
    if name == "memory":
        return MemoryBroker(make_settings(clock))
    server: RedisServer = request.getfixturevalue("redis_server")
    return RedisBroker(await empty_redis(server), make_settings(clock), spread=name == "redis-spread")


async def claims_waiting(broker: Broker) -> int:
    """How many claims wait for work: the memory broker's waiting futures, Redis's blocked clients."""
    if isinstance(broker, MemoryBroker):
        return len(broker._claimers)
    assert isinstance(broker, RedisBroker)
    info = await broker._batch.call(("INFO", "clients"))
    text = info.decode() if isinstance(info, bytes) else str(info)
    return next(int(line.split(":")[1]) for line in text.splitlines() if line.startswith("blocked_clients:"))
