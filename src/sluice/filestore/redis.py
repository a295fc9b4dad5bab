"""The distributed store: the broker's Redis (any topology its URL names), shared by every gateway.

Keys (all in one Cluster hash slot, ``{sluice-batches}``, so that the scripts may touch several)::

    file:<id>            a file's record (JSON)         file:<id>:data   its content
    files:<tenant>       the tenant's files, a zset scored by creation time
    batch:<id>           a batch's record (JSON)        batches:<tenant> the tenant's batches (zset)
    active               the batches not yet terminal (a set)
    batch:<id>:cancel    when a cancel was asked
    batch:<id>:jobs      custom_id → job id (hash)
    batch:<id>:results   custom_id → "1"/"0" + line (hash; HSETNX: the first result wins)
    batch:<id>:counts    ok / failed (hash, counted by the same script that writes a result)
    batch:<id>:lease     the runner that drives the batch (SET NX PX)

Durability is Redis's own: with ``appendonly yes`` and ``appendfsync always`` (as the broker's
queue wants) an acknowledged result survives a kill of Redis.
"""

from __future__ import annotations

import json
from typing import Any

from redis.asyncio import Redis

from sluice.broker.redis_pipe import make_locator, make_pool
from sluice.broker.redis_topology import parse_broker_url
from sluice.filestore.base import TERMINAL_BATCH_STATUSES, BatchStore, FileMeta, Page

PREFIX = "sluice:{sluice-batches}:"

_ADD_RESULT = """
if redis.call('HSETNX', KEYS[1], ARGV[1], ARGV[2]) == 1 then
  redis.call('HINCRBY', KEYS[2], ARGV[3], 1)
  return 1
end
return 0
"""

_RENEW = """
local held = redis.call('GET', KEYS[1])
if held == false then
  redis.call('SET', KEYS[1], ARGV[1], 'PX', ARGV[2])
  return 1
end
if held == ARGV[1] then
  redis.call('PEXPIRE', KEYS[1], ARGV[2])
  return 1
end
return 0
"""

_RELEASE = """
if redis.call('GET', KEYS[1]) == ARGV[1] then
  return redis.call('DEL', KEYS[1])
end
return 0
"""


def _text(value: object) -> str:
    return value.decode() if isinstance(value, bytes) else str(value)


