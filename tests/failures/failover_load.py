"""A load on a replicated Redis broker through a failover, driven through the broker API, that keeps
the books a failover test checks: which admissions were accepted, which finishes were accepted, which
jobs were claimed more than once, and when service stopped and resumed.

Admitters play gateways (``admit`` in a loop); workers play dispatchers (claim, heartbeat while the
job "runs", finish), each a broker of its own as separate processes would have.
"""

from __future__ import annotations

import asyncio
import time
from collections import Counter, defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

from sluice.broker.base import BrokerSettings, BrokerUnavailable
from sluice.broker.redis import RedisBroker
from sluice.core.admission import Refused
from sluice.core.job import JobState
from tests.helpers import make_job, wait_until

MODEL = "m"
#: how long a worker "runs" a job, heartbeating half-way (seconds)
RUN_S = 0.04


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


class FailoverLoad:
    """Admitters and workers on ``url`` until :meth:`stop`; :attr:`ledger` keeps the books. The
    admitters take turns over ``models``; every worker serves them all."""

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
        broker = RedisBroker(self.url, load_settings(), min_replicas=self.min_replicas)
        self._brokers.append(broker)
        return broker

    async def start(self) -> None:
        gateway = self.broker()
        await gateway.start()
        for _ in range(self._admitters):
            self._tasks.append(asyncio.create_task(self._admit_forever(gateway)))
        for n in range(self._workers):
            worker = self.broker()
            await worker.start()
            self._tasks.append(asyncio.create_task(self._work_forever(worker, f"worker-{n}")))

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
            job = make_job(time.time, model=self.models[turn % len(self.models)], timeout=300.0)
            started = time.monotonic()
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
                book.admit_latency_s = max(book.admit_latency_s, time.monotonic() - started)
            book.accepted.append(job.id)
            book.accepted_at.append(time.monotonic())
            book.sent_at.append(started)
            await asyncio.sleep(0.005)

    async def _work_forever(self, broker: RedisBroker, worker_id: str) -> None:
        book = self.ledger
        claims = 0
        while True:
            try:
                await broker.register(worker_id, dict.fromkeys(self.models, 4))
                job = await broker.claim(worker_id, self.models, timeout=0.5)
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
                continue
            if done is None:
                book.refused_finishes += 1
            else:
                book.finished[job.id] += 1

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
        await wait_until(lambda: book.accepted_since(killed_at, resumed) >= 100, timeout=resume_bound_s + 30)
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
