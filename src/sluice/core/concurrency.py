"""The in-flight limit of one engine, learned from what the engine says of itself and from what
Sluice measures of every stream; pure: no I/O, time comes from an injected clock.

An LLM engine runs a batch of sequences; one more in flight than it can batch waits in the
engine's own queue, where Sluice can no longer reorder it, shed it or send it elsewhere. The limit
therefore aims at "just enough to keep the engine's batch full", and, with a time-per-output-token
objective, "no more than the batch size at which decoding meets the objective".

Signals, strongest first:

1. **The engine's own queue** (vLLM ``num_requests_waiting``, TGI ``tgi_queue_size``,
   llama-server ``requests_deferred``). A request sent between two engine steps waits until the
   next one, so a waiting request is a queue only on two polls in a row while the engine runs as
   many as it has run lately (or its KV cache is nearly full), or when many wait at once (slow
   start overshooting), unless the engine runs more than on the last poll (it is still admitting
   what it is sent). Then the limit drops to the engine's ``running`` count, remembered as its
   known capacity; probing past it is slow (one more, ``reprobe_s`` after the last change), so
   the waiting queue stays within a request or two. Where the KV cache is what bounds the engine
   (:data:`KV_HOLD` full), how many it holds moves with the answers' lengths: the limit follows
   the most it ran in the last :data:`KV_RECENT_S` seconds plus a lookahead of :data:`LOOKAHEAD`
   waiting (llm-d's lookahead buffer: the engine admits them as sequences end, and the cache
   stays full), with no known capacity (growth is held back while the full cache has a queue).
   A few preemptions are a full cache; a storm (:data:`PREEMPTION_STORM` of the batch between
   two polls) says it holds fewer now: what runs, plus the lookahead (and for ``memory_s`` after
   it a full cache grows one at a time: it holds about what the storm left). An engine that says how
   many it can run at all (llama-server's slots) is never sent more.
2. **Time per output token** against its objective, where one is set: above it, the limit drops
   by the gradient ``objective / tpot`` (bounded to halve at most, as in Netflix's Gradient2), or
   straight to the in-flight count where the fitted line ``tpot = a + b * inflight`` meets the
   objective (the TPOT half of llm-d's static tuning); below it, the limit may grow only while the
   line predicts the next sequence still meets it.
3. **Time to first token**, where the engine reports no queue: a request that waited in the
   engine shows a first token far later than the low baseline of recent ones (more than
   ``0.5 x baseline`` or 4 decoding steps over it); a quarter of a window's streams like that is
   queueing, and the limit drops to one less than the fewest in flight at which one queued.
   :meth:`ConcurrencyLimit.on_first_token` gives that a whole answer sooner than
   :meth:`ConcurrencyLimit.on_sample`, and says how deep the queue was: the first tokens that
   came while a stream waited are the streams admitted before it, so the engine ran its
   in-flight count less those. A queue far deeper than a lookahead, two windows in a row, makes
   the limit jump to that estimate at once (plus the lookahead where the estimate moves with
   the sequences' lengths, as a KV-bound engine's does; and for ``memory_s`` a wait behind no
   more than a lookahead is then no queue, as with metrics).
4. **Overload answers** (429/503): a multiplicative decrease.

Without trouble, and only when the limit binds (a request was sent with the limit in flight, or
the engine runs that many), the limit grows: doubling until the first sign of trouble (slow
start, as TCP does: a 64-slot engine is found in seconds; blind, at most twice what has been seen
to start without waiting), then additively. Slow start doubles every :data:`SLOW_START_PACE` of
``interval_s`` where an overshoot shows at once (the engine reports its queue, or first tokens
are reported as they come), and at once when the first token of a stream sent at the limit came
without waiting (TCP's ACK clock). With no
objective the growth is throughput-seeking: it stops where the fitted line says one more sequence
barely adds tokens per second across the batch (elasticity ``b*n / (a + b*n)`` above
:data:`PLATEAU_ELASTICITY`: doubling the batch would add under ~7 % throughput).

Baselines follow the engine (Envoy's adaptive concurrency re-measures its minRTT on a timer):
the TPOT line (:mod:`sluice.core.tpot_line`) is fitted from per-in-flight buckets that expire
after ``memory_s`` and are all dropped when the bucket being fed moves far from what the line
predicts (another tenant on the GPU, longer contexts); the TTFT baseline is a low-quantile
tracker that falls fast and rises slowly, so a slower engine raises it within tens of seconds
without the limit being forced down to re-measure it. A hand-set ``ceiling``
(``max_concurrency``) is never exceeded.
"""

