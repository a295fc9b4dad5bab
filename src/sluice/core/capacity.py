"""How fast a model's queue drains, measured from the jobs that finished, and how slow one job can be.

The unit is the job cost (estimated prompt tokens + ``max_tokens``), the same unit the queue is
counted in, so that "cost queued ahead ÷ drain rate" is a time without any conversion. A slot's
rate is the cost its jobs carried over the time they took (both smoothed): the rate of one engine
slot at the load it ran under. Times the number of slots serving the model, that is the drain rate.

A queue drains at that mean rate, but one job does not take the mean time: an answer that stops
early takes a fraction of what its ``max_tokens`` allows, one that runs to the end takes all of it,
and a full batch runs each sequence slower than a light one. What a job is promised when it is
admitted is therefore its generation at :data:`SLOW_QUANTILE` of the time per cost unit the
finished jobs took (:attr:`DrainRate.slow`), not at the mean.

A queue only forms once every slot is busy, and a full batch runs each sequence slower than the
light load the rate may have been learnt at (1.2 to 3 times, on the engines of
``sluice.bench.policy_model``'s family): a burst after a lull would be admitted at the lull's pace,
its last admissions would miss their deadlines, and its queue would seem to rise slower than it
does (codel then takes it for a standing one). So the brokers tell each finished job with how many
jobs ran beside it, and the rate learns the line of a job's time against the batch's fill
(:attr:`DrainRate.slowdown`): the wait for a queue, and a job's promised time, are at the full
batch's pace.

A wait behind a queue is predicted from the cost queued ahead and promised with room for two
errors (:meth:`DrainRate.promise_rate_behind`): the rate's, and how far the jobs ahead, a sample
of their own, stray from what their costs predict. The latter is measured as the jobs finish
(:attr:`DrainRate.residual_spread`: each job's service time less ``cost / per_slot``), not read
off the 95th percentile of the time per cost unit (:attr:`DrainRate.spread`): where prompts vary
that percentile lies in the corner of short prompts with long answers, and reads about twice the
spread a wait strays by (docs/policies.md).
"""

from __future__ import annotations

import math
from dataclasses import dataclass

#: The share of finished jobs at most as slow, per cost unit, as what admission promises a job:
#: the quantile :attr:`DrainRate.slow` tracks.
SLOW_QUANTILE = 0.95
#: How far one sample moves that quantile, on a log scale: a sample above it raises it by
#: ``exp(SLOW_STEP * q)``, one below lowers it by ``exp(-SLOW_STEP * (1 - q))``, so that it rests
#: where a share q of the samples is below it (a stochastic approximation of the quantile).
SLOW_STEP = 0.2
#: Weight of the newest job in the fit of how a job slows as the batch fills (:attr:`DrainRate.fill`):
#: far less than ``alpha``, since one job's time says little about the slope (its answer may
#: have stopped early), and a light load gives only a narrow range of fills to draw the line through.
FILL_ALPHA = 0.01
#: The fill spread the slope is shrunk by (a ridge on the fill's variance): with fills all near one
#: value the line is not drawn, and the rate stays what it was measured at (no slowdown assumed).
FILL_RIDGE = 0.002
#: The most a full batch is taken to slow a job down against the fill it was measured at.
MAX_FILL_SLOWDOWN = 4.0
#: How far a promise's slowdown goes from the fitted line toward the most a full batch can slow a
#: job (:attr:`DrainRate.promise_slowdown`), on a log scale, per unit of the spread of a job's time
#: per cost unit (:attr:`DrainRate.spread`; at most all the way). The line is drawn through the
#: fills a light load gave, and at a burst's onset the first jobs to finish in a full batch are
#: the short ones, which flatten it just when a queue forms; the more the jobs' times spread, the
#: more it is flattened so (docs/policies.md). Where every job takes the same, the line is followed.
EXTRAPOLATION_SHARE = 0.5
#: How far a promise's slowdown goes toward its bound, on the same log scale, per unit of the fill
#: the line was not measured at (:attr:`DrainRate.promise_slowdown`): the stretch from the fills
#: seen, their mean plus :data:`FILL_GAP_SD` standard deviations (:attr:`DrainRate.fit_u`,
#: ``fit_uu``), to a full batch. The line is drawn through the fills a light load gave; on an
#: engine whose KV cache is short of a full batch it bends up past the fill where preemption
#: starts, which no fill below it shows (seed 56 of the family: a lull at a fifth full, the line
#: read a full batch at 0.70 of its true time). Where the lull's fills spread up to most of a full
#: batch (the article's engine: to 0.73) the gap is short and the line is nearly followed; as a
#: burst's full batches are measured the gap closes. Chosen on seeds 40-99 of the family
#: (docs/benchmarks/policies.md).
FILL_GAP_SHARE = 0.6
#: The standard deviations of the fills seen above their mean that count as measured (:data:`FILL_GAP_SHARE`).
FILL_GAP_SD = 2.0
#: Standard errors that the wait a job is promised leaves room for (:meth:`DrainRate.wait_margin`):
#: of the drain rate, a mean of the last few batches of jobs (on a few slots with long-tailed
#: answers a mean of fifty jobs is off by a quarter often enough), and of the jobs queued ahead,
#: whose answers are a sample of their own (how long they take is not known until they end).
WAIT_MARGIN_Z = 2.0
#: Whether the brokers' drain rates weigh a job at ``alpha`` per slot (:attr:`DrainRate.weight`).
#: Both brokers read it (lua/finish.lua is told it at each call), so that the
#: two brokers decide alike; ``sluice.bench.policy_model`` measures with it on.
WEIGHT_PER_SLOT = True


