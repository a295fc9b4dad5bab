"""A what-if for ``sluice.bench.policy_model`` (issue 18): codel's burst limit counted as the promise counts.

codel keeps the queue a burst built: at the end of its interval the limit is the delay reached, at
the mean drain rate, decaying with the half-life. At a burst's onset the deadline check promises a
wait with a wide margin (the rate is young, and few jobs are queued ahead: ``DrainRate.promise_rate_behind``),
so on small engines with long-tailed answers the queue the burst built is what that margin allowed,
and codel then holds it there while the margin narrows (traced on seed 1 of the family: 5.2 s of
delay in the burst's first second, 1.1 s in the next, the deadline refusing). Counted in the
promise's terms, the limit lets the queue grow as the deadline would: the limit is stored as the
delay times the promise's ratio at that admission, and read back divided by the ratio now.

``terms``: ``margin``, the ratio is the wait's margin alone (``DrainRate.wait_margin`` behind the
jobs ahead); ``promise``, the whole promise (the mean rate over ``DrainRate.promise_rate_behind``:
the margin and the slowdown's extrapolation to a full batch). Measured in
docs/benchmarks/policies.md ("codel's burst limit in the promise's terms"); not in ``sluice.core``.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import ClassVar

from sluice.core.admission import Admitted, check_bounds
from sluice.core.capacity import DrainRate
from sluice.core.policy import Candidate, CoDelPolicy, PolicyState, _deadline, learning, standing_refusal

#: The what-if's choices (``--burst-limit``); ``delay`` is codel's own rule.
TERMS = ("delay", "margin", "promise")


def promise_ratio(drain: DrainRate, jobs_ahead: int, slowdown: float, terms: str) -> float:
    """How much longer than its mean a wait behind ``jobs_ahead`` is promised (at least 1)."""
    if not drain.measured or terms == "delay":
        return 1.0
    if terms == "margin":
        return drain._wait_margin(drain.spread, jobs_ahead, drain.residual_spread)
    return max(drain.rate_at(slowdown) / drain.promise_rate_behind(jobs_ahead, slowdown=slowdown), 1.0)


@dataclass(frozen=True)
class PromiseTermsCoDel(CoDelPolicy):
    """codel, with a burst's limit kept as the promised wait it reached (``terms``: :data:`TERMS`).
    A slow rise's limit (the target, or 0 while the rate learns) is unchanged: it has no excess
    over the target to scale."""

    terms: str = "margin"
    name: ClassVar[str] = "codel"

    def admit(self, c: Candidate, state: PolicyState) -> Admitted:
        evict = check_bounds(c.cost, c.priority, c.view, c.limits, c.drain)
        slowdown = c.drain.slowdown
        target = self.target(c, slowdown=slowdown)
        delay = c.drain.wait_s(c.view.tail_tokens, slowdown=slowdown)
        ratio = promise_ratio(c.drain, c.view.ahead_jobs, slowdown, self.terms)
        was_standing = state.standing_since is not None
        self.observe(state, delay, c.now, target, learning=learning(c.drain))
        if not was_standing and state.standing_since is not None and state.limit_s > target:
            state.limit_s *= ratio  # a burst's: the delay it reached, as the promise counted it
        wait = c.drain.wait_s(c.view.ahead_tokens, slowdown=slowdown)
        limit = self.delay_limit(state, c.now, target, ratio)
        if wait > limit:
            raise standing_refusal(state, c.now, wait, limit)
        return _deadline(c, evict, slowdown)

    def delay_limit(self, state: PolicyState, now: float, target: float, ratio: float = 1.0) -> float:
        """:meth:`CoDelPolicy.delay_limit`, the stored limit read back at today's ``ratio``."""
        if state.standing_since is None:
            return math.inf
        excess = max(state.limit_s / ratio - target, 0.0)
        return target + excess * math.pow(0.5, max(now - state.standing_since, 0.0) / self.half_life_s)

    def describe(self) -> str:
        return f"{super().describe()} + burst limit in {self.terms} terms"
