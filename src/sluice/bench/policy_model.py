"""The queue policies on a model of the article's engine, in virtual time: seconds per what-if.

Not a benchmark of Sluice (``sluice bench`` runs the real gateway against the simulator for that):
a discrete-event model of one model's queue in front of a continuously batching engine, driven by the
same arrival schedules as ``sluice bench`` and by the real policy and drain-rate code from
``sluice.core``. It was used to choose the ``codel`` defaults, and answers "what would this policy do
under that load" in a second.

    python -m sluice.bench.policy_model                      # every policy, steady and spike
    python -m sluice.bench.policy_model --policy codel --param target_s=0.3 --seeds 5

The engine: ``--slots`` sequences at once; every step advances each running sequence by one token
and takes ``step0 + step1 * batch`` seconds (defaults fit the simulator's ``article`` preset: 2.1 s
for a 128-token answer alone, 5.5 answers/s with 16 running). Clients give up at ``--client-timeout``;
a running job given up is aborted and its tokens count as wasted. ``--retriers`` of the refused
clients wait exactly the Retry-After they were given and try once more.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import random
import statistics
from collections import deque
from dataclasses import dataclass, field

from sluice.bench.load import Profile, arrivals
from sluice.core.admission import Admitted, QueueLimits, QueueView, Refused
from sluice.core.capacity import DrainRate
from sluice.core.policy import POLICIES, Candidate, CoDelPolicy, PolicyState, QueuePolicy, make_policy


@dataclass
class _Job:
    id: int
    arrived: float
    deadline: float
    retry: bool
    tokens: int = 0
    started: float = math.nan
    done: float = math.nan
    outcome: str = ""  # ok, refused, timeout (given up), expired (dropped at dispatch)
    retry_after: float | None = None


@dataclass
class Result:
    goodput: float
    goodput_steady: float
    ok_p50: float
    ok_p99: float
    refused: int
    timeouts: int
    wasted_share: float
    retries: int
    retries_ok: int
    offered: int
    series: list[tuple[float, float]] = field(default_factory=list)


def run(
    policy: QueuePolicy,
    profile: Profile,
    seed: int,
    *,
    slots: int = 16,
    answer_tokens: int = 128,
    prompt_tokens: int = 32,
    step0: float = 0.01592,
    step1: float = 0.000406,
    client_timeout: float = 15.0,
    retriers: float = 0.0,
) -> Result:
    cost = prompt_tokens + answer_tokens
    rng = random.Random(seed + 1)
    drain = DrainRate(slots=slots)
    state = PolicyState()
    limits = QueueLimits()
    queue: deque[_Job] = deque()
    running: list[_Job] = []
    jobs: list[_Job] = []
    events: list[tuple[float, int, str, _Job | None]] = []
    seq = itertools.count()
    generated = wasted = 0
    stepping = False

    def push(t: float, kind: str, job: _Job | None = None) -> None:
        heapq.heappush(events, (t, next(seq), kind, job))

    for i, t in enumerate(arrivals(profile, seed)):
        arrival = _Job(i, t, t + client_timeout, retry=rng.random() < retriers)
        jobs.append(arrival)
        push(t, "arrive", arrival)

    def view() -> QueueView:
        n = len(queue)
        return QueueView(n, n * cost, n, n * cost, n, n * cost, running=len(running))

    def dispatch(now: float) -> None:
        nonlocal stepping
        while queue and len(running) < slots:
            job = queue.pop() if policy.lifo(state, now) else queue.popleft()
            left = job.deadline - now
            if left <= 0 or (drain.measured and left < drain.service_s(cost)):
                job.outcome = "expired"
                continue
            job.started = now
            running.append(job)
        if running and not stepping:
            stepping = True
            push(now + step0 + step1 * len(running), "step")

    while events:
        now, _, kind, job = heapq.heappop(events)
        if kind == "arrive" or kind == "retry":
            assert job is not None
            if kind == "retry":
                job.deadline = now + client_timeout
                job.arrived = now
            c = Candidate(cost, "normal", now, job.deadline, view(), limits, drain)
            try:
                policy.admit(c, state)
            except Refused as r:
                if job.retry and kind == "arrive" and r.should_retry:
                    job.retry_after = r.retry_after_s
                    push(now + r.retry_after_s, "retry", job)
                else:
                    job.outcome = "refused"
                continue
            job.outcome = "queued"
            queue.append(job)
            push(job.deadline, "giveup", job)
            dispatch(now)
        elif kind == "giveup":
            assert job is not None
            if job.outcome == "queued":
                job.outcome = "timeout"
                if job in running:
                    running.remove(job)
                    wasted += job.tokens
                else:
                    queue.remove(job)
            dispatch(now)
        elif kind == "step":
            stepping = False
            for j in list(running):
                j.tokens += 1
                generated += 1
                if j.tokens >= answer_tokens:
                    running.remove(j)
                    j.outcome, j.done = "ok", now
                    drain.observe(cost, now - j.started)
            dispatch(now)
            if running and not stepping:
                stepping = True
                push(now + step0 + step1 * len(running), "step")

    d = profile.duration
    ok = [j for j in jobs if j.outcome == "ok"]
    lat = sorted(j.done - j.arrived for j in ok)
    first = min((j.done for j in ok), default=d)
    in_window = [j for j in ok if j.done <= d]
    retried = [j for j in jobs if j.retry_after is not None]

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, int(p * len(lat)))] if lat else math.nan

    return Result(
        goodput=len(in_window) / d,
        goodput_steady=sum(1 for j in in_window if j.done >= first) / (d - first) if first < d else 0.0,
        ok_p50=pct(0.5),
        ok_p99=pct(0.99),
        refused=sum(1 for j in jobs if j.outcome == "refused"),
        timeouts=sum(1 for j in jobs if j.outcome in ("timeout", "expired")),
        wasted_share=wasted / generated if generated else 0.0,
        retries=len(retried),
        retries_ok=sum(1 for j in retried if j.outcome == "ok"),
        offered=len(jobs),
    )


# Engine shapes. article: the simulator's preset. llama-cpu: fitted to llama-server with SmolLM2-135M
# on this project's 2-vCPU machines (sluice.bench.llm): a 64-token answer takes ~0.55 s alone and 1.46 s
# in a full batch of 4, 2.74 answers/s at capacity. A sequence that slows down this much as the batch
# fills is what makes a per-slot rate measured at light load overestimate the drain rate.
ENGINES: dict[str, dict[str, float]] = {
    "article": {"slots": 16, "answer_tokens": 128, "step0": 0.01592, "step1": 0.000406, "capacity": 5.5},
    "llama-cpu": {"slots": 4, "answer_tokens": 64, "step0": 0.0039, "step1": 0.0047, "capacity": 2.74},
}


class _AdaptiveLifo(QueuePolicy):
    """A policy, with the queue handed out newest first while ``codel`` counts it as standing."""

    def __init__(self, inner: QueuePolicy) -> None:
        self.inner = inner
        self.codel = inner if isinstance(inner, CoDelPolicy) else CoDelPolicy()
        self.name = inner.name  # type: ignore[misc]

    def admit(self, c: Candidate, state: PolicyState) -> Admitted:
        if self.codel is not self.inner:
            self.codel.observe(state, c.drain.wait_s(c.view.model_tokens), c.now, self.codel.target(c))
        return self.inner.admit(c, state)

    def lifo(self, state: PolicyState, now: float) -> bool:
        return state.standing_since is not None

    def describe(self) -> str:
        return f"{self.inner.describe()} + adaptive LIFO"


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m sluice.bench.policy_model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--policy", action="append", choices=sorted(POLICIES), help="repeatable (all)")
    ap.add_argument("--param", action="append", default=[], help="NAME=VALUE for codel or fifo (repeatable)")
    ap.add_argument("--lifo", action="store_true", help="also each policy with adaptive LIFO")
    ap.add_argument("--seeds", type=int, default=5, help="runs per cell, seeds 0..N-1 (5)")
    ap.add_argument(
        "--engine",
        choices=sorted(ENGINES),
        default="article",
        help="article: the simulator's preset (16 slots); llama-cpu: llama-server with SmolLM2 on 2 vCPUs "
        "(4 slots, 64-token answers), whose sequences slow down 2.7x from alone to a full batch",
    )
    ap.add_argument("--retriers", type=float, default=0.1, help="share of clients that retry once (0.1)")
    args = ap.parse_args()
    params = {k: float(v) for k, v in (p.split("=", 1) for p in args.param)}
    engine = ENGINES[args.engine]
    cap = engine["capacity"]
    if args.engine == "article":
        profiles = {
            "steady 10": Profile("steady", 10.0, 60.0),
            "spike 3-30-3": Profile("spike", 3.0, 60.0, peak=30.0, spike_at=20.0, spike_for=10.0),
        }
    else:  # the loads of sluice.bench.llm: 1.8x capacity, and 0.5x -> 5x -> 0.5x
        profiles = {
            f"steady {1.8 * cap:.2f}": Profile("steady", round(1.8 * cap, 2), 60.0),
            "spike 0.5x-5x-0.5x": Profile(
                "spike", round(0.5 * cap, 2), 60.0, peak=round(5 * cap, 2), spike_at=20.0, spike_for=10.0
            ),
        }
    shape = {k: v for k, v in engine.items() if k != "capacity"}
    policies: list[QueuePolicy] = []
    for name in args.policy or list(POLICIES):
        if name == "codel":
            own = {k: v for k, v in params.items() if k != "max_queued"}
        elif name == "fifo":
            own = {k: int(v) for k, v in params.items() if k == "max_queued"}
        else:
            own = {}
        policies.append(make_policy(name, **own))
        if args.lifo:
            policies.append(_AdaptiveLifo(make_policy(name, **own)))
    print(f"Means over seeds 0..{args.seeds - 1} (p99: the median of the runs' p99s).\n")
    print("| policy | load | goodput | % of capacity | ok p50 | ok p99 | refused | timed out | retries ok |")
    print("|---|---|---|---|---|---|---|---|---|")
    for policy in policies:
        for load, profile in profiles.items():
            results = [
                run(policy, profile, seed, retriers=args.retriers, **shape)  # type: ignore[arg-type]
                for seed in range(args.seeds)
            ]
            retries = sum(r.retries for r in results)
            retry_ok = sum(r.retries_ok for r in results) / retries if retries else math.nan
            gp = statistics.fmean(r.goodput for r in results)
            p50 = statistics.fmean(r.ok_p50 for r in results)
            p99 = statistics.median(r.ok_p99 for r in results)
            refused = statistics.fmean(r.refused for r in results)
            timeouts = statistics.fmean(r.timeouts for r in results)
            print(
                f"| {policy.describe()} | {load} | {gp:.2f}/s | {100 * gp / cap:.0f} % | "
                f"{p50:.1f} s | {p99:.1f} s | {refused:.0f} | {timeouts:.0f} | {100 * retry_ok:.0f} % |"
            )


if __name__ == "__main__":
    main()
