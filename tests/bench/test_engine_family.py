"""The engine family's saturated engine: the capacity every family figure is a percentage of."""

from __future__ import annotations

import pytest

from sluice.bench.engine_family import Engine, draw_engine, saturated
from sluice.bench.policy_model import loads, run
from sluice.core.policy import CoDelPolicy

#: 8 slots of fixed 128-token answers on 16-token prompts, and a KV cache of 800 tokens: a batch
#: started in step outgrows it (8 x 144 = 1,152 at the end), a staggered one never does (at most
#: 8 x 16 + 16 x (1 + ... + 8) = 704), and a preempted sequence's recompute is dear (2 ms a token).
KV_SHORT = Engine(
    slots=8,
    step0=0.01,
    step1=0.001,
    prefill=0.002,
    max_tokens=128,
    answers="fixed",
    prompt_mean=16,
    kv_tokens=800,
    name="kv-short",
)


def test_a_kv_short_engines_capacity_is_not_its_cold_starts_churn() -> None:
    """A full batch started at once stays in step and keeps preempting (2.54 answers/s before
    the ramp); the capacity is the staggered batch's: every ``max_tokens`` steps of a full batch
    finish ``slots`` answers and prefill ``slots`` prompts, with no preemption."""
    e = KV_SHORT
    staggered = e.slots / (e.max_tokens * (e.step0 + e.step1 * e.slots) + e.slots * e.prompt_mean * e.prefill)
    answers_s, p99, per_cost = saturated(e)
    assert answers_s == pytest.approx(staggered, rel=0.01)
    # One answer in a full batch, alone with its prompt's share of the prefills: no recompute.
    assert p99 < 1.05 * e.max_tokens * (e.step0 + e.step1 * e.slots) + e.slots * e.prompt_mean * e.prefill
    assert per_cost == pytest.approx(answers_s * (e.prompt_mean + e.max_tokens), rel=0.01)


def test_a_standing_overload_is_never_served_above_the_capacity() -> None:
    """Seed 146 (45 slots, fixed 512-token answers, a KV cache short of a full batch): the
    standing 1.8x overload was served at 181 % of the capacity measured from a cold start
    (6.5 answers/s, the engine churning in preemptions); against the staggered engine's it is at
    most the capacity."""
    engine = draw_engine(146)
    answers_s = saturated(engine)[0]
    r = run(CoDelPolicy(), loads(answers_s)["steady 1.8x"], 146, engine=engine, retriers=0.1)
    assert r.preemptions == 0 and r.goodput_steady <= 1.02 * answers_s, (r.goodput_steady, answers_s)


def test_a_run_too_short_to_leave_its_warm_up_is_refused() -> None:
    with pytest.raises(ValueError, match="warm-up"):
        saturated(KV_SHORT, seconds=0.5)
