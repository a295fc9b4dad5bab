"""What any admission could get in the spike: a ceiling on goodput, engine by engine (issue 18).

codel's spike goodput misses 73 % of capacity on some engines of the family
(:func:`sluice.bench.engine_family.draw_engine`). Whether 73 % is there to be had on those engines
depends on the engine and on the arrivals, not on the rule; this module bounds it, on the very
trace the policy model runs (:func:`sluice.bench.policy_model.run`: the same arrivals, prompts and
answers), every client trying once.

Two figures bracket the best admission:

- **The ceiling** (an upper bound, exact for its relaxation): the engine as one fluid server
  of ``R`` tokens a second, ``R`` its decoding rate in a full batch (``slots / (step0 + step1 ·
  slots)``, the most tokens a second any batch can decode: a step of ``b`` sequences takes at
  least ``b / R``), prefill free, the KV cache never short, and each job's answer tokens done
  within ``[arrival, min(arrival + patience, end of run)]``. Any schedule of the real engine is one
  of this server (each step's tokens fit in the step at rate ``R``), so the most jobs this server
  can finish in their windows bounds every admission policy's goodput. With a patience the same for
  every client, windows are agreeable (a later arrival never has an earlier deadline), so earliest-
  deadline order is first-come order and the most on-time jobs is found exactly by Kise, Ibaraki
  and Mine's algorithm (Oper. Res. 26, 1978; :func:`most_on_time`): take jobs in order, and when one
  would be late drop the job whose removal ends the schedule earliest.
- **A clairvoyant admission** (a lower bound on the best): the relaxation's chosen set, recomputed
  with each job's window shortened by its full-batch service and the rate scaled down a little (it
  is a fluid server's set, the engine serves jobs side by side), admitted and everything else
  refused, run through the model's engine. What it serves, an admission knowing every answer in
  advance could serve.

And what codel lost, from its own run on the same trace: admitted jobs that then ended past their
deadline, refused jobs that would have fit (one at a time: started where the next admitted job
after it started, or at the first free slot, and served at a full batch's pace, done within their
patience), and the engine's idle slots while a refused client could still have been served
(in points of goodput: idle slot-seconds over ``slots`` times the run's length).

    python -m sluice.bench.spike_ceiling --seeds 40 --first-seed 0
"""

from __future__ import annotations

import argparse
import itertools
import math
import random
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sluice.bench.engine_family import ARTICLE, ENGINES, Engine, draw_engine, saturated
from sluice.bench.load import Profile
from sluice.bench.policy_model import Result, _Job, loads, run
from sluice.core.admission import Admitted, Refused
from sluice.core.policy import Candidate, PolicyState, QueuePolicy, make_policy

#: the spike target, in % of capacity (issue 18)
TARGET = 73.0


