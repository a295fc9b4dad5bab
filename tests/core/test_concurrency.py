"""ConcurrencyLimit on its own: each signal moves the limit the way it should, within floor and ceiling."""

from __future__ import annotations

import json
import math

import pytest

from sluice.core.concurrency import LOOKAHEAD, ConcurrencyLimit, EngineLoad, LimitPhase, StreamSample


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def advance(self, s: float) -> None:
        self.now += s


def _load(running: int, waiting: int = 0, kv: float | None = 0.1, preemptions: int | None = 0) -> EngineLoad:
    return EngineLoad(running=running, waiting=waiting, kv_usage=kv, preemptions=preemptions)


def _sample(inflight: int, tpot: float = 0.02, ttft: float = 0.05) -> StreamSample:
    return StreamSample(inflight=inflight, ttft_s=ttft, tpot_s=tpot, output_tokens=64, prompt_tokens=32)


def _engine(limiter: ConcurrencyLimit, clock: Clock, slots: int, seconds: float, poll_s: float = 0.5) -> None:
    """An engine with ``slots`` slots that is always sent the limit: it runs what fits and queues
    the rest, and says so on every poll."""
    for _ in range(int(seconds / poll_s)):
        clock.advance(poll_s)
        sent = limiter.limit
        limiter.on_engine_load(_load(min(sent, slots), max(0, sent - slots)))


def test_a_fixed_limit_stays_whatever_the_signals() -> None:
    clock = Clock()
    limiter = ConcurrencyLimit(ceiling=8, adaptive=False, clock=clock)
    assert limiter.limit == 8 and limiter.phase is LimitPhase.FIXED
    limiter.on_overload()
    limiter.on_engine_load(_load(8, waiting=5))
    clock.advance(5)
    limiter.on_sample(_sample(8, tpot=0.5))
    assert limiter.limit == 8
    assert limiter.seconds_per_token == pytest.approx(0.5)


def test_a_fixed_limit_needs_a_value() -> None:
    with pytest.raises(ValueError):
        ConcurrencyLimit(adaptive=False)
    with pytest.raises(ValueError):
        ConcurrencyLimit(ceiling=2, floor=3)
    with pytest.raises(ValueError):
        ConcurrencyLimit(floor=0)


def test_the_limit_grows_to_the_engines_batch_and_stops_where_it_queues() -> None:
    clock = Clock()
    limiter = ConcurrencyLimit(clock=clock)
    assert limiter.limit == 4
    _engine(limiter, clock, slots=48, seconds=30)
    # It doubled past 48, saw the queue, and came back to what the engine runs.
    assert limiter.limit == 48
    assert limiter.snapshot()["known_capacity"] == 48
    assert limiter.phase is LimitPhase.STEADY


def test_probes_past_the_known_capacity_are_rare_and_come_back() -> None:
    clock = Clock()
    limiter = ConcurrencyLimit(clock=clock, reprobe_s=10)
    _engine(limiter, clock, slots=16, seconds=20)
    seen = []
    for _ in range(240):
        clock.advance(0.5)
        sent = limiter.limit
        seen.append(sent)
        limiter.on_engine_load(_load(min(sent, 16), max(0, sent - 16)))
    assert min(seen) == 16
    assert max(seen) == 17  # a probe of one, now and then
    assert seen.count(17) < len(seen) / 4


def test_a_single_waiting_request_on_one_poll_is_not_queueing() -> None:
    clock = Clock()
    limiter = ConcurrencyLimit(clock=clock, initial=8)
    clock.advance(3)
    for _ in range(2):
        limiter.on_engine_load(_load(7, waiting=1))
        clock.advance(0.5)
        limiter.on_engine_load(_load(7))  # the request was admitted: 7 running, below the limit
        clock.advance(0.5)
    assert limiter.limit == 8
    # On three polls in a row it is a queue, and the limit is what the engine runs.
    for _ in range(3):
        limiter.on_engine_load(_load(7, waiting=1))
        clock.advance(0.5)
    assert limiter.limit == 7


def test_the_ceiling_is_never_exceeded() -> None:
    clock = Clock()
    limiter = ConcurrencyLimit(clock=clock, ceiling=10)
    _engine(limiter, clock, slots=64, seconds=30)
    assert limiter.limit == 10


