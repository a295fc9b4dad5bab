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

import httpx
import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse

from sluice.bench import cli as bench
from sluice.bench.load import Client, Profile, Record, arrivals, is_retrier, parse_prometheus
from sluice.bench.report import bins, goodput, load_result, markdown, percentile, summarize
from sluice.cli import build_parser
from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.servers import run_app, run_gateway

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


def test_goodput_counts_an_answer_that_came_on_a_retry() -> None:
    records = _synthetic()
    retried = records[11]  # refused at 3.0 s with Retry-After 1.5 s
    retried.retry_outcome, retried.retry_sent_s, retried.retry_ended_s = "ok", 4.5, 7.0
    assert goodput(records, 0.0, 10.0) == pytest.approx(10 / 10)
    # the first outcome stays what it was: a refusal, counted as one
    assert summarize(records, duration=10.0)["outcomes"]["refused"] == 2


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


def test_retries_in_the_summary_and_old_records() -> None:
    records = [
        _rec(0, "refused", 0.0, 0.01, status=429, retry_after_s=0.5, retrier=True, retry_outcome="ok"),
        _rec(1, "refused", 0.0, 0.01, status=429, retry_after_s=1.5, retrier=True, retry_outcome="refused"),
        _rec(2, "refused", 0.0, 0.01, status=503, retry_after_s=1.0, retrier=True, should_retry=False),
        _rec(3, "refused", 0.0, 0.01, status=429, retry_after_s=1.0),
    ]
    s = summarize(records, duration=5.0)
    assert s["outcomes"]["refused"] == 4  # the first outcome stays the record's outcome
    r = s["retries"]
    assert (r["retriers"], r["refused_retriers"], r["told_not_to"]) == (3, 3, 1)
    assert (r["count"], r["ok"], r["ok_share"]) == (2, 1, 0.5)
    assert r["retry_after_s"] == {"p50": 1.0, "max": 1.5}
    table = markdown([{"label": "x", "summary": s, "config": _config()}])
    assert "| retried once after Retry-After | 2, 50.0 % then succeeded" in table
    # A result saved before retries existed: its records load, and its table shows a dash.
    old = {k: v for k, v in records[3].to_json().items() if not k.startswith("retr") and k != "should_retry"}
    assert Record.from_json(old).retry_outcome is None
    del s["retries"]
    assert "| retried once after Retry-After | - |" in markdown([{"summary": s, "config": _config()}])


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


async def test_retriers_against_a_spawned_gateway_with_no_queue(tmp_path: Path) -> None:
    # One slot and the cap policy (no waiting room) at 10 req/s of ~0.3 s answers: most requests are
    # refused with a Retry-After, and half of the clients come back once after it.
    async with serve_in_background(preset("article", model="sim")) as url:
        args = _args(
            tmp_path,
            "--target",
            url,
            "--spawn-sluice",
            "--slots",
            "1",
            "--sluice-args=--queue-policy cap",
            "--max-tokens",
            "16",
            "--rate",
            "10",
            "--duration",
            "2",
            "--retriers",
            "0.5",
            "--label",
            "retries",
        )
        assert await bench._main(args) == 0
    result = load_result(tmp_path / "retries.json")
    summary = _check_run(result, tmp_path, "retries")
    records = [Record.from_json(r) for r in result["records"]]
    assert result["config"]["spawn_sluice"] is True
    assert summary["outcomes"]["refused"] > 0  # type: ignore[index]
    retried = 0
    for r in records:
        assert r.retrier == is_retrier(r.index, seed=1, fraction=0.5)
        told = r.outcome == "refused" and r.retry_after_s is not None and r.should_retry is not False
        if r.retrier and told:
            assert r.retry_outcome is not None and r.retry_sent_s is not None and r.retry_after_s is not None
            assert r.retry_sent_s >= r.ended_s + r.retry_after_s
            retried += 1
        else:
            assert r.retry_outcome is None and r.retry_sent_s is None
    assert retried > 0
    assert summary["retries"]["count"] == retried  # type: ignore[index]
    assert "| retried once after Retry-After | " in (tmp_path / "retries.md").read_text()


# -- --policies ----------------------------------------------------------------------------------


async def test_policies_run_on_the_same_arrivals(tmp_path: Path) -> None:
    args = _args(
        tmp_path, "--spawn-sim", "fast", "--policies", "direct,codel", "--rate", "5", "--duration", "1.5"
    )
    assert await bench._main(args) == 0
    results = [load_result(tmp_path / f"steady-{entry}.json") for entry in ("direct", "codel")]
    for result, entry in zip(results, ("direct", "codel"), strict=True):
        _check_run(result, tmp_path, f"steady-{entry}")
        assert result["config"]["policy"] == entry
    direct, codel = results
    assert direct["config"]["mode"] == "direct" and direct["summary"]["server_admitted"] is None
    assert codel["config"]["mode"] == "sync"
    assert codel["summary"]["server_admitted"] == codel["summary"]["accepted"]
    # The same traffic for every entry: the schedule, and the requests made of it.
    assert direct["arrivals"] == codel["arrivals"]
    assert [r["scheduled_s"] for r in direct["records"]] == [r["scheduled_s"] for r in codel["records"]]
    # The gateway ran with the entry's policy, on an engine of its own.
    assert (tmp_path / "sluice-codel.log").exists() and (tmp_path / "sim-direct.log").exists()
    assert not (tmp_path / "sluice-direct.log").exists()
    table = (tmp_path / "policies-steady.md").read_text()
    assert "| | steady-direct | steady-codel |" in table and "(queue policy codel)" in table
    assert (tmp_path / "policies-steady.png").stat().st_size > 0


@pytest.mark.parametrize(
    "extra",
    [
        ("--spawn-sim", "fast", "--policies", "direct,lifo"),
        ("--spawn-sim", "fast", "--policies", "codel,codel"),
        ("--spawn-sim", "fast", "--retriers", "1.5"),
        ("--target", "http://127.0.0.1:9", "--spawn-sluice"),  # a gateway in front needs --slots
        ("--target", "http://127.0.0.1:9", "--policies", "direct,cap"),
    ],
)
def test_bad_command_lines_are_refused_before_anything_starts(tmp_path: Path, extra: tuple[str, ...]) -> None:
    assert bench.run(_args(tmp_path, *extra)) == 2
    assert not list(tmp_path.glob("*.log"))
