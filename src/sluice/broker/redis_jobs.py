"""The gateway's side of the Redis broker: admission, a tenant's job list, reading a job and
following its events, cancelling it, and its place in the queue. Part of
:class:`sluice.broker.redis.RedisBroker`; each operation runs on the shard of its job or model
(``redis_shards``)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
from collections.abc import AsyncIterator

from redis.exceptions import RedisError

from sluice.broker.base import TERMINAL_EVENTS, Admission, BrokerUnavailable, Event, EventType, JobPage
from sluice.broker.redis_codec import (
    AdmitOutcome,
    AdmitReply,
    JobReply,
    bound,
    created_us,
    decode_job,
    encode_job,
    pairs,
    settings_text,
    tenant_limit_args,
)
from sluice.broker.redis_core import CANCELLED, RECORD_GRACE_S, STREAM_MAXLEN, UPKEEP_BATCH, RedisCore
from sluice.broker.redis_events import decode_event
from sluice.broker.redis_keys import JobField
from sluice.broker.redis_shards import Shard, shard_of_job, tag_job_id
from sluice.core import admission
from sluice.core.job import TERMINAL_STATES, Job, JobState
from sluice.core.policy import Candidate, decide
from sluice.core.ratelimit import TenantLimits
from sluice.views import job_view

log = logging.getLogger("sluice.broker.redis")

#: How long after its admission upkeep lists a job that its admission may still be listing: well
#: past the command timeout (2 s), the longest a listing that succeeds can take.
LIST_REPAIR_AFTER_S = 10.0


def _ignore_failure(done: asyncio.Future[object]) -> None:
    """Retrieve an unawaited command's error (upkeep repairs what it did not do)."""
    if not done.cancelled():
        done.exception()


