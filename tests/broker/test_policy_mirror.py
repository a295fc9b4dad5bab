"""Every queue policy decides the same on both brokers: ``lua/_policy.lua`` mirrors ``core/policy.py``.

A random run of admissions (steep and slow rises, lulls), claims and finishes on an injected clock,
on the memory broker and on a real redis-server side by side; every answer must be the same,
refusals to the Retry-After, and codel must go through its states (good, standing, good again).
"""

from __future__ import annotations

import copy
import dataclasses
import itertools
import math
import random
from importlib import resources
from typing import Any

import pytest
import redis.asyncio as aioredis

from sluice.broker.base import Broker, BrokerSettings
from sluice.broker.memory import MemoryBroker
from sluice.broker.redis import RedisBroker
from sluice.core import capacity
from sluice.core.admission import RETRY_SHARE, Bounds, QueueLimits, Refused
from sluice.core.capacity import DrainRate
from sluice.core.job import JobState
from sluice.core.policy import CapPolicy, CoDelPolicy, DeadlinePolicy, FifoPolicy, QueuePolicy
from sluice.core.ratelimit import TenantLimits
from tests.helpers import FakeClock, make_job

POLICIES: dict[str, QueuePolicy] = {
    "cap": CapPolicy(),
    "fifo": FifoPolicy(max_queued=5),
    "deadline": DeadlinePolicy(),
    # Scaled down to the run: jobs of ~0.1 to 0.6 s on 3 slots.
    "codel": CoDelPolicy(target_s=0.2, interval_s=0.8, early_s=0.3, burst_rise=1.5, half_life_s=1.5),
}


def _settings(clock: FakeClock, policy: QueuePolicy) -> BrokerSettings:
    return BrokerSettings(
        default_limits=QueueLimits(model=Bounds(max_jobs=80)),
        lease_s=60.0,
        drain_prior_per_slot=100.0,
        policy=policy,
        clock=clock,
    )


def _outcome(result: Any) -> Any:
    if isinstance(result, Refused):
        return (result.status, result.code, result.message, result.retry_after_s, result.should_retry)
    return (result.position, result.estimated_start_s)


