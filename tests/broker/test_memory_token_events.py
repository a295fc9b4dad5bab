"""The memory broker keeps a token event as marshal's bytes from its publish (memory_record.kept),
out of the garbage collector's walks, while its follower is handed the published dict itself; every
reader, before the pack, after it and across it, reads the events as they were published."""

from __future__ import annotations

import asyncio
import enum
import gc
from typing import Any

import pytest

from sluice.bench.broker_cycles import settings
from sluice.broker import memory
from sluice.broker.base import EventType
from sluice.broker.memory import MemoryBroker
from sluice.core.job import JobState
from tests.broker.test_memory_follow import running_job
from tests.helpers import wait_until


class _Kind(enum.StrEnum):
    A = "a"


def token(content: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": content}, "logprobs": None, "finish_reason": None}]}


async def _read(broker: MemoryBroker, job_id: str, after: int = 0) -> list[tuple[int, EventType, Any]]:
    return [(e.id, e.type, e.data) async for e in broker.events(job_id, after, timeout=0)]


async def test_token_events_are_kept_where_the_collector_does_not_walk_them() -> None:
    async with MemoryBroker(settings()) as broker:
        job = await running_job(broker)
        followed: list[Any] = []
        broker.follow(job.id, 2, lambda _id, _type, data: followed.append(data) or True)
        published = [token(str(i)) for i in range(5)]
        for data in published:
            await broker.publish(job.id, EventType.TOKEN, data)
        entries = broker._records[job.id].events
        assert len(entries) == 2 + 5  # queued, started, the tokens
        tracked = [gc.is_tracked(entry) for entry in entries[2:]]
        assert tracked == [False] * 5  # a (type, dict) tuple would be tracked
        # the follower has the published objects themselves, a reader equal values
        assert all(a is b for a, b in zip(followed, published, strict=True))
        read = await _read(broker, job.id)
        assert [(t, d) for _, t, d in read][2:] == [(EventType.TOKEN, d) for d in published]
        assert [i for i, _, _ in read] == list(range(1, 8))


async def test_a_token_marshal_cannot_take_is_kept_as_published() -> None:
    async with MemoryBroker(settings()) as broker:
        job = await running_job(broker)
        odd = {"choices": [{"index": 0, "delta": {"content": _Kind.A}}]}  # a str subclass
        await broker.publish(job.id, EventType.TOKEN, odd)
        entry = broker._records[job.id].events[-1]
        assert entry == (EventType.TOKEN, odd)
        assert (await _read(broker, job.id))[-1] == (3, EventType.TOKEN, odd)


@pytest.mark.parametrize("odd", [False, True])
async def test_events_read_across_the_pack_are_those_published(
    monkeypatch: pytest.MonkeyPatch, odd: bool
) -> None:
    # odd: a token marshal cannot take packs the whole stream as JSON, the tokens kept as bytes too
    monkeypatch.setattr(memory, "PACK_AFTER_S", 0.0)
    async with MemoryBroker(settings()) as broker:
        job = await running_job(broker)
        await broker.publish(job.id, EventType.TOKEN, token("a"))
        if odd:
            await broker.publish(
                job.id, EventType.TOKEN, {"choices": [{"index": 0, "delta": {"content": _Kind.A}}]}
            )
        await broker.publish(job.id, EventType.TOKEN, token("b"))
        live = await _read(broker, job.id)
        await broker.finish(job.id, "w", JobState.SUCCEEDED, result={"choices": []})
        await broker.maintain()  # packs the ended stream
        rec = broker._records[job.id]
        assert rec.packed is not None and isinstance(rec.packed, str) is odd
        after = await _read(broker, job.id)
        assert after[: len(live)] == live and after[-1][1] is EventType.DONE
        # from inside the packed events, and from the last of them
        assert await _read(broker, job.id, after=3) == after[3:]
        assert await _read(broker, job.id, after=len(live)) == after[len(live) :]
        # a second pack (the terminal event kept out of the first) reads back the same
        rec.pack()
        assert await _read(broker, job.id) == after


async def test_a_token_a_reader_waits_for_is_kept_as_the_object_it_reads() -> None:
    # a stream read through events (its key checked as it goes) would otherwise decode every token
    async with MemoryBroker(settings()) as broker:
        job = await running_job(broker)
        events = broker.events(job.id, 2)
        waiting = asyncio.ensure_future(anext(events))
        await wait_until(lambda: bool(broker._records[job.id].readers))  # the reader waits
        data = token("a")
        await broker.publish(job.id, EventType.TOKEN, data)
        event = await asyncio.wait_for(waiting, 5)
        assert event.type is EventType.TOKEN and event.data is data  # not decoded
        assert broker._records[job.id].events[-1] == (EventType.TOKEN, data)
        # with nobody waiting, the next token is bytes, read back equal
        await broker.publish(job.id, EventType.TOKEN, token("b"))
        assert isinstance(broker._records[job.id].events[-1], bytes)
        assert (await anext(events)).data == token("b")
        await events.aclose()  # type: ignore[attr-defined]


@pytest.mark.parametrize(
    "data",
    [
        token("a"),  # choices alone: kept as the list
        {"system_fingerprint": "fp", **token("b")},  # fields beside: kept whole
        {"choices": []},
        {"choices": {"not": "a list"}},  # kept whole, read back a dict as it was
        {"usage": None, "choices": [{"index": 0}]},
        {},
    ],
)
async def test_a_token_reads_back_as_published_whatever_its_shape(data: dict[str, Any]) -> None:
    async with MemoryBroker(settings()) as broker:
        job = await running_job(broker)
        await broker.publish(job.id, EventType.TOKEN, data)
        assert isinstance(broker._records[job.id].events[-1], bytes)
        (read,) = [d for _, t, d in await _read(broker, job.id) if t is EventType.TOKEN]
        assert read == data and list(read) == list(data)  # the same keys in the same order
