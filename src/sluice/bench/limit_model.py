"""The adaptive in-flight limit against every fixed one, on the simulator's engine model in virtual
time: seconds for what two minutes of traffic would take.

Not a benchmark of Sluice over HTTP (``sluice bench`` does that): one engine
(:class:`sluice.sim.model.BatchModel`, the model ``sluice sim`` serves), a FIFO gateway queue in
front of it that sends at most ``limit`` requests in flight, and the real
:class:`~sluice.core.concurrency.ConcurrencyLimit` fed as the dispatcher feeds it: a
:class:`~sluice.core.concurrency.StreamSample` for every finished stream, and the engine's own load
(``/metrics``: running, waiting, KV use, preemptions) every ``--poll`` seconds, or never
(``adaptive, no metrics``: TTFT alone); the gateway also tells it of every dispatch and first
token (:meth:`~sluice.core.concurrency.ConcurrencyLimit.on_dispatch`, ``on_first_token``).

Arrivals are open-loop Poisson at ``--overload`` times the engine's capacity (prompts of 16..256
tokens, answers of 32..224); every client gives up ``--patience`` seconds after it arrived (a
request still queued is dropped, one running is aborted: its tokens are wasted). At
``--change-at`` seconds every step cost doubles (another tenant on the GPU; ``--change kv``: the KV
cache halves instead) and the arrival rate follows the new capacity. Goodput: answers finished
within their client's patience, per second.

    python -m sluice.bench.limit_model                   # every engine, all fixed limits 1..2x batch
    python -m sluice.bench.limit_model --engines b16 --seeds 3
    python -m sluice.bench.limit_model --engines b64kv --change kv

Time to converge, three ways (start/change): the *band*, from when the limit stays within
max(2, 15 %) of where it settles (its median over the last third of the phase); *goodput*, from
when every later 10-s window's goodput is within 2 % (or one answer) of the phase's best fixed
limit's over the same window; *envelope*, the same windows against the least of the fixed limits
within 2 % of the best over the phase (their spread is the windows' noise). With ``--seeds`` > 1
a summary per engine follows: the worst seed of each figure, and how many of the fixed limits
held from the start the goodput measure reads as not converged (its noise).
"""

from __future__ import annotations

import argparse
import bisect
import heapq
import itertools
import random
import statistics
from collections import deque
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, replace

from sluice.core.concurrency import ConcurrencyLimit, EngineLoad, StreamSample
from sluice.sim.model import BatchModel, SimParams, SimRequest, capacity_rps, preset

PROMPT_RANGE = (16, 256)
OUTPUT_RANGE = (32, 224)
MEAN_PROMPT = sum(PROMPT_RANGE) // 2
MEAN_OUTPUT = sum(OUTPUT_RANGE) // 2

#: The engines: batch sizes 4 to 64, different step and prefill costs; ``b64kv`` is short of KV
#: cache for a full batch of long answers (it preempts before its batch fills).
ENGINES: dict[str, SimParams] = {
    "b4": preset("llama-cpu"),
    "b8": preset("article", max_num_seqs=8, base_step_s=0.030, per_seq_s=0.0020, prefill_s_per_token=0.00005),
    "b16": preset("article"),
    "b32": preset(
        "article", max_num_seqs=32, base_step_s=0.012, per_seq_s=0.0003, prefill_s_per_token=0.00001
    ),
    "b64": preset(
        "article", max_num_seqs=64, base_step_s=0.020, per_seq_s=0.00025, prefill_s_per_token=0.00002
    ),
    "b64kv": preset(
        "article",
        max_num_seqs=64,
        base_step_s=0.020,
        per_seq_s=0.00025,
        prefill_s_per_token=0.00002,
        kv_cache_tokens=8192,
        max_model_len=2048,
    ),
}


@dataclass(frozen=True, slots=True)
class Config:
    """One experiment's knobs.

    Attributes:
        duration_s: simulated seconds of arrivals.
        change_at_s: when the engine changes (None: never).
        change: how: ``step`` (every step cost doubles) or ``kv`` (half the KV cache).
        overload: arrival rate over the engine's capacity.
        patience_s: how long a client waits for its whole answer.
        poll_s: how often the engine's load is read (the heartbeat).
        seed: of the arrivals (the same for every limit compared).
        tpot_objective_s: where set, an answer is good only if its time per output token met it
            too, and the adaptive limit is given it as its objective.
    """

    duration_s: float = 120.0
    change_at_s: float | None = 60.0
    change: str = "step"
    overload: float = 1.3
    patience_s: float = 15.0
    poll_s: float = 1.0
    seed: int = 1
    tpot_objective_s: float | None = None


