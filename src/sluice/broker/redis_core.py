"""The Redis broker's plumbing: its connections, its shards (``redis_shards``), how a script or a
command is sent and its errors mapped, the blocking waits, and the upkeep loop. The broker's
operations are in ``redis_jobs``, ``redis_work``, ``redis_upkeep`` and ``redis_admin``, each a part
of :class:`sluice.broker.redis.RedisBroker`.

Connections (``redis_pipe``): commands and scripts go out in pipelines, one per event-loop turn, on a
``BlockingConnectionPool`` with short timeouts, so that a dead Redis answers with
:class:`BrokerUnavailable` in about a second, never a hang; a second pool serves the blocking claim
(``BZPOPMIN`` on the models' wake-up markers, at most 10 s per block) and the abort subscription;
each process follows all the job streams it is asked for with one multiplexed reader
(``redis_events``) per master. With Sentinel or Cluster (``redis_topology``) every pool connects to
wherever the primary is now, and the writes in :data:`DURABLE_SCRIPTS` are answered only once a
replica has them (docs/redis.md). On a cluster each shard has its own pools, located at the master
of its slot.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import secrets
from collections.abc import Awaitable, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

from redis.asyncio import Redis
from redis.asyncio.retry import Retry
from redis.backoff import NoBackoff
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import RedisError, ResponseError

from sluice.broker.base import Broker, BrokerSettings, BrokerUnavailable
from sluice.broker.outage import OutageLog
from sluice.broker.redis_codec import settings_text, to_json
from sluice.broker.redis_events import AbortListener, StreamHub, check_cancelled, stop_task
from sluice.broker.redis_keys import QueueKeys
from sluice.broker.redis_library import Library, build_library
from sluice.broker.redis_pipe import Batcher, Script, make_locator, make_pool, translate
from sluice.broker.redis_shards import Shard, shard_of_job, shard_of_model, shard_queue
from sluice.broker.redis_topology import DEFAULT_WAIT_TIMEOUT_MS, Kind, durability_for, parse_broker_url
from sluice.core import admission, capacity
from sluice.core.capacity import DrainRate
from sluice.core.errors import (
    UNFINISHABLE_LEFT,
    WORKER_LOST_ATTEMPTS,
    cancelled_error,
    deadline_error,
    evicted_error,
    unfinishable_error,
    worker_lost_error,
)

log = logging.getLogger("sluice.broker.redis")

T = TypeVar("T")

#: Longest single BZPOPMIN of an idle claimer; a longer claim blocks again.
CLAIM_BLOCK_S = 10.0
#: While a shard a claim needs is unavailable (its master down, mid-failover), how long the claim
#: blocks on the others' markers before it tries that shard again.
SHARD_RETRY_S = 1.0
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
EXPIRED = to_json(deadline_error().to_dict())
EVICTED = to_json(evicted_error().to_dict())
CANCELLED = to_json(cancelled_error().to_dict())
UNFINISHABLE = to_json(unfinishable_error(UNFINISHABLE_LEFT).to_dict())
WORKER_LOST = to_json(worker_lost_error(WORKER_LOST_ATTEMPTS).to_dict())

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


@functools.cache
def scripts_library() -> Library:
    """The library of every script, built once per process."""
    return build_library(SCRIPT_NAMES)


#: The scripts whose writes must reach the replicas the durability setting asks for before they are
#: answered (``WAIT``): an accepted job, a settled one and a cancel are never lost in a failover.
#: Claims need not wait: a claim lost with the primary leaves its job queued on the new one, and the
#: lease token fences the worker that had it (its heartbeat is told to abort, its finish refused).
DURABLE_SCRIPTS = frozenset({"admit", "finish", "cancel"})


@dataclass(frozen=True)
class ClaimPlan:
    """The keys and the settings of a claim over one tuple of models of one shard (cached).

    Attributes:
        shard: the shard the models' queues are in.
        keys: claim.lua's KEYS.
        markers: the models' wake-up markers, which an idle claimer blocks on.
        settings: claim.lua's ARGV[5], what every such claim passes the same (its header).
    """

    shard: Shard
    keys: list[str]
    markers: list[str]
    settings: str


class RedisCore(Broker):
    """Connections, shards and upkeep of :class:`sluice.broker.redis.RedisBroker` (its arguments are
    documented there)."""

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
        spread: bool | None = None,
    ) -> None:
        super().__init__(settings or BrokerSettings())
        self.url = url
        self.queue = queue
        self.topology = parse_broker_url(url)
        self.durability = durability_for(self.topology, min_replicas, wait_timeout_ms)
        #: whether each model's queue is in a shard of its own (redis_shards); a test may force it on
        #: one Redis to check the layout's slots there
        self.spread = self.topology.spread if spread is None else spread
        self._pools = {
            "max_connections": max_connections,
            "pool_timeout_s": pool_timeout_s,
            "connect_timeout_s": connect_timeout_s,
            "blocking_connections": blocking_connections,
        }
        # No socket timeouts: each call or pipeline gets one asyncio timeout instead (socket_timeout_s
        # for commands, above the block time for blocking reads). With a socket timeout redis-py
        # arms a timer around every reply and sends through asyncio.wait_for, which on Python 3.11
        # can swallow a cancel and would leave a cancelled claim blocked for 10 s.
        self._timeout = socket_timeout_s
        self.home = self._make_shard(None, QueueKeys(queue))
        self._shards: dict[int, Shard] = {}
        # The home shard's names, for the operations on the whole queue (and for tests).
        self.keys = self.home.keys
        self._redis = self.home.redis
        self._blocking = self.home.blocking
        self._batch = self.home.batch
        self._hub = self.home.hub
        self._locator = self.home.locator
        self.library = scripts_library()
        self.scripts = {name: Script(name, self.library) for name in SCRIPT_NAMES}
        self._aborts = AbortListener(self._blocking, self.keys.abort_channel)
        self._tokens: dict[tuple[str, str], str] = {}
        self._releases: set[asyncio.Task[None]] = set()
        self._plans: dict[tuple[str, ...], list[ClaimPlan]] = {}
        self._claim_turn = 0  # which shard a claim over several tries first
        # Per shard, the outage of its master as a worker's claims, registrations and heartbeats
        # see it: logged once when it begins and once when it ends, not at every claim round.
        self._shard_outages: dict[Shard, OutageLog] = {}
        # Per shard known down, the call that asks whether it answers again (_probe), one at a time.
        self._probes: dict[Shard, asyncio.Task[None]] = {}
        self._class_names = list(self.classes)
        self._policy_args = self.settings.policy.lua_args()  # fixed for the broker's life
        # admit.lua's settings after the model's and the class's bounds (its header), joined once
        self._admit_settings = settings_text(
            [
                repr(float(self.settings.drain_prior_per_slot)),
                *self._policy_args,
                repr(float(self.settings.result_ttl_s)),
                STREAM_MAXLEN,
                EVICTED,
                repr(admission.MIN_RETRY_AFTER_S),
                repr(admission.MAX_RETRY_AFTER_S),
                repr(admission.RETRY_PATIENCE_S),
                repr(admission.RETRY_SHARE),
                repr(capacity.FILL_RIDGE),
                repr(capacity.MAX_FILL_SLOWDOWN),
                *self._class_names,
            ]
        )
        self._min_shares = [repr(float(c.min_share)) for c in self.settings.classes]
        self._drain_alpha = repr(DrainRate().alpha)
        # finish.lua's settings texts, by (prefix, capacity.WEIGHT_PER_SLOT, capacity.FILL_ALPHA)
        self._finish_texts: dict[tuple[str, bool, float], str] = {}
        self._task: asyncio.Task[None] | None = None

    def _make_shard(self, number: int | None, keys: QueueKeys) -> Shard:
        """A shard's clients: its own on a cluster (located at its slot's master); elsewhere every
        slot is on the one primary, and a shard shares the home shard's pipeline and pools, with a
        stream reader of its own (an XREAD names the streams of one slot, as on a cluster)."""
        p = self._pools
        locator = make_locator(self.topology, p["connect_timeout_s"], keys.prefix)
        # One immediate retry on a fresh connection absorbs a Redis restart (every pooled
        # connection is dead then); timeouts are not retried, as the command may have run.
        common: dict[str, Any] = {
            # RESP2: the pipelines read raw replies, which must keep one shape (redis-py 8 speaks
            # RESP3 by default, where a hash comes back as a map).
            "protocol": 2,
            "decode_responses": True,
            "socket_connect_timeout": p["connect_timeout_s"],
            "retry": Retry(NoBackoff(), 1, (RedisConnectionError,)),
            "socket_timeout": None,
        }

        def client(connections: int, timeout: float | None) -> Redis:
            return Redis.from_pool(
                make_pool(self.topology, locator, max_connections=connections, timeout=timeout, **common)
            )

        reader = client(1, None)
        if number is not None and self.topology.kind is not Kind.CLUSTER:
            home = self.home
            hub = StreamHub(reader, home.redis, keys.wake(secrets.token_hex(8)))
            return Shard(number, keys, home.redis, home.blocking, reader, home.batch, hub, locator, False)
        redis = client(int(p["max_connections"]), p["pool_timeout_s"])
        blocking = client(int(p["blocking_connections"]) + 1, p["pool_timeout_s"])
        batch = Batcher(redis, timeout=self._timeout, durability=self.durability)
        hub = StreamHub(reader, redis, keys.wake(secrets.token_hex(8)))
        return Shard(number, keys, redis, blocking, reader, batch, hub, locator, True)

    # --- shards ---------------------------------------------------------------------------------

    def _shard(self, number: int) -> Shard:
        shard = self._shards.get(number)
        if shard is None:
            shard = self._shards[number] = self._make_shard(
                number, QueueKeys(shard_queue(self.queue, number))
            )
        return shard

    def _model_shard(self, model: str) -> Shard:
        """The shard of a model's queue (the home shard unless the queue is spread)."""
        return self._shard(shard_of_model(model)) if self.spread else self.home

    def _job_shard(self, job_id: str) -> Shard:
        """The shard a job's keys are in, from its id (the home shard when it names none)."""
        number = shard_of_job(job_id) if self.spread else None
        return self.home if number is None else self._shard(number)

    def _by_shard(self, job_ids: Sequence[str]) -> dict[Shard, list[str]]:
        groups: dict[Shard, list[str]] = {}
        for job_id in job_ids:
            groups.setdefault(self._job_shard(job_id), []).append(job_id)
        return groups

    async def _announce(self, shard: Shard) -> None:
        """Record in the home shard that ``shard`` holds queues, once per process, so that upkeep and
        stats in every process walk it."""
        if shard.announced or shard is self.home:
            return
        await self._io(self.home.redis.sadd(self.keys.shards, str(shard.number)))
        shard.announced = True

    def _shard_failed(self, shard: Shard, exc: Exception) -> None:
        """A worker's call to ``shard`` found its master unavailable and went on with the other
        shards: said once per outage of that shard (a failover fails every claim round meanwhile)."""
        outage = self._shard_outages.get(shard)
        if outage is None:
            outage = self._shard_outages[shard] = OutageLog(
                log,
                f"the worker's calls to the shard {shard.keys.prefix.rstrip(':')} (the other shards go on)",
            )
        outage.failed(exc)

    def _shard_down(self, shard: Shard) -> bool:
        """Whether the last worker's call to ``shard`` found it unavailable."""
        outage = self._shard_outages.get(shard)
        return outage is not None and outage.since is not None

    def _shard_answered(self, shard: Shard) -> None:
        """``shard`` answered a worker's call: ends its outage, if one was logged."""
        outage = self._shard_outages.get(shard)
        if outage is not None:
            outage.ok()

    def _skip_down(self, shards: Sequence[Shard]) -> set[Shard]:
        """The shards of ``shards`` that a round of calls over them (a worker's claim, webhook
        fetch, registration or heartbeat; an upkeep round) passes over: those known down, while
        another one is not. Each is probed meanwhile (:meth:`_probe`), and is in the round again
        once it answers. A master that hangs rather than refuses fails a call only by its timeout (the command
        timeout, 2 s): a round that tried it again would hold the other shards' next jobs (or
        leases) back by as much, every round of the outage.
        With every shard down, none is passed over: the round tries them, and raises."""
        if not self._shard_outages:
            return set()
        down = {shard for shard in shards if self._shard_down(shard)}
        if len(down) == len(set(shards)):
            return set()
        for shard in down:
            self._probe(shard)
        return down

    def _probe(self, shard: Shard) -> None:
        """Ask ``shard``, known down, whether it answers again, unless a probe of it is in flight: a
        read of a key of its slot (a replica of it, or a node that no longer serves it, answers
        MOVED: only its master's answer counts), whose answer ends the shard's outage."""
        if shard in self._probes:
            return

        async def probe() -> None:
            try:
                await shard.batch.call(("EXISTS", shard.keys.active))
            except Exception as exc:  # an outage is logged once; anything else is a bug, logged
                self._shard_failed(shard, exc)
                return
            self._shard_answered(shard)

        task = asyncio.create_task(probe(), name="redis-shard-probe")
        self._probes[shard] = task
        task.add_done_callback(lambda _t: self._probes.pop(shard, None))

    async def _shards_in_use(self) -> list[Shard]:
        """The home shard, then every shard that has held a model's queue."""
        if not self.spread:
            return [self.home]
        numbers = await self._io(self.home.redis.smembers(self.keys.shards))
        return [self.home, *(self._shard(int(n)) for n in sorted(numbers, key=int) if str(n).isdigit())]

    async def _repair_listing(self, shard: Shard) -> None:
        """List in their tenants' lists the jobs ``shard`` holds that their admission could not list
        (``redis_jobs``, where it is defined; upkeep calls it)."""
        raise NotImplementedError

    # --- plumbing -----------------------------------------------------------------------------

    async def start(self) -> None:
        if self._task is None:
            self._task = asyncio.create_task(self._maintain_forever(), name="redis-broker-maintain")
            await self._load_library()
            await self._check_replicas()

    async def _load_library(self) -> None:
        """Load the scripts' library into the primary now (each pipeline loads it again whenever a
        server lacks it), so that a Redis without Functions is named at start, not by every call."""
        try:
            await self._io(self._redis.execute_command(*self.library.load_command()))  # type: ignore[no-untyped-call]
        except BrokerUnavailable as exc:
            log.warning("could not load the broker's functions into Redis yet: %s", exc)
        except ResponseError as exc:
            if "unknown command" in str(exc).lower():
                raise RuntimeError(
                    "the Redis broker needs Redis 7.0 or later (Functions: FUNCTION LOAD, FCALL); "
                    f"{self.topology.describe()} answered: {exc}"
                ) from exc
            raise

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
        for probe in list(self._probes.values()):
            await stop_task(probe)
        await self._aborts.close()
        if self._releases:
            await asyncio.wait(self._releases, timeout=2.0)
        for shard in self._shards.values():
            await shard.aclose()
        await self.home.aclose()

    async def ping(self) -> bool:
        """Whether Redis answers now (for readiness probes)."""
        try:
            return bool(await self._io(self._redis.ping()))
        except BrokerUnavailable:
            return False

    async def _call(
        self, name: str, keys: Sequence[str], args: Sequence[str | int | float], shard: Shard | None = None
    ) -> Any:
        """Run a script on ``shard`` (the home shard by default; ``keys`` must be that shard's), in its
        next pipeline. It runs whole even if the caller is cancelled (a client hung up): a state
        change is applied entirely or not at all. The durable scripts are answered once the
        replicas that the durability asks for have the change."""
        script = self.scripts[name]
        batch = (shard or self.home).batch
        return await batch.call(script.command(keys, args), script=script, durable=name in DURABLE_SCRIPTS)

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

    async def _block(self, waits: Sequence[tuple[Shard, Sequence[str]]], block: float) -> str | None:
        """Wait up to ``block`` seconds for a member on any of the wake-up markers (``BZPOPMIN``), each
        shard's markers in a command of their own on its blocking client (a command names the keys
        of one slot); the marker that woke the wait, or None. With several shards they are all
        waited on at once and the other waits are cancelled when one wakes or runs out (a hung
        master's may not run out in time); a wait that fails for an outage of its master leaves the
        others waiting, for at most :data:`SHARD_RETRY_S` more (the caller then tries that shard
        again), and the wait raises only when every one failed."""
        by_shard: dict[Shard, list[str]] = {}
        for shard, markers in waits:
            by_shard.setdefault(shard, []).extend(markers)
        # Redis reads a zero timeout as "forever"; the timeout above the block notices a connection
        # that died silently.
        block = max(block, 0.01)

        async def one(client: Redis, markers: list[str]) -> str | None:
            popped = await self._io(client.bzpopmin(markers, timeout=block), timeout=block + 5.0)
            return str(popped[0]) if popped else None

        groups = [(shard.blocking, markers) for shard, markers in by_shard.items()]
        if len(groups) == 1:
            return await one(*groups[0])
        tasks = [asyncio.ensure_future(one(client, markers)) for client, markers in groups]
        loop = asyncio.get_running_loop()
        try:
            pending: set[asyncio.Future[str | None]] = set(tasks)
            give_up: float | None = None  # set once a wait failed: the others wait that long more
            failed: BrokerUnavailable | None = None
            while pending:
                left = None if give_up is None else give_up - loop.time()
                if left is not None and left <= 0:
                    return None
                done, pending = await asyncio.wait(pending, timeout=left, return_when=asyncio.FIRST_COMPLETED)
                for task in done:
                    exc = task.exception()
                    if isinstance(exc, BrokerUnavailable):
                        # One master down (mid-failover) must not end the wait on the others.
                        failed = exc
                        give_up = loop.time() + SHARD_RETRY_S if give_up is None else give_up
                        continue
                    # Any other failure raises here: a bug, let it show. A wait that ran out ends
                    # the whole wait (all began together): none waits on for a hung master's.
                    return task.result()
            if failed is not None and all(t.done() and t.exception() is not None for t in tasks):
                raise failed
            return None
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)

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
