"""The dashboard's history: its windows' running sums say what summing the window's ticks again
says, to the bit, whatever the ticks grew by (whole numbers, fractions, NaN, huge values) and
however its clock moves; and the sample keys a report's series are read under."""

from __future__ import annotations

import math
import random
from typing import Any

from sluice.dashboard import History, SampleKey, Tick, samples_of

KEYS: list[SampleKey] = [
    ("sluice_jobs_total", (("model", "m"), ("status", "succeeded"))),
    ("sluice_queue_wait_seconds_bucket", (("le", "0.1"), ("model", "m"))),
    ("sluice_admissions_total", (("code", "queue_full"), ("outcome", "refused"))),
    ("x_total", ()),
]


def summed(ticks: list[Tick], seconds: float, end: float) -> tuple[dict[SampleKey, float], float]:
    """The window as defined: the ticks newest first until one at or before ``end - seconds``."""
    total: dict[SampleKey, float] = {}
    span = 0.0
    for tick in reversed(ticks):
        if tick.at <= end - seconds:
            break
        span += tick.span_s
        for key, value in tick.grew.items():
            total[key] = total.get(key, 0.0) + value
    return total, span


def same(a: dict[SampleKey, float], b: dict[SampleKey, float]) -> bool:
    return a.keys() == b.keys() and all(
        (math.isnan(a[k]) and math.isnan(b[k])) or a[k].hex() == b[k].hex() for k in a
    )


def grow(rng: random.Random, odd: bool) -> dict[SampleKey, float]:
    out: dict[SampleKey, float] = {}
    for key in rng.sample(KEYS, rng.randrange(len(KEYS) + 1)):
        roll = rng.random()
        if odd and roll < 0.1:
            out[key] = rng.uniform(0, 3)  # a fraction
        elif odd and roll < 0.12:
            out[key] = math.nan
        elif odd and roll < 0.14:
            out[key] = 2.0**60
        else:
            out[key] = float(rng.randrange(1, 50))
    return out


def test_windows_say_what_summing_the_ticks_again_says() -> None:
    rng = random.Random(7)
    for odd in (False, True):
        h = History(keep=40)
        at = 1_000.0
        for _ in range(400):
            # mostly a second apart, sometimes faster or slower, now and then a clock stepped back
            roll = rng.random()
            at += -5.0 if roll < 0.03 else rng.choice((0.5, 1.0, 1.0, 1.0, 2.5))
            tick = h.advance(at, {})
            tick.grew.update(grow(rng, odd))
            for seconds in (3.0, 7.5, 30.0, 100.0):
                got, span = h.window(seconds)
                want, want_span = summed(list(h.ticks), seconds, at)
                assert same(got, want), (seconds, got, want)
                assert span.hex() == want_span.hex()
            # a window at another time is summed as defined too
            got, span = h.window(7.5, now=at - 2.0)
            assert same(got, summed(list(h.ticks), 7.5, at - 2.0)[0])


def report(samples: list[Any]) -> dict[str, Any]:
    return {"samples": samples}


def test_sample_keys_are_made_once_per_series() -> None:
    labels = {"status": "succeeded", "model": "m"}
    first = samples_of(report([["sluice_jobs_total", labels, 3]]))
    again = samples_of(report([["sluice_jobs_total", dict(labels), 4.0]]))
    key = ("sluice_jobs_total", (("model", "m"), ("status", "succeeded")))
    assert first == {key: 3.0} and again == {key: 4.0}
    assert next(iter(first)) is next(iter(again))  # the same key object
    # labels that are not strings are made as they come: 1 and 1.0 are equal, their str is not
    ints = samples_of(report([["n_total", {"a": 1}, 1], ["n_total", {"a": 1.0}, 2]]))
    assert ints == {("n_total", (("a", "1"),)): 1.0, ("n_total", (("a", "1.0"),)): 2.0}
    # a histogram's _sum is not read; malformed entries are skipped; a list label still reads
    assert samples_of(report([["h_sum", {}, 0.5], ["bad"], ["l_total", {"a": [1]}, 1]])) == {
        ("l_total", (("a", "[1]"),)): 1.0
    }
