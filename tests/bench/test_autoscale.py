"""The simulated cluster, on a tiny day: structure and invariants (its figures are in docs)."""

from __future__ import annotations

from pathlib import Path

import pytest

from sluice.bench import autoscale
from sluice.bench.autoscale import Config, Hpa

TINY = Config(day_s=600, peak_rps=6, burst_s=60, ramp_s=20, cold_start_s=20, sample_s=30, down_window_s=60)


@pytest.fixture(scope="module")
def report() -> dict[str, object]:
    return autoscale.run(TINY)


def test_every_strategy_sees_the_same_arrivals_and_accounts_for_every_job(report: dict[str, object]) -> None:
    rows = report["rows"]
    assert isinstance(rows, list)
    assert [r["strategy"] for r in rows] == [s.name for s in autoscale.STRATEGIES]
    jobs = {r["jobs"] for r in rows}
    assert len(jobs) == 1 and jobs.pop() == len(autoscale.arrivals(TINY)) > 0
    for r in rows:
        assert r["done"] + r["misses"] == r["jobs"]  # each job done within its deadline, or missed
        assert 0 <= r["goodput_share"] <= 1
        assert r["misses"] == sum(r["misses_by_class"].values())
        assert r["engine_seconds"] > 0


def test_the_fixed_fleet_bills_its_engines_all_day_and_scalers_stay_in_bounds(
    report: dict[str, object],
) -> None:
    rows = {r["strategy"]: r for r in report["rows"]}  # type: ignore[attr-defined]
    fleet = report["peak_fleet"]
    assert isinstance(fleet, int) and fleet >= 1
    assert rows["fixed-peak"]["engine_seconds"] == fleet * TINY.day_s
    assert rows["fixed-peak"]["engine_seconds_vs_fixed"] == 1.0
    for name in ("keda-waiting", "keda-sluice"):
        assert TINY.min_replicas <= rows[name]["peak_engines"] <= 2 * fleet
    # behind Sluice the engines' own waiting queue stays empty: that scaler never leaves its minimum
    assert rows["keda-waiting-behind-sluice"]["peak_engines"] == TINY.min_replicas


def test_timelines_cover_the_day(report: dict[str, object]) -> None:
    timelines = report["timelines"]
    assert isinstance(timelines, dict)
    misses = {r["strategy"]: r["misses"] for r in report["rows"]}  # type: ignore[attr-defined]
    for name, tl in timelines.items():
        assert sum(tl["misses"]) == misses[name]
        samples = tl["samples"]
        assert len(samples) == int(TINY.day_s / TINY.sample_s) + 1 == len(tl["misses"])
        assert [s[0] for s in samples] == sorted(s[0] for s in samples)
        assert all(s[3] <= s[2] for s in samples)  # serving never exceeds billed


def test_table_and_plot(report: dict[str, object], tmp_path: Path) -> None:
    text = autoscale.table(report)
    assert text.count("\n") == 1 + len(autoscale.STRATEGIES)
    pytest.importorskip("matplotlib")
    path = tmp_path / "autoscale.png"
    assert autoscale.plot(report, path)
    assert path.stat().st_size > 1000


def test_arrivals_are_seeded() -> None:
    a, b = autoscale.arrivals(TINY), autoscale.arrivals(TINY)
    assert [(j.arrival, j.output) for j in a] == [(j.arrival, j.output) for j in b]
    other = autoscale.arrivals(Config(**{**TINY.__dict__, "seed": 2}))
    assert [j.arrival for j in other] != [j.arrival for j in a]


def test_hpa_follows_the_kubernetes_rules() -> None:
    hpa = Hpa(target=5, min_replicas=1, max_replicas=20, down_window_s=300)
    assert hpa.desired(52, current=10, now=0) == 10  # 5.2 per replica: within the 10 % tolerance
    assert hpa.desired(200, current=2, now=15) == 6  # 40 wanted; at most max(4, 100 %) more
    assert hpa.desired(0, current=6, now=30) == 6  # the window still holds the 20
    assert hpa.desired(0, current=6, now=400) == 1  # the window has passed: to the minimum
    assert hpa.desired(10_000, current=18, now=415) == 20  # the maximum