@dataclass(slots=True)
class Outcome:
    """What one run gave.

    Attributes:
        good: answers finished within their client's patience.
        goodput: ``good`` per simulated second.
        max_waiting: the most requests seen in the engine's own waiting queue (after any step).
        trace: (time, limit) at every poll.
        good_at: when each good answer finished.
    """

    good: int = 0
    goodput: float = 0.0
    max_waiting: int = 0
    trace: list[tuple[float, int]] = field(default_factory=list)
    good_at: list[float] = field(default_factory=list)


@dataclass(slots=True)
class _Request:
    rid: str
    arrival: float
    prompt: int
    output: int
    deadline: float
    sent_at: float | None = None
    inflight_at_send: int = 0
    handle: SimRequest | None = None
    done: bool = False


def _capacity(params: SimParams) -> float:
    return capacity_rps(params, MEAN_OUTPUT, MEAN_PROMPT)


def _changed(params: SimParams, change: str) -> SimParams:
    """The engine after the change: every step cost doubled (``step``), or half its KV cache
    (``kv``: another tenant took the memory)."""
    if change == "kv":
        return replace(params, kv_cache_tokens=max(params.max_model_len, params.kv_cache_tokens // 2))
    return replace(
        params,
        base_step_s=params.base_step_s * 2,
        per_seq_s=params.per_seq_s * 2,
        prefill_s_per_token=params.prefill_s_per_token * 2,
    )


def arrivals(params: SimParams, cfg: Config) -> list[_Request]:
    """The run's requests, the same for every limit: Poisson at ``overload`` x capacity, the rate
    following the capacity after the change."""
    rng = random.Random(cfg.seed)
    out: list[_Request] = []
    t = 0.0
    slow = _changed(params, cfg.change)
    while True:
        phase = params if cfg.change_at_s is None or t < cfg.change_at_s else slow
        t += rng.expovariate(cfg.overload * _capacity(phase))
        if t >= cfg.duration_s:
            return out
        prompt = rng.randint(*PROMPT_RANGE)
        output = rng.randint(*OUTPUT_RANGE)
        out.append(_Request(f"r{len(out)}", t, prompt, output, t + cfg.patience_s))


def run(
    params: SimParams, cfg: Config, *, fixed: int | None = None, metrics: bool = True, **limit_args: object
) -> Outcome:
    """One run: a fixed limit, or (``fixed=None``) the adaptive one, with or without the engine's
    metrics."""
    engine = BatchModel(params)
    limiter: ConcurrencyLimit
    now = 0.0
    if fixed is not None:
        limiter = ConcurrencyLimit(adaptive=False, initial=fixed, clock=lambda: now)
    else:
        limit_args.setdefault("tpot_objective_s", cfg.tpot_objective_s)
        limiter = ConcurrencyLimit(clock=lambda: now, **limit_args)  # type: ignore[arg-type]
    # A fixed limit learns nothing from what it is told: only the adaptive one is fed.
    learning = fixed is None
    requests = arrivals(params, cfg)
    by_id = {r.rid: r for r in requests}
    queue: deque[_Request] = deque()
    inflight: dict[str, _Request] = {}
    out = Outcome()
    events: list[tuple[float, int, str, str]] = []
    seq = itertools.count()

    def push(at: float, kind: str, rid: str = "") -> None:
        heapq.heappush(events, (at, next(seq), kind, rid))

    for r in requests:
        push(r.arrival, "arrive", r.rid)
        push(r.deadline, "deadline", r.rid)
    t = 0.0
    while t <= cfg.duration_s + cfg.patience_s:
        push(t, "poll")
        t += cfg.poll_s
    if cfg.change_at_s is not None:
        push(cfg.change_at_s, "change")
    stepping = False

    def dispatch() -> None:
        while queue and len(inflight) < limiter.limit:
            r = queue.popleft()
            if r.done:
                continue
            r.sent_at = now
            r.inflight_at_send = len(inflight) + 1
            r.handle = engine.submit(r.rid, r.prompt, r.output, now)
            inflight[r.rid] = r
            if learning:
                limiter.on_dispatch(r.inflight_at_send)

    while events:
        now, _, kind, rid = heapq.heappop(events)
        if kind == "arrive":
            queue.append(by_id[rid])
        elif kind == "deadline":
            r = by_id[rid]
            if not r.done:
                r.done = True  # the client gave up: dropped from the queue, or aborted in the engine
                if rid in inflight:
                    engine.abort(rid, now)
                    del inflight[rid]
        elif kind == "poll":
            if metrics and learning:
                limiter.on_engine_load(
                    EngineLoad(
                        running=engine.num_running,
                        waiting=engine.num_waiting,
                        kv_usage=engine.kv_usage,
                        preemptions=engine.stats.preemptions_total,
                    )
                )
            out.trace.append((now, limiter.limit))
        elif kind == "change":
            engine.params = _changed(engine.params, cfg.change)
        elif kind == "step":
            stepping = False
            result = engine.step(now)
            for h in result.emitted if learning else ():
                if h.generated == 1:
                    first = inflight[h.request_id]
                    assert first.sent_at is not None
                    limiter.on_first_token(first.inflight_at_send, now - first.sent_at)
            for h in result.finished:
                r = inflight.pop(h.request_id)
                r.done = True
                assert r.sent_at is not None and h.first_token_at is not None
                tpot = (now - h.first_token_at) / (h.generated - 1) if h.generated > 1 else None
                objective = cfg.tpot_objective_s
                if now <= r.deadline and (objective is None or tpot is None or tpot <= objective):
                    out.good += 1
                    out.good_at.append(now)
                if learning:
                    limiter.on_sample(
                        StreamSample(
                            inflight=r.inflight_at_send,
                            ttft_s=h.first_token_at - r.sent_at,
                            tpot_s=tpot,
                            output_tokens=h.generated,
                            prompt_tokens=h.prompt_tokens,
                        )
                    )
            out.max_waiting = max(out.max_waiting, engine.num_waiting)
        dispatch()
        if not stepping and engine.has_work():
            duration = engine.next_step_duration()
            assert duration is not None
            push(now + duration, "step")
            stepping = True
    out.goodput = out.good / cfg.duration_s
    return out


def converge_s(trace: Sequence[tuple[float, int]], start: float, end: float) -> tuple[float, int]:
    """How long after ``start`` the limit entered, for good, the band around where it settled in
    [start, end); and that settled value (the median of the phase's last third)."""
    phase = [(t, v) for t, v in trace if start <= t < end]
    if not phase:
        return 0.0, 0
    tail = [v for t, v in phase if t >= start + (end - start) * 2 / 3] or [phase[-1][1]]
    settled = round(statistics.median(tail))
    band = max(2.0, 0.15 * settled)
    entered = start
    for t, v in phase:
        if abs(v - settled) > band:
            entered = t
    return max(0.0, entered - start), settled


def phase_good(outcome: Outcome, start: float, end: float) -> int:
    """Good answers that finished in [start, end)."""
    return bisect.bisect_left(outcome.good_at, end) - bisect.bisect_left(outcome.good_at, start)


@dataclass(frozen=True, slots=True)
class Plateau:
    """The fixed limits that do about as well as the best one over a phase.

    Attributes:
        best: the fixed limit with the most good answers finished in the phase (the smallest of
            equals).
        low, high: the run of consecutive fixed limits around ``best`` whose good answers in the
            phase are within the tolerance of the best's.
    """

    best: int
    low: int
    high: int


def _bar(best: int, tolerance: float) -> float:
    """The least count within ``tolerance`` of ``best``, or one answer, whichever is more: a
    count is whole answers (a slow engine finishes ~30 in a phase, where 2 % is a fraction of
    one)."""
    return min((1 - tolerance) * best, best - 1.0)


def plateau(fixed: dict[int, Outcome], start: float, end: float, tolerance: float = 0.02) -> Plateau:
    """Where the fixed limits' goodput over [start, end) is within ``tolerance`` (or one answer)
    of the best."""
    good = {n: phase_good(o, start, end) for n, o in fixed.items()}
    best = max(good, key=lambda n: (good[n], -n))
    bar = _bar(good[best], tolerance)
    low = high = best
    while low - 1 in good and good[low - 1] >= bar:
        low -= 1
    while high + 1 in good and good[high + 1] >= bar:
        high += 1
    return Plateau(best, low, high)


#: Sliding window of the goodput-based convergence (seconds).
GOODPUT_WINDOW_S = 10.0


def _windows(start: float, end: float, window_s: float) -> Iterator[float]:
    """The starts of the windows of ``window_s`` within [start, end], one second apart."""
    t = start
    while t + window_s <= end + 1e-9:
        yield t
        t += 1.0


def _phases(cfg: Config) -> list[tuple[float, float]]:
    """The run's phases: [0, change) and [change, end), or the whole run when nothing changes."""
    if cfg.change_at_s is None:
        return [(0.0, cfg.duration_s)]
    return [(0.0, cfg.change_at_s), (cfg.change_at_s, cfg.duration_s)]


def converge_goodput_s(
    adaptive: Outcome,
    reference: Outcome,
    start: float,
    end: float,
    *,
    tolerance: float = 0.02,
    window_s: float = GOODPUT_WINDOW_S,
) -> float | None:
    """How long after ``start`` the adaptive run's goodput over every later window of
    ``window_s`` (1-s steps, within the phase) stays within ``tolerance`` (or one answer,
    whichever is more: ``b8`` finishes about 8 in 10 s) of the ``reference`` run's (the phase's
    best fixed limit) over the same window, on the same arrivals. None: the last window of the
    phase still falls short."""
    converged: float | None = start
    for t in _windows(start, end, window_s):
        ok = phase_good(adaptive, t, t + window_s) >= _bar(phase_good(reference, t, t + window_s), tolerance)
        if not ok:
            converged = None
        elif converged is None:
            converged = t
    return None if converged is None else converged - start


def converge_envelope_s(
    adaptive: Outcome,
    members: Sequence[Outcome],
    start: float,
    end: float,
    *,
    window_s: float = GOODPUT_WINDOW_S,
) -> float | None:
    """How long after ``start`` the adaptive run's goodput over every later window of
    ``window_s`` (1-s steps, within the phase) is at least the least of the ``members``' over the
    same window: the fixed limits whose goodput over the phase is within 2 % of the best's
    (:func:`plateau`). Each of them, held from the first second, reads 0 by construction: what
    the windows of equally good limits spread by is the noise, and only a window below all of
    them counts as short. None: the last window of the phase still falls short."""
    converged: float | None = start
    for t in _windows(start, end, window_s):
        floor = min(phase_good(m, t, t + window_s) for m in members)
        if phase_good(adaptive, t, t + window_s) < floor:
            converged = None
        elif converged is None:
            converged = t
    return None if converged is None else converged - start


@dataclass(slots=True)
class Row:
    """One engine's comparison.

    Attributes:
        engine: its name in :data:`ENGINES`.
        batch: its ``max_num_seqs``.
        fixed: goodput of every fixed limit tried, by limit.
        adaptive, blind: the adaptive limit's run with the engine's metrics, and with none.
    """

    engine: str
    batch: int
    fixed: dict[int, Outcome]
    adaptive: Outcome
    blind: Outcome

    @property
    def best(self) -> tuple[int, Outcome]:
        return max(self.fixed.items(), key=lambda kv: (kv[1].good, -kv[0]))


def compare(name: str, cfg: Config, limits: Sequence[int] | None = None) -> Row:
    """Every fixed limit (1..2x batch unless given), the adaptive one, and the adaptive one blind."""
    params = ENGINES[name]
    tried = list(limits) if limits is not None else list(range(1, 2 * params.max_num_seqs + 1))
    fixed = {n: run(params, cfg, fixed=n) for n in tried}
    return Row(name, params.max_num_seqs, fixed, run(params, cfg), run(params, cfg, metrics=False))


@dataclass(frozen=True, slots=True)
class Figures:
    """One adaptive run's figures against the fixed limits, per phase (start, then after the
    change: a second value of 0 when there is no change).

    Attributes:
        share: its good answers, as a percentage of the best fixed limit's over the whole run.
        settled: where the limit settled (the median of each phase's last third).
        band_s: convergence by the band of max(2, 15 %) around ``settled``.
        plateau: the range of fixed limits within 2 % of each phase's best fixed goodput.
        goodput_s: convergence by goodput over 10-s windows against the phase's best fixed limit
            (None: never, by the phase's end).
        envelope_s: convergence by goodput over 10-s windows against the least of the fixed
            limits within 2 % of the phase's best (None: never).
        max_waiting: the most the engine's own queue held.
    """

    share: float
    goodput: float
    settled: tuple[int, int]
    band_s: tuple[float, float]
    plateau: tuple[Plateau, Plateau | None]
    goodput_s: tuple[float | None, float | None]
    envelope_s: tuple[float | None, float | None]
    max_waiting: int


def figures(row: Row, o: Outcome, cfg: Config) -> Figures:
    """The figures of one of the row's adaptive runs (``row.adaptive`` or ``row.blind``)."""
    _, best = row.best
    phases = _phases(cfg)
    settled: list[int] = []
    band: list[float] = []
    bands: list[Plateau] = []
    goodput_s: list[float | None] = []
    envelope_s: list[float | None] = []
    for start, end in phases:
        c, v = converge_s(o.trace, start, end)
        settled.append(v)
        band.append(c)
        p = plateau(row.fixed, start, end)
        bands.append(p)
        goodput_s.append(converge_goodput_s(o, row.fixed[p.best], start, end))
        members = [row.fixed[n] for n in range(p.low, p.high + 1)]
        envelope_s.append(converge_envelope_s(o, members, start, end))
    if len(phases) == 1:
        settled.append(settled[0])
        band.append(0.0)
        goodput_s.append(0.0)
        envelope_s.append(0.0)
    return Figures(
        share=100 * o.good / best.good if best.good else 0.0,
        goodput=o.goodput,
        settled=(settled[0], settled[1]),
        band_s=(band[0], band[1]),
        plateau=(bands[0], bands[1] if len(bands) > 1 else None),
        goodput_s=(goodput_s[0], goodput_s[1]),
        envelope_s=(envelope_s[0], envelope_s[1]),
        max_waiting=o.max_waiting,
    )


def _secs(v: float | None) -> str:
    return "never" if v is None else f"{v:.0f}"


def _fmt_row(row: Row, arms: tuple[Figures, Figures]) -> list[str]:
    """The row's cells, from :func:`figures` of its adaptive and its blind run."""
    limit, best = row.best
    cells = [row.engine, str(row.batch), f"{limit}", f"{best.goodput:.2f}", str(best.max_waiting)]
    # The plateaus are the fixed limits', the same in both arms' figures.
    bands = "/".join(f"{p.low}-{p.high}" for p in arms[0].plateau if p is not None)
    cells.append(bands)
    for f in arms:
        cells += [
            f"{f.goodput:.2f} ({f.share:.1f} %)",
            f"{f.settled[0]}/{f.settled[1]}",
            f"{f.band_s[0]:.0f}/{f.band_s[1]:.0f}",
            f"{_secs(f.goodput_s[0])}/{_secs(f.goodput_s[1])}",
            f"{_secs(f.envelope_s[0])}/{_secs(f.envelope_s[1])}",
            str(f.max_waiting),
        ]
    return cells


_ARM = [
    "goodput/s (% best)",
    "limit start/after",
    "converge s, 15 % band",
    "converge s, goodput",
    "converge s, envelope",
    "max wait",
]
HEADER = [
    "engine",
    "batch",
    "best fixed",
    "its goodput/s",
    "its max wait",
    "plateau ±2 % start/after",
    *(f"adaptive {h}" for h in _ARM),
    *(f"blind {h}" for h in _ARM),
]


def table(rows: Sequence[Sequence[str]], header: Sequence[str] = HEADER) -> str:
    """A Markdown table."""
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(r) + " |" for r in rows]
    return "\n".join(lines)


SUMMARY_HEADER = [
    "engine",
    "seeds",
    "metrics: worst % of best (seed)",
    "15 % band s start/change",
    "goodput s",
    "envelope s",
    "max wait",
    "blind: worst % of best (seed)",
    "15 % band s start/change",
    "goodput s",
    "envelope s",
    "max wait",
    "goodput measure on fixed limits ±2 %: unconverged / judged",
]


def goodput_noise(row: Row, cfg: Config) -> tuple[int, int]:
    """The goodput-window measure turned on the fixed limits themselves: of the fixed limits
    within 2 % of each phase's best (at most 12 above it), how many it reads as not converged
    at once, and how many it judged. A limit held from the first second has nothing to converge
    to; what the measure reads there is its noise."""
    late = judged = 0
    for start, end in _phases(cfg):
        p = plateau(row.fixed, start, end)
        for n in range(p.low, min(p.high, p.best + 12) + 1):
            if n == p.best:
                continue
            judged += 1
            c = converge_goodput_s(row.fixed[n], row.fixed[p.best], start, end)
            late += c is None or c > 0
    return late, judged


def summary(
    name: str, per_seed: Sequence[tuple[int, Figures, Figures]], noise: tuple[int, int] | None = None
) -> list[str]:
    """One engine's worst figures over its seeds: the least share of the best fixed, the longest
    convergence by each measure (start/change), the longest engine queue; and ``noise``, what
    :func:`goodput_noise` found over the seeds."""
    seeds = [s for s, _, _ in per_seed]
    cells = [name, f"{min(seeds)}-{max(seeds)}"]

    def worst(xs: Sequence[float | None]) -> str:
        return "never" if any(x is None for x in xs) else f"{max(x for x in xs if x is not None):.0f}"

    for arm in (1, 2):
        figs = [(s, f[arm - 1]) for s, *f in per_seed]
        seed, low = min(figs, key=lambda sf: (sf[1].share, sf[0]))
        cells += [
            f"{low.share:.1f} (#{seed})",
            f"{worst([f.band_s[0] for _, f in figs])}/{worst([f.band_s[1] for _, f in figs])}",
            f"{worst([f.goodput_s[0] for _, f in figs])}/{worst([f.goodput_s[1] for _, f in figs])}",
            f"{worst([f.envelope_s[0] for _, f in figs])}/{worst([f.envelope_s[1] for _, f in figs])}",
            str(max(f.max_waiting for _, f in figs)),
        ]
    cells.append(f"{noise[0]} / {noise[1]}" if noise is not None else "-")
    return cells


_DEFAULT = Config()


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m sluice.bench.limit_model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--engines", default=",".join(ENGINES), help="comma-separated names (default: all)")
    ap.add_argument("--seeds", type=int, default=1, help="arrival seeds per engine (each its own row)")
    ap.add_argument("--first-seed", type=int, default=1, help="the first arrival seed")
    ap.add_argument("--duration", type=float, default=_DEFAULT.duration_s, help="simulated seconds")
    ap.add_argument(
        "--change-at", type=float, default=_DEFAULT.change_at_s, help="when steps double; <0: never"
    )
    ap.add_argument(
        "--change", choices=("step", "kv"), default="step", help="what changes: step costs x2, or KV / 2"
    )
    ap.add_argument("--overload", type=float, default=_DEFAULT.overload)
    ap.add_argument("--patience", type=float, default=_DEFAULT.patience_s)
    ap.add_argument("--poll", type=float, default=_DEFAULT.poll_s)
    ap.add_argument(
        "--tpot-objective",
        type=float,
        default=None,
        help="seconds per output token an answer must meet to count (and the adaptive limit's objective)",
    )
    args = ap.parse_args(argv)
    rows = []
    summaries = []
    for name in args.engines.split(","):
        if name not in ENGINES:
            ap.error(f"unknown engine {name!r}; known: {', '.join(ENGINES)}")
        per_seed: list[tuple[int, Figures, Figures]] = []
        late = judged = 0
        for seed in range(args.first_seed, args.first_seed + args.seeds):
            cfg = Config(
                duration_s=args.duration,
                change_at_s=args.change_at if args.change_at >= 0 else None,
                change=args.change,
                overload=args.overload,
                patience_s=args.patience,
                poll_s=args.poll,
                seed=seed,
                tpot_objective_s=args.tpot_objective,
            )
            row = compare(name, cfg)
            arms = (figures(row, row.adaptive, cfg), figures(row, row.blind, cfg))
            per_seed.append((seed, *arms))
            noise = goodput_noise(row, cfg)
            late, judged = late + noise[0], judged + noise[1]
            cells = _fmt_row(row, arms)
            rows.append(cells if args.seeds == 1 else [f"{name}#{seed}", *cells[1:]])
            print(" | ".join(rows[-1]), flush=True)
        summaries.append(summary(name, per_seed, (late, judged)))
    print()
    print(table(rows))
    if args.seeds > 1:
        print()
        print(table(summaries, SUMMARY_HEADER))


if __name__ == "__main__":
    main()
