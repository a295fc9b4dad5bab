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


@dataclass
class DrainRate:
    """Smoothed per-slot service rate (cost units per second) of one model, its slot count, and how
    slow a job gets.

    Args:
        prior_per_slot: the rate assumed before any job has finished.
        alpha: weight of the newest sample in the moving averages.

    Attributes:
        per_slot: a slot's rate: the moving average of the jobs' costs over that of their service
            times (a ratio of averages, not an average of ratios: a job that stops early carries
            much cost in little time, and must not make the queue look faster than it drains).
        samples: the finished jobs measured.
        slots: the slots of the live workers serving the model.
        service: the moving average of the jobs' service times, in seconds (the ratio's
            denominator; 0 before the first sample).
        slow: the :data:`SLOW_QUANTILE` of a job's seconds per cost unit on a slot (0 before the
            first sample).
    """

    prior_per_slot: float = 50.0
    alpha: float = 0.2
    per_slot: float = 0.0
    samples: int = 0
    slots: int = 0
    service: float = 0.0
    slow: float = 0.0

    def observe(self, cost: int, service_s: float) -> None:
        if cost <= 0 or service_s <= 0:
            return
        per_cost = service_s / cost
        if self.samples == 0 or self.service <= 0:
            self.per_slot, self.service = cost / service_s, service_s
        else:
            carried = self.per_slot * self.service  # the moving average of the costs
            self.service += self.alpha * (service_s - self.service)
            self.per_slot = (carried + self.alpha * (cost - carried)) / self.service
        if self.slow <= 0:
            self.slow = per_cost
        elif per_cost > self.slow:
            self.slow *= math.exp(SLOW_STEP * SLOW_QUANTILE)
        else:
            self.slow *= math.exp(-SLOW_STEP * (1 - SLOW_QUANTILE))
        self.samples += 1

    @property
    def measured(self) -> bool:
        return self.samples > 0

    @property
    def slot_rate(self) -> float:
        return self.per_slot if self.samples else self.prior_per_slot

    @property
    def rate(self) -> float:
        """Cost units per second the whole model drains; never zero, so divisions stay finite."""
        return max(self.slot_rate * max(self.slots, 1), 1e-3)

    def service_s(self, cost: int) -> float:
        """Expected time one job of this cost occupies a slot."""
        return cost / max(self.slot_rate, 1e-3)

    def slow_service_s(self, cost: int) -> float:
        """The time a job of this cost is promised: at the :data:`SLOW_QUANTILE` of the time per
        cost unit seen, never less than :meth:`service_s` (before any measurement, that)."""
        mean = self.service_s(cost)
        return max(cost * self.slow, mean) if self.samples else mean

    def wait_s(self, tokens_ahead: int) -> float:
        return tokens_ahead / self.rate
