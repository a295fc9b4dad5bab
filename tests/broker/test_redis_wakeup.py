"""An idle claim wakes when a job it may take appears, not at the end of its block (on Redis a
BZPOPMIN of up to 10 s on its models' markers): here, a job held back by its tenant's concurrency
cap in one model, freed by the end of the tenant's running job in another model. The tenant's cap
spans its models, so the slot freed by a job of model ``a`` is one for its job of model ``b``,
whose claimers must wake too (the memory broker wakes every claim; Redis sets the marker of every
model of the shard, lua/_job.lua ``settle``)."""

from __future__ import annotations

import asyncio

import pytest

from sluice.broker import redis_work
from sluice.core.job import JobState
from sluice.core.ratelimit import TenantLimits
from tests.broker.brokers import claims_waiting, make_broker
from tests.helpers import FakeClock, make_job, wait_until

#: Redis's BZPOPMIN in these tests (CLAIM_BLOCK_S, 10 s, patched): what a claim not woken waits out
BLOCK_S = 120.0
#: how long the waiting claim waits at most: past the block
CLAIM_WAIT_S = 300.0
#: how long a woken claim may take to return its job, well under the block, so that a loaded
#: machine cannot make a woken claim look like one that waited out its block
WOKEN_S = 30.0
assert WOKEN_S < BLOCK_S < CLAIM_WAIT_S


@pytest.fixture(autouse=True)
def long_block(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setattr(redis_work, "CLAIM_BLOCK_S", BLOCK_S)


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.mark.parametrize("end", ["finish", "cancel", "lost"])
@pytest.mark.parametrize("name", ["memory", "redis"])
async def test_a_capped_tenants_end_in_one_model_wakes_the_claim_of_its_held_job_in_another(
    name: str, end: str, request: pytest.FixtureRequest, clock: FakeClock
) -> None:
    broker = await make_broker(name, request, clock)
    capped = TenantLimits("capped", max_concurrent=1)
    async with broker:
        running = make_job(clock, model="a", tenant="capped", max_attempts=1)
        held = make_job(clock, model="b", tenant="capped")
        await broker.admit(running, capped)
        assert (await broker.claim("wa", ["a"], timeout=1.0)).id == running.id  # type: ignore[union-attr]
        await broker.admit(held, capped)
        # A claim of model b alone: it looks, finds only the held job, and waits (past Redis's block).
        waiting = asyncio.create_task(broker.claim("wb", ["b"], timeout=CLAIM_WAIT_S))
        try:
            await wait_until(lambda: claims_waiting(broker), timeout=10.0)
            assert not waiting.done()
            if end == "finish":
                await broker.finish(running.id, "wa", JobState.SUCCEEDED, result={})
            elif end == "cancel":
                await broker.cancel(running.id)
            else:
                clock.advance(6)  # past its lease, no heartbeat: its one attempt fails
                await broker.maintain()
                assert (await broker.get(running.id)).state is JobState.FAILED  # type: ignore[union-attr]
            claimed = await asyncio.wait_for(waiting, WOKEN_S)
            assert claimed is not None and claimed.id == held.id
        finally:
            waiting.cancel()


@pytest.mark.parametrize("name", ["memory", "redis"])
async def test_a_raised_cap_wakes_the_claim_of_a_held_job_in_another_model(
    name: str, request: pytest.FixtureRequest, clock: FakeClock
) -> None:
    """The tenant's next admission (model ``a``) comes with a higher cap: its held job of model
    ``b`` may run now, and the claim of ``b`` waiting for it gets it."""
    broker = await make_broker(name, request, clock)
    async with broker:
        running = make_job(clock, model="a", tenant="capped")
        held = make_job(clock, model="b", tenant="capped")
        await broker.admit(running, TenantLimits("capped", max_concurrent=1))
        assert (await broker.claim("wa", ["a"], timeout=1.0)).id == running.id  # type: ignore[union-attr]
        await broker.admit(held, TenantLimits("capped", max_concurrent=1))
        waiting = asyncio.create_task(broker.claim("wb", ["b"], timeout=CLAIM_WAIT_S))
        try:
            await wait_until(lambda: claims_waiting(broker), timeout=10.0)
            assert not waiting.done()
            await broker.admit(
                make_job(clock, model="a", tenant="capped"), TenantLimits("capped", max_concurrent=2)
            )
            claimed = await asyncio.wait_for(waiting, WOKEN_S)
            assert claimed is not None and claimed.id == held.id
        finally:
            waiting.cancel()