from __future__ import annotations

import math
import statistics
import time
from collections import deque
from collections.abc import Callable
from dataclasses import dataclass
from enum import StrEnum

from sluice.core.tpot_line import TpotLine

__all__ = [
    "PLATEAU_ELASTICITY",
    "ConcurrencyLimit",
    "EngineLoad",
    "LimitPhase",
    "StreamSample",
]

#: Where throughput-seeking stops growing: the share of one more sequence's time that goes to the
#: batch being slower (d ln tpot / d ln n). At 0.9, doubling the batch would add ~7 % tokens/s.
PLATEAU_ELASTICITY = 0.9
#: KV-cache use at which the limit stops growing, and a waiting request is the cache being full.
KV_HOLD = 0.8
#: Starting limit when neither ``initial`` nor a fixed limit is given.
DEFAULT_INITIAL = 4
#: Requests a KV-bound engine may hold waiting, as a share of its batch: it admits them as the
#: cache frees, without waiting for Sluice to send the next.
LOOKAHEAD = 0.15
#: Preemptions between two polls, as a share of the batch, that are too many (a recompute each):
#: the cache shrank. A full cache with its lookahead preempts up to ~45 % of its batch a 1-s poll
#: as a matter of course (median 17 %), halving it 120-170 % (limit_model, b64kv, seeds 1-5); a
#: bar at 25 % fired on the ordinary churn, and the limit swung with it.
PREEMPTION_STORM = 0.6
#: The share of recent polls that found a request waiting (smoothed, 0.3 a poll) from which the
#: engine's queue is real: two polls in a row.
WAITING_PERSISTS = 0.5
#: How far back a KV-bound engine's most running counts for its limit (seconds): long enough that
#: a passing mix of long answers does not cut it, short enough to follow a cache that shrank.
KV_RECENT_S = 10.0
#: The share of a window's first tokens that waited in the engine that is queueing (blind).
TTFT_QUEUED_SHARE = 0.25
#: A TTFT-inferred cut to above this share of the limit is a nudge: at most one per ``reprobe_s``.
TTFT_NUDGE = 0.8
#: Blind: a window's streams waited behind a deep queue when the median count of first tokens
#: that came while each waited passes this share of what the engine ran (and
#: :data:`DEEP_QUEUE_MIN`): far more than a lookahead (b64kv blind, seed 1: behind 6-20 with
#: 17-27 running in the 30 s after its cache halved, against 0-3 of ~38 before, 6 once in slow
#: start's overshoot).
DEEP_QUEUE_SHARE = 0.3
DEEP_QUEUE_MIN = 3
#: Windows in a row that must be deep before the limit jumps to the estimate: a persistent queue,
#: not slow start's one overshoot read twice or a bunch of long answers ending together.
DEEP_QUEUE_WINDOWS = 2
#: Blind: the spread of what the engine ran when streams waited (max - min of a window's
#: estimates) at which its capacity moves with its sequences' lengths, as a KV-bound engine's
#: does. A batch-bound engine runs its batch whenever one waits (spread 0 on b8, b16).
CAPACITY_MOVES = 2
#: Slow start's least time between two doublings, as a share of ``interval_s``.
SLOW_START_PACE = 0.5
#: Multiplicative decrease on a congestion signal that does not say by how much.
BACKOFF = 0.8
#: What the limit aims the mean TPOT at, below the objective: answers' TPOTs spread around their
#: mean (prefill steps interleave), and an objective is met per answer, not on average. It grows
#: only while the next sequence is predicted within the aim, and is cut once the mean passes
#: half the margin (hysteresis: a limit at the aim is not cut by noise).
TPOT_MARGIN = 0.02


@dataclass(frozen=True, slots=True)
class EngineLoad:
    """What an engine reports of itself right now (None: it does not say)."""

    running: int | None  # sequences it is running (vllm:num_requests_running, llama-server busy slots)
    waiting: int | None  # requests in its own waiting queue (vllm:num_requests_waiting)
    kv_usage: float | None  # KV-cache use, 0..1
    preemptions: int | None  # cumulative count of preemptions since the engine started
    slots: int | None = None  # sequences it can run at all, where it says (llama-server's slot count)


@dataclass(frozen=True, slots=True)
class StreamSample:
    """What Sluice measured of one request that finished on an engine."""

    inflight: int  # sequences Sluice had in flight on the engine when it started (incl. itself)
    ttft_s: float | None  # time to first token, seconds
    tpot_s: float | None  # mean seconds per output token after the first (None if < 2 tokens)
    output_tokens: int
    prompt_tokens: int


