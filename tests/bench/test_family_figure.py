"""The engine family's figure and table (bench/family_figure.py): one run gives both."""

from __future__ import annotations

import math
from pathlib import Path

import pytest

from sluice.bench.family_figure import CHOSEN_ON, MEASURES, main, measure, table


def test_a_tiny_family_gives_a_row_per_policy_and_measure() -> None:
    """Seed 19 (the defaults were chosen on it) and seed 20 (held out), two policies: every
    measure's row has the median, the worst and the engines at target of both, the held out's of one."""
    figures = measure(range(19, 21), ["fifo", "codel"])
    assert [(f.seed, f.policy) for f in figures] == [(19, "fifo"), (19, "codel"), (20, "fifo"), (20, "codel")]
    assert [f.held_out for f in figures] == [False, False, True, True]
    assert 19 in CHOSEN_ON and 20 not in CHOSEN_ON
    for f in figures:
        assert 0 < f.spike_pct < 200 and 0 < f.steady_pct < 200 and 0 < f.steady_p99 <= 15.0
        assert f.retries_all >= f.retries_10 > 0  # every refused client retrying is the wave
        assert not math.isnan(f.retry_all_pct)
    lines = table(figures).splitlines()
    rows = lines[2:]
    assert len(rows) == 2 * (len(MEASURES) + 1)
    assert all(line.count("|") == 7 for line in lines)
    measure_rows = [r for r in rows if "broken promises" not in r]
    assert all(" of 2" in r.split("|")[5] and r.split("|")[6].strip().endswith("of 1") for r in measure_rows)
    assert {r.split("|")[1].strip() for r in rows} == {"fifo", "codel"}


def test_the_command_writes_the_png_and_prints_the_table(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    pytest.importorskip("matplotlib")
    out = tmp_path / "img" / "family.png"
    main(["--seeds", "2", "--first-seed", "19", "--policy", "codel", "--out", str(out)])
    assert out.read_bytes()[:8] == b"\x89PNG\r\n\x1a\n"
    printed = capsys.readouterr()
    assert "| codel | spike goodput, % of capacity (≥ 73 %) |" in printed.out
    assert "seed 20" in printed.err  # progress on stderr