@dataclass
class DrainRate:
    """Smoothed per-slot service rate (cost units per second) of one model, its slot count, how
    slow a job gets, and how a job slows as the batch fills.

    Args:
        prior_per_slot: the rate assumed before any job has finished.
        alpha: weight of the newest sample in the moving averages, per slot (:attr:`weight`).

    Attributes:
        per_slot: a slot's rate at the fill it was measured at: the moving average of the jobs'
            costs over that of their service times (a ratio of averages, not an average of ratios:
            a job that stops early carries much cost in little time, and must not make the queue
            look faster than it drains).
        samples: the finished jobs measured.
        slots: the slots of the live workers serving the model.
        service: the moving average of the jobs' service times, in seconds (the ratio's
            denominator; 0 before the first sample).
        slow: the :data:`SLOW_QUANTILE` of a job's seconds per cost unit on a slot (0 before the
            first sample), at the fill it was measured at.
        fill: the moving average (:attr:`weight`) of the share of the slots busy while the jobs
            ran: the fill ``per_slot`` and ``slow`` were measured at (0: never told).
        resid: the moving average (:attr:`weight`) of the square of a job's residual, in s²: its
            service time less what its cost predicts at the rate before it (``cost / per_slot``);
            0 until a second job has finished (:attr:`residual_spread` is its root over
            :attr:`service`).
        fit_u, fit_t, fit_uu, fit_ut: the slow moving averages (:data:`FILL_ALPHA`) of a job's
            fill u, its seconds per cost unit t, u² and u·t: the line t(u) drawn through them is
            how a job slows as the batch fills (:attr:`slowdown`).
        fills: the finished jobs measured with their fill.
        weigh_per_slot: the moving averages weigh a job at ``alpha`` per slot (else at ``alpha``).
        extrapolation_share, wait_margin_z: the promise's constants (:data:`EXTRAPOLATION_SHARE`,
            :data:`WAIT_MARGIN_Z`, which the brokers use; ``sluice.bench.policy_model`` sets others
            for its what-ifs).
        extrapolation_floor: the least share of the way a promise's slowdown goes toward its
            bound, whatever the spread (0, the brokers' rule: none; a what-if of
            ``sluice.bench.policy_model --extrapolation-floor``, docs/benchmarks/policies.md).
        fill_gap_share, fill_gap_sd: the promise's share per unit of fill not measured
            (:data:`FILL_GAP_SHARE`, :data:`FILL_GAP_SD`, which the brokers use; the policy
            model's ``--fill-gap`` and ``--fill-gap-sd`` set others).
        slope_z: model-only, a what-if of the policy model (``--slope-z``): the promise's
            slowdown at least the line's at its slope plus this many standard errors. 0, the
            default and the brokers' rule: not read at all (no Lua twin; lua/_drain.lua's
            ``promise_slowdown`` mirrors the rule at 0, and nothing sets it outside the model).
        slope_residual: model-only (``--slope-residual``), read only where ``slope_z`` > 0: the
            jobs' times strayed from the line by :attr:`residual_spread`, not :attr:`spread`.
    """

    prior_per_slot: float = 50.0
    alpha: float = 0.2
    per_slot: float = 0.0
    samples: int = 0
    slots: int = 0
    service: float = 0.0
    slow: float = 0.0
    fill: float = 0.0
    fit_u: float = 0.0
    fit_t: float = 0.0
    fit_uu: float = 0.0
    fit_ut: float = 0.0
    fills: int = 0
    resid: float = 0.0
    weigh_per_slot: bool = WEIGHT_PER_SLOT
    extrapolation_share: float = EXTRAPOLATION_SHARE
    wait_margin_z: float = WAIT_MARGIN_Z
    extrapolation_floor: float = 0.0
    fill_gap_share: float = FILL_GAP_SHARE
    fill_gap_sd: float = FILL_GAP_SD
    slope_z: float = 0.0
    slope_residual: bool = False

    def observe(self, cost: int, service_s: float, running: float | None = None) -> None:
        """One finished job: its cost, the seconds it took, and (when the broker knows it) how
        many of the model's jobs ran beside it, itself included: the mean of the model's running
        jobs when it started and when it finished (both brokers count those)."""
        if cost <= 0 or service_s <= 0:
            return
        per_cost = service_s / cost
        alpha = self.weight
        if self.samples > 0 and self.per_slot > 0 and self.service > 0:
            # before the rate learns this job: its residual against what was predicted for it
            r = service_s - cost / self.per_slot
            self.resid = r * r if self.resid <= 0 else self.resid + alpha * (r * r - self.resid)
        if self.samples == 0 or self.service <= 0:
            self.per_slot, self.service = cost / service_s, service_s
        else:
            carried = self.per_slot * self.service  # the moving average of the costs
            self.service += alpha * (service_s - self.service)
            self.per_slot = (carried + alpha * (cost - carried)) / self.service
        if self.slow <= 0:
            self.slow = per_cost
        elif per_cost > self.slow:
            self.slow *= math.exp(SLOW_STEP * SLOW_QUANTILE)
        else:
            self.slow *= math.exp(-SLOW_STEP * (1 - SLOW_QUANTILE))
        self.samples += 1
        if running is not None and running > 0:
            self.observe_fill(min(running / max(self.slots, 1), 1.0), per_cost)

    @property
    def weight(self) -> float:
        """The newest job's weight in the moving averages: ``alpha`` per slot, so that they
        remember about as many batches on an engine of 64 slots as on one of 4, and not a fifth
        of a second of finishing jobs (a rate that swings by half within a second is read by
        every admission, and the admissions it lets in are those made when it swung high)."""
        # max() as a conditional: the same value, one call less (every admission reads it)
        slots = self.slots
        return self.alpha / (slots if slots > 1 else 1) if self.weigh_per_slot else self.alpha

    def observe_fill(self, u: float, t: float) -> None:
        """A finished job's fill ``u`` (the share of the slots busy while it ran) and its seconds
        per cost unit ``t``, into the line of how a job slows as the batch fills."""
        if self.fills == 0:
            self.fill, self.fit_u, self.fit_t, self.fit_uu, self.fit_ut = u, u, t, u * u, u * t
        else:
            a = FILL_ALPHA
            self.fill += self.weight * (u - self.fill)
            self.fit_u += a * (u - self.fit_u)
            self.fit_t += a * (t - self.fit_t)
            self.fit_uu += a * (u * u - self.fit_uu)
            self.fit_ut += a * (u * t - self.fit_ut)
        self.fills += 1

    @property
    def slowdown(self) -> float:
        """How much slower a job runs in a full batch than at the fill the rate was measured at
        (1: never told a fill, or no slowdown seen). A queue only forms once every slot is busy,
        so the wait for it and the promise of a job's time are made at the full batch's pace, not
        at the light load's the rate may have been learnt at: the line t(u) fitted through the
        finished jobs' fills, at 1 over at :attr:`fill`, within [1, :data:`MAX_FILL_SLOWDOWN`]."""
        if self.fills == 0 or self.fit_t <= 0:
            return 1.0
        # max() and min() as conditionals here and below on the admission's path: the same
        # values (max(x, c) is c only where c > x), a call less each
        var = self.fit_uu - self.fit_u * self.fit_u
        var = 0.0 if var < 0.0 else var
        cov = self.fit_ut - self.fit_u * self.fit_t
        slope = (0.0 if cov < 0.0 else cov) / (var + FILL_RIDGE)
        at_fill = self.fit_t + slope * (self.fill - self.fit_u)
        at_full = self.fit_t + slope * (1.0 - self.fit_u)
        if at_fill <= 0:
            return MAX_FILL_SLOWDOWN
        ratio = at_full / at_fill
        ratio = 1.0 if ratio < 1.0 else ratio
        return MAX_FILL_SLOWDOWN if ratio > MAX_FILL_SLOWDOWN else ratio

    @property
    def measured(self) -> bool:
        return self.samples > 0

    @property
    def slot_rate(self) -> float:
        """A slot's rate in a full batch (:attr:`slowdown`), or the prior before any measurement."""
        return self.slot_rate_at(self.slowdown)

    def slot_rate_at(self, slowdown: float) -> float:
        """:attr:`slot_rate` at a :attr:`slowdown` the caller has read already (an admission reads
        it once, for its wait, its promise and its own time alike)."""
        return self.per_slot / slowdown if self.samples else self.prior_per_slot

    @property
    def rate(self) -> float:
        """Cost units per second the whole model drains; never zero, so divisions stay finite."""
        return self.rate_at(self.slowdown)

    def rate_at(self, slowdown: float) -> float:
        """:attr:`rate` at a :attr:`slowdown` read already (:meth:`slot_rate_at`)."""
        slots = self.slots
        rate = (self.per_slot / slowdown if self.samples else self.prior_per_slot) * (
            slots if slots > 1 else 1
        )
        return 1e-3 if rate < 1e-3 else rate

    def service_s(self, cost: int) -> float:
        """Expected time one job of this cost occupies a slot in a full batch."""
        return cost / max(self.slot_rate, 1e-3)

    def slow_service_s(self, cost: int, *, behind_queue: bool = True, slowdown: float | None = None) -> float:
        """The time a job of this cost is promised: at the :data:`SLOW_QUANTILE` of the time per
        cost unit seen, never less than the mean (before any measurement, :meth:`service_s`).

        Behind a queue (``behind_queue``) the batch is full, and the job is promised its time at
        the full batch's pace (:attr:`slowdown`; ``slowdown``: that one, read already by the
        caller). With nothing queued ahead it starts at once, in a batch not yet full, and is
        promised its time at the pace measured: were the slowdown applied there too, a slowdown
        estimated too high would refuse every job as never fitting, and with nothing admitted
        nothing would finish to correct it."""
        if not self.samples:
            return self.service_s(cost)
        if not behind_queue:
            slowdown = 1.0
        elif slowdown is None:
            slowdown = self.slowdown
        per_slot = self.per_slot
        at_slow = cost * self.slow * slowdown
        at_mean = cost * slowdown / (1e-3 if per_slot < 1e-3 else per_slot)
        return at_mean if at_mean > at_slow else at_slow

    def wait_s(self, tokens_ahead: int, *, slowdown: float | None = None) -> float:
        """The mean wait behind ``tokens_ahead`` (``slowdown``: :attr:`slowdown`, read already)."""
        return tokens_ahead / (self.rate if slowdown is None else self.rate_at(slowdown))

    @property
    def promise_slowdown(self) -> float:
        """The slowdown a promise is made at: :attr:`slowdown`, moved toward the most a full batch
        can slow a job by :data:`EXTRAPOLATION_SHARE` times :attr:`spread` (at most all the way,
        on a log scale). A batch never drains slower in all than the part of it the rate was
        measured at (an engine's throughput does not fall as its batch fills), so a slot's rate
        at the full batch is at least ``per_slot`` times :attr:`fill`: a slowdown of at most
        1 / fill. The line lies on fills a light load gave, and a burst's first finishers in a
        full batch are its short answers, which flatten it just as the queue forms, the more so
        the more the jobs' times spread; where they all take the same, there is no such bias and
        the line is followed. And the line is only measured up to the fills seen (their mean
        plus :data:`FILL_GAP_SD` standard deviations): for the stretch beyond them to a full
        batch it goes :data:`FILL_GAP_SHARE` of the way per unit of fill, whichever of the two
        shares is the larger (a KV cache short of a full batch bends the line up where no light
        load measured it). :attr:`slowdown` when never told a fill."""
        return self._promise_slowdown(self.spread, self.slowdown)

    def _promise_slowdown(self, spread: float, fit: float) -> float:
        if self.fills == 0:
            return fit
        fill = self.fill
        bound = 1.0 / (1e-3 if fill < 1e-3 else fill)
        bound = fit if fit > bound else bound
        bound = MAX_FILL_SLOWDOWN if bound > MAX_FILL_SLOWDOWN else bound
        share = self.extrapolation_share * spread
        floor = self.extrapolation_floor
        share = floor if share < floor else share  # 0: share itself (spread is never below 0)
        # the fills measured reach about fit_u + FILL_GAP_SD standard deviations; beyond them the
        # line is a guess, and the promise goes part of the way to the bound for that stretch
        # 0 only where var < 0, as Lua's math.max(var, 0) (a NaN stays NaN, and the gap then
        # decides nothing on either side)
        var = self.fit_uu - self.fit_u * self.fit_u
        gap = 1.0 - self.fit_u - self.fill_gap_sd * math.sqrt(0.0 if var < 0.0 else var)
        by_gap = self.fill_gap_share * gap
        share = by_gap if share < by_gap else share
        promised = fit * math.pow(bound / fit, 1.0 if share > 1.0 else share)
        if self.slope_z > 0:
            noise = self.residual_spread if self.slope_residual else spread
            upper = self._slope_upper(noise, var, bound)
            promised = upper if upper > promised else promised
        return promised

    def _slope_upper(self, spread: float, var: float, bound: float) -> float:
        """A model-only what-if (``slope_z``; 0 in the brokers: never called): the line's slowdown
        at its slope plus ``slope_z`` standard errors, within ``bound``. The slope is drawn
        through the fills' moving averages (``FILL_ALPHA``: some ``2 / FILL_ALPHA`` jobs, fewer
        before that many have finished), and each job's time per cost unit strays from the line by
        about :attr:`spread` of the mean: on a few slots with answers that stop early a lull's few
        dozen fills in a narrow band leave the slope unknown to within its own size (seed 97 of
        the family: 37 fills at 0.52 ± 0.13, the line flat, the truth some 1.3 to a full batch).

        The standard error counts ``fills`` jobs, but the averages start at the first job's
        values and weigh it ``(1 - FILL_ALPHA) ** (fills - 1)``: before a few hundred jobs the
        line rests on fewer, and the slope strays more than this error says (simulated, slope 0,
        noise 0.5, fills uniform in 0.3 to 0.74: its robust spread over 4,000 runs is 1.2 times
        this error at 37 fills, 1.9 times at 100, equal at 400). ``slope_z`` is a knob, not a
        calibrated quantile."""
        var = 0.0 if var < 0.0 else var
        remembered = (2.0 - FILL_ALPHA) / FILL_ALPHA
        jobs = remembered if remembered < self.fills else self.fills
        if self.fit_t <= 0:
            return bound
        cov = self.fit_ut - self.fit_u * self.fit_t
        slope = (0.0 if cov < 0.0 else cov) / (var + FILL_RIDGE) / self.fit_t
        up = slope + self.slope_z * spread / math.sqrt((var + FILL_RIDGE) * jobs)
        at_fill = 1.0 + up * (self.fill - self.fit_u)
        if at_fill <= 0:
            return bound
        ratio = (1.0 + up * (1.0 - self.fit_u)) / at_fill
        return bound if ratio > bound else (1.0 if ratio < 1.0 else ratio)

    @property
    def spread(self) -> float:
        """How much a job's time per cost unit varies, relative to the mean: read off :attr:`slow`
        (the 95th percentile, some two standard deviations above the mean for the spreads seen:
        exactly so for times spread as an exponential) and the mean (``1 / per_slot``). 0 before
        any measurement, or when every job takes the same."""
        if not self.samples:
            return 0.0
        over = self.slow * self.per_slot - 1.0
        return (0.0 if over < 0.0 else over) / 2.0

    @property
    def residual_spread(self) -> float:
        """How much a job's service time strays from what its cost predicts at the rate
        (``cost / per_slot``), relative to the mean service time: the root of :attr:`resid` over
        :attr:`service` (a ratio of averages, as the rate is: an average of each job's ratio to
        the mean of its moment swings with the short answers a burst's first seconds finish). A
        wait behind k jobs is their service times' sum, predicted from the cost queued ahead; it
        strays from that by this over √k of it. :attr:`spread` before a second job has finished
        (or with a state kept without it)."""
        if self.resid <= 0 or self.service <= 0:
            return self.spread
        return math.sqrt(self.resid) / self.service

    @property
    def wait_margin(self) -> float:
        """How much longer than its mean a long queue's wait is promised: :data:`WAIT_MARGIN_Z`
        standard errors of the rate, a mean over about ``2 / weight`` finished jobs (fewer before
        that many finished) whose times vary by :attr:`spread`. Behind a few jobs the margin is
        wider (:meth:`promise_rate_behind`): they are a sample of their own."""
        return self._wait_margin(self.spread, 0, 0.0)

    def _wait_margin(self, spread: float, jobs_ahead: int, residual: float) -> float:
        """``1 + z·√(spread² / jobs + residual² / jobs_ahead)``: the rate's error, read off the
        95th percentile (it is also off by more than a mean's error at a burst's onset, when the
        first to finish are short answers: the percentile's reading covers that too, on seed 22
        of the family), and the jobs ahead's, a sample of service times that stray from what their
        costs predict by ``residual`` (:attr:`residual_spread`, measured)."""
        if not self.samples:
            return 1.0
        w = self.weight
        remembered = (2.0 - w) / w
        jobs = remembered if remembered < self.samples else self.samples
        own = residual * residual / jobs_ahead if jobs_ahead > 0 else 0.0
        return 1.0 + self.wait_margin_z * math.sqrt(spread * spread / jobs + own)

    @property
    def batch_rate(self) -> float:
        """The drain rate of a full batch at :attr:`promise_slowdown` (cost units per second): the
        capacity admission expects to grant, which the Retry-After book spreads its times over
        (``admission.reserve``); the prior before any measurement."""
        return self._batch_rate(self.spread, self.slowdown)

    def _batch_rate(self, spread: float, fit: float) -> float:
        if not self.samples:
            return self.rate_at(fit)
        slots = self.slots
        rate = self.per_slot / self._promise_slowdown(spread, fit) * (slots if slots > 1 else 1)
        return 1e-3 if rate < 1e-3 else rate

    @property
    def promise_rate(self) -> float:
        """The rate a long queue's wait is promised at: :meth:`promise_rate_behind` a queue whose
        own jobs' spread averages out, the rate's error alone."""
        return self.promise_rate_behind(0)

    def promise_rate_behind(self, jobs_ahead: int, *, slowdown: float | None = None) -> float:
        """The drain rate the wait behind ``jobs_ahead`` jobs is promised at: :attr:`batch_rate`
        less a margin of :data:`WAIT_MARGIN_Z` standard errors of two means: the rate's, whose
        times vary by :attr:`spread` (:attr:`wait_margin`), and the jobs ahead's, a sample of
        their own whose answers are not known until they end and whose sum strays from what the
        cost queued ahead predicts by :attr:`residual_spread` over √jobs_ahead (0 jobs: none).
        ``slowdown``: :attr:`slowdown`, when the caller has read it already (an admission reads
        it once). Only the deadline check reads it: codel's view of the queue and the position
        and start a client is told stay at the mean rate."""
        spread = self.spread  # read once for both of the rate's parts, and for the residual's
        fit = self.slowdown if slowdown is None else slowdown
        resid, service = self.resid, self.service  # residual_spread, without reading spread again
        residual = spread if resid <= 0 or service <= 0 else math.sqrt(resid) / service
        rate = self._batch_rate(spread, fit) / self._wait_margin(spread, jobs_ahead, residual)
        return 1e-3 if rate < 1e-3 else rate

    def promised_wait_s(
        self, tokens_ahead: int, jobs_ahead: int = 0, *, slowdown: float | None = None
    ) -> float:
        """The wait a job behind ``tokens_ahead`` in ``jobs_ahead`` jobs is promised
        (:meth:`promise_rate_behind`; ``slowdown`` as there)."""
        return tokens_ahead / self.promise_rate_behind(jobs_ahead, slowdown=slowdown)


def promise_args() -> list[str]:
    """What ``lua/_drain.lua``'s promise needs besides the model's fields (admit.lua is told it
    after the queue policy's numbers): the constants of :attr:`DrainRate.promise_slowdown` and
    :meth:`DrainRate.promise_rate_behind`, the rate's ``alpha`` and whether it is weighed per slot,
    then the fill gap's (:data:`FILL_GAP_SHARE`, :data:`FILL_GAP_SD`)."""
    return [
        repr(EXTRAPOLATION_SHARE),
        repr(WAIT_MARGIN_Z),
        repr(float(DrainRate.alpha)),
        "1" if WEIGHT_PER_SLOT else "0",
        repr(FILL_GAP_SHARE),
        repr(FILL_GAP_SD),
    ]
