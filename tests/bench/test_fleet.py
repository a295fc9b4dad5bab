"""``sluice bench fleet``: the fleet's engines and arms from the command line, the gateway's config, and
tiny real runs (two simulators, a few seconds) asserting the report's structure and that every request
has an outcome, nothing lost, also with one engine SIGKILLed mid-run. Never timings."""

from __future__ import annotations

import argparse
import json
from pathlib import Path
from typing import Any

import pytest

from sluice.bench import fleet, fleet_watch
from sluice.bench.load import PROMPT, parse_prometheus
from sluice.cli import build_parser
from sluice.config import load_settings
from sluice.sim.model import capacity_rps, estimate_chat_tokens, preset

ENGINES = ["--engine", "a=fast", "--engine", "b=fast,max-num-seqs=4,base-step-ms=1"]


def test_an_engine_is_a_preset_and_flags_that_override_it() -> None:
    spec = fleet.parse_engine("s64=article,max-num-seqs=64,base-step-ms=40,per-seq-ms=0.5")
    params = spec.params()
    assert (params.max_num_seqs, params.base_step_s, params.per_seq_s) == (64, 0.04, 0.0005)
    assert spec.batch == 64
    assert spec.sim_args() == ["--max-num-seqs", "64", "--base-step-ms", "40", "--per-seq-ms", "0.5"]
    expected = capacity_rps(params, 128, estimate_chat_tokens([PROMPT]))
    assert spec.capacity(128) == pytest.approx(expected)
    assert fleet.parse_engine("s16=article").params() == preset("article")


@pytest.mark.parametrize(
    ("text", "says"),
    [
        ("s4", "NAME=PRESET"),
        ("s4=nope", "unknown preset"),
        ("s4=article,max-num-seqs", "is not one of"),
        ("s4=article,gpu=1", "is not one of"),
        ("s4=article,max-num-seqs=many", "takes a number"),
        ("s4=article,max-num-seqs=0", "at least 1"),
    ],
)
def test_a_bad_engine_is_refused_before_anything_starts(text: str, says: str) -> None:
    with pytest.raises(ValueError, match=says):
        fleet.parse_engine(text)


def test_the_arms_are_adaptive_the_fixed_sweep_then_the_peers() -> None:
    engines = [fleet.parse_engine(t) for t in fleet.DEFAULT_FLEET]
    arms = fleet.plan_arms(engines, ["adaptive", "fixed", "least-busy"], [0.5, 1.0], 1.0)
    assert [a.label for a in arms] == ["adaptive", "fixed-x0.5", "fixed-x1", "least-busy"]
    assert arms[1].limits == {"s4": 2, "s16": 8, "s64": 32}
    assert arms[2].limits == arms[3].limits == {"s4": 4, "s16": 16, "s64": 64}
    assert [a.sluice for a in arms] == [True, True, True, False]


def test_a_fixed_arm_is_a_config_the_gateway_loads(tmp_path: Path) -> None:
    arm = fleet.Arm("fixed-x1", "fixed", {"a": 16, "b": 4})
    path = tmp_path / "fixed.toml"
    path.write_text(fleet.sluice_config(arm, {"a": "http://127.0.0.1:1", "b": "http://127.0.0.1:2"}, "sim"))
    settings = load_settings(path)
    got = {b.name: (b.url, b.max_concurrency, b.models) for b in settings.backends}
    assert got == {"a": ("http://127.0.0.1:1", 16, ["sim"]), "b": ("http://127.0.0.1:2", 4, ["sim"])}
    for backend in settings.backends:
        assert getattr(backend, "adaptive", False) is False


def test_the_least_loaded_arm_is_the_fixed_arm_with_only_the_routing_changed(tmp_path: Path) -> None:
    engines = [fleet.parse_engine(t) for t in fleet.DEFAULT_FLEET]
    fixed, least = fleet.plan_arms(engines, ["fixed", "least-loaded"], [1.0], 1.0)
    assert least.label == "least-loaded" and least.sluice and least.limits == fixed.limits
    urls = {name: f"http://127.0.0.1:{i + 1}" for i, name in enumerate(fixed.limits)}
    settings = {}
    for arm in (fixed, least):
        path = tmp_path / f"{arm.label}.toml"
        path.write_text(fleet.sluice_config(arm, urls, "sim"))
        settings[arm.label] = load_settings(path)
    assert settings["fixed-x1"].routing == "predicted"
    assert settings["least-loaded"].routing == "least_loaded"
    assert settings["least-loaded"].backends == settings["fixed-x1"].backends


def test_the_adaptive_arm_is_one_pool_with_no_limit_set(tmp_path: Path) -> None:
    arm = fleet.Arm("adaptive", "adaptive", {"a": 16, "b": 4})
    path = tmp_path / "adaptive.toml"
    path.write_text(fleet.sluice_config(arm, {"a": "http://127.0.0.1:1", "b": "http://127.0.0.1:2"}, "sim"))
    settings = load_settings(path)
    assert not settings.backends and len(settings.pools) == 1
    pool = settings.pools[0]
    assert pool.engines == ["http://127.0.0.1:1", "http://127.0.0.1:2"] and pool.models == ["sim"]
    assert pool.adaptive is True and pool.max_concurrency is None
    assert settings.prefix_affinity is False


