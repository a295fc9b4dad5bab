"""token_events --memory: every job's every token is published, each ended job is packed once the
given number of tokens has passed, and the collector is left as it was found."""

from __future__ import annotations

import asyncio
import gc
import marshal

import pytest

from sluice.bench import token_events
from sluice.broker.base import BrokerSettings
from sluice.broker.memory import MemoryBroker


def test_the_memory_streams_publish_every_token_and_pack_the_ended_jobs(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    brokers: list[MemoryBroker] = []

    def kept_broker(settings: BrokerSettings) -> MemoryBroker:
        brokers.append(MemoryBroker(settings))
        return brokers[-1]

    monkeypatch.setattr(token_events, "MemoryBroker", kept_broker)
    threshold = gc.get_threshold()
    published, passes, us = asyncio.run(token_events.memory_streams(jobs=10, tokens=8, live=4, keep=20))
    assert published == 10 * 8 and len(passes) == 3 and us > 0
    (broker,) = brokers
    records = list(broker._records.values())
    assert len(records) == 10
    # ended at tokens 8*k..: those ended 20 or more tokens before the last were packed, the rest not
    packed = [rec for rec in records if rec.packed is not None]
    assert 0 < len(packed) < 10
    for rec in records:
        tokens = [data for type, data in rec.since(0) if type.value == "token"]
        assert [t["choices"][0]["delta"]["content"] for t in tokens] == [f" w{i}" for i in range(8)]
    assert all(isinstance(marshal.loads(rec.packed), list) for rec in packed)  # type: ignore[arg-type]
    assert gc.get_freeze_count() == 0 and gc.get_threshold() == threshold  # the collector put back