def test_an_engine_that_grows_is_found_again() -> None:
    clock = Clock()
    limiter = ConcurrencyLimit(clock=clock, reprobe_s=5)
    _engine(limiter, clock, slots=8, seconds=20)
    assert limiter.limit in (8, 9)  # 9: a probe
    _engine(limiter, clock, slots=32, seconds=120)
    assert limiter.limit >= 28


def test_the_limit_does_not_grow_while_it_does_not_bind() -> None:
    clock = Clock()
    limiter = ConcurrencyLimit(clock=clock)
    for _ in range(60):
        clock.advance(0.5)
        limiter.on_engine_load(_load(2))
        limiter.on_sample(_sample(2))
    assert limiter.limit == 4


def test_a_storm_of_preemptions_cuts_the_limit_to_what_runs_and_its_lookahead() -> None:
    clock = Clock()
    limiter = ConcurrencyLimit(clock=clock, initial=20)
    limiter.on_engine_load(_load(20, preemptions=3))
    clock.advance(2)
    limiter.on_engine_load(_load(16, kv=0.99, preemptions=13))
    # The cache holds 16 now (what ran a poll ago does not count): 16 and 15 % waiting.
    assert limiter.limit == 16 + math.ceil(LOOKAHEAD * 16)
    assert limiter.snapshot()["reason"] == "preemption"


def _full_cache_growth(limiter: ConcurrencyLimit, clock: Clock, seconds: int) -> list[int]:
    """The limit on each of ``seconds`` polls of an engine that runs all it is sent, its cache
    full and nothing waiting: the limit binds and nothing says "fewer"."""
    limits = []
    for _ in range(seconds):
        clock.advance(1)
        limiter.on_engine_load(_load(limiter.limit, kv=0.99, preemptions=13))
        limits.append(limiter.limit)
    return limits


def test_after_the_cache_shrank_a_full_cache_grows_one_at_a_time() -> None:
    """A storm of preemptions (the cache shrank) cuts to what runs; a full cache that then
    takes all it is sent grows one at a time for ``memory_s``, not by sqrt(n)/2: the cache holds
    about what the storm left it, and a larger step overshot it (b64kv, cache halved, seed 8)."""
    clock = Clock()
    limiter = ConcurrencyLimit(clock=clock, initial=40, memory_s=60.0)
    limiter.on_engine_load(_load(36, kv=0.99, preemptions=0))
    clock.advance(1)
    limiter.on_engine_load(_load(16, waiting=20, kv=0.99, preemptions=13))
    assert limiter.limit == 19  # 16 and its lookahead
    limits = _full_cache_growth(limiter, clock, 4)
    assert limits == [19, 20, 21, 22]  # growth waits 2 s after the cut, then one a second
    clock.advance(60)
    limiter.on_engine_load(_load(limiter.limit, waiting=0, kv=0.5, preemptions=13))
    before = limiter.limit
    grown = _full_cache_growth(limiter, clock, 1)[0]
    assert grown - before >= 2  # a minute later, the usual additive step again


def test_a_full_cache_that_did_not_shrink_grows_by_the_usual_step() -> None:
    clock = Clock()
    limiter = ConcurrencyLimit(clock=clock, initial=19)
    limiter.on_engine_load(_load(19, kv=0.99, preemptions=13))
    limiter.phase = LimitPhase.STEADY  # past slow start, as the storm's cut left the other
    assert _full_cache_growth(limiter, clock, 1) == [19 + math.floor(math.sqrt(19) / 2)]


def test_a_kv_bound_engine_is_not_cut_to_a_passing_dip() -> None:
    """A full cache with a queue, while a mix of long answers holds fewer sequences for a poll
    or two: the limit stays at the most that ran lately (and its lookahead), not at the dip."""
    clock = Clock()
    limiter = ConcurrencyLimit(clock=clock, initial=64)
    for running in (40, 40, 30, 30):
        clock.advance(1)
        limiter.on_engine_load(_load(running, waiting=10, kv=0.99))
    assert limiter.limit == 40 + math.ceil(LOOKAHEAD * 40)
    assert limiter.snapshot()["known_capacity"] is None  # the figure moves: no slow probing past it


