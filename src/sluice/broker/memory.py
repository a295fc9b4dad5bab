"""The embedded broker: asyncio structures in one process. Nothing survives a restart."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import heapq
import json
import time
from collections.abc import AsyncIterator, Callable, Collection, Mapping, Sequence
from typing import Any

from sluice.broker.base import (
    TERMINAL_EVENTS,
    Admission,
    Broker,
    BrokerSettings,
    ClassDepth,
    Event,
    EventType,
    JobPage,
    ModelStats,
    QueueBreakdown,
    TenantDepth,
)
from sluice.broker.memory_record import Follower, JobRecord, _Lease, _Tenant, kept
from sluice.broker.memory_workers import Workers
from sluice.broker.signal import Signal
from sluice.core import admission
from sluice.core.capacity import DrainRate
from sluice.core.errors import (
    cancelled_error,
    deadline_error,
    evicted_error,
    unfinishable_error,
    worker_lost_error,
)
from sluice.core.job import Job, JobError, JobState
from sluice.core.model_info import ModelInfo
from sluice.core.policy import Candidate, PolicyState, decide
from sluice.core.ratelimit import TenantLimiter, TenantLimits
from sluice.core.scheduler import Backlog, ClassScheduler, Entry
from sluice.views import job_view

MAINTAIN_INTERVAL_S = 0.1
#: how long after its end a job's events are packed (:meth:`JobRecord.pack`): its live readers have
#: read them by then
PACK_AFTER_S = 1.0


class MemoryBroker(Broker):
    """Everything in dictionaries and heaps; one event loop; admission is atomic because it never awaits."""

    def __init__(self, settings: BrokerSettings | None = None) -> None:
        super().__init__(settings or BrokerSettings())
        self._records: dict[str, JobRecord] = {}
        self._queues: dict[str, ClassScheduler] = {}
        self._drain: dict[str, DrainRate] = {}
        self._policy_state: dict[str, PolicyState] = {}
        #: the Retry-After times each model's queue has handed out (admission.reserve)
        self._reservations: dict[str, admission.Reservations] = {}
        #: per model, the jobs admitted that then ended past their deadline (ModelStats)
        self._broken: dict[str, int] = {}
        self._running: dict[str, int] = {}
        self._leases: dict[str, _Lease] = {}
        self._tenants: dict[str, _Tenant] = {}
        #: the tenants at their concurrency cap (running >= max_concurrent), whose queued jobs a
        #: claim passes over: kept where a running count or a cap changes (_move, _key_limiter),
        #: not walked over every tenant on each claim
        self._at_cap: set[str] = set()
        #: the tenants holding queued jobs back by their cap (more queued and running than it:
        #: ``_Tenant.held_back``), whose rooms admission reads (``_view``): kept where a count or a
        #: cap changes (``_move``, ``_key_limiter``, ``_admit``), as ``_at_cap`` is, not walked over
        #: every tenant on each admission (bench/claim_tenants: O(tenants kept) calls before)
        self._held: set[str] = set()
        #: the jobs queued, over every tenant and model (the sum of the tenants' ``queued``): a
        #: claim with none to find does not walk the queues (the dispatcher's next claim, in the
        #: turn that writes a job's engine request, finds none at light load)
        self._queued = 0
        #: (tenant, Idempotency-Key) → the job it names, for as long as that job's record is kept
        self._idempotency: dict[tuple[str, str], str] = {}
        #: the workers' registrations, their slots' kept sum and their models (memory_workers)
        self._workers = Workers()
        #: each tenant's kept jobs, job id → created_at, for ``list_jobs``
        self._tenant_jobs: dict[str, dict[str, float]] = {}
        self._deadlines: list[tuple[float, str]] = []
        self._ttl: list[tuple[float, str]] = []
        self._dead: dict[str, float] = {}
        #: (monotonic time, job id): ended jobs whose events are to be packed then, oldest first
        self._to_pack: collections.deque[tuple[float, str]] = collections.deque()
        self._callbacks: list[str] = []
        self._callback_signal = Signal()
        #: the claims waiting for work, a bare future each (True: work came; False: the wait ran
        #: out): an admission wakes them all (:meth:`_wake_claimers`)
        self._claimers: list[asyncio.Future[bool]] = []
        self._abort = Signal()
        self._draining: set[str] = set()
        self._keys: dict[str, dict[str, Any]] = {}
        #: open connections per API key: key SHA-256 → connection id → lease expiry
        self._connections: dict[str, dict[str, float]] = {}
        #: what each process reports of itself: process id → (expiry, report)
        self._reports: dict[str, tuple[float, dict[str, Any]]] = {}
        self._task: asyncio.Task[None] | None = None

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._maintain_forever(), name="memory-broker-maintain")

    async def close(self) -> None:
        if self._task is not None:
            self._task.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._task
            self._task = None

    async def _maintain_forever(self) -> None:
        while True:
            await asyncio.sleep(MAINTAIN_INTERVAL_S)
            await self.maintain()

    # --- helpers ------------------------------------------------------------------------------

    def _queue(self, model: str) -> ClassScheduler:
        q = self._queues.get(model)
        if q is None:
            q = self._queues[model] = ClassScheduler(self.settings.classes)
        return q

    def _drain_rate(self, model: str, now: float | None = None) -> DrainRate:
        d = self._drain.get(model)
        if d is None:
            d = self._drain[model] = DrainRate(prior_per_slot=self.settings.drain_prior_per_slot)
        d.slots = self._workers.slots(self.now() if now is None else now).get(model, 0)
        return d

    def _emit(self, rec: JobRecord, type: EventType, data: dict[str, Any]) -> None:
        # a token as marshal's bytes, out of the collector's walks; the object itself where a
        # reader waits for it (memory_record.kept)
        rec.events.append(kept(type, data, rec.readers))
        terminal = type in TERMINAL_EVENTS
        if terminal:
            rec.ended_stream = True
            self._to_pack.append((time.monotonic() + PACK_AFTER_S, rec.job.id))
        follower = rec.follower
        if follower is not None:
            try:
                keep = follower(rec.packed_count + len(rec.events), type, data)
            except Exception:  # a follower's failure is its own: the publisher goes on
                keep = False
            if terminal or not keep:
                rec.follower = None
        if rec.readers:  # a followed stream's token has none: no call for nothing
            rec.notify()

    def _tenant(self, name: str) -> _Tenant:
        t = self._tenants.get(name)
        if t is None:
            t = self._tenants[name] = _Tenant()
        return t

    def _keep_held(self, name: str, t: _Tenant) -> None:
        """``_held`` brought up to date for ``name``: the rule is ``_Tenant.held_back``'s alone."""
        if t.held_back:
            self._held.add(name)
        else:
            self._held.discard(name)

    def _key_limiter(self, name: str, t: _Tenant, limits: TenantLimits | None) -> TenantLimiter:
        """The buckets of the key ``limits`` come from, brought to its limits as they are now; their
        levels stay through any change (a new key's buckets start full). Without limits, none."""
        if limits is None:
            return TenantLimiter(TenantLimits(""))
        cap = t.max_concurrent = limits.max_concurrent
        if cap is not None and t.running >= cap:
            self._at_cap.add(name)
        elif name in self._at_cap:
            # Raised or dropped, the cap it was at frees its held jobs: the claims wake, on an
            # admission then refused too (the limits stand; an admitted job wakes them anyway).
            # admit.lua sets the markers of the shard's models then.
            self._at_cap.remove(name)
            if t.queued:
                self._wake_claimers()
        self._keep_held(name, t)
        bucket = limits.bucket_id
        limiter = t.limiters.get(bucket)
        if limiter is None:
            limiter = TenantLimiter(limits)
        else:
            limiter.update(limits)
        if limiter.has_buckets:
            t.limiters[bucket] = limiter
        else:
            t.limiters.pop(bucket, None)
        return limiter

    def _move(self, job: Job, state: JobState) -> None:
        """Change a job's state, keeping the per-model and per-tenant counts in step."""
        t = self._tenant(job.tenant)
        cap = t.max_concurrent
        if job.state is JobState.RUNNING:
            self._running[job.model] -= 1
            t.running -= 1
            # From its cap to under it (a cap lowered below the running count stays at it): out of
            # the capped set, and a slot freed for its held-back jobs: the claims wake (or wait
            # out their bound). An uncapped tenant's end reads one field more, no call.
            if cap is not None and t.running == cap - 1:
                self._at_cap.discard(job.tenant)
                if t.queued:
                    self._wake_claimers()
        elif job.state is JobState.QUEUED:
            t.queued -= 1
            self._queued -= 1
        if state is JobState.RUNNING:
            self._running[job.model] = self._running.get(job.model, 0) + 1
            t.running += 1
            if cap is not None and t.running >= cap:
                self._at_cap.add(job.tenant)
        elif state is JobState.QUEUED:
            t.queued += 1
            self._queued += 1
        if cap is not None:  # an uncapped tenant's move reads no more
            self._keep_held(job.tenant, t)
        job.state = state
        if t.idle:
            del self._tenants[job.tenant]
            if cap is not None:  # a cap of 0 holds even an idle tenant at it
                self._at_cap.discard(job.tenant)

    def _settle(self, rec: JobRecord, state: JobState, error: JobError | None = None) -> None:
        """Put a job in a terminal state and publish its terminal event."""
        job = rec.job
        self._move(job, state)
        if state is JobState.EXPIRED:  # admitted, then past its deadline: a broken promise
            self._broken[job.model] = self._broken.get(job.model, 0) + 1
        job.finished_at = self.now()
        if error is not None:
            job.error = error
        heapq.heappush(self._ttl, (job.finished_at + self.settings.result_ttl_s, job.id))
        view = job_view(job)
        # The event is kept as it is now: deliveries appended later are the record's, not the event's.
        view["deliveries"] = list(view["deliveries"])
        self._emit(rec, EventType.DONE if state is JobState.SUCCEEDED else EventType.ERROR, view)
        rec.notify_end()
        if job.callback_url:
            self._callbacks.append(job.id)
            self._callback_signal.notify()

    def _entry(self, job: Job) -> Entry:
        return Entry(job.id, job.tenant, job.cost, job.weight)

    # --- gateway side -------------------------------------------------------------------------

    async def _admit(self, job: Job, limits: TenantLimits | None) -> Admission:
        now = self.now()
        idem = (job.tenant, job.idempotency_key) if job.idempotency_key else None
        if idem is not None:
            hit = self._idempotency.get(idem)
            if hit is not None and hit in self._records:
                first = self._records[hit].job
                pos = await self.position(first.id)
                return Admission(first, True, pos or 0, 0.0)
        tenant = self._tenant(job.tenant)
        limiter = self._key_limiter(job.tenant, tenant, limits)
        drain = self._drain_rate(job.model, now)
        q = self._queue(job.model)
        try:
            view, victim = self._view(q, job)
            queue = self.settings.limits_for(job.model)
            candidate = Candidate(job.cost, job.priority, now, job.deadline, view, queue, drain)
            state = self._policy_state.get(job.model)
            if state is None:
                state = self._policy_state[job.model] = PolicyState()
            book = self._reservations.setdefault(job.model, admission.Reservations())
            ok = decide(
                self.settings.policy, candidate, state, limiter=limiter, queued=tenant.queued, book=book
            )
        except admission.Refused:
            if tenant.idle:
                del self._tenants[job.tenant]  # a refused first request leaves nothing behind
                self._at_cap.discard(job.tenant)
            raise
        if ok.evict:
            assert victim is not None
            self._evict(q, job.priority, victim)
        limiter.take(job.cost, now)
        tenant.queued += 1
        self._queued += 1
        if tenant.max_concurrent is not None:
            self._keep_held(job.tenant, tenant)
        job.state = JobState.QUEUED
        rec = self._records[job.id] = JobRecord(job, bucket=None if limits is None else limits.bucket_id)
        self._tenant_jobs.setdefault(job.tenant, {})[job.id] = job.created_at
        q.push(job.priority, self._entry(job))
        heapq.heappush(self._deadlines, (job.deadline, job.id))
        if idem is not None:
            self._idempotency[idem] = job.id
        self._emit(
            rec, EventType.QUEUED, {"position": ok.position, "estimated_start_s": ok.estimated_start_s}
        )
        self._wake_claimers()
        return Admission(job, False, ok.position, ok.estimated_start_s, limiter.status(now))

    def _charged_limiter(self, rec: JobRecord) -> TenantLimiter | None:
        """The buckets a job was charged to, if they are still kept."""
        t = self._tenants.get(rec.job.tenant)
        if t is None or rec.bucket is None:
            return None
        return t.limiters.get(rec.bucket)

    def _view(self, q: ClassScheduler, job: Job) -> tuple[admission.QueueView, Backlog | None]:
        """The model's queue as admission sees it for ``job``, and the backlog that gives way when a
        bound is reached: every queued job counts for the bounds, but ahead of it is only what the
        fair order puts there, less the jobs other tenants hold back by their concurrency caps
        (``ClassScheduler.fair_view``; admit.lua computes the same)."""
        rooms = {}
        tenants = self._tenants
        for name in self._held:  # the order is no matter: fair_view sums, and keys by name
            t = tenants[name]
            assert t.max_concurrent is not None
            rooms[name] = max(t.max_concurrent - t.running, 0)
        fair = q.fair_view(job.priority, job.tenant, rooms)
        cls_q = q.queues[job.priority]
        view = admission.QueueView(
            q.jobs,
            q.tokens,
            cls_q.jobs,
            cls_q.tokens,
            fair.ahead_jobs,
            fair.ahead_tokens,
            self._running.get(job.model, 0),
            fair.runnable_tokens,
            None if fair.victim is None else fair.victim.newest_cost,
        )
        return view, fair.victim

    def _evict(self, q: ClassScheduler, cls: str, victim: Backlog) -> None:
        """The newest job of the heaviest backlog gives way (``Admitted.evict``): it ends as failed."""
        rec = self._records[victim.newest_id]
        q.remove(cls, victim.newest_id, victim.tenant)
        self._settle(rec, JobState.FAILED, evicted_error())

    async def get(self, job_id: str) -> Job | None:
        rec = self._records.get(job_id)
        return rec.job if rec else None

    async def wait(self, job_id: str, timeout: float) -> Job | None:
        rec = self._records.get(job_id)
        if rec is None:
            return None
        if not rec.job.terminal:
            # The bound as a timer that settles the end's future, not asyncio.timeout's
            # cancellation of this task (its context manager, asyncio.current_task in Python, the
            # task's cancel count, the CancelledError turned into a TimeoutError): every short
            # request waits so once.
            ended = rec.end()
            timer = asyncio.get_running_loop().call_later(timeout, _gave_up, ended)
            try:
                await ended
            finally:
                timer.cancel()
        return rec.job

    async def events(self, job_id: str, after: int = 0, timeout: float | None = None) -> AsyncIterator[Event]:
        rec = self._records.get(job_id)
        if rec is None:
            return
        sent = max(after, 0)
        while True:
            # Events published while this reader was suspended at a yield are read before it
            # waits again: the signal they notified has passed, and the last may be the terminal one.
            while sent < rec.count:
                for type, data in rec.since(sent):
                    sent += 1
                    yield Event(sent, type, data)
                    if type in TERMINAL_EVENTS:
                        return
            if rec.ended_stream:
                return  # resumed after the terminal event: nothing more will come
            if timeout is None:  # a live reader wakes once per token: no timer to set each time
                await rec.next_event()
                continue
            try:
                async with asyncio.timeout(timeout):
                    await rec.next_event()
            except TimeoutError:
                return

    def follow(self, job_id: str, after: int, follower: Follower) -> Callable[[], None] | None:
        """Call ``follower`` with each event of the job after ``after`` (its id, type and data): at
        once with those published already, then with each as it is published, inside the
        publisher's own call (no task of the reader's is woken for it), until it returns False,
        the stream ends (the terminal event is its last call), or the call returned is made. What
        :meth:`events` reads, as callbacks; a follower must not raise (one that does is dropped)
        nor await. One follower a job: None when the job has one already, or is not known (the
        caller then reads :meth:`events`, which says how the stream stands)."""
        rec = self._records.get(job_id)
        if rec is None or rec.follower is not None:
            return None
        event_id = max(after, 0)
        if event_id < rec.count:
            for type, data in rec.since(event_id):
                event_id += 1
                if not follower(event_id, type, data) or type in TERMINAL_EVENTS:
                    return _unfollowed
        if rec.ended_stream:
            return _unfollowed
        rec.follower = follower

        def stop() -> None:
            if rec.follower is follower:
                rec.follower = None

        return stop

    async def cancel(self, job_id: str) -> Job | None:
        rec = self._records.get(job_id)
        if rec is None:
            return None
        job = rec.job
        if job.state is JobState.QUEUED:
            self._queue(job.model).remove(job.priority, job.id, job.tenant)
        elif job.state is JobState.RUNNING:
            self._abort.notify()  # the lease stays until the worker hears of it and lets go
        else:
            return job
        self._settle(rec, JobState.CANCELLED, cancelled_error())
        return job

    async def position(self, job_id: str) -> int | None:
        rec = self._records.get(job_id)
        if rec is None or rec.job.state is not JobState.QUEUED:
            return None
        job = rec.job
        return self._queue(job.model).position(job.priority, job.id, job.tenant)

    async def stats(self) -> dict[str, ModelStats]:
        models = set(self._queues) | set(self._workers.slots(self.now()))
        out = {}
        for model in sorted(models):
            q = self._queue(model)
            d = self._drain_rate(model)
            out[model] = ModelStats(
                q.jobs,
                q.tokens,
                self._running.get(model, 0),
                d.slots,
                d.rate,
                d.measured,
                self._broken.get(model, 0),
            )
        return out

    async def queue_breakdown(self, top_tenants: int) -> dict[str, QueueBreakdown]:
        out = {}
        for model, q in sorted(self._queues.items()):
            classes = {}
            tenants: dict[str, list[int]] = {}
            for c in self.classes:
                fq = q.queues[c]
                classes[c] = ClassDepth(fq.jobs, fq.tokens)
                for entry in fq:
                    held = tenants.setdefault(entry.tenant, [0, 0])
                    held[0] += 1
                    held[1] += entry.cost
            top = sorted(tenants.items(), key=lambda kv: (-kv[1][0], kv[0]))[: max(top_tenants, 0)]
            out[model] = QueueBreakdown(
                classes, [TenantDepth(t, jobs, tokens) for t, (jobs, tokens) in top], len(tenants)
            )
        return out

    async def put_report(self, process_id: str, report: Mapping[str, Any], ttl_s: float) -> None:
        # Through JSON, as on Redis: the reader gets a copy, never the writer's live objects.
        self._reports[process_id] = (self.now() + ttl_s, json.loads(json.dumps(report)))

    async def reports(self) -> dict[str, dict[str, Any]]:
        now = self.now()
        for process_id in [p for p, (expires, _) in self._reports.items() if expires <= now]:
            del self._reports[process_id]
        return {p: json.loads(json.dumps(report)) for p, (_, report) in self._reports.items()}

    # --- worker side --------------------------------------------------------------------------

    async def register(self, worker_id: str, slots: Mapping[str, int]) -> None:
        self._workers.register(worker_id, slots, self.now() + max(self.settings.lease_s, 1.0))

    async def unregister(self, worker_id: str) -> None:
        self._workers.unregister(worker_id)

    async def served_models(self) -> dict[str, int]:
        return dict(self._workers.slots(self.now()))

    async def describe_models(self, worker_id: str, models: Mapping[str, ModelInfo]) -> None:
        self._workers.describe(worker_id, models)

    async def model_info(self) -> dict[str, ModelInfo]:
        return self._workers.merged_info(self.now())

    async def list_jobs(self, tenant: str, limit: int, after: str | None = None) -> JobPage:
        kept = self._tenant_jobs.get(tenant, {})
        order = sorted(kept, key=lambda job_id: (kept[job_id], job_id), reverse=True)
        start = 0
        if after is not None:
            if after not in kept:
                return JobPage([], False)
            start = order.index(after) + 1
        page = order[start : start + limit]
        return JobPage([self._records[job_id].job for job_id in page], start + limit < len(order))

    def _pop(self, models: Sequence[str]) -> Job | None:
        now = self.now()
        blocked = self._at_cap  # read, never changed, by the queues (an expiry below may drop one)
        while True:
            best: tuple[int, float, str] | None = None
            for model in models:
                q = self._queues.get(model)
                cls = q.next_class(blocked) if q else None
                if q is None or cls is None:
                    continue
                head = q.queues[cls].peek(blocked)
                assert head is not None
                rank = (self.classes.index(cls), self._records[head.job_id].job.created_at, model)
                if best is None or rank < best:
                    best = rank
            if best is None:
                return None
            popped = self._queues[best[2]].pop(blocked)
            assert popped is not None
            rec = self._records[popped[1].job_id]
            if rec.job.deadline <= now:
                self._settle(rec, JobState.EXPIRED, deadline_error())
                continue
            drain = self._drain_rate(rec.job.model, now)
            if drain.measured and rec.job.deadline - now < drain.service_s(rec.job.cost):
                # It would be aborted half-way: the engine's time goes to a job that can finish.
                self._settle(rec, JobState.EXPIRED, unfinishable_error(rec.job.deadline - now))
                continue
            return rec.job

    def _wake_claimers(self) -> None:
        claimers, self._claimers = self._claimers, []
        for future in claimers:
            if not future.done():
                future.set_result(True)

    async def _claim(self, worker_id: str, models: Sequence[str], timeout: float) -> Job | None:
        job = self._pop(models) if self._queued else None
        if job is None:
            # A claim waits on a future of its own, put where an admission wakes it right after
            # the look (nothing runs in between: no admission is missed), bounded by a timer that
            # settles it: the timer armed only when there is a wait (a busy queue's claims find
            # their job at once). Not an asyncio.Event's wait and an asyncio.timeout around it:
            # the dispatcher's claim loop waits so once a job, on the first token's path (the
            # successor's first claim runs in the turn that writes the engine request).
            loop = asyncio.get_running_loop()
            ends = loop.time() + timeout
            while job is None:
                woken = loop.create_future()
                self._claimers.append(woken)
                timer = loop.call_at(ends, _ran_out, woken)
                came = False
                try:
                    came = await woken
                finally:
                    timer.cancel()
                    if not came:  # ran out or cancelled: not left behind (a wake-up may have taken it)
                        with contextlib.suppress(ValueError):
                            self._claimers.remove(woken)
                if not came:
                    return None
                job = self._pop(models) if self._queued else None
        now = self.now()
        self._move(job, JobState.RUNNING)
        self._records[job.id].running_at_start = self._running[job.model]
        job.started_at = now
        job.attempts += 1
        self._leases[job.id] = _Lease(worker_id, now + self.settings.lease_s)
        self._emit(self._records[job.id], EventType.STARTED, {"attempt": job.attempts})
        return job

    async def heartbeat(self, worker_id: str, job_ids: Sequence[str]) -> set[str]:
        now = self.now()
        abort = set()
        for job_id in job_ids:
            lease = self._leases.get(job_id)
            rec = self._records.get(job_id)
            if lease is None or lease.worker_id != worker_id or rec is None or rec.job.terminal:
                abort.add(job_id)
                if lease is not None and lease.worker_id == worker_id:
                    del self._leases[job_id]
                continue
            lease.expires = now + self.settings.lease_s
        return abort

    async def release(self, job_id: str, worker_id: str) -> bool:
        lease = self._leases.get(job_id)
        rec = self._records.get(job_id)
        if lease is None or lease.worker_id != worker_id:
            return False
        if rec is None or rec.job.state is not JobState.RUNNING:
            return False
        del self._leases[job_id]
        job = rec.job
        # As release.lua: the attempt this worker gave up is not charged.
        job.attempts = max(job.attempts - 1, 0)
        self._move(job, JobState.QUEUED)
        self._queue(job.model).push(job.priority, self._entry(job), front=True)
        # Its deadline entry may have gone while it ran: queued again, it must expire again.
        heapq.heappush(self._deadlines, (job.deadline, job.id))
        self._emit(rec, EventType.RETRY, {"attempt": job.attempts + 1, "reason": "released unstarted"})
        self._wake_claimers()
        return True

    async def wait_abort_signal(self, timeout: float) -> None:
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                await self._abort.current().wait()

    async def publish(self, job_id: str, type: EventType, data: dict[str, Any]) -> None:
        rec = self._records.get(job_id)
        if rec is None or rec.job.state is not JobState.RUNNING:
            return
        if type is EventType.TOKEN and rec.job.first_token_at is None:
            rec.job.first_token_at = self.now()
        # Tokens too go through _emit, the one statement of how an event is appended and handed
        # to the follower and the readers: its steps copied inline here save one call a token
        # (memory_wakeup --whole 47.6 -> 46.5 of the whole path's calls), not worth two copies.
        self._emit(rec, type, data)

    #: finish below awaits nothing (tests/broker/test_conformance.py holds it to that)
    finish_at_once = True

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
        lease = self._leases.get(job_id)
        if lease is None or lease.worker_id != worker_id:
            return None
        del self._leases[job_id]
        rec = self._records.get(job_id)
        if rec is None or rec.job.state is not JobState.RUNNING:
            return None
        job = rec.job
        job.result, job.usage = result, usage
        if attempts is not None:
            job.attempts = attempts
        if backend is not None:
            job.backend = backend
        # The jobs that ran beside it, itself included: the mean of when it started and now.
        beside = (rec.running_at_start + self._running.get(job.model, 0)) / 2
        self._settle(rec, state, error)
        now = job.finished_at  # the settlement's time, _settle's one read of the clock
        assert now is not None
        if usage is not None and isinstance(usage.get("total_tokens"), int):
            limiter = self._charged_limiter(rec)
            if limiter is not None:
                limiter.settle(job.cost, usage["total_tokens"], now)
        if state is JobState.SUCCEEDED and job.started_at is not None:
            self._drain_rate(job.model, now).observe(job.cost, now - job.started_at, beside)
        return job

    async def dead_letters(self) -> dict[str, float]:
        return dict(self._dead)

    async def purge_dead_letters(self, ids: Sequence[str] | None = None) -> int:
        gone = [i for i in (ids if ids is not None else list(self._dead)) if i in self._dead]
        for job_id in gone:
            del self._dead[job_id]
            self._drop_record(job_id)
        return len(gone)

    async def set_draining(self, backend: str, draining: bool) -> None:
        if draining:
            self._draining.add(backend)
        else:
            self._draining.discard(backend)

    async def draining(self) -> set[str]:
        return set(self._draining)

    async def put_key(self, key_sha256: str, record: dict[str, Any]) -> None:
        self._keys[key_sha256] = dict(record)

    async def get_key(self, key_sha256: str) -> dict[str, Any] | None:
        record = self._keys.get(key_sha256)
        return dict(record) if record is not None else None

    async def delete_key(self, key_sha256: str) -> bool:
        return self._keys.pop(key_sha256, None) is not None

    async def list_keys(self) -> dict[str, dict[str, Any]]:
        return {h: dict(r) for h, r in self._keys.items()}

    # --- open connections per API key --------------------------------------------------------

    def _live_connections(self, key_sha256: str) -> dict[str, float]:
        """The key's counted connections (id → lease expiry), those whose lease lapsed dropped."""
        held = self._connections.get(key_sha256, {})
        now = self.now()
        for conn_id in [c for c, expires in held.items() if expires < now]:
            del held[conn_id]
        if not held:
            self._connections.pop(key_sha256, None)
        return held

    async def open_connection(self, key_sha256: str, connection_id: str, cap: int) -> bool:
        held = self._live_connections(key_sha256)
        if len(held) >= cap:
            return False
        self._connections[key_sha256] = {**held, connection_id: self.now() + self.settings.lease_s}
        return True

    async def renew_connections(self, held: Mapping[str, Collection[str]]) -> None:
        expires = self.now() + self.settings.lease_s
        for key_sha256, ids in held.items():
            if ids:
                self._connections.setdefault(key_sha256, {}).update(dict.fromkeys(ids, expires))

    async def close_connection(self, key_sha256: str, connection_id: str) -> None:
        held = self._connections.get(key_sha256)
        if held is not None:
            held.pop(connection_id, None)
            if not held:
                del self._connections[key_sha256]

    async def open_connections(self, key_sha256: str) -> int:
        return len(self._live_connections(key_sha256))

    supports_callbacks = True

    async def ended_callbacks(self, worker_id: str, timeout: float) -> list[str]:
        if not self._callbacks:
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(timeout):
                    await self._callback_signal.current().wait()
        ids, self._callbacks = self._callbacks, []
        return ids

    async def add_delivery(self, job_id: str, attempt: dict[str, Any]) -> None:
        rec = self._records.get(job_id)
        if rec is not None:
            rec.job.extra.setdefault("deliveries", []).append(attempt)

    async def maintain(self) -> None:
        now = self.now()
        while self._deadlines and self._deadlines[0][0] <= now:
            _, job_id = heapq.heappop(self._deadlines)
            rec = self._records.get(job_id)
            if rec is not None and rec.job.state is JobState.QUEUED:
                job = rec.job
                self._queue(job.model).remove(job.priority, job.id, job.tenant)
                self._settle(rec, JobState.EXPIRED, deadline_error())
        for job_id, lease in list(self._leases.items()):
            if lease.expires > now:
                continue
            del self._leases[job_id]
            rec = self._records.get(job_id)
            if rec is None or rec.job.state is not JobState.RUNNING:
                continue
            job = rec.job
            if job.attempts >= job.max_attempts:
                self._dead[job.id] = now
                self._settle(rec, JobState.FAILED, worker_lost_error(job.attempts))
                continue
            self._move(job, JobState.QUEUED)
            self._queue(job.model).push(job.priority, self._entry(job), front=True)
            # Its deadline entry may have gone while it ran: queued again, it must expire again.
            heapq.heappush(self._deadlines, (job.deadline, job.id))
            self._emit(rec, EventType.RETRY, {"attempt": job.attempts, "reason": "lease expired"})
            self._wake_claimers()
        for q in self._queues.values():  # the tenants drained out of the fair order's memory
            q.forget_drained()
        mono = time.monotonic()
        while self._to_pack and self._to_pack[0][0] <= mono:
            _, job_id = self._to_pack.popleft()
            rec = self._records.get(job_id)
            if rec is not None:
                rec.pack()
        while self._ttl and self._ttl[0][0] <= now:
            _, job_id = heapq.heappop(self._ttl)
            self._drop_record(job_id)
            self._dead.pop(job_id, None)

    def _drop_record(self, job_id: str) -> None:
        """Forget a job, and the idempotency key that names it: a key lives as long as its job."""
        rec = self._records.pop(job_id, None)
        if rec is not None:
            kept = self._tenant_jobs.get(rec.job.tenant, {})
            kept.pop(job_id, None)
            if not kept:
                self._tenant_jobs.pop(rec.job.tenant, None)
        if rec is not None and rec.job.idempotency_key:
            idem = (rec.job.tenant, rec.job.idempotency_key)
            if self._idempotency.get(idem) == job_id:
                del self._idempotency[idem]


def _ran_out(waiting: asyncio.Future[bool]) -> None:
    """A claim's wait that ran out (its timer's call)."""
    if not waiting.done():
        waiting.set_result(False)


def _unfollowed() -> None:
    """The stop of a follow that has ended already."""


def _gave_up(ended: asyncio.Future[None]) -> None:
    """:meth:`MemoryBroker.wait`'s timer: its wait ends (the job as it stands) unless the job's
    end, or the waiter's cancellation, settled the future first."""
    if not ended.done():
        ended.set_result(None)
