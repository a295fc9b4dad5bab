"""The memory broker's record of one job: the job, its event stream (live objects while it runs,
packed once it has ended) and the readers waiting on it; and its records of a tenant and a lease."""

from __future__ import annotations

import asyncio
import json
import marshal
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

from sluice.broker.base import EventType
from sluice.core.job import Job
from sluice.core.ratelimit import TenantLimiter

# Also _Tenant and _Lease below: the memory broker's own, kept here for memory.py's length (the Lua
# scripts' comments name _Tenant as the memory broker's).
__all__ = ["Follower", "JobRecord", "kept", "pack_events", "unpack_events"]

#: What the broker calls with each event of a followed job as it is published (its id, its type,
#: its data): True to be called with the next one too, False to stop (see ``MemoryBroker.follow``).
Follower = Callable[[int, EventType, Any], bool]


@dataclass(slots=True)
class JobRecord:
    """A job and its event stream.

    The events stay the objects they were published as while the job runs and shortly after it
    ends, so that the readers that follow it live (the relay to a streaming client) take them as
    they are, with nothing encoded or decoded in between: Redis needs bytes, one process does not.
    Readers share them and must not change them. A token event is the exception: it is kept as
    marshal's bytes from its publish (:func:`kept`; its follower, the relay, is handed the dict
    itself), since a stream's tokens otherwise sit in the young generation as four containers
    each (the entry's tuple, the event, its choices list, the choice), about half of what each
    young collection walked in a saturated gateway streaming 64-token answers, which spent 5-13 %
    of its CPU in the collector (0.4-0.6 % with the tokens kept as bytes); a token a reader of
    :meth:`since` waits for as it is published stays the object (:func:`kept`), and any other
    reader but the follower gets each token decoded afresh. A second after the end they are packed into one
    ``marshal`` string of bytes (:meth:`pack`), all but the terminal event: bytes are invisible to
    the garbage collector, and a busy gateway holds hundreds of thousands of token events for the
    result TTL (as dicts they made GC pauses of 0.2 s). marshal rather than JSON: it packs a
    64-token stream's events in 12 µs against json.dumps' 74 (the pack was 5 % of a streamed
    request's gateway CPU), and gives the values back as they were published; events that marshal
    cannot take (a ``str`` subclass such as an enum member) are packed as JSON, as all were
    before. The terminal event stays an object: its result is the job's own (``job.result``), kept
    once.
    """

    job: Job
    #: the events from index ``packed_count`` on: (type, data) as published, a token as the bytes
    #: :func:`kept` made of its data (:meth:`since` gives every one back as (type, data))
    events: list[tuple[EventType, Any] | bytes] = field(default_factory=list)
    #: the events before ``packed_count``, as one list of [type, data]: marshal's bytes, or a JSON
    #: text where marshal could not take them (:func:`pack_events`); None until packed
    packed: bytes | str | None = None
    packed_count: int = 0
    #: whether the terminal event was published
    ended_stream: bool = False
    #: the live readers waiting for the next event, each on a future of its own: woken by the
    #: next event (:meth:`notify`); a reader that stopped waiting (cancelled, timed out) leaves its
    #: future done, and the next event drops it
    readers: list[asyncio.Future[None]] = field(default_factory=list)
    #: the one reader the broker calls with each event as it is published, in the publisher's own
    #: turn (``MemoryBroker.follow``): no wake-up of a task per token; None: none follows
    follower: Follower | None = None
    #: the waiters for the job's end alone (:meth:`end`), a future each, as ``readers``: they do
    #: not wake for every token; None while none waits (most jobs' case but one)
    enders: list[asyncio.Future[None]] | None = None
    #: the buckets the job was charged to (``TenantLimits.bucket_id`` of its key inside its
    #: tenant); None when it came with no limits
    bucket: str | None = None
    #: the model's running jobs just after this one started, itself included (the drain rate
    #: learns from it how a job slows as the batch fills; Redis keeps it in the job's ``rb``)
    running_at_start: int = 0

    def next_event(self) -> asyncio.Future[None]:
        """A future the next event sets. A bare future rather than an ``asyncio.Event`` per event
        (what :class:`~sluice.broker.signal.Signal` makes): a token's wake-up is on every
        streamed token's path, and the Event, its ``wait`` coroutine and its own future cost more
        than the future alone."""
        future = asyncio.get_running_loop().create_future()
        self.readers.append(future)
        return future

    def notify(self) -> None:
        readers, self.readers = self.readers, []
        for future in readers:
            if not future.done():
                future.set_result(None)

    def end(self) -> asyncio.Future[None]:
        """A future the job's end sets (:meth:`notify_end`). One a waiter, as :meth:`next_event`
        (a shared one would be cancelled with the first waiter that gives up), rather than a
        Signal's ``asyncio.Event``, its ``wait`` coroutine and a future: every short request
        waits so once. Waiters that gave up (a long poll timed out) leave a done future, dropped
        once a few have gathered."""
        future = asyncio.get_running_loop().create_future()
        enders = self.enders
        if enders is None:
            self.enders = [future]
        else:
            if len(enders) >= 8:
                enders[:] = [f for f in enders if not f.done()]
            enders.append(future)
        return future

    def notify_end(self) -> None:
        """Wake every waiter for the job's end (the broker's settlement calls it once, after the
        terminal event); a waiter that gave up has a done future, left as it is."""
        enders, self.enders = self.enders, None
        if enders is not None:
            for future in enders:
                if not future.done():
                    future.set_result(None)

    @property
    def count(self) -> int:
        return self.packed_count + len(self.events)

    def since(self, start: int) -> list[tuple[EventType, Any]]:
        """The events from index ``start`` (0-based) on."""
        if start >= self.packed_count:
            return [_live(e) for e in self.events[start - self.packed_count :]]
        assert self.packed is not None
        old = [(EventType(t), _data(d)) for t, d in unpack_events(self.packed)[start:]]
        return old + [_live(e) for e in self.events]

    def pack(self) -> None:
        """Pack every event but the terminal one (see the class)."""
        keep = 1 if self.ended_stream else 0
        fresh = self.events[: len(self.events) - keep]
        if not fresh:
            return
        old = unpack_events(self.packed) if self.packed is not None else []
        # a token's bytes go in as they are (read back by _data), not decoded to be encoded again
        self.packed = pack_events([*old, *[_packed(e) for e in fresh]])
        self.packed_count += len(fresh)
        self.events = self.events[len(fresh) :]


