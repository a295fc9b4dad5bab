"""The engine model of ``sluice sim``, driven step by step on a virtual clock: no sleeping."""

from __future__ import annotations

import math
from dataclasses import replace

import pytest

from sluice.sim.model import (
    PRESETS,
    BatchModel,
    RequestState,
    SimParams,
    SimRequest,
    StepResult,
    capacity_rps,
    estimate_chat_tokens,
    estimate_text_tokens,
    lone_latency_s,
    preset,
    step_duration_s,
    token_text,
)

ARTICLE = PRESETS["article"]


class Clock:
    """Virtual time: each step advances it by exactly the step's duration."""

    def __init__(self) -> None:
        self.now = 0.0

    def step(self, engine: BatchModel) -> StepResult:
        duration = engine.next_step_duration()
        assert duration is not None, "the engine has no work"
        self.now += duration
        result = engine.step(self.now)
        assert result.duration == duration
        return result

    def run_until_idle(self, engine: BatchModel, max_steps: int = 1_000_000) -> list[StepResult]:
        results = []
        while engine.has_work():
            results.append(self.step(engine))
            assert len(results) <= max_steps, "the engine never went idle"
        return results


def submit_many(
    engine: BatchModel, count: int, prompt: int, max_tokens: int, now: float = 0.0
) -> list[SimRequest]:
    return [engine.submit(f"r{i}", prompt, max_tokens, now) for i in range(count)]


def test_lone_request_takes_exactly_the_formula_time() -> None:
    engine, clock = BatchModel(ARTICLE), Clock()
    req = engine.submit("only", prompt_tokens=32, max_tokens=128, now=0.0)

    results = clock.run_until_idle(engine)

    assert len(results) == 128
    assert req.state is RequestState.FINISHED
    assert req.generated == 128
    assert req.first_token_at == pytest.approx(step_duration_s(ARTICLE, 1, 32))
    assert req.finished_at == pytest.approx(lone_latency_s(ARTICLE, 128, 32))
    assert engine.stats.generation_tokens_total == 128
    assert engine.stats.prompt_tokens_total == 32
    assert engine.stats.finished_total == 1
    assert engine.kv_tokens_used == 0


def test_step_duration_counts_running_sequences_and_newly_admitted_prompts() -> None:
    engine = BatchModel(ARTICLE)
    engine.submit("a", 10, 5, 0.0)
    engine.submit("b", 30, 5, 0.0)

    first = engine.next_step_duration()
    engine.step(1.0)
    second = engine.next_step_duration()

    assert first == pytest.approx(
        ARTICLE.base_step_s + 2 * ARTICLE.per_seq_s + 40 * ARTICLE.prefill_s_per_token
    )
    assert second == pytest.approx(ARTICLE.base_step_s + 2 * ARTICLE.per_seq_s)


def test_throughput_with_a_full_batch_matches_the_capacity_formula() -> None:
    engine, clock = BatchModel(ARTICLE), Clock()
    rounds = 10
    submit_many(engine, rounds * ARTICLE.max_num_seqs, prompt=32, max_tokens=128)

    clock.run_until_idle(engine)

    assert engine.stats.finished_total == rounds * ARTICLE.max_num_seqs
    assert engine.stats.finished_total / clock.now == pytest.approx(capacity_rps(ARTICLE, 128, 32))


def test_staggered_arrivals_under_overload_also_finish_at_capacity() -> None:
    """Arrivals faster than capacity keep every slot busy, whatever their phase."""
    engine, clock = BatchModel(ARTICLE), Clock()
    arrivals = [i * 0.1 for i in range(200)]  # 10 req/s, as in the article
    finished_at: list[float] = []
    while arrivals or engine.has_work():
        while arrivals and arrivals[0] <= clock.now:
            engine.submit(f"r{len(arrivals)}", 32, 128, arrivals.pop(0))
        if not engine.has_work():
            clock.now = arrivals[0]
            continue
        finished_at += [r.finished_at for r in clock.step(engine).finished if r.finished_at is not None]

    # Between the 50th and the 150th completion the queue is never empty, so the rate is capacity.
    rate = 100 / (finished_at[150] - finished_at[50])
    assert rate == pytest.approx(capacity_rps(ARTICLE, 128, 32), rel=0.02)


