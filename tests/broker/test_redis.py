"""The Redis broker beyond the conformance suite (test_conformance.py): what only a real Redis can
show (one cluster slot per queue, durability across a crash with AOF, fast errors while Redis is
down, reconnection, and the same dispatch order as the memory broker)."""

from __future__ import annotations

import asyncio
import copy
import random
import re
import time
from collections.abc import AsyncIterator, Iterator, Sequence
from importlib import resources
from typing import Any

import pytest
from redis.asyncio import BlockingConnectionPool, Redis
from redis.exceptions import ResponseError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluice.broker.base import Broker, BrokerUnavailable, EventType
from sluice.broker.memory import MemoryBroker
from sluice.broker.redis import RedisBroker, Script
from sluice.broker.redis_codec import capacity_drain
from sluice.broker.redis_keys import (
    SKIPLIST_MEMBER,
    QueueKeys,
    head_field,
    queued_jobs_field,
    queued_tokens_field,
)
from sluice.broker.redis_pipe import Batcher
from sluice.broker.redis_shards import shard_of_model, shard_queue
from sluice.core.admission import Refused
from sluice.core.capacity import MAX_FILL_SLOWDOWN
from sluice.core.job import JobState
from sluice.core.ratelimit import TenantLimits
from sluice.views import job_view
from tests.broker.brokers import make_settings
from tests.helpers import FakeClock, make_job, wait_until
from tests.redis_server import RedisServer


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


async def wait_blocked(redis_url: str, n: int) -> None:
    """Until at least ``n`` clients of the server are in a blocking command (a claim or a webhook
    waiter asleep on its marker), instead of sleeping and hoping they got there."""
    probe = Redis.from_url(redis_url)
    try:

        async def blocked() -> bool:
            return int((await probe.info("clients"))["blocked_clients"]) >= n

        await wait_until(blocked)
    finally:
        await probe.aclose()


@pytest.fixture
async def broker(clock: FakeClock, redis_url: str) -> AsyncIterator[RedisBroker]:
    async with RedisBroker(redis_url, make_settings(clock)) as b:
        yield b


# --- one slot per queue ---------------------------------------------------------------------------


def _crc16(data: bytes) -> int:
    """CRC16-CCITT (XModem), the checksum Redis Cluster maps keys to slots with."""
    crc = 0
    for byte in data:
        crc ^= byte << 8
        for _ in range(8):
            crc = ((crc << 1) ^ 0x1021) if crc & 0x8000 else crc << 1
            crc &= 0xFFFF
    return crc


def key_slot(key: str) -> int:
    raw = key.encode()
    start = raw.find(b"{")
    if start >= 0:
        end = raw.find(b"}", start + 1)
        if end > start + 1:
            raw = raw[start + 1 : end]
    return _crc16(raw) % 16384


def test_key_slot_matches_redis_cluster_spec() -> None:
    assert _crc16(b"123456789") == 0x31C3
    assert key_slot("foo") == 12182
    assert key_slot("{user1000}.following") == key_slot("{user1000}.followers")
    assert key_slot("foo{}{bar}") == key_slot("foo{}{bar}")  # empty tag: the whole key counts


class _Monitor:
    """Every command the server runs, scripts' inner calls included (MONITOR), with its arguments."""

    _arg = re.compile(r'"((?:[^"\\]|\\.)*)"')

    def __init__(self, port: int) -> None:
        self.port = port
        self.lines: list[str] = []
        self._task: asyncio.Task[None] | None = None
        self._writer: asyncio.StreamWriter | None = None

    async def __aenter__(self) -> _Monitor:
        # A line can be long: FUNCTION LOAD carries the whole library (about 90 KB).
        reader, self._writer = await asyncio.open_connection("127.0.0.1", self.port, limit=1 << 22)
        self._writer.write(b"MONITOR\r\n")
        assert (await reader.readline()).startswith(b"+OK")
        self._task = asyncio.create_task(self._read(reader))
        return self

    @classmethod
    def args(cls, line: str) -> list[str]:
        """The command and arguments of one MONITOR line."""
        return [bytes(a, "utf-8").decode("unicode_escape") for a in cls._arg.findall(line)]

    async def _read(self, reader: asyncio.StreamReader) -> None:
        while line := await reader.readline():
            self.lines.append(line.decode("utf-8"))

    async def __aexit__(self, *exc: object) -> None:
        assert self._task is not None and self._writer is not None
        self._writer.close()
        await asyncio.gather(self._task, return_exceptions=True)


async def _exercise(broker: RedisBroker, clock: FakeClock) -> None:
    """Every script and every reader of the broker, with names that need escaping."""
    model, tenant = "org/llama:8b", "acme:eu{1}%"
    await broker.register("w:1", {model: 2, "x": 1})
    first = make_job(clock, model=model, tenant=tenant, idempotency_key="k:1", max_attempts=1)
    await broker.admit(first, TenantLimits(tenant, rpm=100, tpm=10_000, max_queued=10, max_concurrent=3))
    assert (await broker.admit(make_job(clock, model=model, tenant=tenant, idempotency_key="k:1"))).duplicate
    others = [
        make_job(clock, model=model, tenant=t, priority=p) for t in ("a", "b:c") for p in ("low", "high")
    ]
    for job in others:
        await broker.admit(job)
    await broker.admit(make_job(clock, model="x", timeout=1))
    assert await broker.position(others[0].id) is not None
    reader = asyncio.create_task(broker.wait(first.id, timeout=5))
    follower = asyncio.create_task(_collect(broker, others[1].id))
    await broker.stats()
    clock.advance(2)  # the job of model x is past its deadline: claim expires it on the way
    claimed = [await broker.claim("w:1", [model, "x"], timeout=1) for _ in range(4)]
    assert [j.id if j else None for j in claimed] == [others[1].id, others[3].id, first.id, others[0].id]
    await broker.heartbeat("w:1", [j.id for j in claimed if j is not None])
    for job in claimed:
        assert job is not None
        await broker.publish(job.id, EventType.TOKEN, {"i": 1})
    aborted = asyncio.create_task(broker.wait_abort_signal(5))
    await asyncio.sleep(0.05)
    running = [j for j in claimed if j is not None and j.id != first.id]
    await broker.cancel(running[0].id)
    await aborted
    await broker.finish(running[1].id, "w:1", JobState.SUCCEEDED, result={"ok": 1}, usage={"total_tokens": 3})
    hooked = make_job(clock, model=model, tenant=tenant)
    hooked.callback_url = "https://example.com/hook"
    await broker.admit(hooked)
    await broker.cancel(hooked.id)
    assert await broker.ended_callbacks("w:1", timeout=1) == [hooked.id]
    await broker.add_delivery(hooked.id, {"attempt": 1, "status": 200})
    await broker.ack_callback(hooked.id)
    await broker.set_draining("b:1", True)
    assert await broker.draining() == {"b:1"}
    await broker.cancel(others[2].id)  # still queued
    clock.advance(10)  # leases lost: one job goes back to its queue, the first one dies (max_attempts 1)
    await broker.maintain()
    assert first.id in await broker.dead_letters()
    assert await broker.purge_dead_letters([first.id]) == 1
    await reader
    await follower
    clock.advance(4000)  # deadlines and result TTLs pass
    await broker.maintain()
    await broker.unregister("w:1")
    await broker.served_models()