def test_an_engine_still_admitting_is_not_queueing() -> None:
    """One request waits on two polls in a row, but the engine runs more each time: it takes
    what it is sent (a request sent between two steps waits for the next), so no cut."""
    clock = Clock()
    limiter = ConcurrencyLimit(clock=clock, initial=64)
    for running in (30, 36, 42, 48):
        clock.advance(1)
        limiter.on_engine_load(_load(running, waiting=1))
    assert limiter.limit == 64


def test_slow_start_doubles_as_soon_as_the_limit_started_without_waiting() -> None:
    """The ACK clock: a whole limit's worth sent and its last stream's first token came at once,
    so slow start doubles without waiting for an interval; it stays bounded by what was seen."""
    clock = Clock()
    limiter = ConcurrencyLimit(clock=clock, initial=4, interval_s=1.0)
    limiter.on_first_token(1, 0.03)  # the baseline
    for _ in range(3):
        clock.advance(0.05)
        n = limiter.limit
        for i in range(1, n + 1):
            limiter.on_dispatch(i)
        limiter.on_first_token(n, 0.03)
    assert limiter.limit == 32  # 4, 8, 16, 32 within 0.15 s
    assert limiter.phase is LimitPhase.STARTING


def test_a_few_preemptions_are_a_full_cache_not_too_many() -> None:
    clock = Clock()
    limiter = ConcurrencyLimit(clock=clock, initial=20)
    limiter.on_engine_load(_load(18, preemptions=3))
    clock.advance(2)
    limiter.on_engine_load(_load(18, kv=0.97, preemptions=5))
    assert limiter.limit == 20


def test_a_full_caches_ordinary_preemptions_do_not_cut_the_limit() -> None:
    """A KV-bound engine preempts a good share of its batch a poll while its cache is full
    (40 % here): that is the cache used to the full, not a smaller cache."""
    clock = Clock()
    limiter = ConcurrencyLimit(clock=clock, initial=30)
    limiter.on_engine_load(_load(25, kv=0.98, preemptions=0))
    clock.advance(2)
    limiter.on_engine_load(_load(25, kv=0.99, preemptions=10))
    assert limiter.limit == 30
    assert limiter.snapshot()["reason"] != "preemption"


def test_a_probe_the_engine_did_not_run_does_not_forget_its_capacity() -> None:
    """Probes past the known capacity met no queue on the polls, but the engine never ran more
    than that capacity: it has not grown, so growth past it stays one probe at a time."""
    clock = Clock()
    limiter = ConcurrencyLimit(clock=clock, initial=10, reprobe_s=5.0)
    for _ in range(2):
        clock.advance(1)
        limiter.on_engine_load(_load(8, waiting=5))
    assert limiter.limit == 8
    for expected in (9, 10):
        clock.advance(6)
        limiter.on_dispatch(limiter.limit)
        limiter.on_engine_load(_load(8))
        assert limiter.limit == expected
    clock.advance(1.5)
    limiter.on_dispatch(limiter.limit)
    limiter.on_engine_load(_load(8))
    assert limiter.limit == 10  # no additive jump: the figure still holds
    assert limiter.snapshot()["known_capacity"] == 8


def _blind_at_inferred_capacity(streams: int = 8) -> tuple[Clock, ConcurrencyLimit]:
    """A blind (TTFT only) limiter whose first tokens came at a 0.04 s baseline, then waited in
    the engine at ``streams`` streams: the capacity inferred from them is one less, and so is
    the limit."""
    clock = Clock()
    limiter = ConcurrencyLimit(clock=clock, initial=streams, reprobe_s=5.0)
    for _ in range(5):
        clock.advance(0.1)
        limiter.on_sample(_sample(1, ttft=0.04))
    for _ in range(12):
        clock.advance(0.1)
        limiter.on_sample(_sample(streams, ttft=1.0))  # waited in the engine
    assert limiter.limit == streams - 1 and limiter.snapshot()["known_capacity"] == streams - 1
    return clock, limiter


