"""``sluice bench`` itself: short bounded runs against the fast simulator, the command line, and how
it runs without its extra (no tqdm, no matplotlib).

End-to-end runs assert structure and invariants (one outcome per request, files written, nothing
lost), never timings: speed is measured by the benchmark itself, not by tests.
"""

from __future__ import annotations

import argparse
import json
import re
import socket
import subprocess
import sys
from collections.abc import AsyncIterator
from pathlib import Path

import httpx
import pytest

from sluice.bench import cli as bench
from sluice.bench import measure
from sluice.bench.load import PROMPT, Record, is_retrier, parse_prometheus
from sluice.bench.report import PLOTS_NEED, load_result
from sluice.cli import build_parser
from sluice.sim.model import capacity_rps, estimate_chat_tokens, preset
from sluice.sim.server import serve_in_background
from tests.servers import run_gateway


def test_counter_sums_the_samples_with_the_labels_asked_for() -> None:
    values = parse_prometheus(
        'sluice_admissions_total{outcome="admitted",code=""} 7.0\n'
        'sluice_admissions_total{outcome="admitted",code="x"} 2.0\n'
        'sluice_admissions_total{outcome="refused",code="queue_full"} 5.0\n'
        "plain 1.5\n"
    )
    assert measure.counter(values, "sluice_admissions_total", outcome="admitted") == 9.0
    assert measure.counter(values, "sluice_admissions_total", outcome="expired") is None
    assert measure.counter(values, "plain") == 1.5


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


# -- runs too short to show what they measure ------------------------------------------------------


# Two slots and 5 ms steps: a 20-token answer in 0.1 s, 20 answers/s; offered 40 req/s, clients
# that give up at 2 s. The queue that times out is 20 * (2 - 0.1) = 38 requests, filled at 20 a
# second: the rule wants at least 2 * 38 / 20 = 3.8 s of arrivals.
_SLOW = {"max_num_seqs": 2, "base_step_s": 0.005, "per_seq_s": 0.0, "prefill_s_per_token": 0.0}
_SLOW_TOKENS = 20


async def _overloaded_run(tmp_path: Path, duration: str, label: str) -> dict[str, object]:
    params = preset("article", model="sim", **_SLOW)
    capacity = capacity_rps(params, _SLOW_TOKENS, estimate_chat_tokens([PROMPT]))
    assert capacity == pytest.approx(20.0)
    async with serve_in_background(params) as url:
        args = _args(
            tmp_path,
            "--target", url, "--capacity", str(capacity), "--max-tokens", str(_SLOW_TOKENS),
            "--client-timeout", "2", "--rate", "40", "--duration", duration, "--label", label, "--no-plot",
        )  # fmt: skip
        assert await bench._main(args) == 0
    return load_result(tmp_path / f"{label}.json")


