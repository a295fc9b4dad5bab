"""Routing by predicted completion against least-loaded, on a fleet of engines of different
speeds, in virtual time: seconds for what minutes of traffic would take, and nothing that moves
with the machine's load.

Not a benchmark of Sluice over HTTP (``sluice bench fleet`` and ``python -m
sluice.bench.prefix_routing`` do that): the simulator's engine model
(:class:`sluice.sim.model.BatchModel`, what ``sluice sim`` serves) for every engine, a FIFO
gateway queue in front of them that sends a job as soon as an engine is under its fixed limit
(its batch size, so that only the routing differs), and the real :class:`~sluice.core.routing.Router`
choosing the engine: ``least-loaded`` (the largest free fraction of the limit) or ``predicted``
(the soonest predicted completion, from each engine's measured seconds per token and TTFT and its
health weight, as the dispatcher passes them). Each engine's speed is measured as the dispatcher
measures it: a :class:`~sluice.core.concurrency.ConcurrencyLimit` fed every finished stream, and
the TTFT smoothed as :meth:`sluice.fleet.Engine.observe_ttft` does.

Arrivals are open-loop Poisson at ``--loads`` times the fleet's capacity (prompts of 16..256
tokens, answers of 32..224, or ``--answer-tokens``); a client gives up ``--patience`` seconds
after it arrived. Goodput: answers finished within their client's patience, per second.

    python -m sluice.bench.route_model                  # the fleet of docs/benchmarks/fleet.md
    python -m sluice.bench.route_model --fleet same     # three engines alike
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field

from sluice.bench.limit_model import table
from sluice.core.concurrency import ConcurrencyLimit, StreamSample
from sluice.core.health import speed_weights
from sluice.core.routing import Candidate, Router
from sluice.fleet import TTFT_SMOOTHING
from sluice.sim.model import BatchModel, SimParams, capacity_rps, preset

PROMPT_RANGE = (16, 256)
OUTPUT_RANGE = (32, 224)
MEAN_PROMPT = sum(PROMPT_RANGE) // 2
MEAN_OUTPUT = sum(OUTPUT_RANGE) // 2

#: The fleets: ``mixed`` is docs/benchmarks/fleet.md's (llama-server on a CPU, the article's
#: engine, a big-batch engine with slow steps); ``same`` three of the article's engine.
FLEETS: dict[str, dict[str, SimParams]] = {
    "mixed": {
        "s4": preset("llama-cpu"),
        "s16": preset("article"),
        "s64": preset("article", max_num_seqs=64, base_step_s=0.040, per_seq_s=0.0005),
    },
    "same": {"a": preset("article"), "b": preset("article"), "c": preset("article")},
}
MODES = ("least-loaded", "predicted")


@dataclass(frozen=True, slots=True)
class Config:
    """One run's knobs: ``load`` is the arrival rate over the fleet's capacity; ``jitter`` the
    spread (sigma of a log-normal factor) of the noise on each stream's measured TTFT and time
    per token, as a loaded gateway's event loop and the network add it (0: exact)."""

    fleet: str = "mixed"
    load: float = 0.5
    duration_s: float = 120.0
    patience_s: float = 30.0
    seed: int = 1
    jitter: float = 0.0
    output: tuple[int, int] = OUTPUT_RANGE


@dataclass(slots=True)
class Outcome:
    """What one run gave: good answers, their end-to-end times and TTFTs, each engine's share of
    the good answers."""

    sent: int = 0
    good: int = 0
    e2e: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    share: dict[str, int] = field(default_factory=dict)


@dataclass(slots=True)
class _Job:
    rid: str
    arrival: float
    prompt: int
    output: int
    done: bool = False
    engine: str | None = None
    sent_at: float = 0.0
    inflight_at_send: int = 0
    first_at: float | None = None


@dataclass(slots=True)
class _Engine:
    name: str
    model: BatchModel
    limit: int
    meter: ConcurrencyLimit
    ttft_s: float | None = None
    inflight: dict[str, _Job] = field(default_factory=dict)
    stepping: bool = False


