"""A spread queue's heartbeat over two shards, one known down (passed over, probed meanwhile,
``RedisCore._skip_down``) and the other failing now for an outage of its own: the heartbeat raises
(it reached no shard), and the second shard's outage is known and logged, as it is when neither
shard was passed over (``RedisCore._shard_failed``), so that the next rounds pass over it too."""

from __future__ import annotations

from typing import Any

import pytest

from sluice.broker.base import BrokerUnavailable
from sluice.broker.redis import RedisBroker
from sluice.broker.redis_shards import Shard, shard_of_model
from tests.broker.brokers import make_settings
from tests.helpers import FakeClock, make_job


def _two_models_on_two_shards() -> tuple[str, str]:
    first = "model-0"
    others = (f"model-{i}" for i in range(1, 1000))
    return first, next(m for m in others if shard_of_model(m) != shard_of_model(first))


async def test_a_heartbeat_left_one_shard_by_a_skip_records_that_shards_outage(
    redis_url: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    clock = FakeClock()
    down_model, failing_model = _two_models_on_two_shards()
    async with RedisBroker(redis_url, make_settings(clock), spread=True) as broker:
        jobs = [make_job(clock, model=m) for m in (down_model, failing_model)]
        for job in jobs:
            await broker.admit(job)
        for job in jobs:
            claimed = await broker.claim("w", [job.model], timeout=0)
            assert claimed is not None and claimed.id == job.id
        known_down, failing = (broker._job_shard(job.id) for job in jobs)
        assert known_down is not failing
        broker._shard_failed(known_down, BrokerUnavailable("its master hangs"))
        call = broker._call

        async def failing_heartbeat(name: str, keys: Any, args: Any, shard: Shard | None = None) -> Any:
            if name == "heartbeat" and shard is failing:
                raise BrokerUnavailable("its master is failing over")
            return await call(name, keys, args, shard)

        monkeypatch.setattr(broker, "_call", failing_heartbeat)
        with pytest.raises(BrokerUnavailable):
            await broker.heartbeat("w", [job.id for job in jobs])
        assert broker._shard_down(failing)
