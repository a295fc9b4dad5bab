"""The prefix-routing bench on a tiny configuration: real ``sluice sim`` engines behind a real
``sluice serve``, the report's structure, and the engines' prefix-cache hits counted."""

from __future__ import annotations

import tomllib

from sluice.bench.prefix_routing import (
    MODES,
    EngineArgs,
    Workload,
    conversation_plan,
    gateway_config,
    modes_available,
    run_mode,
    table,
)

TINY = Workload(
    systems=1, system_tokens=200, doc_tokens=80, turn_tokens=10, turns=2, conversations=3, rate=20,
    think_s=0.0, max_tokens=4,
)  # fmt: skip


def test_the_plan_is_seeded_and_shares_system_prompts() -> None:
    systems, plan = conversation_plan(Workload(conversations=20, systems=3))
    again_systems, again = conversation_plan(Workload(conversations=20, systems=3))
    assert systems == again_systems and [c.first for c in plan] == [c.first for c in again]
    assert len(systems) == 3 and {c.system for c in plan} <= {0, 1, 2}
    assert all(len(c.later) == 3 for c in plan)
    starts = [c.start_s for c in plan]
    assert starts == sorted(starts)
    # The prompts are about as long as asked (four characters a token).
    assert 900 * 4 <= len(systems[0]) <= 1100 * 4


def test_gateway_config_is_valid_toml_with_the_modes_settings() -> None:
    engines = ["http://127.0.0.1:1", "http://127.0.0.1:2"]
    for mode in modes_available():
        config = tomllib.loads(gateway_config(mode, engines, 4, "sim"))
        assert [b["url"] for b in config["backends"]] == engines
        assert all(b["max_concurrency"] == 4 for b in config["backends"])
        for key, value in MODES[mode].items():
            assert config.get(key, value) == value


def test_a_tiny_run_counts_hits_and_reports_every_field() -> None:
    mode = "affinity" if "affinity" in modes_available() else "least-loaded"
    engines = EngineArgs(
        engines=2, preset="fast", slots=4, prefill_ms_per_token=0.01, prefix_cache_tokens=4096
    )
    row = run_mode(mode, TINY, engines, ttft_slo=30.0, timeout_s=30.0)
    assert row["mode"] == mode
    assert row["requests"] == 6 and row["ok"] == 6, row
    assert row["statuses"] == {"200": 6}
    # One system prompt, six requests on two engines: some engine sees it twice, a hit.
    assert row["prefix_cache_hits"] > 0
    assert row["prefix_cache_hits"] == sum(e["prefix_cache_hits"] for e in row["engines"])
    assert 0 < row["hit_rate"] <= 1
    assert sum(e["requests"] for e in row["engines"]) == 6
    for key in ("ttft_p50_s", "ttft_p90_s", "e2e_p50_s", "e2e_p90_s"):
        assert row[key] is not None and row[key] > 0
    assert row["ttft_p50_s"] <= row["ttft_p90_s"]
    assert row["good"] == 6 and row["goodput_rps"] > 0
    assert mode in table({"modes": [row]})
