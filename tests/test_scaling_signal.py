"""The scaling signal's edge on real brokers: the embedded one, and two gateways on one redis-server."""

from __future__ import annotations

import math
from collections.abc import AsyncIterator, Iterator

import pytest

from sluice.broker.base import Broker, BrokerSettings, ModelStats
from sluice.broker.memory import MemoryBroker
from sluice.broker.redis import RedisBroker
from sluice.core.job import JobState
from sluice.core.scaling import ScalingPolicy
from sluice.dashboard_feed import DashboardFeed
from sluice.metrics import Metrics
from sluice.scaling_signal import READING_MAX_AGE_S, ScalingSignal, engines_by_model
from tests.broker.brokers import empty_redis
from tests.helpers import FakeClock, make_job
from tests.redis_server import RedisServer

#: a job's cost: 10 prompt tokens + 190 max_tokens
COST = 200


def worker_report(
    clock: FakeClock, engines: list[tuple[str, int]], model: str = "m", pools: list[str | None] | None = None
) -> dict[str, object]:
    """A worker's report as sluice.reports publishes it (its engines' rows)."""
    rows = [
        {
            "name": name,
            "models": [model],
            "pool": pool,
            "limit": limit,
            "inflight": 0,
            "draining": False,
            "cooldown_s": 0.0,
        }
        for (name, limit), pool in zip(engines, pools or [None] * len(engines), strict=True)
    ]
    return {
        "role": "worker",
        "host": "h",
        "pid": 1,
        "started_at": clock(),
        "at": clock(),
        "engines": rows,
        "samples": [],
    }


async def learn_rate(broker: Broker, clock: FakeClock, jobs: int = 3) -> None:
    """Run ``jobs`` jobs of COST tokens, 2 s each: a slot drains 100 tokens/s."""
    for _ in range(jobs):
        await broker.admit(make_job(clock, prompt_tokens=10, max_tokens=190))
        job = await broker.claim("w1", ["m"], timeout=1.0)
        assert job is not None
        clock.advance(2.0)
        assert await broker.finish(job.id, "w1", JobState.SUCCEEDED, result={}, usage={}) is not None


def gauge(metrics: Metrics, name: str, **labels: str) -> float | None:
    return metrics.registry.get_sample_value(name, labels)


@pytest.fixture
async def memory() -> AsyncIterator[tuple[MemoryBroker, FakeClock]]:
    clock = FakeClock()
    broker = MemoryBroker(BrokerSettings(clock=clock))
    await broker.start()
    try:
        yield broker, clock
    finally:
        await broker.close()


async def test_a_premium_backlog_raises_desired_engines_and_sets_every_gauge(
    memory: tuple[MemoryBroker, FakeClock],
) -> None:
    broker, clock = memory
    await broker.register("w1", {"m": 16})
    await broker.put_report("w1", worker_report(clock, [("e1", 16)]), ttl_s=60)
    await learn_rate(broker, clock)
    metrics = Metrics()
    signal = ScalingSignal(broker, metrics, ScalingPolicy(horizon_s=60))
    first = (await signal.poll())["m"]
    assert first.supply.engines == 1 and first.supply.slot_rate == pytest.approx(100, rel=0.01)
    assert first.desired_engines == 0  # nothing queued, running or arriving
    # 100 high jobs: 20 000 tokens over 1600 tokens/s = 12.5 s, past high's 10 s objective
    for _ in range(100):
        await broker.admit(make_job(clock, priority="high", prompt_tokens=10, max_tokens=190))
    clock.advance(5)
    s = (await signal.poll())["m"]
    assert s.assessment.at_risk["high"]
    assert s.assessment.predicted_wait_s["high"] == pytest.approx(12.5, rel=0.01)
    assert s.desired_engines >= 2
    assert gauge(metrics, "sluice_desired_engines", model="m") == s.desired_engines
    assert gauge(metrics, "sluice_deadlines_at_risk", model="m", **{"class": "high"}) == 1
    assert gauge(metrics, "sluice_deadlines_at_risk", model="m", **{"class": "normal"}) == 0
    assert gauge(metrics, "sluice_queued_jobs", model="m") == 100
    assert gauge(metrics, "sluice_queued_tokens", model="m") == 100 * COST
    assert gauge(metrics, "sluice_oldest_queued_age_seconds", model="m") == pytest.approx(5)
    assert gauge(metrics, "sluice_predicted_wait_seconds", model="m", **{"class": "high"}) == pytest.approx(
        12.5, rel=0.01
    )
    assert gauge(metrics, "sluice_arrival_tokens_per_second", model="m") == s.demand.arrival_tokens_per_s > 0
    assert gauge(metrics, "sluice_engine_capacity_tokens_per_second", model="m") == pytest.approx(
        1600, rel=0.01
    )
    assert gauge(
        metrics, "sluice_engine_capacity_per_engine_tokens_per_second", model="m", engine="e1"
    ) == pytest.approx(1600, rel=0.01)
    assert gauge(metrics, "sluice_engines", model="m") == 1


