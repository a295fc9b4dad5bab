"""Broker URLs (one Redis, Sentinel, Cluster), the durability they default to, and WAIT: a durable
write is answered only once the replicas asked for have it, and 503 (BrokerUnavailable) when they
do not confirm in time."""

from __future__ import annotations

import argparse
import time
from collections.abc import Iterator

import pytest
from redis._parsers.base import BaseParser

from sluice.broker import create_broker
from sluice.broker.base import BrokerSettings, BrokerUnavailable
from sluice.broker.redis import RedisBroker
from sluice.broker.redis_pipe import unavailable
from sluice.broker.redis_shards import SHARDS, shard_of_job, shard_of_model, tag_job_id
from sluice.broker.redis_topology import (
    DEFAULT_WAIT_TIMEOUT_MS,
    Durability,
    Kind,
    Topology,
    durability_for,
    parse_broker_url,
)
from sluice.config import ConfigError, Settings
from sluice.core.job import JobState, new_job_id
from sluice.roles.flags import REDIS_SCHEMES, shared_settings
from sluice.roles.gateway import configure_parser
from tests.broker.brokers import make_settings
from tests.helpers import FakeClock, make_job
from tests.redis_server import RedisServer, wait_replicas

# --- URLs ------------------------------------------------------------------------------------------


def test_one_redis_urls_are_left_to_the_client() -> None:
    for url in ("redis://h:6380/2", "rediss://:pw@h", "unix:///run/redis.sock?db=1"):
        topology = parse_broker_url(url)
        assert topology == Topology(Kind.SINGLE, url) and not topology.replicated


def test_sentinel_url() -> None:
    t = parse_broker_url("redis+sentinel://:s3cret@10.0.0.1:26380,10.0.0.2,[::1]:26381/queue-master/3")
    assert t.kind is Kind.SENTINEL and t.replicated
    assert t.nodes == (("10.0.0.1", 26380), ("10.0.0.2", 26379), ("::1", 26381))
    assert (t.service, t.db, t.username, t.password) == ("queue-master", 3, None, "s3cret")
    assert "s3cret" not in t.describe()


def test_sentinel_url_options() -> None:
    t = parse_broker_url(
        "redis+sentinel://s1:1,s2:2/m?db=5&username=app&password=p%40ss&sentinel_password=sp&sentinel_username=su"
    )
    assert (t.db, t.username, t.password, t.sentinel_username, t.sentinel_password) == (
        5,
        "app",
        "p@ss",
        "su",
        "sp",
    )


def test_cluster_url() -> None:
    t = parse_broker_url("redis+cluster://user:pw@n1:7000,n2:7001,n3")
    assert t.kind is Kind.CLUSTER and t.nodes == (("n1", 7000), ("n2", 7001), ("n3", 6379))
    assert (t.username, t.password, t.db) == ("user", "pw", 0)
    assert parse_broker_url("redis+cluster://n1:7000/0").kind is Kind.CLUSTER
    # A cluster spreads a queue's models over its masters unless told not to; nothing else does.
    assert t.spread and not parse_broker_url("redis+cluster://n1:7000?spread=none").spread
    assert parse_broker_url("redis+cluster://n1:7000?spread=models").spread
    assert not parse_broker_url("redis://h:6379").spread
    assert not parse_broker_url("redis+sentinel://s1:26379/m").spread