def test_at_most_max_num_seqs_run_and_waiting_requests_are_admitted_in_arrival_order() -> None:
    params = replace(ARTICLE, max_num_seqs=4)
    engine, clock = BatchModel(params), Clock()
    # Different lengths make requests finish out of order, so slots free up at odd times.
    reqs = [engine.submit(f"r{i}", 8, 3 + (i * 7) % 11, 0.0) for i in range(30)]
    admitted: list[str] = []

    while engine.has_work():
        waiting_before = [r.request_id for r in engine.waiting]
        result = clock.step(engine)
        assert engine.num_running <= params.max_num_seqs
        admitted += [r.request_id for r in result.admitted]
        # Whoever was admitted came from the head of the queue, and the rest kept their order.
        assert waiting_before[: len(result.admitted)] == [r.request_id for r in result.admitted]
        assert [r.request_id for r in engine.waiting] == waiting_before[len(result.admitted) :]

    assert admitted == [r.request_id for r in reqs]
    assert all(r.generated == r.max_tokens for r in reqs)


def test_a_request_submitted_after_the_step_was_planned_waits_for_the_next_step() -> None:
    engine = BatchModel(ARTICLE)
    engine.submit("early", 4, 10, 0.0)
    planned = engine.next_step_duration()
    late = engine.submit("late", 4, 10, 0.001)

    result = engine.step(0.02)

    assert [r.request_id for r in result.emitted] == ["early"]
    assert result.duration == planned
    assert late.state is RequestState.WAITING
    assert [r.request_id for r in engine.step(0.04).admitted] == ["late"]


def test_preemption_when_the_kv_cache_runs_out() -> None:
    # Four sequences of up to 10 + 40 tokens cannot all fit in 120 tokens of cache.
    params = replace(ARTICLE, max_num_seqs=4, kv_cache_tokens=120, max_model_len=120)
    engine, clock = BatchModel(params), Clock()
    reqs = submit_many(engine, 4, prompt=10, max_tokens=40)
    first_preemption: tuple[list[str], StepResult] | None = None

    while engine.has_work():
        running_before = [r.request_id for r in engine.running]
        result = clock.step(engine)
        assert engine.kv_tokens_used <= params.kv_cache_tokens
        if result.preempted and first_preemption is None:
            first_preemption = (running_before, result)

    assert first_preemption is not None
    running_before, result = first_preemption
    # The victim is the most recently admitted sequence, and nothing is admitted in that step.
    assert result.preempted[0].request_id == running_before[-1]
    assert result.admitted == ()
    assert engine.stats.preemptions_total >= 1
    assert engine.stats.preemptions_total == sum(r.preemptions for r in reqs)
    # A preempted request keeps its tokens and still ends with exactly max_tokens of them.
    assert all(r.state is RequestState.FINISHED and r.generated == 40 for r in reqs)
    assert engine.stats.generation_tokens_total == 4 * 40
    assert engine.stats.prompt_tokens_total == 4 * 10
    assert engine.stats.recomputed_prefill_tokens_total > 0


def test_a_preempted_request_goes_back_to_the_front_and_pays_for_recompute() -> None:
    params = replace(ARTICLE, max_num_seqs=2, kv_cache_tokens=30, max_model_len=30)
    engine, clock = BatchModel(params), Clock()
    a = engine.submit("a", 10, 20, 0.0)
    b = engine.submit("b", 10, 20, 0.0)
    c = engine.submit("c", 1, 1, 0.0)

    result = clock.step(engine)
    while not result.preempted:
        result = clock.step(engine)

    assert result.preempted == (b,)
    assert engine.waiting == (b, c)
    generated_before = b.generated
    assert generated_before > 0
    while b.state is not RequestState.RUNNING:
        readmitted = clock.step(engine)
    # b's recompute covers its prompt and the tokens it had already produced; c comes in with it.
    assert readmitted.admitted == (b, c)
    expected = step_duration_s(params, 2, (10 + generated_before) + 1)
    assert readmitted.duration == pytest.approx(expected)
    assert engine.stats.recomputed_prefill_tokens_total == 10 + generated_before
    clock.run_until_idle(engine)
    assert (a.generated, b.generated, c.generated) == (20, 20, 1)


def test_aborting_a_running_request_frees_its_slot_and_counts_its_tokens_as_wasted() -> None:
    engine, clock = BatchModel(ARTICLE), Clock()
    doomed = engine.submit("doomed", 16, 100, 0.0)
    other = engine.submit("other", 16, 20, 0.0)
    for _ in range(5):
        clock.step(engine)

    assert engine.abort("doomed", clock.now) is True

    assert doomed.state is RequestState.ABORTED
    assert engine.running == (other,)
    assert engine.kv_tokens_used == other.kv_tokens
    assert engine.stats.aborted_total == 1
    assert engine.stats.wasted_generation_tokens_total == 5
    assert engine.abort("doomed", clock.now) is False
    clock.run_until_idle(engine)
    assert engine.stats.generation_tokens_total == 5 + 20
    assert engine.stats.wasted_generation_tokens_total == 5


