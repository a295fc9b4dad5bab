"""How fast a model's queue drains, measured from the jobs that finished.

The unit is the job cost (estimated prompt tokens + ``max_tokens``), the same unit the queue is
counted in, so that "cost queued ahead ÷ drain rate" is a time without any conversion. A finished
job contributes its cost divided by its service time: the rate of one engine slot at the load it
ran under. Times the number of slots serving the model, that is the drain rate.
"""

from __future__ import annotations

from dataclasses import dataclass


@dataclass
class DrainRate:
    """Smoothed per-slot service rate (cost units per second) of one model, and its slot count.

    Args:
        prior_per_slot: the rate assumed before any job has finished.
        alpha: weight of the newest sample in the moving average.
    """

    prior_per_slot: float = 50.0
    alpha: float = 0.2
    per_slot: float = 0.0
    samples: int = 0
    slots: int = 0

    def observe(self, cost: int, service_s: float) -> None:
        if cost <= 0 or service_s <= 0:
            return
        sample = cost / service_s
        self.per_slot = sample if self.samples == 0 else self.per_slot + self.alpha * (sample - self.per_slot)
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

    def wait_s(self, tokens_ahead: int) -> float:
        return tokens_ahead / self.rate
