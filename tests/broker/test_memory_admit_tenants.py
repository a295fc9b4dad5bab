"""An admission on the memory broker costs the same however many tenants it keeps: idle ones (a
job run and finished, kept for their key's bucket) are neither walked for the capped tenants'
rooms (``MemoryBroker._held``) nor read as backlogs of the class (``FairQueue._backlogged``). A
client that makes up tenant ids (10,000: 242,061 bytecodes an admission before, 1,995 after;
``python -m sluice.bench.claim_tenants --tenants 10,1000,10000``) no longer slows everyone's."""

from __future__ import annotations

from sluice.bench.claim_tenants import per_admit, per_claim
from sluice.broker.memory import MemoryBroker
from sluice.core.job import JobState
from tests.broker.brokers import make_settings
from tests.helpers import FakeClock, make_job

W = "worker-1"


async def test_an_admission_counts_the_same_calls_with_2_or_300_idle_tenants_kept() -> None:
    few = await per_admit(2, 20, "calls")
    many = await per_admit(300, 20, "calls")
    # Before: one call (_Tenant.held_back) more for each tenant kept: 102 against 400.
    assert many == few, (few, many)


async def test_a_claim_counts_the_same_calls_with_2_or_300_idle_tenants_kept() -> None:
    few = await per_claim(2, 20, "calls")
    many = await per_claim(300, 20, "calls")
    assert many == few, (few, many)


async def test_the_fair_queue_forgets_the_tenant_ids_that_drained_once_its_virtual_time_passes_them() -> None:
    """1,000 tenant ids each run one job (a client making up tenants); then two tenants' traffic
    moves the virtual time on, and the upkeep runs: the queue remembers only the tenants that may
    still matter (before, every id it had seen stayed: 1,002 of them, for good)."""
    clock = FakeClock()
    broker = MemoryBroker(make_settings(clock))
    for i in range(1_000):
        await broker.admit(make_job(clock, tenant=f"id-{i}"))
        claimed = await broker.claim(W, ["m"], timeout=0.0)
        assert claimed is not None
        await broker.finish(claimed.id, W, JobState.SUCCEEDED, result={})
    fq = broker._queues["m"].queues["normal"]
    assert len(fq._tenants) == 1_000  # each drained, its finish tag ahead of the virtual time
    for i in range(20):
        await broker.admit(make_job(clock, tenant=("a", "b")[i % 2]))
        claimed = await broker.claim(W, ["m"], timeout=0.0)
        assert claimed is not None
        await broker.finish(claimed.id, W, JobState.SUCCEEDED, result={})
    await broker.maintain()
    assert set(fq._tenants) <= {"a", "b"}
