"""``sluice bench`` itself: short bounded runs against the fast simulator, the command line, and how
it runs without its extra (no tqdm, no matplotlib).

End-to-end runs assert structure and invariants (one outcome per request, files written, nothing
lost), never timings: speed is measured by the benchmark itself, not by tests.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import pytest

from sluice.bench import cli as bench
from sluice.bench.load import Record, is_retrier, parse_prometheus
from sluice.bench.report import PLOTS_NEED, load_result
from sluice.cli import build_parser
from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.servers import run_gateway


def test_counter_sums_the_samples_with_the_labels_asked_for() -> None:
    values = parse_prometheus(
        'sluice_admissions_total{outcome="admitted",code=""} 7.0\n'
        'sluice_admissions_total{outcome="admitted",code="x"} 2.0\n'
        'sluice_admissions_total{outcome="refused",code="queue_full"} 5.0\n'
        "plain 1.5\n"
    )
    assert bench._counter(values, "sluice_admissions_total", outcome="admitted") == 9.0
    assert bench._counter(values, "sluice_admissions_total", outcome="expired") is None
    assert bench._counter(values, "plain") == 1.5


# -- end to end ----------------------------------------------------------------------------------


@pytest.fixture
async def fast_sim() -> AsyncIterator[str]:
    async with serve_in_background(preset("fast", model="sim")) as url:
        yield url


def _args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    argv = ["bench", "--rate", "20", "--duration", "1.5", "--out", str(tmp_path), "--no-progress", *extra]
    return build_parser("bench").parse_args(argv)


def _check_run(result: dict[str, object], out: Path, label: str, *, plot: bool = True) -> dict[str, object]:
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
    for suffix in ("json", "md", "png") if plot else ("json", "md"):
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


# -- without the bench extra (tqdm, matplotlib) ----------------------------------------------------


def test_importing_the_bench_loads_neither_matplotlib_nor_tqdm() -> None:
    code = (
        "import sys, sluice.bench.cli, sluice.bench.report; "
        "print(sorted(m for m in ('matplotlib', 'tqdm') if m in sys.modules))"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "[]"


def test_progress_is_one_plain_line_without_tqdm(
    monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "tqdm", None)  # `from tqdm import tqdm` raises ImportError
    assert bench._progress(12, "1/2 steady", disabled=False) is None
    assert capsys.readouterr().err == "1/2 steady: 12 requests\n"
    assert bench._progress(12, "off", disabled=True) is None
    assert capsys.readouterr().err == ""


def test_progress_is_a_bar_with_tqdm(capsys: pytest.CaptureFixture[str]) -> None:
    bar = bench._progress(3, "steady", disabled=False)
    assert bar is not None
    bar.update(3)
    bar.close()
    assert "steady" in capsys.readouterr().err


def test_a_run_and_a_comparison_without_matplotlib_write_everything_but_the_plots(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch, capsys: pytest.CaptureFixture[str]
) -> None:
    monkeypatch.setitem(sys.modules, "matplotlib", None)  # `import matplotlib` raises ImportError
    monkeypatch.setitem(sys.modules, "tqdm", None)
    argv = ["bench", "--spawn-sim", "fast", "--rate", "5", "--duration", "1", "--out", str(tmp_path)]
    assert bench.run(build_parser("bench").parse_args([*argv, "--label", "bare"])) == 0
    err = capsys.readouterr().err
    assert err.count(PLOTS_NEED) == 1 and "Traceback" not in err
    assert "bare: " in err and " requests" in err  # the plain progress line
    _check_run(load_result(tmp_path / "bare.json"), tmp_path, "bare", plot=False)
    assert not (tmp_path / "bare.png").exists()

    compare = ["bench", "compare", str(tmp_path / "bare.json"), str(tmp_path / "bare.json"), "--name", "both"]
    assert bench.run(build_parser("bench").parse_args(compare)) == 0
    assert capsys.readouterr().err.count(PLOTS_NEED) == 1
    assert "| | bare | bare |" in (tmp_path / "both.md").read_text()
    assert not (tmp_path / "both.png").exists()
