"""The queue policies on a model of an engine, in virtual time: seconds per what-if.

Not a benchmark of Sluice (``sluice bench`` runs the real gateway against the simulator for that):
a discrete-event model of one model's queue in front of a continuously batching engine, driven by the
same arrival schedules as ``sluice bench`` and by the real policy, reservation and drain-rate code
from ``sluice.core``. It was used to choose the defaults, and answers "what would this policy do
under that load" in a second.

    python -m sluice.bench.policy_model                      # every policy, steady and spike
    python -m sluice.bench.policy_model --policy codel --param target_s=0.3 --seeds 5
    python -m sluice.bench.policy_model --engine family --seeds 40 --policy codel

The engine (:class:`Engine`): at most ``slots`` sequences at once; every step advances each running
sequence by one token and takes ``step0 + step1 * batch + prefill * (prompt tokens it admits)``
seconds. Answers end at ``max_tokens`` or earlier (:class:`Engine` ``answers``); prompts vary in
length; a KV cache of ``kv_tokens`` preempts the newest sequence when the batch outgrows it (it is
computed again when readmitted, vLLM's recompute). ``article`` fits the simulator's preset (2.1 s
for a 128-token answer alone, 5.5 answers/s with 16 running); ``family`` draws an engine per seed
(:func:`draw_engine`) and scales the loads to its capacity. Clients give up at ``--client-timeout``; a
running job given up is aborted and its tokens count as wasted. ``--retriers`` of the refused
clients wait exactly the Retry-After they were given (unless told not to retry) and try once more.
An admitted job that ends past its deadline (given up, or dropped at dispatch) is a broken promise.
"""

from __future__ import annotations

import argparse
import heapq
import itertools
import math
import random
import statistics
from collections import Counter, deque
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from sluice.bench.burst_limit import TERMS, PromiseTermsCoDel
from sluice.bench.engine_family import (
    ARTICLE,
    ENGINES,
    Engine,
    draw_engine,
    mix_neutral_weight,
    saturated,
)
from sluice.bench.load import Profile, arrivals
from sluice.bench.prompt_mix import PromptMixDrain, PromptWeightFit
from sluice.core import capacity as capacity_rules
from sluice.core.admission import (
    RETRY_SHARE,
    Admitted,
    QueueLimits,
    QueueView,
    Refused,
    Reservations,
    check_deadline,
    reserve,
)
from sluice.core.capacity import DrainRate
from sluice.core.policy import (
    POLICIES,
    Candidate,
    CoDelPolicy,
    PolicyState,
    QueuePolicy,
    learning,
    make_policy,
)


@dataclass(eq=False)
class JobRecord:
    """One client's request in a run of the model, from its arrival to its end: what it asked,
    what admission promised it, and what the engine then did with it. :func:`run` hands every one,
    retries included, to its ``trace``; compared by identity (a retry is a record of its own)."""

    id: int
    """The arrival's index in the run's schedule; a retry keeps the id of the try it repeats."""
    arrived: float
    """Seconds into the run it reached the queue (for a retry: when it came back)."""
    deadline: float
    """When its client gives up: ``arrived`` plus the client's patience (``client_timeout``)."""
    retry: bool
    """If refused, its client waits the Retry-After it is given and tries once more (drawn with
    the chance ``retriers``; unless told not to: ``told_not_to``)."""
    prompt: int
    """Prompt tokens: what the engine prefills when it enters the batch (again, with ``tokens``,
    after a preemption)."""
    answer: int
    """Tokens its answer will have (at most the engine's ``max_tokens``): when it is done."""
    tokens: int = 0
    """Tokens generated so far; kept across a preemption, and also counted as wasted if given up
    while running."""
    started: float = math.nan
    """When it was dispatched to the engine (out of the queue, into a slot); nan if it never was."""
    done: float = math.nan
    """When its last token was generated; nan unless its outcome is ``ok``."""
    outcome: str = ""
    """How it stands or ended: ``queued``, ``running``, ``ok`` (answered), ``refused`` (at
    admission), ``timeout`` (its client gave up, queued or running) or ``expired`` (dropped at
    dispatch: its deadline passed, or too near for its service)."""
    retry_after: float | None = None
    """The Retry-After it was refused with (seconds), None if it was not refused."""
    told_not_to: bool = False
    """Refused with ``x-should-retry: false``: no time within its patience would have room."""
    admitted: bool = False
    """Admission let it into the queue: a promise of an answer by ``deadline``."""
    in_batch: bool = False
    """In the engine's running batch now (dispatched, and neither preempted nor waiting for KV
    cache)."""
    admitted_step: int = 0
    """The engine's step at which it last entered the batch: the newest is the one preempted."""
    retried: bool = False
    """This record is the retry of a refused one (that one's ``retry`` was set)."""
    running_at_start: int = 0
    """The jobs dispatched to the engine, itself included, when it was dispatched: with the count
    at its end, the batch fill it is told it ran beside."""
    promised_wait: float = 0.0
    """The wait in the queue the deadline check allowed for when it was admitted
    (``DrainRate.promised_wait_s``; 0 before the drain rate was measured)."""
    promised_service: float = 0.0
    """The time of its own generation that admission allowed for (``DrainRate.slow_service_s``)."""
    promise_rate: float = 0.0
    """The drain rate, in cost units a second, its wait was promised at
    (``DrainRate.promise_rate_behind``): above a full batch's rate, the estimate was off."""
    slowest_seen: float = 0.0
    """The most seconds per cost unit any job that finished before its admission took: a service
    slower than that is beyond what was measured."""
    preempted: int = 0
    """Times the engine preempted it (KV cache short), each costing a recompute."""
    refused_code: str = ""
    """Why it was refused (the refusal's code, e.g. ``queue_full``), empty if it was not."""
    finish_estimate: float = math.nan
    """For a job given up while running: when it would have finished at the batch's step then."""
    capacity_cost: int = 0
    """Its cost in the capacity model's unit (``prompt_weight`` · prompt + max_tokens) when
    admitted: a broken promise's service is judged per unit of it (:func:`_cause`)."""
    busy_at_start: float = 0.0
    """The run's running-job-seconds so far when it was dispatched (``time_fill``: the time
    average of the batch over its life)."""

    @property
    def broke(self) -> bool:
        """Admitted and then not answered in time: a broken promise (given up or dropped at dispatch)."""
        return self.admitted and self.outcome in ("timeout", "expired")


