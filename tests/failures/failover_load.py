"""A load on a replicated Redis broker through a failover, driven through the broker API, that keeps
the books a failover test checks: which admissions were accepted, which finishes were accepted, which
jobs were claimed more than once, and when service stopped and resumed.

Admitters play gateways (``admit`` in a loop); workers play dispatchers (claim, heartbeat while the
job "runs", finish), each a broker of its own as separate processes would have, and each serving one
model, as a dispatcher in front of that model's engine would, so that each model's books are its own
(a claim over models on several masters skips one that is down and serves the others: that is
test_a_worker_serves_the_other_masters_models_while_one_master_is_down's).

The queue policy is deadline admission, and the jobs' deadline is long: what the failover tests
check is that nothing accepted is lost, not what the policy takes, and under codel a slowed worker
(a loaded machine), or the queue a failover leaves behind (its jobs stalled, the drain rate fallen),
turned admissions into refusals (hundreds in one failover). The queue is bounded by the load itself
instead: each model has :data:`WINDOW` jobs accepted and not yet settled at most (and the
admissions in flight), and an admitter whose model is full waits its next turn instead of sending,
so that admissions come at the speed the workers drain, however slow.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field, replace

from sluice.broker.base import BrokerSettings, BrokerUnavailable
from sluice.broker.redis import RedisBroker
from sluice.core.admission import Refused
from sluice.core.job import Job, JobState
from sluice.core.policy import DeadlinePolicy
from tests.helpers import make_job, wait_until

MODEL = "m"
#: how long a worker "runs" a job, heartbeating half-way (seconds)
RUN_S = 0.04
#: jobs of one model accepted and not yet settled, at most: more than a test waits for before
#: its kill, so that admissions still come as fast as the admitters send them then (a queue a
#: kill finds full of admissions not yet replicated), and few enough for the workers to drain
#: at the end in seconds
WINDOW = 200


@dataclass
class Ledger:
    """What the load saw.

    Attributes:
        accepted: ids of the jobs whose admission was answered (the client heard "accepted").
        accepted_at: when each was answered (monotonic).
        sent_at: when each was sent (monotonic).
        unavailable_at: when admissions were answered BrokerUnavailable (monotonic).
        refused: admissions the queue policy refused (a backlog after the failover).
        admit_latency_s: the longest any admission took to be answered, either way.
        claims: per job id, the (worker, claim number) that claimed it, in order.
        finished: per job id, the finishes that were accepted (returned the settled job).
        aborted: jobs a worker was told to abort by its heartbeat (its lease had gone).
        refused_finishes: finishes the broker refused (the lease was not the caller's).
        failed_calls: broker calls of the workers answered BrokerUnavailable.
        open: per model, the accepted jobs no worker has settled yet (or tried to settle, its
            finish unanswered): the closed loop's window.
        sending: the admissions sent and not yet answered, each with when it was sent (monotonic).
    """

    accepted: list[str] = field(default_factory=list)
    accepted_at: list[float] = field(default_factory=list)
    sent_at: list[float] = field(default_factory=list)
    unavailable_at: list[float] = field(default_factory=list)
    refused: int = 0
    admit_latency_s: float = 0.0
    claims: dict[str, list[str]] = field(default_factory=lambda: defaultdict(list))
    finished: Counter[str] = field(default_factory=Counter)
    aborted: set[str] = field(default_factory=set)
    refused_finishes: int = 0
    failed_calls: int = 0
    open: dict[str, set[str]] = field(default_factory=lambda: defaultdict(set))
    sending: dict[object, float] = field(default_factory=dict)

    def describe(self) -> str:
        """The books in one line, for a failure's message."""
        return (
            f"{len(self.accepted)} accepted, {len(self.unavailable_at)} answered 503, "
            f"{self.refused} refused; open per model {dict((m, len(ids)) for m, ids in self.open.items())}; "
            f"{sum(self.finished.values())} finishes accepted, {self.refused_finishes} refused, "
            f"{self.failed_calls} worker calls failed; {len(self.sending)} admissions unanswered, the "
            f"oldest sent {time.monotonic() - min(self.sending.values(), default=time.monotonic()):.1f} s ago"
        )

    def settled(self, job: Job) -> None:
        """A worker settled ``job`` (or tried to): its model's window has room again."""
        self.open[job.model].discard(job.id)

    def room(self, model: str) -> bool:
        """Whether ``model``'s window takes one more job. (A job that ended without a worker's
        finish, its attempts spent in the failover, keeps its place: a few of those in a window
        of :data:`WINDOW` leave it open.)"""
        return len(self.open[model]) < WINDOW

    def accepted_since(self, t: float, only: Callable[[str], bool] | None = None) -> int:
        """Admissions sent at ``t`` or later and accepted (of the jobs ``only`` selects, if given)."""
        return sum(
            1 for job_id, at in zip(self.accepted, self.sent_at, strict=True) if at >= t and _of(only, job_id)
        )

    def accepted_before(self, t: float) -> list[str]:
        """The jobs whose acceptance was answered before ``t``."""
        return [job_id for job_id, at in zip(self.accepted, self.accepted_at, strict=True) if at < t]

    def resumed_after(self, t: float, only: Callable[[str], bool] | None = None) -> float | None:
        """Seconds from ``t`` to the first acceptance of an admission sent after it (one in flight
        at ``t`` may have been answered by the old primary just before it died), of the jobs
        ``only`` selects if given."""
        later = [
            done
            for job_id, sent, done in zip(self.accepted, self.sent_at, self.accepted_at, strict=True)
            if sent >= t and _of(only, job_id)
        ]
        return min(later) - t if later else None

    @property
    def claimed_twice(self) -> set[str]:
        return {job_id for job_id, who in self.claims.items() if len(who) > 1}


def _of(only: Callable[[str], bool] | None, job_id: str) -> bool:
    return only is None or only(job_id)


def load_settings() -> BrokerSettings:
    """Real time (leases must lapse for real), short leases so that a lost one is reaped soon."""
    return BrokerSettings(lease_s=2.0, result_ttl_s=600.0)


def closed_loop_settings() -> BrokerSettings:
    """:func:`load_settings` with deadline admission: with the load's window and its jobs'
    deadline (:data:`JOB_TIMEOUT_S`), a slowed worker is never a reason to refuse."""
    return replace(load_settings(), policy=DeadlinePolicy())


#: the deadline of the load's jobs: far beyond any wait its window makes
JOB_TIMEOUT_S = 600.0


class FailoverLoad:
    """Admitters and workers on ``url`` until :meth:`stop`; :attr:`ledger` keeps the books. The
    admitters take turns over ``models``; ``workers`` workers serve each model."""

    def __init__(
        self,
        url: str,
        *,
        min_replicas: int | None,
        admitters: int = 4,
        workers: int = 2,
        models: Sequence[str] = (MODEL,),
    ) -> None:
        self.url = url
        self.models = list(models)
        self.min_replicas = min_replicas
        self.ledger = Ledger()
        self._admitters = admitters
        self._workers = workers
        self._brokers: list[RedisBroker] = []
        self._tasks: list[asyncio.Task[None]] = []
        self._admitting = True

    def broker(self) -> RedisBroker:
        broker = RedisBroker(self.url, closed_loop_settings(), min_replicas=self.min_replicas)
        self._brokers.append(broker)
        return broker

    async def start(self) -> None:
        gateway = self.broker()
        await gateway.start()
        for _ in range(self._admitters):
            self._tasks.append(asyncio.create_task(self._admit_forever(gateway)))
        for model in self.models:
            for n in range(self._workers):
                worker = self.broker()
                await worker.start()
                work = self._work_forever(worker, f"worker-{model}-{n}", model)
                self._tasks.append(asyncio.create_task(work))

    def stop_admitting(self) -> None:
        self._admitting = False

    async def stop(self) -> None:
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        for broker in self._brokers:
            await broker.close()

    async def _admit_forever(self, broker: RedisBroker) -> None:
        book = self.ledger
        turn = 0
        while self._admitting:
            turn += 1
            model = self.models[turn % len(self.models)]
            if not book.room(model):
                await asyncio.sleep(0.01)  # the model's window is full: its workers are behind
                continue
            job = make_job(time.time, model=model, timeout=JOB_TIMEOUT_S)
            sent = object()  # (the broker may give the job its id as it admits it: not the key)
            started = book.sending[sent] = time.monotonic()
            try:
                await broker.admit(job)
            except BrokerUnavailable:
                book.unavailable_at.append(time.monotonic())
                await asyncio.sleep(0.05)  # as a client honouring Retry-After would, only sooner
                continue
            except Refused:
                book.refused += 1
                await asyncio.sleep(0.05)
                continue
            finally:
                del book.sending[sent]
                book.admit_latency_s = max(book.admit_latency_s, time.monotonic() - started)
            book.accepted.append(job.id)
            book.accepted_at.append(time.monotonic())
            book.open[model].add(job.id)
            book.sent_at.append(started)
            await asyncio.sleep(0.005)

    async def _work_forever(self, broker: RedisBroker, worker_id: str, model: str) -> None:
        book = self.ledger
        claims = 0
        while True:
            try:
                await broker.register(worker_id, {model: 4})
                job = await broker.claim(worker_id, [model], timeout=0.5)
            except BrokerUnavailable:
                book.failed_calls += 1
                await asyncio.sleep(0.05)
                continue
            if job is None:
                continue
            claims += 1
            book.claims[job.id].append(f"{worker_id}#{claims}")
            await asyncio.sleep(RUN_S / 2)
            try:
                abort = await broker.heartbeat(worker_id, [job.id])
            except BrokerUnavailable:
                book.failed_calls += 1
                abort = set()
            if job.id in abort:
                book.aborted.add(job.id)  # fenced: the lease is someone else's now
                continue
            await asyncio.sleep(RUN_S / 2)
            try:
                done = await broker.finish(job.id, worker_id, JobState.SUCCEEDED, result={"by": worker_id})
            except BrokerUnavailable:  # maybe settled, maybe not: its lease lapses if not
                book.failed_calls += 1
                book.settled(job)  # (if not, it runs again without a place in the window)
                continue
            if done is None:
                book.refused_finishes += 1  # the lease is someone else's: theirs to settle
            else:
                book.finished[job.id] += 1
                book.settled(job)

    async def assert_nothing_lost_since(
        self,
        killed_at: float,
        *,
        resume_bound_s: float,
        answer_bound_s: float,
        resumed: Callable[[str], bool] | None = None,
    ) -> float:
        """The invariants of a failover at ``killed_at`` (monotonic): admissions resume (100 more
        accepted, of the jobs ``resumed`` selects when given: those of the master that was lost)
        within ``resume_bound_s``; every job accepted before, during and after is on record and
        succeeds; no admission took ``answer_bound_s`` to answer; and no job was settled twice
        (fencing). Stops admitting; returns how long admissions took to resume."""
        book = self.ledger
        # Counted, with a generous bound: how soon 100 are accepted is the workers' speed (the
        # window), which a loaded machine divides; when service resumed is asserted below.
        # (Every call answered meanwhile: accepted, unavailable or refused; wait_accepted checks.)
        await self.wait_accepted(100, since=killed_at, only=resumed, timeout=resume_bound_s + 60)
        self.stop_admitting()
        accepted = list(book.accepted)
        assert await self.missing(accepted) == []
        states = await self.wait_all_ended(accepted, timeout=60)
        assert set(states.values()) == {JobState.SUCCEEDED}
        resumed_s = book.resumed_after(killed_at, resumed)
        assert resumed_s is not None and resumed_s < resume_bound_s
        assert book.admit_latency_s < answer_bound_s
        # Whatever became of a claim in the failover, at most one finish was accepted.
        assert [job_id for job_id, n in book.finished.items() if n > 1] == []
        return resumed_s

    async def wait_accepted(
        self,
        count: int,
        *,
        since: float = 0.0,
        only: Callable[[str], bool] | None = None,
        timeout: float,
    ) -> None:
        """Until ``count`` admissions sent at ``since`` or later (of the jobs ``only`` selects) are
        accepted; fails after ``timeout`` seconds with the books, or at once when an admitter or a
        worker ended by an error (an error no caller is told how to answer)."""

        def done() -> bool:
            return self.ledger.accepted_since(since, only) >= count or bool(self.crashed())

        try:
            await wait_until(done, timeout=timeout)
            assert self.crashed() == []
        except AssertionError as exc:
            got = self.ledger.accepted_since(since, only)
            raise AssertionError(
                f"{got} of {count} accepted within {timeout} s: {self.ledger.describe()}; "
                f"admitters and workers ended by an error: {self.crashed()}"
            ) from exc

    def crashed(self) -> list[str]:
        """The admitters and workers that ended by an error (none should: every call is answered,
        accepted or BrokerUnavailable or refused)."""
        errors = [t.exception() for t in self._tasks if t.done() and not t.cancelled()]
        return [f"{type(e).__name__}: {e}" for e in errors if e is not None]

    async def missing(self, ids: list[str]) -> list[str]:
        """The ids among ``ids`` that the broker has no record of."""
        broker = self._brokers[0]
        return [job_id for job_id in ids if await broker.get(job_id) is None]

    async def wait_all_ended(self, ids: list[str], timeout: float) -> dict[str, JobState]:
        """Until every job of ``ids`` on record is terminal (a lease lost in the failover lapses and
        its job runs again); returns the state of each job on record."""
        broker = self._brokers[0]
        deadline = time.monotonic() + timeout
        states: dict[str, JobState] = {}
        pending = list(ids)
        while pending:
            still = []
            for job_id in pending:
                job = await broker.get(job_id)
                if job is not None and job.terminal:
                    states[job_id] = job.state
                elif job is not None:
                    still.append(job_id)
            pending = still
            if pending:
                if time.monotonic() > deadline:
                    raise AssertionError(f"{len(pending)} jobs not ended within {timeout} s: {pending[:5]}")
                await asyncio.sleep(0.1)
        return states
