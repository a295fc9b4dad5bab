"""Whether an engine gets work: outlier ejection with backoff, half-open probing, speed weights.

Like Envoy's outlier detection: an engine that fails ``failures_to_eject`` requests in a row (a
retryable error: a refused connection, a 5xx, a timeout) is ejected for ``base_ejection_s``; each
ejection that follows soon after doubles that time, up to ``max_ejection_s``. When the ejection
ends the engine is half-open (the circuit breaker's term): it gets exactly one request, the probe.
The probe's success makes it healthy again; its failure ejects it again, for twice as long. A
healthy spell as long as ``max_ejection_s`` forgets the earlier ejections, so an engine that
failed once an hour is ejected for the base time each time, not for the cap.

Slowness is not failure: an engine several times slower than its peers (a noisy neighbour on its
GPU, a thermal throttle) still answers, so it is not ejected but weighted
(:func:`speed_weights`), and the router sends it proportionally less.

Pure: every method takes ``now`` (monotonic seconds) from the caller.
"""

from __future__ import annotations

from collections.abc import Mapping
from enum import StrEnum

__all__ = ["SLOW_TOLERANCE", "EngineHealth", "HealthState", "speed_weights"]

#: An engine up to this many times slower than the reference peer is weighted 1.
SLOW_TOLERANCE = 1.5
#: The smallest weight :func:`speed_weights` gives: a very slow engine still gets a trickle of
#: work, which keeps its speed measured (so it can earn its weight back).
MIN_WEIGHT = 0.05


class HealthState(StrEnum):
    """Where an engine stands."""

    HEALTHY = "healthy"  # takes work
    EJECTED = "ejected"  # takes none until its ejection ends
    PROBING = "probing"  # ejection over: takes one request, whose outcome decides


class EngineHealth:
    """One engine's ejection state.

    Args:
        base_ejection_s: the first ejection's length.
        max_ejection_s: the cap on an ejection's length (it doubles with each probe that fails or
            each ejection that follows another within this time).
        failures_to_eject: consecutive failures that eject a healthy engine.
    """

    def __init__(
        self,
        *,
        base_ejection_s: float = 1.0,
        max_ejection_s: float = 30.0,
        failures_to_eject: int = 1,
    ) -> None:
        if base_ejection_s <= 0 or max_ejection_s < base_ejection_s:
            raise ValueError("need 0 < base_ejection_s <= max_ejection_s")
        if failures_to_eject < 1:
            raise ValueError("failures_to_eject must be at least 1")
        self.base_ejection_s = base_ejection_s
        self.max_ejection_s = max_ejection_s
        self.failures_to_eject = failures_to_eject
        #: Failures since the last success.
        self.consecutive_failures = 0
        #: Ejections in the current run of trouble (the exponent of the doubling).
        self.ejections = 0
        #: Ejections over this object's life (for /admin).
        self.total_ejections = 0
        #: When the current ejection ends (None: not ejected nor probing).
        self._until: float | None = None
        #: When the engine was last made healthy after an ejection (for forgetting).
        self._recovered_at: float | None = None
        #: Whether the half-open probe has been sent and not answered.
        self.probe_in_flight = False

    def state(self, now: float) -> HealthState:
        if self._until is None:
            return HealthState.HEALTHY
        return HealthState.EJECTED if now < self._until else HealthState.PROBING

    def available(self, now: float) -> bool:
        """Whether the engine may take a request now: healthy, or probing with no probe out."""
        state = self.state(now)
        return state is HealthState.HEALTHY or (state is HealthState.PROBING and not self.probe_in_flight)

    def ejection_s(self) -> float:
        """How long the next ejection lasts."""
        return min(self.base_ejection_s * 2.0**self.ejections, self.max_ejection_s)

    def on_dispatch(self, now: float) -> None:
        """A request was sent to the engine; when probing, it is the probe."""
        if self.state(now) is HealthState.PROBING:
            self.probe_in_flight = True

    def on_success(self, now: float) -> None:
        """A request finished well. While probing, that ends the ejection; while ejected (a
        request sent before the ejection), it only resets the count of failures."""
        self.consecutive_failures = 0
        if self.state(now) is HealthState.PROBING:
            self._until = None
            self.probe_in_flight = False
            self._recovered_at = now

    def on_failure(self, now: float) -> None:
        """A request failed in a way worth retrying elsewhere (error or timeout): eject once
        enough have failed in a row; a failed probe ejects again, for twice as long. Failures of
        requests sent before the current ejection do not lengthen it."""
        self.consecutive_failures += 1
        state = self.state(now)
        if state is HealthState.EJECTED:
            return
        if state is HealthState.PROBING or self.consecutive_failures >= self.failures_to_eject:
            if (
                state is HealthState.HEALTHY
                and self._recovered_at is not None
                and now - self._recovered_at >= self.max_ejection_s
            ):
                self.ejections = 0  # a long healthy spell: this is new trouble, not the old
            self._eject(now)

    def _eject(self, now: float) -> None:
        self._until = now + self.ejection_s()
        self.ejections += 1
        self.total_ejections += 1
        self.probe_in_flight = False
        # consecutive_failures stays: it counts failures since the last success (what operators
        # read as "failures in a row"); only a success resets it.

    def snapshot(self, now: float) -> dict[str, object]:
        """JSON-able state for /admin and the dashboard."""
        return {
            "state": self.state(now).value,
            "consecutive_failures": self.consecutive_failures,
            "ejections": self.total_ejections,
            "ejected_for_s": (round(max(self._until - now, 0.0), 3) if self._until is not None else 0.0),
            "next_ejection_s": self.ejection_s(),
            "probe_in_flight": self.probe_in_flight,
        }


def speed_weights(seconds_per_token: Mapping[str, float | None]) -> dict[str, float]:
    """Engine -> weight in (0, 1] from each engine's measured decode seconds per token.

    The reference is the fastest median of the measured engines (the lower median: with two
    engines, the faster one; with three, the middle one), so that one slow engine in a small fleet
    cannot drag the reference towards itself. An engine within :data:`SLOW_TOLERANCE` of it
    weighs 1; a slower one ``SLOW_TOLERANCE x reference / its own`` (four times slower: 0.375),
    never below :data:`MIN_WEIGHT`. An engine not measured weighs 1.
    """
    known = sorted(v for v in seconds_per_token.values() if v is not None and v > 0)
    if not known:
        return {name: 1.0 for name in seconds_per_token}
    reference = known[(len(known) - 1) // 2]
    out: dict[str, float] = {}
    for name, spt in seconds_per_token.items():
        if spt is None or spt <= 0 or spt <= SLOW_TOLERANCE * reference:
            out[name] = 1.0
        else:
            out[name] = max(SLOW_TOLERANCE * reference / spt, MIN_WEIGHT)
    return out
