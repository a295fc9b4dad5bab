"""A refused client's Retry-After counts down: a repeat before the promised time hears the rest of
the wait, not the whole wait again.

A refusal's Retry-After comes from the queue as it is (the work ahead over the drain rate, the
new job's own cost): numbers that change only when a job starts or ends. While one long job holds
the slots, nothing changes, and a client refused again nine seconds later would be told the same
wait once more, though the work ahead has run on for those nine seconds: the drain rate says it
should have drained that long. So every refusal is remembered by what refused it (the code, the
model and class, the tenant), with the time it told the client to come back; a repeat before
that time is told what is left of it, or a shorter wait if the queue now gives one. Once the time
has passed, a refusal is a fresh estimate again.

Superseded by one rule: every refusal that says to retry, the tenant's as the queue's, takes its
time from the model's reservation book (``sluice.core.policy.decide``, ``admission.reserve``),
which never tells a repeat a time sooner than the one it told before. The gateway stops counting
down here once both brokers admit through ``decide``; this module then goes.
"""

from __future__ import annotations

from collections.abc import Hashable

from sluice.core.admission import clamp_retry_after

__all__ = ["RetryPromises"]


class RetryPromises:
    """When each kind of refusal told its clients to come back (monotonic seconds).

    Args:
        max_entries: the most refusals remembered; beyond it, those whose time has passed are
            forgotten, and if that is not enough, all of them (a refusal is then a fresh estimate).
    """

    def __init__(self, max_entries: int = 10_000) -> None:
        self.max_entries = max_entries
        self._due: dict[Hashable, float] = {}

    def retry_after(self, key: Hashable, seconds: float, now: float) -> float:
        """The Retry-After of a refusal of kind ``key`` whose queue says ``seconds``, at ``now``:
        at most what is left of the wait an earlier refusal of the kind promised."""
        due = self._due.get(key)
        if due is not None and due > now:
            seconds = min(seconds, due - now)
        seconds = clamp_retry_after(seconds)
        self._due[key] = now + seconds
        if len(self._due) > self.max_entries:
            self._due = {k: d for k, d in self._due.items() if d > now}
            if len(self._due) > self.max_entries:
                self._due = {key: now + seconds}
        return seconds
