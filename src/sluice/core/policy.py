"""Queue policies: which jobs a model's queue takes, and in what order it hands them out.

The policy is the seam between admission and the queue's structure. Every policy first applies the
configured hard bounds (jobs and tokens per model and per class); then each decides in its own way:

* ``cap`` — no waiting room: a job is taken only while a slot is free (LiteLLM's
  ``max_parallel_requests``). Latency stays low under overload; a burst cannot be absorbed.
* ``fifo`` — a bounded first-in, first-out buffer of ``max_queued`` jobs (Ray Serve's
  ``max_queued_requests``). Absorbs a burst; under standing overload every answer comes just
  inside the client's time-out, and some miss it.
* ``deadline`` — a job is taken when its predicted completion (the work queued ahead over the
  measured drain rate, plus its own generation) falls before its deadline.
* ``codel`` — ``deadline``, plus control of the queueing delay in the manner of CoDel (Nichols and
  Jacobson) as Facebook applied it to request queues: a queue whose delay dips to the ``target``
  now and then is a *good* queue, a burst that drains, and may grow as deep as deadlines allow; a
  queue whose delay stays above the target is *standing*, and from then on the delay it admits is
  limited. When a queue counts as standing, and how deep it may stay, depends on how it rose: a
  steep rise (a burst: arrivals at several times what the engine drains) gets the whole
  ``interval`` to build its queue and keeps the depth it reached, decaying to the target with a
  half-life, which is what keeps the engine busy once the burst is over; a slow rise (a mild
  overload, which will not go away by itself) is standing after ``early_s``, while its queue is
  still shallow, and is held to the target at once. Adaptive LIFO was measured on top
  of this and left out: with admission already bounded by deadlines it only starves the jobs it
  admitted (docs/benchmarks/policies.md).

A policy is pure: it reads a :class:`QueueView`, the drain rate and the :class:`PolicyState` the
broker keeps for the model, updates that state, and admits or raises :class:`Refused`. The Redis
broker runs the same decisions in ``lua/_policy.lua`` (parameters from :meth:`QueuePolicy.lua_args`)
and replays them here to build the same refusal.
"""

from __future__ import annotations

import math
from abc import ABC, abstractmethod
from dataclasses import dataclass
from typing import ClassVar, NamedTuple

from sluice.core.admission import (
    Admitted,
    QueueLimits,
    QueueView,
    Refused,
    Reservations,
    check_bounds,
    check_deadline,
    check_tenant,
    clamp_retry_after,
    reserve,
)
from sluice.core.capacity import DrainRate, promise_args
from sluice.core.ratelimit import TenantLimiter

__all__ = [
    "POLICIES",
    "Candidate",
    "CapPolicy",
    "CoDelPolicy",
    "DeadlinePolicy",
    "FifoPolicy",
    "PolicyState",
    "QueuePolicy",
    "decide",
    "make_policy",
    "standing_refusal",
]


@dataclass(slots=True)
class PolicyState:
    """What a policy remembers about one model's queue between decisions; the broker keeps it.

    Only ``codel`` uses it. Times are the broker's clock (seconds).

    Attributes:
        above_since: when the queue's delay last rose above the target; None while it is at or
            below the target (or the queue has not been observed yet).
        standing_since: when the queue was found standing (above the target for a whole
            interval); None while the queue is good.
        limit_s: the delay limit at ``standing_since``, from which it decays toward the target:
            the delay a burst had reached, or the target itself for a slow rise.
        refused_at: when the delay limit last turned a job away.
    """

    above_since: float | None = None
    standing_since: float | None = None
    limit_s: float = 0.0
    refused_at: float | None = None


class Candidate(NamedTuple):
    """A job asking to be queued, and the queue as it is at this instant.

    A NamedTuple for the reason ``QueueView`` is one: made on every admission and refusal.
    """

    cost: int
    priority: str
    now: float
    deadline: float
    view: QueueView
    limits: QueueLimits
    drain: DrainRate


