"""One warning when a dependency goes away, one line when it is back: not a line per failed call.

The loops that talk to the broker (claims, heartbeats, webhook fetches, upkeep) retry every few
hundred milliseconds; during a Redis outage each retry fails. Logging each one buried the logs in
tracebacks. An :class:`OutageLog` per loop logs the first failure of an outage as a warning
without a traceback (the outage is not a bug), counts the rest, and logs the recovery with how long
it lasted. A failure that is not an outage (anything but :class:`BrokerUnavailable`) is a bug and
keeps its traceback, every time.
"""

from __future__ import annotations

import logging
import time
from collections.abc import Callable

from sluice.broker.base import BrokerUnavailable


class OutageLog:
    """The log of one loop's outages.

    Args:
        log: where the lines go.
        what: what the loop does, for the lines ("claims", "heartbeat", ...).
        outages: the exceptions that mean the dependency is away (any other is a bug).
        clock: monotonic seconds; injected so tests can move time.
    """

    def __init__(
        self,
        log: logging.Logger,
        what: str,
        outages: tuple[type[BaseException], ...] = (BrokerUnavailable,),
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.log = log
        self.what = what
        self.outages = outages
        self.clock = clock
        #: when the current outage began; None while the dependency answers
        self.since: float | None = None
        #: calls that failed in the current outage
        self.failures = 0

    def failed(self, exc: BaseException) -> None:
        """A call failed: an outage is logged once, a bug every time."""
        if not isinstance(exc, self.outages):
            self.log.error("%s failed", self.what, exc_info=exc)
            return
        self.failures += 1
        if self.since is None:
            self.since = self.clock()
            self.log.warning(
                "%s paused: the broker is unavailable (%s); retrying until it is back", self.what, exc
            )

    def ok(self) -> None:
        """A call succeeded: ends the outage, if there was one."""
        if self.since is None:
            return
        lasted = self.clock() - self.since
        self.log.warning(
            "%s resumed: the broker is back after %.1f s (%d failed calls)", self.what, lasted, self.failures
        )
        self.since, self.failures = None, 0