def _quiet(
    clock: Clock, limiter: ConcurrencyLimit, seconds: float, started_at: int, ttft: float = 0.04
) -> None:
    """``seconds`` of a stream every 0.25 s, each dispatched at the limit, that started with
    ``started_at`` in flight and had its first token in ``ttft``."""
    for _ in range(int(seconds / 0.25)):
        clock.advance(0.25)
        limiter.on_dispatch(limiter.limit)
        limiter.on_sample(_sample(started_at, ttft=ttft))


def test_blind_a_probe_past_the_capacity_goes_on_only_once_a_stream_at_it_started_at_once() -> None:
    """Blind (TTFT only), a slow engine's few streams may show no queue either way: one probe
    past the TTFT-inferred capacity, then none until a stream sent at it started without waiting."""
    clock, limiter = _blind_at_inferred_capacity()

    def quiet(seconds: float, started_at: int = 1) -> None:
        _quiet(clock, limiter, seconds, started_at)

    quiet(6)
    assert limiter.limit == 8 and limiter.snapshot()["reason"] == "probe"
    quiet(12)
    assert limiter.limit == 8  # nothing started at 8 without waiting: no further probe
    quiet(6, started_at=8)
    assert limiter.limit == 9


@pytest.mark.parametrize(("ttft", "forgets"), [(0.04, True), (0.10, False)])
def test_blind_the_capacity_is_forgotten_only_by_a_stream_that_started_at_once(
    ttft: float, forgets: bool
) -> None:
    """Blind, two past the TTFT-inferred capacity, a stream whose first token came at the
    baseline forgets the capacity; one that came three steps late (under the four steps that
    count as queued: a slot freed just after it came) does not, and growth stays one probe at a
    time."""
    clock, limiter = _blind_at_inferred_capacity()

    def quiet(seconds: float, started_at: int, ttft: float = 0.04) -> None:
        _quiet(clock, limiter, seconds, started_at, ttft)

    quiet(6, started_at=7)
    quiet(6, started_at=8)
    assert limiter.limit == 9 and limiter.snapshot()["known_capacity"] == 7
    # Step 0.02 s, baseline 0.04 s: 0.10 s is not queued (under 0.12 s), not at once (over 0.08 s).
    quiet(6, started_at=9, ttft=ttft)
    if forgets:
        # The capacity is forgotten at the probe to 10, and growth is additive from there.
        assert limiter.snapshot()["known_capacity"] is None and limiter.limit > 10
    else:
        assert limiter.snapshot()["known_capacity"] == 7 and limiter.limit == 10


def test_blind_a_cut_put_off_does_not_make_the_limit_a_probe_past_the_capacity() -> None:
    """Blind, first tokens that waited just after a probe set a capacity under the limit, while
    the cut waits out the interval; the limit there is no probe two past that capacity, so a
    stream at it that started at once does not forget it (b64kv, step change, seed 7: the
    capacity was forgotten so near the end of the phase and growth went 40 -> 49)."""
    clock = Clock()
    limiter = ConcurrencyLimit(clock=clock, initial=44, interval_s=1.0, reprobe_s=5.0)
    limiter.on_first_token(1, 0.05)  # the baseline
    clock.now = 0.5
    limiter.on_first_token(39, 1.0)
    clock.now = 1.0
    limiter.on_first_token(39, 1.0)
    limiter.on_first_token(39, 1.0)
    assert limiter.limit == 38 and limiter.snapshot()["known_capacity"] == 38
    clock.now = 5.5
    limiter.on_first_token(38, 0.05)
    clock.now = 6.0
    limiter.on_dispatch(38)
    limiter.on_first_token(38, 0.05)
    assert limiter.limit == 39 and limiter.snapshot()["reason"] == "probe"
    clock.now = 6.4
    for _ in range(3):
        limiter.on_first_token(38, 1.0)  # sent before the probe; they waited
    clock.now = 6.5
    limiter.on_first_token(38, 1.0)
    # The capacity is 37 now; the cut to it waits for the interval after the probe.
    assert limiter.limit == 39 and limiter.snapshot()["known_capacity"] == 37
    clock.now = 11.5
    limiter.on_dispatch(39)
    limiter.on_first_token(39, 0.05)  # the limit's own stream started at once
    assert limiter.limit == 40  # one probe
    assert limiter.snapshot()["known_capacity"] == 37


