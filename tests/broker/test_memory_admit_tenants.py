"""An admission on the memory broker costs the same however many tenants it keeps: idle ones (a
job run and finished, kept for their key's bucket) are neither walked for the capped tenants'
rooms (``MemoryBroker._held``) nor read as backlogs of the class (``FairQueue._backlogged``). A
client that makes up tenant ids (10,000: 242,061 bytecodes an admission before, 1,995 after;
``python -m sluice.bench.claim_tenants --tenants 10,1000,10000``) no longer slows everyone's."""

from __future__ import annotations

from sluice.bench.claim_tenants import per_admit, per_claim


async def test_an_admission_counts_the_same_calls_with_2_or_300_idle_tenants_kept() -> None:
    few = await per_admit(2, 20, "calls")
    many = await per_admit(300, 20, "calls")
    # Before: one call (_Tenant.held_back) more for each tenant kept: 102 against 400.
    assert many == few, (few, many)


async def test_a_claim_counts_the_same_calls_with_2_or_300_idle_tenants_kept() -> None:
    few = await per_claim(2, 20, "calls")
    many = await per_claim(300, 20, "calls")
    assert many == few, (few, many)