@pytest.mark.parametrize(
    ("url", "says"),
    [
        ("redis+sentinel://s1:26379", "names the master"),
        ("redis+sentinel://s1:26379/", "names the master"),
        ("redis+sentinel://s1:26379/m?timeout=3", "unknown option"),
        ("redis+sentinel://s1:26379/m/x", "must be a number"),
        ("redis+sentinel:///m", "no host:port"),
        ("redis+sentinel://s1:port/m", "bad port"),
        ("redis+sentinel://s1:99999/m", "bad port"),
        ("redis+cluster://n1:7000/2", "only database 0"),
        ("redis+cluster://n1:7000?db=1", "unknown option"),
        ("redis+cluster://n1:7000?spread=tenants", "spread= takes models or none"),
        ("rediss+sentinel://s1/m", "not supported"),
        ("redis+shard://n1", "unknown Redis URL scheme"),
    ],
)
def test_bad_urls_say_what_is_wrong(url: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        parse_broker_url(url)


def test_every_role_takes_every_scheme() -> None:
    assert set(REDIS_SCHEMES) >= {"redis://", "rediss://", "unix://", "redis+sentinel://", "redis+cluster://"}
    parser = argparse.ArgumentParser()
    configure_parser(parser)
    for url in ("redis+sentinel://127.0.0.1:26379/m", "redis+cluster://127.0.0.1:7000"):
        assert shared_settings(parser.parse_args(["--broker", url]), "gateway").broker == url
    with pytest.raises(ConfigError):
        shared_settings(parser.parse_args(["--broker", "memory"]), "gateway")


# --- durability ------------------------------------------------------------------------------------


def test_durability_defaults_to_one_replica_where_one_takes_over() -> None:
    single = parse_broker_url("redis://h")
    sentinel = parse_broker_url("redis+sentinel://s:1/m")
    cluster = parse_broker_url("redis+cluster://n:1")
    assert durability_for(single, None, 1000) == Durability(0, 1000)
    assert durability_for(sentinel, None, 1000) == Durability(1, 1000)
    assert durability_for(cluster, None, 250) == Durability(1, 250)
    assert durability_for(sentinel, 0, 1000).on is False
    assert durability_for(single, 2, 1000) == Durability(2, 1000)
    with pytest.raises(ValueError):
        Durability(1, 0)  # WAIT 0 waits for ever
    with pytest.raises(ValueError):
        Durability(-1, 10)


def test_settings_feed_the_broker() -> None:
    settings = Settings(broker="redis+sentinel://127.0.0.1:26379/m", redis_wait_timeout_ms=300)
    assert settings.redis_min_replicas is None and Settings().redis_wait_timeout_ms == DEFAULT_WAIT_TIMEOUT_MS
    broker = create_broker(
        settings.broker, BrokerSettings(), min_replicas=settings.redis_min_replicas, wait_timeout_ms=300
    )
    assert isinstance(broker, RedisBroker) and broker.durability == Durability(1, 300)
    cluster = create_broker("redis+cluster://127.0.0.1:7000", BrokerSettings(), min_replicas=0)
    assert isinstance(cluster, RedisBroker) and not cluster.durability.on
    with pytest.raises(ValueError, match="redis\\+sentinel"):
        create_broker("postgres://db", BrokerSettings())


def test_outage_errors_are_unavailable_however_redis_py_parses_them() -> None:
    for reply in (
        "OOM command not allowed when used memory > 'maxmemory'.",
        "CLUSTERDOWN The cluster is down",
        "MASTERDOWN Link with MASTER is down and replica-serve-stale-data is set to 'no'.",
        "NOREPLICAS Not enough good replicas to write.",
        "LOADING Redis is loading the dataset in memory",
        "TRYAGAIN Multiple keys request during rehashing of slot",
    ):
        assert unavailable(BaseParser.parse_error(reply)), reply
    assert not unavailable(BaseParser.parse_error("ERR Error running script: bug"))
    assert not unavailable(BaseParser.parse_error("WRONGTYPE Operation against a key"))


# --- WAIT on a real primary --------------------------------------------------------------------------


@pytest.fixture(scope="module")
def primary_and_replica() -> Iterator[tuple[RedisServer, RedisServer]]:
    with RedisServer() as primary:
        replica = RedisServer(extra={"replicaof": f"127.0.0.1 {primary.port}"})
        with replica:
            wait_replicas(primary, 1)
            yield primary, replica


async def test_a_durable_write_waits_for_its_replica(
    primary_and_replica: tuple[RedisServer, RedisServer],
) -> None:
    primary, replica = primary_and_replica
    clock = FakeClock()
    async with RedisBroker(primary.url, make_settings(clock), min_replicas=1) as broker:
        job = make_job(clock)
        await broker.admit(job)  # answered: the replica has it
        with replica.client() as c:
            assert c.exists(broker.keys.job(job.id)) == 1


async def test_too_few_replicas_is_a_fast_refusal(redis_url: str) -> None:
    """One Redis with no replica asked for one: every durable write comes back BrokerUnavailable
    after the WAIT timeout, never later, while reads and other writes go on."""
    clock = FakeClock()
    async with RedisBroker(redis_url, make_settings(clock), min_replicas=1, wait_timeout_ms=100) as broker:
        job = make_job(clock)
        started = time.monotonic()
        with pytest.raises(BrokerUnavailable, match="0 of the 1 replica"):
            await broker.admit(job)
        assert time.monotonic() - started < 2.0
        # The primary has it (the 503 says "not known to be safe", not "not done"): a retry with the
        # same idempotency key would find it.
        assert (await broker.get(job.id)) is not None
        assert await broker.position(job.id) == 0
        with pytest.raises(BrokerUnavailable):
            await broker.cancel(job.id)
        cancelled = await broker.get(job.id)
        assert cancelled is not None and cancelled.state is JobState.CANCELLED


def test_a_job_id_names_its_shard() -> None:
    """A spread queue's job ids carry their shard, so a lookup by id needs nothing else; ids that
    name none (one Redis, a made-up id) are looked for in the home shard."""
    for shard in (0, 7, 0x2A, SHARDS - 1):
        job_id = tag_job_id(new_job_id(), shard)
        assert job_id.startswith("job_") and shard_of_job(job_id) == shard
        assert shard_of_job(tag_job_id(job_id, shard)) == shard
    assert shard_of_job(new_job_id()) is None  # base64url has no "."
    for made_up in ("job_zz.x", "job_+f.x", "job_ f.x", "job_", "x", "job_2a"):
        assert shard_of_job(made_up) is None
    assert {shard_of_model(f"m{i}") for i in range(2000)} == set(range(SHARDS))