async def _monitored(
    redis_url: str, port: int, spread: bool
) -> tuple[list[tuple[str, list[str]]], list[str]]:
    """Run :func:`_exercise` and say what each script declared (name, KEYS) and which raw lines the
    server ran (MONITOR)."""
    clock = FakeClock()
    declared: list[tuple[str, list[str]]] = []
    original = Script.command

    def spy(self: Script, keys: Sequence[str], args: Sequence[str | int | float]) -> tuple[Any, ...]:
        declared.append((self.name, list(keys)))
        return original(self, keys, args)

    Script.command = spy  # type: ignore[method-assign]
    try:
        async with (
            _Monitor(port) as monitor,
            RedisBroker(redis_url, make_settings(clock), spread=spread) as b,
        ):
            await _exercise(b, clock)
    finally:
        Script.command = original  # type: ignore[method-assign]
    names = {name for name, _ in declared}
    assert names >= {"admit", "claim", "heartbeat", "publish", "finish", "cancel", "reap", "purge_expired"}
    assert names >= {"position", "workers", "callbacks", "purge_dead"}
    return declared, monitor.lines


_SKIPPED = ("MONITOR", "FLUSHALL", "COMMAND", "CLIENT", "HELLO", "PING", "FUNCTION", "INFO")


async def _slots_per_call(redis_url: str, lines: list[str]) -> list[tuple[str, set[str]]]:
    """The keys of each call the server ran: a command a client sent, or all the commands one script
    ran inside (the ``lua`` lines MONITOR shows after its FCALL, which nothing can interleave).
    Redis itself says which arguments are keys."""
    calls: list[tuple[str, set[str]]] = []
    async with Redis.from_url(redis_url, decode_responses=True) as r:
        for line in lines:
            inside = " lua] " in line
            args = _Monitor.args(line)
            if not args or args[0].upper() in _SKIPPED:
                continue
            try:
                keys = {str(k) for k in await r.command_getkeys(*args)}
            except ResponseError:
                keys = set()  # no key arguments (PUBLISH, SUBSCRIBE, ...)
            if args[0].upper() == "FCALL":
                keys = set()  # the declared KEYS are checked apart; its calls follow
                calls.append(("script", keys))
            elif inside and calls and calls[-1][0] == "script":
                calls[-1][1].update(keys)
            else:
                calls.append((args[0].upper(), keys))
    return calls


async def test_every_key_of_a_queue_is_in_one_slot(redis_url: str, redis_server: RedisServer) -> None:
    declared, lines = await _monitored(redis_url, redis_server.port, spread=False)
    slot = key_slot(QueueKeys().prefix)
    for name, keys in declared:
        assert {key_slot(k) for k in keys} == {slot}, name

    # What the scripts touch without declaring it (tenant lists, job records found by id) and what the
    # client runs directly (XREAD, BZPOPMIN, pipelines).
    touched = {k for _, keys in await _slots_per_call(redis_url, lines) for k in keys}
    assert any(":tq:" in k for k in touched) and any(":job:" in k for k in touched)
    assert {k for k in touched if key_slot(k) != slot} == set()


async def test_a_spread_queue_touches_one_slot_per_call(redis_url: str, redis_server: RedisServer) -> None:
    """Spread as on a cluster (a hash tag per model's shard), on one Redis that MONITOR can watch:
    every script, with what it touches inside, and every command stays in one slot, and a model's
    queue and jobs are in its own shard's slot."""
    declared, lines = await _monitored(redis_url, redis_server.port, spread=True)
    model = "org/llama:8b"
    own = {key_slot(QueueKeys(shard_queue("sluice", shard_of_model(m))).prefix) for m in (model, "x")}
    home = key_slot(QueueKeys().prefix)
    assert len(own | {home}) == 3  # the models are in shards of their own, apart from the home shard
    for name, keys in declared:
        assert len({key_slot(k) for k in keys}) == 1, (name, keys)

    calls = await _slots_per_call(redis_url, lines)
    for what, used in calls:
        assert len({key_slot(k) for k in used}) <= 1, (what, sorted(used))
    touched = {k for _, keys in calls for k in keys}
    model_slot = key_slot(QueueKeys(shard_queue("sluice", shard_of_model(model))).prefix)
    for kind in (":tq:", ":job:", ":out:", ":tenant:", ":qs:", ":idem:", ":sched:", ":marker:"):
        found = {key_slot(k) for k in touched if kind in k}
        assert found and found <= own, kind
    assert any(key_slot(k) == model_slot and ":tq:org/llama%3A8b:" in k for k in touched)
    assert {key_slot(k) for k in touched} == own | {home}


async def test_lua_key_builders_match_keys_py(redis_url: str) -> None:
    keys = QueueKeys("q:1")
    lib = (resources.files("sluice") / "lua" / "_keys.lua").read_text(encoding="utf-8")
    names = ["m", "org/llama:8b", "a%3Ab", "{x}", "ünï"]
    async with Redis.from_url(redis_url, decode_responses=True) as r:
        for model in names:
            for tenant in names:
                got = await r.eval(
                    lib + "local P, t, m, c = ARGV[1], ARGV[2], ARGV[3], ARGV[4]\n"
                    "return {job_key(P, t), out_key(P, t), tq_key(P, m, c, t), sched_key(P, m, c),"
                    " state_key(P, m), marker_key(P, m), tenant_key(P, t), callbacks_key(P),"
                    " callbacks_marker_key(P), models_key(P)}",
                    0,
                    keys.prefix,
                    tenant,
                    model,
                    "normal",
                )
                assert got == [
                    keys.job(tenant),
                    keys.out(tenant),
                    keys.tq(model, "normal", tenant),
                    keys.sched(model, "normal"),
                    keys.state(model),
                    keys.marker(model),
                    keys.tenant(tenant),
                    keys.callbacks,
                    keys.callbacks_marker,
                    keys.models,
                ]