@pytest.mark.parametrize("name", list(POLICIES))
@pytest.mark.parametrize("seed", range(3))
async def test_policy_decides_the_same_on_both_brokers(redis_url: str, name: str, seed: int) -> None:
    rng = random.Random(seed)
    clock = FakeClock()
    policy = POLICIES[name]
    memory = MemoryBroker(_settings(clock, policy))
    redis = RedisBroker(redis_url, _settings(clock, policy))
    brokers: tuple[Broker, Broker] = (memory, redis)
    running: list[str] = []
    seen: dict[str, int] = {}
    standing_seen: set[str] = set()
    last_standing: float | None = None
    try:
        for b in brokers:
            await b.register("w", {"m": 3})
        for step in range(500):
            phase = (step // 50) % 5  # a steep rise, a lull, a milder rise, a slow rise, a lull
            arrivals = (8, 0, 3, 1, 0)[phase] if rng.random() < 0.8 else 0
            for _ in range(arrivals):
                job = make_job(
                    clock,
                    model="m",
                    tenant=rng.choice(["a", "b"]),
                    priority=rng.choice(["high", "normal", "normal"]),
                    prompt_tokens=10,
                    max_tokens=rng.choice([10, 20, 50]),
                    timeout=rng.choice([60, 60, 2]),
                )
                outcomes = []
                for b in brokers:
                    try:
                        outcomes.append(_outcome(await b.admit(copy.deepcopy(job))))
                    except Refused as exc:
                        outcomes.append(_outcome(exc))
                assert outcomes[0] == outcomes[1], f"step {step}"
                kind = outcomes[0][1] if isinstance(outcomes[0][1], str) else "admitted"
                seen[kind] = seen.get(kind, 0) + 1
            if name == "codel":
                # The memory broker's view, for the coverage check: how did the queue become standing?
                state = memory._policy_state.get("m")
                if state and state.standing_since is not None and state.standing_since != last_standing:
                    assert state.above_since is not None
                    early = state.standing_since - state.above_since < POLICIES["codel"].interval_s  # type: ignore[attr-defined]
                    standing_seen.add("slow rise" if early else "interval")
                last_standing = state.standing_since if state else None
            # The engine: finish some running jobs (their service time feeds the drain rate), claim.
            keep = []
            for job_id in running:
                if rng.random() < 0.35:
                    for b in brokers:
                        await b.finish(job_id, "w", JobState.SUCCEEDED, result={}, usage={"total_tokens": 30})
                else:
                    keep.append(job_id)
            running = keep
            while (
                len(running) < 3
                and (await memory.stats()).get("m")
                and (await memory.stats())["m"].queued_jobs
            ):
                got = [await b.claim("w", ["m"], timeout=0.01) for b in brokers]
                ids = [j.id if j else None for j in got]
                assert ids[0] == ids[1], f"step {step}"
                if ids[0] is None:
                    break
                running.append(ids[0])
            clock.advance(rng.choice([0.05, 0.1, 0.1, 0.2]))
            if step % 50 == 0:
                stats = [await b.stats() for b in brokers]
                assert {m: (s.queued_jobs, s.running_jobs) for m, s in stats[0].items()} == {
                    m: (s.queued_jobs, s.running_jobs) for m, s in stats[1].items()
                }
        # The run went through the policy's decisions, not just the happy path.
        assert (
            seen.get("admitted", 0) > 50
            and seen.get("queue_full", 0) + seen.get("deadline_unmeetable", 0) > 10
        ), seen
        if name == "codel":
            assert standing_seen == {"slow rise", "interval"}, standing_seen
        # The deadline check promised waits at a rate below the mean (capacity.promise_rate): the
        # run compared that rule's decisions too, not only the mean's.
        drain = memory._drain["m"]
        assert drain.fills > 0 and drain.promise_rate < 0.95 * drain.rate
    finally:
        await redis.close()


@pytest.mark.parametrize("seed", range(3))
async def test_fair_admission_and_eviction_decide_the_same_on_both_brokers(redis_url: str, seed: int) -> None:
    """The fair order's view of a job (its tenant's place in virtual time, other tenants' caps) and
    the eviction at a bound, on a small queue that a heavy tenant keeps full: every answer the same,
    every job in the same state at the end, and evictions happened."""
    rng = random.Random(seed)
    clock = FakeClock()
    settings = BrokerSettings(
        default_limits=QueueLimits(model=Bounds(max_jobs=12), classes={"normal": Bounds(max_tokens=900)}),
        lease_s=60.0,
        drain_prior_per_slot=100.0,
        policy=POLICIES["deadline"],
        clock=clock,
    )
    memory = MemoryBroker(settings)
    redis = RedisBroker(redis_url, settings)
    brokers: tuple[Broker, Broker] = (memory, redis)
    limits = {
        "heavy": TenantLimits("heavy", max_concurrent=2),
        "mid": TenantLimits("mid"),
        "light": TenantLimits("light", weight=2.0),
    }
    running: list[str] = []
    ids: list[str] = []
    try:
        for b in brokers:
            await b.register("w", {"m": 3})
        for step in range(200):
            for _ in range(rng.choice([0, 1, 2, 4])):
                tenant = rng.choices(["heavy", "mid", "light"], weights=[6, 2, 1])[0]
                job = make_job(
                    clock,
                    model="m",
                    tenant=tenant,
                    priority=rng.choice(["high", "normal", "normal", "normal"]),
                    prompt_tokens=10,
                    max_tokens=rng.choice([10, 40, 90]),
                    timeout=rng.choice([60, 60, 3]),
                )
                job.weight = limits[tenant].weight
                outcomes = []
                for b in brokers:
                    try:
                        outcomes.append(_outcome(await b.admit(copy.deepcopy(job), limits[tenant])))
                    except Refused as exc:
                        outcomes.append(_outcome(exc))
                assert outcomes[0] == outcomes[1], f"step {step}"
                ids.append(job.id)
            keep = []
            for job_id in running:
                if rng.random() < 0.3:
                    for b in brokers:
                        await b.finish(job_id, "w", JobState.SUCCEEDED, result={}, usage={"total_tokens": 30})
                else:
                    keep.append(job_id)
            running = keep
            while len(running) < 3:
                got = [await b.claim("w", ["m"], timeout=0.01) for b in brokers]
                assert [j.id if j else None for j in got] == [j.id if j else None for j in got[::-1]]
                if got[0] is None:
                    break
                running.append(got[0].id)
            clock.advance(rng.choice([0.05, 0.1, 0.2]))
        states = []
        for b in brokers:
            jobs = [await b.get(i) for i in ids]
            states.append([(j.state, j.error.code if j.error else None) if j else None for j in jobs])
        assert states[0] == states[1]
        evicted = sum(1 for s in states[0] if s and s[1] == "evicted")
        assert evicted > 5, evicted
    finally:
        await redis.close()


async def test_gateways_on_one_redis_hand_out_times_from_one_book(redis_url: str) -> None:
    """Two gateways refusing the same burst never tell two clients the same time: the reservation
    book lives in Redis (admission.reserve, admit.lua)."""
    clock = FakeClock()
    settings = BrokerSettings(
        default_limits=QueueLimits(model=Bounds(max_jobs=2)),
        lease_s=60.0,
        policy=DeadlinePolicy(),
        clock=clock,
    )
    gateways = [RedisBroker(redis_url, settings), RedisBroker(redis_url, settings)]
    try:
        for _ in range(2):
            await gateways[0].admit(make_job(clock, model="m"))
        times = []
        for i in range(6):
            with pytest.raises(Refused) as info:
                await gateways[i % 2].admit(make_job(clock, model="m"))
            times.append(info.value.retry_after_s)
            clock.advance(0.1)
        # Each later refusal's time is one reservation after the one before, less the 0.1 s passed.
        step = 30 / (settings.drain_prior_per_slot * RETRY_SHARE)
        assert [b - a for a, b in itertools.pairwise(times)] == pytest.approx([step - 0.1] * 5)
    finally:
        for g in gateways:
            await g.close()


async def test_the_promises_slowdown_is_the_same_in_lua(redis_url: str) -> None:
    """lua/_drain.lua's promise_slowdown is DrainRate.promise_slowdown, the fill gap's part too
    (the random runs above seldom leave a gap: 3 slots fill up): on drain rates fed fills from a
    few to all of the slots, with answers even and spread, the script gives the same slowdown as
    the rate, and the gap's share decides some of them (where the line is flat and the fills low)."""
    client = aioredis.from_url(redis_url)
    rng = random.Random(7)
    by_gap = 0
    try:
        for case in range(40):
            slots = rng.choice([4, 8, 16, 50])
            top = rng.randint(1, slots)  # the most jobs running while the rate learnt
            even = case % 2 == 0
            d = DrainRate(slots=slots, weigh_per_slot=True)
            for _ in range(rng.randint(20, 400)):
                running = rng.randint(1, top)
                per = 1.0 + 0.5 * running / slots
                d.observe(100, per if even else per * rng.choice([0.2, 0.2, 0.2, 3.0]), running=running)
            got = await _lua_promise_slowdown(client, d)
            assert got == pytest.approx(d.promise_slowdown, rel=1e-12), case
            by_gap += _gap_decides(d)
        assert 5 <= by_gap < 40, by_gap
    finally:
        await client.aclose()


#: lua/_drain.lua with a call of its promise_slowdown on a rate's fields (ARGV as
#: :func:`_lua_promise_slowdown` sends them), its answer to the last digit.
_PROMISE_SCRIPT = (resources.files("sluice") / "lua" / "_drain.lua").read_text(encoding="utf-8") + (
    "\nlocal g = fill_fit(ARGV[1])\n"
    "local fit = fit_slowdown(g, tonumber(ARGV[2]), tonumber(ARGV[3]))\n"
    "local spread = time_spread(tonumber(ARGV[4]), tonumber(ARGV[5]), tonumber(ARGV[6]))\n"
    "return string.format('%.17g', promise_slowdown(g, fit, tonumber(ARGV[3]), tonumber(ARGV[7]), spread,"
    " tonumber(ARGV[8]), tonumber(ARGV[9])))\n"
)


async def _lua_promise_slowdown(client: aioredis.Redis, d: DrainRate) -> float:
    """The script's promise slowdown for ``d``'s fields, the constants as the brokers get them
    (capacity.promise_args: the extrapolation share, then the fill gap's two, last)."""
    args = capacity.promise_args()
    g = " ".join(repr(float(x)) for x in (d.fill, d.fit_u, d.fit_t, d.fit_uu, d.fit_ut, d.fills))
    reply = await client.eval(
        _PROMISE_SCRIPT,
        0,
        g,
        repr(capacity.FILL_RIDGE),
        repr(capacity.MAX_FILL_SLOWDOWN),
        repr(d.per_slot),
        repr(d.slow),
        str(d.samples),
        args[0],
        args[-2],
        args[-1],
    )
    return float(reply)


def _gap_decides(d: DrainRate) -> bool:
    """Whether the fill gap's share moves ``d``'s promise (the same rate without it differs)."""
    want = d.promise_slowdown
    return not math.isnan(want) and want != dataclasses.replace(d, fill_gap_share=0.0).promise_slowdown


def _edge_rates() -> dict[str, DrainRate]:
    """Drain states the random ones above never reach, built field by field: never told a fill,
    one fill (no spread of fills: the gap is 1 - fill), every fill a full batch (the gap below 0),
    even answers (spread 0), a spread that is NaN, fills' moments that round below a variance of
    0, a NaN or infinite second moment (a corrupt field: Python's max() as a conditional must
    give what Lua's math.max gives, which keeps its first argument against a NaN), a flat line
    (fit_t 0: the fit 1) beside one, and the gap's share against the spread's at a tie."""
    nan, inf = float("nan"), float("inf")

    def rate(
        g: tuple[float, float, float, float, float, int], per_slot: float, slow: float, samples: int
    ) -> DrainRate:
        d = DrainRate(slots=8, weigh_per_slot=True, per_slot=per_slot, slow=slow, samples=samples)
        d.fill, d.fit_u, d.fit_t, d.fit_uu, d.fit_ut, d.fills = g
        return d

    u = 0.3
    return {
        "no fills": rate((0.0, 0.0, 0.0, 0.0, 0.0, 0), 1.0, 1.5, 5),
        "no fills, none measured": rate((0.0, 0.0, 0.0, 0.0, 0.0, 0), 0.0, 0.0, 0),
        "one fill": rate((u, u, 1.2, u * u, u * 1.2, 1), 1.0, 1.0, 1),
        "one fill, spread": rate((u, u, 1.2, u * u, u * 1.2, 1), 1.0, 2.5, 1),
        "full batches": rate((1.0, 1.0, 1.5, 1.0, 1.5, 50), 1.0, 1.2, 50),
        "near full, sd": rate((0.9, 0.8, 1.4, 0.8 * 0.8 + 0.01, 0.8 * 1.4 + 0.02, 50), 1.0, 1.1, 50),
        "even answers": rate((0.2, 0.25, 1.0, 0.07, 0.26, 30), 1.0, 1.0, 30),
        "spread NaN": rate((0.2, 0.25, 1.0, 0.07, 0.26, 30), 1.0, nan, 30),
        "variance rounds below 0": rate((0.1, 0.1, 1.0, 0.1 * 0.1 - 1e-17, 0.1, 30), 1.0, 1.3, 30),
        "second moment NaN": rate((0.2, 0.25, 1.0, nan, 0.26, 30), 1.0, 1.3, 30),
        "second moment NaN, flat": rate((0.2, 0.25, 0.0, nan, 0.0, 30), 1.0, 1.3, 30),
        "second moment inf, flat": rate((0.2, 0.25, 0.0, inf, 0.0, 30), 1.0, 1.3, 30),
        "fill 0": rate((0.0, 0.05, 1.0, 0.003, 0.05, 30), 1.0, 1.3, 30),
        "shares tie": rate(
            (u, u, 1.2, u * u, u * 1.2, 1),
            1.0,
            1.0 + 2 * (1 - u) * capacity.FILL_GAP_SHARE / capacity.EXTRAPOLATION_SHARE,
            1,
        ),
    }


async def test_the_promises_slowdown_is_the_same_in_lua_at_the_edges(redis_url: str) -> None:
    """lua/_drain.lua's promise_slowdown is DrainRate.promise_slowdown in every branch, on the
    states _edge_rates builds: each compared to the ulp (NaN with NaN), the constants as the
    brokers get them (capacity.promise_args, the last two), and the gap deciding some of them."""
    args = capacity.promise_args()
    assert args[0] == repr(capacity.EXTRAPOLATION_SHARE)
    assert args[-2:] == [repr(capacity.FILL_GAP_SHARE), repr(capacity.FILL_GAP_SD)]
    client = aioredis.from_url(redis_url)
    by_gap = []
    try:
        for name, d in _edge_rates().items():
            got = await _lua_promise_slowdown(client, d)
            want = d.promise_slowdown
            assert got == want or (math.isnan(got) and math.isnan(want)), (name, got, want)
            if _gap_decides(d):
                by_gap.append(name)
        assert {"one fill", "even answers", "fill 0"} <= set(by_gap), by_gap
    finally:
        await client.aclose()


async def test_a_tenant_never_dispatched_starts_at_the_virtual_time_it_is_pushed_at_on_both(
    redis_url: str,
) -> None:
    """The fair queue's virtual time goes back when a tenant passed over for its cap is popped
    later. A tenant whose first job was cancelled unstarted before that has no finish tag on
    either broker: its next job starts at the virtual time then, and the same work is ahead of it.
    The memory broker had kept the virtual time of its first push as its finish, and put it
    behind two jobs more than Redis did (position 3 against 1)."""
    clock = FakeClock()
    settings = BrokerSettings(
        default_limits=QueueLimits(model=Bounds(max_jobs=100)), lease_s=60.0, clock=clock
    )
    brokers: tuple[Broker, Broker] = (MemoryBroker(settings), RedisBroker(redis_url, settings))
    capped = TenantLimits("a", max_concurrent=1)

    async def admit(tenant: str, limits: TenantLimits | None = None, cost: int = 30) -> tuple[str, list[Any]]:
        job = make_job(clock, model="m", tenant=tenant, prompt_tokens=cost // 2, max_tokens=cost - cost // 2)
        return job.id, [_outcome(await b.admit(copy.deepcopy(job), limits)) for b in brokers]

    async def claim() -> str:
        got = [await b.claim("w", ["m"], timeout=0.0) for b in brokers]
        assert got[0] is not None and got[1] is not None and got[0].id == got[1].id
        return got[0].tenant

    try:
        first, _ = await admit("a", capped)
        assert await claim() == "a"
        await admit("a", capped)  # held: a is at its cap, its tag (30) waits
        for _ in range(4):
            await admit("b")  # tags 0, 30, 60, 90
        assert [await claim() for _ in range(3)] == ["b", "b", "b"]  # past a's tag: vtime 60
        cancelled, _ = await admit("x")  # x first seen at vtime 60
        for b in brokers:
            await b.cancel(cancelled)
            await b.finish(first, "w", JobState.SUCCEEDED, result={})
        assert await claim() == "a"  # a's held job, at tag 30: the virtual time goes back to 30
        for _ in range(3):
            await admit("d", cost=10)  # tags 30, 40, 50
        _, outcomes = await admit("x")
        assert outcomes[0] == outcomes[1]
        assert outcomes[0][0] == 1  # from 30: d's head job only (the tie) is ahead
    finally:
        await brokers[1].close()
