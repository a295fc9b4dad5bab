"""The engine of the queue policies' model: its shape (:class:`Engine`), the seeded family the
defaults are checked across (:func:`draw_engine`), and what an engine does kept saturated (its
capacity, the p99 of a job's service, the drain rate in cost units, the prompt weight at which that
rate does not depend on the prompts' mix). Used by :mod:`sluice.bench.policy_model`, which runs the
queue in front of it.
"""

from __future__ import annotations

import itertools
import math
import random
import statistics
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass

#: How answers end: at max_tokens; at an end-of-sequence drawn with a constant chance per token
#: (geometric: many short answers, some at the limit); or long-tailed (lognormal, like chat traffic).
ANSWERS = ("fixed", "early", "longtail")


@dataclass(frozen=True)
class Engine:
    """One engine's shape.

    Attributes:
        slots: sequences at once (Sluice's slots for the model, the engine's max_num_seqs).
        step0, step1: seconds of one decoding step, and what each running sequence adds to it.
        prefill: seconds per prompt token a step prefills (a sequence admitted, or readmitted).
        max_tokens: what every client asks for.
        answers: how answers end (:data:`ANSWERS`); ``answer_mean`` is their mean share of
            ``max_tokens`` for ``early`` and their median share for ``longtail`` (whose spread is
            ``answer_sigma``, the log's standard deviation).
        prompt_mean, prompt_sigma: the prompts' median tokens and the log's standard deviation.
        kv_tokens: KV cache, in tokens held by the running sequences (prompt + generated); None:
            never short.
        name: how tables call it.
    """

    slots: int = 16
    step0: float = 0.01592
    step1: float = 0.000406
    prefill: float = 0.0
    max_tokens: int = 128
    answers: str = "fixed"
    answer_mean: float = 1.0
    answer_sigma: float = 0.0
    prompt_mean: int = 32
    prompt_sigma: float = 0.0
    kv_tokens: int | None = None
    name: str = "article"

    def prompt(self, rng: random.Random) -> int:
        if self.prompt_sigma <= 0:
            return self.prompt_mean
        return max(
            1, min(int(self.prompt_mean * math.exp(rng.gauss(0, self.prompt_sigma))), 8 * self.prompt_mean)
        )

    def answer(self, rng: random.Random) -> int:
        m = self.max_tokens
        if self.answers == "early":
            # A constant chance of ending at each token, for a mean of answer_mean * m uncapped.
            return max(1, min(m, int(rng.expovariate(1.0 / (self.answer_mean * m))) + 1))
        if self.answers == "longtail":
            return max(1, min(m, int(self.answer_mean * m * math.exp(rng.gauss(0, self.answer_sigma)))))
        return m

    def describe(self) -> str:
        kv = "" if self.kv_tokens is None else f", KV {self.kv_tokens}"
        shape = self.answers if self.answers == "fixed" else f"{self.answers} {self.answer_mean:.2f}"
        return (
            f"{self.name}: {self.slots} slots, step {1000 * self.step0:.1f} ms"
            f" + {1000 * self.step1:.2f} ms/seq, "
            f"prefill {1e6 * self.prefill:.0f} us/token, answers {shape} of {self.max_tokens}, "
            f"prompts ~{self.prompt_mean}{kv}"
        )


ARTICLE = Engine()
# llama-cpu: fitted to llama-server with SmolLM2-135M on this project's 2-vCPU machines (sluice.bench.llm):
# a 64-token answer takes ~0.55 s alone and 1.46 s in a full batch of 4, 2.74 answers/s at capacity. A
# sequence that slows down this much as the batch fills is what makes a per-slot rate measured at light
# load overestimate the drain rate.
ENGINES: dict[str, Engine] = {
    "article": ARTICLE,
    "llama-cpu": Engine(slots=4, step0=0.0039, step1=0.0047, max_tokens=64, name="llama-cpu"),
}