def most_on_time(windows: Sequence[tuple[float, float, float]], rate: float) -> list[int]:
    """The largest set of jobs one server of ``rate`` work a second finishes in their windows.

    ``windows``: (release, deadline, work) per job, agreeable (sorted by release, deadlines
    non-decreasing with it). Returns the chosen jobs' indices, in order. Exact (Kise, Ibaraki and
    Mine): first-come order is optimal for any set, and each job that would be late is dealt with
    by dropping, among the current busy stretch and itself, the job whose removal ends the stretch
    earliest. Only the stretch since the server last idled matters: a job before it delays nothing
    after it."""
    for (r0, d0, _), (r1, d1, _) in itertools.pairwise(windows):
        if r1 < r0 or d1 < d0:
            raise ValueError("windows must be agreeable: sorted by release, deadlines non-decreasing")
    chosen: list[int] = []
    block: list[int] = []  # the current busy stretch's jobs, in order
    end = -math.inf  # when the chosen jobs' schedule ends
    for j, (release, deadline, work) in enumerate(windows):
        p = work / rate
        if release + p > deadline:
            continue  # late even alone
        if release >= end:  # the server idles before it: a new stretch
            chosen.extend(block)
            block, end = [j], release + p
            continue
        if end + p <= deadline:
            block.append(j)
            end += p
            continue
        # Late: drop the job (of the stretch, or j itself) whose removal ends the stretch earliest.
        cand = [*block, j]
        ps = [windows[k][2] / rate for k in cand]
        # a[i]: the stretch's end were it to start at job i's release (the end is the largest)
        a = [0.0] * len(cand)
        tail = 0.0
        for i in range(len(cand) - 1, -1, -1):
            tail += ps[i]
            a[i] = windows[cand[i]][0] + tail
        after = [-math.inf] * (len(cand) + 1)
        for i in range(len(cand) - 1, -1, -1):
            after[i] = max(after[i + 1], a[i])
        best, best_end = len(cand) - 1, math.inf
        before = -math.inf
        for i in range(len(cand)):
            # without cand[i]: jobs after it end as they did, those before it p_i sooner
            e = max(after[i + 1], before - ps[i])
            if e < best_end - 1e-12 or (abs(e - best_end) <= 1e-12 and ps[i] >= ps[best]):
                best, best_end = i, e
            before = max(before, a[i])
        del cand[best]
        block = cand
        end = best_end if cand else -math.inf
    chosen.extend(block)
    return chosen


def full_rate_tokens(engine: Engine) -> float:
    """The most tokens a second the engine decodes: a full batch's (``b / step(b)`` rises with ``b``)."""
    return engine.slots / (engine.step0 + engine.step1 * engine.slots)


class Clairvoyant(QueuePolicy):
    """Admits exactly the first tries that arrive at the times given (a set chosen offline, with
    every answer known), refuses the rest."""

    name = "clairvoyant"
    kind = -1

    def __init__(self, admit_at: Iterable[float]) -> None:
        self.admit_at = set(admit_at)

    def admit(self, c: Candidate, state: PolicyState) -> Admitted:
        if c.now in self.admit_at:
            return Admitted(c.view.ahead_jobs, 0.0, False)
        raise Refused(429, "queue_full", "not in the clairvoyant set", 1.0, should_retry=False)


@dataclass
class Ceiling:
    """One engine's spike: goodput in % of capacity (codel's, a clairvoyant admission's, the
    ceiling's) and codel's losses."""

    seed: int
    engine: Engine
    codel: float
    codel_retrying: float | None
    clairvoyant: float
    ceiling: float
    blind: float  # the clairvoyant admission choosing as if every answer were the mean
    blind_ceiling: float  # the relaxation's most with every answer the mean (a guide, not a bound)
    broken: int  # codel admitted, then ended past the deadline
    wasted: float  # % of codel's generated tokens
    refused: int
    fit_refused: int  # of those, would have fit (one at a time)
    idle_points: float  # idle slots while a refused client could still be served, in points
    idle_after: float  # idle slots from the first refusal to the run's end, in points


def _windows(
    jobs: Sequence[_Job], end: float, shrink: float = 0.0, blind: bool = False
) -> list[tuple[float, float, float]]:
    """The relaxation's windows; ``blind``: every job's work the mean answer (answers unseen)."""
    mean = statistics.fmean(j.answer for j in jobs) if jobs else 0.0
    return [(j.arrived, min(j.deadline, end) - shrink, mean if blind else float(j.answer)) for j in jobs]


def _busy(trace: Sequence[_Job]) -> list[tuple[float, float]]:
    """The slot intervals of the jobs that ran: dispatch to done, or to the client giving up."""
    out = []
    for j in trace:
        if math.isnan(j.started):
            continue
        out.append((j.started, j.done if not math.isnan(j.done) else j.deadline))
    return out


