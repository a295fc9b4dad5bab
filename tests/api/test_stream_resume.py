"""A stream reads on from where engine_accepted stopped (sluice.api.relay): the same payloads as a
stream that read every event from the first, without walking the skipped ones again."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from sluice.api.relay import engine_accepted, openai_stream
from sluice.broker.base import Event, EventType
from sluice.core.job import Endpoint, Job


def _token(text: str) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": text}, "finish_reason": None}]}


class _Broker:
    """The three calls the relay makes, over a fixed list of events; records what it was asked."""

    def __init__(self, events: list[Event]) -> None:
        self._events = events
        self.read: list[int] = []

    async def events(self, job_id: str, after: int = 0, timeout: float | None = None) -> AsyncIterator[Event]:
        for event in self._events:
            if event.id > after:
                self.read.append(event.id)
                yield event

    async def get(self, job_id: str) -> None:
        return None

    async def cancel(self, job_id: str) -> None:
        return None


def _job() -> Job:
    return Job(
        id="job_x",
        model="m",
        endpoint=Endpoint.CHAT,
        body={},
        tenant="t",
        priority="normal",
        prompt_tokens=1,
        max_tokens=2,
        created_at=1.0,
        deadline=100.0,
    )


async def _payloads(broker: _Broker, after: int) -> list[str]:
    return [p async for p in openai_stream(broker, _job(), False, after=after)]  # type: ignore[arg-type]


async def test_the_stream_starts_after_what_engine_accepted_skipped() -> None:
    events = [
        Event(1, EventType.QUEUED, {"position": 0}),
        Event(2, EventType.STARTED, {}),
        Event(3, EventType.RETRY, {"attempt": 2}),  # before any token: a stream skips it
        Event(4, EventType.TOKEN, _token("a")),
        Event(5, EventType.TOKEN, _token("b")),
        Event(6, EventType.DONE, {}),
    ]
    broker = _Broker(events)
    skipped = await engine_accepted(broker, _job())  # type: ignore[arg-type]
    assert skipped == 3
    broker.read.clear()
    resumed = await _payloads(broker, skipped)
    assert broker.read == [4, 5, 6]
    assert resumed == await _payloads(_Broker(events), 0)
    assert resumed[-1] == "[DONE]" and len(resumed) == 3


async def test_an_end_without_tokens_is_not_skipped() -> None:
    events = [Event(1, EventType.QUEUED, {}), Event(2, EventType.DONE, {})]
    broker = _Broker(events)
    assert await engine_accepted(broker, _job()) == 1  # type: ignore[arg-type]
    assert await _payloads(broker, 1) == ["[DONE]"]