def draw_engine(seed: int) -> Engine:
    """An engine of the family, by seed: batch of 4 to 64, a full-batch answer of 1.5 to 3.5 s that
    is 1.2 to 3 times as slow as a lone one, prefill from free to a fifth of the decoding, answers at
    max_tokens or ending early or long-tailed, prompts of 16 to 512 tokens that vary, and on some a KV
    cache too small for a full batch of long answers (preemptions)."""
    rng = random.Random(f"engine-{seed}")
    slots = round(2 ** rng.uniform(2, 6))
    max_tokens = rng.choice([64, 128, 256, 512])
    full_answer_s = rng.uniform(1.5, 3.5)
    slowdown = rng.uniform(1.2, 3.0)  # a step with a full batch over a step alone
    full_step = full_answer_s / max_tokens
    step0 = full_step / slowdown
    step1 = (full_step - step0) / max(slots - 1, 1)
    step0 -= step1  # so that step0 + step1 is the lone step
    prompt_mean = int(2 ** rng.uniform(4, 9))
    prefill = rng.choice([0.0, rng.uniform(0, 0.2)]) * full_step * max_tokens / (slots * prompt_mean)
    answers = rng.choice(ANSWERS)
    answer_mean = {"fixed": 1.0, "early": rng.uniform(0.3, 0.8), "longtail": rng.uniform(0.15, 0.5)}[answers]
    sigma = rng.uniform(0.6, 1.2) if answers == "longtail" else 0.0
    kv = None
    if rng.random() < 0.4:  # short of KV: a full batch of long answers does not fit
        kv = int(slots * (prompt_mean + max_tokens) * rng.uniform(0.5, 0.9))
    return Engine(
        slots=slots,
        step0=max(step0, 1e-5),
        step1=step1,
        prefill=prefill,
        max_tokens=max_tokens,
        answers=answers,
        answer_mean=answer_mean,
        answer_sigma=sigma,
        prompt_mean=prompt_mean,
        prompt_sigma=rng.uniform(0.0, 1.0),
        kv_tokens=max(kv, 2 * (prompt_mean + max_tokens)) if kv is not None else None,
        name=f"family-{seed}",
    )


def capacity(engine: Engine, *, seconds: float = 300.0, seed: int = 0) -> float:
    """Answers per second of the engine kept saturated (a backlog that never runs dry, no deadlines)."""
    return saturated(engine, seconds=seconds, seed=seed)[0]


def service_p99(engine: Engine, *, seconds: float = 300.0, seed: int = 0) -> float:
    """The 99th percentile of one job's service time in the engine kept saturated: the floor of
    the ok p99 of any scheduler that keeps its batch full (where it is over 5 s, an ok p99 of
    5 s at full goodput cannot be had)."""
    return saturated(engine, seconds=seconds, seed=seed)[1]


#: The share of :func:`saturated`'s run before it starts counting: the first batch's ramp (and the
#: few answers after it) are the engine's start, not its steady state.
WARM_UP_SHARE = 0.1


