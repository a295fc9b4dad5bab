"""Routing by predicted completion against least-loaded, in virtual time: seconds for what minutes
of traffic would take, and nothing that moves with the machine's load.

Not a benchmark of Sluice over HTTP (``sluice bench fleet`` and ``python -m
sluice.bench.prefix_routing`` do that): the simulator's engine model
(:class:`sluice.sim.model.BatchModel`, what ``sluice sim`` serves) for every engine, a FIFO
gateway queue in front of them that sends a job as soon as an engine is under its fixed limit
(its batch size, so that only the routing differs), and the real :class:`~sluice.core.routing.Router`
choosing the engine: ``least-loaded`` (the largest free fraction of the limit), ``predicted``
(the soonest predicted completion, from each engine's measured seconds per token and TTFT and its
health weight, as the dispatcher passes them) or ``affinity`` (predicted, with prefix affinity).
Each engine's speed is measured as the dispatcher measures it: a
:class:`~sluice.core.concurrency.ConcurrencyLimit` fed every finished stream, and the TTFT
smoothed by :func:`sluice.fleet.smoothed_ttft` when the stream ends.

Two workloads:

* ``--workload open`` (the default): a fleet of engines of different speeds. Arrivals are
  open-loop Poisson at ``--loads`` times the fleet's capacity (prompts of 16..256 tokens, answers
  of 32..224, or ``--answer-tokens``); a client gives up ``--patience`` seconds after it arrived.
  Goodput: answers finished within their client's patience, per second.
* ``--workload chat``: the chat workload of ``python -m sluice.bench.prefix_routing``, with the
  same flags and the same seeded conversations (each turn resends the whole conversation, after
  a pause from the previous answer), on engines of that bench (the ``article`` preset, ``--slots``
  sequences, a prefill of ``--prefill-ms-per-token`` and a prefix cache of
  ``--prefix-cache-tokens``). Goodput: answers whose first token came within ``--ttft-slo``, per
  second from the first request to the last answer.

    python -m sluice.bench.route_model                  # the fleet of docs/benchmarks/fleet.md
    python -m sluice.bench.route_model --fleet same     # three engines alike
    python -m sluice.bench.route_model --workload chat  # the chat bench of docs/routing.md
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import random
import statistics
from collections import deque
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field, replace

from sluice.bench.limit_model import table
from sluice.bench.prefix_routing import EngineArgs, Workload, conversation_plan
from sluice.core.concurrency import ConcurrencyLimit, StreamSample
from sluice.core.health import speed_weights
from sluice.core.routing import Candidate, Router, prefix_key
from sluice.fleet import TTFT_SMOOTHING, smoothed_ttft
from sluice.sim.model import (
    BatchModel,
    SimParams,
    capacity_rps,
    estimate_chat_tokens,
    prefix_blocks_of_chat,
    preset,
    token_text,
)

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
MODES = ("least-loaded", "predicted", "affinity")
#: What ``--variant`` may change in what the router is given (docs/routing.md's "Where predicted
#: completion lost" compares them), each a name, or NAME=VALUE for ``ttft-smoothing``:
VARIANTS = {
    "no-prefix": "without affinity, the router is not given the prefix key (as before it counted the cache)",
    "weights-1": "every health weight 1",
    "ttft-at-first-token": "an engine's TTFT folded in at the first token, not at the stream's end",
    "ttft-smoothing": "=W: the TTFT smoothed with weight W for the newest sample",
    "no-ttft": "no TTFT given (the prediction has no prefill)",
    "constant": "once measured, every engine's time per token 0.02 s and TTFT 0.5 s (weights kept)",
    "exact-prefill": "the TTFT given is the engine's unstarted prefills plus this job's own tokens, "
    "times its prefill time per token, plus 20 ms",
    "exact-prefill-cached": "the same, less this job's tokens that the engine's prefix cache holds",
    "one-key": "every job has the same prefix key (as one user or prompt_cache_key for a whole application)",
}
#: The modes run when ``--modes`` is not given, per workload (affinity needs shared prefixes).
DEFAULT_MODES = {"open": "least-loaded,predicted", "chat": "least-loaded,predicted,affinity"}


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


@dataclass(frozen=True, slots=True)
class ChatConfig:
    """One run of the chat workload: ``workload`` as prefix_routing draws it (its seed is the
    run's), ``engines`` as prefix_routing starts them (their ``extra`` flags aside), the client's
    TTFT objective (goodput) and its timeout (``patience_s``), and ``jitter`` as in
    :class:`Config`. The defaults are prefix_routing's."""

    workload: Workload = field(default_factory=Workload)
    engines: EngineArgs = field(default_factory=EngineArgs)
    ttft_slo_s: float = 2.0
    patience_s: float = 120.0
    jitter: float = 0.0

    def fleet(self) -> dict[str, SimParams]:
        """The engines (``sim0``, ``sim1``, ...: the names prefix_routing gives them)."""
        e = self.engines
        params = preset(
            e.preset,
            max_num_seqs=e.slots,
            prefill_s_per_token=e.prefill_ms_per_token / 1000,
            prefix_cache_tokens=e.prefix_cache_tokens,
        )
        return {f"sim{i}": params for i in range(e.engines)}


@dataclass(slots=True)
class Outcome:
    """What one run gave: good answers, their end-to-end times and TTFTs, each engine's share of
    the good answers; for the chat workload also the answers (good or not), the engines' prefix
    cache hits and queries (tokens), and the seconds from the first request to the last answer."""

    sent: int = 0
    good: int = 0
    e2e: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    share: dict[str, int] = field(default_factory=dict)
    answered: int = 0
    requests: int = 0
    cache_hits: int = 0
    cache_queries: int = 0
    elapsed_s: float = 0.0

    @property
    def hit_rate(self) -> float:
        return self.cache_hits / self.cache_queries if self.cache_queries else 0.0

    @property
    def goodput(self) -> float:
        return self.good / self.elapsed_s if self.elapsed_s > 0 else 0.0


@dataclass(slots=True)
class _Job:
    rid: str
    arrival: float
    prompt: int
    output: int
    blocks: tuple[int, ...] = ()
    prefix: str | None = None
    done: bool = False
    engine: str | None = None
    sent_at: float = 0.0
    inflight_at_send: int = 0
    first_at: float | None = None
    finished_at: float | None = None


@dataclass(slots=True)
class _Engine:
    name: str
    model: BatchModel
    limit: int
    meter: ConcurrencyLimit
    ttft_s: float | None = None
    inflight: dict[str, _Job] = field(default_factory=dict)
    stepping: bool = False


class _Gateway:
    """The engines, the gateway's FIFO queue and its router, in virtual time.

    ``on_end(job)`` is called when a job ends, answered (``job.finished_at`` set) or given up.
    """

    def __init__(
        self,
        fleet: Mapping[str, SimParams],
        mode: str,
        *,
        patience_s: float,
        jitter: float,
        noise_seed: int,
        on_end: Callable[[_Job], None] | None = None,
        variant: Mapping[str, str] | None = None,
    ) -> None:
        self.now = 0.0
        self.variant = dict(variant or {})
        self.smoothing = float(self.variant.get("ttft-smoothing", TTFT_SMOOTHING))
        self.engines = {
            name: _Engine(
                name,
                BatchModel(params),
                params.max_num_seqs,
                ConcurrencyLimit(adaptive=False, initial=params.max_num_seqs, clock=lambda: self.now),
            )
            for name, params in fleet.items()
        }
        self.router = Router(affinity=mode == "affinity")
        self.predicted = mode != "least-loaded"
        self.patience_s = patience_s
        self.jitter = jitter
        self.noise = random.Random(noise_seed)
        self.on_end = on_end
        self.jobs: dict[str, _Job] = {}
        self.sent = 0
        self._events: list[tuple[float, int, str, str]] = []
        self._seq = itertools.count()
        self._queue: deque[_Job] = deque()  # FIFO: a list's pop(0) is O(n) past capacity

    def add(self, job: _Job) -> None:
        """The job arrives at ``job.arrival`` (not before now); its client waits ``patience_s``."""
        self.jobs[job.rid] = job
        heapq.heappush(self._events, (job.arrival, next(self._seq), "arrive", job.rid))
        heapq.heappush(self._events, (job.arrival + self.patience_s, next(self._seq), "deadline", job.rid))

    def _measured(self, seconds: float) -> float:
        return seconds * self.noise.lognormvariate(0.0, self.jitter) if self.jitter > 0 else seconds

    def _pick(self, job: _Job) -> _Engine | None:
        engines = self.engines.values()
        predicted, variant = self.predicted, self.variant
        weights = speed_weights({e.name: e.meter.seconds_per_token for e in engines}) if predicted else {}
        if "weights-1" in variant:
            weights = {}
        candidates = [
            Candidate(
                name=e.name,
                inflight=len(e.inflight),
                limit=e.limit,
                seconds_per_token=e.meter.seconds_per_token if predicted else None,
                ttft_s=self._ttft(e, job) if predicted else None,
                weight=weights.get(e.name, 1.0),
            )
            for e in engines
        ]
        if "constant" in variant:
            candidates = [
                replace(c, seconds_per_token=0.02, ttft_s=0.5) if c.seconds_per_token is not None else c
                for c in candidates
            ]
        # As the dispatcher does: the prefix key goes to the router unless it routes least-loaded.
        withheld = "no-prefix" in variant and not self.router.affinity
        key = "one-key" if "one-key" in variant and job.prefix is not None else job.prefix
        prefix = key if predicted and not withheld else None
        name = self.router.pick(candidates, prompt_tokens=job.prompt, output_tokens=job.output, prefix=prefix)
        return self.engines[name] if name is not None else None

    def _ttft(self, e: _Engine, job: _Job) -> float | None:
        """The TTFT the router is given for ``e``: the measured one, or a variant's."""
        variant = self.variant
        if "no-ttft" in variant:
            return None
        if "exact-prefill" not in variant and "exact-prefill-cached" not in variant:
            return e.ttft_s
        cache = e.model.prefix_cache
        pending = 0
        for j in e.inflight.values():
            if j.first_at is None:
                req = e.model.get(j.rid)
                pending += j.prompt - (req.cached_tokens if req is not None and req.admitted_once else 0)
        own = job.prompt
        if "exact-prefill-cached" in variant and job.blocks:
            own -= min(cache.cached_blocks(job.blocks) * cache.block_tokens, job.prompt - 1)
        return (pending + own) * e.model.params.prefill_s_per_token + 0.02

    def _dispatch(self) -> None:
        queue, now = self._queue, self.now
        while queue:
            if queue[0].done:
                queue.popleft()
                continue
            engine = self._pick(queue[0])
            if engine is None:
                return
            job = queue.popleft()
            job.engine, job.sent_at = engine.name, now
            job.inflight_at_send = len(engine.inflight) + 1
            engine.model.submit(job.rid, job.prompt, job.output, now, job.blocks)
            engine.inflight[job.rid] = job
            self.sent += 1

    def _end(self, job: _Job) -> None:
        job.done = True
        if self.on_end is not None:
            self.on_end(job)

    def _stepped(self, engine: _Engine) -> None:
        now = self.now
        engine.stepping = False
        result = engine.model.step(now)
        early = "ttft-at-first-token" in self.variant
        for h in result.emitted:
            if h.generated == 1:
                job = engine.inflight[h.request_id]
                job.first_at = now
                if early:
                    engine.ttft_s = smoothed_ttft(
                        engine.ttft_s, self._measured(now - job.sent_at), self.smoothing
                    )
        for h in result.finished:
            job = engine.inflight.pop(h.request_id)
            job.finished_at = now
            assert job.first_at is not None
            ttft = self._measured(job.first_at - job.sent_at)
            tpot = self._measured((now - job.first_at) / (h.generated - 1)) if h.generated > 1 else None
            # As the dispatcher does: both measurements are read when the stream ends.
            if not early:
                engine.ttft_s = smoothed_ttft(engine.ttft_s, ttft, self.smoothing)
            engine.meter.on_sample(
                StreamSample(
                    inflight=job.inflight_at_send,
                    ttft_s=job.first_at - job.sent_at,
                    tpot_s=tpot,
                    output_tokens=h.generated,
                    prompt_tokens=job.prompt,
                )
            )
            self._end(job)

    def run(self) -> None:
        """Every event until none is left."""
        events = self._events
        while events:
            self.now, _, kind, key = heapq.heappop(events)
            if kind == "arrive":
                self._queue.append(self.jobs[key])
            elif kind == "deadline":
                job = self.jobs[key]
                if not job.done:  # the client gave up: dropped from the queue, or aborted
                    if job.engine is not None and key in self.engines[job.engine].inflight:
                        self.engines[job.engine].model.abort(key, self.now)
                        del self.engines[job.engine].inflight[key]
                    self._end(job)
            else:  # an engine's step ended
                self._stepped(self.engines[key])
            self._dispatch()
            for engine in self.engines.values():
                if not engine.stepping and engine.model.has_work():
                    duration = engine.model.next_step_duration()
                    assert duration is not None
                    heapq.heappush(events, (self.now + duration, next(self._seq), "step", engine.name))
                    engine.stepping = True


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


def run(cfg: Config, mode: str, variant: Mapping[str, str] | None = None) -> Outcome:
    """One run of the fleet under one routing mode (``variant``: see :data:`VARIANTS`)."""
    gateway = _Gateway(
        FLEETS[cfg.fleet], mode, patience_s=cfg.patience_s, jitter=cfg.jitter,
        noise_seed=cfg.seed + 1_000_003, variant=variant,
    )  # fmt: skip
    for job in arrivals(cfg):
        gateway.add(job)
    gateway.run()
    out = Outcome(sent=gateway.sent, share={name: 0 for name in gateway.engines})
    for job in gateway.jobs.values():
        if job.finished_at is None or job.first_at is None or job.engine is None:
            continue
        if job.finished_at <= job.arrival + cfg.patience_s:
            out.good += 1
            out.e2e.append(job.finished_at - job.arrival)
            out.ttft.append(job.first_at - job.arrival)
            out.share[job.engine] += 1
    return out


@dataclass(frozen=True, slots=True)
class _Turn:
    prompt: int
    blocks: tuple[int, ...]
    prefix: str | None


def chat_turns(cfg: ChatConfig) -> tuple[list[float], list[list[float]], list[list[_Turn]]]:
    """Each conversation's start, its pauses after each answer, and its turns' prompts as
    ``sluice sim`` counts them (tokens, prefix-cache blocks) with their prefix keys. Every answer
    is ``max_tokens`` long (the simulator's tokens), so the prompts do not depend on the routing."""
    w = cfg.workload
    systems, plan = conversation_plan(w)
    answer = "".join(token_text(i) for i in range(w.max_tokens))
    block = preset(cfg.engines.preset).prefix_block_tokens
    starts, pauses, turns = [], [], []
    for c in plan:
        messages = [("system", systems[c.system]), ("user", c.first)]
        key = prefix_key({"model": "sim", "messages": [{"role": r, "content": t} for r, t in messages]})
        rows = []
        for turn in range(w.turns):
            tokens = estimate_chat_tokens([t for _, t in messages])
            cached = cfg.engines.prefix_cache_tokens > 0
            blocks = prefix_blocks_of_chat(messages, tokens, block) if cached else ()
            rows.append(_Turn(tokens, blocks, key))
            if turn + 1 < w.turns:
                messages = [*messages, ("assistant", answer), ("user", c.later[turn])]
        starts.append(c.start_s)
        pauses.append(c.pauses)
        turns.append(rows)
    return starts, pauses, turns


def run_chat(cfg: ChatConfig, mode: str, variant: Mapping[str, str] | None = None) -> Outcome:
    """One run of the chat workload under one routing mode (``variant``: see :data:`VARIANTS`):
    each conversation's next turn arrives a pause after its previous answer (a turn given up ends
    the conversation)."""
    w = cfg.workload
    starts, pauses, turns = chat_turns(cfg)

    def job(conversation: int, turn: int, at: float) -> _Job:
        t = turns[conversation][turn]
        return _Job(f"c{conversation}t{turn}", at, t.prompt, w.max_tokens, t.blocks, t.prefix)

    def on_end(j: _Job) -> None:
        c, _, t = j.rid[1:].partition("t")
        conversation, turn = int(c), int(t)
        if j.finished_at is not None and turn + 1 < w.turns:
            gateway.add(job(conversation, turn + 1, j.finished_at + pauses[conversation][turn]))

    gateway = _Gateway(
        cfg.fleet(), mode, patience_s=cfg.patience_s, jitter=cfg.jitter, noise_seed=w.seed + 1_000_003,
        on_end=on_end, variant=variant,
    )  # fmt: skip
    for i, start in enumerate(starts):
        gateway.add(job(i, 0, start))
    gateway.run()
    out = Outcome(sent=gateway.sent, share={name: 0 for name in gateway.engines})
    out.requests = len(gateway.jobs)
    ends = []
    for j in gateway.jobs.values():
        if j.finished_at is None or j.first_at is None or j.engine is None:
            continue
        out.answered += 1
        ends.append(j.finished_at)
        out.e2e.append(j.finished_at - j.arrival)
        out.ttft.append(j.first_at - j.arrival)
        if j.first_at - j.arrival <= cfg.ttft_slo_s:
            out.good += 1
            out.share[j.engine] += 1
    out.elapsed_s = max(ends, default=0.0) - min(starts, default=0.0)
    for e in gateway.engines.values():
        out.cache_hits += e.model.stats.prefix_cache_hits_total
        out.cache_queries += e.model.stats.prefix_cache_queries_total
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
CHAT_HEADER = [
    "mode",
    "hit rate",
    "TTFT p50 / p90 s",
    "e2e p50 / p90 s",
    "goodput/s (seeds' mean)",
    "answered / requests",
    "goodput per seed",
]


_DEFAULT = Config()


def _share(runs: Sequence[Outcome]) -> str:
    good = sum(o.good for o in runs)
    shares = {n: sum(o.share[n] for o in runs) for n in runs[0].share}
    return " / ".join(f"{n} {100 * v / max(good, 1):.0f} %" for n, v in shares.items())


def _open_rows(args: argparse.Namespace, modes: Sequence[str]) -> list[list[str]]:
    low, high = (int(x) for x in args.answer_tokens.split(","))
    capacity = fleet_capacity(FLEETS[args.fleet], (low + high) // 2)
    print(f"fleet {args.fleet}: capacity {capacity:.2f} answers/s")
    rows = []
    for load in (float(x) for x in args.loads.split(",")):
        for mode in modes:
            runs = [
                run(
                    Config(args.fleet, load, args.duration, args.patience, seed, args.jitter, (low, high)),
                    mode,
                    args.variant,
                )
                for seed in range(1, args.seeds + 1)
            ]
            e2e = [x for o in runs for x in o.e2e]
            ttft = [x for o in runs for x in o.ttft]
            rows.append(
                [
                    f"{load:g}",
                    mode,
                    f"{statistics.mean(o.good for o in runs) / args.duration:.2f}",
                    f"{_q(e2e, 0.5):.2f} / {_q(e2e, 0.9):.2f}",
                    f"{_q(ttft, 0.5):.2f} / {_q(ttft, 0.9):.2f}",
                    _share(runs),
                    " ".join(f"{_q(o.e2e, 0.9):.1f}" for o in runs),
                ]
            )
            print(" | ".join(rows[-1]), flush=True)
    return rows


def _chat_rows(args: argparse.Namespace, modes: Sequence[str]) -> list[list[str]]:
    w = Workload(
        systems=args.systems, system_tokens=args.system_tokens, doc_tokens=args.doc_tokens,
        turns=args.turns, conversations=args.conversations, rate=args.rate,
    )  # fmt: skip
    engines = EngineArgs(prefix_cache_tokens=args.prefix_cache_tokens)
    cfg = ChatConfig(w, engines, jitter=args.jitter)
    rows = []
    for mode in modes:
        runs = [
            run_chat(replace(cfg, workload=replace(w, seed=seed)), mode, args.variant)
            for seed in range(1, args.seeds + 1)
        ]
        e2e = [x for o in runs for x in o.e2e]
        ttft = [x for o in runs for x in o.ttft]
        hits = sum(o.cache_hits for o in runs) / max(sum(o.cache_queries for o in runs), 1)
        rows.append(
            [
                mode,
                f"{100 * hits:.1f} %",
                f"{_q(ttft, 0.5):.2f} / {_q(ttft, 0.9):.2f}",
                f"{_q(e2e, 0.5):.2f} / {_q(e2e, 0.9):.2f}",
                f"{statistics.mean(o.goodput for o in runs):.2f}",
                f"{sum(o.answered for o in runs)} / {sum(o.requests for o in runs)}",
                " ".join(f"{o.goodput:.2f}" for o in runs),
            ]
        )
        print(" | ".join(rows[-1]), flush=True)
    return rows


def _variant(text: str) -> dict[str, str]:
    out: dict[str, str] = {}
    for item in filter(None, text.split(",")):
        name, _, value = item.partition("=")
        if name not in VARIANTS:
            raise argparse.ArgumentTypeError(f"unknown variant {name!r}; known: {', '.join(VARIANTS)}")
        out[name] = value
    return out


def main(argv: Sequence[str] | None = None) -> None:
    ap = argparse.ArgumentParser(
        prog="python -m sluice.bench.route_model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--workload", choices=tuple(DEFAULT_MODES), default="open")
    ap.add_argument("--modes", help="comma-separated (default: least-loaded,predicted; chat adds affinity)")
    ap.add_argument("--seeds", type=int, default=5)
    ap.add_argument("--jitter", type=float, default=0.0, help="log-normal sigma of measurement noise")
    ap.add_argument(
        "--variant",
        type=_variant,
        default={},
        help="comma-separated changes to what the router is given: "
        + "; ".join(f"{k}{'' if v.startswith('=') else ': '}{v}" for k, v in VARIANTS.items()),
    )
    open_ = ap.add_argument_group("the open workload")
    open_.add_argument("--fleet", choices=tuple(FLEETS), default="mixed")
    open_.add_argument(
        "--loads", default="0.25,0.5,0.75,0.9,1.2", help="arrival rates over the fleet's capacity"
    )
    open_.add_argument("--duration", type=float, default=_DEFAULT.duration_s)
    open_.add_argument("--patience", type=float, default=_DEFAULT.patience_s)
    open_.add_argument("--answer-tokens", default="32,224", help="answers' lengths: LOW,HIGH (uniform)")
    chat = ap.add_argument_group("the chat workload (prefix_routing's flags and defaults)")
    d = Workload()
    chat.add_argument("--systems", type=int, default=d.systems)
    chat.add_argument("--system-tokens", type=int, default=d.system_tokens)
    chat.add_argument("--doc-tokens", type=int, default=d.doc_tokens)
    chat.add_argument("--turns", type=int, default=d.turns)
    chat.add_argument("--conversations", type=int, default=d.conversations)
    chat.add_argument("--rate", type=float, default=d.rate, help="conversations started per second")
    chat.add_argument("--prefix-cache-tokens", type=int, default=EngineArgs().prefix_cache_tokens)
    args = ap.parse_args(argv)
    modes = (args.modes or DEFAULT_MODES[args.workload]).split(",")
    for m in modes:
        if m not in MODES:
            ap.error(f"unknown mode {m!r}; known: {', '.join(MODES)}")
    if args.workload == "open":
        rows, header = _open_rows(args, modes), HEADER
    else:
        rows, header = _chat_rows(args, modes), CHAT_HEADER
    print()
    print(table(rows, header))


if __name__ == "__main__":
    main()
