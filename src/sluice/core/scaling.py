"""How many engines a model needs: the scaling signal, from the demand Sluice sees and the capacity
it has learned. Pure: no I/O, time comes in as arguments.

The signal is ``desired_engines``: the engines needed to serve the current demand within the
deadlines, with headroom, and with hysteresis so that it does not flap. Three steps:

1. **What one engine does.** A busy slot drains ``slot_rate`` cost units (tokens) per second
   (:class:`sluice.core.capacity.DrainRate`, learned from the jobs that finished); an engine has
   ``slots_per_engine`` of them. Their product is ``per_engine_rate``.
2. **What the demand needs** (:func:`assess`). For every class with a deadline objective (the
   urgent ones), highest first: the rate that keeps up with the arrivals, plus the rate that clears
   the work queued at or above that class within ``min(horizon_s, objective)``::

       need_c = (arrival_tokens_per_s * (1 + rate_headroom)
                 + ahead_c / min(horizon_s, objective_c) * (1 + headroom)) / per_engine_rate

   and ``raw = ceil(max_c need_c)``, clamped to the policy's bounds. A class is *at risk* when its
   predicted wait (the tokens queued at or above it over the capacity serving now) exceeds its
   objective; its backlog term then asks for more engines than serve now, so a premium class
   at risk scales the pool. A best-effort class (no objective) adds nothing: its backlog waits for
   capacity left idle. While a best-effort backlog is queued the engines run full on it, so the
   measured arrival rate is the fleet's throughput, not urgent demand: it is then counted without
   headroom (it holds the engines serving, and never grows them).
3. **Hysteresis** (:class:`Stabiliser`). Up at once (a cold start already costs a minute) once
   the need is past a tolerance (10 %) above the engines given; down only to the highest raw
   value of the last ``down_window_s`` (the rule of Kubernetes' HPA) and by at most
   ``down_step`` engines per ``down_period_s``, so noisy steady input does not flap.

:class:`ArrivalEstimator` gives the arrival rate from what every gateway can read of the shared
queue: the tokens served (busy slots x slot rate) plus the growth of the urgent queue, smoothed.
"""

from __future__ import annotations

import math
from collections import deque
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, field

__all__ = [
    "DEFAULT_OBJECTIVES",
    "ArrivalEstimator",
    "Assessment",
    "ClassObjective",
    "ClassQueue",
    "Demand",
    "ScalingPolicy",
    "Stabiliser",
    "Supply",
    "assess",
    "pool_shares",
    "split_by_pool",
    "throughput",
    "urgent_tokens",
]


@dataclass(frozen=True)
class ClassObjective:
    """The operator's objective for one priority class.

    Attributes:
        name: the class (as configured in the queue's classes).
        deadline_s: the wait a job of the class may see before it starts, at most; None marks the
            class best effort: it is served by capacity left idle and never adds an engine.
    """

    name: str
    deadline_s: float | None


#: The default classes' objectives: ``high`` starts within 10 s, ``normal`` within 60 s, ``low``
#: (batch work) is best effort.
DEFAULT_OBJECTIVES: tuple[ClassObjective, ...] = (
    ClassObjective("high", 10.0),
    ClassObjective("normal", 60.0),
    ClassObjective("low", None),
)


