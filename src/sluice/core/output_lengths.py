"""How long a model's answers are when the engine decides: a running estimate, learned from finished jobs.

A request that sets no ``max_tokens`` goes to the engine without one, and the engine generates
until the answer ends (or the context is full). Admission still needs a cost for it before it
runs; this estimate is that cost's completion part (capped by the context window, see
:func:`sluice.core.request.plan_job`), and the real usage settles the charge afterwards.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

__all__ = ["MIN_SAMPLES", "OutputLengths"]

#: How many finished jobs it takes before the estimate is trusted.
MIN_SAMPLES = 3


@dataclass
class OutputLengths:
    """Exponentially weighted mean and variance of the tokens one sequence generated.

    Attributes:
        alpha: the weight of the newest sample: recent answers count most, so a change of traffic
            shows within some tens of jobs.
        mean: the weighted mean, in tokens per sequence.
        variance: the weighted variance around it.
        samples: how many jobs were observed.
    """

    alpha: float = 0.1
    mean: float = 0.0
    variance: float = 0.0
    samples: int = 0

    def observe(self, tokens: float) -> None:
        """One finished sequence generated ``tokens`` tokens (a job's completion tokens over its
        sequences)."""
        if not math.isfinite(tokens) or tokens < 0:
            return
        if self.samples == 0:
            self.mean, self.variance = tokens, 0.0
        else:
            diff = tokens - self.mean
            step = self.alpha * diff
            self.mean += step
            self.variance = (1 - self.alpha) * (self.variance + diff * step)
        self.samples += 1

    @property
    def estimate(self) -> int | None:
        """The tokens to reserve for one sequence: the mean plus two standard deviations (most
        answers are shorter), at least one; None before MIN_SAMPLES jobs."""
        if self.samples < MIN_SAMPLES:
            return None
        return max(1, math.ceil(self.mean + 2 * math.sqrt(self.variance)))
