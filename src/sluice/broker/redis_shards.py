"""How the Redis broker spreads one queue over a Redis Cluster's masters (docs/redis.md, "Cluster: a
hash tag per model").

A *shard* is one hash tag, so one slot, so one master: the keys of one :class:`QueueKeys`. Every
script is given the keys of one shard and touches that shard only. The *home* shard, tagged with the
queue's name, holds what belongs to the whole queue (API keys, reports, draining backends, open
connections, the tenants' job lists, the worker registry for ``served_models``, the upkeep lock,
the abort channel). With ``spread`` (a cluster, unless its URL says ``spread=none``) each model's
queue, its tenants' state for that model and its jobs' keys live in the shard its name hashes to,
one of :data:`SHARDS`; otherwise (one Redis, Sentinel) every model is in the home shard, and the
layout and behaviour are those of a single slot, as before there were shards.

A job's id names its shard (``job_<shard>.<random>``), so that ``GET /v1/jobs/{id}`` finds the
record with no lookup; an id that names none is looked for in the home shard.
"""

from __future__ import annotations

import zlib
from dataclasses import dataclass, field
from typing import Final

from redis.asyncio import Redis

from sluice.broker.redis_events import StreamHub
from sluice.broker.redis_keys import QueueKeys
from sluice.broker.redis_pipe import Batcher, Locator

#: How many shards a spread queue's models hash to. Bounded, so that an id naming a shard can never
#: make the broker open connections for an unbounded number of them; large, so that two models
#: rarely share one (they may: they then share a master and their tenants' state, which is safe).
SHARDS: Final = 256
#: Separates the queue's name from a shard's number in the shard's hash tag, ``{sluice~2a}``.
SHARD_SEP: Final = "~"
#: The prefix of every job id (``sluice.core.job.new_job_id``).
JOB_PREFIX: Final = "job_"
_HEX = frozenset("0123456789abcdef")


def shard_of_model(model: str) -> int:
    """The shard a model's queue lives in when the queue is spread."""
    return zlib.crc32(model.encode("utf-8", "surrogatepass")) % SHARDS


def shard_queue(queue: str, shard: int) -> str:
    """The hash tag (without braces) of a shard of ``queue``."""
    return f"{queue}{SHARD_SEP}{shard:02x}"


def tag_job_id(job_id: str, shard: int) -> str:
    """``job_<random>`` as the id of a job in ``shard``: ``job_<shard>.<random>`` (the random part
    never has a ``.``: it is URL-safe base64)."""
    return f"{JOB_PREFIX}{shard:02x}.{job_id.removeprefix(JOB_PREFIX)}"


def shard_of_job(job_id: str) -> int | None:
    """The shard a job id names (:func:`tag_job_id`), or None when it names none."""
    if len(job_id) < 8 or not job_id.startswith(JOB_PREFIX) or job_id[6] != ".":
        return None
    digits = job_id[4:6]
    return int(digits, 16) if set(digits) <= _HEX else None


@dataclass(eq=False)
class Shard:
    """One hash tag of the queue and the clients that reach its master.

    Attributes:
        number: the shard's number, None for the home shard.
        keys: its key names (all in its one slot).
        redis: the command client (pipelines, plain commands).
        blocking: the client of the blocking claims and webhook waits.
        reader: the client of the multiplexed stream reader.
        batch: the pipeline that scripts and commands go out in.
        hub: the stream reader of the jobs of this shard (always its own).
        locator: finds its master (its reader's, when not ``owned``) with Sentinel or Cluster; None
            on one Redis.
        owned: whether the command and blocking clients and the pipeline are this shard's own
            (closed with it); without a cluster every shard shares the home shard's, as they all
            reach the one primary.
        announced: whether this process has already recorded the shard in the home shard's set.
    """

    number: int | None
    keys: QueueKeys
    redis: Redis
    blocking: Redis
    reader: Redis
    batch: Batcher
    hub: StreamHub
    locator: Locator | None
    owned: bool
    announced: bool = field(default=False)

    async def aclose(self) -> None:
        """Close its stream reader, and its pools when they are its own (else the home shard's)."""
        await self.hub.close()
        await self.reader.aclose()
        if self.owned:
            await self.batch.drain()
            for client in (self.redis, self.blocking):
                await client.aclose()
        if self.locator is not None:
            await self.locator.aclose()
