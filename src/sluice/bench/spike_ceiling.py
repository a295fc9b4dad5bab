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
  least ``b / R``), each prompt prefilled once, the KV cache never short (so the bound is loose
  on the engines whose cache is short of a full batch), and each job's answer tokens done
  within ``[arrival, min(arrival + patience, end of run)]``. Any schedule of the real engine is one
  of this server (each step's tokens fit in the step at rate ``R``), so the most jobs this server
  can finish in their windows bounds every admission policy's goodput. With a patience the same for
  every client, windows are agreeable (a later arrival never has an earlier deadline), so earliest-
  deadline order is first-come order and the most on-time jobs is found exactly by Kise, Ibaraki
  and Mine's algorithm (Oper. Res. 26, 1978; :func:`most_on_time`): take jobs in order, and when one
  would be late drop the job whose removal ends the schedule earliest.
- **A clairvoyant admission** (a lower bound on the best): the relaxation's chosen set, also
  with every window shortened by the mean job's full-batch service (it is a fluid server's set;
  the engine serves jobs side by side), admitted and everything else refused, run through the
  model's engine. The set is chosen with each job's answer known (and then run again without the
  jobs seen to miss their deadline, up to :data:`REPAIRS` times), or unseen: every answer taken as
  the run's mean, and (a cautious admission) each window shortened so that the job's own answer
  may be its 95th percentile; the prompts are seen.
  Knowing every arrival in advance, such an admission is not one a broker can make: it shows what
  the engine and the trace allow, not a rule.

