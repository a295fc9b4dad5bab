"""The worker's side of the Redis broker: registering its slots, claiming a job, renewing and
releasing leases, publishing events and settling the job. Part of
:class:`sluice.broker.redis.RedisBroker`.

A claim over models whose queues are in several shards (a spread queue on a cluster) runs the claim
script once per shard, starting from a different shard at each claim so that none is always served
first, and blocks on the wake-up markers of all of them at once.

A shard whose master is unavailable (down, mid-failover) does not stop the others: a claim,
a registration and a heartbeat go on with the shards that answer, try that one again at their next
round, and raise :class:`BrokerUnavailable` only when none answered (the outage of each shard is
logged once, ``RedisCore._shard_failed``). A claim's rounds pass over a shard known down while it is
probed (``RedisCore._skip_down``): a master that hangs, failing each call only by its timeout, holds
up only the round that found it down.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import secrets
from collections.abc import Mapping, Sequence
from typing import Any

from redis.exceptions import RedisError

from sluice.broker.base import BrokerUnavailable, EventType
from sluice.broker.redis_codec import JobReply, capacity_slots, pairs, settings_text, settle_fields, to_json
from sluice.broker.redis_core import (
    CLAIM_BLOCK_S,
    EXPIRED,
    EXPIRED_PER_CLAIM,
    SHARD_RETRY_S,
    STREAM_MAXLEN,
    UNFINISHABLE,
    ClaimPlan,
    RedisCore,
)
from sluice.broker.redis_pipe import translate
from sluice.broker.redis_shards import Shard
from sluice.core import capacity
from sluice.core.capacity import SLOW_QUANTILE, SLOW_STEP
from sluice.core.job import Job, JobError, JobState
from sluice.core.model_info import ModelInfo, merge


class WorkMixin(RedisCore):
    """Workers, claims, leases, events and settlements."""

    # --- the worker registry --------------------------------------------------------------------

    async def _workers(
        self, op: str, worker_id: str = "", slots: Mapping[str, int] | None = None, shard: Shard | None = None
    ) -> dict[str, str]:
        k = (shard or self.home).keys
        expires = self.now() + max(self.settings.lease_s, 1.0)
        reply = await self._call(
            "workers",
            [k.workers, k.worker_slots, k.capacity],
            [self._now(), op, worker_id, repr(float(expires)), to_json(dict(sorted((slots or {}).items())))],
            shard,
        )
        return pairs(reply)

    async def register(self, worker_id: str, slots: Mapping[str, int]) -> None:
        # The home shard knows every model's slots (served_models); a model's shard knows the slots
        # of its own models, which its admissions predict with and its finishes measure.
        if not self.spread:
            await self._workers("register", worker_id, slots)
            return
        per_shard: dict[Shard, dict[str, int]] = {self.home: dict(slots)}
        for model, n in slots.items():
            per_shard.setdefault(self._model_shard(model), {})[model] = n
        # Shard by shard: one whose master is down (a failover) is registered on at the next
        # heartbeat, and the others now; only a registration that reached no shard raises.
        failed: BrokerUnavailable | None = None
        answered = False
        # A shard known down is not waited on (a hung master costs the timeout, and the heartbeat
        # that follows a registration would renew the leases that much later): probed meanwhile.
        skipped = self._skip_down(list(per_shard))
        for shard, own in per_shard.items():
            if shard in skipped:
                continue
            try:
                if not shard.announced and shard is not self.home:
                    # (in the home shard: if its master is down, announced at a later registration)
                    with contextlib.suppress(BrokerUnavailable):
                        await self._announce(shard)
                await self._workers("register", worker_id, own, shard)
            except BrokerUnavailable as exc:
                failed = exc
                self._shard_failed(shard, exc)
                continue
            answered = True
            self._shard_answered(shard)
        if not answered and failed is not None:
            raise failed

    async def unregister(self, worker_id: str) -> None:
        # Every shard that answers, then the outage of one that did not, if any (its master down:
        # the registration there runs out with its lease).
        failed: BrokerUnavailable | None = None
        for shard in await self._shards_in_use():
            try:
                await self._workers("unregister", worker_id, shard=shard)
            except BrokerUnavailable as exc:
                failed = failed or exc
        await self._batch.call(("HDEL", self.keys.model_info, worker_id))
        if failed is not None:
            raise failed

    async def describe_models(self, worker_id: str, models: Mapping[str, ModelInfo]) -> None:
        described = {model: info.to_dict() for model, info in sorted(models.items())}
        await self._batch.call(("HSET", self.keys.model_info, worker_id, to_json(described)))

    async def model_info(self) -> dict[str, ModelInfo]:
        k = self.keys
        live, described = await asyncio.gather(
            self._batch.call(("ZRANGEBYSCORE", k.workers, self._now(), "+inf")),
            self._batch.call(("HGETALL", k.model_info)),
        )
        accounts: dict[str, list[ModelInfo]] = {}
        for worker_id, raw in pairs(described).items():
            if worker_id not in live:
                continue
            with contextlib.suppress(ValueError, TypeError, AttributeError):
                for model, info in json.loads(raw).items():
                    accounts.setdefault(model, []).append(ModelInfo.from_dict(info))
        return {model: merge(infos) for model, infos in accounts.items()}

    async def served_models(self) -> dict[str, int]:
        return {model: n for model, n in capacity_slots(await self._workers("list")).items() if n > 0}

    # --- claims ---------------------------------------------------------------------------------

    def _plan(self, models: Sequence[str]) -> list[ClaimPlan]:
        """One plan per shard that holds some of ``models`` (one, unless the queue is spread)."""
        plans = self._plans.get(tuple(models))
        if plans is not None:
            return plans
        groups: dict[Shard, list[str]] = {}
        for model in models:
            groups.setdefault(self._model_shard(model), []).append(model)
        plans = []
        for shard, own in groups.items():
            k = shard.keys
            keys = [k.active, k.deadline, k.results, k.running, k.blocked, k.capacity]
            for model in own:
                keys += [k.state(model), k.marker(model)]
                keys += [k.sched(model, c) for c in self._class_names]
            settings = settings_text(
                [
                    k.prefix,
                    repr(float(self.settings.lease_s)),
                    repr(float(self.settings.result_ttl_s)),
                    STREAM_MAXLEN,
                    len(self._class_names),
                    len(own),
                    EXPIRED_PER_CLAIM,
                    EXPIRED,
                    UNFINISHABLE,
                    repr(capacity.FILL_RIDGE),
                    repr(capacity.MAX_FILL_SLOWDOWN),
                    *self._class_names,
                    *self._min_shares,
                    *own,
                ]
            )
            plans.append(ClaimPlan(shard, keys, [k.marker(m) for m in own], settings))
        self._plans[tuple(models)] = plans
        return plans

    async def _claim(self, worker_id: str, models: Sequence[str], timeout: float) -> Job | None:
        plans = self._plan(models)
        several = len(plans) > 1
        loop = asyncio.get_running_loop()
        give_up = loop.time() + timeout
        woken: Shard | None = None
        while True:
            answered: list[ClaimPlan] = []
            failed: BrokerUnavailable | None = None
            order = plans
            skipped: set[Shard] = set()
            if several:
                order = self._claim_order(plans)
                skipped = self._skip_down([p.shard for p in order])
            for plan in order:
                if plan.shard in skipped:
                    continue  # known down: probed meanwhile, in the round again once it answers
                try:
                    job = await self._claim_on(plan, worker_id, 1 if plan.shard is woken else 0)
                except BrokerUnavailable as exc:
                    if not several:
                        raise
                    # Its master is down (a failover): the models of the other masters go on being
                    # served; this shard is tried again at the next round.
                    failed = exc
                    self._shard_failed(plan.shard, exc)
                    continue
                if several:
                    self._shard_answered(plan.shard)
                if job is not None:
                    return job
                answered.append(plan)
            if not answered and failed is not None:
                raise failed  # every shard the claim needs is unavailable
            woken = None
            remaining = give_up - loop.time()
            if remaining <= 0:
                return None
            retry = failed is not None or bool(skipped)
            block = min(remaining, SHARD_RETRY_S if retry else CLAIM_BLOCK_S)
            marker = await self._block([(p.shard, p.markers) for p in answered], block)
            woken = next((p.shard for p in answered if marker in p.markers), None)

    def _claim_order(self, plans: list[ClaimPlan]) -> list[ClaimPlan]:
        """The order a claim round over several shards tries them in: a different one first at each
        round, so that no shard's models always win. (A shard known down is not tried at all while
        another one is up: the round passes it over, :meth:`_skip_down`.)"""
        turn = self._claim_turn
        self._claim_turn += 1
        return [plans[(turn + i) % len(plans)] for i in range(len(plans))]

    async def _claim_on(self, plan: ClaimPlan, worker_id: str, woken: int) -> Job | None:
        """Run the claim script on one shard until it leases a job or finds none."""
        script = self.scripts["claim"]
        while True:
            token = secrets.token_hex(8)
            command = script.command(plan.keys, [self._now(), worker_id, token, woken, plan.settings])

            def orphan(reply: Any, worker_id: str = worker_id, token: str = token) -> None:
                # The caller was cancelled but its claim went through: hand that job straight
                # back rather than leave it leased to nobody until the lease runs out.
                release = asyncio.ensure_future(self._release_claimed(reply, worker_id, token))
                self._releases.add(release)
                release.add_done_callback(self._releases.discard)

            try:
                reply = await plan.shard.batch.submit(command, script=script, orphan=orphan)
            except (RedisError, OSError) as exc:
                raise translate(exc) from exc
            claimed = JobReply.from_reply(reply)
            if claimed.job is not None:
                self._tokens[(worker_id, claimed.job.id)] = token
                return claimed.job
            if claimed.code != 2:
                return None

    async def _release_claimed(self, reply: Any, worker_id: str, token: str) -> None:
        claimed = JobReply.from_reply(reply).job
        if claimed is None:
            return
        with contextlib.suppress(Exception):
            await self._release(claimed.id, worker_id, token)

    async def _release(self, job_id: str, worker_id: str, token: str) -> Any:
        shard = self._job_shard(job_id)
        k = shard.keys
        return await self._call(
            "release",
            [k.job(job_id), k.out(job_id), k.active, k.deadline, k.running, k.blocked],
            [k.prefix, job_id, worker_id, token, STREAM_MAXLEN],
            shard,
        )

    async def release(self, job_id: str, worker_id: str) -> bool:
        token = self._tokens.get((worker_id, job_id))
        if token is None:
            return False
        released = await self._release(job_id, worker_id, token)
        # Forgotten only once the script has answered: if Redis could not be reached, the lease is
        # still this worker's, and a heartbeat or a finish may still need the token.
        self._tokens.pop((worker_id, job_id), None)
        return int(released) == 1

    # --- leases, events, settlements ------------------------------------------------------------

    async def heartbeat(self, worker_id: str, job_ids: Sequence[str]) -> set[str]:
        if not job_ids:
            return set()

        sent = {job_id: self._tokens.get((worker_id, job_id), "") for job_id in job_ids}

        async def beat(shard: Shard, ids: list[str]) -> list[Any]:
            k = shard.keys
            args: list[str | int | float] = [self._now(), repr(float(self.settings.lease_s)), worker_id]
            for job_id in ids:
                args += [job_id, sent[job_id]]
            return list(await self._call("heartbeat", [k.active, *map(k.job, ids)], args, shard))

        groups = self._by_shard(job_ids)
        # Counted before the skip: a shard left alone by it is still one of several, whose outage is
        # known and logged (and passed over at the next rounds), not raised as the only shard's.
        several = len(groups) > 1
        # A shard known down is passed over (probed meanwhile), not waited on: a hung master would
        # hold this heartbeat, and so the next one's renewals on the others, for its timeout.
        for shard in self._skip_down(list(groups)):
            del groups[shard]
        replies = await asyncio.gather(*(beat(s, ids) for s, ids in groups.items()), return_exceptions=True)
        # A shard whose master is down (a failover) renews nothing now, and its jobs are not told
        # to abort: their leases are renewed at the next heartbeat if it is back in time, else
        # they are lost there and that heartbeat says so (the lease token fences this worker).
        # The other shards' leases are renewed meanwhile; only a heartbeat that reached no shard
        # raises.
        abort: set[str] = set()
        failed: BrokerUnavailable | None = None
        answered = False
        for shard, reply in zip(groups, replies, strict=True):
            if isinstance(reply, BrokerUnavailable) and several:
                failed = reply
                self._shard_failed(shard, reply)
                continue
            if isinstance(reply, BaseException):
                raise reply  # not an outage (a bug, let it show), or the one shard's outage
            answered = True
            if several:
                self._shard_answered(shard)
            abort.update(str(i) for i in reply)
        if not answered and failed is not None:
            raise failed
        for job_id in abort:
            # Forgotten only if it is still the token this heartbeat sent: a claim of the same job by
            # this worker may have stored a new one meanwhile, which the adopted run needs.
            if self._tokens.get((worker_id, job_id)) == sent.get(job_id):
                self._tokens.pop((worker_id, job_id), None)
        return abort

    async def wait_abort_signal(self, timeout: float) -> None:
        await self._aborts.wait(timeout)

    async def publish(self, job_id: str, type: EventType, data: dict[str, Any]) -> None:
        shard = self._job_shard(job_id)
        k = shard.keys
        await self._call(
            "publish",
            [k.job(job_id), k.out(job_id)],
            [self._now(), type.value, to_json(data), STREAM_MAXLEN],
            shard,
        )

    async def finish(
        self,
        job_id: str,
        worker_id: str,
        state: JobState,
        *,
        result: dict[str, Any] | None = None,
        usage: dict[str, Any] | None = None,
        error: JobError | None = None,
        attempts: int | None = None,
        backend: str | None = None,
    ) -> Job | None:
        fields = settle_fields(result=result, usage=usage, error=error, attempts=attempts, backend=backend)
        used = usage.get("total_tokens") if usage is not None else None
        return await self._finish(job_id, worker_id, state, used if isinstance(used, int) else -1, fields)

    def _finish_settings(self, prefix: str) -> str:
        """finish.lua's settings (its header): what every finish on a shard passes the same, joined
        once per distinct value; capacity's switches are read at each call (tests flip them)."""
        per_slot, fill_alpha = capacity.WEIGHT_PER_SLOT, capacity.FILL_ALPHA
        memo_key = (prefix, per_slot, fill_alpha)
        text = self._finish_texts.get(memo_key)
        if text is None:
            text = settings_text(
                [
                    prefix,
                    repr(float(self.settings.result_ttl_s)),
                    STREAM_MAXLEN,
                    self._drain_alpha,
                    repr(SLOW_QUANTILE),
                    repr(SLOW_STEP),
                    1 if per_slot else 0,
                    repr(fill_alpha),
                ]
            )
            self._finish_texts[memo_key] = text
        return text

    async def _finish(
        self, job_id: str, worker_id: str, state: JobState, used: int, fields: list[str]
    ) -> Job | None:
        shard = self._job_shard(job_id)
        k = shard.keys
        token = self._tokens.pop((worker_id, job_id), "")
        reply = await self._call(
            "finish",
            [
                k.job(job_id),
                k.out(job_id),
                k.active,
                k.results,
                k.running,
                k.capacity,
                k.blocked,
                k.workers,
                k.worker_slots,
            ],
            [
                self._now(),
                job_id,
                worker_id,
                token,
                state.value,
                used,
                self._finish_settings(k.prefix),
                *fields,
            ],
            shard,
        )
        return JobReply.from_reply(reply).job