async def test_a_short_overload_warns_that_it_cannot_show_it(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    result = await _overloaded_run(tmp_path, "0.5", "short")
    summary = result["summary"]
    assert isinstance(summary, dict)
    # What misleads: at twice the capacity, the engine alone answered every request.
    assert summary["outcomes"]["timeout"] == 0 and summary["outcomes"]["ok"] == summary["offered"]
    overload = [w for w in summary["warnings"] if w.startswith("too short to show overload")]
    # 2 * 20 * (2 - T) / 20 s for the shortest answer T, 0.1 s on an idle machine
    assert len(overload) == 1 and re.search(r"run at least [34] s \(--duration\)$", overload[0])
    # In the printed report and in the saved table, under the run's name.
    printed = capsys.readouterr().out
    for table in (printed, (tmp_path / "short.md").read_text()):
        assert "\nWarnings:\n" in table and "- **short**: too short to show overload" in table


async def test_a_long_enough_overload_shows_and_does_not_warn(tmp_path: Path) -> None:
    result = await _overloaded_run(tmp_path, "5", "long")
    summary = result["summary"]
    assert isinstance(summary, dict)
    assert summary["outcomes"]["timeout"] > 0  # clients gave up: the overload shows
    assert not [w for w in summary["warnings"] if w.startswith("too short to show overload")]


async def test_a_goodput_above_the_capacity_given_says_why(fast_sim: str, tmp_path: Path) -> None:
    # 20 req/s answered by an engine told to be a 5 req/s one: the capacity came from elsewhere.
    args = _args(tmp_path, "--target", fast_sim, "--capacity", "5", "--label", "above", "--no-plot")
    assert await bench._main(args) == 0
    summary = load_result(tmp_path / "above.json")["summary"]
    assert summary["goodput_rps"] > 5 and summary["goodput_steady_rps"] > 5
    assert set(summary["above_capacity"]) == {"goodput_rps", "goodput_steady_rps"}
    assert any(w.startswith("goodput ") and "measured on another run" in w for w in summary["warnings"])
    table = (tmp_path / "above.md").read_text()
    row = next(line for line in table.splitlines() if line.startswith("| goodput |"))
    assert row.endswith("% of 5.00; above capacity: capacity measured on another run) |")


# -- ports ---------------------------------------------------------------------------------------


def _two_free_ports() -> tuple[int, int]:
    first = bench.free_port()
    second = bench.free_port()
    while second == first:
        second = bench.free_port()
    return first, second


async def test_spawned_servers_listen_on_the_ports_chosen(tmp_path: Path) -> None:
    sim_port, sluice_port = _two_free_ports()
    args = _args(
        tmp_path,
        "--spawn-sim", "fast", "--sim-port", str(sim_port),
        "--spawn-sluice", "--sluice-port", str(sluice_port), "--rate", "5", "--duration", "0.5",
    )  # fmt: skip
    # Twice, as --policies spawns its entries in turn: the second pair binds the same ports again,
    # beside the connections the first left in TIME_WAIT.
    for entry in ("cap", "codel"):
        async with bench.targets(args, tmp_path, entry) as found:
            assert found.target == f"http://127.0.0.1:{sluice_port}"
            assert found.engine_metrics == f"http://127.0.0.1:{sim_port}/metrics"
            async with httpx.AsyncClient(timeout=5.0) as http:
                assert (await http.get(f"http://127.0.0.1:{sim_port}/v1/models")).status_code == 200
                assert (await http.get(f"http://127.0.0.1:{sluice_port}/readyz")).status_code == 200
            result = await bench.measure(args, found, bench._profile(args), policy=entry)
        assert result["summary"]["outcomes"]["ok"] > 0


def test_a_port_taken_is_refused_before_anything_starts(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    with socket.socket() as taken:
        taken.bind(("127.0.0.1", 0))
        taken.listen()
        port = str(taken.getsockname()[1])
        for flags in (("--sim-port", port), ("--spawn-sluice", "--sluice-port", port)):
            assert bench.run(_args(tmp_path, "--spawn-sim", "fast", *flags)) == 2
            assert f"port {port} on 127.0.0.1 is taken" in capsys.readouterr().err
    assert not list(tmp_path.glob("*.log"))


@pytest.mark.parametrize("value", ["0", "65536", "http"])
def test_a_port_is_a_number_from_1_to_65535(value: str) -> None:
    with pytest.raises(SystemExit):
        build_parser("bench").parse_args(["bench", "--spawn-sim", "fast", "--sim-port", value])


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
        ("--target", "http://127.0.0.1:9", "--sim-port", "8100"),  # no simulator to put there
        ("--spawn-sim", "fast", "--sluice-port", "8000"),  # no gateway either
        ("--spawn-sim", "fast", "--policies", "direct", "--sluice-port", "8000"),
        ("--spawn-sim", "fast", "--spawn-sluice", "--sim-port", "8100", "--sluice-port", "8100"),
    ],
)
def test_bad_command_lines_are_refused_before_anything_starts(tmp_path: Path, extra: tuple[str, ...]) -> None:
    assert bench.run(_args(tmp_path, *extra)) == 2
    assert not list(tmp_path.glob("*.log"))


# -- without the bench extra (tqdm, matplotlib) ----------------------------------------------------


def test_the_fleet_bench_does_not_import_the_bench_command_line() -> None:
    """No import cycle: the fleet bench uses the shared spawn and measure modules, and the bench
    command line imports the fleet bench, not the other way round."""
    code = "import sys, sluice.bench.fleet; print('sluice.bench.cli' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True, timeout=60)
    assert out.stdout.strip() == "False"


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
    assert measure.progress(12, "1/2 steady", disabled=False) is None
    assert capsys.readouterr().err == "1/2 steady: 12 requests\n"
    assert measure.progress(12, "off", disabled=True) is None
    assert capsys.readouterr().err == ""


def test_progress_is_a_bar_with_tqdm(capsys: pytest.CaptureFixture[str]) -> None:
    bar = measure.progress(3, "steady", disabled=False)
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


def test_fleet_is_a_bench_subcommand(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    args = build_parser("bench").parse_args(["bench", "fleet", "--kill", "nobody", "--out", str(tmp_path)])
    assert args.bench_command == "fleet"
    # bench's run hands it to sluice.bench.fleet, which refuses the command line before spawning anything.
    assert bench.run(args) == 2
    assert "sluice bench fleet: --kill nobody: no such engine" in capsys.readouterr().err