def test_aborting_a_waiting_request_removes_it_from_the_queue() -> None:
    engine, clock = BatchModel(replace(ARTICLE, max_num_seqs=1)), Clock()
    first, second, third = submit_many(engine, 3, prompt=4, max_tokens=3)
    clock.step(engine)

    assert engine.abort(second.request_id, clock.now) is True

    assert engine.waiting == (third,)
    assert engine.stats.wasted_generation_tokens_total == 0
    clock.run_until_idle(engine)
    assert (first.state, second.state, third.state) == (
        RequestState.FINISHED,
        RequestState.ABORTED,
        RequestState.FINISHED,
    )
    assert engine.stats.generation_tokens_total == 6


def test_a_request_aborted_during_its_step_emits_nothing() -> None:
    engine = BatchModel(ARTICLE)
    keep = engine.submit("keep", 4, 5, 0.0)
    engine.submit("drop", 4, 5, 0.0)
    engine.next_step_duration()

    engine.abort("drop", 0.01)
    result = engine.step(0.02)

    assert result.emitted == (keep,)
    assert engine.stats.generation_tokens_total == 1
    assert engine.kv_tokens_used == keep.kv_tokens


def test_an_idle_engine_has_no_step() -> None:
    engine = BatchModel(ARTICLE)

    assert engine.next_step_duration() is None
    assert engine.step(1.0) == StepResult(0.0, (), (), (), ())
    assert engine.stats.steps_total == 0


def test_submit_refuses_requests_that_can_never_fit_and_duplicate_ids() -> None:
    engine = BatchModel(replace(ARTICLE, max_model_len=100))

    with pytest.raises(ValueError, match="max_model_len"):
        engine.submit("long", 60, 41, 0.0)
    engine.submit("ok", 60, 40, 0.0)
    with pytest.raises(ValueError, match="already"):
        engine.submit("ok", 1, 1, 0.0)
    with pytest.raises(ValueError):
        engine.submit("empty", 1, 0, 0.0)


@pytest.mark.parametrize(
    "overrides",
    [
        {"max_num_seqs": 0},
        {"kv_cache_tokens": 100, "max_model_len": 200},
        {"base_step_s": 0.0, "per_seq_s": 0.0},
        {"per_seq_s": -1.0},
        {"error_rate": 1.5},
        {"default_max_tokens": 0},
    ],
)
def test_params_reject_impossible_engines(overrides: dict[str, object]) -> None:
    with pytest.raises(ValueError):
        SimParams(**overrides)  # type: ignore[arg-type]


def test_presets_accept_overrides_and_reject_unknown_names() -> None:
    params = preset("fast", max_num_seqs=3, model="m")

    assert (params.max_num_seqs, params.model) == (3, "m")
    assert params.base_step_s == PRESETS["fast"].base_step_s
    with pytest.raises(KeyError):
        preset("nope")
    with pytest.raises(TypeError):
        preset("fast", max_num_sequences=3)


def test_the_article_preset_is_calibrated_to_the_article_engine() -> None:
    assert ARTICLE.max_num_seqs == 16
    assert 2.0 <= lone_latency_s(ARTICLE, 128, 32) <= 2.12
    assert capacity_rps(ARTICLE, 128, 32) == pytest.approx(5.5, abs=0.05)
    # The fast preset has the same shape, 100 times faster.
    fast = PRESETS["fast"]
    assert fast.max_num_seqs == ARTICLE.max_num_seqs
    assert capacity_rps(fast) == pytest.approx(100 * capacity_rps(ARTICLE))


def test_the_llama_cpu_preset_matches_llama_server_on_two_cores() -> None:
    llama = PRESETS["llama-cpu"]

    assert llama.max_num_seqs == 4
    assert 1 / step_duration_s(llama, 4, 0) == pytest.approx(56, rel=0.05)
    assert 1 / step_duration_s(llama, 1, 0) == pytest.approx(176, rel=0.06)


def test_capacity_is_limited_by_the_kv_cache_when_it_is_small() -> None:
    small = replace(ARTICLE, kv_cache_tokens=4 * 160, max_model_len=160)

    assert capacity_rps(small, 128, 32) == pytest.approx(
        4 / (128 * (small.base_step_s + 4 * small.per_seq_s) + 4 * small.prefill_s_per_token * 32)
    )


def test_token_estimates_are_deterministic_and_at_least_one() -> None:
    assert estimate_text_tokens("") == 1
    assert estimate_text_tokens("abcd") == 1
    assert estimate_text_tokens("abcde") == 2
    assert estimate_text_tokens("x" * 400) == 100
    # The gateway's estimate (sluice.core.cost): an empty message counts one token, like empty text.
    assert estimate_chat_tokens(["abcd", ""]) == (4 + 1) + (4 + 1) + 3
    assert estimate_chat_tokens(["hello there"]) == 4 + math.ceil(11 / 4) + 3
    assert [token_text(i) for i in range(3)] == [" tok0", " tok1", " tok2"]