class JobsMixin(RedisCore):
    """Admitting, reading, following and cancelling jobs."""

    async def _admit(self, job: Job, limits: TenantLimits | None) -> Admission:
        shard = self._model_shard(job.model)
        k = shard.keys
        if shard.number is not None and shard_of_job(job.id) != shard.number:
            job.id = tag_job_id(job.id, shard.number)  # GET /v1/jobs/{id} then finds its shard
        await self._announce(shard)
        queue = self.settings.limits_for(job.model)
        cls_bounds = queue.classes.get(job.priority, admission.Bounds())
        idem = k.idem(job.tenant, job.idempotency_key) if job.idempotency_key else k.job(job.id)
        now = self.now()
        job.state = JobState.QUEUED
        keys = [
            k.job(job.id),
            k.out(job.id),
            k.tq(job.model, job.priority, job.tenant),
            k.sched(job.model, job.priority),
            idem,
            k.state(job.model),
            k.deadline,
            k.models,
            k.capacity,
            k.workers,
            k.worker_slots,
            k.marker(job.model),
            k.tenant(job.tenant),
            k.blocked,
            k.running,
            k.capped,
            k.results,
        ]
        # The tenant's list is in the home shard: there the script adds the job to it (one call
        # fewer, no MULTI/EXEC); a queue of another shard lists it after, with _list_job, and the
        # script notes it in that shard's unlisted jobs, from which upkeep lists it if we cannot.
        listed = shard is self.home
        listing: list[str | int | float] = ["", ""]
        if listed:
            keys.append(self.keys.tenant_jobs_us(job.tenant))
            listing = [created_us(job.created_at), self._list_ttl_ms(job, now)]
        else:
            keys.append(k.unlisted)
        args: list[str | int | float] = [
            repr(float(now)),
            job.id,
            job.tenant,
            job.cost,
            repr(float(job.deadline)),
            repr(self._idempotency_ttl_s(job, now)) if job.idempotency_key else 0,
            *tenant_limit_args(limits),
            settings_text(
                (
                    job.model,
                    job.priority,
                    bound(queue.model.max_jobs),
                    bound(queue.model.max_tokens),
                    bound(cls_bounds.max_jobs),
                    bound(cls_bounds.max_tokens),
                ),
                self._admit_settings,
            ),
            *listing,
            *encode_job(job),
        ]
        reply = AdmitReply.from_reply(await self._call("admit", keys, args, shard))
        if reply.outcome is AdmitOutcome.QUEUED:
            assert reply.tenant is not None
            if not listed:
                await self._list_admitted(job, now, shard)
            rate = reply.tenant.limiter(job.tenant).status(now)
            return Admission(job, False, reply.position, reply.estimated_start_s, rate)
        if reply.outcome is not AdmitOutcome.REFUSED:
            # A repeat of an idempotent request, or our own earlier try of this call got through.
            first_id = reply.first_id or job.id
            first = await self.get(first_id)
            if first is None:  # dropped in between: admit afresh
                return await self._admit(job, limits)
            if reply.outcome is AdmitOutcome.RETRIED and not listed:
                # The earlier try may have been cut off before it listed the job (its answer lost
                # on the way back): list it now (a ZADD of the same member and score changes nothing).
                await self._list_admitted(first, now, shard)
            pos = await self.position(first_id)
            return Admission(first, reply.outcome is AdmitOutcome.DUPLICATE, pos or 0, 0.0)
        # The script decided; the core's checks, replayed on the state it saw, raise the same Refused
        # the memory broker raises (tenant limits first, then the queue).
        assert reply.tenant is not None and reply.refusal is not None
        refusal = reply.refusal
        drain = refusal.drain(self.settings.drain_prior_per_slot)
        limiter = reply.tenant.limiter(job.tenant)
        candidate = Candidate(job.cost, job.priority, now, job.deadline, refusal.view, queue, drain)
        book = admission.Reservations(refusal.next_free)
        decide(
            self.settings.policy,
            candidate,
            refusal.policy,
            limiter=limiter,
            queued=reply.tenant.queued,
            book=book,
        )
        raise RuntimeError("the admit script refused a job that the queue policy accepts")

    async def _list_admitted(self, job: Job, now: float, shard: Shard) -> None:
        """List a job just queued in ``shard`` (not the home shard) in its tenant's list, then take
        it out of the shard's unlisted jobs. The job is queued whatever happens here: a failure
        (the home shard's master down, a failover) does not fail the admission, whose answer must
        say what happened to the job (a 503 would have the client send it again, and it would run
        twice); upkeep lists it instead (:meth:`_repair_listing`), once the home shard answers."""
        try:
            await self._list_job(job, now)
        except (BrokerUnavailable, RedisError) as exc:
            log.warning(
                "job %s is queued; listing it for tenant %s failed, upkeep retries: %s",
                job.id,
                job.tenant,
                exc,
            )
            return
        # Not awaited: the admission's answer need not wait for it (the pipeline sends it anyway);
        # if it is lost, upkeep lists the job again, which changes nothing.
        done = shard.batch.submit(("ZREM", shard.keys.unlisted, job.id))
        done.add_done_callback(_ignore_failure)

    async def _repair_listing(self, shard: Shard) -> None:
        """List the jobs of ``shard`` that their admission could not list (:meth:`_list_admitted`),
        those noted at least :data:`LIST_REPAIR_AFTER_S` ago (the others' admissions may be listing
        them now), at most :data:`UPKEEP_BATCH` per round; a job whose record is gone is dropped.
        A listing that fails leaves them for the next round."""
        k = shard.keys
        before = repr(float(self.now() - LIST_REPAIR_AFTER_S))
        ids: list[str] = await shard.batch.call(
            ("ZRANGEBYSCORE", k.unlisted, "-inf", before, "LIMIT", 0, UPKEEP_BATCH)
        )
        if not ids:
            return
        now = self.now()
        jobs = await asyncio.gather(*(self.get(i) for i in ids))
        tries = await asyncio.gather(
            *(self._list_job(job, now) for job in jobs if job is not None), return_exceptions=True
        )
        outcomes = iter(tries)
        failed = [next(outcomes) if job is not None else None for job in jobs]
        done = [job_id for job_id, exc in zip(ids, failed, strict=True) if exc is None]
        if done:
            await shard.batch.call(("ZREM", k.unlisted, *done))
        error = next((exc for exc in failed if exc is not None), None)
        if error is not None:
            raise error

    async def _list_job(self, job: Job, now: float) -> None:
        """Add an admitted job to its tenant's list, which then lives at least as long as the job's
        record can (NX sets a first expiry, GT only ever lengthens it). The list is in the home
        shard: it spans the tenant's models, and holds only ids, which name their shards."""
        key = self.keys.tenant_jobs_us(job.tenant)
        ttl_ms = self._list_ttl_ms(job, now)
        await self._batch.transaction(
            ("ZADD", key, created_us(job.created_at), job.id),
            ("PEXPIRE", key, ttl_ms, "NX"),
            ("PEXPIRE", key, ttl_ms, "GT"),
        )

    def _list_ttl_ms(self, job: Job, now: float) -> int:
        """How long, at least, the tenant's list of jobs is kept after this job joins it."""
        return math.ceil(self._idempotency_ttl_s(job, now) * 1000)

    async def list_jobs(self, tenant: str, limit: int, after: str | None = None) -> JobPage:
        # The list admissions write now, then the older form's (seconds as scores), whose jobs are
        # all older: read one after the other, they are one list newest first.
        keys = (self.keys.tenant_jobs_us(tenant), self.keys.tenant_jobs(tenant))
        source, start = 0, 0
        if after is not None:
            ranks = await asyncio.gather(*(self._batch.call(("ZREVRANK", key, after)) for key in keys))
            found = [(i, int(rank)) for i, rank in enumerate(ranks) if rank is not None]
            if not found:
                return JobPage([], False)
            source, start = found[0][0], found[0][1] + 1
        jobs: list[Job] = []
        gone: dict[str, list[str]] = {}
        # One more than the page, to know whether more follow; members whose record expired are
        # dropped from the list and the next ones read in their place.
        while len(jobs) <= limit and source < len(keys):
            want = limit + 1 - len(jobs)
            key = keys[source]
            ids: list[str] = await self._batch.call(("ZREVRANGE", key, start, start + want - 1))
            if len(ids) < want:  # this list ends here: the next one follows
                source, start = source + 1, 0
            else:
                start += len(ids)
            for job_id, job in zip(ids, await asyncio.gather(*(self.get(i) for i in ids)), strict=True):
                if job is None:
                    gone.setdefault(key, []).append(job_id)
                else:
                    jobs.append(job)
        for key, ids in gone.items():
            await self._batch.call(("ZREM", key, *ids))
        return JobPage(jobs[:limit], len(jobs) > limit)

    async def _record(self, job_id: str) -> dict[str, str]:
        shard = self._job_shard(job_id)
        return pairs(await shard.batch.call(("HGETALL", shard.keys.job(job_id))))

    def _idempotency_ttl_s(self, job: Job, now: float) -> float:
        """How long an idempotency key is stored: no longer than its job's record can live (its
        deadline, a lease for a lost worker's job to be reaped, the result TTL and the record's own
        grace). admit.lua honours the key only while that record exists, so a repeat gets the first
        job exactly as long as the job is kept."""
        s = self.settings
        return max(job.deadline - now, 0.0) + s.lease_s + s.result_ttl_s + RECORD_GRACE_S

    async def get(self, job_id: str) -> Job | None:
        data = await self._record(job_id)
        return decode_job(data) if data else None

    async def wait(self, job_id: str, timeout: float) -> Job | None:
        data = await self._record(job_id)
        if not data:
            return None
        job = decode_job(data)
        if job.terminal:
            return job
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                async for event in self.events(job_id, after=int(data.get(JobField.SEQ, "0"))):
                    if event.type in TERMINAL_EVENTS:
                        break
        return await self.get(job_id) or job

    async def events(self, job_id: str, after: int = 0, timeout: float | None = None) -> AsyncIterator[Event]:
        shard = self._job_shard(job_id)
        key = shard.keys.out(job_id)
        last = max(after, 0)
        # Event 1 (QUEUED) is kept in the record; the stream starts at 0-2 (see admit.lua).
        record = shard.batch.call(("HMGET", shard.keys.job(job_id), JobField.STATE, JobField.QUEUED_EVENT))
        stream = shard.batch.call(("XRANGE", key, f"0-{max(last + 1, 2)}", "+"))
        (state, queued), backlog = await asyncio.gather(record, stream)
        if state is None:
            return
        if last < 1 and queued is not None:
            last = 1
            yield Event(1, EventType.QUEUED, json.loads(queued))
        for entry_id, fields in backlog:
            event = decode_event(entry_id, pairs(fields))
            last = event.id
            if event.type in TERMINAL_EVENTS:
                yield await self._terminal(job_id, event)
                return
            yield event
        if JobState(state) in TERMINAL_STATES:
            return  # resumed after the terminal event: nothing more will come
        async with shard.hub.subscribe(key, last) as sub:
            while True:
                try:
                    async with asyncio.timeout(timeout):
                        event = await sub.queue.get()
                except TimeoutError:
                    return
                if event.type in TERMINAL_EVENTS:
                    yield await self._terminal(job_id, event)
                    return
                yield event

    async def _terminal(self, job_id: str, event: Event) -> Event:
        """A terminal event carries the job's view, read from its record, which no longer changes."""
        job = await self.get(job_id)
        return Event(event.id, event.type, job_view(job) if job else {"id": job_id, "object": "job"})

    async def cancel(self, job_id: str) -> Job | None:
        shard = self._job_shard(job_id)
        k = shard.keys
        reply = await self._call(
            "cancel",
            [k.job(job_id), k.deadline, k.results, k.running, k.blocked],
            [
                self._now(),
                k.prefix,
                job_id,
                repr(float(self.settings.result_ttl_s)),
                STREAM_MAXLEN,
                self.keys.abort_channel,  # the home shard's: a cluster's PUBLISH reaches every node
                CANCELLED,
            ],
            shard,
        )
        return JobReply.from_reply(reply).job

    async def position(self, job_id: str) -> int | None:
        shard = self._job_shard(job_id)
        k = shard.keys
        pos = int(
            await self._call("position", [k.job(job_id)], [k.prefix, job_id, *self._class_names], shard)
        )
        return None if pos < 0 else pos