def saturated(
    engine: Engine,
    *,
    seconds: float = 300.0,
    seed: int = 0,
    jobs: Sequence[tuple[int, int]] = (),
    prompt_weight: float = 1.0,
) -> tuple[float, float, float]:
    """The engine kept saturated: its answers per second, the p99 of a job's service time, and
    its drain rate in cost units (``prompt_weight`` · prompt + max_tokens) per second. ``jobs``:
    (prompt, answer) pairs to feed it, in turn (its own draws when empty): a run's served jobs
    give the capacity on the very jobs it served (:attr:`Result.served`).

    The first batch fills one slot at a time over ``max_tokens`` steps, as a backlog that builds
    up fills it, and the figures count from :data:`WARM_UP_SHARE` of the run on (and the end of
    that ramp). A full batch started at once keeps its sequences in step: where the KV cache is
    short of a full batch of long answers they outgrow it together, preemptions recompute them
    in step again, and the engine can stay in that churn for good. Seed 146 (45 slots, fixed
    512-token answers) did: 6.5 answers/s, 1,190 preemptions in 300 s and a p99 service of
    10.8 s, where staggered sequences fit the cache (14.4/s, none); its standing overload,
    at 1.8 x 6.5 req/s, was served at 181 % of that "capacity"."""
    sizes = random.Random(f"sizes-capacity-{seed}")
    fed = itertools.cycle(jobs) if jobs else None
    running: list[list[float]] = []  # [prompt, answer, tokens, admitted step, in batch, started]
    waiting: deque[list[float]] = deque()
    t, done, steps = 0.0, 0, 0
    cost_done = 0.0
    services: list[float] = []
    ramp_steps = max(engine.max_tokens, 1)
    counted_from: float | None = None  # when the counting began (the warm-up over)
    while t < seconds:
        if counted_from is None and t >= WARM_UP_SHARE * seconds and steps >= ramp_steps:
            counted_from, done, cost_done = t, 0, 0.0
        fill_to = engine.slots if steps >= ramp_steps else max(1, steps * engine.slots // ramp_steps)
        while len(running) < fill_to:
            prompt, answer = next(fed) if fed else (engine.prompt(sizes), engine.answer(sizes))
            job: list[float] = [prompt, answer, 0, 0, 0, t]
            running.append(job)
            waiting.append(job)
        prefill = 0.0
        while waiting:
            j = waiting[0]
            used = sum(r[0] + r[2] for r in running if r[4])
            if engine.kv_tokens is not None and used + j[0] + j[2] + 1 > engine.kv_tokens and used:
                break
            waiting.popleft()
            j[3], j[4] = steps, 1
            prefill += j[0] + j[2]
        batch = [r for r in running if r[4]]
        t += engine.step0 + engine.step1 * len(batch) + engine.prefill * prefill
        steps += 1
        for r in batch:
            r[2] += 1
            if r[2] >= r[1]:
                running.remove(r)
                done += 1
                cost_done += round(prompt_weight * r[0]) + engine.max_tokens
                if counted_from is not None and r[5] >= counted_from:
                    services.append(t - r[5])
        if engine.kv_tokens is not None:
            while True:
                batch = [r for r in running if r[4]]
                if len(batch) <= 1 or sum(r[0] + r[2] + 1 for r in batch) <= engine.kv_tokens:
                    break
                newest = max(batch, key=lambda r: r[3])
                newest[4] = 0
                waiting.appendleft(newest)
    services.sort()
    p99 = services[min(len(services) - 1, int(0.99 * len(services)))] if services else math.nan
    if counted_from is None or t <= counted_from:
        raise ValueError(f"{seconds} s is too short for {engine.name} to leave its warm-up")
    return done / (t - counted_from), p99, cost_done / (t - counted_from)


def mix_neutral_weight(engine: Engine, *, draws: int = 2000, seconds: float = 120.0) -> float:
    """The prompt weight at which the engine kept saturated drains as many cost units a second
    (``w`` · prompt + max_tokens) on its jobs with the shorter half of the prompts as on those with
    the longer half: what a prompt token costs the engine against a max_token, whether in prefill
    (a step that prefills stalls the whole batch) or in KV cache (a long prompt holds memory a
    full batch of answers needs), on the same answers. An oracle for the what-if
    (``--prompt-weight engine``): it runs the engine offline, which the brokers cannot; within
    [0, 4]."""
    sizes = random.Random(f"sizes-mix-{engine.name}")
    prompts = sorted(engine.prompt(sizes) for _ in range(draws))
    # The same answers, in the same order, behind both halves: only the prompts differ.
    half = draws // 2
    answers = [engine.answer(sizes) for _ in range(half)]
    halves = (
        list(zip(prompts[:half], answers, strict=True)),
        list(zip(prompts[half : 2 * half], answers, strict=True)),
    )
    (short_s, _, _), (long_s, _, _) = (saturated(engine, seconds=seconds, jobs=h) for h in halves)
    p_short, p_long = (statistics.fmean(p for p, _ in h) for h in halves)
    m = engine.max_tokens
    # short_s · (w · p_short + m) = long_s · (w · p_long + m)
    denominator = short_s * p_short - long_s * p_long
    if denominator >= 0 or long_s >= short_s:
        return 0.0
    return min(max(m * (long_s - short_s) / denominator, 0.0), 4.0)