And what codel lost, from its own run on the same trace: admitted jobs that then ended past their
deadline, refused jobs while a slot was free before they would have had to start (served at a
full batch's pace to be done within their patience), and the engine's idle slots while a refused
client could still have been served, and from the first refusal to the end (in points of goodput:
idle slot-seconds over ``slots`` times the run's length). The ceiling bounds runs where every
client tries once; a retry is a second chance the bound does not count.

    python -m sluice.bench.spike_ceiling --seeds 40 --first-seed 0
"""

from __future__ import annotations

import argparse
import itertools
import math
import statistics
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from sluice.bench.engine_family import ARTICLE, ENGINES, Engine, draw_engine, saturated
from sluice.bench.load import Profile
from sluice.bench.policy_model import JobRecord, Result, loads, run
from sluice.core.admission import Admitted, Refused
from sluice.core.policy import Candidate, PolicyState, QueuePolicy, make_policy

#: the spike target, in % of capacity (issue 18)
TARGET = 73.0
#: how many times a clairvoyant set is run again without the jobs it saw miss their deadline
REPAIRS = 3


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
    rs: list[float] = []  # their releases
    ps: list[float] = []  # and their times on the server
    end = -math.inf  # when the chosen jobs' schedule ends
    for j, (release, deadline, work) in enumerate(windows):
        p = work / rate
        if release + p > deadline:
            continue  # late even alone
        if release >= end:  # the server idles before it: a new stretch
            chosen.extend(block)
            block, rs, ps, end = [j], [release], [p], release + p
            continue
        if end + p <= deadline:
            block.append(j)
            rs.append(release)
            ps.append(p)
            end += p
            continue
        # Late: drop the job (of the stretch, or j itself) whose removal ends the stretch earliest.
        # Without job k the stretch ends no sooner than p_k before it does now, and without j it
        # ends exactly so: where no job of the stretch takes longer than j, j goes.
        if p >= max(ps):
            continue
        block.append(j)
        rs.append(release)
        ps.append(p)
        # a[i]: the stretch's end were it to start at job i's release (the end is the largest of them)
        tails = list(itertools.accumulate(reversed(ps)))[::-1]
        a = [r + t for r, t in zip(rs, tails, strict=True)]
        after = [*list(itertools.accumulate(reversed(a), max))[::-1][1:], -math.inf]
        before = [-math.inf, *itertools.accumulate(a[:-1], max)]
        # without job i: the jobs after it end as they did, those before it p_i sooner
        ends = [max(x, y - q) for x, y, q in zip(after, before, ps, strict=True)]
        best_end = min(ends)
        # of the drops that end it soonest, the longest job's (the latest of those)
        best = max((i for i, e in enumerate(ends) if e <= best_end + 1e-12), key=lambda i: (ps[i], i))
        del block[best], rs[best], ps[best]
        end = best_end if block else -math.inf
    chosen.extend(block)
    return chosen


def full_rate_tokens(engine: Engine) -> float:
    """The most tokens a second the engine decodes: a full batch's (``b / step(b)`` rises with ``b``)."""
    return engine.slots / (engine.step0 + engine.step1 * engine.slots)


class Clairvoyant(QueuePolicy):
    """Admits exactly the first tries that arrive at the times given (a set chosen offline, with
    every answer known), refuses the rest."""

    name = "clairvoyant"
    kind = -1  # no number in lua/_policy.lua: an offline set, for the policy model only

    def __init__(self, admit_at: Iterable[float]) -> None:
        self.admit_at = set(admit_at)

    def admit(self, c: Candidate, state: PolicyState) -> Admitted:
        if c.now in self.admit_at:
            return Admitted(c.view.ahead_jobs, 0.0, False)
        raise Refused(429, "queue_full", "not in the clairvoyant set", 1.0, should_retry=False)


def _windows(
    jobs: Sequence[JobRecord], engine: Engine, end: float, shrink: float = 0.0, answers: str = "known"
) -> list[tuple[float, float, float]]:
    """The relaxation's windows, work in tokens at the full batch's rate: a job's answer, and its
    prompt's prefill once (a step that prefills ``P`` tokens takes ``prefill · P`` beyond its
    decoding, and a preempted job's second prefill is more). ``answers``: ``known`` (each job's
    own), or unseen (the prompt is seen): every answer taken as the run's ``mean``, or so and each
    window shortened by the 95th percentile's excess over the mean at a full batch's pace
    (``p95``: a cautious admission's, that leaves room for the job's own answer being long, as the
    deadline check does, the queue ahead counted at its mean)."""
    ordered = sorted(j.answer for j in jobs)
    if answers not in ("known", "mean", "p95"):
        raise ValueError(f"answers: known, mean or p95, not {answers!r}")
    guess = statistics.fmean(ordered) if ordered else 0.0
    if answers == "p95" and ordered:
        tail = ordered[min(len(ordered) - 1, int(0.95 * len(ordered)))] - guess
        shrink += max(tail, 0.0) * (engine.step0 + engine.step1 * engine.slots)
    blind = answers != "known"
    per_prompt = engine.prefill * full_rate_tokens(engine)
    return [
        (j.arrived, min(j.deadline, end) - shrink, (guess if blind else j.answer) + per_prompt * j.prompt)
        for j in jobs
    ]


def _busy(trace: Sequence[JobRecord]) -> list[tuple[float, float]]:
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


def losses(trace: Sequence[JobRecord], engine: Engine, end: float) -> tuple[int, int, float, float]:
    """codel's run, read: (refused, refused while a slot was free before they would have had to
    start, idle slot-seconds while a refused client could still be served, idle slot-seconds
    from the first refusal to the end). Its broken promises are the run's own
    (:attr:`Result.broken`)."""
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
    refused = [j for j in first if j.outcome == "refused"]
    with_room = 0
    spans = []
    for j in refused:
        latest = min(j.deadline, end) - j.answer * full_step - engine.prefill * j.prompt
        if any(a < latest and b > j.arrived for a, b in free):
            with_room += 1
        spans.append((j.arrived, latest))
    first_refusal = min((j.arrived for j in refused), default=end)
    return (
        len(refused),
        with_room,
        _idle_slot_seconds(busy, engine.slots, spans),
        _idle_slot_seconds(busy, engine.slots, [(first_refusal, end)]),
    )


def spike_profile(engine: Engine) -> tuple[float, Profile, float]:
    """The engine's capacity (answers a second, :func:`saturated`), the model's spike scaled to
    it, and its full batch's drain rate in cost units a second."""
    cap, _, full_rate = saturated(engine)
    return cap, loads(cap)["spike 0.55x-5.5x"], full_rate


def clairvoyant_best(
    jobs: Sequence[JobRecord],
    engine: Engine,
    profile: Profile,
    seed: int,
    full_rate: float,
    *,
    answers: str = "known",
) -> Result:
    """The best of a few clairvoyant sets run through the engine: the relaxation's set (answers as
    :func:`_windows` takes them), with windows shortened by the mean job's full-batch service or
    not; with answers known, each run again up to :data:`REPAIRS` times without the jobs it saw
    end past their deadline. The best: the most goodput among the runs that broke no promise (else the fewest
    broken). That choice between the two windows is made on the runs' outcomes, so with the answers
    unseen too one bit of hindsight goes into the set (which shortening to use)."""
    rate = full_rate_tokens(engine)
    full_step = engine.step0 + engine.step1 * engine.slots
    best: Result | None = None
    # the mean job's full-batch service beyond its fluid time (one figure keeps windows agreeable)
    beside = statistics.fmean(
        j.answer * full_step + engine.prefill * j.prompt - j.answer / rate for j in jobs
    )
    for shrink in (0.0, beside):
        chosen = most_on_time(_windows(jobs, engine, profile.duration, shrink, answers), rate)
        admit = {jobs[i].arrived for i in chosen}
        # Repairing needs the answers (which jobs then missed): only where they are known.
        for _ in range((REPAIRS if answers == "known" else 0) + 1):
            trace: list[JobRecord] = []
            result = run(
                Clairvoyant(admit),
                profile,
                seed,
                engine=engine,
                retriers=0.0,
                full_rate=full_rate,
                trace=trace,
            )
            if best is None or (result.broken, -result.goodput) < (best.broken, -best.goodput):
                best = result
            late = {j.arrived for j in trace if j.broke}
            if not late:
                break
            admit -= late  # seen to miss: refused, the jobs behind them start sooner
    assert best is not None
    return best


@dataclass
class Replay:
    """A clairvoyant admission's run.

    Attributes:
        goodput: in % of the engine's capacity.
        broken: admitted jobs that then ended past their deadline.
        wasted: tokens generated for jobs given up while running, in % of those generated.
    """

    goodput: float
    broken: int
    wasted: float

    @classmethod
    def of(cls, result: Result, cap: float) -> Replay:
        return cls(100 * result.goodput / cap, result.broken, 100 * result.wasted_share)

    def __str__(self) -> str:
        return f"{self.goodput:.1f} % ({self.broken}, {self.wasted:.1f} %)"


@dataclass
class Ceiling:
    """One engine's spike: goodput in % of capacity (codel's, the clairvoyant admissions', the
    ceiling's) and codel's losses.

    Attributes:
        seed: the family's seed (the engine's draw and the run's trace).
        engine: the engine run.
        codel: codel's goodput, every client trying once (the trace the ceiling bounds).
        codel_retrying: codel's goodput with the model's default 10 % of clients retrying (None:
            not run).
        known: the clairvoyant admission, every answer known (:func:`clairvoyant_best`).
        unseen: the same, choosing as if every answer were the run's mean.
        cautious: the same, leaving room for a 95th-percentile answer of the job's own.
        ceiling: the most on-time jobs of the fluid relaxation (:func:`most_on_time`), as goodput.
        broken: codel's admitted jobs that then ended past their deadline.
        wasted: codel's wasted tokens, in % of those it generated.
        refused: codel's refused first tries.
        by_limit: of those, refused by codel's delay limit (``queue_full``), the rest by the
            deadline check.
        refused_with_room: of those, refused while a slot was free before they would have had to start.
        idle_points: idle slots while a refused client could still be served, in points of
            goodput (slot-seconds over ``slots`` times the run's length).
        idle_after: idle slots from the first refusal to the run's end, in points.
    """

    seed: int
    engine: Engine
    codel: float
    codel_retrying: float | None
    known: Replay
    unseen: Replay
    cautious: Replay
    ceiling: float
    broken: int
    wasted: float
    refused: int
    by_limit: int
    refused_with_room: int
    idle_points: float
    idle_after: float


def ceiling(
    seed: int, engine: Engine, *, retrying: bool = True, missing_only: bool = False
) -> Ceiling | None:
    """One engine's spike: codel (every client trying once, and with the model's default 10 %
    retrying), the clairvoyant admissions and the ceiling. ``missing_only``: None where codel (as
    the model runs it, 10 % retrying) meets the target, before the costlier part."""
    cap, profile, full_rate = spike_profile(engine)
    trace: list[JobRecord] = []
    policy = make_policy("codel")
    codel = run(policy, profile, seed, engine=engine, retriers=0.0, full_rate=full_rate, trace=trace)
    codel_retrying = (
        run(policy, profile, seed, engine=engine, retriers=0.1, full_rate=full_rate).goodput
        if retrying
        else None
    )
    judged = codel_retrying if codel_retrying is not None else codel.goodput
    if missing_only and 100 * judged / cap >= TARGET:
        return None
    jobs = [j for j in trace if not j.retried]
    jobs.sort(key=lambda j: j.arrived)
    upper = len(most_on_time(_windows(jobs, engine, profile.duration), full_rate_tokens(engine)))
    replays = {
        a: Replay.of(clairvoyant_best(jobs, engine, profile, seed, full_rate, answers=a), cap)
        for a in ("known", "mean", "p95")
    }
    refused, with_room, idle, idle_after = losses(trace, engine, profile.duration)
    return Ceiling(
        seed=seed,
        engine=engine,
        codel=100 * codel.goodput / cap,
        codel_retrying=100 * codel_retrying / cap if codel_retrying is not None else None,
        known=replays["known"],
        unseen=replays["mean"],
        cautious=replays["p95"],
        ceiling=100 * upper / profile.duration / cap,
        broken=codel.broken,
        wasted=100 * codel.wasted_share,
        refused=refused,
        by_limit=sum(1 for j in trace if not j.retried and j.refused_code == "queue_full"),
        refused_with_room=with_room,
        idle_points=100 * idle / (engine.slots * profile.duration),
        idle_after=100 * idle_after / (engine.slots * profile.duration),
    )


HEADER = (
    "| seed | slots, answers, max_tokens | codel, all try once (10 % retry) | codel: broken (wasted) "
    "| clairvoyant, answers unseen (broken, wasted) | the same, room for a p95 answer | clairvoyant, answers "
    "known | ceiling | codel: refused (by its limit), a slot free in time | idle while refusing (points) "
    "| idle from the first refusal (points) |"
)


def line(c: Ceiling) -> str:
    e = c.engine
    kv = ", KV-short" if e.kv_tokens is not None else ""
    retrying = f"{c.codel_retrying:.1f} %" if c.codel_retrying is not None else "-"
    return (
        f"| {c.seed} | {e.slots}, {e.answers}, {e.max_tokens}{kv} | {c.codel:.1f} % ({retrying}) "
        f"| {c.broken} ({c.wasted:.1f} %) | {c.unseen} | {c.cautious} | {c.known} | {c.ceiling:.1f} % "
        f"| {c.refused} ({c.by_limit}), {c.refused_with_room} | {c.idle_points:.1f} | {c.idle_after:.1f} |"
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
    ap.add_argument(
        "--all",
        action="store_true",
        help="every engine, not only those codel misses 73 %% on (the counts: of those)",
    )
    args = ap.parse_args()
    rows: list[Ceiling] = []
    print(HEADER)
    print("|---|---|---|---|---|---|---|---|---|---|---|")
    for s in range(args.first_seed, args.first_seed + args.seeds):
        engine = draw_engine(s) if args.engine == "family" else ENGINES.get(args.engine, ARTICLE)
        c = ceiling(s, engine, missing_only=not args.all)
        if c is not None:
            rows.append(c)
            print(line(c), flush=True)
    if not rows:
        return

    def count(values: list[float]) -> str:
        met = sum(1 for v in values if v >= TARGET)
        return f"{met} of {len(values)} (median {statistics.median(values):.1f} %)"

    def kept(replays: list[Replay]) -> str:
        met = sum(1 for r in replays if r.goodput >= TARGET and r.wasted <= 2.0)
        clean = sum(1 for r in replays if r.goodput >= TARGET and r.wasted <= 2.0 and r.broken == 0)
        return f"{met} ({clean} with none broken) of {len(replays)}"

    print(
        f"\nAt {TARGET:.0f} % (clairvoyants: with <= 2 % waste): codel, all try once "
        f"{count([r.codel for r in rows])}; "
        f"with 10 % retrying {count([r.codel_retrying or 0.0 for r in rows])}; "
        f"clairvoyant, answers unseen {kept([r.unseen for r in rows])}; room for a p95 answer "
        f"{kept([r.cautious for r in rows])}; answers known {kept([r.known for r in rows])}; "
        f"ceiling {count([r.ceiling for r in rows])}."
    )


if __name__ == "__main__":
    main()
