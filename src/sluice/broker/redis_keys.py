"""Every Redis key name of the durable broker, and the names of the fields Python reads or writes in
its hashes and streams, built in one place.

All keys of one ``QueueKeys`` start with the same hash tag, ``{<queue>}:``, so that Redis Cluster
puts them in one slot and every Lua script, given the keys of one ``QueueKeys``, touches a single
slot. On a cluster a queue is spread over several of them, one per shard (``redis_shards``).
Names that carry a model, a class or a tenant escape ``%`` and ``:`` in that part, so that
``model="a:b"`` can never collide with ``model="a", class="b"``.

The scripts that find keys from data (``claim`` pops a tenant and then needs its list) build those
names in Lua; ``lua/_keys.lua`` mirrors the builders marked "mirrored in Lua" below, and
``tests/broker/test_redis.py`` checks that both agree. The scripts name the same fields in their
own text (``lua/README.md`` says which script reads what).
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Final


def part(name: str) -> str:
    """One variable segment of a key name. Mirrored in Lua (``part``)."""
    return name.replace("%", "%25").replace(":", "%3A")


@dataclass(frozen=True)
class QueueKeys:
    """Key names of one queue namespace.

    Args:
        queue: the queue's name; it becomes the hash tag, so it may not contain braces.
    """

    queue: str = "sluice"

    def __post_init__(self) -> None:
        if not self.queue or "{" in self.queue or "}" in self.queue:
            raise ValueError(f"a queue name needs at least one character and no braces: {self.queue!r}")

    @property
    def prefix(self) -> str:
        """The hash-tagged prefix every key starts with; scripts get it to build data-dependent keys."""
        return f"{{{self.queue}}}:"

    # --- one job --------------------------------------------------------------------------------

    def job(self, job_id: str) -> str:
        """Hash: the job record. Mirrored in Lua."""
        return f"{self.prefix}job:{job_id}"

    def out(self, job_id: str) -> str:
        """Stream: the job's events, ids ``0-<seq>``. Mirrored in Lua."""
        return f"{self.prefix}out:{job_id}"

    def idem(self, tenant: str, key: str) -> str:
        """String: ``<job id> <expires_at>`` for a tenant's ``Idempotency-Key``; tenant and key are
        escaped apart, so no (tenant, key) pair names another's. Stored no longer than its job's
        record lives (RedisBroker._idempotency_ttl_s)."""
        return f"{self.prefix}idem:{part(tenant)}:{part(key)}"

    # --- queues: per model, per class, per tenant --------------------------------------------------

    def tq(self, model: str, cls: str, tenant: str) -> str:
        """List: job ids one tenant has queued in one class of one model. Mirrored in Lua."""
        return f"{self.prefix}tq:{part(model)}:{part(cls)}:{part(tenant)}"

    def sched(self, model: str, cls: str) -> str:
        """Zset: backlogged tenants of a class, ``<seq><tenant>`` → start tag (SFQ). Mirrored in Lua."""
        return f"{self.prefix}sched:{part(model)}:{part(cls)}"

    def state(self, model: str) -> str:
        """Hash: a model's queue state, read and written in one call by the scripts. Per class ``<c>``
        (escaped): ``j:<c>`` jobs, ``k:<c>`` tokens, ``c:<c>`` credit, ``v:<c>`` virtual time,
        ``s:<c>`` sequence; per class and tenant: ``t:<c>:<tenant>`` start tag and ``f:<c>:<tenant>``
        finish tag; per tenant list, ``w:<tq key>`` the cost queued in it and ``hd:<tq key>``
        (:func:`head_field`) what admit.lua last read of its head job; ``ht``, a long value that
        keeps the hash in Redis's hashtable encoding (admit.lua says why). Mirrored in Lua."""
        return f"{self.prefix}qs:{part(model)}"

    def tenant(self, tenant: str) -> str:
        """Hash: a tenant's jobs queued and running, its policy and its rate buckets. Mirrored in Lua."""
        return f"{self.prefix}tenant:{part(tenant)}"

    def marker(self, model: str) -> str:
        """Zset: wake-up marker that idle claimers block on (BZPOPMIN). Mirrored in Lua."""
        return f"{self.prefix}marker:{part(model)}"

    # --- queue-wide ---------------------------------------------------------------------------------

    @property
    def shards(self) -> str:
        """Set: the shards that hold a model's queue (``redis_shards``), in the home shard only, for
        upkeep and stats to walk."""
        return f"{self.prefix}shards"

    @property
    def models(self) -> str:
        """Set: every model that ever had a job, for stats."""
        return f"{self.prefix}models"

    @property
    def active(self) -> str:
        """Zset: running job id → lease expiry, and :data:`SKIPLIST_MEMBER`."""
        return f"{self.prefix}active"

    @property
    def deadline(self) -> str:
        """Zset: queued job id → deadline, and :data:`SKIPLIST_MEMBER`."""
        return f"{self.prefix}deadline"

    @property
    def results(self) -> str:
        """Zset: terminal job id → when its record, result and events are dropped, and
        :data:`SKIPLIST_MEMBER`."""
        return f"{self.prefix}results"

    @property
    def dead(self) -> str:
        """Zset: dead-lettered job id → when it died; the error stays in the job record."""
        return f"{self.prefix}dead"

    @property
    def running(self) -> str:
        """Hash: model → running jobs."""
        return f"{self.prefix}running"

    @property
    def blocked(self) -> str:
        """Set: tenants at their concurrency cap, whom claim passes over."""
        return f"{self.prefix}blocked"

    @property
    def capped(self) -> str:
        """Set: tenants with more jobs queued and running than their concurrency cap, whose jobs
        beyond it admit does not count as ahead of other tenants'. Mirrored in Lua."""
        return f"{self.prefix}capped"

    @property
    def draining(self) -> str:
        """Set: backends that take no new jobs (an administrator drains them)."""
        return f"{self.prefix}draining"

    @property
    def api_keys(self) -> str:
        """Hash: API keys stored by an administrator, SHA-256 of the key → its record as JSON."""
        return f"{self.prefix}apikeys"

    @property
    def reports(self) -> str:
        """Hash: process id → JSON ``{"expires": t, "report": {...}}``, what each gateway and worker
        reports of itself for the dashboard; an expired entry is dropped by the next reader."""
        return f"{self.prefix}reports"

    @property
    def capacity(self) -> str:
        """Hash: per model, ``p:<model>`` per-slot drain rate and ``n:<model>`` samples (DrainRate),
        and ``s:<model>`` the slots of the live workers (rebuilt whenever a worker comes or goes)."""
        return f"{self.prefix}capacity"

    @property
    def workers(self) -> str:
        """Zset: worker id → registration expiry."""
        return f"{self.prefix}workers"

    @property
    def worker_slots(self) -> str:
        """Hash: worker id → JSON ``{model: slots}``."""
        return f"{self.prefix}wslots"

    @property
    def callbacks(self) -> str:
        """List: ended jobs whose webhook awaits a worker. Mirrored in Lua."""
        return f"{self.prefix}callbacks"

    @property
    def callbacks_marker(self) -> str:
        """Zset: wake-up marker for workers waiting on webhooks (BZPOPMIN). Mirrored in Lua."""
        return f"{self.prefix}cbmarker"

    @property
    def callbacks_inflight(self) -> str:
        """Zset: webhooks handed to a worker, job id → when they are handed out again."""
        return f"{self.prefix}cbinflight"

    @property
    def maintain_lock(self) -> str:
        """String: taken with ``SET NX PX`` so one process per interval runs background upkeep."""
        return f"{self.prefix}maintain"

    @property
    def abort_channel(self) -> str:
        """Pub/sub channel: a running job was cancelled; workers should heartbeat now."""
        return f"{self.prefix}abort"

    def wake(self, reader_id: str) -> str:
        """Stream: interrupts one process's multiplexed XREAD when a new reader joins."""
        return f"{self.prefix}wake:{part(reader_id)}"

    def connections(self, key_sha256: str) -> str:
        """Zset: an API key's open connections on every gateway, connection id → lease expiry; the
        key itself expires when no gateway renews any of them (connect.lua)."""
        return f"{self.prefix}conns:{part(key_sha256)}"

    def tenant_jobs(self, tenant: str) -> str:
        """Zset: a tenant's jobs, job id → created_at, to list them newest first. Trimmed as they
        expire: a member whose record is gone is dropped when a listing meets it, and the key
        lives no longer than the record of the newest job in it."""
        return f"{self.prefix}tjobs:{part(tenant)}"

    def tenant_jobs_us(self, tenant: str) -> str:
        """Zset: a tenant's jobs, job id → created_at in whole microseconds, where admissions list
        them now (``tenant_jobs`` is the older form, read until its last member expires). An
        integer score is stored as an integer in a listpack, so a ``ZADD`` that walks one (under
        128 members) compares integers instead of parsing every score's text; kept and trimmed as
        ``tenant_jobs`` is."""
        return f"{self.prefix}tjobsu:{part(tenant)}"

    @property
    def unlisted(self) -> str:
        """Zset: in a shard other than the home shard, the jobs admitted here and not yet known to be
        in their tenant's list (``tenant_jobs_us``, in the home shard), job id → when admitted. The
        admit script adds each; the admission removes it once it listed the job, and upkeep lists
        those it did not (``RedisJobs._repair_listing``)."""
        return f"{self.prefix}unlisted"

    @property
    def model_info(self) -> str:
        """Hash: worker id → JSON ``{model: ModelInfo}``, what each worker knows of the models it
        serves; read for the live workers only (``workers``)."""
        return f"{self.prefix}minfo"