#: each event type's value, looked up rather than read through the enum's property per event
_VALUE = {t: t.value for t in EventType}
_TOKEN_TYPE = EventType.TOKEN
_TOKEN = _TOKEN_TYPE.value


def kept(type: EventType, data: Any, readers: list[asyncio.Future[None]]) -> tuple[EventType, Any] | bytes:
    """How a published event is kept in :attr:`JobRecord.events`: a token's data as marshal's
    bytes (no container for the collector to walk; see the class), unless a reader of ``events``
    waits for it (``readers``, the record's: a stream read through ``events``, one whose key is
    checked as it goes, reads each token as it comes, and would decode each, 13 k instructions
    against the 7.5 k of its encode); any other event, and a token marshal cannot take (a ``str``
    subclass, nesting past marshal's depth), as (type, data)."""
    if type is _TOKEN_TYPE and not readers:
        try:
            return marshal.dumps(data)
        except ValueError:
            pass
    return (type, data)


def _live(entry: tuple[EventType, Any] | bytes) -> tuple[EventType, Any]:
    """A kept event as (type, data) (a token's data decoded afresh: readers get equal values)."""
    if isinstance(entry, bytes):
        return (_TOKEN_TYPE, marshal.loads(entry))
    return entry


def _packed(entry: tuple[EventType, Any] | bytes) -> list[Any]:
    """A kept event as :func:`pack_events` takes it: [type's value, data], a token's bytes as they are."""
    if isinstance(entry, bytes):
        return [_TOKEN, entry]
    return [_VALUE[entry[0]], entry[1]]


def _data(data: Any) -> Any:
    """A packed event's data: a token's bytes decoded (event data is otherwise never bytes)."""
    return marshal.loads(data) if data.__class__ is bytes else data


def pack_events(events: list[list[Any]]) -> bytes | str:
    """``events`` as marshal's bytes, or as JSON where marshal cannot take some value in them."""
    try:
        return marshal.dumps(events)
    except ValueError:  # a subclass of a builtin type (an enum member): JSON takes it as its value
        # JSON has no bytes: a token kept as marshal's goes as its data
        return json.dumps([[t, _data(d)] for t, d in events], separators=(",", ":"))


def unpack_events(packed: bytes | str) -> list[list[Any]]:
    value: list[list[Any]] = marshal.loads(packed) if isinstance(packed, bytes) else json.loads(packed)
    return value


@dataclass
class _Tenant:
    """The memory broker's record of a tenant: its jobs and its keys' buckets (admit.lua keeps the
    same in the tenant's hash)."""

    #: the tenant's concurrency cap: ``TenantLimits.max_concurrent`` of the key that sent its latest job
    #: (set only by ``MemoryBroker._key_limiter``, which with ``_move`` keeps the set of the tenants
    #: at their cap, ``MemoryBroker._at_cap``)
    max_concurrent: int | None = None
    #: its jobs queued and running, over every model
    queued: int = 0
    running: int = 0
    #: each key's buckets, by ``TenantLimits.bucket_id``; keys without buckets have no entry
    limiters: dict[str, TenantLimiter] = field(default_factory=dict)

    @property
    def idle(self) -> bool:
        # Nothing to remember: no jobs and no buckets whose levels matter.
        return not (self.queued or self.running or self.limiters)

    @property
    def held_back(self) -> bool:
        """Whether some of its queued jobs wait for its concurrency cap: more jobs than the cap lets
        run (admit.lua keeps these tenants in the capped set)."""
        cap = self.max_concurrent
        return cap is not None and self.queued + self.running > cap


@dataclass
class _Lease:
    """A running job's lease: the worker that holds it, and when it runs out."""

    worker_id: str
    expires: float
