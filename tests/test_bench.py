"""``sluice bench``: arrivals, statistics, and short bounded runs against the fast simulator.

End-to-end runs assert structure and invariants (one outcome per request, files written, nothing
lost), never timings: speed is measured by the benchmark itself, not by tests.
"""

from __future__ import annotations

import argparse
import itertools
import json
import math
import statistics
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sluice import bench
from sluice.bench_load import Profile, Record, arrivals, parse_prometheus
from sluice.bench_report import bins, goodput, load_result, markdown, percentile, summarize
from sluice.cli import build_parser
from sluice.sim import preset
from sluice.sim_server import serve_in_background
from tests.servers import run_gateway

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


# -- statistics ----------------------------------------------------------------------------------


def test_percentile_interpolates_like_numpy() -> None:
    values = [4.0, 1.0, 3.0, 2.0]
    assert percentile(values, 0) == 1.0
    assert percentile(values, 100) == 4.0
    assert percentile(values, 50) == pytest.approx(2.5)
    assert percentile(values, 90) == pytest.approx(3.7)
    assert percentile([5.0], 99) == 5.0
    assert percentile([], 50) is None


def _rec(i: int, outcome: str, sent: float, latency: float, **kw: object) -> Record:
    return Record(
        index=i,
        scheduled_s=sent,
        sent_s=sent,
        ended_s=sent + latency,
        latency_s=latency,
        outcome=outcome,  # type: ignore[arg-type]
        **kw,  # type: ignore[arg-type]
    )


def _synthetic() -> list[Record]:
    records = [_rec(i, "ok", float(i), 1.0 + i / 10, status=200, tokens=128) for i in range(10)]
    records += [_rec(10, "ok", 9.5, 2.0, status=200)]  # ends at 11.5: after the window
    records += [
        _rec(11, "refused", 3.0, 0.002, status=429, code="queue_full", retry_after_s=1.5),
        _rec(12, "refused", 4.0, 0.004, status=503, code="deadline_unmeetable", retry_after_s=3.0),
        _rec(13, "timeout", 5.0, 15.0, code="client_gave_up", tokens=40),
        _rec(14, "timeout", 6.0, 15.1, status=504, code="deadline_exceeded"),
        _rec(15, "error", 7.0, 0.1, status=502, code="engine_error"),
        _rec(16, "error", 8.0, 0.1, code="RemoteProtocolError"),
    ]
    return records


def test_goodput_counts_successes_finished_inside_the_window() -> None:
    records = _synthetic()
    # Successes end at i + 1 + i/10: those with i <= 8 end by 10.0 (9 of them), i = 9 at 10.9.
    assert goodput(records, 0.0, 10.0) == pytest.approx(9 / 10)
    assert goodput(records, 0.0, 20.0) == pytest.approx(11 / 20)
    assert goodput(records, 5.0, 5.0) == 0.0


def test_summary_of_synthetic_records() -> None:
    records = _synthetic()
    s = summarize(
        records,
        duration=10.0,
        capacity=1.8,
        counters={"engine_generated_tokens": 2000, "engine_wasted_tokens": 50, "stuck": 0},
    )
    assert s["offered"] == 17 and s["offered_rps"] == pytest.approx(1.7)
    assert s["outcomes"] == {"ok": 11, "refused": 2, "timeout": 2, "error": 2}
    assert sum(s["outcomes"].values()) == s["offered"]
    assert s["by_code"]["refused 429 queue_full"] == 1
    assert s["by_code"]["timeout - client_gave_up"] == 1
    assert s["success_rate"] == pytest.approx(11 / 17)
    assert s["accepted"] == 15
    assert s["goodput_rps"] == pytest.approx(0.9)
    assert s["goodput_pct_capacity"] == pytest.approx(50.0)
    assert s["latency_ok_s"]["p50"] == pytest.approx(1.5)
    assert s["latency_ok_s"]["max"] == pytest.approx(2.0)
    assert s["refuse_s"]["p50"] == pytest.approx(0.003)
    assert s["retry_after_s"]["count"] == 2 and s["retry_after_s"]["max"] == 3.0
    assert s["wasted_share"] == pytest.approx(0.025)
    assert s["wasted_source"].startswith("engine counter")
    # The reset connection is the one accepted request that ended without a visible outcome.
    assert s["lost"] == 1 and s["nothing_lost"] is False
    table = markdown([{"label": "x", "summary": s, "config": _config()}])
    assert "| success rate | 64.7 % |" in table
    assert "50.0 % of 1.80" in table


def test_client_side_waste_is_the_fallback() -> None:
    records = [_rec(0, "ok", 0.0, 1.0, tokens=100, ttft_s=0.1), _rec(1, "timeout", 0.0, 15.0, tokens=25)]
    s = summarize(records, duration=5.0)
    assert s["wasted_share"] == pytest.approx(0.2)
    assert s["wasted_source"].startswith("client side")
    assert summarize(records[:1], duration=5.0)["nothing_lost"] is True


