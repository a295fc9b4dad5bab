"""Graceful shutdown: what a process does between SIGTERM and its exit, so that scaling in loses nothing.

The first SIGTERM (or SIGINT) starts a drain; a second one hurries it. A worker draining stops
claiming at once, lets the jobs it runs finish within the grace period, then hands the rest back to
the head of their queue (:meth:`sluice.broker.base.Broker.release`) for another worker, and exits 0.
A gateway draining says so on ``/readyz`` at once and lets its open requests end within the grace
period (:mod:`sluice.roles.http`). ``docs/operations.md`` says what Kubernetes should set around it.

This module never imports the web framework: a worker uses it.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import time
from collections.abc import Awaitable, Callable, Iterator
from dataclasses import dataclass, field
from enum import StrEnum
from typing import TYPE_CHECKING

from sluice.config import DEFAULT_DRAIN_ACCEPT_S, DEFAULT_DRAIN_GRACE_S, Settings

if TYPE_CHECKING:
    from sluice.dispatcher import Dispatcher

log = logging.getLogger("sluice.drain")

#: how long running work may take to finish after SIGTERM, unless configured
DEFAULT_GRACE_S = DEFAULT_DRAIN_GRACE_S
#: the environment variable that sets the grace period (the name the setting ``drain_grace_s`` reads)
GRACE_ENV = "SLUICE_DRAIN_GRACE_S"
#: how long a gateway still takes new requests after SIGTERM, unless configured (seconds)
DEFAULT_ACCEPT_S = DEFAULT_DRAIN_ACCEPT_S
#: the environment variable that sets it (the name the setting ``drain_accept_s`` reads)
ACCEPT_ENV = "SLUICE_DRAIN_ACCEPT_S"
#: how long after its tasks are cancelled a job's engine stream is given to close
CANCEL_WAIT_S = 5.0
SIGNALS = (signal.SIGTERM, signal.SIGINT)


class DrainPhase(StrEnum):
    """Where a process stands in its shutdown."""

    #: no signal yet: business as usual
    SERVING = "serving"
    #: the first signal came: no new work is taken, what runs may finish within the grace period
    DRAINING = "draining"
    #: a second signal came, or the grace period is over: what still runs is handed back now
    HURRYING = "hurrying"


def grace_of(settings: Settings) -> float:
    """How long running work may take to finish after SIGTERM (``drain_grace_s``, which the
    settings read from ``SLUICE_DRAIN_GRACE_S`` as any setting from its variable)."""
    return settings.drain_grace_s


@dataclass
class Drain:
    """One process's shutdown, driven by its signals.

    Attributes:
        grace_s: how long work running at the first signal may take to finish.
        phase: where the shutdown stands.
        began: ``time.monotonic()`` at the first signal; None before it.
        started: set at the first signal.
        hurry: set at the second signal (or by whoever decides the grace is over).
        clock: monotonic seconds; injected so that tests can move it.
    """

    grace_s: float = DEFAULT_GRACE_S
    phase: DrainPhase = DrainPhase.SERVING
    began: float | None = None
    started: asyncio.Event = field(default_factory=asyncio.Event)
    hurry: asyncio.Event = field(default_factory=asyncio.Event)
    clock: Callable[[], float] = time.monotonic

    @property
    def draining(self) -> bool:
        return self.phase is not DrainPhase.SERVING

    def signal(self, sig: int | None = None) -> None:
        """A shutdown signal came: the first starts the drain, the next hurries it."""
        name = signal.Signals(sig).name if sig is not None else "a request"
        if self.phase is DrainPhase.SERVING:
            self.phase = DrainPhase.DRAINING
            self.began = self.clock()
            self.started.set()
            log.info("draining", extra={"fields": {"signal": name, "grace_s": self.grace_s}})
        else:
            self.hurry_now(f"second signal ({name})")

    def hurry_now(self, why: str) -> None:
        if self.phase is not DrainPhase.HURRYING:
            self.phase = DrainPhase.HURRYING
            log.info("drain hurried", extra={"fields": {"reason": why}})
        self.hurry.set()

    def elapsed(self) -> float:
        return 0.0 if self.began is None else self.clock() - self.began

    def remaining(self) -> float:
        """Seconds left of the grace period (the whole of it before the first signal)."""
        return max(self.grace_s - self.elapsed(), 0.0)

    async def until(self, done: Callable[[], bool], wake: Callable[[], Awaitable[object]]) -> bool:
        """Wait until ``done()`` holds, the grace period ends or the drain is hurried; True if
        ``done()`` held. ``wake`` is awaited between checks: it returns when something that may
        make ``done()`` true happened (or after a short while)."""
        while not done():
            left = self.remaining()
            if left <= 0 or self.hurry.is_set():
                return False
            waker = asyncio.ensure_future(wake())
            hurried = asyncio.ensure_future(self.hurry.wait())
            try:
                await asyncio.wait({waker, hurried}, timeout=left, return_when=asyncio.FIRST_COMPLETED)
            finally:
                for task in (waker, hurried):
                    task.cancel()
                await asyncio.gather(waker, hurried, return_exceptions=True)
        return True


@contextlib.contextmanager
def signals_drain(drain: Drain, loop: asyncio.AbstractEventLoop) -> Iterator[Drain]:
    """SIGTERM and SIGINT drive ``drain`` while the block runs; their default actions after it."""
    for sig in SIGNALS:
        loop.add_signal_handler(sig, drain.signal, sig)
    try:
        yield drain
    finally:
        for sig in SIGNALS:
            loop.remove_signal_handler(sig)


@dataclass(frozen=True)
class WorkerDrained:
    """How a dispatcher's drain ended.

    Attributes:
        finished: jobs that ended on this worker during the drain (succeeded, failed or expired).
        released: jobs handed back to the head of their queue for another worker.
        unreleased: jobs that could not be handed back (the broker unreachable, or the job no longer
            this worker's); the broker re-queues those whose lease runs out.
        waited_s: how long the drain took.
    """

    finished: int
    released: int
    unreleased: list[str]
    waited_s: float


def claim_loop(dispatcher: Dispatcher) -> asyncio.Task[None] | None:
    """The dispatcher's claim loop (its task named ``dispatch``), if it runs."""
    for task in dispatcher._tasks:
        if task.get_name() == "dispatch" and not task.done():
            return task
    return None


async def stop_claiming(dispatcher: Dispatcher) -> None:
    """Take no more jobs. A claim on its way is handed back by the broker itself when cancelled."""
    task = claim_loop(dispatcher)
    if task is None:
        return
    task.cancel()
    await asyncio.gather(task, return_exceptions=True)


async def _any_job_ends(dispatcher: Dispatcher) -> None:
    tasks = set(dispatcher.running.values())
    if tasks:
        await asyncio.wait(tasks, return_when=asyncio.FIRST_COMPLETED)


async def hand_back(dispatcher: Dispatcher) -> tuple[int, list[str]]:
    """Stop every job this dispatcher still has (running, or claimed and waiting for a slot) and
    hand it back to the head of its queue: (how many were handed back, the ids that were not)."""
    # Leaving its task closes the engine stream, which aborts the generation. A task that ended
    # meanwhile (cancel() is False) settled its job itself: nothing to hand back.
    jobs = {job_id: task for job_id, task in list(dispatcher.running.items()) if task.cancel()}
    if jobs:
        await asyncio.wait(jobs.values(), timeout=CANCEL_WAIT_S)
    released, unreleased = 0, []
    # Each goes to the head of its queue: the latest claimed first, so that the earliest ends first.
    for job_id in reversed(list(jobs)):
        try:
            ok = await dispatcher.broker.release(job_id, dispatcher.worker_id)
        except Exception as exc:
            log.warning(
                "could not hand a job back; it is re-queued when its lease runs out",
                extra={"fields": {"job": job_id, "error": f"{type(exc).__name__}: {exc}"}},
            )
            ok = False
        if ok:
            released += 1
        else:
            unreleased.append(job_id)
    return released, unreleased


async def drain_dispatcher(
    dispatcher: Dispatcher, drain: Drain, *, keep_claiming: bool = False
) -> WorkerDrained:
    """Drain a dispatcher: stop claiming (unless ``keep_claiming``: an embedded broker has no other
    worker to take its queue), let its jobs finish until the grace period ends or the drain is
    hurried, then hand back what is left. The heartbeat runs on meanwhile, so leases stay renewed
    and cancels still reach the jobs. The dispatcher is not stopped: its owner does that."""
    loop = asyncio.get_running_loop()
    t0 = loop.time()
    if not keep_claiming:
        await stop_claiming(dispatcher)
    seen: set[str] = set()

    def idle() -> bool:
        seen.update(dispatcher.running)  # every job met while draining, to count those that end
        return not dispatcher.running

    await drain.until(idle, lambda: _any_job_ends(dispatcher))
    if keep_claiming:
        await stop_claiming(dispatcher)
    left = set(dispatcher.running)
    released, unreleased = await hand_back(dispatcher)
    outcome = WorkerDrained(len(seen - left), released, unreleased, loop.time() - t0)
    log.info(
        "worker drained",
        extra={
            "fields": {
                "worker": dispatcher.worker_id,
                "finished": outcome.finished,
                "released": outcome.released,
                "unreleased": len(outcome.unreleased),
                "waited_s": round(outcome.waited_s, 3),
            }
        },
    )
    return outcome
