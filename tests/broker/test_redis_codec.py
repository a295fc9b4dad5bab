"""redis_codec on its own: the job record's encoding, the tenant state, and the decoders of the
scripts' replies, first on hand-built replies, then on what admit.lua really answers."""

from __future__ import annotations

import dataclasses
import json
from collections.abc import AsyncIterator, Sequence
from typing import Any

import pytest

from sluice.broker.redis import RedisBroker
from sluice.broker.redis_codec import (
    AdmitOutcome,
    AdmitReply,
    JobReply,
    PurgeExpiredReply,
    ReapReply,
    TenantState,
    bound,
    capacity_drain,
    capacity_slots,
    decode_job,
    encode_job,
    limiter_from_state,
    pairs,
    settings_text,
    settle_fields,
    tenant_limit_args,
)
from sluice.broker.redis_keys import JOB_OWN_FIELDS, JobField
from sluice.broker.redis_shards import Shard
from sluice.core.admission import Bounds, QueueLimits, QueueView, Refused
from sluice.core.job import JobError, JobState
from sluice.core.policy import PolicyState
from sluice.core.ratelimit import TenantLimits
from tests.broker.brokers import make_settings
from tests.helpers import FakeClock, make_job

# --- the job record ------------------------------------------------------------------------------


def _full_job() -> Any:
    """A job with every optional field set, floats that need all their digits, and text to escape."""
    job = make_job(FakeClock(1_800_000_000.123456789), tenant="acme:eu", idempotency_key="k 1")
    job.state = JobState.FAILED
    job.started_at = job.created_at + 0.1
    job.first_token_at = job.created_at + 0.2000000001
    job.finished_at = job.created_at + 1 / 3
    job.attempts = 2
    job.backend = "gpu-1"
    job.result = {"text": 'é "q"\n', "n": [1, 2.5, None]}
    job.usage = {"prompt_tokens": 10, "completion_tokens": 5, "total_tokens": 15}
    job.error = JobError("boom", "server_error", "engine_error")
    job.weight = 2.5
    job.callback_url = "https://example.com/hook"
    job.key_sha256 = "0f" * 32
    job.stream_tokens = False
    job.extra = {"deliveries": [{"attempt": 1, "status": 500}]}
    return job


def test_a_job_comes_back_as_it_went() -> None:
    for job in (make_job(), _full_job()):
        flat = encode_job(job)
        assert decode_job(pairs(flat)) == job


def test_the_record_keeps_script_fields_apart_and_leaves_none_out() -> None:
    job = make_job()
    record = pairs(encode_job(job))
    assert record[JobField.COST] == str(job.cost)  # for the scripts
    assert set(record) - {JobField.COST, JobField.SPEC} <= JOB_OWN_FIELDS
    assert "result" not in record and "error" not in record  # None is left out
    spec = json.loads(record[JobField.SPEC])
    assert spec["body"] == job.body and spec["endpoint"] == job.endpoint.value
    assert not set(spec) & JOB_OWN_FIELDS
    # Numbers are JSON text, so that a script can splice them into event data as they are.
    assert json.loads(record["deadline"]) == job.deadline and record[JobField.STATE] == "queued"


def test_every_job_field_is_stored() -> None:
    job = _full_job()
    record = pairs(encode_job(job))
    stored = set(record) | set(json.loads(record[JobField.SPEC]))
    assert {f.name for f in dataclasses.fields(job)} <= stored


def test_settle_fields() -> None:
    error = JobError("no", "timeout", "deadline_exceeded")
    fields = pairs(settle_fields(result={"a": 1}, usage=None, error=error, attempts=2, backend="b"))
    assert fields == {
        JobField.RESULT: '{"a":1}',
        JobField.ERROR: json.dumps(error.to_dict(), separators=(",", ":")),
        JobField.ATTEMPTS: "2",
        JobField.BACKEND: "b",
    }
    assert settle_fields(result=None, usage=None, error=None, attempts=None, backend=None) == []


# --- limits and the tenant state ---------------------------------------------------------------------


def test_bound() -> None:
    assert bound(None) == -1
    assert bound(0) == 0
    assert bound(250) == 250


def test_settings_text() -> None:
    fixed = settings_text(["60.0", 10_000, '{"error": "x"}'])
    assert fixed == '60.0\x1f10000\x1f{"error": "x"}'
    assert settings_text(["m", "normal", -1, 2.5], fixed) == "m\x1fnormal\x1f-1\x1f2.5\x1f" + fixed
    assert settings_text(["m"]) == "m"
    # '%' and the separator escaped, as settings_of in _keys.lua undoes them
    assert settings_text(["m\x1fx", "100%"]) == "m%1Fx\x1f100%25"


