"""``sluice bench``'s report side: statistics, the summary, markdown, and plots without matplotlib."""

from __future__ import annotations

import math
import sys
from pathlib import Path

import pytest

from sluice.bench.load import Record
from sluice.bench.report import (
    PLOTS_NEED,
    bins,
    goodput,
    markdown,
    percentile,
    plot_compare,
    plot_run,
    plots_available,
    summarize,
)

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


# -- plots ---------------------------------------------------------------------------------------


def _result(label: str) -> dict[str, object]:
    records = _synthetic()
    return {
        "label": label,
        "config": _config(),
        "summary": summarize(records, duration=10.0, capacity=1.8),
        "records": [r.to_json() for r in records],
        "samples": [{"t": 1.0, "sluice_queued_jobs": 3.0}, {"t": 2.0, "sluice_queued_jobs": 1.0}],
    }


def test_plots_of_a_run_and_of_a_comparison(tmp_path: Path) -> None:
    assert plots_available()
    plot_run(_result("a"), tmp_path / "a.png")
    plot_compare([_result("a"), _result("b")], tmp_path / "ab.png")
    for name in ("a.png", "ab.png"):
        assert (tmp_path / name).read_bytes().startswith(b"\x89PNG")


def test_without_matplotlib_plotting_says_what_to_install(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    assert not plots_available()
    with pytest.raises(ImportError, match=r"plots need matplotlib: pip install 'sluice\[bench\]'"):
        plot_run(_result("a"), tmp_path / "a.png")
    assert PLOTS_NEED == "plots need matplotlib: pip install 'sluice[bench]'"
    assert not (tmp_path / "a.png").exists()


def test_broken_promises_are_accepted_requests_not_answered_in_time() -> None:
    records = _synthetic()
    records[11].retry_outcome, records[11].retry_code = "timeout", "deadline_exceeded"  # a retry too
    s = summarize(records, duration=10.0, counters={"server_broken_promises": 2})
    # Of 15 first tries and 1 retry accepted: the one that gave up, and two the server expired.
    assert s["broken_promises"] == {"count": 3, "accepted": 16, "expired": 2, "gave_up": 1}
    table = markdown([{"label": "x", "summary": s, "config": _config()}])
    assert (
        "| broken promises: accepted, then not answered in time | 3 of 16 (2 expired, 1 gave up); "
        "the gateway counted 2 |"
    ) in table
