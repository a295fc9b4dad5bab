"""When a run is too short to show what its table says: the rules behind a summary's ``warnings``.

A run is a transient: it starts on an idle engine and stops with a queue still in front of it. The
rules below say when the transient is most of what a run shows. The figures in the examples are the
article's engine (``--spawn-sim article``): 16 slots, a capacity of c = 5.5 req/s, a lone answer in
T = 2.1 s, clients that give up at τ = 15 s.

**Overload needs time to show** (:func:`overload_warning`). Offered λ > c req/s, the engine's queue
grows by λ - c requests a second. A request that finds q requests queued waits about q / c seconds
and then its own generation, so it is answered within τ while q ≤ Q = c·(τ - T). Until the queue
holds Q requests no client gives up, whatever stands in front of the engine: the engine alone
answers every request (only later), while a gateway that refuses what it could not serve in time
looks worse than no gateway, at the same goodput. The rule: the arrivals above capacity,
E = ∫ max(λ(t) - c, 0) dt over the run, must be at least :data:`OVERLOAD_QUEUES` = 2 such queues,
so that at least half of them arrive once the queue is full, where the engine alone fails and the
policies differ. At a steady rate that is a duration of at least 2·Q / (λ - c): 32 s at 10 req/s
(Q = 71), so a 10 s run fails it (it showed the engine alone answering 100 % and Sluice 58 %); the
article's 60 s pass, and so does its spike (10 s at 30 req/s: E = 245 ≥ 142). What matters is the
filling, not the end of the run: in a FIFO a request's fate depends only on what arrived before
it, so the queue a run leaves behind drains without changing an earlier outcome, and a run need
not last several client timeouts beyond this. T is the run's shortest answer (0 without one, which
only makes the rule stricter). Not checked without a capacity, nor when clients never give up (a
capacity run: overload then shows as latency alone).

**The window after the first answer needs many generations** (:func:`steady_window_warning`).
"Goodput after the first answer" counts the answers after the first one (at t1) until the end of
the arrivals (D), per second of D - t1. Answers come in waves: the first requests fill the batch
within a second or two and finish one generation later, together, and their replacements do the
same. Where the window's two ends cut the waves moves the count by up to about one batch, c·t1
answers (t1, the first answer, is about one generation), that is by up to t1 / (D - t1) of the
rate. The window opens on a whole wave, so a short one reads high. The rule: D - t1 ≥
:data:`STEADY_GENERATIONS` = 10 generations, within 10 %. The 10 s run: t1 = 2.65 s, a window of
7.35 s, up to 36 % (it read 108.8 % of capacity).

**A goodput above capacity says why** (:func:`above_capacity`). No engine answers faster than its
capacity for long, so a figure above it is an artefact of the measure or of the capacity, and the
table says which: the window after the first answer counts answers begun before it opened (rule
above); a capacity given with ``--capacity`` was measured on another run (runs of one load differ
by a few %); the simulator's formula is the rate with every slot busy, and the first generations,
on a batch still filling, take shorter steps.
"""

from __future__ import annotations

from dataclasses import dataclass

from sluice.bench.load import Profile

__all__ = [
    "ANOTHER_RUN",
    "ELSEWHERE",
    "FORMULA",
    "OVERLOAD_QUEUES",
    "STEADY_GENERATIONS",
    "WINDOW",
    "Reason",
    "above_capacity",
    "excess_arrivals",
    "overload_warning",
    "queue_that_times_out",
    "run_warnings",
    "steady_window_warning",
]

#: the arrivals above capacity must fill the queue this many times over (see the module docstring)
OVERLOAD_QUEUES = 2.0
#: the window after the first answer must last this many generations (the first answer's time)
STEADY_GENERATIONS = 10.0


def queue_that_times_out(capacity: float, client_timeout: float, generation_s: float = 0.0) -> float:
    """Q = c·(τ - T): the queue, in requests, behind which a new request is no longer answered in time."""
    return capacity * max(client_timeout - generation_s, 0.0)


def _area_above(start_rate: float, end_rate: float, length: float, capacity: float) -> float:
    """∫ max(rate - capacity, 0) over ``length`` seconds of a rate going linearly from start to end."""
    a, b = start_rate - capacity, end_rate - capacity
    if length <= 0 or (a <= 0 and b <= 0):
        return 0.0
    if a >= 0 and b >= 0:
        return (a + b) / 2 * length
    # It crosses the capacity once: only the triangle above it counts.
    top = max(a, b)
    return top / 2 * length * top / (top - min(a, b))


def excess_arrivals(profile: Profile, capacity: float) -> float:
    """E: the mean number of arrivals above ``capacity`` over the run (the integral of the excess rate)."""
    d = profile.duration
    if profile.kind == "ramp":
        return _area_above(profile.rate, profile.to, d, capacity)
    if profile.kind == "spike":
        start = min(profile.spike_at, d)
        end = min(profile.spike_at + profile.spike_for, d)
        inside = _area_above(profile.peak, profile.peak, end - start, capacity)
        return inside + _area_above(profile.rate, profile.rate, d - (end - start), capacity)
    return _area_above(profile.rate, profile.rate, d, capacity)


