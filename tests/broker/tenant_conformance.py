"""Per-tenant limits, enforced atomically with admission: a second conformance suite for brokers."""

from __future__ import annotations

import pytest

from sluice.broker.base import Broker
from sluice.core.admission import Refused
from sluice.core.job import JobState
from sluice.core.ratelimit import TenantLimits
from tests.helpers import FakeClock, make_job

W = "worker-1"


class TenantLimitsConformance:
    async def test_requests_per_minute(self, broker: Broker, clock: FakeClock) -> None:
        policy = TenantLimits("t", rpm=2)
        first = await broker.admit(make_job(clock), policy)
        assert first.rate is not None and first.rate.remaining_requests == 1
        await broker.admit(make_job(clock), policy)
        with pytest.raises(Refused) as info:
            await broker.admit(make_job(clock), policy)
        assert info.value.status == 429 and info.value.code == "rate_limit_exceeded"
        assert info.value.retry_after_s == pytest.approx(30, abs=1)  # two a minute: one every 30 s
        assert info.value.rate is not None
        headers = info.value.rate.headers()
        assert (
            headers["x-ratelimit-limit-requests"] == "2" and headers["x-ratelimit-remaining-requests"] == "0"
        )
        other = await broker.admit(make_job(clock, tenant="other"), TenantLimits("other", rpm=2))
        assert not other.duplicate  # limits are per tenant
        # The three queued jobs start (a queue that stood still for 30 s would be refused as
        # standing, which is the queue policy's business, not this test's).
        for _ in range(3):
            assert await broker.claim(W, ["m"], timeout=1.0) is not None
        clock.advance(30)
        await broker.admit(make_job(clock), policy)

    async def test_tokens_per_minute_settled_with_real_usage(self, broker: Broker, clock: FakeClock) -> None:
        policy = TenantLimits("t", tpm=100)
        job = make_job(clock, prompt_tokens=10, max_tokens=50)
        await broker.admit(job, policy)
        with pytest.raises(Refused) as info:
            await broker.admit(make_job(clock, prompt_tokens=10, max_tokens=50), policy)
        assert info.value.code == "rate_limit_exceeded" and "tokens" in info.value.message
        await broker.claim(W, ["m"], timeout=1.0)
        # It used 20 of the 60 tokens charged: the other 40 come back.
        await broker.finish(job.id, W, JobState.SUCCEEDED, result={}, usage={"total_tokens": 20})
        await broker.admit(make_job(clock, prompt_tokens=10, max_tokens=50), policy)
        with pytest.raises(Refused) as hopeless:
            await broker.admit(make_job(clock, prompt_tokens=100, max_tokens=100), policy)
        assert hopeless.value.should_retry is False  # larger than a whole minute's allowance

    async def test_max_queued(self, broker: Broker, clock: FakeClock) -> None:
        policy = TenantLimits("t", max_queued=2)
        for _ in range(2):
            await broker.admit(make_job(clock), policy)
        with pytest.raises(Refused) as info:
            await broker.admit(make_job(clock), policy)
        assert info.value.status == 429 and info.value.code == "too_many_queued"
        assert 0 < info.value.retry_after_s <= 120
        await broker.claim(W, ["m"], timeout=1.0)  # one starts: room for one more
        await broker.admit(make_job(clock), policy)

    async def test_max_concurrent(self, broker: Broker, clock: FakeClock) -> None:
        capped = TenantLimits("capped", max_concurrent=1)
        a1, a2 = make_job(clock, tenant="capped"), make_job(clock, tenant="capped")
        b = make_job(clock, tenant="free")
        for job, policy in ((a1, capped), (a2, capped), (b, TenantLimits("free"))):
            await broker.admit(job, policy)
        assert (await broker.claim(W, ["m"], timeout=1.0)).id == a1.id  # type: ignore[union-attr]
        assert (await broker.claim(W, ["m"], timeout=1.0)).id == b.id  # type: ignore[union-attr]
        assert await broker.claim(W, ["m"], timeout=0.2) is None  # a2 waits for a1
        await broker.finish(a1.id, W, JobState.SUCCEEDED, result={})
        assert (await broker.claim(W, ["m"], timeout=1.0)).id == a2.id  # type: ignore[union-attr]

    async def test_refused_requests_are_not_charged(self, broker: Broker, clock: FakeClock) -> None:
        policy = TenantLimits("t", rpm=5, max_queued=1)
        await broker.admit(make_job(clock), policy)
        for _ in range(3):
            with pytest.raises(Refused):
                await broker.admit(make_job(clock), policy)
        ok = await broker.claim(W, ["m"], timeout=1.0)
        assert ok is not None
        adm = await broker.admit(make_job(clock), policy)
        assert adm.rate is not None and adm.rate.remaining_requests == 3
