"""The durable broker: Redis, with one Lua script per state change (docs/design.md, "Redis").

Every key of a queue carries the queue's hash tag (``sluice.broker.redis_keys``), so each script touches
one slot and the layout runs unchanged on Redis Cluster. Scripts get the time from the caller
(``settings.clock``), never from Redis, so that tests can move it and the scripts stay pure. The
scripts mirror the core's scheduling (``lua/_fairqueue.lua`` is FairQueue, ``lua/_classes.lua`` is
ClassScheduler, ``admit.lua`` is the queue policy with admission's checks), and a test checks that
the memory broker and this one make the same decisions.

Connections (``redis_pipe``): commands and scripts go out in pipelines, one per event-loop turn, on a
``BlockingConnectionPool`` with short timeouts, so that a dead Redis answers with
:class:`BrokerUnavailable` in about a second, never a hang; a second pool serves the blocking claim
(``BZPOPMIN`` on the models' wake-up markers, at most 10 s per block) and the abort subscription;
each process follows all the job streams it is asked for with one multiplexed reader
(``redis_events``). With Sentinel or Cluster (``redis_topology``) every pool connects to wherever
the primary is now, and the writes in :data:`DURABLE_SCRIPTS` are answered only once a replica has
them (docs/redis.md).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import secrets
from collections.abc import AsyncIterator, Awaitable, Collection, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar, cast

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError

from sluice.broker.base import (
    TERMINAL_EVENTS,
    Admission,
    Broker,
    BrokerSettings,
    BrokerUnavailable,
    ClassDepth,
    Event,
    EventType,
    JobPage,
    ModelStats,
    QueueBreakdown,
    TenantDepth,
)
from sluice.broker.redis_codec import (
    AdmitOutcome,
    AdmitReply,
    JobReply,
    PurgeExpiredReply,
    ReapReply,
    bound,
    capacity_drain,
    capacity_slots,
    decode_job,
    encode_job,
    pairs,
    settle_fields,
    tenant_limit_args,
    to_json,
)
from sluice.broker.redis_events import AbortListener, StreamHub, check_cancelled, decode_event, stop_task
from sluice.broker.redis_keys import (
    BROKEN_PROMISES_FIELD,
    JobField,
    QueueKeys,
    queued_jobs_field,
    queued_tokens_field,
)
from sluice.broker.redis_pipe import Batcher, Script, make_locator, make_pool, translate
from sluice.broker.redis_topology import DEFAULT_WAIT_TIMEOUT_MS, durability_for, parse_broker_url
from sluice.core import admission
from sluice.core.capacity import SLOW_QUANTILE, SLOW_STEP, DrainRate
from sluice.core.errors import (
    UNFINISHABLE_LEFT,
    WORKER_LOST_ATTEMPTS,
    cancelled_error,
    deadline_error,
    evicted_error,
    unfinishable_error,
    worker_lost_error,
)
from sluice.core.job import TERMINAL_STATES, Job, JobError, JobState
from sluice.core.model_info import ModelInfo, merge
from sluice.core.policy import Candidate
from sluice.core.ratelimit import TenantLimits
from sluice.outage import OutageLog
from sluice.views import job_view

__all__ = ["BrokerUnavailable", "RedisBroker", "Script"]

log = logging.getLogger(__name__)

T = TypeVar("T")

#: Longest single BZPOPMIN of an idle claimer; a longer claim blocks again.
CLAIM_BLOCK_S = 10.0
#: How often each process offers to run upkeep; a lock lets one process per interval do it.
MAINTAIN_INTERVAL_S = 0.25
#: Events kept per job stream (``XADD MAXLEN ~``): room for a long generation, token by token.
STREAM_MAXLEN = 10_000
#: Work per upkeep script call, so that no call holds Redis for long; the rest follows at once.
UPKEEP_BATCH = 500
#: Jobs found expired per claim call before the call returns to be repeated.
EXPIRED_PER_CLAIM = 64
#: What a finished record's Redis TTL adds to the result TTL (lua/_job.lua, ``settle``).
RECORD_GRACE_S = 60.0
#: How long a worker may take to deliver a webhook before it is handed to another worker.
CALLBACK_LEASE_S = 600.0
#: Webhooks handed to one worker at a time.
CALLBACK_BATCH = 100
#: Backlogged tenants read per class and model for the dashboard's breakdown (bounds its cost).
BREAKDOWN_SCAN = 2000

# The errors the scripts settle jobs with, as JSON; the scripts fill in the placeholders.
_EXPIRED = to_json(deadline_error().to_dict())
_EVICTED = to_json(evicted_error().to_dict())
_CANCELLED = to_json(cancelled_error().to_dict())
_UNFINISHABLE = to_json(unfinishable_error(UNFINISHABLE_LEFT).to_dict())
_WORKER_LOST = to_json(worker_lost_error(WORKER_LOST_ATTEMPTS).to_dict())

SCRIPT_NAMES = (
    "admit",
    "claim",
    "heartbeat",
    "publish",
    "finish",
    "cancel",
    "reap",
    "purge_expired",
    "position",
    "workers",
    "release",
    "callbacks",
    "purge_dead",
    "connect",
)

#: The scripts whose writes must reach the replicas the durability setting asks for before they are
#: answered (``WAIT``): an accepted job, a settled one and a cancel are never lost in a failover.
#: Claims need not wait: a claim lost with the primary leaves its job queued on the new one, and the
#: lease token fences the worker that had it (its heartbeat is told to abort, its finish refused).
DURABLE_SCRIPTS = frozenset({"admit", "finish", "cancel"})


@dataclass(frozen=True)
class _ClaimPlan:
    """The keys and fixed arguments of a claim over one tuple of models (cached per tuple)."""

    keys: list[str]
    markers: list[str]
    lease_s: str
    fixed: list[str]  # ARGV[6 .. 11]
    unfinishable: str  # ARGV[13]
    tail: list[str]  # class names, minimum shares, models


# --- the broker -------------------------------------------------------------------------------


class RedisBroker(Broker):
    """Admitted jobs, queues, leases, results and events in Redis; any number of gateway and worker
    processes share one queue.

    Args:
        url: ``redis://``, ``rediss://`` or ``unix://`` URL of one Redis, ``redis+sentinel://`` of the
            sentinels and the master's name, or ``redis+cluster://`` of some cluster nodes
            (``redis_topology``).
        settings: the broker settings; they travel to the scripts with every call.
        queue: the queue's name: the hash tag of all its keys, so several queues can share one Redis.
        max_connections: size of the command pool; callers beyond it wait up to ``pool_timeout_s``.
        pool_timeout_s: longest wait for a free connection before :class:`BrokerUnavailable`.
        socket_timeout_s: longest wait for a command's answer.
        connect_timeout_s: longest wait for a TCP connection.
        blocking_connections: size of the pool for blocking claims (one per concurrent ``claim``).
        min_replicas: replicas that must confirm an admission, settlement or cancel before it is
            answered (``WAIT``); None: 1 with Sentinel or Cluster, 0 with one Redis.
        wait_timeout_ms: how long they have; when fewer confirm, the call raises
            :class:`BrokerUnavailable`.
    """

    def __init__(
        self,
        url: str = "redis://localhost:6379/0",
        settings: BrokerSettings | None = None,
        *,
        queue: str = "sluice",
        max_connections: int = 64,
        pool_timeout_s: float = 2.0,
        socket_timeout_s: float = 2.0,
        connect_timeout_s: float = 0.5,
        blocking_connections: int = 16,
        min_replicas: int | None = None,
        wait_timeout_ms: int = DEFAULT_WAIT_TIMEOUT_MS,
    ) -> None:
        super().__init__(settings or BrokerSettings())
        self.url = url
        self.keys = QueueKeys(queue)
        self.topology = parse_broker_url(url)
        self.durability = durability_for(self.topology, min_replicas, wait_timeout_ms)
        # With Sentinel or Cluster, one locator finds the primary for all three pools.
        self._locator = make_locator(self.topology, connect_timeout_s, self.keys.prefix)
        # One immediate retry on a fresh connection absorbs a Redis restart (every pooled
        # connection is dead then); timeouts are not retried, as the command may have run.
        retry = Retry(NoBackoff(), 1, (RedisConnectionError,))
        common: dict[str, Any] = {
            # RESP2: the pipelines read raw replies, which must keep one shape (redis-py 8 speaks
            # RESP3 by default, where a hash comes back as a map).
            "protocol": 2,
            "decode_responses": True,
            "socket_connect_timeout": connect_timeout_s,
            "retry": retry,
        }
        # No socket timeouts: each call or pipeline gets one asyncio timeout instead (socket_timeout_s
        # for commands, above the block time for blocking reads). With a socket timeout redis-py
        # arms a timer around every reply and sends through asyncio.wait_for, which on Python 3.11
        # can swallow a cancel and would leave a cancelled claim blocked for 10 s.
        self._timeout = socket_timeout_s
        self._redis = Redis.from_pool(
            make_pool(
                self.topology,
                self._locator,
                max_connections=max_connections,
                timeout=pool_timeout_s,
                socket_timeout=None,
                **common,
            )
        )
        self._blocking = Redis.from_pool(
            make_pool(
                self.topology,
                self._locator,
                max_connections=blocking_connections + 1,
                timeout=pool_timeout_s,
                socket_timeout=None,
                **common,
            )
        )
        self._reader = Redis.from_pool(
            make_pool(
                self.topology, self._locator, max_connections=1, timeout=None, socket_timeout=None, **common
            )
        )
        self.scripts = {name: Script(name) for name in SCRIPT_NAMES}
        self._batch = Batcher(self._redis, timeout=socket_timeout_s, durability=self.durability)
        self._hub = StreamHub(self._reader, self._redis, self.keys.wake(secrets.token_hex(8)))
        self._aborts = AbortListener(self._blocking, self.keys.abort_channel)
        self._tokens: dict[tuple[str, str], str] = {}
        self._plans: dict[tuple[str, ...], _ClaimPlan] = {}
        self._releases: set[asyncio.Task[None]] = set()
        self._class_names = list(self.classes)
        self._policy_args = self.settings.policy.lua_args()  # fixed for the broker's life
        self._min_shares = [repr(float(c.min_share)) for c in self.settings.classes]
        self._drain_alpha = repr(DrainRate().alpha)
        self._task: asyncio.Task[None] | None = None

    # --- plumbing -----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._maintain_forever(), name="redis-broker-maintain")
            await self._check_replicas()

    async def _check_replicas(self) -> None:
        """Say at start when the primary has fewer replicas than every durable write will wait for:
        each of those writes would then be answered 503 after the WAIT timeout."""
        if not self.durability.on:
            return
        try:
            info = await self._io(self._redis.info("replication"))
        except BrokerUnavailable as exc:
            log.warning("could not count the Redis primary's replicas: %s", exc)
            return
        connected = int(info.get("connected_slaves", 0))
        if connected < self.durability.replicas:
            log.warning(
                "the Redis primary (%s) has %d replica(s) connected, and every admission waits for %d: "
                "they will be refused (503) until enough replicas are up (redis_min_replicas)",
                self.topology.describe(),
                connected,
                self.durability.replicas,
            )

    async def close(self) -> None:
        await stop_task(self._task)
        self._task = None
        await self._hub.close()
        await self._aborts.close()
        if self._releases:
            await asyncio.wait(self._releases, timeout=2.0)
        await self._batch.drain()
        for client in (self._redis, self._blocking, self._reader):
            await client.aclose()
        if self._locator is not None:
            await self._locator.aclose()

    async def ping(self) -> bool:
        """Whether Redis answers now (for readiness probes)."""
        try:
            return bool(await self._io(self._redis.ping()))
        except BrokerUnavailable:
            return False

    async def _call(self, name: str, keys: Sequence[str], args: Sequence[str | int | float]) -> Any:
        """Run a script, in the next pipeline. It runs whole even if the caller is cancelled (a
        client hung up): a state change is applied entirely or not at all. The durable scripts are
        answered once the replicas that the durability asks for have the change."""
        script = self.scripts[name]
        return await self._batch.call(
            script.command(keys, args), script=script, durable=name in DURABLE_SCRIPTS
        )

    async def _io(self, awaitable: Awaitable[T], timeout: float | None = None) -> T:
        """A command outside the pipelines (blocking reads, stats), with the same error mapping;
        ``timeout`` defaults to the command timeout."""
        try:
            async with asyncio.timeout(timeout or self._timeout):
                result = await awaitable
        except TimeoutError as exc:
            raise BrokerUnavailable("Redis did not answer in time") from exc
        except (RedisError, OSError) as exc:
            raise translate(exc) from exc
        check_cancelled()
        return result

    def _now(self) -> str:
        return repr(float(self.now()))

    async def _maintain_forever(self) -> None:
        lock_ms = int(MAINTAIN_INTERVAL_S * 1000)
        upkeep = OutageLog(log, "broker upkeep")
        while True:
            await asyncio.sleep(MAINTAIN_INTERVAL_S)
            try:
                if await self._io(self._redis.set(self.keys.maintain_lock, "1", nx=True, px=lock_ms)):
                    await self.maintain()
            except Exception as exc:
                upkeep.failed(exc)
            else:
                upkeep.ok()

    # --- gateway side -------------------------------------------------------------------------

    async def _admit(self, job: Job, limits: TenantLimits | None) -> Admission:
        k = self.keys
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
        args: list[str | int | float] = [
            repr(float(now)),
            job.id,
            job.model,
            job.tenant,
            job.priority,
            job.cost,
            repr(float(job.deadline)),
            bound(queue.model.max_jobs),
            bound(queue.model.max_tokens),
            bound(cls_bounds.max_jobs),
            bound(cls_bounds.max_tokens),
            repr(float(self.settings.drain_prior_per_slot)),
            repr(self._idempotency_ttl_s(job, now)) if job.idempotency_key else 0,
            *tenant_limit_args(limits),
            *self._policy_args,
            repr(float(self.settings.result_ttl_s)),
            STREAM_MAXLEN,
            _EVICTED,
            repr(admission.MIN_RETRY_AFTER_S),
            repr(admission.MAX_RETRY_AFTER_S),
            repr(admission.RETRY_PATIENCE_S),
            repr(admission.RETRY_SHARE),
            len(self._class_names),
            *self._class_names,
            *encode_job(job),
        ]
        reply = AdmitReply.from_reply(await self._call("admit", keys, args))
        if reply.outcome is AdmitOutcome.QUEUED:
            assert reply.tenant is not None
            await self._list_job(job, now)
            rate = reply.tenant.limiter(job.tenant).status(now)
            return Admission(job, False, reply.position, reply.estimated_start_s, rate)
        if reply.outcome is not AdmitOutcome.REFUSED:
            # A repeat of an idempotent request, or our own earlier try of this call got through.
            first_id = reply.first_id or job.id
            first = await self.get(first_id)
            if first is None:  # dropped in between: admit afresh
                return await self._admit(job, limits)
            pos = await self.position(first_id)
            return Admission(first, reply.outcome is AdmitOutcome.DUPLICATE, pos or 0, 0.0)
        # The script decided; the core's checks, replayed on the state it saw, raise the same Refused
        # the memory broker raises (tenant limits first, then the queue).
        assert reply.tenant is not None and reply.refusal is not None
        refusal = reply.refusal
        drain = refusal.drain(self.settings.drain_prior_per_slot)
        limiter = reply.tenant.limiter(job.tenant)
        admission.check_tenant(limiter, cost=job.cost, queued=reply.tenant.queued, now=now, drain=drain)
        candidate = Candidate(job.cost, job.priority, now, job.deadline, refusal.view, queue, drain)
        try:
            self.settings.policy.admit(candidate, refusal.policy)
        except admission.Refused as refused:
            book = admission.Reservations(refusal.next_free)
            raise admission.reserve(refused, cost=job.cost, now=now, drain=drain, book=book) from None
        raise RuntimeError("the admit script refused a job that the queue policy accepts")

    async def _list_job(self, job: Job, now: float) -> None:
        """Add an admitted job to its tenant's list, which then lives at least as long as the job's
        record can (NX sets a first expiry, GT only ever lengthens it)."""
        key = self.keys.tenant_jobs(job.tenant)
        ttl_ms = math.ceil(self._idempotency_ttl_s(job, now) * 1000)
        async with self._redis.pipeline(transaction=True) as pipe:
            pipe.zadd(key, {job.id: job.created_at})
            pipe.pexpire(key, ttl_ms, nx=True)
            pipe.pexpire(key, ttl_ms, gt=True)
            await self._io(pipe.execute())

    async def list_jobs(self, tenant: str, limit: int, after: str | None = None) -> JobPage:
        key = self.keys.tenant_jobs(tenant)
        start = 0
        if after is not None:
            rank = await self._batch.call(("ZREVRANK", key, after))
            if rank is None:
                return JobPage([], False)
            start = int(rank) + 1
        jobs: list[Job] = []
        gone: list[str] = []
        # One more than the page, to know whether more follow; members whose record expired are
        # dropped from the list and the next ones read in their place.
        while len(jobs) <= limit:
            want = limit + 1 - len(jobs)
            ids: list[str] = await self._batch.call(("ZREVRANGE", key, start, start + want - 1))
            if not ids:
                break
            start += len(ids)
            for job_id, job in zip(ids, await asyncio.gather(*(self.get(i) for i in ids)), strict=True):
                if job is None:
                    gone.append(job_id)
                else:
                    jobs.append(job)
        if gone:
            await self._batch.call(("ZREM", key, *gone))
        return JobPage(jobs[:limit], len(jobs) > limit)

    async def _record(self, job_id: str) -> dict[str, str]:
        return pairs(await self._batch.call(("HGETALL", self.keys.job(job_id))))

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
        key = self.keys.out(job_id)
        last = max(after, 0)
        # Event 1 (QUEUED) is kept in the record; the stream starts at 0-2 (see admit.lua).
        record = self._batch.call(("HMGET", self.keys.job(job_id), JobField.STATE, JobField.QUEUED_EVENT))
        stream = self._batch.call(("XRANGE", key, f"0-{max(last + 1, 2)}", "+"))
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
        async with self._hub.subscribe(key, last) as sub:
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
        k = self.keys
        reply = await self._call(
            "cancel",
            [k.job(job_id), k.deadline, k.results, k.running, k.blocked],
            [
                self._now(),
                k.prefix,
                job_id,
                repr(float(self.settings.result_ttl_s)),
                STREAM_MAXLEN,
                k.abort_channel,
                _CANCELLED,
            ],
        )
        return JobReply.from_reply(reply).job

    async def position(self, job_id: str) -> int | None:
        k = self.keys
        pos = int(await self._call("position", [k.job(job_id)], [k.prefix, job_id, *self._class_names]))
        return None if pos < 0 else pos

    async def stats(self) -> dict[str, ModelStats]:
        k = self.keys
        capacity = await self._workers("list")
        slots = capacity_slots(capacity)
        models = sorted(cast(set[str], await self._io(self._redis.smembers(k.models))) | set(slots))
        fields = [f(c) for c in self._class_names for f in (queued_jobs_field, queued_tokens_field)]
        async with self._redis.pipeline(transaction=False) as pipe:
            for model in models:
                pipe.hmget(k.state(model), [*fields, BROKEN_PROMISES_FIELD])
            pipe.hgetall(k.running)
            replies: list[Any] = await self._io(pipe.execute())
        running: dict[str, str] = replies[-1]
        out: dict[str, ModelStats] = {}
        for model, values in zip(models, replies, strict=False):
            counts, broken = values[:-1], values[-1]
            drain = capacity_drain(capacity, model, self.settings.drain_prior_per_slot)
            out[model] = ModelStats(
                sum(int(n or 0) for n in counts[0::2]),
                sum(int(n or 0) for n in counts[1::2]),
                int(running.get(model, 0)),
                drain.slots,
                drain.rate,
                drain.measured,
                int(broken or 0),
            )
        return out

    async def queue_breakdown(self, top_tenants: int) -> dict[str, QueueBreakdown]:
        k = self.keys
        models = sorted(cast(set[str], await self._io(self._redis.smembers(k.models))))
        fields = [f(c) for c in self._class_names for f in (queued_jobs_field, queued_tokens_field)]
        async with self._redis.pipeline(transaction=False) as pipe:
            for model in models:
                pipe.hmget(k.state(model), fields)
                for c in self._class_names:
                    # The class's heap of backlogged tenants (stale entries too, dropped below by
                    # their empty lists), read from its head: past BREAKDOWN_SCAN, tenants are missed.
                    pipe.zrange(k.sched(model, c), 0, BREAKDOWN_SCAN - 1)
            replies: list[Any] = await self._io(pipe.execute())
        per_model = len(self._class_names) + 1
        lists = sorted(
            {
                (model, c, member[15:])  # a member is '<15-digit seq><tenant>' (_fairqueue.lua)
                for i, model in enumerate(models)
                for c, members in zip(
                    self._class_names, replies[i * per_model + 1 : (i + 1) * per_model], strict=True
                )
                for member in members
            }
        )
        async with self._redis.pipeline(transaction=False) as pipe:
            for model, c, tenant in lists:
                tq = k.tq(model, c, tenant)
                pipe.llen(tq)
                pipe.hget(k.state(model), "w:" + tq)  # the cost in the list (_fairqueue.lua, f_work)
            counts: list[Any] = await self._io(pipe.execute()) if lists else []
        tenants: dict[str, dict[str, list[int]]] = {model: {} for model in models}
        for (model, _, tenant), jobs, tokens in zip(lists, counts[0::2], counts[1::2], strict=True):
            if int(jobs):
                held = tenants[model].setdefault(tenant, [0, 0])
                held[0] += int(jobs)
                held[1] += int(float(tokens or 0))
        out: dict[str, QueueBreakdown] = {}
        for i, model in enumerate(models):
            depth = replies[i * per_model]
            classes = {
                c: ClassDepth(int(depth[2 * j] or 0), int(depth[2 * j + 1] or 0))
                for j, c in enumerate(self._class_names)
            }
            ranked = sorted(tenants[model].items(), key=lambda kv: (-kv[1][0], kv[0]))
            out[model] = QueueBreakdown(
                classes,
                [TenantDepth(t, jobs, tokens) for t, (jobs, tokens) in ranked[: max(top_tenants, 0)]],
                len(ranked),
            )
        return out

    async def put_report(self, process_id: str, report: Mapping[str, Any], ttl_s: float) -> None:
        entry = to_json({"expires": self.now() + ttl_s, "report": report})
        await self._io(self._redis.hset(self.keys.reports, process_id, entry))

    async def reports(self) -> dict[str, dict[str, Any]]:
        raw = cast(dict[str, str], await self._io(self._redis.hgetall(self.keys.reports)))
        now = self.now()
        out: dict[str, dict[str, Any]] = {}
        expired = []
        for process_id, entry in raw.items():
            decoded = json.loads(entry)
            if float(decoded["expires"]) <= now:
                expired.append(process_id)
            else:
                out[process_id] = cast(dict[str, Any], decoded["report"])
        if expired:
            await self._io(self._redis.hdel(self.keys.reports, *expired))
        return out

    async def purge_dead_letters(self, ids: Sequence[str] | None = None) -> int:
        if ids is not None and not ids:
            return 0
        k = self.keys
        return int(await self._call("purge_dead", [k.dead, k.results], [k.prefix, *(ids or ())]))

    async def set_draining(self, backend: str, draining: bool) -> None:
        key = self.keys.draining
        await self._io(self._redis.sadd(key, backend) if draining else self._redis.srem(key, backend))

    async def draining(self) -> set[str]:
        return cast(set[str], await self._io(self._redis.smembers(self.keys.draining)))

    async def put_key(self, key_sha256: str, record: dict[str, Any]) -> None:
        await self._io(self._redis.hset(self.keys.api_keys, key_sha256, json.dumps(record)))

    async def get_key(self, key_sha256: str) -> dict[str, Any] | None:
        raw = await self._io(self._redis.hget(self.keys.api_keys, key_sha256))
        return cast(dict[str, Any], json.loads(raw)) if raw else None

    async def delete_key(self, key_sha256: str) -> bool:
        return bool(await self._io(self._redis.hdel(self.keys.api_keys, key_sha256)))

    async def list_keys(self) -> dict[str, dict[str, Any]]:
        raw = cast(dict[str, str], await self._io(self._redis.hgetall(self.keys.api_keys)))
        return {h: cast(dict[str, Any], json.loads(v)) for h, v in raw.items()}

    # --- open connections per API key: a zset per key, connection id -> lease expiry -----------

    def _connection_lease(self) -> tuple[str, int]:
        """A lease taken or renewed now: its expiry, and the zset's own time to live (ms). The zset
        outlives every lease in it twice over, whatever the skew between gateways' clocks, and goes
        once no gateway renews anything in it."""
        lease_s = self.settings.lease_s
        return repr(float(self.now() + lease_s)), max(int(2000 * lease_s), 1000)

    async def open_connection(self, key_sha256: str, connection_id: str, cap: int) -> bool:
        expires, ttl_ms = self._connection_lease()
        reply = await self._call(
            "connect", [self.keys.connections(key_sha256)], [self._now(), connection_id, cap, expires, ttl_ms]
        )
        return int(reply) == 1

    async def renew_connections(self, held: Mapping[str, Collection[str]]) -> None:
        expires, ttl_ms = self._connection_lease()
        sent = []  # submitted in this turn of the event loop, ahead of any release issued after it
        for key_sha256, ids in held.items():
            if ids:
                conns = self.keys.connections(key_sha256)
                scored = [part for conn_id in ids for part in (expires, conn_id)]
                sent.append(self._batch.submit(("ZADD", conns, *scored)))
                sent.append(self._batch.submit(("PEXPIRE", conns, ttl_ms)))
        try:
            await asyncio.gather(*sent)
        except (RedisError, OSError) as exc:
            raise translate(exc) from exc

    async def close_connection(self, key_sha256: str, connection_id: str) -> None:
        await self._batch.call(("ZREM", self.keys.connections(key_sha256), connection_id))

    async def open_connections(self, key_sha256: str) -> int:
        conns = self.keys.connections(key_sha256)
        return int(await self._batch.call(("ZCOUNT", conns, self._now(), "+inf")))

    async def dead_letters(self) -> dict[str, float]:
        entries = await self._io(self._redis.zrange(self.keys.dead, 0, -1, withscores=True))
        return {str(member): float(score) for member, score in cast(list[tuple[str, float]], entries)}

    # --- worker side --------------------------------------------------------------------------

    async def _workers(
        self, op: str, worker_id: str = "", slots: Mapping[str, int] | None = None
    ) -> dict[str, str]:
        k = self.keys
        expires = self.now() + max(self.settings.lease_s, 1.0)
        reply = await self._call(
            "workers",
            [k.workers, k.worker_slots, k.capacity],
            [self._now(), op, worker_id, repr(float(expires)), to_json(dict(sorted((slots or {}).items())))],
        )
        return pairs(reply)

    async def register(self, worker_id: str, slots: Mapping[str, int]) -> None:
        await self._workers("register", worker_id, slots)

    async def unregister(self, worker_id: str) -> None:
        await self._workers("unregister", worker_id)
        await self._batch.call(("HDEL", self.keys.model_info, worker_id))

    async def describe_models(self, worker_id: str, models: Mapping[str, ModelInfo]) -> None:
        described = {model: info.to_dict() for model, info in sorted(models.items())}
        await self._batch.call(("HSET", self.keys.model_info, worker_id, to_json(described)))

    async def model_info(self) -> dict[str, ModelInfo]:
        k = self.keys
        live, described = await asyncio.gather(
            self._batch.call(("ZRANGEBYSCORE", k.workers, self._now(), "+inf")),
            self._batch.call(("HGETALL", k.model_info)),
        )
        accounts: dict[str, list[ModelInfo]] = {}
        for worker_id, raw in pairs(described).items():
            if worker_id not in live:
                continue
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                for model, info in json.loads(raw).items():
                    accounts.setdefault(model, []).append(ModelInfo.from_dict(info))
        return {model: merge(infos) for model, infos in accounts.items()}

    async def served_models(self) -> dict[str, int]:
        return {model: n for model, n in capacity_slots(await self._workers("list")).items() if n > 0}

    def _plan(self, models: Sequence[str]) -> _ClaimPlan:
        plan = self._plans.get(tuple(models))
        if plan is None:
            k = self.keys
            keys = [k.active, k.deadline, k.results, k.running, k.blocked, k.capacity]
            for model in models:
                keys += [k.state(model), k.marker(model)]
                keys += [k.sched(model, c) for c in self._class_names]
            fixed = [
                repr(float(self.settings.result_ttl_s)),
                str(STREAM_MAXLEN),
                str(len(self._class_names)),
                str(len(models)),
                str(EXPIRED_PER_CLAIM),
                _EXPIRED,
            ]
            plan = self._plans[tuple(models)] = _ClaimPlan(
                keys,
                [k.marker(m) for m in models],
                repr(float(self.settings.lease_s)),
                fixed,
                _UNFINISHABLE,
                [*self._class_names, *self._min_shares, *models],
            )
        return plan

    async def _claim(self, worker_id: str, models: Sequence[str], timeout: float) -> Job | None:
        plan = self._plan(models)
        loop = asyncio.get_running_loop()
        give_up = loop.time() + timeout
        script = self.scripts["claim"]
        woken = 0
        while True:
            token = secrets.token_hex(8)
            command = script.command(
                plan.keys,
                [
                    self._now(),
                    self.keys.prefix,
                    plan.lease_s,
                    worker_id,
                    token,
                    *plan.fixed,
                    woken,
                    plan.unfinishable,
                    *plan.tail,
                ],
            )

            def orphan(reply: Any, worker_id: str = worker_id, token: str = token) -> None:
                # The caller was cancelled but its claim went through: hand that job straight
                # back rather than leave it leased to nobody until the lease runs out.
                release = asyncio.ensure_future(self._release_claimed(reply, worker_id, token))
                self._releases.add(release)
                release.add_done_callback(self._releases.discard)

            try:
                reply = await self._batch.submit(command, script=script, orphan=orphan)
            except (RedisError, OSError) as exc:
                raise translate(exc) from exc
            claimed = JobReply.from_reply(reply)
            if claimed.job is not None:
                self._tokens[(worker_id, claimed.job.id)] = token
                return claimed.job
            if claimed.code == 2:
                continue
            remaining = give_up - loop.time()
            if remaining <= 0:
                return None
            # Redis reads a zero timeout as "forever".
            block = max(min(remaining, CLAIM_BLOCK_S), 0.01)
            # The timeout above the block notices a connection that died silently.
            popped = await self._io(self._blocking.bzpopmin(plan.markers, timeout=block), timeout=block + 5.0)
            woken = 1 if popped else 0

    async def _release_claimed(self, reply: Any, worker_id: str, token: str) -> None:
        claimed = JobReply.from_reply(reply).job
        if claimed is None:
            return
        job_id = claimed.id
        k = self.keys
        with contextlib.suppress(Exception):
            await self._call(
                "release",
                [k.job(job_id), k.out(job_id), k.active, k.deadline, k.running, k.blocked],
                [k.prefix, job_id, worker_id, token, STREAM_MAXLEN],
            )

    async def release(self, job_id: str, worker_id: str) -> bool:
        token = self._tokens.get((worker_id, job_id))
        if token is None:
            return False
        k = self.keys
        released = await self._call(
            "release",
            [k.job(job_id), k.out(job_id), k.active, k.deadline, k.running, k.blocked],
            [k.prefix, job_id, worker_id, token, STREAM_MAXLEN],
        )
        # Forgotten only once the script has answered: if Redis could not be reached, the lease is
        # still this worker's, and a heartbeat or a finish may still need the token.
        self._tokens.pop((worker_id, job_id), None)
        return int(released) == 1

    async def heartbeat(self, worker_id: str, job_ids: Sequence[str]) -> set[str]:
        if not job_ids:
            return set()
        k = self.keys
        args: list[str | int | float] = [self._now(), repr(float(self.settings.lease_s)), worker_id]
        for job_id in job_ids:
            args += [job_id, self._tokens.get((worker_id, job_id), "")]
        abort = {str(i) for i in await self._call("heartbeat", [k.active, *map(k.job, job_ids)], args)}
        for job_id in abort:
            self._tokens.pop((worker_id, job_id), None)
        return abort

    async def wait_abort_signal(self, timeout: float) -> None:
        await self._aborts.wait(timeout)

    async def publish(self, job_id: str, type: EventType, data: dict[str, Any]) -> None:
        k = self.keys
        await self._call(
            "publish", [k.job(job_id), k.out(job_id)], [self._now(), type.value, to_json(data), STREAM_MAXLEN]
        )

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
        fields = settle_fields(result=result, usage=usage, error=error, attempts=attempts, backend=backend)
        used = usage.get("total_tokens") if usage is not None else None
        return await self._finish(job_id, worker_id, state, used if isinstance(used, int) else -1, fields)

    async def _finish(
        self, job_id: str, worker_id: str, state: JobState, used: int, fields: list[str]
    ) -> Job | None:
        k = self.keys
        token = self._tokens.pop((worker_id, job_id), "")
        reply = await self._call(
            "finish",
            [k.job(job_id), k.out(job_id), k.active, k.results, k.running, k.capacity, k.blocked],
            [
                self._now(),
                k.prefix,
                job_id,
                worker_id,
                token,
                state.value,
                repr(float(self.settings.result_ttl_s)),
                STREAM_MAXLEN,
                self._drain_alpha,
                repr(SLOW_QUANTILE),
                repr(SLOW_STEP),
                used,
                *fields,
            ],
        )
        return JobReply.from_reply(reply).job

    # --- webhooks -----------------------------------------------------------------------------

    supports_callbacks = True

    async def ended_callbacks(self, worker_id: str, timeout: float) -> list[str]:
        k = self.keys
        loop = asyncio.get_running_loop()
        give_up = loop.time() + timeout
        while True:
            ids = await self._call(
                "callbacks",
                [k.callbacks, k.callbacks_inflight, k.callbacks],
                ["take", self._now(), repr(CALLBACK_LEASE_S), CALLBACK_BATCH],
            )
            if ids:
                return [str(i) for i in ids]
            remaining = give_up - loop.time()
            if remaining <= 0:
                return []
            block = max(min(remaining, CLAIM_BLOCK_S), 0.01)
            await self._io(self._blocking.bzpopmin([k.callbacks_marker], timeout=block), timeout=block + 5.0)

    async def ack_callback(self, job_id: str) -> None:
        k = self.keys
        await self._call(
            "callbacks", [k.callbacks, k.callbacks_inflight, k.callbacks], ["ack", self._now(), job_id]
        )

    async def add_delivery(self, job_id: str, attempt: dict[str, Any]) -> None:
        k = self.keys
        for _ in range(10):  # compare and set: another writer is unlikely, but never lost
            before = await self._batch.call(("HGET", k.job(job_id), JobField.EXTRA))
            if before is None:
                return
            extra = json.loads(before)
            extra.setdefault("deliveries", []).append(attempt)
            keys = [k.callbacks, k.callbacks_inflight, k.job(job_id)]
            if int(await self._call("callbacks", keys, ["extra", self._now(), before, to_json(extra)])) != 0:
                return
        log.warning("delivery log of %s kept changing; attempt not recorded", job_id)

    async def maintain(self) -> None:
        k = self.keys
        common: list[str | int | float] = [
            k.prefix,
            UPKEEP_BATCH,
            repr(float(self.settings.result_ttl_s)),
            STREAM_MAXLEN,
        ]
        # Deadlines before leases, as the memory broker: a job handed back now waits a round.
        while True:
            purged = PurgeExpiredReply.from_reply(
                await self._call(
                    "purge_expired",
                    [k.deadline, k.results, k.dead, k.running, k.blocked],
                    [self._now(), *common, _EXPIRED],
                )
            )
            if not purged.more:
                break
        while True:
            reaped = ReapReply.from_reply(
                await self._call(
                    "reap",
                    [k.active, k.deadline, k.results, k.dead, k.running, k.blocked],
                    [self._now(), *common, _WORKER_LOST],
                )
            )
            if not reaped.more:
                break
        await self._workers("list")