@dataclass(frozen=True)
class ScalingPolicy:
    """How demand turns into engines.

    Attributes:
        objectives: per class, highest first, its deadline objective; a queued class not listed is
            taken as best effort.
        horizon_s: a backlog is to be cleared within this long (or the class's objective, if
            shorter): the smaller, the harder a backlog pushes.
        headroom: the share of capacity kept spare above the urgent demand (0.2: engines run at
            most ~83 % busy on it), for the noise of arrivals and the minute a new engine takes.
        min_engines, max_engines: bounds of the answer (max None: unbounded).
        busy_floor: engines kept while any job is queued or running, best effort too (so that a
            batch never waits on a fleet scaled to zero).
        default_slots_per_engine: an engine's slots assumed while none serves the model (scaled to
            zero) and none was seen before.
        down_window_s: scale down only to the highest raw answer of this window (HPA: 300 s).
        down_step: engines removed at most per ``down_period_s``.
        down_period_s: see ``down_step``.
        up_tolerance: scale up only when the unrounded need exceeds the engines given by more than
            this share of them (HPA's tolerance, 0.1), so that a need hovering at a whole number
            does not flap; a backlog that grows pushes the need past it.
    """

    objectives: tuple[ClassObjective, ...] = DEFAULT_OBJECTIVES
    horizon_s: float = 60.0
    headroom: float = 0.2
    min_engines: int = 0
    max_engines: int | None = None
    busy_floor: int = 1
    default_slots_per_engine: int = 16
    down_window_s: float = 300.0
    down_step: int = 1
    down_period_s: float = 30.0
    up_tolerance: float = 0.1

    def __post_init__(self) -> None:
        if self.horizon_s <= 0:
            raise ValueError("horizon_s must be positive")
        if self.headroom < 0:
            raise ValueError("headroom must not be negative")
        if self.min_engines < 0 or (self.max_engines is not None and self.max_engines < self.min_engines):
            raise ValueError("need 0 <= min_engines <= max_engines")
        if self.up_tolerance < 0:
            raise ValueError("up_tolerance must not be negative")
        if self.down_step < 1 or self.down_window_s < 0 or self.down_period_s < 0:
            raise ValueError("down_step must be at least 1, the windows not negative")
        for o in self.objectives:
            if o.deadline_s is not None and o.deadline_s <= 0:
                raise ValueError(f"class {o.name!r}: a deadline objective must be positive")

    def objective(self, name: str) -> float | None:
        for o in self.objectives:
            if o.name == name:
                return o.deadline_s
        return None


@dataclass(frozen=True)
class ClassQueue:
    """What one priority class has queued.

    Attributes:
        jobs: its jobs queued.
        tokens: their cost (prompt + max_tokens, in tokens).
    """

    jobs: int
    tokens: int


@dataclass(frozen=True)
class Demand:
    """One model's demand, as the shared queue shows it.

    Attributes:
        queued_jobs, queued_tokens: the whole queue, every class.
        running_jobs: jobs on engines now.
        arrival_tokens_per_s: tokens (cost units) arriving per second, smoothed
            (:class:`ArrivalEstimator`).
        oldest_queued_age_s: age of the oldest queued job (0 when none is queued).
        classes: per class, in dispatch order (highest first), what it has queued; classes not
            listed hold nothing.
    """

    queued_jobs: int
    queued_tokens: int
    running_jobs: int
    arrival_tokens_per_s: float
    oldest_queued_age_s: float = 0.0
    classes: Mapping[str, ClassQueue] = field(default_factory=dict)


@dataclass(frozen=True)
class Supply:
    """What serves the model now.

    Attributes:
        engines: engines serving it (ready, not draining).
        slots: their sequences (in-flight limits) together.
        slot_rate: cost units per second one busy slot drains (``DrainRate.slot_rate``).
        slots_per_engine: an engine's slots when none serves now (the last seen, or None for the
            policy's default); ignored while ``engines`` > 0 (then it is ``slots / engines``).
    """

    engines: int
    slots: int
    slot_rate: float
    slots_per_engine: float | None = None

    def engine_slots(self, default: int) -> float:
        if self.engines > 0 and self.slots > 0:
            return self.slots / self.engines
        return self.slots_per_engine if self.slots_per_engine else float(default)

    def capacity(self) -> float:
        """Cost units per second the engines serving now drain together."""
        return max(self.slots, 0) * max(self.slot_rate, 0.0)


