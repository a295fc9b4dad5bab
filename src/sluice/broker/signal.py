"""A broadcast wake-up for the tasks of one event loop, used by both brokers."""

from __future__ import annotations

import asyncio


class Signal:
    """A broadcast wake-up: waiters take the current event, the notifier swaps in a fresh one.

    A waiter takes :meth:`current` before it checks its condition, then waits on that event: a
    notify in between sets the event it holds, so no wake-up is lost. The event is made only when
    someone waits: most queued jobs are never watched, and an ``asyncio.Event`` costs about 700 bytes.
    """

    __slots__ = ("_event",)

    def __init__(self) -> None:
        self._event: asyncio.Event | None = None

    def current(self) -> asyncio.Event:
        if self._event is None:
            self._event = asyncio.Event()
        return self._event

    def notify(self) -> None:
        old, self._event = self._event, None
        if old is not None:
            old.set()