async def test_a_best_effort_backlog_alone_asks_only_for_the_busy_floor(
    memory: tuple[MemoryBroker, FakeClock],
) -> None:
    broker, clock = memory
    await broker.register("w1", {"m": 16})
    await broker.put_report("w1", worker_report(clock, [("e1", 16)]), ttl_s=60)
    await learn_rate(broker, clock)
    signal = ScalingSignal(broker, Metrics())
    await signal.poll()
    for _ in range(500):  # 100 000 tokens: a minute of the engine's work, all batch
        await broker.admit(make_job(clock, priority="low", prompt_tokens=10, max_tokens=190))
    clock.advance(5)
    s = (await signal.poll())["m"]
    assert s.assessment.predicted_wait_s["low"] > 60
    assert not any(s.assessment.at_risk.values())
    assert s.desired_engines == 1


async def test_an_engine_that_goes_leaves_the_per_engine_gauge(
    memory: tuple[MemoryBroker, FakeClock],
) -> None:
    broker, clock = memory
    per_engine = "sluice_engine_capacity_per_engine_tokens_per_second"
    await broker.register("w1", {"m": 32})
    await broker.put_report("w1", worker_report(clock, [("e1", 16), ("e2", 16)]), ttl_s=60)
    metrics = Metrics()
    signal = ScalingSignal(broker, metrics)
    assert (await signal.poll())["m"].supply.engines == 2
    assert gauge(metrics, per_engine, model="m", engine="e2") is not None
    await broker.register("w1", {"m": 16})
    await broker.put_report("w1", worker_report(clock, [("e1", 16)]), ttl_s=60)
    assert (await signal.poll())["m"].supply.engines == 1
    assert gauge(metrics, per_engine, model="m", engine="e2") is None


def test_engines_by_model_skips_draining_ejected_and_leaving_engines() -> None:
    clock = FakeClock()
    report = worker_report(clock, [("a", 8), ("b", 8), ("c", 8), ("d", 8)])
    rows = report["engines"]
    assert isinstance(rows, list)
    rows[1]["draining"] = True
    rows[2]["cooldown_s"] = 3.0
    rows[3]["leaving"] = True
    gateway = {"role": "gateway", "samples": []}
    views = engines_by_model({"w": report, "g": gateway})
    assert [v.name for v in views["m"]] == ["a"]


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


async def test_two_gateways_on_one_redis_agree(redis_server: RedisServer) -> None:
    """Each gateway has its own broker connection and its own signal; both read the shared queue."""
    url = await empty_redis(redis_server)
    clock = FakeClock()
    one, two = RedisBroker(url, BrokerSettings(clock=clock)), RedisBroker(url, BrokerSettings(clock=clock))
    await one.start()
    await two.start()
    try:
        await one.register("w1", {"m": 16})
        await one.put_report("w1", worker_report(clock, [("e1", 16)]), ttl_s=60)
        await learn_rate(one, clock)
        signals = [ScalingSignal(one, Metrics()), ScalingSignal(two, Metrics())]
        for signal in signals:
            await signal.poll()
        for i in range(60):  # admitted through both gateways
            await (one if i % 2 else two).admit(
                make_job(clock, priority="high" if i % 3 else "low", prompt_tokens=10, max_tokens=190)
            )
        clock.advance(5)
        a, b = [(await signal.poll())["m"] for signal in signals]
        assert a.demand == b.demand and a.supply == b.supply
        assert a.assessment == b.assessment and a.desired_engines == b.desired_engines
        assert a.demand.queued_jobs == 60
        assert a.demand.classes["high"].jobs == 40
        assert a.desired_engines >= 1
        for signal, s in zip(signals, (a, b), strict=True):
            assert gauge(signal.metrics, "sluice_desired_engines", model="m") == s.desired_engines
    finally:
        await one.close()
        await two.close()