def _idle_slot_seconds(
    busy: Sequence[tuple[float, float]], slots: int, spans: list[tuple[float, float]]
) -> float:
    """Slot-seconds free over the union of ``spans``."""
    spans = sorted(spans)
    merged: list[list[float]] = []
    for a, b in spans:
        if b <= a:
            continue
        if merged and a <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], b)
        else:
            merged.append([a, b])
    total = 0.0
    for a, b in merged:
        used = sum(max(0.0, min(e, b) - max(s, a)) for s, e in busy)
        total += slots * (b - a) - used
    return max(total, 0.0)


def losses(trace: Sequence[_Job], engine: Engine, end: float) -> tuple[int, int, int, float, float]:
    """codel's run, read: (broken, refused, refused while a slot was free before they would have
    had to start, idle slot-seconds while a refused client could still be served, idle
    slot-seconds from the spike's start to the end)."""
    full_step = engine.step0 + engine.step1 * engine.slots
    first = [j for j in trace if not j.retried]
    busy = _busy(trace)
    events = sorted([(s, 1) for s, _ in busy] + [(e, -1) for _, e in busy])
    free: list[tuple[float, float]] = []  # spans with a slot free (the running count below slots)
    running, since = 0, 0.0
    for t, d in events:
        if running < engine.slots and t > since:
            free.append((since, t))
        running += d
        since = t
    if since < end:
        free.append((since, end))
    broken = sum(1 for j in trace if j.admitted and j.outcome in ("timeout", "expired"))
    refused = [j for j in first if j.outcome == "refused"]
    fit = 0
    spans = []
    for j in refused:
        latest = min(j.deadline, end) - j.answer * full_step - engine.prefill * j.prompt
        if any(a < latest and b > j.arrived for a, b in free):
            fit += 1
        spans.append((j.arrived, latest))
    spike_at = min((j.arrived for j in refused), default=end)
    return (
        broken,
        len(refused),
        fit,
        _idle_slot_seconds(busy, engine.slots, spans),
        _idle_slot_seconds(busy, engine.slots, [(spike_at, end)]),
    )


def spike_profile(engine: Engine) -> tuple[float, Profile, float]:
    cap, _, full_rate = saturated(engine)
    return cap, loads(cap)["spike 0.55x-5.5x"], full_rate


def clairvoyant_best(
    jobs: Sequence[_Job],
    engine: Engine,
    profile: Profile,
    seed: int,
    full_rate: float,
    *,
    blind: bool = False,
) -> tuple[float, Result]:
    """The best of a few clairvoyant sets run through the engine: the relaxation's set at the rate
    scaled by 1, 0.95, 0.9, with windows shortened by each job's full-batch service or not."""
    rate = full_rate_tokens(engine)
    full_step = engine.step0 + engine.step1 * engine.slots
    best: tuple[float, Result] | None = None
    # the mean job's full-batch service beyond its fluid time (one figure keeps windows agreeable)
    own = statistics.fmean(j.answer * full_step + engine.prefill * j.prompt - j.answer / rate for j in jobs)
    for shrink in (0.0, own):
        for scale in (1.0, 0.95, 0.9):
            chosen = most_on_time(_windows(jobs, profile.duration, shrink, blind), rate * scale)
            result = run(
                Clairvoyant(jobs[i].arrived for i in chosen),
                profile,
                seed,
                engine=engine,
                retriers=0.0,
                full_rate=full_rate,
            )
            if best is None or result.goodput > best[0]:
                best = (result.goodput, result)
    assert best is not None
    return best