async def test_lua_field_builders_match_redis_keys(redis_url: str) -> None:
    folder = resources.files("sluice") / "lua"
    files = ("_keys.lua", "_state.lua", "_fairqueue.lua")
    lib = "".join((folder / f).read_text(encoding="utf-8") for f in files)
    async with Redis.from_url(redis_url, decode_responses=True) as r:
        for cls in ("normal", "a:b", "50%"):
            got = await r.eval(lib + "return {f_jobs(ARGV[1]), f_tokens(ARGV[1])}", 0, cls)
            assert got == [queued_jobs_field(cls), queued_tokens_field(cls)]
        tq = QueueKeys().tq("m", "a:b", "t")
        assert await r.eval(lib + "return f_head(ARGV[1])", 0, tq) == head_field(tq)


def test_escaped_names_never_collide() -> None:
    keys = QueueKeys()
    assert keys.tq("a:b", "c", "t") != keys.tq("a", "b:c", "t")
    assert keys.idem("a:b", "c") != keys.idem("a", "b:c")
    with pytest.raises(ValueError):
        QueueKeys("bad{name}")


# --- the same decisions as the memory broker ----------------------------------------------------


POLICIES: dict[str, TenantLimits | None] = {
    "a": TenantLimits("a", max_concurrent=2),
    "b": TenantLimits("b", rpm=40, tpm=3000),
    "c": TenantLimits("c", max_queued=6, weight=2.5),
    "d": None,
}


def _outcome(result: Any) -> Any:
    """What a client sees of an admit: the admission or the refusal, rate headers included."""
    if isinstance(result, Refused):
        headers = result.rate.headers() if result.rate else None
        return (
            result.status,
            result.code,
            result.message,
            result.retry_after_s,
            result.should_retry,
            headers,
        )
    return (result.position, result.estimated_start_s, result.rate.headers() if result.rate else None)


@pytest.mark.parametrize("seed", range(8))
async def test_dispatch_order_matches_memory_broker(redis_url: str, seed: int) -> None:
    """A random mix of admits under tenant policies, claims over two models, cancels, finishes with
    usage, lost leases and jobs that run out of time gives the same answers, claims, positions and
    queue sizes on both brokers: the scripts mirror the core (SFQ tags and their ties, front
    re-queues, class credits, concurrency caps, rate buckets, the rank across models)."""
    rng = random.Random(seed)
    clock = FakeClock()
    memory = MemoryBroker(make_settings(clock))
    redis = RedisBroker(redis_url, make_settings(clock))
    brokers: tuple[Broker, Broker] = (memory, redis)
    queued: list[str] = []
    running: list[str] = []
    try:
        for b in brokers:
            await b.register("w", {"m": 2, "x": 1})
        for step in range(300):
            op = rng.random()
            if op < 0.5:
                tenant = rng.choice(["a", "b", "c", "d"])
                job = make_job(
                    clock,
                    model=rng.choice(["m", "m", "x"]),
                    tenant=tenant,
                    priority=rng.choice(["high", "normal", "normal", "low", "low"]),
                    prompt_tokens=rng.choice([10, 10, 50]),
                    max_tokens=rng.choice([0, 20, 20, 300]),
                    timeout=rng.choice([600, 600, 3, 1]),
                )
                job.weight = {"a": 1.0, "b": 1.0, "c": 2.5, "d": 0.3}[tenant]
                outcomes = []
                for b in brokers:
                    try:
                        outcomes.append(_outcome(await b.admit(copy.deepcopy(job), POLICIES[tenant])))
                    except Refused as exc:
                        outcomes.append(_outcome(exc))
                assert outcomes[0] == outcomes[1], f"step {step}"
                if len(outcomes[0]) == 3:
                    queued.append(job.id)
            elif op < 0.8:
                models = rng.choice([["m"], ["m", "x"], ["x", "m"]])
                got = [await b.claim("w", models, timeout=0.01) for b in brokers]
                ids = [j.id if j else None for j in got]
                assert ids[0] == ids[1], f"step {step}"
                if ids[0] is not None:
                    running.append(ids[0])
            elif op < 0.87 and queued:
                victim = rng.choice(queued)
                for b in brokers:
                    await b.cancel(victim)
            elif op < 0.95 and running:
                done = running.pop(rng.randrange(len(running)))
                usage = {"total_tokens": rng.randrange(0, 60)}
                for b in brokers:
                    await b.finish(done, "w", JobState.SUCCEEDED, result={}, usage=usage)
            elif running:
                keep = [j for j in running if rng.random() < 0.7]
                clock.advance(6)
                for b in brokers:
                    await b.heartbeat("w", keep)
                    await b.maintain()
                    await b.register("w", {"m": 2, "x": 1})
                running = keep
            clock.advance(rng.choice([0.0, 0.01, 0.02, 0.5]))
            queued = [
                j for j in queued if (await memory.get(j)) and (await memory.get(j)).state is JobState.QUEUED
            ]  # type: ignore[union-attr]
            if step % 20 == 0 or step > 290:
                for job_id in queued:
                    positions = [await b.position(job_id) for b in brokers]
                    assert positions[0] == positions[1], f"step {step}"
                states = [[(await b.get(j)).state for j in queued + running] for b in brokers]  # type: ignore[union-attr]
                assert states[0] == states[1], f"step {step}"
                stats = [await b.stats() for b in brokers]
                assert {m: (s.queued_jobs, s.queued_tokens, s.running_jobs) for m, s in stats[0].items()} == {
                    m: (s.queued_jobs, s.queued_tokens, s.running_jobs) for m, s in stats[1].items()
                }
    finally:
        await redis.close()


async def test_refusals_match_memory_broker(redis_url: str) -> None:
    clock = FakeClock()
    memory = MemoryBroker(make_settings(clock))
    async with RedisBroker(redis_url, make_settings(clock)) as redis:
        brokers: tuple[Broker, Broker] = (memory, redis)
        for b in brokers:
            await b.register("w", {"m": 2})
        for _ in range(4):  # measure a drain rate: 100 cost units per second per slot
            job = make_job(clock, prompt_tokens=50, max_tokens=50)
            for b in brokers:
                await b.admit(copy.deepcopy(job))
                await b.claim("w", ["m"], timeout=1)
            clock.advance(1.0)
            for b in brokers:
                await b.finish(job.id, "w", JobState.SUCCEEDED, result={})
        for i in range(40):
            job = make_job(clock, model=rng_model(i), prompt_tokens=30 + i, max_tokens=40, timeout=3 + i % 7)
            outcomes: list[Any] = []
            for b in brokers:
                try:
                    adm = await b.admit(copy.deepcopy(job))
                    outcomes.append(("ok", adm.position, adm.estimated_start_s))
                except Refused as exc:
                    outcomes.append((exc.status, exc.code, exc.message, exc.retry_after_s, exc.should_retry))
            assert outcomes[0] == outcomes[1], i


