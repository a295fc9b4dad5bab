"""``sluice bench``'s load side: arrival schedules, the clients (retries included), /metrics parsing."""

from __future__ import annotations

import itertools
import json
import math
import statistics

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from sluice.bench.load import Client, Profile, Record, arrivals, is_retrier, parse_prometheus
from tests.servers import run_app

# -- arrivals ------------------------------------------------------------------------------------


def test_steady_arrivals_are_poisson_at_the_rate() -> None:
    times = arrivals(Profile("steady", rate=50.0, duration=200.0), seed=7)
    expected = 50.0 * 200.0
    # A Poisson count has standard deviation sqrt(mean); 4 sigma is a bound no seed should cross.
    assert abs(len(times) - expected) < 4 * math.sqrt(expected)
    gaps = [b - a for a, b in itertools.pairwise(times)]
    # Exponential gaps: mean 1/rate and coefficient of variation 1 (a fixed pacing would give 0).
    assert statistics.fmean(gaps) == pytest.approx(1 / 50.0, rel=0.05)
    assert statistics.stdev(gaps) / statistics.fmean(gaps) == pytest.approx(1.0, abs=0.08)
    assert times == sorted(times) and times[0] >= 0 and times[-1] < 200.0


def test_arrivals_depend_only_on_the_seed() -> None:
    profile = Profile("spike", rate=3, peak=30, spike_at=20, spike_for=10, duration=60)
    assert arrivals(profile, seed=1) == arrivals(profile, seed=1)
    assert arrivals(profile, seed=1) != arrivals(profile, seed=2)


def test_spike_shape() -> None:
    profile = Profile("spike", rate=3, peak=30, spike_at=20, spike_for=10, duration=60)
    assert profile.expected_count() == pytest.approx(3 * 50 + 30 * 10)
    counts = [0, 0, 0]
    for seed in range(20):
        for t in arrivals(profile, seed):
            counts[0 if t < 20 else 1 if t < 30 else 2] += 1
    before, during, after = (c / 20 for c in counts)
    assert before == pytest.approx(3 * 20, rel=0.15)
    assert during == pytest.approx(30 * 10, rel=0.1)
    assert after == pytest.approx(3 * 30, rel=0.15)


def test_ramp_shape() -> None:
    profile = Profile("ramp", rate=2, to=20, duration=100)
    assert profile.rate_at(0) == 2 and profile.rate_at(50) == 11 and profile.rate_at(100) == 20
    times = [t for seed in range(10) for t in arrivals(profile, seed)]
    quarters = [sum(1 for t in times if q * 25 <= t < (q + 1) * 25) / 10 for q in range(4)]
    # Integral of the rate over each quarter: 25 * (mean rate of the quarter).
    for got, rate in zip(quarters, (4.25, 8.75, 13.25, 17.75), strict=True):
        assert got == pytest.approx(25 * rate, rel=0.12)
    assert quarters == sorted(quarters)


def test_profile_rejects_nonsense() -> None:
    with pytest.raises(ValueError):
        Profile("steady", duration=0)
    with pytest.raises(ValueError):
        Profile("steady", rate=-1)
    assert arrivals(Profile("steady", rate=0, duration=5), seed=1) == []


def test_retriers_are_the_same_clients_for_a_seed() -> None:
    chosen = [i for i in range(2000) if is_retrier(i, seed=1, fraction=0.1)]
    assert chosen == [i for i in range(2000) if is_retrier(i, seed=1, fraction=0.1)]
    assert chosen != [i for i in range(2000) if is_retrier(i, seed=2, fraction=0.1)]
    # About the share asked for (a binomial count: 4 sigma of 2000 * 0.1 * 0.9 is 54).
    assert abs(len(chosen) - 200) < 54
    # A larger share keeps the clients of a smaller one: the same seed only adds retriers.
    assert set(chosen) <= {i for i in range(2000) if is_retrier(i, seed=1, fraction=0.3)}
    assert not any(is_retrier(i, seed=1, fraction=0.0) for i in range(100))
    assert all(is_retrier(i, seed=1, fraction=1.0) for i in range(100))


def test_parse_prometheus_sums_labelled_samples() -> None:
    text = (
        "# HELP sluice_queued_jobs Jobs waiting\n"
        'sluice_queued_jobs{model="a"} 3.0\n'
        'sluice_queued_jobs{model="b"} 4.0\n'
        'vllm:num_requests_waiting{model_name="sim"} 2.0\n'
        'sluice_admissions_total{outcome="admitted",code=""} 7.0\n'
        "plain 1.5e3\n"
    )
    values = parse_prometheus(text)
    assert values["sluice_queued_jobs"] == 7.0
    assert values['sluice_queued_jobs{model="a"}'] == 3.0
    assert values["vllm:num_requests_waiting"] == 2.0
    assert values["plain"] == 1500.0


# -- retries -------------------------------------------------------------------------------------


def _refusing_engine(seen: list[dict[str, str]], should_retry: str | None = None) -> FastAPI:
    """Refuses a first attempt with a Retry-After of 0.2 s, answers a retry; keeps every request's headers."""
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> JSONResponse:
        seen.append(dict(request.headers))
        if "x-stainless-retry-count" not in request.headers:
            headers = {"retry-after": "1", "retry-after-ms": "200"}
            if should_retry is not None:
                headers["x-should-retry"] = should_retry
            return JSONResponse({"error": {"code": "queue_full"}}, status_code=429, headers=headers)
        return JSONResponse({"choices": [], "usage": {"completion_tokens": 3}})

    return app


async def _one(url: str, retriers: float) -> Record:
    async with httpx.AsyncClient() as http:
        record = Record(index=0, scheduled_s=0.0)
        await Client(http, url, retriers=retriers).run(record)
        return record


async def test_a_retrier_waits_the_retry_after_and_retries_once() -> None:
    seen: list[dict[str, str]] = []
    async with run_app(_refusing_engine(seen)) as url:
        record = await _one(url, retriers=1.0)
    assert len(seen) == 2
    assert "x-stainless-retry-count" not in seen[0] and seen[1]["x-stainless-retry-count"] == "1"
    # The first outcome stays; the retry's is beside it, sent no sooner than the Retry-After (the ms one).
    assert (record.outcome, record.retry_after_s, record.should_retry) == ("refused", 0.2, None)
    assert record.retrier and record.retry_outcome == "ok" and record.retry_status == 200
    assert record.retry_sent_s is not None and record.retry_ended_s is not None
    assert record.retry_sent_s >= record.ended_s + 0.2
    assert record.retry_latency_s == pytest.approx(record.retry_ended_s - record.retry_sent_s)
    assert Record.from_json(json.loads(json.dumps(record.to_json()))) == record


async def test_no_retry_for_a_non_retrier_or_when_told_not_to() -> None:
    seen: list[dict[str, str]] = []
    async with run_app(_refusing_engine(seen)) as url:
        record = await _one(url, retriers=0.0)
    assert len(seen) == 1 and not record.retrier and record.retry_outcome is None
    seen.clear()
    async with run_app(_refusing_engine(seen, should_retry="false")) as url:
        record = await _one(url, retriers=1.0)
    assert len(seen) == 1 and record.retrier and record.should_retry is False
    assert record.retry_outcome is None and record.retry_sent_s is None
