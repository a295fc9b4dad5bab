"""How an engine's time per output token grows with the sequences in flight: the line
``tpot = a + b * inflight`` that :class:`sluice.core.concurrency.ConcurrencyLimit` reads to stop
growing where one more sequence barely adds throughput, or where the line meets a TPOT objective.
Pure: no I/O, time comes from an injected clock.

The line is fitted over per-in-flight buckets of smoothed TPOT. A bucket counts for ``memory_s``
after its newest sample, and all are dropped when the bucket being fed moves far from what the
line predicts (another tenant on the GPU, longer contexts): the line then follows the engine
without the limit being forced down to re-measure it (Envoy's adaptive concurrency re-measures
its minRTT on a timer for the same reason).
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

__all__ = ["Line", "TpotLine"]

#: Weight of the newest sample in its bucket's moving average.
BUCKET_WEIGHT = 0.2
#: The most samples a bucket is weighted by in the fit (a bucket fed for long does not pin it).
BUCKET_COUNT_CAP = 50
#: Samples a bucket needs before its distance from the line can say the engine changed.
CHANGE_MIN_COUNT = 5
#: A bucket this far from the line's prediction (a share of it) says the engine changed under it.
CHANGE_SHARE = 0.35
#: The least in-flight span the fresh buckets must cover to give a slope.
MIN_SPAN = 2


@dataclass(slots=True)
class _Bucket:
    """Smoothed TPOT of the streams that started with ``n`` in flight.

    Attributes:
        tpot: moving average of their seconds per output token.
        count: samples folded in (capped; it weights the line's fit).
        updated: clock time of the newest sample.
    """

    tpot: float
    count: int
    updated: float


@dataclass(frozen=True, slots=True)
class Line:
    """``tpot = a + b * inflight``, fitted over the fresh buckets.

    Attributes:
        a: seconds per output token with no other sequence in flight (the intercept, > 0).
        b: seconds per output token each more sequence in flight adds (>= 0).
    """

    a: float
    b: float

    def at(self, n: float) -> float:
        """The TPOT predicted with ``n`` in flight."""
        return self.a + self.b * n

    def elasticity(self, n: float) -> float:
        """d ln tpot / d ln n at ``n``: 0 when the batch is free, 1 when tokens/s is flat."""
        tpot = self.at(n)
        return self.b * n / tpot if tpot > 0 else 1.0


class TpotLine:
    """The buckets of smoothed TPOT per in-flight count, and the line fitted through them.

    Args:
        memory_s: how long a bucket counts after its newest sample.
        clock: monotonic seconds (the fit reads it to leave stale buckets out).
    """

    def __init__(self, memory_s: float, clock: Callable[[], float]) -> None:
        self._memory_s = memory_s
        self._clock = clock
        self._buckets: dict[int, _Bucket] = {}
        # The last fit, when it was made, and the oldest bucket it used (its ``updated``; None:
        # it used none); ``_fitted_at`` is None when nothing is kept. The limit asks for the line
        # up to three times a sample (the fold, the objective, the growth), and the fit walks
        # every bucket: it is made again only once a bucket changed or the oldest it used went
        # stale (a bucket left out as stale stays out as the clock goes on), so that what it
        # returns is what a fit made afresh would.
        self._fitted: Line | None = None
        self._fitted_at: float | None = None
        self._oldest: float | None = None

    def fold(self, n: int, tpot: float, now: float) -> None:
        """A stream that started with ``n`` in flight ran at ``tpot`` seconds per output token."""
        bucket = self._buckets.get(n)
        if bucket is None:
            self._buckets[n] = _Bucket(tpot, 1, now)
            self._fitted_at = None
            return
        # The line as it stood before this sample (the change test reads it), fitted only when
        # that test can be reached: a bucket of CHANGE_MIN_COUNT - 1 samples cannot.
        line = self.fit() if bucket.count + 1 >= CHANGE_MIN_COUNT else None
        self._fitted_at = None
        bucket.tpot += BUCKET_WEIGHT * (tpot - bucket.tpot)
        bucket.count = min(bucket.count + 1, BUCKET_COUNT_CAP)
        bucket.updated = now
        # The engine changed under the line (a second tenant, longer contexts): what the line
        # was fitted on no longer holds, so it is fitted again from what comes next.
        if (
            line is not None
            and bucket.count >= CHANGE_MIN_COUNT
            and abs(bucket.tpot - line.at(n)) > CHANGE_SHARE * line.at(n)
        ):
            self._buckets = {n: bucket}

    def fit(self) -> Line | None:
        """The least-squares line of TPOT over in-flight count, from the fresh buckets; None when
        they span too little of the in-flight range to give a slope."""
        now = self._clock()
        at, oldest = self._fitted_at, self._oldest
        # The same test as the fit's own for the oldest bucket it used: while that one is fresh,
        # so are the others it used.
        if at is not None and now >= at and (oldest is None or now - oldest <= self._memory_s):
            return self._fitted
        return self._fit(now)

    def _fit(self, now: float) -> Line | None:
        """The fit of :meth:`fit` at ``now``, kept (see ``__init__``)."""
        memory_s = self._memory_s
        fresh = [(n, b) for n, b in self._buckets.items() if now - b.updated <= memory_s]
        self._fitted_at = now
        self._oldest = min([b.updated for _, b in fresh]) if fresh else None
        self._fitted = None
        # Lists, not generators, for the sums: the same values summed in the same order by the
        # same sum(), without a generator's resumption (a call) for every bucket.
        ns = [n for n, _ in fresh]
        if len(fresh) < 2 or max(ns) - min(ns) < MIN_SPAN:
            return None
        w = [float(b.count) for _, b in fresh]
        sw = sum(w)
        mx = sum([wi * n for wi, (n, _) in zip(w, fresh, strict=True)]) / sw
        my = sum([wi * b.tpot for wi, (_, b) in zip(w, fresh, strict=True)]) / sw
        sxx = sum([wi * (n - mx) ** 2 for wi, (n, _) in zip(w, fresh, strict=True)])
        sxy = sum([wi * (n - mx) * (b.tpot - my) for wi, (n, b) in zip(w, fresh, strict=True)])
        if sxx <= 0:
            return None
        b = max(0.0, sxy / sxx)
        a = my - b * mx
        if a <= 0:
            # A line through (or below) zero at no load is noise; keep the slope's share bounded.
            a = max(my * 0.05, 1e-9)
            b = max(0.0, (my - a) / mx)
        self._fitted = Line(a, b)
        return self._fitted
