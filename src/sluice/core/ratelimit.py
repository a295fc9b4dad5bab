"""Per-key limits: token buckets for requests and tokens per minute, and the headers that report them.

Every API key has buckets of its own (``TenantLimits.key`` names them): a tenant with two keys has
each key's allowance, and no order of using them resets anything (docs/security.md, "Limits").
A bucket holds up to a minute's allowance and refills continuously, so a key may burst up to its
per-minute limit and then proceeds at the steady rate. Token use is charged at admission as the
job's cost (prompt estimate + ``max_tokens``) and settled with the engine's real usage at the end:
what it did not use comes back, and what it used beyond its charge is taken then.
"""

from __future__ import annotations

import math
from dataclasses import dataclass


@dataclass(frozen=True)
class TenantLimits:
    """What one API key may do.

    Args:
        tenant: who pays; fair sharing (weights, virtual time) is between tenants.
        max_priority: the highest priority class the key may use (a request may ask lower, never higher).
        weight: fair-share weight inside a class (2.0 gets twice the tokens of 1.0 under contention).
        rpm: requests per minute; tpm: tokens (prompt + max_tokens) per minute. Both are the key's
            own buckets (see ``key``); a changed limit keeps the level its bucket had.
        max_concurrent: the tenant's jobs running at once. It is the tenant's, as the dispatch order
            is: the cap in force is that of the key that sent the tenant's latest job.
        max_queued: the tenant's jobs waiting at once, above which this key's requests are refused:
            a count of real jobs, which nothing resets.
        key: an id of the API key these limits come from (its SHA-256, never the key itself): the
            name of its buckets inside its tenant. None for a caller without a key (open mode),
            whose buckets are its tenant's.
    """

    tenant: str
    max_priority: str | None = None
    weight: float = 1.0
    rpm: int | None = None
    tpm: int | None = None
    max_concurrent: int | None = None
    max_queued: int | None = None
    key: str | None = None

    @property
    def bucket_id(self) -> str:
        """The name of this key's buckets inside its tenant: ``key``, or '' for a caller without one."""
        return self.key or ""


@dataclass
class Bucket:
    """A token bucket of ``capacity`` that refills fully in ``period`` seconds.

    Its level may fall below zero: a job that used more than it was charged leaves a debt, which
    the refill pays off before anything fits again.
    """

    capacity: float
    period: float = 60.0
    level: float = math.inf  # not used yet: full (refill cuts it to the capacity)
    stamp: float = 0.0

    @property
    def rate(self) -> float:
        return self.capacity / self.period

    def refill(self, now: float) -> float:
        self.level = min(self.capacity, self.level + (now - self.stamp) * self.rate)
        self.stamp = now
        return self.level

    def wait_s(self, amount: float, now: float) -> float:
        """Seconds until ``amount`` fits; infinite if it never can."""
        level = self.refill(now)
        if amount <= level:
            return 0.0
        if amount > self.capacity:
            return math.inf
        return (amount - level) / self.rate

    def take(self, amount: float, now: float) -> None:
        self.refill(now)
        self.level -= amount

    def give_back(self, amount: float, now: float) -> None:
        self.refill(now)
        self.level = min(self.capacity, self.level + amount)

    def reset_s(self, now: float) -> float:
        """Seconds until the bucket is full again."""
        return (self.capacity - self.refill(now)) / self.rate


def _resized(bucket: Bucket | None, capacity: int | None) -> Bucket | None:
    """``bucket`` with a new capacity and its level kept; a new (full) one if there was none."""
    if not capacity:
        return None
    if bucket is None:
        return Bucket(capacity)
    bucket.capacity = capacity
    return bucket


def duration(seconds: float) -> str:
    """OpenAI's duration format for ``x-ratelimit-reset-*``: ``1s``, ``6m0s``, ``250ms``."""
    if seconds < 1:
        return f"{max(round(seconds * 1000), 0)}ms"
    whole = math.ceil(seconds)
    minutes, secs = divmod(whole, 60)
    return f"{minutes}m{secs}s" if minutes else f"{secs}s"


@dataclass(frozen=True)
class RateStatus:
    """Values for the ``x-ratelimit-*`` headers after a decision."""

    limit_requests: int | None
    remaining_requests: int | None
    reset_requests_s: float | None
    limit_tokens: int | None
    remaining_tokens: int | None
    reset_tokens_s: float | None

    def headers(self) -> dict[str, str]:
        h: dict[str, str] = {}
        if self.limit_requests is not None:
            h["x-ratelimit-limit-requests"] = str(self.limit_requests)
            h["x-ratelimit-remaining-requests"] = str(max(self.remaining_requests or 0, 0))
            h["x-ratelimit-reset-requests"] = duration(self.reset_requests_s or 0.0)
        if self.limit_tokens is not None:
            h["x-ratelimit-limit-tokens"] = str(self.limit_tokens)
            h["x-ratelimit-remaining-tokens"] = str(max(self.remaining_tokens or 0, 0))
            h["x-ratelimit-reset-tokens"] = duration(self.reset_tokens_s or 0.0)
        return h


class TenantLimiter:
    """The buckets of one API key (``TenantLimits.key``). Pure: the broker calls it inside its
    atomic admission."""

    def __init__(self, limits: TenantLimits) -> None:
        self.limits = limits
        self.requests = Bucket(limits.rpm) if limits.rpm else None
        self.tokens = Bucket(limits.tpm) if limits.tpm else None

    @property
    def has_buckets(self) -> bool:
        """Whether it holds a level worth keeping; one without buckets is the same as a new one."""
        return self.requests is not None or self.tokens is not None

    def update(self, limits: TenantLimits) -> None:
        """Take the key's limits as they are now (its configuration may have changed).

        A bucket keeps its level through a change of size: it refills at the new rate up to the
        new size, so a change never hands out a fresh minute's allowance. A limit that goes away
        takes its bucket with it; one that appears starts full, as a new key does.
        """
        self.requests = _resized(self.requests, limits.rpm)
        self.tokens = _resized(self.tokens, limits.tpm)
        self.limits = limits

    def check(self, cost: int, now: float) -> tuple[float, str | None]:
        """(seconds to wait, which limit) — (0, None) when the job fits both buckets."""
        waits = []
        if self.requests is not None:
            waits.append((self.requests.wait_s(1, now), "requests"))
        if self.tokens is not None:
            waits.append((self.tokens.wait_s(cost, now), "tokens"))
        worst = max(waits, default=(0.0, None))
        return worst if worst[0] > 0 else (0.0, None)

    def take(self, cost: int, now: float) -> None:
        if self.requests is not None:
            self.requests.take(1, now)
        if self.tokens is not None:
            self.tokens.take(cost, now)

    def settle(self, charged: int, used: int, now: float) -> None:
        """Settle a job's charge with the tokens it really used: give back what it did not use,
        take what it used beyond the charge. The bucket may go below zero (a debt: the estimate
        was short), and the tenant's next requests wait until the refill has paid it off."""
        if self.tokens is None or used == charged:
            return
        if used < charged:
            self.tokens.give_back(charged - used, now)
        else:
            self.tokens.take(used - charged, now)

    def status(self, now: float) -> RateStatus:
        r, t = self.requests, self.tokens
        return RateStatus(
            limit_requests=self.limits.rpm,
            remaining_requests=math.floor(r.refill(now)) if r else None,
            reset_requests_s=r.reset_s(now) if r else None,
            limit_tokens=self.limits.tpm,
            remaining_tokens=math.floor(t.refill(now)) if t else None,
            reset_tokens_s=t.reset_s(now) if t else None,
        )