class QueuePolicy(ABC):
    """Admission and dispatch order of one model's queue."""

    #: the name used in configuration (``queue_policy = "codel"``)
    name: ClassVar[str]
    #: the number ``lua/_policy.lua`` knows the policy by
    kind: ClassVar[int]

    @abstractmethod
    def admit(self, c: Candidate, state: PolicyState) -> Admitted:
        """Take the job (updating ``state``) or raise :class:`Refused`."""

    def lifo(self, state: PolicyState, now: float) -> bool:
        """Whether the queue hands out its newest jobs first now (within a tenant's own jobs)."""
        return False

    def lua_args(self) -> list[str]:
        """The policy for ``lua/_policy.lua``: its kind and five numbers, then what the deadline
        check's promise needs (``capacity.promise_args``: every policy's last check but cap's)."""
        return [str(self.kind), "0", "0", "0", "0", "0", *promise_args()]

    def describe(self) -> str:
        return self.name


def _admitted(c: Candidate, evict: bool) -> Admitted:
    return Admitted(c.view.ahead_jobs, c.drain.wait_s(c.view.ahead_tokens), evict)


def _deadline(c: Candidate, evict: bool, slowdown: float | None = None) -> Admitted:
    ok = check_deadline(
        cost=c.cost, now=c.now, deadline=c.deadline, view=c.view, drain=c.drain, slowdown=slowdown
    )
    # The check's own answer where nothing is evicted (dataclasses.replace is some five calls).
    return ok if ok.evict == evict else Admitted(ok.position, ok.estimated_start_s, evict)


class CapPolicy(QueuePolicy):
    """Take a job only while a slot is free: the queue holds nothing beyond what starts at once."""

    name = "cap"
    kind = 1

    def admit(self, c: Candidate, state: PolicyState) -> Admitted:
        evict = check_bounds(c.cost, c.priority, c.view, c.limits, c.drain)
        slots = c.drain.slots
        if c.view.running + c.view.model_jobs >= slots:
            # A slot frees, on average, every service time / slots.
            raise Refused(
                429,
                "queue_full",
                f"All {slots} slots of this model are busy; retry later.",
                clamp_retry_after(c.drain.service_s(c.cost) / max(slots, 1)),
            )
        return _admitted(c, evict)


@dataclass(frozen=True)
class FifoPolicy(QueuePolicy):
    """A bounded first-in, first-out buffer: at most ``max_queued`` jobs wait, whatever their deadlines."""

    max_queued: int = 50
    name: ClassVar[str] = "fifo"
    kind: ClassVar[int] = 2

    def __post_init__(self) -> None:
        # A buffer of none would refuse every job, its Retry-After a division by the empty queue's
        # zero jobs (ZeroDivisionError here, a Lua error in _policy.lua): "cap" is the policy that
        # keeps no queue. The config's fifo_max_queued is held to >= 1 the same way.
        if not self.max_queued >= 1:
            raise ValueError(
                f"fifo needs max_queued >= 1, not {self.max_queued!r} (a queue of none is policy cap)"
            )

    def admit(self, c: Candidate, state: PolicyState) -> Admitted:
        evict = check_bounds(c.cost, c.priority, c.view, c.limits, c.drain)
        if c.view.model_jobs >= self.max_queued:
            avg = c.view.model_tokens / c.view.model_jobs
            raise Refused(
                429,
                "queue_full",
                f"The model's queue holds its limit of {self.max_queued} jobs; retry later.",
                clamp_retry_after((c.view.model_jobs + 1 - self.max_queued) * avg / c.drain.rate),
            )
        return _admitted(c, evict)

    def lua_args(self) -> list[str]:
        return [str(self.kind), str(self.max_queued), "0", "0", "0", "0", *promise_args()]

    def describe(self) -> str:
        return f"fifo(max_queued={self.max_queued})"


class DeadlinePolicy(QueuePolicy):
    """Take a job when its predicted completion falls before its deadline."""

    name = "deadline"
    kind = 3

    def admit(self, c: Candidate, state: PolicyState) -> Admitted:
        return _deadline(c, check_bounds(c.cost, c.priority, c.view, c.limits, c.drain))


#: Batches of jobs (the model's slots' worth each) the drain rate must have seen finish before
#: codel tells a burst from a standing overload by how fast the delay rises (:func:`learning`).
LEARNING_BATCHES = 2


#: How long a rise is judged by its average, in ``early_s``'s: a queue that has gained more than
#: ``burst_rise`` times that is a burst's, however long it has been above its target. A burst whose
#: queue stops growing before the interval ends (the deadline admits no deeper one) has an average
#: rise that falls as the seconds pass; judged over all of them, it read as a slow rise on a 62-slot
#: engine of the family, and its queue was held to the target mid-burst (docs/benchmarks/policies.md).
RISE_WINDOW = 2.0