def rng_model(i: int) -> str:
    return "small" if i % 3 == 0 else "m"


# --- Redis taken away ------------------------------------------------------------------------------


@pytest.fixture
def aof_server() -> Iterator[RedisServer]:
    with RedisServer(aof=True) as server:
        yield server


async def test_queued_job_survives_redis_crash_with_aof(aof_server: RedisServer) -> None:
    clock = FakeClock()
    job = make_job(clock, tenant="durable")
    async with RedisBroker(aof_server.url, make_settings(clock)) as b:
        await b.admit(job)
    aof_server.kill()  # SIGKILL: only what appendfsync always already wrote survives
    aof_server.start()
    async with RedisBroker(aof_server.url, make_settings(clock)) as b:
        assert await b.position(job.id) == 0
        claimed = await b.claim("w", ["m"], timeout=1)
        assert claimed is not None and claimed.id == job.id and claimed.tenant == "durable"
        events = [e.type async for e in b.events(job.id, timeout=0.5)]
        assert events == [EventType.QUEUED, EventType.STARTED]


async def test_admit_fails_fast_while_redis_is_down(aof_server: RedisServer) -> None:
    clock = FakeClock()
    async with RedisBroker(aof_server.url, make_settings(clock)) as b:
        await b.admit(make_job(clock))
        aof_server.kill()
        started = time.monotonic()
        async with asyncio.timeout(5):
            with pytest.raises(BrokerUnavailable):
                await b.admit(make_job(clock))
            with pytest.raises(BrokerUnavailable):
                await b.get("job_x")
            with pytest.raises(BrokerUnavailable):
                await b.claim("w", ["m"], timeout=1)
        assert time.monotonic() - started < 3  # a refused connection, not a hang
        assert not await b.ping()


async def test_reconnects_after_restart(aof_server: RedisServer) -> None:
    """One broker lives through a Redis crash: commands, the blocking claim, the shared event
    reader and the abort subscription all come back by themselves."""
    clock = FakeClock()
    async with (
        RedisBroker(aof_server.url, make_settings(clock)) as gateway,
        RedisBroker(aof_server.url, make_settings(clock)) as worker,
    ):
        job = make_job(clock)
        await gateway.admit(job)
        assert await worker.claim("w", ["m"], timeout=1) is not None
        follower = asyncio.create_task(_collect(gateway, job.id))
        aborts = asyncio.create_task(worker.wait_abort_signal(0.01))
        await aborts
        await asyncio.sleep(0.1)  # the follower is blocked in XREAD

        aof_server.kill()
        await asyncio.sleep(0.2)
        aof_server.start()

        await worker.publish(job.id, EventType.TOKEN, {"i": 1})
        await worker.finish(job.id, "w", JobState.SUCCEEDED, result={"ok": True})
        events = await asyncio.wait_for(follower, 10)
        assert [e.type for e in events][-2:] == [EventType.TOKEN, EventType.DONE]

        second = make_job(clock)
        await gateway.admit(second)
        claimed = await worker.claim("w", ["m"], timeout=2)
        assert claimed is not None and claimed.id == second.id

        async def cancelled_reaches_worker() -> bool:
            waiter = asyncio.create_task(worker.wait_abort_signal(5))
            await asyncio.sleep(0.1)
            await gateway.cancel(second.id)
            started = time.monotonic()
            await waiter
            return time.monotonic() - started < 2

        await wait_until(cancelled_reaches_worker, timeout=10)


async def _collect(broker: Broker, job_id: str) -> list[Any]:
    return [e async for e in broker.events(job_id, timeout=10)]


# --- several processes on one queue ------------------------------------------------------------------


async def test_gateway_and_worker_processes_share_a_queue(redis_url: str) -> None:
    """Two brokers stand for a gateway and a worker process: a blocked claim wakes on the other's
    admit, and the gateway follows the worker's tokens live."""
    clock = FakeClock()
    async with (
        RedisBroker(redis_url, make_settings(clock)) as gateway,
        RedisBroker(redis_url, make_settings(clock)) as worker,
    ):
        claim = asyncio.create_task(worker.claim("w", ["m"], timeout=5))
        await asyncio.sleep(0.1)
        job = make_job(clock)
        await gateway.admit(job)
        claimed = await asyncio.wait_for(claim, 2)
        assert claimed is not None and claimed.id == job.id
        follower = asyncio.create_task(_collect(gateway, job.id))
        waiter = asyncio.create_task(gateway.wait(job.id, timeout=5))
        await asyncio.sleep(0.05)
        for i in range(20):
            await worker.publish(job.id, EventType.TOKEN, {"i": i})
        await worker.finish(job.id, "w", JobState.SUCCEEDED, result={"ok": True})
        events = await asyncio.wait_for(follower, 5)
        assert [e.id for e in events] == list(range(1, 24))
        done = await asyncio.wait_for(waiter, 5)
        assert done is not None and done.state is JobState.SUCCEEDED and done.result == {"ok": True}


async def test_many_followers_share_one_reader(redis_url: str) -> None:
    clock = FakeClock()
    async with RedisBroker(redis_url, make_settings(clock)) as b:
        jobs = [make_job(clock, tenant=f"t{i}") for i in range(30)]
        for job in jobs:
            await b.admit(job)
        followers = [asyncio.create_task(_collect(b, j.id)) for j in jobs]
        await asyncio.sleep(0.05)
        for _ in jobs:
            claimed = await b.claim("w", ["m"], timeout=1)
            assert claimed is not None
            await b.publish(claimed.id, EventType.TOKEN, {})
            await b.finish(claimed.id, "w", JobState.SUCCEEDED, result={})
        results = await asyncio.wait_for(asyncio.gather(*followers), 10)
        assert all([e.type for e in events] == [
            EventType.QUEUED, EventType.STARTED, EventType.TOKEN, EventType.DONE
        ] for events in results)  # fmt: skip


