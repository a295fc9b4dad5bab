"""What the Redis broker reports and what an administrator sets: queue statistics and the
dashboard's breakdown (read shard by shard), the processes' reports, draining backends, API keys
stored in the broker, and each API key's open connections (all in the home shard). Part of
:class:`sluice.broker.redis.RedisBroker`.
"""

from __future__ import annotations

import asyncio
import json
from collections.abc import Collection, Iterable, Mapping
from typing import Any, cast

from redis.exceptions import RedisError

from sluice.broker.base import ClassDepth, ModelStats, QueueBreakdown, TenantDepth
from sluice.broker.redis_codec import capacity_drain, capacity_slots, to_json
from sluice.broker.redis_core import BREAKDOWN_SCAN, RedisCore
from sluice.broker.redis_keys import BROKEN_PROMISES_FIELD, queued_jobs_field, queued_tokens_field
from sluice.broker.redis_pipe import translate
from sluice.broker.redis_shards import Shard
from sluice.broker.redis_work import WorkMixin


class AdminMixin(WorkMixin, RedisCore):
    """Statistics, reports, draining, API keys and connection slots."""

    async def stats(self) -> dict[str, ModelStats]:
        out: dict[str, ModelStats] = {}
        for shard in await self._shards_in_use():
            out.update(await self._shard_stats(shard))
        return dict(sorted(out.items()))

    def _own_models(self, shard: Shard, models: Iterable[str]) -> list[str]:
        """The models whose queue is in ``shard``: the home shard's capacity hash knows the slots
        of every model, and its stats are read from their own shards."""
        return sorted(m for m in set(models) if self._model_shard(m) is shard)

    async def _shard_stats(self, shard: Shard) -> dict[str, ModelStats]:
        k = shard.keys
        capacity = await self._workers("list", shard=shard)
        slots = capacity_slots(capacity)
        queued = cast(set[str], await self._io(shard.redis.smembers(k.models)))
        models = self._own_models(shard, queued | set(slots))
        fields = [f(c) for c in self._class_names for f in (queued_jobs_field, queued_tokens_field)]
        async with shard.redis.pipeline(transaction=False) as pipe:
            for model in models:
                pipe.hmget(k.state(model), [*fields, BROKEN_PROMISES_FIELD])
            pipe.hgetall(k.running)
            replies: list[Any] = await self._io(pipe.execute())
        running: dict[str, str] = replies[-1]
        out: dict[str, ModelStats] = {}
        for model, values in zip(models, replies, strict=False):
            counts, broken = values[:-1], values[-1]
            drain = capacity_drain(capacity, model, self.settings.drain_prior_per_slot)
            out[model] = ModelStats(
                sum(int(n or 0) for n in counts[0::2]),
                sum(int(n or 0) for n in counts[1::2]),
                int(running.get(model, 0)),
                drain.slots,
                drain.rate,
                drain.measured,
                int(broken or 0),
            )
        return out

    async def queue_breakdown(self, top_tenants: int) -> dict[str, QueueBreakdown]:
        out: dict[str, QueueBreakdown] = {}
        for shard in await self._shards_in_use():
            out.update(await self._shard_breakdown(shard, top_tenants))
        return dict(sorted(out.items()))

    async def _shard_breakdown(self, shard: Shard, top_tenants: int) -> dict[str, QueueBreakdown]:
        k = shard.keys
        models = self._own_models(shard, cast(set[str], await self._io(shard.redis.smembers(k.models))))
        fields = [f(c) for c in self._class_names for f in (queued_jobs_field, queued_tokens_field)]
        async with shard.redis.pipeline(transaction=False) as pipe:
            for model in models:
                pipe.hmget(k.state(model), fields)
                for c in self._class_names:
                    # The class's heap of backlogged tenants (stale entries too, dropped below by
                    # their empty lists), read from its head: past BREAKDOWN_SCAN, tenants are missed.
                    pipe.zrange(k.sched(model, c), 0, BREAKDOWN_SCAN - 1)
            replies: list[Any] = await self._io(pipe.execute())
        per_model = len(self._class_names) + 1
        lists = sorted(
            {
                (model, c, member[15:])  # a member is '<15-digit seq><tenant>' (_fairqueue.lua)
                for i, model in enumerate(models)
                for c, members in zip(
                    self._class_names, replies[i * per_model + 1 : (i + 1) * per_model], strict=True
                )
                for member in members
            }
        )
        async with shard.redis.pipeline(transaction=False) as pipe:
            for model, c, tenant in lists:
                tq = k.tq(model, c, tenant)
                pipe.llen(tq)
                pipe.hget(k.state(model), "w:" + tq)  # the cost in the list (_fairqueue.lua, f_work)
            counts: list[Any] = await self._io(pipe.execute()) if lists else []
        tenants: dict[str, dict[str, list[int]]] = {model: {} for model in models}
        for (model, _, tenant), jobs, tokens in zip(lists, counts[0::2], counts[1::2], strict=True):
            if int(jobs):
                held = tenants[model].setdefault(tenant, [0, 0])
                held[0] += int(jobs)
                held[1] += int(float(tokens or 0))
        out: dict[str, QueueBreakdown] = {}
        for i, model in enumerate(models):
            depth = replies[i * per_model]
            classes = {
                c: ClassDepth(int(depth[2 * j] or 0), int(depth[2 * j + 1] or 0))
                for j, c in enumerate(self._class_names)
            }
            ranked = sorted(tenants[model].items(), key=lambda kv: (-kv[1][0], kv[0]))
            out[model] = QueueBreakdown(
                classes,
                [TenantDepth(t, jobs, tokens) for t, (jobs, tokens) in ranked[: max(top_tenants, 0)]],
                len(ranked),
            )
        return out

    async def put_report(self, process_id: str, report: Mapping[str, Any], ttl_s: float) -> None:
        entry = to_json({"expires": self.now() + ttl_s, "report": report})
        await self._io(self._redis.hset(self.keys.reports, process_id, entry))

    async def reports(self) -> dict[str, dict[str, Any]]:
        raw = cast(dict[str, str], await self._io(self._redis.hgetall(self.keys.reports)))
        now = self.now()
        out: dict[str, dict[str, Any]] = {}
        expired = []
        for process_id, entry in raw.items():
            decoded = json.loads(entry)
            if float(decoded["expires"]) <= now:
                expired.append(process_id)
            else:
                out[process_id] = cast(dict[str, Any], decoded["report"])
        if expired:
            await self._io(self._redis.hdel(self.keys.reports, *expired))
        return out

    async def set_draining(self, backend: str, draining: bool) -> None:
        key = self.keys.draining
        await self._io(self._redis.sadd(key, backend) if draining else self._redis.srem(key, backend))

    async def draining(self) -> set[str]:
        return cast(set[str], await self._io(self._redis.smembers(self.keys.draining)))

    async def put_key(self, key_sha256: str, record: dict[str, Any]) -> None:
        await self._io(self._redis.hset(self.keys.api_keys, key_sha256, json.dumps(record)))

    async def get_key(self, key_sha256: str) -> dict[str, Any] | None:
        raw = await self._io(self._redis.hget(self.keys.api_keys, key_sha256))
        return cast(dict[str, Any], json.loads(raw)) if raw else None

    async def delete_key(self, key_sha256: str) -> bool:
        return bool(await self._io(self._redis.hdel(self.keys.api_keys, key_sha256)))

    async def list_keys(self) -> dict[str, dict[str, Any]]:
        raw = cast(dict[str, str], await self._io(self._redis.hgetall(self.keys.api_keys)))
        return {h: cast(dict[str, Any], json.loads(v)) for h, v in raw.items()}

    # --- open connections per API key: a zset per key, connection id -> lease expiry -----------

    def _connection_lease(self) -> tuple[str, int]:
        """A lease taken or renewed now: its expiry, and the zset's own time to live (ms). The zset
        outlives every lease in it twice over, whatever the skew between gateways' clocks, and goes
        once no gateway renews anything in it."""
        lease_s = self.settings.lease_s
        return repr(float(self.now() + lease_s)), max(int(2000 * lease_s), 1000)

    async def open_connection(self, key_sha256: str, connection_id: str, cap: int) -> bool:
        expires, ttl_ms = self._connection_lease()
        reply = await self._call(
            "connect", [self.keys.connections(key_sha256)], [self._now(), connection_id, cap, expires, ttl_ms]
        )
        return int(reply) == 1

    async def renew_connections(self, held: Mapping[str, Collection[str]]) -> None:
        expires, ttl_ms = self._connection_lease()
        sent = []  # submitted in this turn of the event loop, ahead of any release issued after it
        for key_sha256, ids in held.items():
            if ids:
                conns = self.keys.connections(key_sha256)
                scored = [part for conn_id in ids for part in (expires, conn_id)]
                sent.append(self._batch.submit(("ZADD", conns, *scored)))
                sent.append(self._batch.submit(("PEXPIRE", conns, ttl_ms)))
        try:
            await asyncio.gather(*sent)
        except (RedisError, OSError) as exc:
            raise translate(exc) from exc

    async def close_connection(self, key_sha256: str, connection_id: str) -> None:
        await self._batch.call(("ZREM", self.keys.connections(key_sha256), connection_id))

    async def open_connections(self, key_sha256: str) -> int:
        conns = self.keys.connections(key_sha256)
        return int(await self._batch.call(("ZCOUNT", conns, self._now(), "+inf")))
