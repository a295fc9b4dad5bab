"""The virtual-time model of the engine, running the real core code: what the docs' figures rest on."""

from __future__ import annotations

import random

from sluice.bench.engine_family import ARTICLE, capacity, draw_engine, mix_neutral_weight, saturated
from sluice.bench.policy_model import loads, run, seed_line
from sluice.bench.prompt_mix import PromptWeightFit
from sluice.core.capacity import EXTRAPOLATION_SHARE, FILL_GAP_SHARE, WAIT_MARGIN_Z, DrainRate
from sluice.core.policy import CoDelPolicy


def test_the_article_engine_keeps_its_capacity() -> None:
    assert 5.4 < capacity(ARTICLE) < 5.7


def test_retry_after_is_a_reservation_when_every_refused_client_retries() -> None:
    """The article's spike with every refused client retrying once at its Retry-After: with the
    reservations, at least 90 % of those who come back are served; the times of before (the same
    for everyone refused in the same second, share 0 here) served about a quarter."""
    spike = loads(5.5)["spike 0.55x-5.5x"]
    for share, at_least, at_most in ((0.5, 0.9, 1.0), (0.0, 0.0, 0.5)):
        results = [run(CoDelPolicy(), spike, seed, retriers=1.0, share=share) for seed in range(3)]
        retries = sum(r.retries for r in results)
        served = sum(r.retries_ok for r in results) / retries
        assert retries > 100 and at_least <= served <= at_most, (share, served, retries)


def test_the_family_draws_engines_of_every_shape() -> None:
    engines = [draw_engine(seed) for seed in range(40)]
    assert {e.answers for e in engines} == {"fixed", "early", "longtail"}
    assert min(e.slots for e in engines) <= 6 and max(e.slots for e in engines) >= 48
    assert any(e.kv_tokens is not None for e in engines) and any(e.kv_tokens is None for e in engines)
    assert draw_engine(7) == draw_engine(7)


def test_a_burst_on_a_kv_short_engine_keeps_every_promise() -> None:
    """Two engines of the family (50 slots, answers that stop early, a KV cache short of a full
    batch) on the article's spike: with the promise at the rate of a full batch's worst case and
    the rate's error (DrainRate.promise_rate_behind), no admitted job ends past its deadline;
    promised at the fitted line's mean rate, as before (the promise's constants at 0, passed to
    the run's drain rate), 11 and 16 did, each because its wait was promised at a rate above what
    the engine drains in a full batch."""
    for promise in ("now", "before"):
        share, z = (EXTRAPOLATION_SHARE, WAIT_MARGIN_Z) if promise == "now" else (0.0, 0.0)

        def drain(slots: int, share: float = share, z: float = z) -> DrainRate:
            return DrainRate(slots=slots, weigh_per_slot=True, extrapolation_share=share, wait_margin_z=z)

        for seed in (10, 13):
            engine = draw_engine(seed)
            answers_s, _, full_rate = saturated(engine)
            spike = loads(answers_s)["spike 0.55x-5.5x"]
            r = run(
                CoDelPolicy(),
                spike,
                seed,
                engine=engine,
                retriers=0.1,
                drain_factory=drain,
                full_rate=full_rate,
            )
            assert r.admitted > 500 and r.goodput / answers_s > 0.7, (promise, seed, r)
            if promise == "now":
                assert r.broken == 0 and not r.causes, (seed, r.causes)
            else:
                assert r.broken > 5 and set(r.causes) == {"wait, promised above a full batch's rate"}, (
                    r.causes
                )


def test_the_capacity_on_a_runs_own_jobs_is_measured_on_those_jobs() -> None:
    """A standing overload's 60-s run serves a sample of the engine's answers; fed back to the
    saturated engine, those jobs give its capacity on them: answers twice as long halve it, and the
    run's goodput, against its own jobs' capacity, is at the engine's capacity (seed 3 of the family:
    every slot busy the whole run, the served answers some percent longer than the engine's mean)."""
    engine = draw_engine(3)
    answers_s = saturated(engine)[0]
    steady = loads(answers_s)["steady 1.8x"]
    r = run(CoDelPolicy(), steady, 3, engine=engine, retriers=0.1)  # as the model runs it
    assert len(r.served) > 1000 and all(prompt > 0 and answer > 0 for prompt, answer in r.served)
    on_own = saturated(engine, jobs=r.served)[0]
    assert on_own < answers_s  # the served answers run longer than the engine's draws
    assert r.goodput_steady / on_own > 0.98 > r.goodput_steady / answers_s, (
        r.goodput_steady,
        on_own,
        answers_s,
    )
    doubled = saturated(engine, jobs=[(p, 2 * a) for p, a in r.served])[0]
    assert 0.4 * on_own < doubled < 0.6 * on_own