async def test_terminal_event_carries_the_job_view(broker: RedisBroker, clock: FakeClock) -> None:
    job = make_job(clock)
    await broker.admit(job)
    await broker.claim("w", ["m"], timeout=1)
    clock.advance(1.25)
    done = await broker.finish(job.id, "w", JobState.SUCCEEDED, result={"text": 'é "q"'}, usage={"n": 1})
    events = [e async for e in broker.events(job.id, timeout=1)]
    assert done is not None and events[-1].data == job_view(done)
    assert events[0].data == {"position": 0, "estimated_start_s": 0}


async def test_cancelled_claim_is_not_swallowed(broker: RedisBroker) -> None:
    """redis-py can swallow a cancel on Python 3.11; a blocked claim must still stop when cancelled."""
    for _ in range(20):
        task = asyncio.create_task(broker.claim("w", ["m"], timeout=5))
        await asyncio.sleep(random.random() * 0.01)
        task.cancel()
        with pytest.raises(asyncio.CancelledError):
            await asyncio.wait_for(task, 2)


async def test_claim_cancelled_in_flight_hands_the_job_back(
    broker: RedisBroker, clock: FakeClock, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A claim cancelled while its script runs (a worker stopping) must not strand the job under a
    lease nobody renews: it goes straight back to the head of its queue, not charged an attempt."""
    job, later = make_job(clock), make_job(clock)
    await broker.admit(job)
    await broker.admit(later)
    original = Batcher._send
    in_flight, sent = asyncio.Event(), asyncio.Event()

    async def slow(self: Batcher, batch: list[Any], retried: bool = False) -> None:
        claiming = any(broker.scripts["claim"].function in e.command for e in batch)
        if claiming:
            in_flight.set()
            await asyncio.sleep(0.2)  # the claim is on its way when the cancel lands
        await original(self, batch, retried)
        if claiming:
            sent.set()

    monkeypatch.setattr(Batcher, "_send", slow)
    task = asyncio.create_task(broker.claim("w", ["m"], timeout=1))
    await in_flight.wait()
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    monkeypatch.setattr(Batcher, "_send", original)
    await asyncio.wait_for(sent.wait(), 5)
    await wait_until(lambda: not broker._releases, timeout=5)
    back = await broker.get(job.id)
    assert back is not None and back.state is JobState.QUEUED and back.attempts == 0
    assert await broker.position(job.id) == 0
    again = await broker.claim("w2", ["m"], timeout=1)
    assert again is not None and again.id == job.id and again.attempts == 1
    assert [e.type for e in await _collect_now(broker, job.id)] == [
        EventType.QUEUED, EventType.STARTED, EventType.RETRY, EventType.STARTED
    ]  # fmt: skip


async def _collect_now(broker: Broker, job_id: str) -> list[Any]:
    return [e async for e in broker.events(job_id, timeout=0.2)]


async def test_a_burst_wakes_every_idle_claimer(redis_url: str) -> None:
    """Only the first job of an idle queue sets the wake-up marker; each woken claimer passes it on
    while work is left, so a burst reaches every idle claimer at once, not one per block timeout."""
    clock = FakeClock()
    async with (
        RedisBroker(redis_url, make_settings(clock)) as gateway,
        RedisBroker(redis_url, make_settings(clock)) as worker,
    ):
        claims = [asyncio.create_task(worker.claim(f"w{i}", ["m"], timeout=8)) for i in range(6)]
        await wait_blocked(redis_url, 6)  # every claimer waits on the marker
        jobs = [make_job(clock, tenant=f"t{i}") for i in range(6)]
        for job in jobs:
            await gateway.admit(job)
        started = time.monotonic()
        claimed = await asyncio.wait_for(asyncio.gather(*claims), 4)
        assert time.monotonic() - started < 2
        assert sorted(j.id for j in claimed if j is not None) == sorted(j.id for j in jobs)


async def test_webhooks_handed_out_acked_and_logged(broker: RedisBroker, clock: FakeClock) -> None:
    job = make_job(clock)
    job.callback_url = "https://example.com/hook"
    plain = make_job(clock)
    for j in (job, plain):
        await broker.admit(j)
        await broker.claim("w", ["m"], timeout=1)
        await broker.finish(j.id, "w", JobState.SUCCEEDED, result={})
    assert await broker.ended_callbacks("w", timeout=1) == [job.id]
    assert await broker.ended_callbacks("w", timeout=0.1) == []  # in flight with w
    await broker.add_delivery(job.id, {"attempt": 1, "at": clock() + 0.123456789, "status": 500})
    await broker.add_delivery(job.id, {"attempt": 2, "at": clock() + 1.5, "status": 200})
    got = await broker.get(job.id)
    assert got is not None and [d["status"] for d in got.extra["deliveries"]] == [500, 200]
    assert got.extra["deliveries"][0]["at"] == clock() + 0.123456789  # not rounded on the way
    clock.advance(601)  # w went quiet: the webhook goes to another worker
    assert await broker.ended_callbacks("w2", timeout=1) == [job.id]
    await broker.ack_callback(job.id)
    clock.advance(601)
    assert await broker.ended_callbacks("w3", timeout=0.1) == []


async def test_waiting_for_webhooks_wakes_on_an_ending_job(
    broker: RedisBroker, clock: FakeClock, redis_url: str
) -> None:
    waiter = asyncio.create_task(broker.ended_callbacks("w", timeout=5))
    await wait_blocked(redis_url, 1)  # the waiter sleeps on the marker: only a wake-up can end it
    job = make_job(clock)
    job.callback_url = "https://example.com/hook"
    await broker.admit(job)
    await broker.cancel(job.id)
    assert await asyncio.wait_for(waiter, 2) == [job.id]


async def test_dead_letters_purged_and_draining_shared(redis_url: str) -> None:
    clock = FakeClock()
    async with (
        RedisBroker(redis_url, make_settings(clock)) as a,
        RedisBroker(redis_url, make_settings(clock)) as b,
    ):
        jobs = [make_job(clock, max_attempts=1) for _ in range(3)]
        for job in jobs:
            await a.admit(job)
            await a.claim("w", ["m"], timeout=1)
        clock.advance(6)
        await a.maintain()
        assert set(await b.dead_letters()) == {j.id for j in jobs}
        assert await b.purge_dead_letters([]) == 0
        assert await b.purge_dead_letters([jobs[0].id, "job_unknown"]) == 1
        assert await a.get(jobs[0].id) is None
        assert await b.purge_dead_letters() == 2
        assert await a.dead_letters() == {}

        await a.set_draining("gpu-1", True)
        assert await b.draining() == {"gpu-1"}
        await b.set_draining("gpu-1", False)
        assert await a.draining() == set()


async def test_a_pipelined_transaction_runs_whole_and_alone(broker: RedisBroker) -> None:
    """A transaction in the shared pipeline (the admitted job's entry in its tenant's list) answers
    with EXEC's replies, nothing submitted in the same turn lands inside it, and a command refused
    while queued fails only that transaction, not its neighbours in the pipeline."""
    batch = broker._batch
    key, other = "sluice-test:tx", "sluice-test:tx-other"
    before = batch.submit(("SET", other, "1"))
    tx = asyncio.ensure_future(batch.transaction(("ZADD", key, "1.5", "a"), ("PEXPIRE", key, 60_000, "NX")))
    after = batch.submit(("INCR", other))
    assert await before == "OK"
    assert await tx == [1, 1]
    assert await after == 2
    assert 0 < int(await batch.call(("PTTL", key))) <= 60_000
    refused = asyncio.ensure_future(batch.transaction(("ZADD", key), ("DEL", key)))  # too few arguments
    neighbour = batch.submit(("INCR", other))
    with pytest.raises(ResponseError, match="wrong number of arguments"):  # why EXEC was aborted
        await refused
    assert await neighbour == 3
    assert await batch.call(("ZRANGE", key, 0, -1)) == ["a"]  # the DEL never ran
    with pytest.raises(ResponseError, match="float"):  # fails as it runs: the rest still runs
        await batch.transaction(("ZADD", key, "not-a-number", "b"), ("ZADD", key, "2", "c"))
    assert await batch.call(("ZRANGE", key, 0, -1)) == ["a", "c"]


async def test_a_transaction_refused_by_an_outage_reads_as_one(broker: RedisBroker) -> None:
    """A transaction whose commands Redis refuses as they are queued because it cannot take writes
    now (here OOM under noeviction; CLUSTERDOWN mid-failover the same way) is an outage, raised as
    BrokerUnavailable (a 503 at the gateway), not EXEC's EXECABORT (which reads as a bug: a 500)."""
    batch = broker._batch
    key = "sluice-test:tx-oom"
    await batch.call(("CONFIG", "SET", "maxmemory", "1"))
    try:
        with pytest.raises(BrokerUnavailable, match="maxmemory"):
            await batch.transaction(("ZADD", key, "1", "a"), ("PEXPIRE", key, 60_000))
    finally:
        await batch.call(("CONFIG", "SET", "maxmemory", "0"))
    assert await batch.call(("EXISTS", key)) == 0  # none of it ran
    assert await batch.transaction(("ZADD", key, "1", "a"), ("DEL", key)) == [1, 1]


@pytest.mark.parametrize("places", [1, 2])
async def test_commands_wait_for_a_place_and_go_out_as_one_pipeline(redis_url: str, places: int) -> None:
    """With ``max_inflight`` pipelines in flight, what callers submit in later turns waits and goes
    out together as the next pipeline when one comes back; below the bound it goes out at once."""
    client = Redis.from_url(redis_url, protocol=2, decode_responses=True)
    other = Redis.from_url(redis_url, decode_responses=True)
    batch = Batcher(client, timeout=10.0, max_inflight=places)
    key = "sluice-test:held"
    try:
        await batch.call(("DEL", key))
        first = batch.pipelines
        held = []
        for _ in range(places):  # each in a turn of its own, so each its own pipeline
            held.append(batch.submit(("BLPOP", key, 0)))
            await asyncio.sleep(0)
        await wait_blocked(redis_url, places)  # the second went out while the first was held
        assert batch.pipelines - first == places
        pings = []
        for _ in range(5):  # five callers in five turns of the loop
            pings.append(batch.submit(("PING",)))
            await asyncio.sleep(0)
        assert batch.pipelines - first == places  # every place is taken: the pings wait
        assert not any(p.done() for p in pings)
        await other.lpush(key, "a")  # one pipeline comes back
        assert await asyncio.wait_for(asyncio.gather(*pings), 5) == ["PONG"] * 5
        assert batch.pipelines - first == places + 1  # the five went out as one pipeline
        assert batch.commands >= 5
        if places == 2:
            await other.lpush(key, "b")  # the other BLPOP
        assert sorted(v for _, v in await asyncio.wait_for(asyncio.gather(*held), 5)) == ["a", "b"][:places]
    finally:
        await batch.drain()
        await client.aclose()
        await other.aclose()


async def test_a_held_commands_deadline_runs_from_its_submission(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A command that waits for a place fails within the command timeout of when it was submitted,
    not of when it went out. The loop's clock is moved by hand (no sleeps for time to pass): one
    pipeline holds the only place with a BLPOP until its own deadline, and the held BLPOP, sent
    then, must fail at its submission's deadline, five seconds before one counted from its sending."""
    loop = asyncio.get_running_loop()
    real, shift = loop.time, [0.0]
    monkeypatch.setattr(loop, "time", lambda: real() + shift[0])
    # redis-py's own timeout of a read (its socket_timeout) is kept out of the way: the deadline's
    client = Redis.from_url(redis_url, protocol=2, decode_responses=True, socket_timeout=60)
    batch = Batcher(client, timeout=10.0, max_inflight=1)
    try:
        await batch.call(("DEL", "sluice-test:never-a", "sluice-test:never-b"))
        first = batch.pipelines
        holder = batch.submit(("BLPOP", "sluice-test:never-a", 0))  # deadline t0 + 10
        await wait_blocked(redis_url, 1)
        shift[0] += 5.0
        held = batch.submit(("BLPOP", "sluice-test:never-b", 0))  # at t0 + 5: deadline t0 + 15
        await asyncio.sleep(0)
        assert batch.pipelines - first == 1 and not held.done()  # the place is taken: it waits
        shift[0] += 5.1  # t0 + 10.1: the holder's deadline passes, and the held one goes out
        with pytest.raises(RedisTimeoutError, match="no answer"):
            await asyncio.wait_for(holder, 5)
        await wait_until(lambda: batch.pipelines - first == 2)
        await wait_blocked(redis_url, 1)  # sent, and blocked in Redis
        shift[0] += 4.8  # t0 + 14.9: before either deadline
        await asyncio.sleep(0.05)
        assert not held.done()
        shift[0] += 0.2  # t0 + 15.1: past the submission's deadline, 5 s before the sending's
        await wait_until(held.done, timeout=3)
        with pytest.raises(Exception, match="no answer"):
            await held
    finally:
        await batch.drain()
        await client.aclose()


async def test_a_tenants_list_keeps_integer_scores_and_still_reads_the_older_form(
    broker: RedisBroker, clock: FakeClock
) -> None:
    """Admissions list a job under its created_at in whole microseconds (an integer score, which a
    listpack keeps as an integer); the jobs an earlier version listed in the older key, scored in
    seconds, still list after them, newest first, and pages run on across the two lists."""
    raw = broker._redis
    keys = broker.keys
    older = []
    for _ in range(3):
        older.append(make_job(clock, tenant="a"))
        await broker.admit(older[-1])
        clock.advance(0.01)
    # as the version before wrote them: seconds as scores, in the older key
    for job in older:
        await raw.zrem(keys.tenant_jobs_us("a"), job.id)
        await raw.zadd(keys.tenant_jobs("a"), {job.id: float(job.created_at)})
    newer = []
    for _ in range(2):
        newer.append(make_job(clock, tenant="a"))
        await broker.admit(newer[-1])
        clock.advance(0.01)
    assert await raw.zscore(keys.tenant_jobs_us("a"), newer[-1].id) == round(newer[-1].created_at * 1_000_000)
    assert await raw.object("encoding", keys.tenant_jobs_us("a")) == "listpack"
    newest_first = [j.id for j in reversed(older + newer)]
    assert [j.id for j in (await broker.list_jobs("a", 10)).jobs] == newest_first
    seen, after = [], None
    while True:
        page = await broker.list_jobs("a", 2, after=after)
        seen += [j.id for j in page.jobs]
        if not page.has_more:
            break
        after = page.jobs[-1].id
    assert seen == newest_first
    # a cursor in the older list goes on in it
    rest = await broker.list_jobs("a", 10, after=older[-1].id)
    assert [j.id for j in rest.jobs] == [older[1].id, older[0].id] and not rest.has_more
    # an expired job leaves whichever list holds it
    await raw.delete(keys.job(older[1].id), keys.job(newer[0].id))
    assert [j.id for j in (await broker.list_jobs("a", 10)).jobs] == [newer[1].id, older[2].id, older[0].id]
    assert await raw.zscore(keys.tenant_jobs("a"), older[1].id) is None
    assert await raw.zscore(keys.tenant_jobs_us("a"), newer[0].id) is None


async def test_admit_lists_a_queued_job_in_its_own_call(broker: RedisBroker, clock: FakeClock) -> None:
    """On the home shard admit.lua adds a queued job to its tenant's list itself, as _list_job's
    MULTI/EXEC did: the list's expiry set once (NX), then only ever lengthened (GT)."""
    raw, keys = broker._redis, broker.keys
    transactions: list[tuple[Any, ...]] = []

    async def transaction(*commands: tuple[Any, ...]) -> Any:
        transactions.append(commands)  # what _list_job would send: none of it should go
        return []

    broker._batch.transaction = transaction  # type: ignore[method-assign]
    long_job = make_job(clock, tenant="a", timeout=3600.0)
    await broker.admit(long_job)
    assert await raw.zscore(keys.tenant_jobs_us("a"), long_job.id) == round(long_job.created_at * 1_000_000)
    long_ttl = await raw.pttl(keys.tenant_jobs_us("a"))
    assert long_ttl > 3600 * 1000
    clock.advance(1.0)  # a later score: two jobs of one instant list in their ids' (random) order
    short_job = make_job(clock, tenant="a", timeout=60.0)
    await broker.admit(short_job)
    assert await raw.zscore(keys.tenant_jobs_us("a"), short_job.id) is not None
    assert await raw.pttl(keys.tenant_jobs_us("a")) > 3600 * 1000  # not shortened
    assert transactions == []
    assert [j.id for j in (await broker.list_jobs("a", 10)).jobs] == [short_job.id, long_job.id]


async def test_admit_keeps_the_head_it_read_while_the_list_and_tag_hold(
    broker: RedisBroker, clock: FakeClock
) -> None:
    """admit.lua stores what it read of another tenant's head job (the list's hd: field, with the
    list's length and its tenant's tag) and reads the job again only when those moved; a cancel of
    the head and a job handed back to the front, which may leave both as they were, drop it."""
    raw = broker._redis
    state, tq = broker.keys.state("m"), broker.keys.tq("m", "normal", "a")
    field = head_field(tq)
    mine = [make_job(clock, tenant="a", max_tokens=n) for n in (10, 300, 20)]  # costs 20, 310, 30
    for job in mine:
        await broker.admit(job)
    # read by the tenant's own second admission, and kept on by its third (one job more)
    cost, _weight, at = (await raw.hget(state, field)).split(" ")
    assert cost == "20" and at.startswith("3:")
    await broker.admit(make_job(clock, tenant="b"))
    assert (await raw.hget(state, field)).split(" ")[2] == at  # another's read it and kept it
    await broker.cancel(mine[0].id)  # the head goes; the tag stays
    assert await raw.hget(state, field) is None
    await broker.admit(make_job(clock, tenant="b"))
    cost, _weight, at = (await raw.hget(state, field)).split(" ")
    assert cost == "310" and at.startswith("2:")
    claimed = await broker.claim("w", ["m"], timeout=1.0)
    assert claimed is not None and claimed.id == mine[1].id
    assert await broker.release(mine[1].id, "w")  # back at the front
    assert await raw.hget(state, field) is None
    await broker.admit(make_job(clock, tenant="b"))
    cost, _weight, at = (await raw.hget(state, field)).split(" ")
    assert cost == "310" and at.startswith("2:")


async def test_the_deadline_active_and_results_zsets_are_kept_skiplists(
    broker: RedisBroker, clock: FakeClock
) -> None:
    """Each admit, claim and settle adds SKIPLIST_MEMBER (at +inf, longer than
    zset-max-listpack-value) beside its job, so that Redis keeps those zsets skiplists, whose insert
    does not walk every member; no read up to a time meets it, and the upkeep passes it by."""
    raw, keys = broker._redis, broker.keys
    keys_lua = (resources.files("sluice") / "lua" / "_keys.lua").read_text(encoding="utf-8")
    lua_member = await raw.eval(keys_lua + "return SKIPLIST_MEMBER", 0)
    assert lua_member == SKIPLIST_MEMBER and len(SKIPLIST_MEMBER) > 64
    job = make_job(clock)
    await broker.admit(job)
    assert await raw.object("encoding", keys.deadline) == "skiplist"
    assert await broker.claim("w", ["m"], timeout=1.0) is not None
    assert await raw.object("encoding", keys.active) == "skiplist"
    await broker.finish(job.id, "w", JobState.SUCCEEDED, result={})
    assert await raw.object("encoding", keys.results) == "skiplist"
    for key in (keys.deadline, keys.active, keys.results):
        assert await raw.zscore(key, SKIPLIST_MEMBER) == float("inf")
    clock.advance(10 * 24 * 3600.0)  # past the result's TTL and any lease
    await broker.maintain()
    assert await broker.get(job.id) is None  # purged, the member passed by
    assert await raw.zrange(keys.results, 0, -1) == [SKIPLIST_MEMBER]


async def test_a_model_queue_state_is_kept_a_hashtable(broker: RedisBroker, clock: FakeClock) -> None:
    """admit.lua stores one value longer than hash-max-listpack-value in the model's state hash, so
    that Redis keeps it a hashtable: as a listpack every field read scans the whole hash, and each
    cycle reads some 40 of its fields. The value outlives the queue's work, and costs no decision."""
    raw = broker._redis
    state = broker.keys.state("m")
    job = make_job(clock, model="m")
    await broker.admit(job)
    assert await raw.object("encoding", state) == "hashtable"
    assert len(await raw.hget(state, "ht")) > 64
    assert await broker.claim("w", ["m"], timeout=1.0) is not None
    await broker.finish(job.id, "w", JobState.SUCCEEDED, result={})
    assert await raw.object("encoding", state) == "hashtable"


@pytest.mark.parametrize(
    "fit",
    [
        "",  # no fill fit: the slowdown is 1
        "0.25 0.5 1.0 0.35 0.6 12",  # slower in a full batch than at the fill measured
        "0.9 0.5 1.0 0.35 0.6 12",  # measured nearly full: little slowdown left
        "0.1 0.1 0.01 0.02 0.01 3",  # a steep line: the slowdown at its bound
    ],
)
async def test_claim_drops_a_job_exactly_as_the_drain_rate_says(
    broker: RedisBroker, clock: FakeClock, fit: str
) -> None:
    """claim.lua drops a job with less time left than DrainRate.service_s at the measured rate and
    fill fit, and leases one with as much or more: checked just either side of the service time,
    and between it and the most any fit could make it (where claim skips reading the fit)."""
    k, cost = broker.keys, 300
    fields = {"p:m": "20.0", "n:m": "5"} | ({"g:m": fit} if fit else {})
    drain = capacity_drain(fields, "m", broker.settings.drain_prior_per_slot)
    service = drain.service_s(cost)
    longest = cost / max(drain.per_slot / MAX_FILL_SLOWDOWN, 1e-3)
    for left in (service * 0.98, service * 1.02, (service + longest) / 2, longest * 1.02):
        job = make_job(clock, prompt_tokens=100, max_tokens=cost - 100, timeout=10_000)
        assert job.cost == cost
        await broker.admit(job)
        await broker._batch.call(("HSET", k.capacity, *(x for kv in fields.items() for x in kv)))
        clock.advance(job.deadline - clock() - left)
        claimed = await broker.claim("w", ["m"], timeout=0.05)
        got = await broker.get(job.id)
        assert got is not None
        if left < service:
            assert claimed is None and got.state is JobState.EXPIRED, (left, service)
        else:
            assert claimed is not None and claimed.id == job.id, (left, service)
        await broker._batch.call(("DEL", k.capacity))


async def test_a_kept_connection_closed_by_the_server_is_replaced(redis_url: str) -> None:
    """A connection the batcher kept from its last pipeline and Redis has since closed (``CLIENT
    KILL``, an idle ``timeout``) fails at its first read; the next pipeline is sent again on a
    connection from the pool and answers, and the dead one is not kept."""
    client = Redis.from_url(redis_url, protocol=2, decode_responses=True)
    other = Redis.from_url(redis_url, decode_responses=True)
    batch = Batcher(client, timeout=10.0)
    try:
        kept = await batch.call(("CLIENT", "ID"))  # this pipeline's connection is kept
        assert await other.client_kill_filter(_id=kept) == 1
        assert await batch.call(("ECHO", "after the kill")) == "after the kill"
        again = await batch.call(("CLIENT", "ID"))
        assert again != kept
        assert await batch.call(("CLIENT", "ID")) == again  # the replacement is kept in turn
    finally:
        await batch.drain()
        await client.aclose()
        await other.aclose()


async def test_a_pipeline_cut_off_mid_read_leaves_no_reply_for_the_next(redis_url: str) -> None:
    """A pipeline whose deadline passes while its reply is still owed (a BLPOP blocked in Redis) is
    not kept for the next one: a later reply on that connection would be handed to another caller.
    Its connection is closed, so Redis drops the blocked pop, and the next command gets its own."""
    client = Redis.from_url(redis_url, protocol=2, decode_responses=True)
    other = Redis.from_url(redis_url, decode_responses=True)
    batch = Batcher(client, timeout=0.3)
    key, mine = "sluice-test:owed", "sluice-test:mine"
    try:
        await batch.call(("DEL", key))
        await batch.call(("SET", mine, "its own reply"))
        owed = await batch.call(("CLIENT", "ID"))
        with pytest.raises(BrokerUnavailable, match="no answer"):
            await batch.call(("BLPOP", key, 0))  # sent on the kept connection, cut off by the deadline
        await wait_until(lambda: _has_no_client(other, owed))
        await other.lpush(key, "late")
        for _ in range(3):  # every connection the batcher may hold now
            assert await batch.call(("GET", mine)) == "its own reply"
        assert await other.llen(key) == 1  # no pop was left blocked to take it
    finally:
        await batch.drain()
        await client.aclose()
        await other.aclose()


async def _has_no_client(redis: Redis, client_id: int) -> bool:
    return all(int(c["id"]) != client_id for c in await redis.client_list())


@pytest.mark.parametrize("size", [1, 2])
async def test_kept_connections_leave_the_pool_one_for_its_other_callers(redis_url: str, size: int) -> None:
    """The connections a batcher keeps between pipelines stay checked out of its client's pool; in
    a pool of one or two they must not take every connection, or the client's direct commands
    (a script library's load among them) wait for the pool's timeout and fail."""
    pool = BlockingConnectionPool.from_url(
        redis_url, max_connections=size, timeout=0.5, protocol=2, decode_responses=True
    )
    client = Redis.from_pool(pool)
    batch = Batcher(client, timeout=10.0)
    try:
        # two pipelines in flight at once, so that two connections come back to be kept
        assert (
            list(await asyncio.gather(batch.call(("PING",)), _next_turn(batch.call(("PING",)))))
            == ["PONG"] * 2
        )
        assert await client.ping()  # a direct command finds a connection
        assert await batch.call(("ECHO", "still")) == "still"
    finally:
        await batch.drain()
        await client.aclose()


async def _next_turn(call: Any) -> Any:
    await asyncio.sleep(0)
    return await call