def learning(drain: DrainRate) -> bool:
    """Whether the drain rate has seen fewer than :data:`LEARNING_BATCHES` batches of jobs finish:
    its first finishers are the short answers of a light batch, so it starts high and falls as it
    learns, and a delay read at it rises faster than the queue does."""
    return drain.samples < LEARNING_BATCHES * max(drain.slots, 1)


def standing_refusal(state: PolicyState, now: float, wait: float, limit: float) -> Refused:
    """codel's refusal of a ``wait`` over the standing queue's delay ``limit``, noted in ``state``
    (one text for codel and the what-ifs built on it: ``sluice.bench.burst_limit``)."""
    state.refused_at = now
    return Refused(
        429,
        "queue_full",
        f"The model's queue is standing at {wait:.1f} s of waiting, over its limit of "
        f"{limit:.1f} s; retry later.",
        # When the work queued ahead now has started: the queue is then younger than you.
        clamp_retry_after(wait),
    )


@dataclass(frozen=True)
class CoDelPolicy(QueuePolicy):
    """Deadline admission, plus a limit on the queueing delay once the queue is standing.

    Args:
        target_s: the queueing delay a standing queue is driven down to; enough to keep the
            engine's slots fed between arrivals. Never less than the time between two completions
            (a job's cost over the drain rate), or a standing queue would run dry between them.
        interval_s: the longest a queue may stay above the target, and keep growing, before it
            counts as standing: the room a steep burst gets.
        early_s: after this long above the target, a queue that rose slower than ``burst_rise`` is
            standing already. A mild overload is caught while its queue is shallow: one that has
            gained more than ``burst_rise`` times :data:`RISE_WINDOW` early_s's is a burst's.
        burst_rise: seconds of queueing delay gained per second above the target that mark a
            burst (1: arrivals at twice what the engine drains; a standing 1.8x overload rises
            0.8 s a second, and is caught after ``early_s``).
        half_life_s: how fast the delay limit of a standing queue decays to the target; also how
            long the limit must have turned nobody away before the queue counts as good again.
    """

    target_s: float = 0.5
    interval_s: float = 2.5
    early_s: float = 0.5
    burst_rise: float = 1.0
    half_life_s: float = 30.0
    name: ClassVar[str] = "codel"
    kind: ClassVar[int] = 4

    def __post_init__(self) -> None:
        if not (self.target_s >= 0 and self.interval_s >= self.early_s >= 0 and self.burst_rise >= 0):
            raise ValueError("codel needs target_s >= 0, interval_s >= early_s >= 0 and burst_rise >= 0")
        if not self.half_life_s > 0:
            raise ValueError("codel needs half_life_s > 0")

    def target(self, c: Candidate, *, slowdown: float | None = None) -> float:
        """The target for this job's queue: ``target_s``, or one job's drain time if that is longer
        (``slowdown``: ``c.drain.slowdown``, when read already)."""
        return max(self.target_s, c.drain.wait_s(c.cost, slowdown=slowdown))

    def observe(
        self, state: PolicyState, delay_s: float, now: float, target: float, *, learning: bool = False
    ) -> None:
        """Update the state with the queue's current delay (the wait of a job joining its tail);
        ``target`` is :meth:`target` for the job at hand. ``learning``: the drain rate has seen
        fewer than :data:`LEARNING_BATCHES` batches of jobs finish (:func:`learning`)."""
        if delay_s <= target:
            state.above_since = None
            # The delay limit itself keeps a standing queue near the target, and a lull of a few
            # seconds is common under a standing overload: the queue is good again only once the
            # limit has turned nobody away for a half-life.
            if state.refused_at is None or now - state.refused_at >= self.half_life_s:
                state.standing_since = None
            return
        if state.above_since is None:
            state.above_since = now
        if state.standing_since is not None:
            return
        above = now - state.above_since
        # The rise is judged over at most RISE_WINDOW early_s's (early_s 0: over all the time above).
        judged = min(above, RISE_WINDOW * self.early_s) if self.early_s > 0 else above
        if above >= self.early_s and (learning or delay_s - target < self.burst_rise * judged):
            # A mild overload will not drain by itself, and the queue it built is only latency:
            # hold it to the target at once. While the rate is still learning (its first batches:
            # short answers finish first, and the slowdown of a full batch is not yet drawn) the
            # delay rises as the rate falls, not only as the queue grows, and a standing
            # overload's onset looked like a burst (docs/benchmarks/policies.md). Held then to
            # the target as it will be (a limit of 0 has no excess over it), not to the target at
            # the rate not yet learnt: that one, a job's cost over the prior rate, can be seconds,
            # and would decay over a half-life.
            state.standing_since, state.limit_s = now, 0.0 if learning else target
        elif above >= self.interval_s:
            # A burst keeps the queue it built; the limit decays from there with the half-life.
            state.standing_since, state.limit_s = now, delay_s

    def delay_limit(self, state: PolicyState, now: float, target: float) -> float:
        """The longest queueing delay admitted now: unlimited (inf) while the queue is good."""
        if state.standing_since is None:
            return math.inf
        excess = max(state.limit_s - target, 0.0)
        return target + excess * math.pow(0.5, max(now - state.standing_since, 0.0) / self.half_life_s)

    def admit(self, c: Candidate, state: PolicyState) -> Admitted:
        evict = check_bounds(c.cost, c.priority, c.view, c.limits, c.drain)
        # Before the first job finishes the rate is the configured prior: a guess, but the onset of
        # an overload is exactly when the interval must start counting.
        # The batch's slowdown, read once for this admission's every wait (a fit of five numbers).
        slowdown = c.drain.slowdown
        # The rate at it, read once for the three waits below (each DrainRate.wait_s: the same
        # division by the same rate).
        rate = c.drain.rate_at(slowdown)
        one = c.cost / rate
        target = one if one > self.target_s else self.target_s  # self.target(c): max(), a call less
        # The queue's delay is what a job at its tail waits for: jobs held back by their tenant's
        # concurrency cap are not in it.
        delay = c.view.tail_tokens / rate
        self.observe(state, delay, c.now, target, learning=learning(c.drain))
        wait = c.view.ahead_tokens / rate
        limit = self.delay_limit(state, c.now, target)
        if wait > limit:
            raise standing_refusal(state, c.now, wait, limit)
        return _deadline(c, evict, slowdown)

    def lua_args(self) -> list[str]:
        nums = (self.target_s, self.interval_s, self.early_s, self.burst_rise, self.half_life_s)
        return [str(self.kind), *map(repr, map(float, nums)), *promise_args()]

    def describe(self) -> str:
        return (
            f"codel(target_s={self.target_s:g}, interval_s={self.interval_s:g}, early_s={self.early_s:g}, "
            f"burst_rise={self.burst_rise:g}, half_life_s={self.half_life_s:g})"
        )