def _advice(profile: Profile, capacity: float, queue: float) -> str:
    need = OVERLOAD_QUEUES * queue
    if profile.kind == "steady":
        return (
            f"at {profile.rate:g} req/s, run at least {need / (profile.rate - capacity):.0f} s (--duration)"
        )
    if profile.kind == "spike" and profile.rate <= capacity < profile.peak:
        spike = need / (profile.peak - capacity)
        return f"at a peak of {profile.peak:g} req/s, a spike of at least {spike:.1f} s (--spike-for)"
    return "offer more above capacity, or for longer"


def overload_warning(
    profile: Profile,
    capacity: float | None,
    client_timeout: float | None,
    generation_s: float = 0.0,
) -> str | None:
    """Why the run cannot show overload, or None if it can (or offers none, or the rule cannot tell)."""
    if not capacity or not client_timeout:
        return None
    excess = excess_arrivals(profile, capacity)
    queue = queue_that_times_out(capacity, client_timeout, generation_s)
    if excess <= 0 or excess >= OVERLOAD_QUEUES * queue:
        return None
    return (
        f"too short to show overload: {excess:.0f} requests are offered above the capacity of "
        f"{capacity:.2f} req/s, fewer than {OVERLOAD_QUEUES:g} times the {queue:.0f} that the engine's "
        f"queue holds before a new request waits past the {client_timeout:g} s client timeout; until "
        "then no client gives up, with or without a gateway (the engine alone answers everyone, only "
        f"later, and a gateway that refuses early looks worse); {_advice(profile, capacity, queue)}"
    )


def steady_window_warning(first_answer_s: float | None, duration: float) -> str | None:
    """Why "goodput after the first answer" is unreliable on this run, or None if it is not."""
    if first_answer_s is None:
        return None  # no answer at all: the table says so
    window = duration - first_answer_s
    if window <= 0:
        return (
            f"no answer came before the end of the arrivals ({duration:g} s): goodput after the first "
            "answer says nothing"
        )
    generations = window / first_answer_s if first_answer_s > 0 else float("inf")
    if generations >= STEADY_GENERATIONS:
        return None
    return (
        f"goodput after the first answer is measured over {window:.1f} s, {generations:.1f} generations "
        f"(the first answer came at {first_answer_s:.2f} s): answers come in waves of a whole batch, "
        f"and where the window cuts them moves this rate by up to about {100 / generations:.0f} %; "
        f"at least {(STEADY_GENERATIONS + 1) * first_answer_s:.0f} s of arrivals (--duration) keep it "
        f"within {100 / STEADY_GENERATIONS:.0f} %"
    )


@dataclass(frozen=True, slots=True)
class Reason:
    """Why a goodput can read above capacity.

    ``short``: a few words, for the table's cell; ``long``: the explanation, for the warnings.
    """

    short: str
    long: str


WINDOW = Reason(
    "answers begun before the window",
    "its window opens at the first answer, when the whole batch has been generating since the first "
    "requests, so it counts answers begun before it opened",
)
ANOTHER_RUN = Reason(
    "capacity measured on another run",
    "the capacity given with --capacity was measured on another run, and runs of one load differ by a few %",
)
FORMULA = Reason(
    "the formula's full batch",
    "the simulator's formula is the rate with every slot busy, and the first generations, on a batch "
    "still filling, take shorter steps",
)
ELSEWHERE = Reason("capacity not measured on this run", "the capacity was not measured on this run")


def _capacity_reason(capacity_source: str | None) -> Reason:
    if capacity_source == "--capacity":
        return ANOTHER_RUN
    if capacity_source and capacity_source.startswith("simulator formula"):
        return FORMULA
    return ELSEWHERE


def above_capacity(
    goodput_rps: float,
    goodput_steady_rps: float,
    capacity: float | None,
    capacity_source: str | None,
) -> dict[str, list[Reason]]:
    """For each goodput above ``capacity`` (by its summary key), the reasons it can be."""
    if not capacity:
        return {}
    reasons: dict[str, list[Reason]] = {}
    if goodput_rps > capacity:
        reasons["goodput_rps"] = [_capacity_reason(capacity_source)]
    if goodput_steady_rps > capacity:
        reasons["goodput_steady_rps"] = [WINDOW, _capacity_reason(capacity_source)]
    return reasons


_GOODPUT_NAMES = {"goodput_rps": "goodput", "goodput_steady_rps": "goodput after the first answer"}


def run_warnings(
    *,
    profile: Profile | None,
    capacity: float | None,
    capacity_source: str | None,
    client_timeout: float | None,
    first_answer_s: float | None,
    shortest_answer_s: float | None,
    goodputs: dict[str, float],
    reasons: dict[str, list[Reason]],
) -> list[str]:
    """Every warning a run's summary carries, in the order of the rules above.

    ``goodputs`` holds the summary's ``goodput_rps`` and ``goodput_steady_rps``; ``reasons`` is
    :func:`above_capacity` of them.
    """
    out: list[str] = []
    if profile is not None:
        overload = overload_warning(profile, capacity, client_timeout, shortest_answer_s or 0.0)
        if overload:
            out.append(overload)
        window = steady_window_warning(first_answer_s, profile.duration)
        if window:
            out.append(window)
    for key, why in reasons.items():
        value = goodputs[key]
        pct = 100.0 * value / capacity if capacity else 0.0
        out.append(
            f"{_GOODPUT_NAMES[key]} {value:.2f} req/s is {pct:.1f} % of the capacity, {capacity:.2f} "
            f"req/s from {capacity_source or 'the command line'}; above it because "
            + "; and ".join(r.long for r in why)
        )
    return out