def test_a_burst_on_a_small_engine_with_long_tailed_answers_keeps_every_promise() -> None:
    """Seed 22 of the family (5 slots, answers of up to 256 tokens, long-tailed) on the article's
    spike: its rate, a mean of some fifty jobs, is made of the burst's first finishers and runs
    above what the queue then drains; the wait is promised with room for the jobs ahead's own
    spread as well as the rate's (DrainRate.promise_rate_behind), and no admitted job ends past its
    deadline. With the rate's error alone, 9 did."""
    engine = draw_engine(22)
    answers_s, _, full_rate = saturated(engine)
    spike = loads(answers_s)["spike 0.55x-5.5x"]
    r = run(CoDelPolicy(), spike, 22, engine=engine, retriers=0.1, full_rate=full_rate)
    assert r.admitted > 300 and r.goodput / answers_s > 0.73, r
    assert r.broken == 0 and not r.causes, r.causes


def test_a_seeds_line_names_the_engine_and_the_runs_own_figures() -> None:
    """``--per-seed``: a run's line carries its engine's shape and the figures the table's medians
    are made of, so that the engines missing a target are named (seed 12 of the family, the
    standing overload: 5 slots of fixed answers)."""
    engine = draw_engine(12)
    answers_s = saturated(engine)[0]
    r = run(CoDelPolicy(), loads(answers_s)["steady 1.8x"], 12, engine=engine, retriers=0.1)
    pct = 100 * r.goodput_steady / answers_s
    line = seed_line(12, engine, pct, r, on_served=97.95)
    assert line.startswith("  - seed 12 (5 slots, fixed answers): goodput ")
    assert f"goodput {pct:.1f} % (98.0 % on its served jobs)" in line
    assert f"ok p99 {r.ok_p99:.1f} s, broken {r.broken} of {r.admitted}" in line
    assert f"retries ok {r.retries_ok} of {r.retries}" in line
    assert "on its served jobs" not in seed_line(12, engine, pct, r)


def test_the_prompt_weight_fit_reads_what_a_prompt_token_costs_against_an_answer_token() -> None:
    """``--prompt-weight fit``: service seconds drawn as 1 ms a prompt token and 10 ms a
    max_token (prompts and max_tokens that vary, some noise) give a weight of 0.1; prompts that do
    not vary leave the weight as it was (a line through one point is not drawn)."""
    rng = random.Random(3)
    fit, weight = PromptWeightFit(), 1.0
    for _ in range(2000):
        prompt, max_tokens = rng.randint(16, 512), rng.choice([64, 128, 256])
        weight = fit.observe(
            prompt, max_tokens, (0.001 * prompt + 0.01 * max_tokens) * rng.uniform(0.9, 1.1), weight
        )
    assert abs(weight - 0.1) < 0.02, weight
    flat, weight = PromptWeightFit(), 0.5
    for _ in range(200):
        weight = flat.observe(100, 128, 1.28 * rng.uniform(0.5, 1.5), weight)
    assert weight == 0.5


def test_a_prompt_weight_of_zero_counts_the_capacity_in_max_tokens_alone() -> None:
    """The what-if's unit (``prompt_weight``): at 0 a saturated engine drains its answers per
    second times max_tokens cost units a second; at 1, the job's cost (prompt + max_tokens) as
    before; and a run at 1 is the run of today's unit, figure for figure."""
    engine = draw_engine(3)
    answers_s, _, per_cost = saturated(engine)
    _, _, per_max = saturated(engine, prompt_weight=0.0)
    assert abs(per_max - answers_s * engine.max_tokens) < 1e-6 * per_max
    assert per_cost > per_max
    spike = loads(answers_s)["spike 0.55x-5.5x"]
    today = run(CoDelPolicy(), spike, 3, engine=engine)
    assert run(CoDelPolicy(), spike, 3, engine=engine, prompt_weight=1.0) == today
    assert run(CoDelPolicy(), spike, 3, engine=engine, prompt_weight=0.0) != today


def test_the_oracle_weight_reads_prefill_and_finds_none_where_prompts_are_free() -> None:
    """``--prompt-weight engine``: on an engine whose prefill is free and whose KV cache holds a
    full batch (seed 3 of the family) a long prompt costs nothing, weight 0; on one whose prefill
    stalls the batch (seed 37: 127 us a prompt token) a prompt token weighs a good share of an
    answer's."""
    assert mix_neutral_weight(draw_engine(3)) == 0.0
    assert 0.2 < mix_neutral_weight(draw_engine(37)) < 1.0


def test_a_second_units_deadline_check_refuses_more_where_the_units_differ() -> None:
    """``--check-weight``: a job admitted must also pass the deadline check in a second unit; on
    an engine where the two units read a queue differently (seed 2's spike: prefill 121 us a
    prompt token) the run admits fewer jobs than with the first unit alone."""
    engine = draw_engine(2)
    spike = loads(saturated(engine)[0])["spike 0.55x-5.5x"]
    alone = run(CoDelPolicy(), spike, 2, engine=engine, prompt_weight=0.2)
    checked = run(CoDelPolicy(), spike, 2, engine=engine, prompt_weight=0.2, check_weight=1.0)
    assert checked.admitted < alone.admitted