def test_a_kv_bound_engine_keeps_a_lookahead_waiting() -> None:
    clock = Clock()
    limiter = ConcurrencyLimit(clock=clock, initial=64)
    for _ in range(3):
        clock.advance(1)
        limiter.on_engine_load(_load(40, waiting=24, kv=0.99))
    # 40 fit in its cache; 15 % more wait to take the room as sequences end.
    assert limiter.limit == 46


def test_overload_answers_cut_the_limit_down_to_the_floor() -> None:
    clock = Clock()
    limiter = ConcurrencyLimit(clock=clock, initial=16, floor=2)
    for _ in range(30):
        clock.advance(1.5)
        limiter.on_overload()
    assert limiter.limit == 2


def test_tpot_above_the_objective_lowers_the_limit_to_where_the_line_meets_it() -> None:
    clock = Clock()
    # A batch where each sequence costs 1 ms on top of 10 ms: 20 ms per token at 10 in flight.
    objective = 0.020
    limiter = ConcurrencyLimit(clock=clock, initial=32, tpot_objective_s=objective)
    for i in range(400):
        clock.advance(0.1)
        n = 1 + i % limiter.limit
        limiter.on_sample(_sample(n, tpot=0.010 + 0.001 * n))
    assert 8 <= limiter.limit <= 11


def test_throughput_seeking_stops_where_tokens_per_second_plateaus() -> None:
    clock = Clock()
    # Compute-bound: 1 ms fixed, 4 ms per sequence (llama.cpp on a CPU): past ~9 x 1/4 = 2.25
    # sequences one more adds almost nothing.
    limiter = ConcurrencyLimit(clock=clock, initial=1)
    for i in range(600):
        clock.advance(0.1)
        cap = limiter.limit
        n = 1 + i % cap
        limiter.on_engine_load(_load(cap))
        limiter.on_sample(_sample(n, tpot=0.001 + 0.004 * n))
    assert 2 <= limiter.limit <= 4


def test_late_first_tokens_without_engine_metrics_mean_queueing() -> None:
    clock = Clock()
    slots = 12
    limiter = ConcurrencyLimit(clock=clock, initial=24)
    for i in range(300):
        clock.advance(0.05)
        n = limiter.limit
        # Streams past the engine's slots wait for one to free: their first token is late.
        queued = (i % n) >= slots
        limiter.on_sample(_sample(n, tpot=0.02, ttft=1.0 if queued else 0.04))
    assert limiter.limit <= slots + 2
    assert limiter.snapshot()["reason"] in ("ttft queueing", "probe", "additive increase")


def test_the_snapshot_is_json() -> None:
    clock = Clock()
    limiter = ConcurrencyLimit(clock=clock, ceiling=32)
    _engine(limiter, clock, slots=8, seconds=10)
    for n in (1, 4, 8):
        limiter.on_sample(_sample(n, tpot=0.01 + 0.001 * n))
    snap = json.loads(json.dumps(limiter.snapshot()))
    assert snap["limit"] == 8 and snap["ceiling"] == 32 and snap["adaptive"] is True
    assert snap["tpot_slope_s"] == pytest.approx(0.001, rel=0.01)


def test_dispatches_show_the_limit_binds_before_any_stream_ends() -> None:
    clock = Clock()
    limiter = ConcurrencyLimit(clock=clock)
    for _ in range(5):
        clock.advance(1.1)
        for n in range(1, limiter.limit + 1):
            limiter.on_dispatch(n)
        # Every stream that started so far got its first token at once: nothing waits.
        limiter.on_first_token(limiter.limit, 0.03)
    # Doubling every interval from 4 (the first answer only sets the baseline: 4, 5, 10, 20, 40, 80).
    assert limiter.limit == 80


def test_blind_slow_start_goes_no_further_than_twice_what_started_without_waiting() -> None:
    clock = Clock()
    limiter = ConcurrencyLimit(clock=clock, initial=4)
    limiter.on_first_token(1, 0.03)
    for _ in range(10):
        clock.advance(1.1)
        limiter.on_dispatch(limiter.limit)
    # Only one stream was ever seen to start freely: the limit grows by one a step, not doubling.
    assert limiter.limit < 16


