"""The Broker interface: the queue between gateways and dispatchers.

Every implementation runs the same conformance suite (``tests/broker/test_conformance.py``). Time
is read from ``settings.clock`` (seconds since the epoch) so that tests can move it; waits that
block (claim, wait, events) use real time with a bound. Where every broker takes the same first
steps (``admit``, ``claim``), the public method here takes them and calls the implementation's
``_admit`` or ``_claim``.
"""

from __future__ import annotations

import asyncio
import time
from abc import ABC, abstractmethod
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from dataclasses import dataclass, field
from enum import StrEnum
from typing import Any

from sluice.core.admission import QueueLimits
from sluice.core.capacity import DrainRate
from sluice.core.job import Job, JobError, JobState
from sluice.core.model_info import ModelInfo
from sluice.core.policy import CoDelPolicy, QueuePolicy
from sluice.core.ratelimit import RateStatus, TenantLimits
from sluice.core.scheduler import DEFAULT_CLASSES, ClassSpec


class BrokerUnavailable(Exception):
    """The broker's store cannot be reached right now; the caller should answer 503 and retry later."""


class EventType(StrEnum):
    """Events of one job's stream, in the order a client sees them."""

    QUEUED = "queued"
    STARTED = "started"
    TOKEN = "token"
    #: a failed attempt will be retried; tokens already streamed for it are void
    RETRY = "retry"
    #: terminal: the job succeeded; data is the job view with its result
    DONE = "done"
    #: terminal: failed, cancelled or expired; data carries the state and the error
    ERROR = "error"


TERMINAL_EVENTS = frozenset({EventType.DONE, EventType.ERROR})


@dataclass(frozen=True)
class Event:
    """One entry of a job's event stream. ``id`` increases from 1 and is the SSE event id."""

    id: int
    type: EventType
    data: dict[str, Any]


@dataclass
class BrokerSettings:
    """What every broker needs to know.

    Args:
        classes: the priority classes, highest first.
        limits: the queue bounds of each model; ``default_limits`` for models not named.
        lease_s: how long a claimed job stays with its worker without a heartbeat.
        result_ttl_s: how long finished jobs, their results and events are kept.
        drain_prior_per_slot: the service rate assumed for a model before any job finished there.
        policy: the queue policy: which jobs a model's queue takes (sluice.core.policy).
        clock: wall-clock time in seconds; injected so tests can move time.
    """

    classes: Sequence[ClassSpec] = DEFAULT_CLASSES
    limits: Mapping[str, QueueLimits] = field(default_factory=dict)
    default_limits: QueueLimits = field(default_factory=QueueLimits)
    lease_s: float = 30.0
    result_ttl_s: float = 600.0
    drain_prior_per_slot: float = DrainRate.prior_per_slot
    policy: QueuePolicy = field(default_factory=CoDelPolicy)
    clock: Callable[[], float] = time.time

    def limits_for(self, model: str) -> QueueLimits:
        return self.limits.get(model, self.default_limits)


@dataclass(frozen=True)
class Admission:
    """The broker's answer to a successful admit."""

    job: Job
    #: True when the idempotency key matched an earlier job: ``job`` is that job, nothing was queued
    duplicate: bool
    position: int
    estimated_start_s: float
    #: the caller's rate-limit standing after this admission, for the x-ratelimit-* headers
    rate: RateStatus | None = None


@dataclass(frozen=True)
class JobPage:
    """One page of a tenant's jobs, newest first (:meth:`Broker.list_jobs`).

    Attributes:
        jobs: the jobs of the page, newest first.
        has_more: whether older jobs follow the page's last one.
    """

    jobs: list[Job]
    has_more: bool


@dataclass(frozen=True)
class ModelStats:
    queued_jobs: int
    queued_tokens: int
    running_jobs: int
    slots: int
    drain_rate: float  # cost units (tokens) per second
    measured: bool
    #: jobs admitted that then ended past their deadline (expired queued, dropped at dispatch,
    #: stopped while running), since the broker's state began: each a promise admission broke
    broken_promises: int = 0


@dataclass(frozen=True)
class ClassDepth:
    """What one priority class of a model's queue holds."""

    #: jobs queued in the class
    jobs: int
    #: their cost (prompt + max_tokens, in tokens)
    tokens: int