@dataclass
class Result:
    """One run's figures. ``broken``: admitted jobs that then ended past their deadline (given up
    while queued or running, or dropped at dispatch); ``retries``: clients that came back after
    their Retry-After, ``retries_ok`` those then served; ``told_not_to``: refused retriers told not
    to come back (``x-should-retry: false``)."""

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
    admitted: int = 0
    broken: int = 0
    told_not_to: int = 0
    preemptions: int = 0
    #: how the retries that were not served ended: refused again (and why), given up, dropped at
    #: dispatch
    retry_failures: dict[str, int] = field(default_factory=dict)
    #: the broken promises by cause (:data:`CAUSES`, :func:`_cause`)
    causes: dict[str, int] = field(default_factory=dict)
    #: (prompt, answer) of the jobs served, in the order they finished: a 60-s run's answers are a
    #: sample, and on long-tailed answers its mean is a few percent off the engine's
    #: (``saturated(jobs=...)`` measures the capacity on them)
    served: list[tuple[int, int]] = field(default_factory=list)


def run(
    policy: QueuePolicy,
    profile: Profile,
    seed: int,
    *,
    engine: Engine = ARTICLE,
    client_timeout: float = 15.0,
    retriers: float = 0.0,
    share: float = RETRY_SHARE,
    drain_factory: Callable[[int], DrainRate] | None = None,
    trace: list[JobRecord] | None = None,
    full_rate: float | None = None,
    prompt_weight: float = 1.0,
    fit_prompt_weight: bool = False,
    check_weight: float | None = None,
    time_fill: bool = False,
) -> Result:
    """One run of ``policy`` on ``engine`` under ``profile``. ``full_rate``: the engine's drain
    rate in a full batch, in cost units a second (:func:`saturated`), for telling the broken
    promises' causes apart (:func:`_cause`); ``trace`` gets every job, retries included.

    ``prompt_weight`` (a what-if, issue 18): the capacity model's unit is ``prompt_weight`` ·
    prompt tokens + max_tokens (1: the job's cost, as the brokers count it), for the drain rate,
    the queue's view, the promises and Retry-After's reservation alike; ``fit_prompt_weight``:
    it starts at ``prompt_weight`` and is then learnt from the finished jobs (:class:`PromptWeightFit`).
    ``check_weight``: a job the policy admits must also pass the deadline check in a second unit
    (``check_weight`` · prompt + max_tokens, its own drain rate learnt alongside): the promise at
    the slower of two units' predictions. ``time_fill`` (a what-if): a finished job is told the
    time average of the running jobs over its life, not the mean of their count at its start and
    its end (which the brokers tell: a job that started in a lull and ended in a burst is told a
    half-full batch, though most of its time ran in the lull's)."""
    rng = random.Random(seed + 1)
    sizes = random.Random(f"sizes-{seed}")
    drain = (
        drain_factory(engine.slots) if drain_factory else DrainRate(slots=engine.slots, weigh_per_slot=True)
    )
    state = PolicyState()
    book = Reservations()
    limits = QueueLimits()
    queue: deque[JobRecord] = deque()
    running: list[JobRecord] = []  # dispatched: in the batch, or preempted and waiting in the engine
    waiting: deque[JobRecord] = deque()  # preempted, or dispatched while the KV cache was full
    jobs: list[JobRecord] = []
    events: list[tuple[float, int, str, JobRecord | None]] = []
    seq = itertools.count()
    generated = wasted = preemptions = steps = 0
    slowest = 0.0
    stepping = False
    busy = busy_t = 0.0  # running-job-seconds so far, and when last counted (time_fill)

    m = engine.max_tokens
    weight = prompt_weight
    fit = PromptWeightFit() if fit_prompt_weight else None
    queued_prompt = 0  # the queued jobs' prompt tokens: their cost is read at the weight of the moment

    def cost(job: JobRecord) -> int:
        return round(weight * job.prompt) + m

    drain_b = (
        (drain_factory(engine.slots) if drain_factory else DrainRate(slots=engine.slots))
        if check_weight is not None
        else None
    )

    def cost_b(job: JobRecord) -> int:
        return round((check_weight or 0.0) * job.prompt) + m

    def view_b() -> QueueView:
        n = len(queue)
        queued_cost = round((check_weight or 0.0) * queued_prompt) + m * n
        return QueueView(n, queued_cost, n, queued_cost, n, queued_cost, running=len(running))

    def count_busy(now: float) -> None:
        nonlocal busy, busy_t
        busy += len(running) * (now - busy_t)
        busy_t = now

    def push(t: float, kind: str, job: JobRecord | None = None) -> None:
        heapq.heappush(events, (t, next(seq), kind, job))

    for i, t in enumerate(arrivals(profile, seed)):
        arrival = JobRecord(
            i, t, t + client_timeout, rng.random() < retriers, engine.prompt(sizes), engine.answer(sizes)
        )
        jobs.append(arrival)
        push(t, "arrive", arrival)

    def view() -> QueueView:
        n = len(queue)
        queued_cost = round(weight * queued_prompt) + m * n
        return QueueView(n, queued_cost, n, queued_cost, n, queued_cost, running=len(running))

    def kv_used() -> int:
        return sum(j.prompt + j.tokens for j in running if j.in_batch)

    def fill_batch() -> int:
        """Admit waiting sequences while the KV cache allows; the prompt tokens they prefill."""
        prefill = 0
        while waiting:
            j = waiting[0]
            full = engine.kv_tokens is not None and kv_used() + j.prompt + j.tokens + 1 > engine.kv_tokens
            if full and any(r.in_batch for r in running):
                break
            waiting.popleft()
            j.in_batch, j.admitted_step = True, steps
            prefill += j.prompt + j.tokens
        return prefill

    def schedule_step(now: float) -> None:
        nonlocal stepping
        if stepping:
            return
        prefill = fill_batch()
        batch = sum(1 for j in running if j.in_batch)
        if batch:
            stepping = True
            push(now + engine.step0 + engine.step1 * batch + engine.prefill * prefill, "step")

    def dispatch(now: float) -> None:
        nonlocal queued_prompt
        while queue and len(running) < engine.slots:
            job = queue.pop() if policy.lifo(state, now) else queue.popleft()
            queued_prompt -= job.prompt
            left = job.deadline - now
            if left <= 0 or (drain.measured and left < drain.service_s(cost(job))):
                job.outcome = "expired"
                continue
            job.started, job.outcome = now, "running"
            count_busy(now)
            job.busy_at_start = busy
            running.append(job)
            job.running_at_start = len(running)
            waiting.append(job)
        schedule_step(now)

    while events:
        now, _, kind, job = heapq.heappop(events)
        if kind in ("arrive", "retry"):
            assert job is not None
            if kind == "retry":
                job = replace(job, arrived=now, deadline=now + client_timeout, retried=True, retry=False)
                jobs.append(job)
            if isinstance(drain, PromptMixDrain):  # the queue ahead's mix (--prompt-mix)
                drain.ahead_prompt, drain.ahead_cost = queued_prompt, view().ahead_tokens
                drain.own_prompt, drain.own_cost = job.prompt, cost(job)
            c = Candidate(cost(job), "normal", now, job.deadline, view(), limits, drain)
            try:
                policy.admit(c, state)
                if drain_b is not None and drain_b.measured:
                    check_deadline(
                        cost=cost_b(job), now=now, deadline=job.deadline, view=view_b(), drain=drain_b
                    )
            except Refused as refused:
                r = refused
                if share > 0:  # 0: Retry-After as before reservations, for comparison
                    r = reserve(r, cost=c.cost, now=now, drain=drain, book=book, share=share)
                job.outcome, job.retry_after = "refused", r.retry_after_s
                job.refused_code = r.code
                job.told_not_to = not r.should_retry
                if job.retry and r.should_retry:
                    push(now + r.retry_after_s, "retry", job)
                continue
            job.outcome, job.admitted = "queued", True
            ahead, ahead_jobs = c.view.ahead_tokens, c.view.ahead_jobs
            job.promised_wait = drain.promised_wait_s(ahead, ahead_jobs) if drain.measured else 0.0
            job.promised_service = drain.slow_service_s(c.cost, behind_queue=ahead > 0)
            job.promise_rate, job.slowest_seen = drain.promise_rate_behind(ahead_jobs), slowest
            job.capacity_cost = c.cost
            queue.append(job)
            queued_prompt += job.prompt
            push(job.deadline, "giveup", job)
            dispatch(now)
        elif kind == "giveup":
            assert job is not None
            if job.outcome == "queued":
                job.outcome = "timeout"
                queue.remove(job)
                queued_prompt -= job.prompt
            elif job.outcome == "running":
                job.outcome = "timeout"
                batch_now = sum(1 for r in running if r.in_batch)
                job.finish_estimate = now + (job.answer - job.tokens) * (
                    engine.step0 + engine.step1 * max(batch_now, 1)
                )
                count_busy(now)
                running.remove(job)
                if job in waiting:
                    waiting.remove(job)
                wasted += job.tokens
            dispatch(now)
        elif kind == "step":
            stepping = False
            steps += 1
            for j in [j for j in running if j.in_batch]:
                j.tokens += 1
                generated += 1
                if j.tokens >= j.answer:
                    # The jobs beside it, as the brokers tell the drain rate: the mean of the
                    # running jobs when it started and when it finished, itself included.
                    beside = (j.running_at_start + len(running)) / 2
                    count_busy(now)
                    if time_fill and now > j.started:
                        beside = (busy - j.busy_at_start) / (now - j.started)
                    running.remove(j)
                    j.in_batch = False
                    j.outcome, j.done = "ok", now
                    drain.observe(cost(j), now - j.started, beside)
                    if isinstance(drain, PromptMixDrain):
                        drain.observe_mix(j.prompt, m, j.tokens, now - j.started, beside)
                    if drain_b is not None:
                        drain_b.observe(cost_b(j), now - j.started, beside)
                    slowest = max(slowest, (now - j.started) / cost(j))
                    if fit is not None:
                        weight = fit.observe(j.prompt, m, now - j.started, weight)
            if engine.kv_tokens is not None:
                # The next step needs a token of cache for every sequence: preempt the newest.
                while kv_used() + sum(1 for j in running if j.in_batch) > engine.kv_tokens:
                    batch = [j for j in running if j.in_batch]
                    if len(batch) <= 1:
                        break
                    newest = max(batch, key=lambda j: (j.admitted_step, j.id))
                    newest.in_batch = False
                    newest.preempted += 1
                    waiting.appendleft(newest)
                    preemptions += 1
            dispatch(now)

    if trace is not None:
        trace.extend(jobs)
    d = profile.duration
    first_tries = [j for j in jobs if not j.retried]
    ok = [j for j in jobs if j.outcome == "ok"]
    lat = sorted(j.done - j.arrived for j in ok)
    first = min((j.done for j in ok), default=d)
    in_window = [j for j in ok if j.done <= d]
    retries = [j for j in jobs if j.retried]

    def pct(p: float) -> float:
        return lat[min(len(lat) - 1, int(p * len(lat)))] if lat else math.nan

    return Result(
        goodput=len(in_window) / d,
        goodput_steady=(sum(1 for j in in_window if j.done >= first) - 1) / (d - first) if first < d else 0.0,
        ok_p50=pct(0.5),
        ok_p99=pct(0.99),
        refused=sum(1 for j in first_tries if j.outcome == "refused"),
        timeouts=sum(1 for j in first_tries if j.outcome in ("timeout", "expired")),
        wasted_share=wasted / generated if generated else 0.0,
        retries=len(retries),
        retries_ok=sum(1 for j in retries if j.outcome == "ok"),
        offered=len(first_tries),
        admitted=sum(1 for j in jobs if j.admitted),
        broken=sum(1 for j in jobs if j.broke),
        causes=dict(Counter(_cause(j, full_rate) for j in jobs if j.broke)),
        told_not_to=sum(1 for j in first_tries if j.retry and j.told_not_to),
        preemptions=preemptions,
        served=[(j.prompt, j.answer) for j in sorted(ok, key=lambda j: j.done)],
        retry_failures=dict(
            Counter(
                f"refused {j.refused_code}" if j.outcome == "refused" else j.outcome
                for j in retries
                if j.outcome != "ok"
            )
        ),
    )


