"""How the Redis broker talks to Redis: connection pools, its Lua scripts, and auto-pipelining.

On a small machine the client's work per command (redis-py's asyncio call path, a system call
each way) costs more than the scripts themselves. So commands issued by concurrent callers in one
event-loop turn go out as one pipeline (ioredis calls this auto-pipelining), and commands are packed
by hiredis in C rather than by redis-py's Python loop.

Where the connections go (``redis_topology``): to the URL's one Redis; or, with Sentinel or Cluster,
to an address a :class:`Locator` looks up whenever a connection is made, and forgets when a
connection to it fails, a primary turns out to be a replica (READONLY) or the slot has moved
(MOVED): after a failover the next connection goes to the new primary by itself. A durable write
(:class:`~sluice.broker.redis_topology.Durability`) is followed, in the same pipeline and on the same
connection, by ``WAIT`` for the replicas, and answered only when enough of them have it.
"""

from __future__ import annotations

import abc
import asyncio
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any, cast

import hiredis
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import AbstractConnection, Connection
from redis.asyncio.retry import Retry
from redis.asyncio.sentinel import Sentinel
from redis.backoff import NoBackoff
from redis.crc import key_slot
from redis.exceptions import AskError, ExecAbortError, ReadOnlyError, RedisError, ResponseError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluice.broker.base import BrokerUnavailable
from sluice.broker.redis_library import Library, function_missing
from sluice.broker.redis_topology import Durability, Kind, Topology

log = logging.getLogger(__name__)

#: The most commands one pipeline carries; more wait for the next turn of the event loop.
MAX_BATCH = 512
#: Pipelines of one :class:`Batcher` in flight at once (those that wait for replicas aside).
MAX_INFLIGHT = 2

# Errors that say "Redis cannot take this now" rather than "this request is wrong": OOM under
# noeviction, MISCONF (persistence failing), a replica that lost its master, a cluster mid-failover.
_UNAVAILABLE_CODES = ("OOM", "MISCONF", "NOREPLICAS", "MASTERDOWN", "CLUSTERDOWN", "LOADING", "BUSY")


def unavailable(exc: BaseException) -> bool:
    if isinstance(exc, RedisConnectionError | RedisTimeoutError | ReadOnlyError | TryAgainError | OSError):
        return True
    if not isinstance(exc, ResponseError):
        return False
    # redis-py takes the code off the message of the errors it has a class for (OOM, CLUSTERDOWN,
    # MASTERDOWN...) and keeps it in status_code; the others keep it in their text.
    code = getattr(exc, "status_code", None) or str(exc).split(" ", 1)[0]
    return code in _UNAVAILABLE_CODES


def translate(exc: BaseException) -> BaseException:
    """:class:`BrokerUnavailable` for an outage, the error itself otherwise (a bug: let it show)."""
    if unavailable(exc):
        error = BrokerUnavailable(f"Redis is unavailable: {exc}")
        error.__cause__ = exc
        return error
    return exc


# --- connections ----------------------------------------------------------------------------------


class _HiredisPacking(AbstractConnection):
    """Packs commands in C: an admit carries about 60 arguments, which redis-py's asyncio connection
    packs in a Python loop that took longer than Redis takes to run the script."""

    def pack_command(self, *args: Any) -> list[bytes]:
        if isinstance(args[0], str) and " " in args[0]:  # "COMMAND GETKEYS" is two arguments
            args = (*args[0].split(), *args[1:])
        return [hiredis.pack_command(cast(Any, args))]  # floats come out as repr(), as redis-py's


_PACKING: dict[type[AbstractConnection], type[AbstractConnection]] = {}


def _packing(base: type[AbstractConnection]) -> type[AbstractConnection]:
    """``base`` (TCP, TLS, Unix socket, located) with commands packed by hiredis."""
    fast = _PACKING.get(base)
    if fast is None:
        fast = _PACKING[base] = type(f"Hiredis{base.__name__}", (_HiredisPacking, base), {})
    return fast


Address = tuple[str, int]


