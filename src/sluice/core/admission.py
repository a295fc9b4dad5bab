"""Admission: does a job fit in its queue, and can it finish before its deadline?

Refuse early rather than accept work that cannot finish in time. Every refusal carries a
Retry-After computed from the same measurements as the prediction, so that a client that waits
that long finds room.
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import NamedTuple

from sluice.core.capacity import DrainRate
from sluice.core.ratelimit import RateStatus, TenantLimiter

# Retry-After is a promise to the client; keep it inside what the official SDKs honour (≤ 120 s)
# and never zero, which would invite a tight retry loop.
MIN_RETRY_AFTER_S = 0.5
MAX_RETRY_AFTER_S = 120.0
#: The share of a model's drain rate that Retry-After times promise to refused clients: each
#: refusal reserves its job's cost at this rate, and the rest is left to requests yet to come (a
#: retry is admitted as any request is, so the share it is promised must be one new arrivals leave
#: free: docs/benchmarks/policies.md, "Retry-After is a reservation").
RETRY_SHARE = 0.5
#: The longest Retry-After a refused client is given a time for: the official openai SDKs wait
#: for one of at most 60 s, and replace a longer one with their own short backoff, which brings
#: them back into the queue that refused them. Beyond it, the refusal says not to retry.
RETRY_PATIENCE_S = 60.0


@dataclass(frozen=True)
class Bounds:
    """Queued-work bounds; None means unbounded."""

    max_jobs: int | None = None
    max_tokens: int | None = None


#: A class without bounds of its own (one instance: check_bounds reads it on every admission).
_UNBOUNDED = Bounds()


@dataclass(frozen=True)
class QueueLimits:
    """The bounds admission checks for one model: the model's own and each class's."""

    model: Bounds = Bounds(max_jobs=1000, max_tokens=None)
    classes: dict[str, Bounds] = field(default_factory=dict)


class QueueView(NamedTuple):
    """What admission needs to know about the queue at this instant.

    A NamedTuple, not a frozen dataclass: one is made for every admission and every refusal, and a
    frozen dataclass sets each of its nine fields through ``object.__setattr__`` (3.7 us a view made
    by keyword, against ~1 us as a tuple; the call counts never show it). It stays immutable and
    takes the same positional and keyword arguments.

    Attributes:
        model_jobs, model_tokens: every job queued for the model, and their cost; the hard bounds
            count these.
        class_jobs, class_tokens: the same for the job's priority class.
        ahead_jobs, ahead_tokens: the work that can start before the job: what is queued in its
            class and the classes above, less the jobs other tenants hold back by their concurrency
            caps (``ClassScheduler.held_back``: those wait for their own tenant's running jobs, not
            for the queue, and never take the slots the job would run on). The deadline prediction
            and the estimated start read these.
        running: jobs of the model generating now (only the cap policy reads it).
        runnable_tokens: the cost a job joining the queue's tail would wait for: ``model_tokens``
            less the jobs held back by other tenants' caps, in every class. codel observes the
            queue's delay on it. None: ``model_tokens`` (nothing held back).
        victim_tokens: the cost of the job that gives way when a bound is reached: the newest of
            the tenant with the most jobs queued in the job's class, when that tenant has at least
            two more there than the job's own (``ClassScheduler.fair_view``). None: no tenant is
            that much heavier, and the job itself is refused.
    """

    model_jobs: int
    model_tokens: int
    class_jobs: int
    class_tokens: int
    ahead_jobs: int
    ahead_tokens: int
    running: int = 0
    runnable_tokens: int | None = None
    victim_tokens: int | None = None

    @property
    def tail_tokens(self) -> int:
        """The cost a job at the queue's tail waits for (``runnable_tokens``, else ``model_tokens``)."""
        return self.model_tokens if self.runnable_tokens is None else self.runnable_tokens