def test_an_extrapolation_floor_keeps_a_kv_short_engines_fixed_answers_promises() -> None:
    """Seed 42 of the family (12 slots, fixed 512-token answers, a KV cache of 6,532 tokens against
    the ~7,800 a full batch wants): the lull's fills are below the one where preemption starts,
    fixed answers give no spread, and the promise follows the line, which a full batch then drains
    slower than: 4 waits promised above the engine's full-batch rate. With the promise at least a
    quarter of the way to its bound (``extrapolation_floor``, a what-if), none. The spike is
    scaled to 3.94 answers/s, the capacity measured before ``saturated`` ramped its first batch
    (5 % under the engine's 4.14, where neither run breaks a promise)."""
    engine = draw_engine(42)
    _, _, full_rate = saturated(engine)
    spike = loads(3.94)["spike 0.55x-5.5x"]
    broken = {}
    for floor in (0.0, 0.25):

        def drain(slots: int, floor: float = floor) -> DrainRate:
            # the floor alone, without the fill gap's part (the next test's)
            return DrainRate(slots=slots, weigh_per_slot=True, extrapolation_floor=floor, fill_gap_share=0.0)

        r = run(
            CoDelPolicy(), spike, 42, engine=engine, retriers=0.1, drain_factory=drain, full_rate=full_rate
        )
        broken[floor] = (r.broken, r.causes)
    assert broken[0.0] == (4, {"wait, promised above a full batch's rate": 4}), broken
    assert broken[0.25] == (0, {}), broken


def test_the_fill_gap_keeps_a_kv_short_engines_promises_where_the_lull_filled_little() -> None:
    """Seed 56 of the family (27 slots, fixed 256-token answers, a KV cache of 5,416 tokens): the
    lull fills a fifth of the slots, and the line drawn through those fills reads a full batch at
    0.70 of its time; fixed answers give no spread to move the promise. Without the fill gap's
    part (``fill_gap_share`` 0, the rule before it) 2 waits are promised above the engine's
    full-batch rate; with it (capacity.FILL_GAP_SHARE: the promise goes toward its bound for the
    fills never measured) none, and the spike's goodput does not fall. The spike is scaled to
    6.9664 answers/s, the capacity measured before ``saturated`` ramped its first batch (5 % under
    the engine's 7.31, where neither run breaks a promise)."""
    engine = draw_engine(56)
    _, _, full_rate = saturated(engine)
    spike = loads(6.9664)["spike 0.55x-5.5x"]
    out = {}
    for gap in (0.0, FILL_GAP_SHARE):

        def drain(slots: int, gap: float = gap) -> DrainRate:
            return DrainRate(slots=slots, weigh_per_slot=True, fill_gap_share=gap)

        r = run(
            CoDelPolicy(), spike, 56, engine=engine, retriers=0.1, drain_factory=drain, full_rate=full_rate
        )
        out[gap] = (r.broken, r.causes, r.goodput)
    assert out[0.0][:2] == (2, {"wait, promised above a full batch's rate": 2}), out
    assert out[FILL_GAP_SHARE][:2] == (0, {}), out
    assert out[FILL_GAP_SHARE][2] >= out[0.0][2]


def _recording(seen: list[float]) -> type[DrainRate]:
    """A drain rate that keeps the fill each finished job is told."""

    class Recording(DrainRate):
        def observe(self, cost: int, service_s: float, running: float | None = None) -> None:
            seen.append(running or 0.0)
            super().observe(cost, service_s, running)

    return Recording


def test_a_time_averaged_fill_is_told_the_running_jobs_over_a_jobs_life() -> None:
    """``time_fill`` (a what-if): the fill a finished job is told is the time average of the running
    jobs over its life, not the mean of their count at its start and its end (what the brokers
    tell). In the article's spike the two readings part where the batch fills or empties within a
    job's life (the burst's onset, its end), by several jobs; each stays within one job and the
    slots."""
    told: dict[bool, list[float]] = {}
    spike = loads(5.5)["spike 0.55x-5.5x"]
    for time_fill in (False, True):
        seen: list[float] = []
        kind = _recording(seen)

        def drain(slots: int, kind: type[DrainRate] = kind) -> DrainRate:
            return kind(slots=slots, weigh_per_slot=True)

        run(CoDelPolicy(), spike, 0, retriers=0.1, drain_factory=drain, time_fill=time_fill)
        told[time_fill] = seen
    ends, timed = told[False], told[True]
    assert len(ends) > 200 and len(timed) > 200
    assert all(1.0 <= f <= ARTICLE.slots for f in ends + timed)
    apart = [abs(a - b) for a, b in zip(ends[:100], timed[:100], strict=True)]
    assert max(apart) > 2.0, apart