class Locator(abc.ABC):
    """Where the Redis that the broker writes to is now: looked up when a connection is made,
    remembered until a connection to it fails, and shared by all the pools of one broker, so that
    one lookup serves every connection made after a failover.

    Attributes:
        current: the address last found; None until found, and after it failed.
    """

    def __init__(self) -> None:
        self.current: Address | None = None
        self._last: Address | None = None
        self._lock = asyncio.Lock()

    async def locate(self) -> Address:
        current = self.current
        if current is not None:
            return current
        async with self._lock:  # one lookup at a time: a pool reconnecting at once asks once
            if self.current is None:
                found = await self._discover()
                if found != self._last:
                    log.info("Redis primary at %s:%s", *found)
                    self._last = found
                self.current = found
            return self.current

    def forget(self, address: Address) -> None:
        """A connection to ``address`` failed: look again for the next one."""
        if self.current == address:
            self.current = None

    def redirect(self, address: Address) -> None:
        """Redis said where to go (MOVED)."""
        self.current = address

    async def aclose(self) -> None:
        """Close what the lookups keep open."""

    @abc.abstractmethod
    async def _discover(self) -> Address:
        """The address now; :class:`RedisConnectionError` when none is known."""


def _lookup_kwargs(timeout_s: float, username: str | None, password: str | None) -> dict[str, Any]:
    """Connections that ask where the primary is: short timeouts and no retries, since the next
    node in the list is the retry."""
    return {
        "socket_timeout": timeout_s,
        "socket_connect_timeout": timeout_s,
        "retry": Retry(NoBackoff(), 0),
        "protocol": 2,
        "decode_responses": True,
        "username": username,
        "password": password,
    }


class SentinelLocator(Locator):
    """The primary that the sentinels name (redis-py's ``Sentinel.discover_master``: the first
    sentinel that answers and sees the master up, not subjectively or objectively down)."""

    def __init__(self, topology: Topology, timeout_s: float) -> None:
        super().__init__()
        self._service = topology.service
        kwargs = _lookup_kwargs(timeout_s, topology.sentinel_username, topology.sentinel_password)
        self._sentinel = Sentinel(list(topology.nodes), sentinel_kwargs=kwargs)  # type: ignore[no-untyped-call, unused-ignore]

    async def _discover(self) -> Address:
        host, port = await self._sentinel.discover_master(self._service)
        return str(host), int(port)

    async def aclose(self) -> None:
        await self._sentinel.aclose()


class ClusterLocator(Locator):
    """The master of one hash slot, the queue's (every key of a queue is in it), as ``CLUSTER
    SLOTS`` on the first node that answers says. Nodes learnt from an answer join the list to ask,
    so the URL's few nodes need not stay up."""

    def __init__(self, topology: Topology, timeout_s: float, key: str) -> None:
        super().__init__()
        self.slot = key_slot(key.encode())
        self._nodes: list[Address] = list(topology.nodes)
        self._kwargs = _lookup_kwargs(timeout_s, topology.username, topology.password)

    async def _discover(self) -> Address:
        failures = []
        for host, port in list(self._nodes):
            client = Redis(host=host, port=port, **self._kwargs)
            try:
                ranges = await client.execute_command("CLUSTER", "SLOTS")  # type: ignore[no-untyped-call]
            except (RedisError, OSError) as exc:
                failures.append(f"{host}:{port}: {exc}")
                continue
            finally:
                await client.aclose()
            master = None
            for start, end, *nodes in cast(list[list[Any]], ranges):
                addresses = [(str(n[0]) or host, int(n[1])) for n in nodes]  # "" is the node asked
                for address in addresses:
                    if address not in self._nodes:
                        self._nodes.append(address)
                if int(start) <= self.slot <= int(end) and addresses:
                    master = addresses[0]
            if master is not None:
                return master
            failures.append(f"{host}:{port}: slot {self.slot} is not served")
        raise RedisConnectionError(
            f"no cluster node knows the master of slot {self.slot}: {'; '.join(failures)}"
        )


