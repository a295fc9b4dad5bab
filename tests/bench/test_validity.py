"""The rules that warn when a run is too short to show what its table says (sluice.bench.validity),
on the article's figures: capacity 5.5 req/s, a lone answer in 2.1 s, clients that give up at 15 s."""

from __future__ import annotations

import pytest

from sluice.bench.load import Profile, Record
from sluice.bench.report import goodput_after_first_answer, markdown, summarize
from sluice.bench.validity import (
    ANOTHER_RUN,
    ELSEWHERE,
    FORMULA,
    OVERLOAD_QUEUES,
    STEADY_GENERATIONS,
    WINDOW,
    above_capacity,
    excess_arrivals,
    overload_warning,
    queue_that_times_out,
    steady_window_warning,
)

CAPACITY, LONE, TIMEOUT = 5.5, 2.1, 15.0


def test_the_queue_that_times_out_is_the_work_left_in_the_timeout() -> None:
    assert queue_that_times_out(CAPACITY, TIMEOUT, LONE) == pytest.approx(5.5 * 12.9)
    assert queue_that_times_out(CAPACITY, TIMEOUT) == pytest.approx(82.5)
    assert queue_that_times_out(CAPACITY, 1.0, 2.0) == 0.0  # every request times out at once


@pytest.mark.parametrize(
    ("profile", "excess"),
    [
        (Profile("steady", rate=10, duration=10), 45.0),
        (Profile("steady", rate=5, duration=60), 0.0),
        (Profile("spike", rate=3, peak=30, spike_at=20, spike_for=10, duration=60), 245.0),
        (Profile("spike", rate=3, peak=30, spike_at=55, spike_for=10, duration=60), 5 * 24.5),  # cut at 60 s
        (Profile("spike", rate=7.5, peak=30, spike_at=20, spike_for=10, duration=60), 245.0 + 2.0 * 50),
        (Profile("ramp", rate=0.5, to=10.5, duration=10), 0.5 * 5 * 5),  # crosses 5.5 halfway
        (Profile("ramp", rate=10.5, to=0.5, duration=10), 0.5 * 5 * 5),
        (Profile("ramp", rate=7.5, to=9.5, duration=10), 3.0 * 10),
    ],
)
def test_excess_arrivals_integrate_the_rate_above_capacity(profile: Profile, excess: float) -> None:
    assert excess_arrivals(profile, CAPACITY) == pytest.approx(excess)


def test_a_ten_second_overload_is_too_short_and_a_minute_is_not() -> None:
    short = overload_warning(Profile("steady", rate=10, duration=10), CAPACITY, TIMEOUT, LONE)
    assert short is not None and short.startswith("too short to show overload: 45 requests")
    # 2 queues of 5.5 * 12.9 requests, filled at 4.5 a second
    assert "run at least 32 s (--duration)" in short
    assert overload_warning(Profile("steady", rate=10, duration=60), CAPACITY, TIMEOUT, LONE) is None
    spike = Profile("spike", rate=3, peak=30, spike_at=20, spike_for=10, duration=60)
    assert overload_warning(spike, CAPACITY, TIMEOUT, LONE) is None
    brief = Profile("spike", rate=3, peak=30, spike_at=20, spike_for=2, duration=60)
    warning = overload_warning(brief, CAPACITY, TIMEOUT, LONE)
    assert warning is not None and "a spike of at least 5.8 s (--spike-for)" in warning


def test_the_overload_rule_at_its_boundary() -> None:
    # Without an answer's time: Q = 82.5, so the steady run needs 2 * 82.5 / 4.5 = 36.67 s.
    need = OVERLOAD_QUEUES * 82.5 / 4.5
    assert overload_warning(Profile("steady", rate=10, duration=need - 0.01), CAPACITY, TIMEOUT) is not None
    assert overload_warning(Profile("steady", rate=10, duration=need + 0.01), CAPACITY, TIMEOUT) is None


def test_the_overload_rule_stays_silent_when_it_cannot_tell_or_there_is_none() -> None:
    short = Profile("steady", rate=10, duration=10)
    assert overload_warning(short, None, TIMEOUT) is None  # capacity unknown
    assert overload_warning(short, CAPACITY, None) is None  # clients never give up: a capacity run
    assert overload_warning(Profile("steady", rate=5, duration=10), CAPACITY, TIMEOUT) is None
    ramp = overload_warning(Profile("ramp", rate=1, to=12, duration=10), CAPACITY, TIMEOUT)
    assert ramp is not None and ramp.endswith("offer more above capacity, or for longer")