@dataclass(frozen=True)
class Assessment:
    """What :func:`assess` found for one model.

    Attributes:
        raw_engines: the engines the demand needs now (before hysteresis).
        needed: the same before rounding up and clamping (for plots and tests).
        per_engine_rate: cost units per second one engine drains.
        capacity: cost units per second the engines serving now drain.
        predicted_wait_s: per class (every objective's class and every queued one), how long a job
            of it queued now waits: the tokens queued at or above it over ``capacity`` (inf when
            tokens wait and nothing serves; 0 when nothing waits).
        at_risk: per class with an objective, whether its predicted wait exceeds it.
    """

    raw_engines: int
    needed: float
    per_engine_rate: float
    capacity: float
    predicted_wait_s: dict[str, float]
    at_risk: dict[str, bool]


def _wait(tokens: float, capacity: float) -> float:
    if tokens <= 0:
        return 0.0
    return tokens / capacity if capacity > 0 else math.inf


def class_order(demand: Demand, policy: ScalingPolicy) -> list[str]:
    """The classes to judge, in dispatch order: the policy's, then any other queued one."""
    names = [o.name for o in policy.objectives]
    return names + [c for c in demand.classes if c not in names]


def assess(demand: Demand, supply: Supply, policy: ScalingPolicy) -> Assessment:
    """The engines ``demand`` needs from engines like those of ``supply`` (module docstring)."""
    per_engine = max(supply.slot_rate, 1e-9) * supply.engine_slots(policy.default_slots_per_engine)
    capacity = supply.capacity()
    best_effort_queued = any(
        q.jobs > 0 and policy.objective(name) is None for name, q in demand.classes.items()
    )
    # Full engines serving a best-effort backlog measure their throughput as the arrival rate.
    rate = max(demand.arrival_tokens_per_s, 0.0) * (1.0 if best_effort_queued else 1.0 + policy.headroom)
    need = rate / per_engine
    ahead = 0.0
    waits: dict[str, float] = {}
    risk: dict[str, bool] = {}
    for name in class_order(demand, policy):
        queued = demand.classes.get(name)
        ahead += queued.tokens if queued is not None else 0
        waits[name] = _wait(ahead, capacity)
        objective = policy.objective(name)
        if objective is None:
            continue
        risk[name] = waits[name] > objective
        clear = ahead / min(policy.horizon_s, objective) * (1.0 + policy.headroom)
        need = max(need, (rate + clear) / per_engine)
    raw = math.ceil(need - 1e-9)
    if demand.queued_jobs > 0 or demand.running_jobs > 0:
        raw = max(raw, policy.busy_floor)
    raw = max(raw, policy.min_engines)
    if policy.max_engines is not None:
        raw = min(raw, policy.max_engines)
    return Assessment(raw, need, per_engine, capacity, waits, risk)


class Stabiliser:
    """Hysteresis on the raw answers of :func:`assess`: up at once, down slowly (module docstring).

    Args:
        policy: its ``down_window_s``, ``down_step`` and ``down_period_s``.

    Attributes:
        current: the answer given last (None before the first).
    """

    def __init__(self, policy: ScalingPolicy) -> None:
        self.policy = policy
        self.current: int | None = None
        self._history: deque[tuple[float, int]] = deque()
        self._last_down = -math.inf

    def update(self, raw: int, now: float, needed: float | None = None) -> int:
        """The answer at ``now`` given this raw answer (and the unrounded need it came from, for
        the up tolerance; None: no tolerance); calls come in time order."""
        p = self.policy
        self._history.append((now, raw))
        while self._history and self._history[0][0] < now - p.down_window_s:
            self._history.popleft()
        if self.current is None or raw == self.current:
            self.current = raw
            return raw
        if raw > self.current:
            if needed is None or self.current == 0 or needed > self.current * (1 + p.up_tolerance):
                self.current = raw
            return self.current
        floor = max(r for _, r in self._history)
        if floor < self.current and now - self._last_down >= p.down_period_s:
            self.current = max(floor, self.current - p.down_step)
            self._last_down = now
        return self.current