def ceiling(seed: int, engine: Engine, *, retrying: bool = True) -> Ceiling:
    """One engine's spike: codel (every client trying once, and with the model's default 10 %
    retrying), the clairvoyant admission and the ceiling."""
    cap, profile, full_rate = spike_profile(engine)
    trace: list[_Job] = []
    codel = run(
        make_policy("codel"), profile, seed, engine=engine, retriers=0.0, full_rate=full_rate, trace=trace
    )
    codel_retrying = (
        run(make_policy("codel"), profile, seed, engine=engine, retriers=0.1, full_rate=full_rate).goodput
        if retrying
        else None
    )
    jobs = [j for j in trace if not j.retried]
    jobs.sort(key=lambda j: j.arrived)
    upper = len(most_on_time(_windows(jobs, profile.duration), full_rate_tokens(engine)))
    clair, _ = clairvoyant_best(jobs, engine, profile, seed, full_rate)
    blind, _ = clairvoyant_best(jobs, engine, profile, seed, full_rate, blind=True)
    blind_upper = len(most_on_time(_windows(jobs, profile.duration, blind=True), full_rate_tokens(engine)))
    broken, refused, fit, idle, idle_after = losses(trace, engine, profile.duration)
    pct = 100 / cap
    return Ceiling(
        seed=seed,
        engine=engine,
        codel=pct * codel.goodput,
        codel_retrying=pct * codel_retrying if codel_retrying is not None else None,
        clairvoyant=pct * clair,
        blind=pct * blind,
        blind_ceiling=pct * blind_upper / profile.duration,
        ceiling=pct * upper / profile.duration,
        broken=broken,
        wasted=100 * codel.wasted_share,
        refused=refused,
        fit_refused=fit,
        idle_points=100 * idle / (engine.slots * profile.duration),
        idle_after=100 * idle_after / (engine.slots * profile.duration),
    )


def line(c: Ceiling) -> str:
    e = c.engine
    kv = ", KV-short" if e.kv_tokens is not None else ""
    retrying = f"{c.codel_retrying:.1f} %" if c.codel_retrying is not None else "-"
    return (
        f"| {c.seed} | {e.slots}, {e.answers}, {e.max_tokens}{kv} | {c.codel:.1f} % ({retrying}) "
        f"| {c.blind:.1f} % | {c.blind_ceiling:.1f} % | {c.clairvoyant:.1f} % | {c.ceiling:.1f} % "
        f"| {c.broken} ({c.wasted:.1f} %) "
        f"| {c.fit_refused} of {c.refused} | {c.idle_points:.1f} | {c.idle_after:.1f} |"
    )


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m sluice.bench.spike_ceiling",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--seeds", type=int, default=20)
    ap.add_argument("--first-seed", type=int, default=0)
    ap.add_argument("--engine", choices=[*sorted(ENGINES), "family"], default="family")
    ap.add_argument("--all", action="store_true", help="every engine, not only those codel misses 73 %% on")
    args = ap.parse_args()
    rows: list[Ceiling] = []
    print(
        "| seed | slots, answers, max_tokens | codel, all try once (10 % retry) | answers unseen: admission "
        "| answers unseen: relaxation | clairvoyant admission | ceiling | codel: broken (wasted) "
        "| codel: refused, a slot free in time | idle while refusing (points) "
        "| idle from the first refusal (points) |"
    )
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for s in range(args.first_seed, args.first_seed + args.seeds):
        engine = draw_engine(s) if args.engine == "family" else ENGINES.get(args.engine, ARTICLE)
        c = ceiling(s, engine)
        rows.append(c)
        if args.all or (c.codel_retrying if c.codel_retrying is not None else c.codel) < TARGET:
            print(line(c), flush=True)

    def count(values: list[float]) -> str:
        met = sum(1 for v in values if v >= TARGET)
        return f"{met} of {len(values)} (median {statistics.median(values):.1f} %)"

    print(
        f"\nAt {TARGET:.0f} %: codel, all try once {count([r.codel for r in rows])}; "
        f"with 10 % retrying {count([r.codel_retrying or 0.0 for r in rows])}; "
        f"answers unseen: admission {count([r.blind for r in rows])}, relaxation "
        f"{count([r.blind_ceiling for r in rows])}; "
        f"clairvoyant {count([r.clairvoyant for r in rows])}; ceiling {count([r.ceiling for r in rows])}."
    )


if __name__ == "__main__":
    random.seed(0)
    main()