def test_late_first_tokens_cut_to_below_the_fewest_in_flight_that_waited() -> None:
    clock = Clock()
    limiter = ConcurrencyLimit(clock=clock, initial=40)
    for i in range(200):
        clock.advance(0.02)
        n = 1 + i % 40
        limiter.on_first_token(n, 0.5 if n > 30 else 0.03)
    assert limiter.limit == 30
    assert limiter.snapshot()["reason"] == "ttft queueing"


def _first_tokens(
    clock: Clock,
    limiter: ConcurrencyLimit,
    seconds: float,
    waits: list[float],
    inflight: int | None = None,
    *,
    binds: bool = False,
) -> None:
    """``seconds`` of first tokens, ten a second, each of a stream sent with the limit (or
    ``inflight``) in flight that waited ``waits[i % len(waits)]`` for it: at ten a second, a wait
    of 1.95 s saw 19 first tokens of streams admitted before it. ``binds``: a dispatch at the
    limit before each."""
    for i in range(int(seconds * 10)):
        clock.advance(0.1)
        if binds:
            limiter.on_dispatch(limiter.limit)
        limiter.on_first_token(inflight or limiter.limit, waits[i % len(waits)])


def _blind_kv_cache_halved() -> tuple[Clock, ConcurrencyLimit]:
    """A blind limiter at 39 whose first tokens came at once, then an engine that holds ~18 of
    them and queues the rest: each stream sent at the limit waited behind 15-23 others."""
    clock = Clock()
    limiter = ConcurrencyLimit(clock=clock, initial=39, interval_s=1.0, reprobe_s=5.0)
    _first_tokens(clock, limiter, 2, [0.03], inflight=1)
    _first_tokens(clock, limiter, 3, [1.55, 1.75, 1.95, 2.15, 2.35])
    return clock, limiter


def test_blind_a_deep_queue_cuts_at_once_to_what_the_engine_ran_and_its_lookahead() -> None:
    """Blind, first tokens that waited behind ~19 others with 38 in flight: the engine runs ~18.
    Cutting to one less than the fewest in flight that waited would take one request off per
    queued wait (38 -> 19 in 50 s on b64kv blind, its cache halved); the depth of the queue says
    how many at once. What the engine ran moves (14-22: a KV-bound engine), so the lookahead
    is kept on top, as with metrics, of the median (not of the most, as for a batch)."""
    _, limiter = _blind_kv_cache_halved()
    snap = limiter.snapshot()
    assert snap["reason"] == "ttft queue depth"
    # The median of what it ran (18) and its lookahead (3); the old rule stood at 37.
    assert limiter.limit == 18 + math.ceil(LOOKAHEAD * 18)
    assert snap["known_capacity"] == limiter.limit


def test_blind_a_deep_queue_on_a_batch_bound_engine_cuts_to_its_batch() -> None:
    """The same depth where every stream that waited shows the engine running the same number
    (its batch, as b16 does after slow start overshoots): no lookahead, which on such an engine
    only waits; the estimate errs low by the one admitted just before, so one more."""
    clock = Clock()
    limiter = ConcurrencyLimit(clock=clock, initial=39, interval_s=1.0, reprobe_s=5.0)
    _first_tokens(clock, limiter, 2, [0.03], inflight=1)
    _first_tokens(clock, limiter, 3, [1.95])
    assert limiter.snapshot()["reason"] == "ttft queue depth"
    # Sent at 38 after the first cut (39 -> 38), behind 19: the engine ran 18.
    assert limiter.limit == 19