class _LocatedConnection(Connection):
    """A TCP connection to wherever its :class:`Locator` says the primary is now."""

    def __init__(self, *, locator: Locator, **kwargs: Any) -> None:
        self.locator = locator
        super().__init__(**kwargs)

    @property
    def address(self) -> Address:
        return self.host, self.port

    async def _connect(self) -> None:
        self.host, self.port = await self.locator.locate()
        try:
            await super()._connect()  # type: ignore[no-untyped-call]
        except BaseException:
            self.locator.forget(self.address)
            raise

    async def send_packed_command(self, command: Any, check_health: bool = True) -> None:
        try:
            await super().send_packed_command(command, check_health)
        except (RedisConnectionError, RedisTimeoutError):
            self.locator.forget(self.address)
            raise

    async def read_response(self, *args: Any, **kwargs: Any) -> Any:
        try:
            return await super().read_response(*args, **kwargs)
        except AskError as exc:  # MOVED (or ASK): the slot is another master's now; nothing ran
            self.locator.redirect(exc.node_addr)
            await self.disconnect()
            raise RedisConnectionError(f"the queue's slot moved to {exc.host}:{exc.port}") from exc
        except ReadOnlyError as exc:  # the primary was demoted; the write did not run
            self.locator.forget(self.address)
            await self.disconnect()
            raise RedisConnectionError("the primary has become a replica") from exc
        except (RedisConnectionError, RedisTimeoutError):
            self.locator.forget(self.address)
            raise

    def should_reconnect(self) -> bool:
        # Asked as the connection goes back to the pool: one to a former primary is closed then.
        current = self.locator.current
        moved = self.is_connected and current is not None and current != self.address
        return bool(super().should_reconnect() or moved)  # type: ignore[no-untyped-call]


def make_locator(topology: Topology, timeout_s: float, key: str) -> Locator | None:
    """The locator a topology needs (None for a single Redis); ``key`` names the queue's slot."""
    if topology.kind is Kind.SENTINEL:
        return SentinelLocator(topology, timeout_s)
    if topology.kind is Kind.CLUSTER:
        return ClusterLocator(topology, timeout_s, key)
    return None


def make_pool(
    topology: Topology | str, locator: Locator | None = None, **kwargs: Any
) -> BlockingConnectionPool:
    """A ``BlockingConnectionPool`` whose connections pack commands with hiredis: to a single
    Redis's URL, or wherever ``locator`` finds the primary."""
    if isinstance(topology, str):
        url = topology
    elif topology.kind is Kind.SINGLE:
        url = topology.url
    else:
        if locator is None:
            raise ValueError(f"{topology.describe()} needs a locator")
        kwargs.update(db=topology.db, username=topology.username, password=topology.password)
        return BlockingConnectionPool(
            connection_class=_packing(_LocatedConnection), locator=locator, **kwargs
        )
    pool = BlockingConnectionPool.from_url(url, **kwargs)
    pool.connection_class = _packing(pool.connection_class)  # TCP, TLS or Unix socket, as the URL says
    return pool


# --- scripts --------------------------------------------------------------------------------------


class Script:
    """One script of the broker: a function of its library (``redis_library``), called by FCALL; the
    library is loaded again when the server lacks it (a restart, a new master)."""

    def __init__(self, name: str, library: Library) -> None:
        self.name = name
        self.library = library
        self.function = library.functions[name]

    def command(self, keys: Sequence[str], args: Sequence[str | int | float]) -> tuple[Any, ...]:
        return ("FCALL", self.function, len(keys), *keys, *args)


# --- auto-pipelining ------------------------------------------------------------------------------


