"""The memory broker's kept sets of the tenants at their concurrency cap (``MemoryBroker._at_cap``,
which a claim passes over) and of those holding jobs back by it (``MemoryBroker._held``, whose
rooms admission reads), and each fair queue's backlogged tenants (``FairQueue._backlogged``), are
what a fresh walk of every tenant gives, through admissions with caps raised, lowered and dropped,
claims, finishes, cancels, releases, lost leases and expiries."""

from __future__ import annotations

import random

from sluice.broker.memory import MemoryBroker
from sluice.core.admission import Refused
from sluice.core.job import JobState
from sluice.core.ratelimit import TenantLimits
from tests.broker.brokers import make_settings
from tests.helpers import FakeClock, make_job

W = "worker-1"
MODELS = ["m", "m2"]


def fresh_held(broker: MemoryBroker) -> set[str]:
    """The tenants holding jobs back by their cap, walked afresh (what each admission computed
    before the set was kept)."""
    return {name for name, t in broker._tenants.items() if t.held_back}


def fresh_backlogged(broker: MemoryBroker) -> dict[tuple[str, str], set[str]]:
    """Per (model, class): the fair queue's tenants with jobs queued, walked afresh."""
    return {
        (model, cls): {name for name, t in fq._tenants.items() if t.jobs}
        for model, q in broker._queues.items()
        for cls, fq in q.queues.items()
    }


def fresh(broker: MemoryBroker) -> set[str]:
    """The tenants at their cap, walked afresh (what each claim computed before the set was kept)."""
    return {
        name
        for name, t in broker._tenants.items()
        if t.max_concurrent is not None and t.running >= t.max_concurrent
    }


async def test_the_kept_capped_set_is_a_fresh_walk_at_every_step() -> None:
    clock = FakeClock()
    broker = MemoryBroker(make_settings(clock))  # leases of 5 s
    rng = random.Random(11)
    tenants = [f"t{i}" for i in range(12)]
    done: dict[str, int] = {}
    largest = most_held = 0
    for _ in range(4_000):
        step = rng.random()
        running = [j for j, rec in broker._records.items() if rec.job.state is JobState.RUNNING]
        if step < 0.35:
            tenant = rng.choice(tenants)
            limits = None
            if rng.random() < 0.8:  # a cap of 0 holds even an idle tenant at it
                cap = rng.choice([None, 0, 1, 1, 2, 3])
                limits = TenantLimits(tenant, max_concurrent=cap, rpm=rng.choice([None, 10_000]))
            job = make_job(clock, model=rng.choice(MODELS), tenant=tenant, timeout=rng.uniform(1, 30))
            try:
                await broker.admit(job, limits)
                done["admit"] = done.get("admit", 0) + 1
            except Refused:
                done["refused"] = done.get("refused", 0) + 1
        elif step < 0.6:
            capped = fresh(broker)
            claimed = await broker.claim(W, rng.sample(MODELS, rng.randrange(1, 3)), timeout=0.0)
            if claimed is not None:
                assert claimed.tenant not in capped  # a claim passes over the tenants at their cap
                done["claim"] = done.get("claim", 0) + 1
        elif step < 0.75 and running:
            state = rng.choice([JobState.SUCCEEDED, JobState.FAILED])
            assert await broker.finish(rng.choice(running), W, state) is not None
            done["finish"] = done.get("finish", 0) + 1
        elif step < 0.8 and broker._records:
            await broker.cancel(rng.choice(list(broker._records)))
            done["cancel"] = done.get("cancel", 0) + 1
        elif step < 0.85 and running:
            assert await broker.release(rng.choice(running), W)
            done["release"] = done.get("release", 0) + 1
        else:
            clock.advance(rng.random() * 2.5)  # leases lapse after 5 s, deadlines from 1 s
            await broker.maintain()
            done["maintain"] = done.get("maintain", 0) + 1
        assert broker._at_cap == fresh(broker)
        assert broker._held == fresh_held(broker)
        kept = {(m, c): set(fq._backlogged) for m, q in broker._queues.items() for c, fq in q.queues.items()}
        assert kept == fresh_backlogged(broker)
        largest = max(largest, len(broker._at_cap))
        most_held = max(most_held, len(broker._held))
    assert largest >= 3  # several tenants were held at their caps at once
    assert most_held >= 2  # and several held jobs back at once
    assert min(done.get(k, 0) for k in ("admit", "claim", "finish", "cancel", "release", "maintain")) > 50


async def test_a_lowered_cap_holds_a_tenant_until_its_running_jobs_are_under_it() -> None:
    clock = FakeClock()
    broker = MemoryBroker(make_settings(clock))
    for _ in range(3):
        await broker.admit(make_job(clock, tenant="a"), TenantLimits("a", max_concurrent=3))
    claimed = [await broker.claim(W, ["m"], timeout=0.0) for _ in range(3)]
    assert broker._at_cap == {"a"}
    await broker.admit(make_job(clock, tenant="a"), TenantLimits("a", max_concurrent=1))  # lowered
    assert broker._at_cap == {"a"}
    ids = [job.id for job in claimed if job is not None]
    await broker.finish(ids[0], W, JobState.SUCCEEDED)
    assert broker._at_cap == {"a"}  # 2 running, cap 1
    assert await broker.claim(W, ["m"], timeout=0.0) is None  # its queued job waits
    await broker.finish(ids[1], W, JobState.SUCCEEDED)
    assert broker._at_cap == {"a"}  # 1 running, cap 1
    await broker.finish(ids[2], W, JobState.SUCCEEDED)
    assert broker._at_cap == set()
    held = await broker.claim(W, ["m"], timeout=0.0)
    assert held is not None and held.tenant == "a" and broker._at_cap == {"a"}
    await broker.admit(make_job(clock, tenant="a"), TenantLimits("a"))  # the cap dropped
    assert broker._at_cap == set()
