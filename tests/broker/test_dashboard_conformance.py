"""Conformance for what the dashboard reads of the broker: the queue by class and by tenant
(``queue_breakdown``) and the processes' reports (``put_report``, ``reports``), on every broker."""

from __future__ import annotations

from collections.abc import AsyncIterator

import pytest

from sluice.broker.base import Broker, ClassDepth, TenantDepth
from tests.broker.brokers import make_broker
from tests.helpers import FakeClock, make_job


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture(params=["memory", "redis"])
async def broker(request: pytest.FixtureRequest, clock: FakeClock) -> AsyncIterator[Broker]:
    async with await make_broker(request.param, request, clock) as impl:
        yield impl


async def test_breakdown_by_class_and_top_tenants(broker: Broker, clock: FakeClock) -> None:
    for tenant, priority, n in [("a", "normal", 3), ("b", "normal", 1), ("b", "high", 1), ("c", "low", 2)]:
        for _ in range(n):
            await broker.admit(
                make_job(clock, tenant=tenant, priority=priority, prompt_tokens=10, max_tokens=20)
            )
    await broker.admit(make_job(clock, model="other", tenant="z"))
    got = await broker.queue_breakdown(top_tenants=2)
    m = got["m"]
    assert m.classes == {"high": ClassDepth(1, 30), "normal": ClassDepth(4, 120), "low": ClassDepth(2, 60)}
    assert list(m.classes) == ["high", "normal", "low"]  # highest first
    # a: 3 jobs; b and c 2 each, tie broken by name; only the top two are listed, all are counted
    assert m.tenants == [TenantDepth("a", 3, 90), TenantDepth("b", 2, 60)]
    assert m.tenant_count == 3
    assert got["other"].tenants == [TenantDepth("z", 1, 30)]


async def test_breakdown_follows_claims_and_cancels(broker: Broker, clock: FakeClock) -> None:
    jobs = [make_job(clock, tenant=t) for t in ("a", "a", "b")]
    for job in jobs:
        await broker.admit(job)
    claimed = await broker.claim("w", ["m"], timeout=1.0)
    assert claimed is not None
    queued = [j for j in jobs if j.id != claimed.id]
    await broker.cancel(queued[0].id)
    m = (await broker.queue_breakdown(top_tenants=10))["m"]
    assert m.classes["normal"].jobs == 1
    assert sum(t.jobs for t in m.tenants) == 1 and m.tenant_count == 1
    assert await broker.claim("w", ["m"], timeout=1.0) is not None
    m = (await broker.queue_breakdown(top_tenants=10))["m"]
    assert m.classes["normal"] == ClassDepth(0, 0) and m.tenants == [] and m.tenant_count == 0


async def test_reports_are_shared_replaced_and_expire(broker: Broker, clock: FakeClock) -> None:
    assert await broker.reports() == {}
    await broker.put_report("gateway-1", {"role": "gateway", "samples": [["x_total", {"a": "b"}, 1.0]]}, 10.0)
    await broker.put_report("worker-1", {"role": "worker", "engines": []}, 3.0)
    got = await broker.reports()
    assert got == {
        "gateway-1": {"role": "gateway", "samples": [["x_total", {"a": "b"}, 1.0]]},
        "worker-1": {"role": "worker", "engines": []},
    }
    got["gateway-1"]["role"] = "changed"  # a copy: the broker's own is untouched
    await broker.put_report("gateway-1", {"role": "gateway", "n": 2}, 10.0)
    assert (await broker.reports())["gateway-1"] == {"role": "gateway", "n": 2}
    clock.advance(5.0)  # past the worker's ttl, not the gateway's
    assert set(await broker.reports()) == {"gateway-1"}
    clock.advance(6.0)
    assert await broker.reports() == {}