#: Why an admitted job ended past its deadline (:func:`_cause`).
CAUSES = {
    "wait, promised above a full batch's rate": "the wait was promised at a rate above the engine's "
    "in a full batch (the drain rate's estimate was off)",
    "wait, the queue ahead ran slower": "promised at most a full batch's rate, but the jobs ahead of "
    "it took longer than that (their answers, preemptions)",
    "own service, preempted": "it started in time, and the engine preempted it (KV cache short)",
    "own service, beyond any seen": "it started in time, and took longer per cost unit than any job "
    "that had finished before it was admitted: the engine did not behave as measured",
    "own service, within what was seen": "it started in time, and took longer than the 95th "
    "percentile it was promised at, but no longer than jobs seen before",
}


def _cause(job: JobRecord, full_rate: float | None) -> str:
    """The cause of one broken promise (a key of :data:`CAUSES`). It is the wait's when the job
    started too late for its promised service to fit (or never started), else its own service's."""
    started = job.started if not math.isnan(job.started) else job.deadline
    if started > job.deadline - job.promised_service:
        if full_rate is not None and job.promise_rate > full_rate:
            return "wait, promised above a full batch's rate"
        return "wait, the queue ahead ran slower"
    if job.preempted:
        return "own service, preempted"
    done = job.done if not math.isnan(job.done) else job.finish_estimate
    if (done - job.started) / job.capacity_cost > job.slowest_seen:
        return "own service, beyond any seen"
    return "own service, within what was seen"


