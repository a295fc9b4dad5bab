"""The dashboard tick's call count (bench/dashboard_tick.py): the tick it counts is a whole one,
whose snapshot reports the load recorded before it."""

from __future__ import annotations

import asyncio

from sluice.bench.dashboard_tick import _one


def test_the_counted_tick_reports_the_load_recorded() -> None:
    calls, top, snap = asyncio.run(_one(10, 20, ["m", "n"], 2))
    rates = snap["rates"]
    # 10 jobs a second per model admitted, finished with 8 tokens each, a tenth as many refused
    assert rates["admitted"] == 20.0 and rates["goodput"] == 20.0 and rates["tokens"] == 160.0
    assert rates["refused"] == 2.0
    assert [m["name"] for m in snap["models"]] == ["m", "n"]
    assert len(top) == 2 and calls >= sum(n for _, n in top) > 0
    idle_calls, _, idle = asyncio.run(_one(0, 20, ["m", "n"], 0))
    assert idle["rates"]["admitted"] == 0.0 and 0 < idle_calls < calls