POLICIES: dict[str, type[QueuePolicy]] = {
    p.name: p for p in (CapPolicy, FifoPolicy, DeadlinePolicy, CoDelPolicy)
}


def make_policy(name: str, **params: float) -> QueuePolicy:
    """A policy by its configured name, with its parameters (unknown ones are an error)."""
    try:
        cls = POLICIES[name]
    except KeyError:
        raise ValueError(f"unknown queue policy {name!r}; choose one of {', '.join(POLICIES)}") from None
    try:
        return cls(**params)
    except TypeError as exc:
        raise ValueError(f"bad parameters for queue policy {name!r}: {exc}") from None


def decide(
    policy: QueuePolicy,
    c: Candidate,
    state: PolicyState,
    *,
    limiter: TenantLimiter,
    queued: int,
    book: Reservations,
) -> Admitted:
    """A job's whole admission, as both brokers make it: the caller's own limits
    (:func:`~sluice.core.admission.check_tenant`: its key's rates, its tenant's ``queued`` jobs),
    then the queue's bounds and ``policy``. Every refusal that says to retry, the tenant's as the
    queue's, takes its Retry-After from the model's reservation ``book``
    (:func:`~sluice.core.admission.reserve`): never sooner than its own reason allows (a rate
    limit's bucket refill, room in the queue), nor than the times already handed out, so that one
    rule decides every time told and the refusals of a burst, whatever refused them, do not come
    back together."""
    try:
        check_tenant(limiter, cost=c.cost, queued=queued, now=c.now, drain=c.drain)
        return policy.admit(c, state)
    except Refused as refused:
        raise reserve(refused, cost=c.cost, now=c.now, drain=c.drain, book=book) from None