# --- fields of the job record (QueueKeys.job) ---------------------------------------------------------


class JobField:
    """Fields of a job's hash that Python names. The ``Job`` dataclass's own fields are stored under
    their attribute names (``redis_codec``): :data:`JOB_OWN_FIELDS` each as a field of its own, the
    rest together in :attr:`SPEC`."""

    #: the job's state (``JobState`` value)
    STATE: Final = "state"
    #: the id of the job's latest event
    SEQ: Final = "seq"
    #: the data of event 1 (QUEUED), kept in the record rather than in the stream (admit.lua)
    QUEUED_EVENT: Final = "q"
    #: prompt plus most tokens, for the scripts (``Job.cost``)
    COST: Final = "cost"
    #: the fields that never change after admission, as one JSON object
    SPEC: Final = "spec"
    #: the answer (``Job.result``), recorded by finish.lua
    RESULT: Final = "result"
    #: the engine's token accounting (``Job.usage``), recorded by finish.lua
    USAGE: Final = "usage"
    #: why the job failed, was cancelled or expired (``Job.error``)
    ERROR: Final = "error"
    #: how many times the job was started (``Job.attempts``)
    ATTEMPTS: Final = "attempts"
    #: the backend of the latest attempt (``Job.backend``)
    BACKEND: Final = "backend"
    #: ``Job.extra`` as JSON (the webhook delivery log); callbacks.lua compares and sets it
    EXTRA: Final = "extra"