class LimitPhase(StrEnum):
    """Where the learner is: ``fixed`` (not adaptive), ``starting`` (doubling until the first sign
    of trouble), ``steady`` (additive growth, decreases on signals)."""

    FIXED = "fixed"
    STARTING = "starting"
    STEADY = "steady"


class ConcurrencyLimit:
    """The in-flight limit of one engine: learned (adaptive=True) or fixed.

    Args:
        ceiling: the hand-set ``max_concurrency``: the limit never exceeds it; None: no ceiling.
        adaptive: learn the limit; False: the limit stays at ``initial`` (else ``ceiling``).
        initial: the starting limit; None: ``ceiling`` when fixed, :data:`DEFAULT_INITIAL` when
            learning (both within floor and ceiling).
        floor: the limit never goes below it (at least 1: an engine always gets a request).
        tpot_objective_s: the time per output token to stay within; None: throughput-seeking.
        clock: monotonic seconds.
        interval_s: the least time between two changes of the limit (a change needs streams
            started under it before it can be judged).
        memory_s: how long a TPOT bucket counts after its newest sample.
        reprobe_s: how long the limit stays at the engine's known capacity before probing one
            more (and how long a TTFT-inferred capacity holds).
    """

    def __init__(
        self,
        *,
        ceiling: int | None = None,
        adaptive: bool = True,
        initial: int | None = None,
        floor: int = 1,
        tpot_objective_s: float | None = None,
        clock: Callable[[], float] = time.monotonic,
        interval_s: float = 1.0,
        memory_s: float = 60.0,
        reprobe_s: float = 5.0,
    ) -> None:
        if floor < 1:
            raise ValueError("floor must be at least 1")
        if ceiling is not None and ceiling < floor:
            raise ValueError("ceiling must be at least floor")
        if tpot_objective_s is not None and not tpot_objective_s > 0:
            raise ValueError("tpot_objective_s must be positive")
        if not adaptive and initial is None and ceiling is None:
            raise ValueError("a fixed limit needs initial or ceiling")
        self.ceiling = ceiling
        self.adaptive = adaptive
        self.floor = floor
        self.tpot_objective_s = tpot_objective_s
        self._clock = clock
        self._interval_s = interval_s
        self._memory_s = memory_s
        self._reprobe_s = reprobe_s
        if initial is None:
            initial = DEFAULT_INITIAL if adaptive else ceiling
        assert initial is not None
        self._value = float(self._clamp(initial))
        # The limit as an int, kept as the value changes (only _set changes it): the dispatcher
        # reads it several times for every claim and every pick.
        self._limit = self._clamp(int(self._value))
        self.phase = LimitPhase.STARTING if adaptive else LimitPhase.FIXED
        now = clock()
        self._last_change = now
        self._last_congestion = -math.inf
        # What the engine ran when it last queued (or what TTFT says it runs): past this, probe slowly.
        self._known_capacity: int | None = None
        self._reason = "initial"
        self._changes = 0
        # Evidence that the limit binds: the most in flight a stream started with, or the engine ran.
        self._peak_inflight = 0
        self._peak_sample_inflight = 0
        self._samples_since_change = 0
        # The most the engine said it ran since the limit last changed (None: it never says).
        self._peak_running: int | None = None
        # Engine load, as last polled.
        self._load: EngineLoad | None = None
        self._engine_reports_waiting = False
        self._waiting_avg = 0.0  # smoothed share of polls with a request waiting
        self._recent_running: deque[tuple[float, int]] = deque()  # (time, running) of recent polls
        self._preemptions: int | None = None
        self._kv_hold = False
        self._engine_slots: int | None = None
        # Measurements.
        self._tpot_ewma: float | None = None
        self._ttft_base: float | None = None
        self._tpot_line = TpotLine(memory_s, clock)
        self._window_samples = 0
        self._window_queued = 0
        self._window_started = now
        self._min_queued_inflight: int | None = None
        # Blind queue depth (Little's law without a rate): the first tokens that came while a
        # stream waited are the streams admitted before it, so what the engine ran when it was
        # sent is its in-flight count less those (and itself).
        self._first_token_times: deque[float] = deque()  # when recent first tokens came
        self._window_ahead: list[int] = []  # per current stream: first tokens that came while it waited
        self._window_ran: list[int] = []  # per current stream that waited: what the engine ran then
        self._window_tolerated = 0  # current streams that waited behind no more than a lookahead
        self._deep_windows = 0  # windows in a row whose streams waited behind a deep queue
        # When the window's waits last showed a KV-bound engine, after a jump to a deep queue's
        # estimate (blind): for ``memory_s`` a lookahead waiting is tolerated, as with metrics.
        self._last_moving = -math.inf
        self._lookahead_full = False  # the last window's streams waited behind a lookahead: hold
        self._last_ttft_cut = -math.inf
        self._last_probe = -math.inf
        self._last_forgot = -math.inf  # when a blind probe last forgot the known capacity
        self._last_storm = -math.inf  # when preemptions last said the KV cache shrank
        # The limit when TTFT last set the known capacity (blind): a cut put off leaves it above.
        self._limit_at_capacity = 0
        self._first_tokens = False  # on_first_token is called: TTFTs come from it
        self._verified = 0  # the most in flight at which a stream started without waiting
        self._verified_since_change = 0  # the same, since the limit last changed
        # The same, within two steps of the baseline (no slot freed just in time for it): what
        # forgets a known capacity, blind.
        self._started_at_once_since_change = 0

    # -- what the dispatcher reads -------------------------------------------------------------

    @property
    def limit(self) -> int:
        """The current limit: floor <= limit <= ceiling (if set)."""
        return self._limit

    @property
    def seconds_per_token(self) -> float | None:
        """Smoothed decode seconds per output token per sequence at the current load."""
        return self._tpot_ewma

    def snapshot(self) -> dict[str, object]:
        """JSON-able state for /admin and the dashboard."""
        line = self._tpot_line.fit()
        return {
            "limit": self.limit,
            "adaptive": self.adaptive,
            "phase": str(self.phase),
            "reason": self._reason,
            "changes": self._changes,
            "floor": self.floor,
            "ceiling": self.ceiling,
            "tpot_objective_s": self.tpot_objective_s,
            "known_capacity": self._known_capacity,
            "engine_slots": self._engine_slots,
            "seconds_per_token": self._tpot_ewma,
            "ttft_baseline_s": self._ttft_base,
            "tpot_at_one_s": line.at(1) if line is not None else None,
            "tpot_slope_s": line.b if line is not None else None,
            "engine_waiting": self._load.waiting if self._load is not None else None,
            "engine_running": self._load.running if self._load is not None else None,
            "engine_kv_usage": self._load.kv_usage if self._load is not None else None,
        }

    # -- signals -------------------------------------------------------------------------------

    def on_sample(self, sample: StreamSample) -> None:
        """A stream finished on the engine: fold in its TPOT and TTFT, and adjust."""
        now = self._clock()
        self._samples_since_change += 1
        self._peak_inflight = max(self._peak_inflight, sample.inflight)
        self._peak_sample_inflight = max(self._peak_sample_inflight, sample.inflight)
        tpot = sample.tpot_s if sample.tpot_s is not None and sample.tpot_s > 0 else None
        if tpot is not None:
            last = self._tpot_ewma
            self._tpot_ewma = tpot if last is None else last + 0.1 * (tpot - last)
            self._tpot_line.fold(max(1, sample.inflight), tpot, now)
        if sample.ttft_s is not None and sample.ttft_s >= 0 and not self._first_tokens:
            self._fold_ttft(sample.inflight, sample.ttft_s, tpot)
        if not self.adaptive:
            return
        if self._objective_exceeded(now):
            return
        self._judge_window(now)
        self._maybe_increase(now)

    def on_dispatch(self, inflight: int) -> None:
        """Sluice sent the engine a request, and now has ``inflight`` there (including it).
        Optional: it tells at once that the limit binds, where a finished stream tells it a whole
        answer later (slow start then doubles every interval rather than every answer)."""
        self._peak_inflight = max(self._peak_inflight, inflight)

    def on_first_token(self, inflight: int, ttft_s: float) -> None:
        """A stream's first token came, ``ttft_s`` after it was sent with ``inflight`` in
        flight. Optional: where it is called, TTFT-inferred queueing is judged from it (an answer
        sooner than :meth:`on_sample` would) and the samples' TTFTs are no longer read."""
        self._first_tokens = True
        now = self._clock()
        times = self._first_token_times
        while times and now - times[0] > self._memory_s / 2:
            times.popleft()
        if ttft_s >= 0:
            # The first tokens since it was sent: the streams the engine admitted before it.
            sent = now - ttft_s
            ahead = 0
            for t in reversed(times):
                if t <= sent:
                    break
                ahead += 1
            self._fold_ttft(inflight, ttft_s, None, ahead)
        times.append(now)
        if self.adaptive:
            self._judge_window(now)
            self._maybe_increase(now)

    def on_engine_load(self, load: EngineLoad) -> None:
        """The engine's own report, polled on the heartbeat."""
        now = self._clock()
        self._load = load
        if load.running is not None:
            self._peak_inflight = max(self._peak_inflight, load.running)
            self._peak_running = max(self._peak_running or 0, load.running)
        if load.waiting is not None:
            self._engine_reports_waiting = True
            self._waiting_avg += 0.3 * (min(load.waiting, 1) - self._waiting_avg)
        preempted = (
            load.preemptions is not None
            and self._preemptions is not None
            and load.preemptions > self._preemptions
        )
        delta_preempted = float(load.preemptions - self._preemptions) if preempted else 0.0  # type: ignore[operator]
        if load.preemptions is not None:
            self._preemptions = load.preemptions
        # A full cache with requests waiting for it: no room for more.
        self._kv_hold = load.kv_usage is not None and load.kv_usage >= KV_HOLD and (load.waiting or 0) > 0
        if load.slots is not None and load.slots > 0:
            self._engine_slots = load.slots
        if not self.adaptive:
            return
        if self._engine_slots is not None and self._value > self._engine_slots:
            # The engine says how many it can run at all: more would only wait in it.
            self._set(self._engine_slots, "engine slots", now)
            return
        running = load.running or 0
        grew = bool(self._recent_running) and running > self._recent_running[-1][1]
        self._recent_running.append((now, running))
        while self._recent_running and now - self._recent_running[0][0] > self._memory_s / 2:
            self._recent_running.popleft()
        most = max(r for _, r in self._recent_running)
        # A request sent between two engine steps waits until the next one: one waiting on a poll
        # is often that, not a queue, and then the engine runs fewer than it has run (a slot is
        # free until the step). A queue persists while the engine runs all it can (as many as it
        # ever ran, or as many as its KV cache holds), or is large at once (slow start overshooting).
        waiting = load.waiting or 0
        # An engine still admitting (it runs more than on the last poll) is taking what it is
        # sent: what waits there arrived between two steps, not a queue of its own.
        full = (running >= most and not grew) or (load.kv_usage is not None and load.kv_usage >= KV_HOLD)
        queued = waiting > 0 and (
            (self._waiting_avg >= WAITING_PERSISTS and full) or waiting >= max(3, 0.25 * running)
        )
        kv_bound = load.kv_usage is not None and load.kv_usage >= KV_HOLD
        # Preemptions are the KV cache used to the full, which a KV-bound engine should be; only
        # a storm of them (PREEMPTION_STORM of the batch between two polls) is too much.
        storm = preempted and delta_preempted > max(1.0, PREEMPTION_STORM * running)
        if storm:
            self._last_storm = now
        if (queued or storm) and kv_bound and running > 0:
            # The KV cache bounds the engine, and how many sequences it holds moves with their
            # lengths (running dips while preempted ones wait to be readmitted): the limit follows
            # the most it ran lately, plus a lookahead of waiting ones (llm-d's lookahead buffer)
            # that it admits the moment the cache frees. No known capacity: the figure moves,
            # and a full cache with a queue already holds growth back.
            # A storm of preemptions says the cache holds fewer now (a tenant took memory): what
            # ran just before counts; a queue alone may be a passing mix of long answers.
            held = running if storm else max(r for t, r in self._recent_running if now - t <= KV_RECENT_S)
            target = float(held + math.ceil(LOOKAHEAD * held))
            self._decrease(target, "engine queue" if queued else "preemption", now)
            return
        if queued or storm:
            # The engine runs what it can; more waits in it.
            self._known_capacity = running if running > 0 else self._known_capacity
            target = float(running) if running > 0 else self._value * BACKOFF
            self._decrease(target, "engine queue" if queued else "preemption", now, bounded=not queued)
            return
        self._maybe_increase(now)

    def on_overload(self) -> None:
        """The engine answered 429/503: it is full."""
        if not self.adaptive:
            return
        now = self._clock()
        self._decrease(self._value * BACKOFF, "overload answer", now)

    # -- decisions -----------------------------------------------------------------------------

    def _decrease(self, target: float, reason: str, now: float, *, bounded: bool = True) -> None:
        """Lower the limit to ``target`` (never raise it). ``bounded``: a guess, at most once per
        interval; else the engine said how many it runs, which holds at any time."""
        self._last_congestion = now
        if self.phase is LimitPhase.STARTING:
            self.phase = LimitPhase.STEADY
        if bounded and now - self._last_change < self._interval_s:
            return
        target = max(float(self.floor), target)
        if target < self._value:
            self._set(target, reason, now)

    def _maybe_increase(self, now: float) -> None:
        # Slow start doubles faster than the steady state moves: each interval at a small limit
        # is a share of the batch left idle while the arrivals pile up.
        # Only where an overshoot shows at once (the engine's queue, or first tokens as they come).
        fast = self.phase is LimitPhase.STARTING and (self._engine_reports_waiting or self._first_tokens)
        pace = self._interval_s * (SLOW_START_PACE if fast else 1.0)
        if (
            self.phase is LimitPhase.STARTING
            and self._first_tokens
            and self._verified >= self.limit
            and self._window_queued == 0
        ):
            # The first token of a stream sent at the limit came without waiting, and none has
            # waited since the window began: the ACK clock of TCP's slow start; the engine has
            # shown the whole limit's worth, whatever the clock says. (A TTFT read from a
            # finished stream comes a whole answer late: no clock.)
            pace = 0.0
        if now - self._last_change < pace or now - self._last_congestion < 2 * self._interval_s:
            return
        current = self.limit
        if self.ceiling is not None and current >= self.ceiling:
            return
        # Only a limit that binds says anything about more: an engine that is not sent its limit
        # has not shown it can take more (TCP's rule for application-limited flows).
        if self._peak_inflight < current or self._kv_hold or self._lookahead_full:
            return
        line = self._tpot_line.fit()
        aim: float | None = None
        if self.tpot_objective_s is not None:
            # TPOT is known only once a stream ends: growth waits for one sent at this limit.
            if self._peak_sample_inflight < current:
                return
            aim = self.tpot_objective_s * (1 - TPOT_MARGIN)
            predicted = line.at(current + 1) if line is not None else self._tpot_ewma
            if predicted is not None and predicted > aim:
                if self.phase is LimitPhase.STARTING:
                    self.phase = LimitPhase.STEADY
                return
        elif line is not None and line.elasticity(current) > PLATEAU_ELASTICITY:
            if self.phase is LimitPhase.STARTING:
                self.phase = LimitPhase.STEADY
            return
        if self._engine_slots is not None and current >= self._engine_slots:
            return
        if self._known_capacity is not None and current >= self._known_capacity:
            if now - max(self._last_congestion, self._last_change) < self._reprobe_s:
                return
            blind = self._peak_running is None
            if current > self._known_capacity and blind and self._verified_since_change < current:
                # Blind, a probe past the capacity goes on only once a stream sent at it started
                # without waiting: a slow engine's few streams may show no queue either way.
                return
            target = current + 1.0
            # A probe past the known capacity that met no trouble: the engine grew (a tenant
            # left, shorter contexts); forget the old figure so growth speeds up again. Where the
            # engine says what it runs, only if it ran more than the figure: one waiting behind
            # a full batch is missed as a queue while a sequence ends, and forgetting then lets
            # additive growth pile a queue up before the next poll catches it. Blind, only if a
            # stream sent with the probed count in flight started without waiting: a slow engine
            # may finish too few streams in ``reprobe_s`` for a queue to show.
            if self._peak_running is not None:
                ran_more = self._peak_running > self._known_capacity
            else:
                # Two past it: one stream that started at once may have met a sequence ending.
                # Counted from the limit the capacity was found at, where that is higher (a cut
                # put off, as a nudge or within the interval): the limit there is no probe.
                past = max(self._known_capacity, self._limit_at_capacity)
                ran_more = self._started_at_once_since_change >= current >= past + 2
            if self._reason == "probe" and ran_more:
                self._known_capacity = None
                if blind:
                    self._last_forgot = now
            reason = "probe"
            self._last_probe = now
        elif self.phase is LimitPhase.STARTING:
            target = current * 2.0
            if not self._engine_reports_waiting:
                # Blind, nothing but first tokens tells of a queue: at most twice what has been
                # seen to start without waiting.
                target = min(target, max(current + 1.0, 2.0 * self._verified))
            reason = "slow start"
        else:
            target = current + max(1.0, math.sqrt(current) / 2)
            if (
                now - self._last_storm < self._memory_s
                and self._load is not None
                and (self._load.kv_usage or 0) >= KV_HOLD
            ) or (now - self._last_moving < self._memory_s or now - self._last_forgot < self._reprobe_s):
                # The cache shrank lately (a storm) and is full: it holds about what the storm
                # left it, give or take its lengths, so it grows one at a time, as past a known
                # capacity. Steps of sqrt(n)/2 on two polls with nothing waiting overshot what it
                # holds, and the 10-s peak of what it ran then held the limit there for tens of
                # seconds (b64kv, cache halved, seed 8: 22 -> 26 at 73 s, back to 22 at 101 s).
                # Blind, after a jump to a deep queue's estimate on an engine whose capacity
                # moves, the same (two clean probes forgot the capacity, and steps of 2 went
                # 22 -> 32 in 5 s: b64kv, cache halved, seed 6). Blind, for ``reprobe_s`` after
                # a probe forgot the capacity, too: one clean stream is no room for sqrt(n)/2
                # more (b64kv, steps doubled, seed 7: 43 -> 46 -> 49 in 2 s, then cuts of one
                # or two paced by the nudge rule held it outside its band until 91 s).
                target = current + 1.0
            if self._known_capacity is not None:
                target = min(target, float(self._known_capacity))
            reason = "additive increase"
        if aim is not None:
            # No further than where the line meets the objective; without a line (every stream
            # ran at one in-flight count), one more at a time.
            reach = (aim - line.a) / line.b if line is not None and line.b > 0 else current + 1.0
            target = min(target, max(current + 1.0, reach))
        if self._engine_slots is not None:
            target = min(target, float(self._engine_slots))
        if self.ceiling is not None:
            target = min(target, float(self.ceiling))
        if target > self._value:
            self._set(target, reason, now)

    def _objective_exceeded(self, now: float) -> bool:
        """TPOT above its objective: decrease by the gradient, or to where the line meets it."""
        objective = self.tpot_objective_s
        tpot = self._tpot_ewma
        if objective is None or tpot is None or tpot <= objective * (1 - TPOT_MARGIN / 2):
            return False
        aim = objective * (1 - TPOT_MARGIN)
        # Streams started under the current limit must have finished before it is judged.
        if self._samples_since_change < 3:
            return True
        line = self._tpot_line.fit()
        if line is not None and line.b > 0 and line.a < aim:
            target = (aim - line.a) / line.b
        else:
            target = self._value * max(0.5, aim / tpot)
        self._decrease(min(target, self._value * 0.95), "tpot objective", now)
        return True

    def _judge_window(self, now: float) -> None:
        """TTFT-inferred queueing, for engines that report no waiting queue."""
        if now - self._window_started < self._interval_s:
            return
        samples, queued, lowest = self._window_samples, self._window_queued, self._min_queued_inflight
        self._window_samples = self._window_queued = 0
        self._min_queued_inflight = None
        self._window_started = now
        aheads, ran = self._window_ahead, self._window_ran
        tolerated = self._window_tolerated
        self._window_ahead, self._window_ran, self._window_tolerated = [], [], 0
        # Streams that waited behind no more than a lookahead: the engine is full, and keeps
        # what it admits next waiting for it (as a full cache with a queue does with metrics).
        self._lookahead_full = tolerated > 0 and tolerated + queued >= max(2, TTFT_QUEUED_SHARE * samples)
        if self._engine_reports_waiting or samples == 0:
            return
        queueing = queued >= 2 and queued >= TTFT_QUEUED_SHARE * samples and lowest is not None
        moving = len(ran) >= 2 and max(ran) - min(ran) >= CAPACITY_MOVES
        if moving and now - self._last_moving < self._memory_s:
            self._last_moving = now  # still KV-bound: the lookahead stays tolerated
        deep = (
            queueing
            and bool(ran)
            and statistics.median(aheads) > max(DEEP_QUEUE_MIN, DEEP_QUEUE_SHARE * statistics.median(ran))
        )
        self._deep_windows = self._deep_windows + 1 if deep else 0
        if self._deep_windows >= DEEP_QUEUE_WINDOWS and self.phase is LimitPhase.STEADY:
            # Waits far past a lookahead, two windows running: the engine holds far fewer than
            # are in flight (its KV cache shrank: another tenant took memory). Cutting to one
            # less than the fewest that waited took a request off per queued wait (38 -> 19 in
            # 50 s, b64kv blind, cache halved); the depth says how many at once. Where what it
            # ran moves, it is KV-bound: what it ran, plus the lookahead that it admits as
            # sequences end; else its batch (the estimate errs low by the one admitted just
            # before).
            if moving:
                held = int(statistics.median(ran))
                target = float(held + math.ceil(LOOKAHEAD * held))
            else:
                target = float(max(ran) + 1)
            if target < self._value and now - self._last_change >= self._interval_s:
                self._deep_windows = 0
                if moving:
                    self._last_moving = now
                self._known_capacity = max(self.floor, int(target))
                self._last_ttft_cut = now
                self._decrease(max(self._value * 0.5, target), "ttft queue depth", now)
                self._limit_at_capacity = self.limit
                return
        if queueing and lowest is not None:
            # A stream that started with ``lowest`` in flight waited in the engine: it runs fewer.
            self._known_capacity = max(self.floor, lowest - 1)
            guess = lowest - 1.0 if lowest - 1.0 < self._value else self._value * BACKOFF
            target = max(self._value * 0.5, guess)
            nudge = target >= self._value * TTFT_NUDGE
            probing = now - self._last_probe < 2 * self._reprobe_s
            if nudge and probing and now - self._last_ttft_cut < self._reprobe_s:
                # A nudge of a request or two, soon after the last, while probes go on between
                # the cuts: the engine's capacity moving with its sequences' lengths (a KV-bound
                # engine), which probes follow up only one each ``reprobe_s``; cut as slowly, or
                # the limit ratchets down. (Cuts with no probe in 2 x ``reprobe_s`` are the
                # engine holding fewer: they go at the interval's pace. The probe need not come
                # between the cuts: asking that lost up to 3.6 % of the answers blind on b64kv.)
                self._last_congestion = now
                self._limit_at_capacity = self.limit
                return
            self._last_ttft_cut = now
            self._decrease(target, "ttft queueing", now)
            self._limit_at_capacity = self.limit

    def _set(self, value: float, reason: str, now: float) -> None:
        self._value = float(self._clamp(value)) if value >= self.floor else float(self.floor)
        if self.ceiling is not None:
            self._value = min(self._value, float(self.ceiling))
        self._limit = self._clamp(int(self._value))
        self._reason = reason
        self._changes += 1
        self._last_change = now
        self._peak_inflight = 0
        self._peak_sample_inflight = 0
        self._samples_since_change = 0
        if self._peak_running is not None:
            self._peak_running = 0
        self._verified_since_change = 0
        self._started_at_once_since_change = 0

    def _clamp(self, n: float) -> int:
        value = max(self.floor, int(n))
        return min(value, self.ceiling) if self.ceiling is not None else value

    # -- measurements --------------------------------------------------------------------------

    def _fold_ttft(self, inflight: int, ttft: float, tpot: float | None, ahead: int | None = None) -> None:
        """Fold in one stream's TTFT; ``ahead``: the first tokens that came while it waited
        (None: not known, the TTFT came with the finished stream)."""
        base = self._ttft_base
        if base is None:
            self._ttft_base = ttft
            return
        # A decoding step's time: the stream's own, else the smoothed one, else the baseline
        # (a first token takes about one step when nothing waits).
        step = tpot if tpot is not None else (self._tpot_ewma or base)
        queued = ttft > base + max(4 * step, 0.5 * base)
        if not queued:
            self._verified = max(self._verified, inflight)
            self._verified_since_change = max(self._verified_since_change, inflight)
            # Within four steps of the baseline is "not queued"; a request that came when the
            # batch was full and met a slot freeing three steps later passes that (b8 blind
            # forgot its capacity on such a stream and overshot). Forgetting asks for less.
            if ttft <= base + max(2 * step, 0.25 * base):
                self._started_at_once_since_change = max(self._started_at_once_since_change, inflight)
        # A stream that started with more in flight than the limit now allows tells of an older,
        # higher limit, which has already been judged: it must not cut the limit again.
        current = inflight <= self.limit
        if current:
            self._window_samples += 1
        tolerated = False
        if current and ahead is not None:
            self._window_ahead.append(ahead)
            if queued:
                ran = max(1, inflight - 1 - ahead)
                self._window_ran.append(ran)
                # Blind and KV-bound lately: a wait behind no more than a lookahead is the
                # engine admitting as its cache frees, not a queue to cut.
                tolerated = self._clock() - self._last_moving < self._memory_s and ahead <= math.ceil(
                    LOOKAHEAD * ran
                )
                self._window_tolerated += tolerated
        if queued and current and not tolerated:
            self._window_queued += 1
            low = self._min_queued_inflight
            self._min_queued_inflight = inflight if low is None else min(low, inflight)
        # A low-quantile tracker: falls fast, rises slowly, so the baseline follows a slower engine.
        # A queued sample rises it less: queueing must not become the baseline it is judged by.
        rise = 0.005 if queued else 0.02
        self._ttft_base = base + (0.2 if ttft < base else rise) * (ttft - base)
