"""overhead_gc's arithmetic (the collector's share, passes and mean pass between two readings)
and its load options."""

from __future__ import annotations

import pytest

from sluice.bench.overhead_gc import collector_figures, load_of, parse
from sluice.bench.overhead_load import Load


def test_the_collectors_share_is_its_cpu_over_the_gateways() -> None:
    before = {"passes": [10, 1, 0], "seconds": [0.01, 0.002, 0.0]}
    after = {"passes": [110, 11, 1], "seconds": [0.06, 0.022, 0.03]}  # 0.05 + 0.02 + 0.03 s
    share, passes, pause = collector_figures(before, after, cpu_s=2.0)
    assert share == pytest.approx(0.05)
    assert passes == (100, 10, 1)
    assert pause == pytest.approx((0.5, 2.0, 30.0))


def test_no_pass_and_no_cpu_give_zeros() -> None:
    same = {"passes": [3, 0, 0], "seconds": [0.1, 0.0, 0.0]}
    assert collector_figures(same, same, cpu_s=0.0) == (0.0, (0, 0, 0), (0.0, 0.0, 0.0))


def test_without_options_each_connection_sends_the_short_whole_answer() -> None:
    assert load_of(parse([])) == Load(32, 8, stream=False)


def test_tokens_and_stream_give_the_streamed_row() -> None:
    options = parse(["--tokens", "64", "--stream", "--connections", "16"])
    assert load_of(options) == Load(16, 64, stream=True)
