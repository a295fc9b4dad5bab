"""The prompt-mix what-if of the policy model (bench/prompt_mix.py): the weight it learns from
finishes, the factor it puts on a promised wait, and that it is off unless asked for."""

from __future__ import annotations

import math
import random

import pytest

from sluice.bench.engine_family import draw_engine, saturated
from sluice.bench.policy_model import loads, run
from sluice.bench.prompt_mix import MIX_MAX_FACTOR, MIX_MIN_SAMPLES, PromptMixDrain
from sluice.core.capacity import DrainRate
from sluice.core.policy import CoDelPolicy


def _feed(drain: PromptMixDrain, jobs: int, *, c: float, seed: int = 1) -> tuple[float, float, float]:
    """Finishes of an engine of the module's kind: a generated token costs ``b0 + b1·u`` seconds
    plus the mean prompt mix's stalls, a prompt token ``c`` of its own job (``c·n`` of the
    batch's). Returns the mean prompt, generated tokens and max_tokens fed."""
    rng = random.Random(seed)
    n, b0, b1, m = drain.slots, 0.01, 0.01, 128
    p_mean, g_mean = 300.0 * math.exp(0.5**2 / 2), (1 + m) / 2  # of the draws below
    for _ in range(jobs):
        p = max(1, int(300.0 * rng.lognormvariate(0, 0.5)))
        g = rng.randint(1, m)
        u = rng.uniform(0.2, 1.0)
        stall = c * n * p_mean / g_mean  # the batch's prompts' stalls, per generated token
        s = g * (b0 + b1 * u + stall) + c * p
        drain.observe(p + m, s, u * n)
        drain.observe_mix(p, m, g, s, u * n)
    return p_mean, g_mean, m


def test_the_weight_is_learnt_from_the_finishes_as_a_full_batch_pays_it() -> None:
    drain = PromptMixDrain(slots=8)
    _feed(drain, 2000, c=0.0002)
    # c·n slot-seconds a prompt token against (b0 + b1) · g/m a max_token: 0.0016 / (0.02 · 64.5/128)
    weight = drain.prompt_weight
    assert weight is not None and weight == pytest.approx(0.16, rel=0.25)
    free = PromptMixDrain(slots=8)
    _feed(free, 2000, c=0.0)
    assert free.prompt_weight is not None and free.prompt_weight < 0.02


def test_the_factor_lengthens_a_wait_behind_short_prompts_where_prompts_are_cheap() -> None:
    drain = PromptMixDrain(slots=8)
    _feed(drain, 2000, c=0.0)
    mix = drain.rate_prompt / drain.rate_cost
    cost = 100_000
    drain.ahead_prompt, drain.ahead_cost = round(mix * cost), cost
    assert drain.mix_factor() == pytest.approx(1.0, abs=0.02)  # the mix measured: as today
    drain.ahead_prompt = round(0.5 * mix * cost)  # half the prompt share: longer per cost unit
    longer = drain.mix_factor()
    assert 1.2 < longer <= MIX_MAX_FACTOR
    base = DrainRate.promised_wait_s(drain, cost, 50)
    assert drain.promised_wait_s(cost, 50) == pytest.approx(base * longer)
    drain.ahead_prompt = cost  # all prompt: only ever longer, unless both ways
    assert drain.mix_factor() == 1.0
    drain.mix_both = True
    assert 1 / MIX_MAX_FACTOR <= drain.mix_factor() < 1.0


def test_the_factor_is_one_before_the_weight_is_learnt() -> None:
    drain = PromptMixDrain(slots=8)
    _feed(drain, MIX_MIN_SAMPLES - 1, c=0.0)
    drain.ahead_prompt, drain.ahead_cost = 0, 10_000
    assert drain.prompt_weight is None and drain.mix_factor() == 1.0


def test_a_run_with_the_drain_of_before_is_unchanged_by_the_option_being_there() -> None:
    """Off (the default) the model runs DrainRate itself; with the factor at 1 (share 0) the
    prompt-mix drain decides every admission as it does."""
    engine = draw_engine(97)
    spike = loads(saturated(engine)[0])["spike 0.55x-5.5x"]
    before = run(CoDelPolicy(), spike, 97, engine=engine, retriers=0.1)
    same = run(
        CoDelPolicy(),
        spike,
        97,
        engine=engine,
        retriers=0.1,
        drain_factory=lambda slots: PromptMixDrain(slots=slots, weigh_per_slot=True, mix_share=0.0),
    )
    assert (same.admitted, same.broken, same.served) == (before.admitted, before.broken, before.served)
    assert before.admitted > 100