def test_bins() -> None:
    assert bins([0.1, 0.9, 1.0, 2.5, math.nan], 1.0) == [2, 1, 1]
    assert bins([], 1.0, until=2.0) == [0, 0, 0]


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
    assert bench._counter(values, "sluice_admissions_total", outcome="admitted") == 7.0


def _config() -> dict[str, object]:
    return {
        "mode": "direct",
        "target": "t",
        "profile_text": "steady",
        "seed": 1,
        "client_timeout": 15.0,
        "max_tokens": 128,
        "duration": 10.0,
    }


# -- end to end ----------------------------------------------------------------------------------


@pytest.fixture
async def fast_sim() -> AsyncIterator[str]:
    async with serve_in_background(preset("fast", model="sim")) as url:
        yield url


def _args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    argv = ["bench", "--rate", "20", "--duration", "1.5", "--out", str(tmp_path), "--no-progress", *extra]
    return build_parser("bench").parse_args(argv)


def _check_run(result: dict[str, object], out: Path, label: str) -> dict[str, object]:
    records = result["records"]
    assert isinstance(records, list) and records
    summary = result["summary"]
    assert isinstance(summary, dict)
    # Every request has exactly one outcome, and the counts add up.
    assert all(r["outcome"] in ("ok", "refused", "timeout", "error") for r in records)
    assert sorted(r["index"] for r in records) == list(range(len(records)))
    assert sum(summary["outcomes"].values()) == summary["offered"] == len(records)
    assert summary["outcomes"]["ok"] > 0
    assert summary["nothing_lost"] is True
    for r in records:
        assert r["ended_s"] >= r["sent_s"] >= 0
    for suffix in ("json", "md", "png"):
        assert (out / f"{label}.{suffix}").stat().st_size > 0
    assert load_result(out / f"{label}.json")["summary"] == json.loads(json.dumps(summary))
    return summary


async def test_direct_run_against_the_simulator(fast_sim: str, tmp_path: Path) -> None:
    args = _args(tmp_path, "--target", fast_sim, "--label", "direct", "--capacity", "550")
    assert await bench._main(args) == 0
    summary = _check_run(load_result(tmp_path / "direct.json"), tmp_path, "direct")
    assert summary["wasted_source"] is not None and summary["engine_generated_tokens"] > 0
    assert summary["server_admitted"] is None


async def test_sync_and_async_runs_through_sluice(fast_sim: str, tmp_path: Path) -> None:
    async with run_gateway([fast_sim], max_concurrency=16) as gw:
        for mode, users in (("sync", "1"), ("async", "3")):
            args = _args(
                tmp_path,
                "--target",
                gw.url,
                "--mode",
                mode,
                "--label",
                mode,
                "--engine-metrics",
                f"{fast_sim}/metrics",
                "--users",
                users,
            )
            assert await bench._main(args) == 0
            result = load_result(tmp_path / f"{mode}.json")
            summary = _check_run(result, tmp_path, mode)
            # The gateway admitted exactly the requests the clients saw accepted.
            assert summary["server_admitted"] == summary["accepted"]
            assert summary["stuck"] == 0
            assert result["samples"] and "sluice_queued_jobs" in result["samples"][0]

    assert (
        bench.run(
            build_parser("bench").parse_args(
                [
                    "bench",
                    "compare",
                    str(tmp_path / "sync.json"),
                    str(tmp_path / "async.json"),
                    "--name",
                    "both",
                ]
            )
        )
        == 0
    )
    table = (tmp_path / "both.md").read_text()
    assert "| | sync | async |" in table
    assert (tmp_path / "both.png").stat().st_size > 0


async def test_client_gives_up_and_the_engine_aborts(tmp_path: Path) -> None:
    # Answers take ~2 s on the article's engine: every client gives up first, and every token the
    # engine generated was for a request that was then aborted.
    async with serve_in_background(preset("article", model="sim")) as url:
        args = _args(tmp_path, "--target", url, "--client-timeout", "0.3", "--stream", "--duration", "1")
        assert await bench._main(args) == 0
    result = load_result(tmp_path / "direct-steady.json")
    summary = result["summary"]
    assert summary["outcomes"]["ok"] == 0
    assert summary["outcomes"]["timeout"] == summary["offered"] > 0
    assert summary["wasted_share"] == pytest.approx(1.0)
    assert summary["client_wasted_share"] == pytest.approx(1.0)


def test_compare_rejects_a_file_that_is_not_a_result(tmp_path: Path) -> None:
    bogus = tmp_path / "x.json"
    bogus.write_text("{}")
    args = build_parser("bench").parse_args(["bench", "compare", str(bogus)])
    assert bench.run(args) == 2