async def test_beside_a_running_gateway_the_signal_sees_its_engine_and_learns_its_rate(sim_url: str) -> None:
    """A gateway with its worker on a real simulator (``sluice serve``): the worker's own report
    gives the engine, the jobs that finished give the slot rate, and start()/stop() run the loop."""
    import httpx

    from tests.helpers import wait_until
    from tests.servers import run_gateway

    async with run_gateway([sim_url]) as gw, httpx.AsyncClient(timeout=30) as http:
        for _ in range(3):
            r = await http.post(
                f"{gw.url}/v1/chat/completions",
                json={"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 16},
            )
            assert r.status_code == 200, r.text
        metrics = Metrics()
        signal = ScalingSignal(gw.broker, metrics, every_s=0.05)
        await signal.start()
        try:
            await wait_until(lambda: gauge(metrics, "sluice_engines", model="sim") == 1)
        finally:
            await signal.stop()
        s = signal.signals["sim"]
        slots = (await gw.broker.served_models())["sim"]
        assert s.supply.slots == slots > 0
        assert s.supply.slot_rate > 0
        assert [v.slots for v in s.engines] == [slots]
        assert s.desired_engines == 0  # nothing queued, running or arriving any more
        assert gauge(metrics, "sluice_engine_capacity_tokens_per_second", model="sim") == pytest.approx(
            slots * s.supply.slot_rate
        )


async def test_a_models_engines_are_split_over_its_pools(memory: tuple[MemoryBroker, FakeClock]) -> None:
    broker, clock = memory
    await broker.register("w1", {"m": 48})
    engines = [("h1", 16), ("h2", 16), ("a1", 16)]
    await broker.put_report("w1", worker_report(clock, engines, pools=["h100", "h100", "a10"]), ttl_s=60)
    await learn_rate(broker, clock)
    metrics = Metrics()
    signal = ScalingSignal(broker, metrics)
    await signal.poll()
    for _ in range(300):  # 60 000 tokens of high work: 12.5 s at 4800 tokens/s
        await broker.admit(make_job(clock, priority="high", prompt_tokens=10, max_tokens=190))
    clock.advance(5)
    desired = (await signal.poll())["m"].desired_engines
    assert desired > 3
    assert signal.pools == {"h100": math.ceil(desired * 2 / 3 - 1e-9), "a10": math.ceil(desired / 3 - 1e-9)}
    for pool, engines_needed in signal.pools.items():
        assert gauge(metrics, "sluice_pool_desired_engines", pool=pool) == engines_needed


class CountingBroker(MemoryBroker):
    """The embedded broker, counting how often its queue stats are read."""

    stats_reads = 0

    async def stats(self) -> dict[str, ModelStats]:
        self.stats_reads += 1
        return await super().stats()


async def test_the_signal_reads_what_the_dashboard_feed_read_and_the_broker_once() -> None:
    clock = FakeClock()
    broker = CountingBroker(BrokerSettings(clock=clock))
    await broker.start()
    try:
        await broker.register("w1", {"m": 16})
        await broker.put_report("w1", worker_report(clock, [("e1", 16)]), ttl_s=60)
        await learn_rate(broker, clock)
        signal = ScalingSignal(broker, Metrics())
        feed = DashboardFeed(broker, Metrics(), scaling=signal)
        assert feed.sampler is signal.sampler
        await feed.tick()
        assert broker.stats_reads == 1
        for _ in range(10):  # queued after the feed's reading: not in it
            await broker.admit(make_job(clock, priority="high", prompt_tokens=10, max_tokens=190))
        s = (await signal.update())["m"]
        assert broker.stats_reads == 1, "the signal read the broker beside the feed's reading"
        assert s.demand.queued_jobs == 0 and s.supply.engines == 1
        # The feed's next snapshot shows what the signal found in the feed's own reading.
        snap = await feed.tick()
        assert broker.stats_reads == 2, "each of the feed's ticks reads the broker afresh"
        assert snap["models"][0]["desired_engines"] == s.desired_engines
        # Without a recent enough reading (no feed ticking), the signal reads for itself.
        clock.advance(READING_MAX_AGE_S + 1)
        s = (await signal.update())["m"]
        assert broker.stats_reads == 3 and s.demand.queued_jobs == 10
        # poll() always reads afresh, whatever the latest reading.
        await signal.poll()
        assert broker.stats_reads == 4
    finally:
        await broker.close()