def test_tenant_limit_args() -> None:
    assert tenant_limit_args(None) == [0, "", -1, -1, -1, -1]
    assert tenant_limit_args(TenantLimits("t", rpm=5, max_concurrent=2)) == [1, "", 5, -1, -1, 2]
    # A key's buckets are named by its id.
    assert tenant_limit_args(TenantLimits("t", tpm=9, key="ab12")) == [1, "ab12", -1, 9, -1, -1]


def test_limiter_from_state_with_buckets() -> None:
    state = ["60", "1000", "4", "2", "3", "12.5", "1800000000.25", "900", "1800000001"]
    limiter = limiter_from_state("acme", state)
    assert limiter.limits == TenantLimits("acme", rpm=60, tpm=1000, max_queued=4, max_concurrent=2)
    assert limiter.requests is not None and limiter.tokens is not None
    assert (limiter.requests.level, limiter.requests.stamp) == (12.5, 1800000000.25)
    assert (limiter.tokens.level, limiter.tokens.stamp) == (900.0, 1800000001.0)
    status = limiter.status(1800000001.0)
    assert status.remaining_tokens == 900 and status.remaining_requests == 13  # 12.5 + 0.75 s of refill
    decoded = TenantState.from_reply(state)
    assert decoded.queued == 3 and decoded.max_queued == 4


def test_limiter_from_state_without_limits_or_levels() -> None:
    # A tenant with no limits: '' for none; the queued count comes as the script formats numbers.
    limiter = limiter_from_state("t", ["", "", "", "", "0", "", "", "", ""])
    assert limiter.limits == TenantLimits("t")
    assert limiter.requests is None and limiter.tokens is None
    # Limits without levels yet: the buckets are full (never used).
    fresh = limiter_from_state("t", ["10", "100", "", "", "1", "", "", "", ""])
    assert fresh.requests is not None and fresh.requests.refill(1800000000.0) == 10
    assert fresh.tokens is not None and fresh.tokens.refill(1800000000.0) == 100


def test_limiter_from_state_keeps_a_debt() -> None:
    # A level below zero is a debt (a job used more than it was charged), not a bucket never used.
    limiter = limiter_from_state("t", ["", "100", "", "", "0", "", "", "-50", "1800000000"])
    assert limiter.tokens is not None and limiter.tokens.refill(1800000000.0) == -50
    wait, which = limiter.check(10, 1800000000.0)
    assert which == "tokens" and wait == pytest.approx(60 * 60 / 100)


# --- script replies -----------------------------------------------------------------------------------

TENANT = ["5", "", "", "1", "2", "3", "1800000000", "", ""]


def test_admit_reply_queued() -> None:
    reply = AdmitReply.from_reply([1, 4, "2.5", *TENANT])
    assert reply.outcome is AdmitOutcome.QUEUED
    assert (reply.position, reply.estimated_start_s) == (4, 2.5)
    assert reply.tenant == TenantState(5, None, None, 1, 2, 3.0, 1800000000.0, None, None)
    assert reply.first_id is None and reply.refusal is None


def test_admit_reply_duplicate_and_retried() -> None:
    duplicate = AdmitReply.from_reply([2, "job_first"])
    assert duplicate.outcome is AdmitOutcome.DUPLICATE and duplicate.first_id == "job_first"
    retried = AdmitReply.from_reply([3])
    assert retried.outcome is AdmitOutcome.RETRIED and retried.first_id is None


def test_admit_reply_refused() -> None:
    raw = [
        0,
        10,
        300,
        4,
        120,
        6,
        180,
        240,
        "97.5",
        3,
        2,
        *TENANT,
        1,
        "1800000000.5",
        "",
        "1.25",
        "",
        30,
        "1800000012.25",
        "0.0125",
    ]
    reply = AdmitReply.from_reply(raw)
    assert reply.outcome is AdmitOutcome.REFUSED and reply.tenant is not None
    assert reply.tenant.queued == 2 and reply.tenant.max_concurrent == 1
    refusal = reply.refusal
    assert refusal is not None
    assert refusal.view == QueueView(
        10, 300, 4, 120, 6, 180, running=1, runnable_tokens=240, victim_tokens=30
    )
    assert (refusal.per_slot, refusal.samples, refusal.slots) == (97.5, 3, 2)
    assert refusal.policy == PolicyState(1800000000.5, None, 1.25, None)
    assert refusal.next_free == 1800000012.25 and refusal.slow == 0.0125
    drain = refusal.drain(50.0)
    assert (drain.prior_per_slot, drain.per_slot, drain.samples, drain.slots) == (50.0, 97.5, 3, 2)
    # No codel state: limit_s is 0, as PolicyState's default; no victim.
    empty = AdmitReply.from_reply([*raw[:-7], "", "", "", "", "", "", "0"])
    assert empty.refusal is not None and empty.refusal.policy == PolicyState()
    assert empty.refusal.view.victim_tokens is None and empty.refusal.next_free is None


