"""The Redis broker's upkeep: webhooks awaiting a worker, expired deadlines and results, lost
leases, dead letters. Part of :class:`sluice.broker.redis.RedisBroker`; each of these walks every
shard in use (``redis_shards``), one script call per shard, as each script touches one slot.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Sequence
from typing import Any, cast

from sluice.broker.base import BrokerUnavailable
from sluice.broker.redis_codec import PurgeExpiredReply, ReapReply, to_json
from sluice.broker.redis_core import (
    CALLBACK_BATCH,
    CALLBACK_LEASE_S,
    CLAIM_BLOCK_S,
    EXPIRED,
    SHARD_RETRY_S,
    STREAM_MAXLEN,
    UPKEEP_BATCH,
    WORKER_LOST,
    RedisCore,
)
from sluice.broker.redis_keys import JobField
from sluice.broker.redis_shards import Shard
from sluice.broker.redis_work import WorkMixin

log = logging.getLogger("sluice.broker.redis")


class UpkeepMixin(WorkMixin, RedisCore):
    """Webhooks, upkeep and dead letters."""

    # --- webhooks -----------------------------------------------------------------------------

    supports_callbacks = True

    async def ended_callbacks(self, worker_id: str, timeout: float) -> list[str]:
        loop = asyncio.get_running_loop()
        give_up = loop.time() + timeout
        while True:
            shards = await self._shards_in_use()
            # As a claim: a shard whose master is down is tried again at the next round, and the
            # others are served meanwhile; only a round that reached no shard raises.
            answered: list[Shard] = []
            failed: BrokerUnavailable | None = None
            skipped = self._skip_down(shards)  # none of the only shard: it is tried, and raises
            for shard in shards:
                if shard in skipped:
                    continue  # known down (a hung master costs a timeout a call): probed meanwhile
                k = shard.keys
                try:
                    ids = await self._call(
                        "callbacks",
                        [k.callbacks, k.callbacks_inflight, k.callbacks],
                        ["take", self._now(), repr(CALLBACK_LEASE_S), CALLBACK_BATCH],
                        shard,
                    )
                except BrokerUnavailable as exc:
                    if len(shards) == 1:
                        raise
                    failed = exc
                    self._shard_failed(shard, exc)
                    continue
                if len(shards) > 1:
                    self._shard_answered(shard)
                if ids:
                    return [str(i) for i in ids]
                answered.append(shard)
            if not answered and failed is not None:
                raise failed
            remaining = give_up - loop.time()
            if remaining <= 0:
                return []
            retry = failed is not None or bool(skipped)
            block = min(remaining, SHARD_RETRY_S if retry else CLAIM_BLOCK_S)
            await self._block([(s, [s.keys.callbacks_marker]) for s in answered], block)

    async def ack_callback(self, job_id: str) -> None:
        shard = self._job_shard(job_id)
        k = shard.keys
        await self._call(
            "callbacks", [k.callbacks, k.callbacks_inflight, k.callbacks], ["ack", self._now(), job_id], shard
        )

    async def add_delivery(self, job_id: str, attempt: dict[str, Any]) -> None:
        shard = self._job_shard(job_id)
        k = shard.keys
        for _ in range(10):  # compare and set: another writer is unlikely, but never lost
            before = await shard.batch.call(("HGET", k.job(job_id), JobField.EXTRA))
            if before is None:
                return
            extra = json.loads(before)
            extra.setdefault("deliveries", []).append(attempt)
            keys = [k.callbacks, k.callbacks_inflight, k.job(job_id)]
            reply = await self._call("callbacks", keys, ["extra", self._now(), before, to_json(extra)], shard)
            if int(reply) != 0:
                return
        log.warning("delivery log of %s kept changing; attempt not recorded", job_id)

    # --- upkeep ---------------------------------------------------------------------------------

    async def maintain(self) -> None:
        # Shard by shard: one whose master is down (a failover), or whose listing repair fails
        # (the home shard refusing it), does not hold up the others' lost leases and deadlines;
        # its failure is raised once the others are done. A shard that this process's worker
        # calls know down is passed over while it is probed, as their rounds pass over it
        # (_skip_down): a hung master fails each call only by its timeout, and held the later
        # shards' upkeep back that long every round. (Upkeep's own failures are not recorded
        # there: a gateway would log each shard's outage too, and skip it from then on.)
        shards = await self._shards_in_use()
        skipped = self._skip_down(shards)
        failed: Exception | None = None
        for shard in shards:
            if shard in skipped:
                failed = failed or BrokerUnavailable(f"{shard.keys.prefix.rstrip(':')} known down, probed")
                continue
            try:
                await self._maintain(shard)
            except Exception as exc:
                failed = failed or exc
        if failed is not None:
            raise failed

    async def _maintain(self, shard: Shard) -> None:
        k = shard.keys
        common: list[str | int | float] = [
            k.prefix,
            UPKEEP_BATCH,
            repr(float(self.settings.result_ttl_s)),
            STREAM_MAXLEN,
        ]
        # Deadlines before leases, as the memory broker: a job handed back now waits a round.
        while True:
            purged = PurgeExpiredReply.from_reply(
                await self._call(
                    "purge_expired",
                    [k.deadline, k.results, k.dead, k.running, k.blocked],
                    [self._now(), *common, EXPIRED],
                    shard,
                )
            )
            if not purged.more:
                break
        while True:
            reaped = ReapReply.from_reply(
                await self._call(
                    "reap",
                    [k.active, k.deadline, k.results, k.dead, k.running, k.blocked],
                    [self._now(), *common, WORKER_LOST],
                    shard,
                )
            )
            if not reaped.more:
                break
        await self._workers("list", shard=shard)
        if shard is not self.home:  # last: it writes to the home shard too, which may be down
            await self._repair_listing(shard)

    # --- dead letters ---------------------------------------------------------------------------

    async def dead_letters(self) -> dict[str, float]:
        out: dict[str, float] = {}
        for shard in await self._shards_in_use():
            entries = await self._io(shard.redis.zrange(shard.keys.dead, 0, -1, withscores=True))
            for member, score in cast(list[tuple[str, float]], entries):
                out[str(member)] = float(score)
        return out

    async def purge_dead_letters(self, ids: Sequence[str] | None = None) -> int:
        if ids is not None and not ids:
            return 0
        everywhere: dict[Shard, list[str]] = {shard: [] for shard in await self._shards_in_use()}
        groups = everywhere if ids is None else self._by_shard(ids)
        purged = 0
        for shard, own in groups.items():
            k = shard.keys
            purged += int(await self._call("purge_dead", [k.dead, k.results], [k.prefix, *own], shard))
        return purged