#: Job fields the scripts read or write, each a field of the record hash; the others go in ``spec``.
JOB_OWN_FIELDS: Final = frozenset(
    {
        "model", "tenant", "priority", "weight", "created_at", "deadline", "max_attempts", "state",
        "attempts", "started_at", "first_token_at", "finished_at", "backend", "result", "usage",
        "error", "extra", "callback_url",
    }
)  # fmt: skip


# --- fields of a model's queue state (QueueKeys.state) and of the capacity hash ------------------------


#: A member of the deadline, active and results zsets at score +inf, which no job id can be and
#: no read up to a time returns: longer than Redis's zset-max-listpack-value, it keeps each a
#: skiplist, whose insert does not walk every member (lua/_keys.lua says what it saves). Mirrored
#: in Lua.
SKIPLIST_MEMBER = "~ a member over zset-max-listpack-value: this zset stays a skiplist (lua/_keys.lua)"


def head_field(tq_key: str) -> str:
    """Field of a model's state hash: what admit.lua last read of the head job of the tenant list
    ``tq_key``, ``'<cost> <weight> <jobs>:<tag>'``, which holds while the list has ``<jobs>`` jobs
    and its tenant's tag field reads ``<tag>`` (lua/_fairqueue.lua, ``f_head``). Mirrored in Lua."""
    return f"hd:{tq_key}"


def queued_jobs_field(cls: str) -> str:
    """State hash: jobs queued in a class. Mirrored in Lua (``f_jobs``)."""
    return f"j:{part(cls)}"


def queued_tokens_field(cls: str) -> str:
    """State hash: cost (tokens) queued in a class. Mirrored in Lua (``f_tokens``)."""
    return f"k:{part(cls)}"


#: State hash: the jobs admitted that then ended past their deadline (``ModelStats.broken_promises``),
#: counted by ``settle`` in ``lua/_job.lua``.
BROKEN_PROMISES_FIELD: Final = "bp"

#: Capacity hash: ``<prefix><model>`` holds the slots of the live workers for a model (the model
#: unescaped: nothing follows it in the field name).
SLOTS_PREFIX: Final = "s:"


def slots_field(model: str) -> str:
    """Capacity hash: the slots of the live workers for ``model``."""
    return SLOTS_PREFIX + model


def drain_rate_field(model: str) -> str:
    """Capacity hash: the measured drain rate per slot of ``model`` (``DrainRate.per_slot``)."""
    return f"p:{model}"


def drain_samples_field(model: str) -> str:
    """Capacity hash: how many jobs that rate was measured on (``DrainRate.samples``)."""
    return f"n:{model}"


def drain_service_field(model: str) -> str:
    """Capacity hash: the moving average of the service times of ``model`` (``DrainRate.service``)."""
    return f"d:{model}"


def drain_fill_field(model: str) -> str:
    """Capacity hash: how a job of ``model`` slows as the batch fills (``DrainRate.fill`` and its
    fit), six numbers space-separated, written by finish.lua and read by admit and claim
    (``lua/_drain.lua``, ``redis_codec.drain_fill``)."""
    return f"g:{model}"


def drain_slow_field(model: str) -> str:
    """Capacity hash: how slow a job of ``model`` gets, per cost unit (``DrainRate.slow``)."""
    return f"h:{model}"


def drain_resid_field(model: str) -> str:
    """Capacity hash: the moving average of the square of a job's residual, its service time less
    what its cost predicts (``DrainRate.resid``), written by finish.lua and read by admit.lua."""
    return f"r:{model}"


# --- fields of stream entries ---------------------------------------------------------------------------

#: A job's event stream (QueueKeys.out): the event's type (``EventType`` value).
EVENT_TYPE: Final = "t"
#: A job's event stream: the event's data as JSON; empty in a terminal event.
EVENT_DATA: Final = "d"
#: A reader's wake-up stream (QueueKeys.wake): the one field of its entries.
WAKE_FIELD: Final = "w"