def loads(cap: float, duration: float = 60.0) -> dict[str, Profile]:
    """The article's two loads scaled to a capacity: a standing overload of 1.8x, and a spike of
    0.55x -> 5.5x -> 0.55x (3 -> 30 -> 3 req/s on the article's 5.5)."""
    return {
        "steady 1.8x": Profile("steady", round(1.8 * cap, 3), duration),
        "spike 0.55x-5.5x": Profile(
            "spike", round(0.545 * cap, 3), duration, peak=round(5.45 * cap, 3), spike_at=20.0, spike_for=10.0
        ),
    }


class _AdaptiveLifo(QueuePolicy):
    """A policy, with the queue handed out newest first while ``codel`` counts it as standing."""

    def __init__(self, inner: QueuePolicy) -> None:
        self.inner = inner
        self.codel = inner if isinstance(inner, CoDelPolicy) else CoDelPolicy()
        self.name = inner.name  # type: ignore[misc]

    def admit(self, c: Candidate, state: PolicyState) -> Admitted:
        if self.codel is not self.inner:
            self.codel.observe(
                state,
                c.drain.wait_s(c.view.model_tokens),
                c.now,
                self.codel.target(c),
                learning=learning(c.drain),
            )
        return self.inner.admit(c, state)

    def lifo(self, state: PolicyState, now: float) -> bool:
        return state.standing_since is not None

    def describe(self) -> str:
        return f"{self.inner.describe()} + adaptive LIFO"