class Refused(Exception):
    """A job the queue will not take, with the HTTP answer to give."""

    def __init__(
        self,
        status: int,
        code: str,
        message: str,
        retry_after_s: float,
        *,
        should_retry: bool = True,
        rate: RateStatus | None = None,
        reserved: bool = False,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.code = code
        self.message = message
        self.retry_after_s = retry_after_s
        self.should_retry = should_retry
        self.rate = rate
        #: the Retry-After is a reservation (:func:`reserve`): a time of its own, distinct from
        #: those told to the clients refused before it
        self.reserved = reserved


@dataclass(frozen=True)
class Admitted:
    """A job the queue takes.

    Attributes:
        position: the jobs that would be dispatched before it.
        estimated_start_s: the predicted wait before it starts.
        evict: a bound was reached, and the newest job of the heaviest backlog (``QueueView``'s
            victim) gives way to it: the broker ends that job as failed (``evicted_error``).
    """

    position: int
    estimated_start_s: float
    evict: bool = False


@dataclass(slots=True)
class Reservations:
    """The Retry-After times a model's queue has handed out; the broker keeps it (Redis: field
    ``rv`` of the model's state hash, so that every gateway hands out times from one book).

    Attributes:
        next_free: the earliest time whose capacity is not yet promised to a refused client; None
            before the first reservation.
    """

    next_free: float | None = None


def reserve(
    refused: Refused,
    *,
    cost: int,
    now: float,
    drain: DrainRate,
    book: Reservations,
    share: float = RETRY_SHARE,
) -> Refused:
    """A queue's refusal with its Retry-After made a reservation: never sooner than the refusal's
    own time (when room can free for the job), nor than the capacity already promised to the
    clients refused before it; and the job's cost at ``share`` of the rate admission expects to
    grant (``DrainRate.batch_rate``: a full batch's at the promise's slowdown, not the mean) is
    then promised to this client. Refusals in a burst so get distinct times, spread over the
    capacity that frees, and a client that comes back at its time finds the room it was promised.
    Where that time falls beyond a client's patience (:data:`RETRY_PATIENCE_S`), it is told so
    (``should_retry`` False) and nothing is reserved (once the drain rate is measured; before, the
    time is a guess). A refusal that says not to retry is left as it is."""
    if not refused.should_retry:
        return refused
    at = now + refused.retry_after_s
    if book.next_free is not None and book.next_free > at:
        at = book.next_free
    wait = at - now
    # Before the first measurement the times are a guess: a client is not sent away on one.
    if wait > RETRY_PATIENCE_S and drain.measured:
        return Refused(
            refused.status,
            refused.code,
            refused.message,
            clamp_retry_after(wait),
            should_retry=False,
            rate=refused.rate,
        )
    # The capacity admission expects to grant; not less the rate's error margin, a guard either
    # way, which would run a small engine's times long (its retries then came too late to fill
    # the gaps of a standing queue).
    book.next_free = at + cost / (drain.batch_rate * share)
    # A tenant's refusal keeps its rate-limit status (the x-ratelimit-* headers).
    return Refused(
        refused.status,
        refused.code,
        refused.message,
        clamp_retry_after(wait),
        rate=refused.rate,
        reserved=True,
    )


def clamp_retry_after(seconds: float) -> float:
    if not math.isfinite(seconds):
        return MAX_RETRY_AFTER_S
    # min(max(...)) as conditionals, the same values (max keeps its first argument on a tie, min
    # too): every refusal clamps at least twice (its own time, then the reservation's), two calls
    # less each
    low = MIN_RETRY_AFTER_S if seconds < MIN_RETRY_AFTER_S else seconds
    return MAX_RETRY_AFTER_S if low > MAX_RETRY_AFTER_S else low


def _excess(bounds: Bounds, jobs: int, tokens: int, cost: int, avg_cost: float) -> float:
    """How far a job of ``cost`` takes a scope of ``jobs`` and ``tokens`` past ``bounds``, in
    tokens (a job over the jobs bound counts as the queue's average, ``avg_cost``); 0 within."""
    out = 0.0
    if bounds.max_jobs is not None and jobs + 1 > bounds.max_jobs:
        out = (jobs + 1 - bounds.max_jobs) * avg_cost
    if bounds.max_tokens is not None and tokens + cost > bounds.max_tokens:
        out = max(out, tokens + cost - bounds.max_tokens)
    return out


def check_bounds(cost: int, priority: str, view: QueueView, limits: QueueLimits, drain: DrainRate) -> bool:
    """The hard bounds on queued jobs and tokens, of the model and of the job's class.

    When a bound is reached, the heaviest backlog gives way, as fq_codel drops from its fattest
    flow: if the view has a victim (a tenant with at least two more jobs queued in the class than
    the job's own) and evicting its newest job makes room, the job is taken and True returned;
    otherwise it is refused. A light tenant is never the one turned away by a queue a heavy one
    filled, and a bound stays a bound.
    """
    avg_cost = view.model_tokens / view.model_jobs if view.model_jobs else cost
    # The two scopes written out, not looped over by generators (each step of one is a call: this
    # runs on every admission), and the rate read only for a refusal's Retry-After.
    class_bounds = limits.classes.get(priority, _UNBOUNDED)
    over_model = _excess(limits.model, view.model_jobs, view.model_tokens, cost, avg_cost)
    over_class = _excess(class_bounds, view.class_jobs, view.class_tokens, cost, avg_cost)
    if over_model <= 0 and over_class <= 0:
        return False
    victim = view.victim_tokens
    if (
        victim is not None
        and _excess(limits.model, view.model_jobs - 1, view.model_tokens - victim, cost, avg_cost) <= 0
        and _excess(class_bounds, view.class_jobs - 1, view.class_tokens - victim, cost, avg_cost) <= 0
    ):
        return True
    if over_model > 0:
        excess_tokens, scope = over_model, "model's"
    else:
        excess_tokens, scope = over_class, f"'{priority}' priority class's"
    raise Refused(
        429,
        "queue_full",
        f"The {scope} queue is full; retry later.",
        clamp_retry_after(excess_tokens / drain.rate),
    )


def check_deadline(
    *,
    cost: int,
    now: float,
    deadline: float,
    view: QueueView,
    drain: DrainRate,
    slowdown: float | None = None,
) -> Admitted:
    """Can the job finish before its deadline: the work queued ahead at the rate a wait behind
    those jobs is promised at (``DrainRate.promise_rate_behind``: a full batch's, with room for
    the rate's own error and for the jobs ahead's), then its own generation at the pace admission
    promises (``DrainRate.slow_service_s``: as slow as most jobs have been, not the mean), so that
    a job admitted is one that finishes in time. ``slowdown``: ``drain.slowdown`` when the caller
    has read it already; it is read once an admission, for the wait, the promise and the job's
    own time alike (the fit is not cached on the rate, which every finished job changes)."""
    if slowdown is None:
        slowdown = drain.slowdown
    wait = drain.wait_s(view.ahead_tokens, slowdown=slowdown)
    promised_wait = drain.promised_wait_s(view.ahead_tokens, view.ahead_jobs, slowdown=slowdown)
    service = drain.slow_service_s(cost, behind_queue=view.ahead_tokens > 0, slowdown=slowdown)
    budget = deadline - now
    # Before the first measurement the rate is a guess: only the bounds protect the queue then.
    if drain.measured and promised_wait + service > budget:
        # Never to fit is judged at the pace of a job with nothing ahead of it: one that would fit
        # once the queue has drained is told to retry, not to give up.
        alone = drain.slow_service_s(cost, behind_queue=False)
        if alone > budget:
            raise Refused(
                503,
                "deadline_unmeetable",
                f"The request needs about {alone:.1f} s of generation but its deadline is in "
                f"{max(budget, 0):.1f} s; raise the timeout or lower max_tokens.",
                clamp_retry_after(alone),
                should_retry=False,
            )
        # Back when the work queued ahead now has started, as codel's refusals are told: the queue
        # it could not fit behind is then behind it. Not when the queue ahead has drained to what
        # its promised wait leaves room for: in a burst the requests arriving meanwhile take that
        # room, and a client told so comes back into the same burst (docs/benchmarks/policies.md).
        raise Refused(
            503,
            "deadline_unmeetable",
            f"The queue ahead needs about {promised_wait:.1f} s; the request could not finish within "
            f"its deadline ({budget:.1f} s).",
            clamp_retry_after(wait),
        )
    return Admitted(position=view.ahead_jobs, estimated_start_s=wait)


def check_tenant(limiter: TenantLimiter, *, cost: int, queued: int, now: float, drain: DrainRate) -> None:
    """The caller's own limits, checked before the queue's: its key's requests and tokens per minute
    (``limiter``: that key's buckets), and the tenant's ``queued`` jobs against the key's
    ``max_queued``."""
    limits = limiter.limits
    wait, which = limiter.check(cost, now)
    if which is not None:
        status = limiter.status(now)
        if not math.isfinite(wait):
            raise Refused(
                429,
                "rate_limit_exceeded",
                f"The request's {cost} tokens exceed this key's limit of {limits.tpm} tokens per minute; "
                "lower max_tokens.",
                MAX_RETRY_AFTER_S,
                should_retry=False,
                rate=status,
            )
        limit = limits.rpm if which == "requests" else limits.tpm
        raise Refused(
            429,
            "rate_limit_exceeded",
            f"Rate limit reached: {limit} {which} per minute for this key.",
            clamp_retry_after(wait),
            rate=status,
        )
    if limits.max_queued is not None and queued >= limits.max_queued:
        raise Refused(
            429,
            "too_many_queued",
            f"This key already has {queued} jobs waiting, its limit; retry when one has started.",
            clamp_retry_after(drain.wait_s(cost)),
            rate=limiter.status(now),
        )
