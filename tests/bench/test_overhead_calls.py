"""overhead_calls' arithmetic: a phase's calls net of what the gateway does idle around it."""

from __future__ import annotations

import pytest

from sluice.bench.overhead_calls import net_of_idle
from sluice.bench.overhead_profile import function_name


def test_a_phase_is_counted_net_of_the_idle_rate_around_it() -> None:
    """100 calls a second idle (2 s before, 2 s after), a 3-s phase of 600 requests at 12 calls
    each: 12 a request once the 300 idle calls of those 3 s are taken out."""
    marks = [
        (1_000, {"f": 10, "tick": 100}, 10.0),
        (1_200, {"f": 10, "tick": 300}, 12.0),  # idle: 200 calls in 2 s, all ticks
        (1_200 + 300 + 600 * 12, {"f": 10 + 600 * 12, "tick": 600}, 15.0),
        (1_200 + 300 + 600 * 12 + 200, {"f": 10 + 600 * 12, "tick": 800}, 17.0),
    ]
    calls = net_of_idle(marks, 600)
    assert calls.idle_rate == pytest.approx(100.0)
    assert calls.per_request == pytest.approx(12.0)
    assert calls.by_function == pytest.approx({"f": 12.0, "tick": 0.0})


def test_without_per_function_counts_there_are_none() -> None:
    marks = [(0, {}, 0.0), (0, {}, 1.0), (500, {}, 2.0), (500, {}, 3.0)]
    calls = net_of_idle(marks, 50)
    assert (calls.per_request, calls.idle_rate, calls.by_function) == (10.0, 0.0, {})


def test_functions_are_named_by_where_they_are() -> None:
    assert function_name(net_of_idle.__code__).startswith("net_of_idle (overhead_calls.py:")
    assert function_name(len) == "len (C)"