def fleet_capacity(fleet: dict[str, SimParams], output_tokens: int = MEAN_OUTPUT) -> float:
    """Answers per second the fleet finishes with every slot busy (the simulator's formula)."""
    return sum(capacity_rps(p, output_tokens, MEAN_PROMPT) for p in fleet.values())


def arrivals(cfg: Config) -> list[_Job]:
    """The run's jobs, the same for every mode."""
    rng = random.Random(cfg.seed)
    rate = cfg.load * fleet_capacity(FLEETS[cfg.fleet], sum(cfg.output) // 2)
    out: list[_Job] = []
    t = 0.0
    while True:
        t += rng.expovariate(rate)
        if t >= cfg.duration_s:
            return out
        out.append(_Job(f"r{len(out)}", t, rng.randint(*PROMPT_RANGE), rng.randint(*cfg.output)))


def run(cfg: Config, mode: str) -> Outcome:
    """One run of the fleet under one routing mode."""
    now = 0.0
    engines = {
        name: _Engine(
            name,
            BatchModel(params),
            params.max_num_seqs,
            ConcurrencyLimit(adaptive=False, initial=params.max_num_seqs, clock=lambda: now),
        )
        for name, params in FLEETS[cfg.fleet].items()
    }
    router = Router(affinity=False)
    predicted = mode == "predicted"
    jobs = arrivals(cfg)
    noise = random.Random(cfg.seed + 1_000_003)

    def measured(seconds: float) -> float:
        return seconds * noise.lognormvariate(0.0, cfg.jitter) if cfg.jitter > 0 else seconds

    by_id = {j.rid: j for j in jobs}
    out = Outcome(share={name: 0 for name in engines})
    events: list[tuple[float, int, str, str]] = []
    seq = itertools.count()
    for j in jobs:
        heapq.heappush(events, (j.arrival, next(seq), "arrive", j.rid))
        heapq.heappush(events, (j.arrival + cfg.patience_s, next(seq), "deadline", j.rid))
    queue: deque[_Job] = deque()  # FIFO: a list's pop(0) is O(n) once the queue grows past capacity

    def pick() -> _Engine | None:
        weights = (
            speed_weights({e.name: e.meter.seconds_per_token for e in engines.values()}) if predicted else {}
        )
        candidates = [
            Candidate(
                name=e.name,
                inflight=len(e.inflight),
                limit=e.limit,
                seconds_per_token=e.meter.seconds_per_token if predicted else None,
                ttft_s=e.ttft_s if predicted else None,
                weight=weights.get(e.name, 1.0),
            )
            for e in engines.values()
        ]
        job = queue[0]
        name = router.pick(candidates, prompt_tokens=job.prompt, output_tokens=job.output, prefix=None)
        return engines[name] if name is not None else None

    def dispatch() -> None:
        while queue:
            if queue[0].done:
                queue.popleft()
                continue
            engine = pick()
            if engine is None:
                return
            job = queue.popleft()
            job.engine, job.sent_at = engine.name, now
            job.inflight_at_send = len(engine.inflight) + 1
            engine.model.submit(job.rid, job.prompt, job.output, now)
            engine.inflight[job.rid] = job
            out.sent += 1

    while events:
        now, _, kind, key = heapq.heappop(events)
        if kind == "arrive":
            queue.append(by_id[key])
        elif kind == "deadline":
            job = by_id[key]
            if not job.done:
                job.done = True  # the client gave up: dropped from the queue, or aborted
                if job.engine is not None and key in engines[job.engine].inflight:
                    engines[job.engine].model.abort(key, now)
                    del engines[job.engine].inflight[key]
        else:  # an engine's step ended
            engine = engines[key]
            engine.stepping = False
            result = engine.model.step(now)
            for h in result.emitted:
                job = engine.inflight[h.request_id]
                if h.generated == 1:
                    job.first_at = now
                    ttft = measured(now - job.sent_at)
                    engine.ttft_s = (
                        ttft
                        if engine.ttft_s is None
                        else engine.ttft_s + TTFT_SMOOTHING * (ttft - engine.ttft_s)
                    )
            for h in result.finished:
                job = engine.inflight.pop(h.request_id)
                job.done = True
                assert job.first_at is not None
                tpot = measured((now - job.first_at) / (h.generated - 1)) if h.generated > 1 else None
                engine.meter.on_sample(
                    StreamSample(
                        inflight=job.inflight_at_send,
                        ttft_s=job.first_at - job.sent_at,
                        tpot_s=tpot,
                        output_tokens=h.generated,
                        prompt_tokens=job.prompt,
                    )
                )
                if now <= job.arrival + cfg.patience_s:
                    out.good += 1
                    out.e2e.append(now - job.arrival)
                    out.ttft.append(job.first_at - job.arrival)
                    out.share[engine.name] += 1
        dispatch()
        for engine in engines.values():
            if not engine.stepping and engine.model.has_work():
                duration = engine.model.next_step_duration()
                assert duration is not None
                heapq.heappush(events, (now + duration, next(seq), "step", engine.name))
                engine.stepping = True
    return out


def _q(values: Sequence[float], q: float) -> float:
    if not values:
        return float("nan")
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(q * len(ordered)))]