def test_an_engine_is_read_whichever_engine_it_is() -> None:
    sim = fleet_watch._engine_values(
        parse_prometheus(
            'vllm:num_requests_running{model_name="sim"} 3\nvllm:num_requests_waiting{model_name="sim"} 1\n'
            'vllm:request_success_total{model_name="sim",finished_reason="length"} 7\n'
            'vllm:generation_tokens_total{model_name="sim"} 900\n'
            'sim:wasted_generation_tokens_total{model_name="sim"} 5\n'
        )
    )
    assert sim == {"running": 3, "waiting": 1, "finished": 7, "generated": 900, "wasted": 5}
    # llama-server counts neither finished requests nor wasted tokens: those are absent, not NaN
    # (a result file is strict JSON).
    llama = fleet_watch._engine_values(
        parse_prometheus(
            "llamacpp:requests_processing 2\nllamacpp:requests_deferred 4\n"
            "llamacpp:tokens_predicted_total 50\n"
        )
    )
    assert llama == {"running": 2, "waiting": 4, "generated": 50}
    assert fleet_watch._engine_values({"vllm:num_requests_running": float("nan")}) == {}


def _args(tmp_path: Path, *extra: str) -> argparse.Namespace:
    argv = ["bench", "fleet", *ENGINES, "--out", str(tmp_path), "--no-progress", "--client-timeout", "10"]
    return build_parser("bench").parse_args([*argv, *extra])


def _check_arm(result: dict[str, Any], engines: set[str]) -> None:
    records = result["records"]
    summary = result["summary"]
    # Every request has exactly one outcome, and the counts add up: nothing lost, nothing left over.
    assert records and all(r["outcome"] in ("ok", "refused", "timeout", "error") for r in records)
    assert sorted(r["index"] for r in records) == list(range(len(records)))
    assert sum(summary["outcomes"].values()) == summary["offered"] == len(records)
    assert summary["outcomes"]["ok"] > 0
    assert summary["lost"] == 0
    assert summary["wasted_share"] is not None
    got = result["fleet"]
    assert set(got["engines"]) == engines
    shares = [e["share"] for e in got["engines"].values()]
    assert sum(shares) == pytest.approx(1.0)
    assert got["samples"] and all("t" in s for s in got["samples"])


async def test_a_tiny_fleet_run_reports_every_arm(tmp_path: Path) -> None:
    args = _args(tmp_path, "--arms", "fixed,round-robin,least-busy", "--fixed-scales", "1")
    args.rate, args.duration = 20.0, 1.5
    args.out.mkdir(parents=True, exist_ok=True)
    profile, results = await fleet._main(args)
    assert [r["label"] for r in results] == ["fixed-x1", "round-robin", "least-busy"]
    for result in results:
        _check_arm(result, {"a", "b"})
        finished = sum(e["finished"] for e in result["fleet"]["engines"].values())
        assert finished >= result["summary"]["outcomes"]["ok"]
    # Same arrivals in every arm.
    assert len({json.dumps(r["arrivals"]) for r in results}) == 1
    fleet._report(args, profile, results)
    table = (tmp_path / "fleet.md").read_text()
    for label in ("| fixed-x1 |", "| round-robin |", "| least-busy |", "share a / b"):
        assert label in table
    assert "best fixed" not in table  # one fixed limit is no sweep
    rows = [fleet.arm_row(r) for r in results]
    sweep = [rows[0], {**rows[0], "label": "fixed-x2", "goodput_rps": rows[0]["goodput_rps"] + 1}]
    assert "| **fixed-x2** (best fixed) |" in fleet.fleet_table(sweep)
    rows = json.loads((tmp_path / "fleet.json").read_text())["rows"]
    assert [r["label"] for r in rows] == ["fixed-x1", "round-robin", "least-busy"]
    assert rows[1]["limits"] == {"a": 16, "b": 4}
    for name in ("fleet.png", "fleet-time.png", "fleet-engines.png", "fixed-x1.json", "fixed-x1.toml"):
        assert (tmp_path / name).stat().st_size > 0


async def test_an_engine_killed_mid_run_leaves_no_request_without_an_outcome(tmp_path: Path) -> None:
    # Engines slow enough (about 0.26 s an answer) that requests are in flight on b when it dies.
    slow = ["--engine", "a=fast,base-step-ms=2", "--engine", "b=fast,base-step-ms=2"]
    run = [
        "--arms",
        "fixed,least-busy",
        "--fixed-scales",
        "1",
        "--duration",
        "3",
        "--rate",
        "20",
        "--kill",
        "b",
    ]
    args = _args(tmp_path, *run)
    args.engine = slow[1::2]
    args.out.mkdir(parents=True, exist_ok=True)
    _profile, results = await fleet._main(args)
    for result in results:
        _check_arm(result, {"a", "b"})
        got = result["fleet"]
        assert got["killed"] == "b" and got["killed_at_s"] >= 1.5
        assert got["engines"]["b"]["killed"] is True
        # After the kill, b answers no more scrapes; a does.
        after = [s for s in got["samples"] if s["t"] > got["killed_at_s"] + 0.5]
        assert after and all("b" not in s and "a" in s for s in after)
        row = fleet.arm_row(result)
        assert row["kill"] is not None and row["kill"]["engine"] == "b"
        assert sum(row["kill"]["outcomes"].values()) == row["kill"]["in_flight"]
    assert "SIGKILLed" in fleet.fleet_table([fleet.arm_row(r) for r in results])


def test_bad_arms_are_refused_with_a_message(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    for extra, says in (
        (["--arms", "fixed,bogus"], "--arms takes"),
        (["--kill", "nobody"], "no such engine"),
        (["--fixed-scales", "0"], "positive"),
        (["--engine", "a=fast", "--engine", "a=article"], "share a name"),
    ):
        args = _args(tmp_path, *extra)
        assert fleet.run(args) == 2
        assert says in capsys.readouterr().err