@dataclass(eq=False)
class _Entry:
    command: tuple[Any, ...]
    script: Script | None
    future: asyncio.Future[Any]
    orphan: Callable[[Any], None] | None
    durable: bool = False
    #: a transaction: these commands between MULTI and EXEC instead of ``command``; the reply is EXEC's
    transaction: tuple[tuple[Any, ...], ...] | None = None
    #: loop time it was submitted, kept for the first entry of a pipeline only (its deadline's start)
    since: float = 0.0

    def commands(self) -> list[tuple[Any, ...]]:
        if self.transaction is None:
            return [self.command]
        return [("MULTI",), *self.transaction, ("EXEC",)]

    def succeed(self, reply: Any) -> None:
        if not self.future.done():
            self.future.set_result(reply)
        elif self.orphan is not None:  # the caller left; the command ran anyway
            self.orphan(reply)

    def fail(self, exc: BaseException) -> None:
        if not self.future.done():
            self.future.set_exception(exc)


class Batcher:
    """Sends the commands submitted in one event-loop turn as one pipeline (not a transaction).

    Every command submitted is sent, even if its caller is cancelled meanwhile: a state change is
    applied whole or, if Redis fails, not at all, never cut off by a client that hung up. A caller
    that wants the reply of a command it gave up on (a claim) passes ``orphan``.

    A ``durable`` command, when ``durability`` asks for replicas, is answered only once that many
    have it: a pipeline with one ends in ``WAIT`` (on the same connection, so it covers every write
    before it), and when fewer replicas confirm in time its durable commands fail with
    :class:`BrokerUnavailable`; they did run on the primary, which may yet lose them.

    At most ``max_inflight`` pipelines without ``WAIT`` are in flight at once; what is submitted
    meanwhile waits and goes out, all of it, as the next pipeline when one comes back (or at once
    when ``MAX_BATCH`` commands have piled up: a pipeline is never longer than that). Redis runs
    one command at a time whatever the connection, so a second pipeline sent sooner is not answered
    sooner; sent later, it carries the commands of every caller woken meanwhile, and a pipeline of
    one command costs the client about ten times what a command in a deep one does
    (docs/benchmarks/broker.md, the tenth round). A pipeline that waits for replicas holds no
    place (``WAIT`` may take its whole timeout). Every command's deadline runs from when the first
    command of its pipeline was submitted, so that one held back still fails within the timeout of
    an unreachable Redis.
    """

    def __init__(
        self,
        client: Redis,
        timeout: float,
        durability: Durability | None = None,
        max_inflight: int = MAX_INFLIGHT,
    ) -> None:
        if max_inflight < 1:
            raise ValueError("max_inflight must be at least 1")
        self._client = client
        self._timeout = timeout
        self._durability = durability if durability is not None and durability.on else None
        self._max_inflight = max_inflight
        self._pending: list[_Entry] = []
        self._scheduled = False
        self._inflight: set[asyncio.Task[None]] = set()
        self._open = 0  # pipelines in flight that hold a place (no WAIT)
        self._held: list[AbstractConnection] = []  # connections kept between pipelines (_connection)
        # Kept connections stay checked out of the pool, which the client's other callers share
        # (direct commands, a library's load): at least one is left to them, so that a small pool
        # is not held idle by this batcher while they wait for its timeout.
        size = getattr(client.connection_pool, "max_connections", None)
        self._keep = max_inflight if not isinstance(size, int) else max(0, min(max_inflight, size - 1))
        #: pipelines and commands sent (what the benchmark reports as the pipelines' depth)
        self.pipelines = 0
        self.commands = 0

    def submit(
        self,
        command: tuple[Any, ...],
        *,
        script: Script | None = None,
        orphan: Callable[[Any], None] | None = None,
        durable: bool = False,
    ) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._add(_Entry(command, script, future, orphan, durable), loop)
        return future

    def _add(self, entry: _Entry, loop: asyncio.AbstractEventLoop) -> None:
        if not self._pending:
            entry.since = loop.time()
        self._pending.append(entry)
        if len(self._pending) >= MAX_BATCH:
            self._flush()
        elif not self._scheduled and self._open < self._max_inflight:
            self._scheduled = True
            loop.call_soon(self._flush)
        # else a pipeline in flight sends these as it comes back (_landed)

    async def transaction(self, *commands: tuple[Any, ...]) -> Any:
        """Run ``commands`` as one MULTI/EXEC in the next pipeline (on its connection, so nothing
        else comes between); EXEC's replies. A command Redis refuses while queuing it (EXECABORT:
        none ran) or one that fails as it runs (the others ran, as Redis does) raises its error, as
        redis-py's pipeline does (for the first, the queued command's own error, not EXEC's
        EXECABORT); an outage raises :class:`BrokerUnavailable`. Cheaper than
        redis-py's transaction pipeline, which costs a connection, a write and a read of its own."""
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._add(_Entry(("EXEC",), None, future, None, transaction=commands), loop)
        try:
            replies = await future
        except (RedisError, OSError) as exc:
            raise translate(exc) from exc
        failed = next((r for r in replies if isinstance(r, BaseException)), None)
        if failed is not None:
            raise translate(failed)
        return replies

    async def call(
        self, command: tuple[Any, ...], *, script: Script | None = None, durable: bool = False
    ) -> Any:
        """Submit and wait; an outage raises :class:`BrokerUnavailable`."""
        try:
            return await self.submit(command, script=script, durable=durable)
        except (RedisError, OSError) as exc:
            raise translate(exc) from exc

    def _flush(self) -> None:
        self._scheduled = False
        batch, self._pending = self._pending, []
        if not batch:
            return
        waits = self._durability is not None and any(e.durable for e in batch)
        if not waits:
            self._open += 1
        task = asyncio.get_running_loop().create_task(self._send(batch), name="redis-pipeline")
        self._inflight.add(task)
        task.add_done_callback(self._inflight.discard)
        if not waits:
            task.add_done_callback(self._landed)
        self.pipelines += 1
        self.commands += len(batch)

    def _landed(self, _task: asyncio.Task[None]) -> None:
        """A pipeline that held a place came back: what waited for it goes out next. Scheduled, not
        sent here, so that the callers its replies woke add theirs first."""
        self._open -= 1
        if self._pending and not self._scheduled:
            self._scheduled = True
            asyncio.get_running_loop().call_soon(self._flush)

    async def _send(self, batch: list[_Entry], retried: bool = False, deadline: float | None = None) -> None:
        """Send ``batch`` and settle its futures, all within one deadline: the command timeout, plus
        the WAIT timeout for a durable batch, from when its first command was submitted, for the
        wait for a place, the round trip, loading scripts a new or restarted primary lacks, and
        sending their commands again."""
        wait = self._durability if any(e.durable for e in batch) else None
        budget = self._timeout + (wait.timeout_s if wait is not None else 0.0)
        if deadline is None:
            deadline = (batch[0].since or asyncio.get_running_loop().time()) + budget
        try:
            async with asyncio.timeout_at(deadline):  # one timer per batch, not one per reply
                replies, short = await self._roundtrip(batch, wait)
        except Exception as exc:  # the connection failed: the whole batch shares the outcome
            if isinstance(exc, TimeoutError):
                exc = RedisTimeoutError(f"no answer within {budget} s")
            for entry in batch:
                entry.fail(exc)
            return
        missing = []
        for entry, reply in zip(batch, replies, strict=True):
            if function_missing(reply) and entry.script is not None and not retried:
                missing.append(entry)
            elif isinstance(reply, BaseException):
                entry.fail(reply)
            elif entry.durable and short is not None:
                entry.fail(short)
            else:
                entry.succeed(reply)
        if missing:  # a restarted or promoted Redis lacks the library: load it, send those again
            try:
                async with asyncio.timeout_at(deadline):
                    for library in {cast(Script, e.script).library for e in missing}:
                        await self._client.execute_command(*library.load_command())  # type: ignore[no-untyped-call]
            except Exception as exc:
                if isinstance(exc, TimeoutError):
                    exc = RedisTimeoutError(f"no answer within {budget} s")
                for entry in missing:
                    entry.fail(exc)
                return
            await self._send(missing, retried=True, deadline=deadline)

    async def _roundtrip(
        self, batch: list[_Entry], wait: Durability | None
    ) -> tuple[list[Any], BrokerUnavailable | None]:
        """One write of every command, then their raw replies (no response callbacks: callers get
        lists as Redis sends them). redis-py's own pipeline costs more than the scripts it carries.
        With ``wait``, the batch ends in ``WAIT``, and the second value is the error its durable
        commands get when fewer replicas than asked confirmed them (None when enough did).

        A connection that turns out dead before any reply came back (Redis restarted) is replaced
        and the batch sent once more: nothing of it can have run on the new server."""
        pool = self._client.connection_pool
        commands = [c for e in batch for c in e.commands()]
        if wait is not None:
            commands.append(("WAIT", wait.replicas, wait.timeout_ms))
        payload = b"".join(hiredis.pack_command(c) for c in commands)
        for attempt in (1, 2):
            conn = await self._connection(attempt == 1)
            replies: list[Any] = []
            kept = False
            try:
                await conn.send_packed_command(payload, check_health=False)
                for entry in batch:
                    reply: Any = None
                    refused: ResponseError | None = None
                    # A transaction's entry answers with EXEC's reply (MULTI's OK and each QUEUED
                    # come first; a command refused while queued makes EXEC fail too).
                    for _ in range(1 if entry.transaction is None else len(entry.transaction) + 2):
                        try:
                            reply = await conn.read_response()
                        except ResponseError as exc:
                            reply = exc
                            refused = refused or exc
                    if refused is not None and refused is not reply and isinstance(reply, ExecAbortError):
                        # EXEC's EXECABORT says only that a queued command was refused: answer with
                        # why, so that a refusal of an outage (CLUSTERDOWN mid-failover, OOM) reads
                        # as one, not as a bug.
                        reply = refused
                    replies.append(reply)
                short = None
                if wait is not None:
                    try:
                        acked: Any = await conn.read_response()
                    except ResponseError as exc:
                        acked = exc
                    short = _short(acked, wait)
                kept = True  # every reply read: the connection is clean
                return replies, short
            except RedisConnectionError:
                await conn.disconnect()
                if replies or attempt == 2:
                    raise
            except BaseException:
                await conn.disconnect()  # a half-read reply must not reach the next caller
                raise
            finally:
                if kept and len(self._held) < self._keep:
                    self._held.append(conn)
                else:
                    await pool.release(conn)
        raise AssertionError("unreachable")

    async def _connection(self, reuse: bool) -> AbstractConnection:
        """A connection for one pipeline: one this batcher kept from an earlier pipeline, else the
        pool's (at most ``_keep`` are kept: two, and never the pool's last). Kept, since the pool's
        checkout and return (a condition, a timeout, a liveness probe, its metrics) cost a
        single-command pipeline about as much as the rest of its round trip
        (docs/benchmarks/broker.md, the tenth round). A kept connection that should reconnect (one
        to a former primary) goes back to the pool, which closes it. A dead one fails at its first
        read; the batch is then sent again on the pool's (``reuse`` False), which probes."""
        pool = self._client.connection_pool
        while reuse and self._held:
            conn = self._held.pop()
            if not conn.should_reconnect():  # type: ignore[no-untyped-call]
                return conn
            await pool.release(conn)
        return cast(AbstractConnection, await pool.get_connection())  # type: ignore[no-untyped-call]

    async def drain(self, timeout: float = 2.0) -> None:
        """Let the pipelines in flight finish (on close)."""
        if self._pending:
            self._flush()
        if self._inflight:
            await asyncio.wait(self._inflight, timeout=timeout)
        held, self._held = self._held, []
        for conn in held:
            await self._client.connection_pool.release(conn)


def _short(acked: Any, wait: Durability) -> BrokerUnavailable | None:
    """None when ``WAIT``'s reply counts enough replicas; else the error the durable writes get."""
    if isinstance(acked, int) and acked >= wait.replicas:
        return None
    if isinstance(acked, BaseException):
        return BrokerUnavailable(f"Redis could not confirm the write on a replica: {acked}")
    return BrokerUnavailable(
        f"the write reached {acked} of the {wait.replicas} replica(s) it needs within {wait.timeout_ms} ms"
    )