class RedisStore(BatchStore):
    """Files and batches in the Redis at ``url`` (a broker URL)."""

    def __init__(self, url: str, *, timeout_s: float = 5.0) -> None:
        topology = parse_broker_url(url)
        self._locator = make_locator(topology, timeout_s, PREFIX + "active")
        pool = make_pool(topology, self._locator, socket_timeout=timeout_s, socket_connect_timeout=timeout_s)
        self.redis = Redis(connection_pool=pool)
        self._add_result = self.redis.register_script(_ADD_RESULT)
        self._renew = self.redis.register_script(_RENEW)
        self._release = self.redis.register_script(_RELEASE)

    async def close(self) -> None:
        await self.redis.aclose()
        if self._locator is not None:
            await self._locator.aclose()

    # --- files ---------------------------------------------------------------------------------

    async def put_file(self, meta: FileMeta, content: bytes) -> None:
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(f"{PREFIX}file:{meta.id}:data", content)
            pipe.set(f"{PREFIX}file:{meta.id}", json.dumps(meta.to_dict()))
            pipe.zadd(f"{PREFIX}files:{meta.tenant}", {meta.id: meta.created_at})
            await pipe.execute()

    async def get_file(self, file_id: str) -> FileMeta | None:
        raw = await self.redis.get(f"{PREFIX}file:{file_id}")
        return FileMeta.from_dict(json.loads(raw)) if raw else None

    async def file_content(self, file_id: str) -> bytes | None:
        if not await self.redis.exists(f"{PREFIX}file:{file_id}"):
            return None
        data = await self.redis.get(f"{PREFIX}file:{file_id}:data")
        return data if isinstance(data, bytes) or data is None else _text(data).encode()

    async def delete_file(self, file_id: str) -> bool:
        meta = await self.get_file(file_id)
        if meta is None:
            return False
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.delete(f"{PREFIX}file:{file_id}", f"{PREFIX}file:{file_id}:data")
            pipe.zrem(f"{PREFIX}files:{meta.tenant}", file_id)
            await pipe.execute()
        return True

    async def _page(
        self, index: str, record: str, limit: int, after: str | None, ascending: bool, keep: Any = None
    ) -> Page:
        ids = [_text(i) for i in await self.redis.zrange(index, 0, -1, desc=not ascending)]
        if after is not None:
            if after not in ids:
                return Page([], False)
            ids = ids[ids.index(after) + 1 :]
        items: list[dict[str, Any]] = []
        for start in range(0, len(ids), 100):
            chunk = ids[start : start + 100]
            for raw in await self.redis.mget([f"{PREFIX}{record}:{i}" for i in chunk]):
                if raw is None:
                    continue
                item = json.loads(raw)
                if keep is None or keep(item):
                    items.append(item)
                if len(items) > limit:
                    return Page(items[:limit], True)
        return Page(items, False)

    async def list_files(
        self, tenant: str, *, purpose: str | None, limit: int, after: str | None, ascending: bool
    ) -> Page:
        def keep(item: dict[str, Any]) -> bool:
            return purpose is None or item.get("purpose") == purpose

        return await self._page(f"{PREFIX}files:{tenant}", "file", limit, after, ascending, keep)

    # --- batches -------------------------------------------------------------------------------

    async def put_batch(self, batch: dict[str, Any]) -> None:
        tenant = batch["_sluice"]["tenant"]
        async with self.redis.pipeline(transaction=True) as pipe:
            pipe.set(f"{PREFIX}batch:{batch['id']}", json.dumps(batch))
            created = batch["_sluice"].get("created", batch["created_at"])
            pipe.zadd(f"{PREFIX}batches:{tenant}", {batch["id"]: created})
            if batch["status"] in TERMINAL_BATCH_STATUSES:
                pipe.srem(f"{PREFIX}active", batch["id"])
            else:
                pipe.sadd(f"{PREFIX}active", batch["id"])
            await pipe.execute()

    async def get_batch(self, batch_id: str) -> dict[str, Any] | None:
        raw = await self.redis.get(f"{PREFIX}batch:{batch_id}")
        return json.loads(raw) if raw else None

    async def list_batches(self, tenant: str, *, limit: int, after: str | None) -> Page:
        return await self._page(f"{PREFIX}batches:{tenant}", "batch", limit, after, False)

    async def active_batches(self) -> list[str]:
        return sorted(_text(i) for i in await self.redis.smembers(f"{PREFIX}active"))

    async def request_cancel(self, batch_id: str, at: float) -> float:
        key = f"{PREFIX}batch:{batch_id}:cancel"
        await self.redis.set(key, repr(at), nx=True)
        raw = await self.redis.get(key)
        return float(raw) if raw else at

    async def cancel_requested(self, batch_id: str) -> float | None:
        raw = await self.redis.get(f"{PREFIX}batch:{batch_id}:cancel")
        return float(raw) if raw else None

    # --- progress ------------------------------------------------------------------------------

    async def set_job(self, batch_id: str, custom_id: str, job_id: str) -> None:
        await self.redis.hset(f"{PREFIX}batch:{batch_id}:jobs", custom_id, job_id)

    async def jobs(self, batch_id: str) -> dict[str, str]:
        raw = await self.redis.hgetall(f"{PREFIX}batch:{batch_id}:jobs")
        return {_text(k): _text(v) for k, v in raw.items()}

    async def add_result(self, batch_id: str, custom_id: str, ok: bool, line: str) -> bool:
        keys = [f"{PREFIX}batch:{batch_id}:results", f"{PREFIX}batch:{batch_id}:counts"]
        value = ("1" if ok else "0") + line
        added = await self._add_result(keys=keys, args=[custom_id, value, "ok" if ok else "failed"])
        return bool(added)

    async def results(self, batch_id: str) -> dict[str, tuple[bool, str]]:
        raw = await self.redis.hgetall(f"{PREFIX}batch:{batch_id}:results")
        out = {}
        for k, v in raw.items():
            text = _text(v)
            out[_text(k)] = (text[:1] == "1", text[1:])
        return out

    async def result_counts(self, batch_id: str) -> tuple[int, int]:
        ok, failed = await self.redis.hmget(f"{PREFIX}batch:{batch_id}:counts", ["ok", "failed"])
        return int(ok or 0), int(failed or 0)

    # --- leases --------------------------------------------------------------------------------

    async def take_lease(self, batch_id: str, owner: str, ttl_s: float) -> bool:
        key = f"{PREFIX}batch:{batch_id}:lease"
        return bool(await self._renew(keys=[key], args=[owner, max(int(ttl_s * 1000), 1)]))

    async def release_lease(self, batch_id: str, owner: str) -> None:
        await self._release(keys=[f"{PREFIX}batch:{batch_id}:lease"], args=[owner])
