"""The Redis broker's bookkeeping of per-key buckets and concurrency caps (lua/_tenant.lua): the
tenant hash and the blocked and capped sets follow the tenant's jobs, as the memory broker's
_Tenant does. What both brokers decide is in test_conformance.py."""

from __future__ import annotations

import copy
import random
from collections.abc import AsyncIterator
from importlib import resources

import pytest
from redis.asyncio import Redis

from sluice.broker.base import Admission
from sluice.broker.memory import MemoryBroker
from sluice.broker.redis import RedisBroker
from sluice.broker.redis_keys import QueueKeys
from sluice.core.admission import Refused
from sluice.core.job import JobState
from sluice.core.ratelimit import TenantLimits
from tests.broker.brokers import make_settings
from tests.helpers import FakeClock, make_job

W = "w"


@pytest.fixture
async def broker(redis_url: str) -> AsyncIterator[RedisBroker]:
    async with RedisBroker(redis_url, make_settings(FakeClock())) as b:
        yield b


async def test_lua_capped_key_matches_redis_keys(redis_url: str) -> None:
    keys = QueueKeys("q:1")
    lib = (resources.files("sluice") / "lua" / "_keys.lua").read_text(encoding="utf-8")
    async with Redis.from_url(redis_url, decode_responses=True) as r:
        assert await r.eval(lib + "return capped_key(ARGV[1])", 0, keys.prefix) == keys.capped


async def _sets(broker: RedisBroker) -> tuple[set[str], set[str]]:
    r = broker._redis
    return set(await r.smembers(broker.keys.blocked)), set(await r.smembers(broker.keys.capped))


async def test_the_capped_set_follows_the_tenants_jobs(broker: RedisBroker) -> None:
    """A tenant is in the capped set exactly while it has more jobs queued and running than its cap
    (then some of them wait for it), and forgotten with its hash once it has no jobs."""
    clock = broker.settings.clock
    one = TenantLimits("c", max_concurrent=1)
    jobs = [make_job(clock, tenant="c") for _ in range(2)]
    await broker.admit(jobs[0], one)
    assert await _sets(broker) == (set(), set())  # one job, room for one
    await broker.admit(jobs[1], one)
    assert await _sets(broker) == (set(), {"c"})
    assert (await broker.claim(W, ["m"], timeout=1.0)).id == jobs[0].id  # type: ignore[union-attr]
    assert await _sets(broker) == ({"c"}, {"c"})  # at its cap, one job waiting for it
    await broker.finish(jobs[0].id, W, JobState.SUCCEEDED, result={})
    assert await _sets(broker) == (set(), set())
    await broker.claim(W, ["m"], timeout=1.0)
    await broker.finish(jobs[1].id, W, JobState.SUCCEEDED, result={})
    assert await _sets(broker) == (set(), set())
    assert not await broker._redis.exists(broker.keys.tenant("c"))
    # A cap that goes away takes the tenant out of both sets.
    for _ in range(3):
        await broker.admit(make_job(clock, tenant="c"), one)
    assert await _sets(broker) == (set(), {"c"})
    await broker.admit(make_job(clock, tenant="c"), TenantLimits("c"))
    assert await _sets(broker) == (set(), set())


async def test_each_key_has_its_own_fields_in_the_tenant_hash(broker: RedisBroker) -> None:
    """The buckets of every key of a tenant live side by side; fields of the layout before per-key
    buckets are dropped; a tenant with no jobs keeps its hash while a key has buckets."""
    clock = broker.settings.clock
    tenant = broker.keys.tenant("t")
    await broker._redis.hset(tenant, mapping={"rpm": "5", "rl": "0", "rs": "1"})  # the older layout
    a, b = TenantLimits("t", rpm=10, key="a:1"), TenantLimits("t", tpm=100, key="b")
    job = make_job(clock)
    await broker.admit(job, a)
    await broker.admit(make_job(clock), b)
    fields = await broker._redis.hgetall(tenant)
    assert set(fields) == {"q", "r", "rl:a%3A1", "rs:a%3A1", "tl:b", "ts:b", "tpm:b"}
    assert (fields["rl:a%3A1"], fields["tl:b"], fields["tpm:b"]) == ("9", str(100 - job.cost), "100")
    assert await broker._redis.hget(broker.keys.job(job.id), "kb") == "a:1"
    # Key a loses its limit: its bucket goes, b's stays; the hash stays for b's bucket.
    await broker.admit(make_job(clock), TenantLimits("t", key="a:1"))
    assert set(await broker._redis.hgetall(tenant)) == {"q", "r", "tl:b", "ts:b", "tpm:b"}
    for _ in range(3):
        claimed = await broker.claim(W, ["m"], timeout=1.0)
        assert claimed is not None
        await broker.finish(claimed.id, W, JobState.SUCCEEDED, result={})
    assert await broker._redis.hget(tenant, "q") == "0" and await broker._redis.hexists(tenant, "tl:b")


