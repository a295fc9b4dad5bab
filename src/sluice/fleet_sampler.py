"""One reading of the state that every process on a broker shares, for the two parts of a gateway
that look at it: the dashboard's feed (:mod:`sluice.dashboard_feed`, once a second) and the
scaling signal (:mod:`sluice.scaling_signal`, every few seconds).

Both want the same four things: the queue's stats, its breakdown by class and tenant, every
process's report and the backends marked draining. Read separately, each read costs the broker a
round of commands (on Redis, a scan of every model's queues); shared, the broker is read once a
second whatever looks at it. The feed takes a fresh reading at each of its ticks
(:meth:`FleetSampler.read`: its snapshot must include the report it has just published), and the
signal takes the latest one when it is recent enough (:meth:`FleetSampler.recent`), reading the
broker itself only when no feed runs or the feed's last tick is too old.

Wiring: the scaling signal makes the sampler (:attr:`ScalingSignal.sampler`) and the feed, given
the signal, reads through it; either can be given a sampler instead.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from sluice.broker.base import Broker, ModelStats, QueueBreakdown
from sluice.dashboard import TOP_TENANTS


@dataclass(frozen=True)
class FleetReading:
    """What the broker said at one reading.

    Attributes:
        at: the broker's clock when the reading started (seconds).
        stats: per model: depth, running jobs, slots and drain rate (:meth:`Broker.stats`).
        breakdown: per model with a queue: depth by class, and the top tenants
            (:meth:`Broker.queue_breakdown`).
        reports: every live process's report, by process id (:meth:`Broker.reports`).
        draining: the backends marked draining (:meth:`Broker.draining`).
    """

    at: float
    stats: dict[str, ModelStats]
    breakdown: dict[str, QueueBreakdown]
    reports: dict[str, dict[str, Any]]
    draining: frozenset[str]


class FleetSampler:
    """Reads the broker's shared state, and keeps the latest reading for whoever asks next.

    Args:
        broker: the queue every gateway and worker shares (started by whoever built it).
        top_tenants: tenants listed per model in the breakdown (the dashboard's list; the scaling
            signal reads only the classes).
        clock: seconds; the broker's clock unless given.
    """

    def __init__(
        self, broker: Broker, *, top_tenants: int = TOP_TENANTS, clock: Callable[[], float] | None = None
    ) -> None:
        self.broker = broker
        self.top_tenants = top_tenants
        self.clock = clock or broker.now
        #: the latest reading, None before the first
        self.latest: FleetReading | None = None
        #: how many times the broker was read
        self.reads = 0
        # One reading at a time: a caller that finds one under way waits for it rather than
        # starting a second.
        self._lock = asyncio.Lock()

    async def read(self) -> FleetReading:
        """A fresh reading of the broker (after any under way), kept as :attr:`latest`."""
        async with self._lock:
            return await self._read()

    async def recent(self, max_age_s: float) -> FleetReading:
        """The latest reading if it is at most ``max_age_s`` old, else a fresh one."""
        async with self._lock:
            latest = self.latest
            if latest is not None and 0 <= self.clock() - latest.at <= max_age_s:
                return latest
            return await self._read()

    async def _read(self) -> FleetReading:
        broker = self.broker
        at = self.clock()
        reading = FleetReading(
            at=at,
            stats=await broker.stats(),
            breakdown=await broker.queue_breakdown(self.top_tenants),
            reports=await broker.reports(),
            draining=frozenset(await broker.draining()),
        )
        self.latest = reading
        self.reads += 1
        return reading