HEADER = [
    "load",
    "mode",
    "goodput/s (seeds' mean)",
    "e2e p50 / p90 s",
    "TTFT p50 / p90 s",
    "share of good answers",
    "e2e p90 per seed",
]


_DEFAULT = Config()


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m sluice.bench.route_model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--fleet", choices=tuple(FLEETS), default="mixed")
    ap.add_argument(
        "--loads", default="0.25,0.5,0.75,0.9,1.2", help="arrival rates over the fleet's capacity"
    )
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--duration", type=float, default=_DEFAULT.duration_s)
    ap.add_argument("--patience", type=float, default=_DEFAULT.patience_s)
    ap.add_argument("--modes", default=",".join(MODES))
    ap.add_argument("--jitter", type=float, default=0.0, help="log-normal sigma of measurement noise")
    ap.add_argument("--answer-tokens", default="32,224", help="answers' lengths: LOW,HIGH (uniform)")
    args = ap.parse_args(argv)
    modes = args.modes.split(",")
    low, high = (int(x) for x in args.answer_tokens.split(","))
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}; known: {', '.join(MODES)}")
    capacity = fleet_capacity(FLEETS[args.fleet], (low + high) // 2)
    print(f"fleet {args.fleet}: capacity {capacity:.2f} answers/s")
    rows = []
    for load in (float(x) for x in args.loads.split(",")):
        for mode in modes:
            runs = [
                run(
                    Config(args.fleet, load, args.duration, args.patience, seed, args.jitter, (low, high)),
                    mode,
                )
                for seed in range(1, args.seeds + 1)
            ]
            e2e = [x for o in runs for x in o.e2e]
            ttft = [x for o in runs for x in o.ttft]
            good = sum(o.good for o in runs)
            shares = {n: sum(o.share[n] for o in runs) for n in runs[0].share}
            share = " / ".join(f"{n} {100 * v / max(good, 1):.0f} %" for n, v in shares.items())
            rows.append(
                [
                    f"{load:g}",
                    mode,
                    f"{statistics.mean(o.good for o in runs) / args.duration:.2f}",
                    f"{_q(e2e, 0.5):.2f} / {_q(e2e, 0.9):.2f}",
                    f"{_q(ttft, 0.5):.2f} / {_q(ttft, 0.9):.2f}",
                    share,
                    " ".join(f"{_q(o.e2e, 0.9):.1f}" for o in runs),
                ]
            )
            print(" | ".join(rows[-1]), flush=True)
    print()
    print(table(rows, HEADER))


if __name__ == "__main__":
    main()