def test_the_window_after_the_first_answer_needs_ten_generations() -> None:
    warning = steady_window_warning(2.65, 10.0)
    assert warning is not None and "over 7.3 s, 2.8 generations" in warning
    assert "by up to about 36 %" in warning and "at least 29 s of arrivals" in warning
    assert steady_window_warning(2.65, 60.0) is None
    assert steady_window_warning(1.0, 1.0 + STEADY_GENERATIONS) is None
    assert steady_window_warning(1.0, 0.99 + STEADY_GENERATIONS) is not None
    assert steady_window_warning(None, 10.0) is None  # no answer at all: the table says so
    late = steady_window_warning(11.0, 10.0)
    assert late is not None and late.startswith("no answer came before the end of the arrivals")


def test_a_goodput_above_capacity_gets_its_reasons() -> None:
    assert above_capacity(5.0, 5.4, CAPACITY, "--capacity") == {}
    assert above_capacity(9.0, 9.0, None, None) == {}
    measured = above_capacity(5.6, 5.8, CAPACITY, "--capacity")
    assert measured == {"goodput_rps": [ANOTHER_RUN], "goodput_steady_rps": [WINDOW, ANOTHER_RUN]}
    formula = above_capacity(5.0, 5.8, CAPACITY, "simulator formula (preset article)")
    assert formula == {"goodput_steady_rps": [WINDOW, FORMULA]}
    assert above_capacity(5.6, 5.0, CAPACITY, None) == {"goodput_rps": [ELSEWHERE]}


# -- in the summary and the table ----------------------------------------------------------------


def _answers(times: list[float]) -> list[Record]:
    return [
        Record(index=i, scheduled_s=t - 1, sent_s=t - 1, ended_s=t, latency_s=1.0, outcome="ok", status=200)
        for i, t in enumerate(times)
    ]


def test_the_answer_that_opens_the_window_is_not_counted_in_it() -> None:
    # Answers at 1, 2, ..., 10 s: one a second from the first one on, not 10 in 9 s.
    records = _answers([float(t) for t in range(1, 11)])
    assert goodput_after_first_answer(records, 10.0) == pytest.approx(1.0)
    assert goodput_after_first_answer(records, 0.5) == 0.0
    assert goodput_after_first_answer([], 10.0) == 0.0


def test_a_short_run_says_so_in_its_summary_and_its_table() -> None:
    # Waves of 16 answers, one generation (2.9 s) apart: the article's engine, saturated for 10 s.
    times = [2.65 + 2.9 * wave + 0.1 * i for wave in range(3) for i in range(16)]
    records = _answers([t for t in times if t <= 10.0])
    profile = Profile("steady", rate=10, duration=10)
    s = summarize(
        records,
        duration=10.0,
        capacity=CAPACITY,
        capacity_source="simulator formula (preset article)",
        profile=profile,
        client_timeout=TIMEOUT,
    )
    assert s["goodput_steady_rps"] > CAPACITY
    assert s["above_capacity"] == {
        "goodput_steady_rps": "answers begun before the window, the formula's full batch"
    }
    warnings = s["warnings"]
    assert len(warnings) == 3
    assert warnings[0].startswith("too short to show overload")
    assert warnings[1].startswith("goodput after the first answer is measured over 7.3 s")
    assert warnings[2].startswith(
        "goodput after the first answer 6.39 req/s is 116.3 % of the capacity, 5.50 req/s from "
        "simulator formula (preset article); above it because its window opens at the first answer"
    )
    config = {
        "mode": "direct",
        "target": "spawned",
        "profile_text": profile.describe(),
        "seed": 1,
        "client_timeout": TIMEOUT,
        "max_tokens": 128,
    }
    table = markdown([{"label": "d10", "summary": s, "config": config}])
    assert "(116.3 %; above capacity: answers begun before the window, the formula's full batch) |" in table
    assert "\nWarnings:\n\n- **d10**: too short to show overload" in table
    assert table.count("- **d10**: ") == 1 + 3  # the run's line, then its warnings


def test_a_long_run_carries_no_warning() -> None:
    records = _answers([2.0 + i / 5.0 for i in range(290)])  # 5 answers/s from 2 s to 60 s
    s = summarize(
        records,
        duration=60.0,
        capacity=CAPACITY,
        capacity_source="--capacity",
        profile=Profile("steady", rate=10, duration=60),
        client_timeout=TIMEOUT,
    )
    assert s["warnings"] == [] and s["above_capacity"] == {}
    assert "Warnings:" not in markdown([{"label": "x", "summary": s, "config": _config()}])


def _config() -> dict[str, object]:
    return {
        "mode": "direct",
        "target": "t",
        "profile_text": "steady",
        "seed": 1,
        "client_timeout": 15.0,
        "max_tokens": 128,
    }