@dataclass(frozen=True)
class TenantDepth:
    """What one tenant has queued in a model's queue, over every class."""

    tenant: str
    #: its jobs queued
    jobs: int
    #: their cost (prompt + max_tokens, in tokens)
    tokens: int


@dataclass(frozen=True)
class QueueBreakdown:
    """One model's queue split by priority class and by tenant (for the dashboard)."""

    #: per priority class, highest first: what it holds (every class, empty ones too)
    classes: dict[str, ClassDepth]
    #: the tenants with the most jobs queued, most first (ties by name), at most as many as asked
    tenants: list[TenantDepth]
    #: how many tenants have jobs queued, the ones not listed in ``tenants`` too
    tenant_count: int


class Broker(ABC):
    """Admitted jobs, their queues, leases, results and event streams."""

    def __init__(self, settings: BrokerSettings) -> None:
        self.settings = settings
        self.classes = [c.name for c in settings.classes]

    def now(self) -> float:
        return self.settings.clock()

    async def start(self) -> None:
        """Connect and start background maintenance."""

    async def close(self) -> None:
        """Stop background work and release connections."""

    async def __aenter__(self) -> Broker:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    # --- gateway side -------------------------------------------------------------------------

    async def admit(self, job: Job, limits: TenantLimits | None = None) -> Admission:
        """Queue ``job`` or raise :class:`sluice.core.admission.Refused`; a priority class the broker
        does not know raises ValueError.

        Idempotency, the caller's limits (``limits``: its key's own requests and tokens per minute,
        its tenant's jobs queued; None checks none), the queue's bounds and the deadline prediction
        are decided atomically with the enqueue. The dispatcher never runs more of a tenant's jobs
        at once than ``limits.max_concurrent`` (of the key that sent its latest job).

        The job passed in is changed: queued, it is ``Admission.job`` itself, in state QUEUED,
        and its ``id`` is the one it is known by from then on, which the broker may have given it
        here. The Redis broker does so on a spread queue (a cluster): ``job_<random>`` becomes
        ``job_<shard>.<random>``, so that a lookup by id finds the job's shard
        (``redis_shards.tag_job_id``); the memory broker and a Redis queue on one shard keep the
        id. Callers read the id after admission (``admission.job.id``, which the routes answer
        with), never one taken before it. A duplicate's ``Admission.job`` is the first job's
        record: the job passed in then, as after a refusal, names no job, whatever its id.
        """
        if job.priority not in self.classes:
            raise ValueError(f"unknown priority class {job.priority!r}")
        return await self._admit(job, limits)

    @abstractmethod
    async def _admit(self, job: Job, limits: TenantLimits | None) -> Admission:
        """:meth:`admit` of a job whose class is known."""

    @abstractmethod
    async def get(self, job_id: str) -> Job | None:
        """The job's record, or None if unknown or expired."""

    @abstractmethod
    async def wait(self, job_id: str, timeout: float) -> Job | None:
        """The job once terminal, or as it is after ``timeout`` seconds; None if unknown."""

    @abstractmethod
    def events(self, job_id: str, after: int = 0, timeout: float | None = None) -> AsyncIterator[Event]:
        """Events with id > ``after``, then new ones as they come, ending after the terminal event.

        Ends early, without error, after ``timeout`` seconds without a new event.
        """

    @abstractmethod
    async def cancel(self, job_id: str) -> Job | None:
        """Cancel a queued or running job; a running one is aborted by its worker.

        Returns the record as it is after the request (unchanged if it was terminal), None if unknown.
        """

    @abstractmethod
    async def position(self, job_id: str) -> int | None:
        """Jobs ahead of a queued job; None when it is not queued."""

    @abstractmethod
    async def stats(self) -> dict[str, ModelStats]:
        """Per model: queue depth, running jobs, slots and drain rate."""

    @abstractmethod
    async def list_jobs(self, tenant: str, limit: int, after: str | None = None) -> JobPage:
        """The tenant's jobs whose records are still kept, newest first (by ``created_at``, then
        id), at most ``limit`` of them, starting after the job ``after`` (the previous page's last
        job); a job ``after`` that is not the tenant's, or is gone, gives an empty page."""

    @abstractmethod
    async def queue_breakdown(self, top_tenants: int) -> dict[str, QueueBreakdown]:
        """Per model with a queue: its queued jobs and tokens by priority class, and the
        ``top_tenants`` tenants with the most jobs queued. Read without a lock: each count is exact
        when read, the whole is not one instant (the dashboard reads it once a second)."""

    # --- what each process reports of itself (the dashboard's view of the fleet) -------------

    @abstractmethod
    async def put_report(self, process_id: str, report: Mapping[str, Any], ttl_s: float) -> None:
        """Publish what one process (a gateway or a worker) says of itself, replacing its previous
        report; it is forgotten ``ttl_s`` seconds later unless published again. ``report`` must be
        JSON-serializable."""

    @abstractmethod
    async def reports(self) -> dict[str, dict[str, Any]]:
        """The reports of every process that shares this broker and published within its ``ttl_s``:
        process id → report."""

    # --- worker side --------------------------------------------------------------------------

    @abstractmethod
    async def register(self, worker_id: str, slots: Mapping[str, int]) -> None:
        """Announce (and keep alive) the models a worker serves and how many slots each has."""

    @abstractmethod
    async def unregister(self, worker_id: str) -> None:
        """Withdraw a worker's capacity."""

    @abstractmethod
    async def served_models(self) -> dict[str, int]:
        """Models some live worker serves, with their total slots."""

    @abstractmethod
    async def describe_models(self, worker_id: str, models: Mapping[str, ModelInfo]) -> None:
        """Keep what a registered worker knows of the models it serves, replacing its previous
        account; it counts while the worker's registration does."""

    @abstractmethod
    async def model_info(self) -> dict[str, ModelInfo]:
        """What the live workers know of each model they serve, several workers' accounts of a
        model merged (:func:`sluice.core.model_info.merge`)."""

    async def claim(self, worker_id: str, models: Sequence[str], timeout: float) -> Job | None:
        """Take the next job of one of ``models`` (in dispatch order), waiting at most ``timeout``.

        The job turns RUNNING with a lease for ``worker_id``; its STARTED event is published.
        """
        if not models:  # nothing can come: wait as asked, so that a caller's loop does not spin
            await asyncio.sleep(timeout)
            return None
        return await self._claim(worker_id, models, timeout)

    @abstractmethod
    async def _claim(self, worker_id: str, models: Sequence[str], timeout: float) -> Job | None:
        """:meth:`claim` for at least one model."""

    @abstractmethod
    async def heartbeat(self, worker_id: str, job_ids: Sequence[str]) -> set[str]:
        """Renew the leases of ``job_ids``; return those the worker must abort (cancelled or lost)."""

    @abstractmethod
    async def wait_abort_signal(self, timeout: float) -> None:
        """Return early when a running job may have been cancelled, else after ``timeout``."""

    @abstractmethod
    async def publish(self, job_id: str, type: EventType, data: dict[str, Any]) -> None:
        """Append an event to a running job's stream. The first TOKEN sets ``first_token_at``."""

    #: whether :meth:`finish` settles the job without awaiting anything (one process's broker):
    #: nothing can then cancel it halfway, and the dispatcher awaits it as it is rather than in a
    #: shielded task of its own (a task made, and two turns of the event loop, per job). It is
    #: inherited: a subclass whose ``finish`` awaits (a wrapper, a test's gate) must set it back
    #: to False, or a cancel could cut its settlement halfway; tests/broker/test_conformance.py
    #: holds each broker that says True to settling at its coroutine's first step
    finish_at_once = False

    @abstractmethod
    async def finish(
        self,
        job_id: str,
        worker_id: str,
        state: JobState,
        *,
        result: dict[str, Any] | None = None,
        usage: dict[str, Any] | None = None,
        error: JobError | None = None,
        attempts: int | None = None,
        backend: str | None = None,
    ) -> Job | None:
        """Settle a running job in a terminal state and publish its terminal event.

        Ignored (returns None) when the worker no longer holds the job's lease.
        """

    @abstractmethod
    async def release(self, job_id: str, worker_id: str) -> bool:
        """Hand back a job ``worker_id`` holds and will not finish (it is shutting down): the job
        goes back to the head of its tenant's queue as if never started (the attempt is not
        charged), and a RETRY event tells its stream that tokens sent so far are void.

        False, with nothing changed, when the job is not running under this worker's lease (it
        ended, was cancelled, or its lease was lost and it was claimed again)."""

    # --- administration -----------------------------------------------------------------------

    @abstractmethod
    async def dead_letters(self) -> dict[str, float]:
        """Jobs that failed for good after losing their worker ``max_attempts`` times: id → when.

        Their records (with the error) stay readable with :meth:`get` until the result TTL."""

    @abstractmethod
    async def purge_dead_letters(self, ids: Sequence[str] | None = None) -> int:
        """Forget dead letters (all, or ``ids``), records included; returns how many went."""

    @abstractmethod
    async def set_draining(self, backend: str, draining: bool) -> None:
        """Mark a backend as draining: dispatchers send it no new jobs, running ones finish."""

    @abstractmethod
    async def draining(self) -> set[str]:
        """The backends marked as draining, by every process that shares the broker."""

    # --- API keys stored by an administrator (the config file holds the others) --------------

    @abstractmethod
    async def put_key(self, key_sha256: str, record: dict[str, Any]) -> None:
        """Store (or replace) the record of the API key whose SHA-256 is ``key_sha256``."""

    @abstractmethod
    async def get_key(self, key_sha256: str) -> dict[str, Any] | None:
        """A stored key's record, None if there is none."""

    @abstractmethod
    async def delete_key(self, key_sha256: str) -> bool:
        """Forget a stored key; False if there was none."""

    @abstractmethod
    async def list_keys(self) -> dict[str, dict[str, Any]]:
        """Every stored key: SHA-256 → record."""

    # --- open connections per API key (one count for every gateway on this broker) ------------

    @abstractmethod
    async def open_connection(self, key_sha256: str, connection_id: str, cap: int) -> bool:
        """Count connection ``connection_id`` (a stream, long poll or WebSocket) against the key
        whose SHA-256 is ``key_sha256``, unless ``cap`` of its connections are open already: then
        nothing is taken and the answer is False. The check and the take are one atomic step.

        The slot is leased for ``settings.lease_s``: the gateway that holds it renews it
        (:meth:`renew_connections`) and gives it back (:meth:`close_connection`); a gateway that
        dies does neither, and its slots lapse within a lease."""

    @abstractmethod
    async def renew_connections(self, held: Mapping[str, Collection[str]]) -> None:
        """Extend by ``settings.lease_s`` the leases of the connections a gateway still holds, key
        SHA-256 → connection ids. A connection whose lease lapsed meanwhile (its gateway could not
        reach the broker for a lease) is counted again: it is still open. (So may one given back
        while its renewal was on the way, until its lease lapses.)"""

    @abstractmethod
    async def close_connection(self, key_sha256: str, connection_id: str) -> None:
        """Give a connection's slot back; nothing happens if it is not counted (lapsed, or closed)."""

    @abstractmethod
    async def open_connections(self, key_sha256: str) -> int:
        """How many of the key's connections are counted now, on every gateway."""

    # --- webhooks -----------------------------------------------------------------------------

    #: whether this broker hands ended jobs with a ``callback_url`` to workers (see ``ended_callbacks``)
    supports_callbacks = False

    async def ended_callbacks(self, worker_id: str, timeout: float) -> list[str]:
        """Ids of jobs that ended with a ``callback_url`` and await delivery; waits up to ``timeout``."""
        await asyncio.sleep(timeout)
        return []

    async def ack_callback(self, job_id: str) -> None:
        """The webhook of ``job_id`` was delivered, or given up on: do not hand it out again."""

    async def add_delivery(self, job_id: str, attempt: dict[str, Any]) -> None:
        """Append one delivery attempt to the job's log (``deliveries`` in its view)."""

    @abstractmethod
    async def maintain(self) -> None:
        """One round of upkeep: expire queued jobs past their deadline, re-queue jobs whose lease
        expired (or dead-letter them after ``max_attempts``), drop results past their TTL."""
