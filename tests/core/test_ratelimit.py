from __future__ import annotations

import math

import pytest

from sluice.core.ratelimit import Bucket, TenantLimiter, TenantLimits, duration


def test_bucket_bursts_then_refills() -> None:
    b = Bucket(60)  # one a second
    for _ in range(60):
        assert b.wait_s(1, 0.0) == 0
        b.take(1, 0.0)
    assert b.wait_s(1, 0.0) == pytest.approx(1.0)
    assert b.wait_s(1, 0.5) == pytest.approx(0.5)
    assert b.wait_s(1, 1.0) == 0
    assert b.wait_s(61, 1.0) == math.inf


def test_limiter_checks_both_and_reports_the_worst() -> None:
    lim = TenantLimiter(TenantLimits("t", rpm=10, tpm=1000))
    assert lim.check(600, 0.0) == (0.0, None)
    lim.take(600, 0.0)
    wait, which = lim.check(600, 0.0)
    assert which == "tokens" and wait == pytest.approx(200 / (1000 / 60))
    assert lim.check(2000, 0.0)[0] == math.inf


def test_settle_gives_back_unused_tokens() -> None:
    lim = TenantLimiter(TenantLimits("t", tpm=1000))
    lim.take(800, 0.0)
    lim.settle(charged=800, used=100, now=0.0)
    status = lim.status(0.0)
    assert status.remaining_tokens == 900


def test_settle_charges_usage_above_the_estimate_as_a_debt() -> None:
    lim = TenantLimiter(TenantLimits("t", tpm=600))  # ten a second
    lim.take(500, 0.0)
    lim.settle(charged=500, used=1300, now=0.0)  # 800 more than charged: 100 - 800
    assert lim.status(0.0).remaining_tokens == -700
    assert lim.status(0.0).headers()["x-ratelimit-remaining-tokens"] == "0"
    wait, which = lim.check(10, 0.0)
    assert which == "tokens" and wait == pytest.approx(71.0)  # the debt is paid off first
    assert lim.check(10, 71.0) == (0.0, None)


def test_headers_in_openai_format() -> None:
    lim = TenantLimiter(TenantLimits("t", rpm=60, tpm=6000))
    lim.take(3000, 0.0)
    h = lim.status(0.0).headers()
    assert h["x-ratelimit-limit-requests"] == "60"
    assert h["x-ratelimit-remaining-requests"] == "59"
    assert h["x-ratelimit-remaining-tokens"] == "3000"
    assert h["x-ratelimit-reset-tokens"] == "30s"
    assert h["x-ratelimit-reset-requests"] == "1s"


def test_duration_format() -> None:
    assert duration(0.25) == "250ms"
    assert duration(1) == "1s"
    assert duration(360) == "6m0s"
    assert duration(61.2) == "1m2s"


def test_no_limits_no_headers() -> None:
    lim = TenantLimiter(TenantLimits("t"))
    assert lim.check(10**9, 0.0) == (0.0, None)
    assert lim.status(0.0).headers() == {}


def test_a_changed_limit_keeps_the_level() -> None:
    """A key's limits change (its configuration did): its buckets keep their levels, refill at the
    new rate, and hold no more than the new size; a fresh minute is never handed out."""
    lim = TenantLimiter(TenantLimits("t", rpm=10, tpm=1000, key="k"))
    for _ in range(10):
        lim.take(50, 0.0)
    lim.update(TenantLimits("t", rpm=20, tpm=1000, key="k"))
    wait, which = lim.check(50, 0.0)
    assert which == "requests" and wait == pytest.approx(3.0)  # empty still; 20 a minute from now on
    assert lim.check(50, 3.0) == (0.0, None)
    lim.update(TenantLimits("t", rpm=20, tpm=400, key="k"))  # smaller than what it holds: cut to 400
    assert lim.status(3.0).remaining_tokens == 400
    lim.update(TenantLimits("t", tpm=400, key="k"))  # no rpm any more: no requests bucket
    assert lim.requests is None and lim.has_buckets
    lim.update(TenantLimits("t", rpm=5, tpm=400, key="k"))  # back again: a new key's, full
    assert lim.status(3.0).remaining_requests == 5


def test_limits_name_their_buckets_by_key() -> None:
    assert TenantLimits("t", key="ab").bucket_id == "ab"
    assert TenantLimits("t").bucket_id == ""  # a caller without a key: its tenant's
    assert not TenantLimiter(TenantLimits("t")).has_buckets