# --- the same decisions as the memory broker, for keys and caps ------------------------------------

#: Tenants and the keys they send with: two keys of one tenant with different limits, caps of one
#: to three jobs (one tenant's keys disagree on it), and a tenant with neither.
KEYS: dict[str, list[TenantLimits | None]] = {
    "a": [
        TenantLimits("a", rpm=30, key="a1", max_concurrent=1),
        TenantLimits("a", tpm=2000, key="a2", max_concurrent=1),
    ],
    "b": [
        TenantLimits("b", max_concurrent=2, max_queued=8),
        TenantLimits("b", max_concurrent=3, rpm=20, key="b2"),
    ],
    "c": [TenantLimits("c", max_concurrent=1, tpm=3000, key="c1")],
    "d": [None, TenantLimits("d")],
}


def _outcome(result: Admission | Refused) -> tuple[object, ...]:
    if isinstance(result, Refused):
        headers = result.rate.headers() if result.rate else None
        return (result.status, result.code, result.message, result.retry_after_s, headers)
    return (result.position, result.estimated_start_s, result.rate.headers() if result.rate else None)


@pytest.mark.parametrize("seed", range(4))
async def test_keys_and_caps_decide_the_same_on_both_brokers(redis_url: str, seed: int) -> None:
    """Random admits with each tenant's keys in random order, claims, finishes with usage and
    cancels, on a measured drain: both brokers give the same answers (positions, predicted starts,
    refusals with their rate headers), so the held-back counts of admit.lua and the memory
    broker's _view agree, and so do the per-key buckets."""
    rng = random.Random(seed)
    clock = FakeClock()
    memory = MemoryBroker(make_settings(clock))
    async with RedisBroker(redis_url, make_settings(clock)) as redis:
        brokers = (memory, redis)
        for b in brokers:
            await b.register(W, {"m": 4})
        warm = make_job(clock, tenant="warm", prompt_tokens=50, max_tokens=50)
        for b in brokers:
            await b.admit(copy.deepcopy(warm))
            await b.claim(W, ["m"], timeout=1.0)
        clock.advance(1.0)
        for b in brokers:
            await b.finish(warm.id, W, JobState.SUCCEEDED, result={})
        queued: list[str] = []
        running: list[str] = []
        for step in range(250):
            op = rng.random()
            if op < 0.55:
                tenant = rng.choice(list(KEYS))
                job = make_job(
                    clock,
                    tenant=tenant,
                    priority=rng.choice(["high", "normal", "normal", "low"]),
                    prompt_tokens=rng.choice([10, 50]),
                    max_tokens=rng.choice([20, 200, 900]),
                    timeout=rng.choice([600, 30, 8]),
                )
                limits = rng.choice(KEYS[tenant])
                outcomes = []
                for b in brokers:
                    try:
                        outcomes.append(_outcome(await b.admit(copy.deepcopy(job), limits)))
                    except Refused as exc:
                        outcomes.append(_outcome(exc))
                assert outcomes[0] == outcomes[1], f"step {step}"
                if len(outcomes[0]) == 3:
                    queued.append(job.id)
            elif op < 0.8:
                got = [await b.claim(W, ["m"], timeout=0.01) for b in brokers]
                ids = [j.id if j else None for j in got]
                assert ids[0] == ids[1], f"step {step}"
                if ids[0] is not None:
                    running.append(ids[0])
            elif op < 0.85 and queued:
                victim = rng.choice(queued)
                for b in brokers:
                    await b.cancel(victim)
            elif running:
                done = running.pop(rng.randrange(len(running)))
                usage = {"total_tokens": rng.randrange(0, 1200)}
                clock.advance(rng.choice([0.1, 0.5, 2.0]))
                for b in brokers:
                    await b.finish(done, W, JobState.SUCCEEDED, result={}, usage=usage)
            clock.advance(rng.choice([0.0, 0.05, 0.3]))
            queued = [j for j in queued if (job_ := await memory.get(j)) and job_.state is JobState.QUEUED]
            for b in brokers:
                await b.maintain()
