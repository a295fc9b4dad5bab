"""How the Redis broker talks to Redis: connection pools, its Lua scripts, and auto-pipelining.

On a small machine the client's work per command (redis-py's asyncio call path, a system call
each way) costs more than the scripts themselves. So commands issued by concurrent callers in one
event-loop turn go out as one pipeline (ioredis calls this auto-pipelining), and commands are packed
by hiredis in C rather than by redis-py's Python loop.
"""

from __future__ import annotations

import asyncio
import hashlib
import logging
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from importlib import resources
from typing import Any, cast

import hiredis
from redis.asyncio import BlockingConnectionPool, Redis
from redis.asyncio.connection import AbstractConnection
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import NoScriptError, ReadOnlyError, RedisError, ResponseError, TryAgainError
from redis.exceptions import TimeoutError as RedisTimeoutError

from sluice.broker.base import BrokerUnavailable

log = logging.getLogger(__name__)

#: The most commands one pipeline carries; more wait for the next turn of the event loop.
MAX_BATCH = 512

# Errors that say "Redis cannot take this now" rather than "this request is wrong": OOM under
# noeviction, MISCONF (persistence failing), a replica that lost its master, a cluster mid-failover.
_UNAVAILABLE_CODES = ("OOM", "MISCONF", "NOREPLICAS", "MASTERDOWN", "CLUSTERDOWN", "LOADING", "BUSY")


def unavailable(exc: BaseException) -> bool:
    if isinstance(exc, RedisConnectionError | RedisTimeoutError | ReadOnlyError | TryAgainError | OSError):
        return True
    return isinstance(exc, ResponseError) and str(exc).split(" ", 1)[0] in _UNAVAILABLE_CODES


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


def make_pool(url: str, **kwargs: Any) -> BlockingConnectionPool:
    """A ``BlockingConnectionPool`` for ``url`` whose connections pack commands with hiredis."""
    pool = BlockingConnectionPool.from_url(url, **kwargs)
    base = pool.connection_class  # TCP, TLS or Unix socket, as the URL says
    fast = _PACKING.get(base)
    if fast is None:
        fast = _PACKING[base] = type(f"Hiredis{base.__name__}", (_HiredisPacking, base), {})
    pool.connection_class = fast
    return pool


# --- scripts --------------------------------------------------------------------------------------


def load_source(name: str) -> str:
    """A script's text with its ``-- @include <file>`` lines replaced by those files."""
    folder = resources.files("sluice") / "lua"
    lines = []
    for line in (folder / f"{name}.lua").read_text(encoding="utf-8").splitlines():
        if line.startswith("-- @include "):
            lines.append((folder / line.removeprefix("-- @include ").strip()).read_text(encoding="utf-8"))
        else:
            lines.append(line)
    return "\n".join(lines) + "\n"


class Script:
    """A Lua script run by SHA (EVALSHA), loaded again when the server does not know it (a restart)."""

    def __init__(self, name: str) -> None:
        self.name = name
        self.source = load_source(name)
        self.sha = hashlib.sha1(self.source.encode()).hexdigest()

    def command(self, keys: Sequence[str], args: Sequence[str | int | float]) -> tuple[Any, ...]:
        return ("EVALSHA", self.sha, len(keys), *keys, *args)


# --- auto-pipelining ------------------------------------------------------------------------------


@dataclass(eq=False)
class _Entry:
    command: tuple[Any, ...]
    script: Script | None
    future: asyncio.Future[Any]
    orphan: Callable[[Any], None] | None

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
    """

    def __init__(self, client: Redis, timeout: float) -> None:
        self._client = client
        self._timeout = timeout
        self._pending: list[_Entry] = []
        self._scheduled = False
        self._inflight: set[asyncio.Task[None]] = set()

    def submit(
        self,
        command: tuple[Any, ...],
        *,
        script: Script | None = None,
        orphan: Callable[[Any], None] | None = None,
    ) -> asyncio.Future[Any]:
        loop = asyncio.get_running_loop()
        future: asyncio.Future[Any] = loop.create_future()
        self._pending.append(_Entry(command, script, future, orphan))
        if len(self._pending) >= MAX_BATCH:
            self._flush()
        elif not self._scheduled:
            self._scheduled = True
            loop.call_soon(self._flush)
        return future

    async def call(self, command: tuple[Any, ...], *, script: Script | None = None) -> Any:
        """Submit and wait; an outage raises :class:`BrokerUnavailable`."""
        try:
            return await self.submit(command, script=script)
        except (RedisError, OSError) as exc:
            raise translate(exc) from exc

    def _flush(self) -> None:
        self._scheduled = False
        batch, self._pending = self._pending, []
        if batch:
            task = asyncio.get_running_loop().create_task(self._send(batch), name="redis-pipeline")
            self._inflight.add(task)
            task.add_done_callback(self._inflight.discard)

    async def _send(self, batch: list[_Entry], retried: bool = False) -> None:
        try:
            async with asyncio.timeout(self._timeout):  # one timer per batch, not one per reply
                replies = await self._roundtrip(batch)
        except Exception as exc:  # the connection failed: the whole batch shares the outcome
            if isinstance(exc, TimeoutError):
                exc = RedisTimeoutError(f"no answer within {self._timeout} s")
            for entry in batch:
                entry.fail(exc)
            return
        missing = []
        for entry, reply in zip(batch, replies, strict=True):
            if isinstance(reply, NoScriptError) and entry.script is not None and not retried:
                missing.append(entry)
            elif isinstance(reply, BaseException):
                entry.fail(reply)
            else:
                entry.succeed(reply)
        if missing:  # a restarted Redis forgot the scripts: load them and send those again
            try:
                for script in {cast(Script, e.script) for e in missing}:
                    await self._client.script_load(script.source)
            except Exception as exc:
                for entry in missing:
                    entry.fail(exc)
                return
            await self._send(missing, retried=True)

    async def _roundtrip(self, batch: list[_Entry]) -> list[Any]:
        """One write of every command, then their raw replies (no response callbacks: callers get
        lists as Redis sends them). redis-py's own pipeline costs more than the scripts it carries.

        A connection that turns out dead before any reply came back (Redis restarted) is replaced
        and the batch sent once more: nothing of it can have run on the new server."""
        pool = self._client.connection_pool
        payload = b"".join(hiredis.pack_command(e.command) for e in batch)
        for attempt in (1, 2):
            conn = await pool.get_connection()  # type: ignore[no-untyped-call]
            replies: list[Any] = []
            try:
                await conn.send_packed_command(payload, check_health=False)
                for _ in batch:
                    try:
                        replies.append(await conn.read_response())
                    except ResponseError as exc:
                        replies.append(exc)
                return replies
            except RedisConnectionError:
                await conn.disconnect()
                if replies or attempt == 2:
                    raise
            except BaseException:
                await conn.disconnect()  # a half-read reply must not reach the next caller
                raise
            finally:
                await pool.release(conn)
        raise AssertionError("unreachable")

    async def drain(self, timeout: float = 2.0) -> None:
        """Let the pipelines in flight finish (on close)."""
        if self._pending:
            self._flush()
        if self._inflight:
            await asyncio.wait(self._inflight, timeout=timeout)