class ArrivalEstimator:
    """Tokens arriving per second, from successive readings of the shared queue.

    What arrives either is served or waits: the arrival rate is the throughput (busy slots times the
    slot rate) plus the growth of the queue. Only the urgent classes' queue is counted, so that a
    best-effort batch pushed in at once does not read as a surge of demand. Each reading is
    smoothed with a time constant ``tau_s`` (an exponential moving average in continuous time).

    The slot rate is smoothed the same way (:attr:`slot_rate`): the broker's moves with every job
    that finishes, and one long job or a few short ones swing it by half; the engines one needs are
    the smoothed rate over the smoothed slot rate, so that the swings of both cancel.

    Args:
        tau_s: the smoothing time constant, in seconds.

    Attributes:
        rate: the smoothed arrival rate (tokens per second).
        slot_rate: the smoothed slot rate given to :meth:`observe` (0 before the first).
    """

    def __init__(self, tau_s: float = 30.0) -> None:
        if tau_s <= 0:
            raise ValueError("tau_s must be positive")
        self.tau_s = tau_s
        self.rate: float = 0.0
        self.slot_rate: float = 0.0
        self._last: tuple[float, float] | None = None

    def observe(
        self, now: float, urgent_queued_tokens: float, throughput: float, slot_rate: float | None = None
    ) -> float:
        """Count one reading at ``now``: the urgent classes' queued tokens, the tokens per second
        being served, and the slot rate it was computed with; returns the smoothed rate."""
        if self._last is None:
            self._last = (now, urgent_queued_tokens)
            self.rate = max(throughput, 0.0)
            self.slot_rate = max(slot_rate or 0.0, 0.0)
            return self.rate
        then, queued = self._last
        dt = now - then
        if dt <= 0:
            return self.rate
        weight = 1.0 - math.exp(-dt / self.tau_s)
        sample = max(throughput + (urgent_queued_tokens - queued) / dt, 0.0)
        self.rate += weight * (sample - self.rate)
        if slot_rate is not None and slot_rate > 0:
            self.slot_rate = (
                slot_rate if self.slot_rate <= 0 else self.slot_rate + weight * (slot_rate - self.slot_rate)
            )
        self._last = (now, urgent_queued_tokens)
        return self.rate


def throughput(running_jobs: int, slots: int, slot_rate: float) -> float:
    """Tokens per second the busy slots serve (a slot's rate is measured at the load it ran at)."""
    return min(max(running_jobs, 0), max(slots, 0)) * max(slot_rate, 0.0)


def urgent_tokens(classes: Mapping[str, ClassQueue], objectives: Sequence[ClassObjective]) -> int:
    """The tokens queued in classes that have a deadline objective."""
    urgent = {o.name for o in objectives if o.deadline_s is not None}
    return sum(q.tokens for name, q in classes.items() if name in urgent)


def pool_shares(engines_by_pool: Mapping[str, int]) -> dict[str, float]:
    """Each pool's share of a model's engines (pools with none left out; empty when none serves)."""
    total = sum(n for n in engines_by_pool.values() if n > 0)
    return {p: n / total for p, n in engines_by_pool.items() if n > 0} if total else {}


def split_by_pool(desired: Mapping[str, int], shares: Mapping[str, Mapping[str, float]]) -> dict[str, int]:
    """The engines each pool needs: every model's desired engines split over the pools that serve it,
    in proportion to their shares of its engines (``shares``: model -> pool -> share, summing to 1),
    summed per pool and rounded up. A model no pool is known for adds to none."""
    need: dict[str, float] = {}
    for model, engines in desired.items():
        for pool, share in shares.get(model, {}).items():
            need[pool] = need.get(pool, 0.0) + engines * share
    return {pool: math.ceil(n - 1e-9) for pool, n in need.items()}