def test_blind_waits_no_deeper_than_a_lookahead_do_not_queue_the_limit_down() -> None:
    """After the jump, streams that waited behind a lookahead (3 of the ~17 it ran) are the
    engine admitting as its cache frees: neither a cut nor room for more, though the limit binds;
    waits behind more than that are a queue again, cut as before (one less than the fewest in
    flight that waited)."""
    clock, limiter = _blind_kv_cache_halved()
    _first_tokens(clock, limiter, 1, [0.03], inflight=1)  # the baseline falls back
    held = limiter.limit
    # Every other stream sent at the limit started at once (a slot was free), every other
    # waited behind 3.
    _first_tokens(clock, limiter, 10, [0.35, 0.03], binds=True)
    assert limiter.limit == held
    _first_tokens(clock, limiter, 2, [0.75, 0.03], binds=True)  # behind 7: a queue
    assert limiter.limit == held - 1 and limiter.snapshot()["reason"] == "ttft queueing"


def test_slow_start_overshoot_read_once_is_no_deep_queue() -> None:
    """One window of deep waits (slow start overshooting, long answers ending together) is cut
    as before, by one less than the fewest in flight that waited: the jump asks for two in a row."""
    clock = Clock()
    limiter = ConcurrencyLimit(clock=clock, initial=39, interval_s=1.0, reprobe_s=5.0)
    _first_tokens(clock, limiter, 2, [0.03], inflight=1)
    _first_tokens(clock, limiter, 1.5, [0.5, 0.03])  # a short queue: 39 -> 38, slow start ends
    assert limiter.limit == 38 and limiter.phase is LimitPhase.STEADY
    _first_tokens(clock, limiter, 3, [0.03], inflight=1)
    _first_tokens(clock, limiter, 1, [1.55, 1.75, 1.95, 2.15, 2.35])  # one deep window
    _first_tokens(clock, limiter, 3, [0.03], inflight=1)
    assert limiter.limit == 37 and limiter.snapshot()["reason"] == "ttft queueing"


@pytest.mark.parametrize("moving", [True, False])
def test_blind_the_lookahead_stays_tolerated_while_what_the_engine_runs_moves(moving: bool) -> None:
    """After the jump, waits behind a lookahead are tolerated for ``memory_s`` (60 s), and for
    as long after as what the engine ran when they waited keeps moving (a KV-bound engine); where
    it stops moving (every wait shows the same count), they are a queue again once that minute is
    out."""
    clock, limiter = _blind_kv_cache_halved()
    _first_tokens(clock, limiter, 1, [0.03], inflight=1)
    held = limiter.limit
    for i in range(900):  # 90 s: each wait behind 3, sent at the limit or (moving) two under it
        clock.advance(0.1)
        limiter.on_dispatch(limiter.limit)
        if i % 2:
            limiter.on_first_token(1, 0.03)
        else:
            limiter.on_first_token(limiter.limit - (2 if moving and i % 4 == 2 else 0), 0.35)
    assert (limiter.limit == held) is moving


def test_blind_after_a_probe_forgot_the_capacity_growth_goes_one_at_a_time_for_a_while() -> None:
    """Blind, a probe two past the TTFT-inferred capacity whose stream started at once forgets
    it, but one clean stream is no room for sqrt(n)/2 more: for ``reprobe_s`` the limit grows
    one at a time, then by the usual step (b64kv, steps doubled, seed 7: 43 -> 46 -> 49 in 2 s
    after the forgetting, and cuts of one or two held it outside its band until 91 s)."""
    clock, limiter = _blind_at_inferred_capacity(40)
    forgot_at: float | None = None
    steps: list[tuple[float, int]] = []  # (time since the forgetting, step) of each rise after it
    while clock.now < 60 and (not steps or steps[-1][1] < 2):
        clock.advance(0.25)
        before = limiter.limit
        limiter.on_dispatch(before)
        limiter.on_sample(_sample(before, ttft=0.04))  # sent at the limit, started at once
        if forgot_at is None and limiter.snapshot()["known_capacity"] is None:
            forgot_at = clock.now
            assert limiter.limit == 42  # the probe that forgot: 39 -> 40 -> 41 -> 42
        elif forgot_at is not None and limiter.limit > before:
            steps.append((clock.now - forgot_at, limiter.limit - before))
    assert forgot_at is not None and steps
    assert all(step == 1 for since, step in steps if since < 5.0)
    assert len([since for since, _ in steps if since < 5.0]) >= 2  # it still grows, by one
    assert steps[-1][1] >= 2 and steps[-1][0] >= 5.0  # then by sqrt(n)/2 again
