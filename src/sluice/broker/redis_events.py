"""The Redis broker's long-lived readers: one multiplexed ``XREAD BLOCK`` for every job stream a
process follows, and one pub/sub subscription for abort signals.

Each runs on its own connection without a socket timeout (a block longer than the socket timeout
ends in a spurious TimeoutError, redis-py#2807) but with an asyncio timeout above its block time, so
that a connection that died silently is noticed; each reconnects by itself, to wherever the
primary is after a failover (the connection asks its locator, ``redis_pipe``).
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import cast

from redis.asyncio import Redis
from redis.exceptions import ClusterDownError, MasterDownError, ReadOnlyError, TryAgainError
from redis.exceptions import ConnectionError as RedisConnectionError
from redis.exceptions import TimeoutError as RedisTimeoutError
from redis.typing import KeyT, StreamIdT

from sluice.broker.base import Event, EventType
from sluice.broker.outage import OutageLog
from sluice.broker.redis_keys import EVENT_DATA, EVENT_TYPE, WAKE_FIELD
from sluice.broker.signal import Signal

log = logging.getLogger(__name__)

#: How long one blocking read waits on the server (BullMQ caps its blocks at 10 s for the same reason:
#: a short block notices a dead connection soon).
READ_BLOCK_S = 5.0
#: Entries read per stream and call; a stream with more is simply read again at once.
READ_COUNT = 500
#: The wake-up stream of a reader only needs its newest entry.
WAKE_TTL_MS = 60_000

# What a lost connection or a failover looks like (a connection to a primary that was demoted or
# whose slot moved is closed and raises RedisConnectionError, see redis_pipe): read again.
_TRANSIENT = (
    RedisConnectionError,
    RedisTimeoutError,
    OSError,
    TimeoutError,
    ClusterDownError,
    MasterDownError,
    TryAgainError,
    ReadOnlyError,
)


def check_cancelled() -> None:
    """Re-raise a cancellation that redis-py swallowed.

    redis-py sends every command through ``asyncio.wait_for``, which on Python 3.11 returns the
    result instead of raising when the cancel lands as the send completes (CPython gh-86296): the
    command returns normally and the task runs on, so a worker's ``stop()`` or a timeout would be
    lost. Called after every Redis await of a task that may be cancelled.
    """
    task = asyncio.current_task()
    if task is not None and task.cancelling():
        raise asyncio.CancelledError


async def stop_task(task: asyncio.Task[None] | None) -> None:
    """Cancel a background task and wait for it, cancelling again if a cancel got swallowed."""
    while task is not None and not task.done():
        task.cancel()
        await asyncio.wait({task}, timeout=0.1)
    if task is not None and not task.cancelled() and task.exception() is not None:
        log.error("background task %s failed", task.get_name(), exc_info=task.exception())


def decode_event(entry_id: str, fields: dict[str, str]) -> Event:
    """A stream entry ``0-<seq>`` with its type and its JSON data (empty for a terminal event, whose
    data the reader builds from the job's record)."""
    data = fields[EVENT_DATA]
    return Event(
        int(entry_id.rpartition("-")[2]), EventType(fields[EVENT_TYPE]), json.loads(data) if data else {}
    )


@dataclass(eq=False)
class Subscription:
    """One reader's interest in one stream: events after ``last`` arrive in ``queue``."""

    key: str
    last: int
    queue: asyncio.Queue[Event] = field(default_factory=asyncio.Queue)


class StreamHub:
    """Follows many job streams with one blocking XREAD at a time.

    Readers register a :class:`Subscription`; the hub's task reads every registered stream from the
    lowest position any of its readers has seen and hands each reader the entries after its own. A
    reader that joins while the read blocks interrupts it by appending to the hub's private wake-up
    stream, which the read always includes.

    Args:
        reader: a client with its own connection and no socket timeout (see ``RedisBroker``).
        commands: the command client, for the wake-up writes.
        wake_key: this hub's wake-up stream (hash-tagged like every key of the queue).
    """

    def __init__(self, reader: Redis, commands: Redis, wake_key: str) -> None:
        self._reader = reader
        self._commands = commands
        self._wake_key = wake_key
        self._wake_id = "0-0"
        self._subs: dict[str, set[Subscription]] = {}
        self._has_subs = asyncio.Event()
        self._blocking = False
        self._woken = False
        self._task: asyncio.Task[None] | None = None

    @contextlib.asynccontextmanager
    async def subscribe(self, key: str, after: int) -> AsyncIterator[Subscription]:
        sub = Subscription(key, after)
        self._subs.setdefault(key, set()).add(sub)
        self._has_subs.set()
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="sluice-redis-stream-hub")
        elif self._blocking and not self._woken:
            # The running read does not include this stream yet.
            self._woken = True
            with contextlib.suppress(*_TRANSIENT):
                async with asyncio.timeout(2.0), self._commands.pipeline(transaction=False) as pipe:
                    pipe.xadd(self._wake_key, {WAKE_FIELD: "1"}, maxlen=1, approximate=False)
                    pipe.pexpire(self._wake_key, WAKE_TTL_MS)
                    await pipe.execute()
            check_cancelled()
        try:
            yield sub
        finally:
            subs = self._subs.get(key)
            if subs is not None:
                subs.discard(sub)
                if not subs:
                    del self._subs[key]

    async def close(self) -> None:
        await stop_task(self._task)
        self._task = None

    async def _run(self) -> None:
        backoff = 0.05
        reads = OutageLog(log, "event stream reads", _TRANSIENT)
        while True:
            if not self._subs:
                self._has_subs.clear()
                await self._has_subs.wait()
                continue
            streams: dict[KeyT, StreamIdT] = {self._wake_key: self._wake_id}
            for key, subs in self._subs.items():
                streams[key] = f"0-{min(s.last for s in subs)}"
            self._blocking, self._woken = True, False
            try:
                async with asyncio.timeout(READ_BLOCK_S + 5.0):  # a connection that died silently
                    reply = cast(
                        list[tuple[str, list[tuple[str, dict[str, str]]]]] | None,
                        await self._reader.xread(streams, count=READ_COUNT, block=int(READ_BLOCK_S * 1000)),
                    )
                check_cancelled()
            except _TRANSIENT as exc:
                reads.failed(exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
                continue
            finally:
                self._blocking = False
            backoff = 0.05
            reads.ok()
            for key, entries in reply or []:
                if key == self._wake_key:
                    self._wake_id = entries[-1][0]
                    continue
                events = [decode_event(entry_id, fields) for entry_id, fields in entries]
                for sub in list(self._subs.get(key, ())):
                    for event in events:
                        if event.id > sub.last:
                            sub.last = event.id
                            sub.queue.put_nowait(event)


class AbortListener:
    """Wakes waiters when any running job of the queue is cancelled (pub/sub on the abort channel).

    Messages published while the subscription is down are lost, so every (re)subscription wakes
    the waiters once: they heartbeat, and the heartbeat tells them what was cancelled.
    """

    def __init__(self, client: Redis, channel: str) -> None:
        self._client = client
        self._channel = channel
        self._signal = Signal()
        self._ready = asyncio.Event()
        self._task: asyncio.Task[None] | None = None

    async def wait(self, timeout: float) -> None:
        if self._task is None or self._task.done():
            self._task = asyncio.create_task(self._run(), name="sluice-redis-abort-listener")
        signal = self._signal.current()
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(timeout):
                # Only a subscribed listener can promise to hear the next cancel.
                await self._ready.wait()
                await signal.wait()

    async def close(self) -> None:
        await stop_task(self._task)
        self._task = None

    async def _run(self) -> None:
        backoff = 0.05
        first = True
        channel = OutageLog(log, "abort channel", _TRANSIENT)
        while True:
            pubsub = self._client.pubsub()
            try:
                await pubsub.subscribe(self._channel)
                check_cancelled()
                self._ready.set()
                if not first:
                    self._signal.notify()
                first = False
                backoff = 0.05
                channel.ok()
                while True:
                    message = await pubsub.get_message(ignore_subscribe_messages=True, timeout=READ_BLOCK_S)
                    check_cancelled()
                    if message is not None:
                        self._signal.notify()
            except _TRANSIENT as exc:
                self._ready.clear()
                channel.failed(exc)
                await asyncio.sleep(backoff)
                backoff = min(backoff * 2, 2.0)
            finally:
                with contextlib.suppress(*_TRANSIENT):
                    await pubsub.aclose()  # type: ignore[no-untyped-call, unused-ignore]