def seed_line(seed: int, engine: Engine, pct: float, result: Result, on_served: float | None = None) -> str:
    """One run's figures on one line (``--per-seed``): the medians of a table hide which engines
    miss a target, and the work on a rule starts from those. ``pct``: goodput in % of the
    engine's capacity (the table's figure); ``on_served``: against the capacity on the jobs the
    run served (the standing overload's)."""
    served = "" if on_served is None else f" ({on_served:.1f} % on its served jobs)"
    return (
        f"  - seed {seed} ({engine.slots} slots, {engine.answers} answers): goodput {pct:.1f} %{served}, "
        f"ok p99 {result.ok_p99:.1f} s, broken {result.broken} of {result.admitted}, "
        f"wasted {100 * result.wasted_share:.1f} %, retries ok {result.retries_ok} of {result.retries}"
    )


def _spread(values: list[float], fmt: str = "{:.2f}") -> str:
    """Median, and the worst tenth's bound, of per-run figures."""
    ordered = sorted(v for v in values if not math.isnan(v))
    if not ordered:
        return "-"
    return fmt.format(statistics.median(ordered))


def main() -> None:
    ap = argparse.ArgumentParser(
        prog="python -m sluice.bench.policy_model",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    ap.add_argument("--policy", action="append", choices=sorted(POLICIES), help="repeatable (all)")
    ap.add_argument("--param", action="append", default=[], help="NAME=VALUE for codel or fifo (repeatable)")
    ap.add_argument("--lifo", action="store_true", help="also each policy with adaptive LIFO")
    ap.add_argument("--seeds", type=int, default=5, help="runs per cell (5)")
    ap.add_argument("--first-seed", type=int, default=0, help="seeds FIRST .. FIRST+N-1 (0)")
    ap.add_argument(
        "--draw",
        type=int,
        default=None,
        help="with --engine family: the engine of this seed for every run, the seeds drawing only its "
        "loads and answers (how often one engine breaks a promise, over many draws of its load)",
    )
    ap.add_argument(
        "--engine",
        choices=[*sorted(ENGINES), "family"],
        default="article",
        help="article: the simulator's preset (16 slots); llama-cpu: llama-server with SmolLM2 on 2 vCPUs "
        "(4 slots, 64-token answers), whose sequences slow down 2.7x from alone to a full batch; family: "
        "an engine drawn per seed (draw_engine), loads scaled to its capacity",
    )
    ap.add_argument("--retriers", type=float, default=0.1, help="share of clients that retry once (0.1)")
    ap.add_argument("--share", type=float, default=RETRY_SHARE, help=f"Retry-After's share ({RETRY_SHARE})")
    ap.add_argument(
        "--extrapolation",
        type=float,
        default=capacity_rules.EXTRAPOLATION_SHARE,
        help="how far a promise's slowdown goes toward the bound (capacity.EXTRAPOLATION_SHARE; "
        "0 with --margin-z 0: the promise before it)",
    )
    ap.add_argument(
        "--extrapolation-floor",
        type=float,
        default=0.0,
        help="a what-if: the least share of the way a promise's slowdown goes toward its bound, "
        "whatever the spread of the jobs' times (DrainRate.extrapolation_floor; 0: the brokers' rule)",
    )
    ap.add_argument(
        "--fill-gap",
        type=float,
        default=capacity_rules.FILL_GAP_SHARE,
        help="the promise's share toward its bound per unit of the fill not measured "
        "(capacity.FILL_GAP_SHARE; 0: the rule before it)",
    )
    ap.add_argument(
        "--fill-gap-sd",
        type=float,
        default=capacity_rules.FILL_GAP_SD,
        help="standard deviations of the fills seen above their mean that count as measured "
        "(capacity.FILL_GAP_SD)",
    )
    ap.add_argument(
        "--margin-z",
        type=float,
        default=capacity_rules.WAIT_MARGIN_Z,
        help="standard errors of the rate a promised wait leaves room for (capacity.WAIT_MARGIN_Z)",
    )
    ap.add_argument(
        "--prompt-weight",
        default="1",
        help="a what-if: the capacity model's unit is W * prompt tokens + max_tokens (1: the job's cost, "
        "as the brokers count it); 'fit': learnt from the finished jobs (PromptWeightFit), from 1; "
        "'engine': each engine's mix_neutral_weight (an oracle); 'engine-kv': the same, but at least 1 "
        "on an engine whose KV cache is short of a full batch",
    )
    ap.add_argument(
        "--check-weight",
        type=float,
        default=None,
        help="a what-if: an admitted job must also pass the deadline check with the unit "
        "W * prompt tokens + max_tokens (its own drain rate): the slower of two units' promises",
    )
    ap.add_argument(
        "--burst-limit",
        choices=TERMS,
        default="delay",
        help="a what-if for codel: a burst's delay limit kept as the mean delay it reached (delay, "
        "codel's own), or as the promised wait, with the wait's margin (margin) or the whole promise "
        "(promise): bench/burst_limit.py",
    )
    ap.add_argument(
        "--time-fill",
        action="store_true",
        help="a what-if: a finished job is told the time average of the running jobs over its life, "
        "not the mean of their count at its start and end (the brokers')",
    )
    ap.add_argument(
        "--prompt-mix",
        choices=("off", "up", "both"),
        default="off",
        help="a what-if: the deadline check's promised wait at the queue ahead's prompt/output mix, "
        "the prompt weight learnt from the finishes (bench/prompt_mix.py; up: only ever longer)",
    )
    ap.add_argument("--prompt-mix-ridge", type=float, default=0.5, help="PromptMixDrain.mix_ridge (0.5)")
    ap.add_argument(
        "--slope-z",
        type=float,
        default=0.0,
        help="a what-if: the promise's slowdown at least the fill line's at its slope plus Z standard "
        "errors (DrainRate.slope_z; 0: the brokers' rule)",
    )
    ap.add_argument(
        "--slope-residual",
        action="store_true",
        help="with --slope-z: the jobs' noise about the line read as residual_spread, not spread",
    )
    ap.add_argument("--prompt-mix-share", type=float, default=1.0, help="PromptMixDrain.mix_share (1)")
    ap.add_argument(
        "--prompt-mix-own", action="store_true", help="with --prompt-mix: a job's own time at its own mix too"
    )
    ap.add_argument(
        "--per-seed", action="store_true", help="also each seed's figures, after the table (seed_line)"
    )
    args = ap.parse_args()
    fit_weight = args.prompt_weight == "fit"
    oracle_weight = args.prompt_weight in ("engine", "engine-kv")
    prompt_weight = 1.0 if fit_weight or oracle_weight else float(args.prompt_weight)

    def drain_factory(slots: int) -> DrainRate:
        """The drain rate of each run, with the promise's constants of ``--extrapolation`` and
        ``--margin-z`` (the brokers' are capacity's)."""
        drain = DrainRate(
            slots=slots,
            weigh_per_slot=True,
            extrapolation_share=args.extrapolation,
            wait_margin_z=args.margin_z,
            extrapolation_floor=args.extrapolation_floor,
            fill_gap_share=args.fill_gap,
            fill_gap_sd=args.fill_gap_sd,
            slope_z=args.slope_z,
            slope_residual=args.slope_residual,
        )
        if args.prompt_mix == "off":
            return drain
        return PromptMixDrain(
            **vars(drain),
            mix_both=args.prompt_mix == "both",
            mix_ridge=args.prompt_mix_ridge,
            mix_own=args.prompt_mix_own,
            mix_share=args.prompt_mix_share,
        )

    params = {k: float(v) for k, v in (p.split("=", 1) for p in args.param)}
    policies: list[QueuePolicy] = []
    for name in args.policy or list(POLICIES):
        if name == "codel":
            own = {k: v for k, v in params.items() if k != "max_queued"}
        elif name == "fifo":
            own = {k: int(v) for k, v in params.items() if k == "max_queued"}
        else:
            own = {}
        if name == "codel" and args.burst_limit != "delay":
            policies.append(PromiseTermsCoDel(**own, terms=args.burst_limit))
        else:
            policies.append(make_policy(name, **own))
        if args.lifo:
            policies.append(_AdaptiveLifo(make_policy(name, **own)))
    seeds = range(args.first_seed, args.first_seed + args.seeds)
    if args.draw is not None and args.engine != "family":
        ap.error("--draw needs --engine family")
    engines = {
        s: ENGINES[args.engine]
        if args.engine != "family"
        else draw_engine(s if args.draw is None else args.draw)
        for s in seeds
    }
    weights = {e: mix_neutral_weight(e) if oracle_weight else prompt_weight for e in set(engines.values())}
    if args.prompt_weight == "engine-kv":
        weights = {e: max(w, 1.0) if e.kv_tokens is not None else w for e, w in weights.items()}
    if oracle_weight:
        print(
            "Prompt weights (mix_neutral_weight): "
            + ", ".join(f"{s}: {weights[engines[s]]:.3f}" for s in seeds)
        )
    saturated_by_engine = {e: saturated(e, prompt_weight=weights[e]) for e in set(engines.values())}
    floors = {s: saturated_by_engine[e] for s, e in engines.items()}
    caps = {s: f[0] for s, f in floors.items()}
    possible = [s for s in seeds if floors[s][1] <= 5.0]  # where an ok p99 of 5 s can be had at all
    beyond = ", ".join(f"{s} ({floors[s][1]:.1f} s)" for s in seeds if s not in possible) or "none"
    print(
        "Engines where one job's service in a full batch has a p99 over 5 s (no ok p99 ≤ 5 s at "
        f"full goodput): {beyond}."
    )
    print(f"Seeds {seeds.start}..{seeds.stop - 1}; medians over the runs (p99: of each run's p99).\n")
    print(
        "| policy | load | goodput (% of capacity; target 98 % steady, 73 % spike) | ok p99 | ok p99 ≤ 5 s "
        "| wasted | broken promises "
        "| retries ok | told not to retry |"
    )
    print("|---|---|---|---|---|---|---|---|---|")
    causes: list[str] = []
    matched: list[str] = []
    per_seed: list[str] = []
    for policy in policies:
        for load in ("steady", "spike"):
            results = []
            for s in seeds:
                profile = next(p for k, p in loads(caps[s]).items() if k.startswith(load))
                results.append(
                    (
                        caps[s],
                        run(
                            policy,
                            profile,
                            s,
                            engine=engines[s],
                            retriers=args.retriers,
                            share=args.share,
                            drain_factory=drain_factory,
                            full_rate=floors[s][2],
                            prompt_weight=weights[engines[s]],
                            fit_prompt_weight=fit_weight,
                            check_weight=args.check_weight,
                            time_fill=args.time_fill,
                        ),
                    )
                )
            pct = [100 * (r.goodput_steady if load == "steady" else r.goodput) / c for c, r in results]
            # The standing overload's goodput against the capacity on the jobs each run served
            # (a spike's are chosen by the deadline, short prompts first: not a sample).
            on_served = (
                {
                    s: 100 * r.goodput_steady / saturated(engines[s], jobs=r.served)[0]
                    for s, (_, r) in zip(seeds, results, strict=True)
                    if r.served
                }
                if load == "steady"
                else {}
            )
            waste = [100 * r.wasted_share for _, r in results]
            fast = sum(
                1 for s, (_, r) in zip(seeds, results, strict=True) if s in possible and r.ok_p99 <= 5.0
            )
            target = 98.0 if load == "steady" else 73.0
            met = sum(1 for p in pct if p >= target)
            retries = sum(r.retries for _, r in results)
            retry_ok = 100 * sum(r.retries_ok for _, r in results) / retries if retries else math.nan
            print(
                f"| {policy.describe()} | {load} | {_spread(pct, '{:.0f} %')} (worst {min(pct):.0f} %; "
                f"{met} of {len(pct)} at target) "
                f"| {_spread([r.ok_p99 for _, r in results], '{:.1f} s')} "
                f"| {sum(1 for _, r in results if r.ok_p99 <= 5.0)} of {len(results)} "
                f"({fast} of {len(possible)} where it can be) "
                f"| {_spread(waste, '{:.1f} %')} (worst {max(waste):.1f} %) "
                f"| {sum(r.broken for _, r in results)} of {sum(r.admitted for _, r in results)} "
                f"| {retry_ok:.0f} % of {retries} | {sum(r.told_not_to for _, r in results)} |"
            )
            if args.per_seed:
                per_seed.append(f"- {policy.describe()}, {load}:")
                per_seed.extend(
                    seed_line(s, engines[s], p, r, on_served.get(s))
                    for s, p, (_, r) in zip(seeds, pct, results, strict=True)
                )
            below = ", ".join(f"{s}: {p:.1f} %" for s, p in on_served.items() if p < target) or "none"
            if on_served:
                matched.append(
                    f"- {policy.name}: {_spread(list(on_served.values()), '{:.0f} %')} "
                    f"(worst {min(on_served.values()):.1f} %; "
                    f"{sum(1 for p in on_served.values() if p >= target)} of {len(on_served)} at target; "
                    f"below: {below})"
                )
            by_cause: Counter[str] = Counter()
            for _, r in results:
                by_cause.update(r.causes)
            if by_cause:
                where = ", ".join(
                    f"{s}: {r.broken}" for s, (_, r) in zip(seeds, results, strict=True) if r.broken
                )
                why = "; ".join(f"{n} {cause}" for cause, n in by_cause.most_common())
                causes.append(f"- {policy.name}, {load}: {why} (by seed: {where})")
    if per_seed:
        print("\nEach seed's run (goodput in % of its engine's capacity):")
        print("\n".join(per_seed))
    if matched:
        print("\nSteady goodput against the capacity on the jobs each run served (the engine kept")
        print("saturated with them: a run's answers are a sample, some percent off the engine's):")
        print("\n".join(matched))
    if causes:
        print("\nBroken promises by cause (the wait's when the job started too late for its promised")
        print("service to fit, else its own service's; a full batch's rate: the engine kept saturated):")
        print("\n".join(causes))


if __name__ == "__main__":
    main()