def test_job_reply() -> None:
    job = make_job()
    got = JobReply.from_reply([1, *encode_job(job)])
    assert got.code == 1 and got.job == job
    for code in (0, 2):
        assert JobReply.from_reply([code]) == JobReply(code, None)


def test_upkeep_replies() -> None:
    assert PurgeExpiredReply.from_reply([3, 7, 1]) == PurgeExpiredReply(3, 7, True)
    assert PurgeExpiredReply.from_reply([0, 0, 0]).more is False
    assert ReapReply.from_reply([2, 1, 0]) == ReapReply(2, 1, False)


def test_capacity() -> None:
    capacity = {"s:m": "3", "s:org/llama:8b": "0", "p:m": "97.5", "n:m": "4", "e": "1800000000", "ls": "9"}
    assert capacity_slots(capacity) == {"m": 3, "org/llama:8b": 0}
    drain = capacity_drain(capacity, "m", 50.0)
    assert (drain.per_slot, drain.samples, drain.slots, drain.measured) == (97.5, 4, 3, True)
    unknown = capacity_drain(capacity, "x", 50.0)
    assert (unknown.samples, unknown.slots, unknown.slot_rate) == (0, 0, 50.0)


# --- admit.lua's real replies ------------------------------------------------------------------------


@pytest.fixture
def clock() -> FakeClock:
    return FakeClock()


@pytest.fixture
async def spied(clock: FakeClock, redis_url: str) -> AsyncIterator[tuple[RedisBroker, list[Any]]]:
    """A Redis broker whose admit replies are kept, raw, as the script sent them."""
    settings = dataclasses.replace(
        make_settings(clock), limits={"small": QueueLimits(model=Bounds(max_jobs=2))}
    )
    async with RedisBroker(redis_url, settings) as broker:
        replies: list[Any] = []
        call = broker._call

        async def spy(
            name: str, keys: Sequence[str], args: Sequence[str | int | float], shard: Shard | None = None
        ) -> Any:
            reply = await call(name, keys, args, shard)
            if name == "admit":
                replies.append(reply)
            return reply

        broker._call = spy  # type: ignore[method-assign]
        yield broker, replies


async def test_admit_lua_replies_decode(spied: tuple[RedisBroker, list[Any]], clock: FakeClock) -> None:
    broker, replies = spied
    await broker.register("w", {"small": 2})
    limits = TenantLimits("acme", rpm=10, tpm=500, max_queued=5, max_concurrent=3)
    first = make_job(clock, model="small", tenant="acme", idempotency_key="k")
    await broker.admit(first, limits)
    queued = AdmitReply.from_reply(replies[-1])
    assert queued.outcome is AdmitOutcome.QUEUED and queued.position == 0
    assert queued.tenant == TenantState(10, 500, 5, 3, 1, 9.0, clock(), 500.0 - first.cost, clock())

    await broker.admit(make_job(clock, model="small", tenant="acme", idempotency_key="k"), limits)
    duplicate = AdmitReply.from_reply(replies[-1])
    assert duplicate.outcome is AdmitOutcome.DUPLICATE and duplicate.first_id == first.id

    second = make_job(clock, model="small", tenant="acme", priority="high")
    await broker.admit(second, limits)
    clock.advance(3.0)
    with pytest.raises(Refused) as info:
        await broker.admit(make_job(clock, model="small", tenant="acme"), limits)
    assert info.value.code == "queue_full"
    refused = AdmitReply.from_reply(replies[-1])
    assert refused.outcome is AdmitOutcome.REFUSED and refused.refusal is not None
    # The tenant before the checks: two queued, the buckets as the last charge left them.
    assert refused.tenant == TenantState(
        10, 500, 5, 3, 2, 8.0, clock() - 3.0, 500.0 - 2 * first.cost, clock() - 3.0
    )
    view = refused.refusal.view
    cost = first.cost
    assert (view.model_jobs, view.model_tokens) == (2, 2 * cost)
    assert (view.class_jobs, view.class_tokens, view.ahead_jobs, view.ahead_tokens) == (1, cost, 2, 2 * cost)
    assert view.runnable_tokens == 2 * cost  # nobody holds jobs back
    assert (refused.refusal.samples, refused.refusal.slots) == (0, 2)
