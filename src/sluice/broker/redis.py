"""The durable broker: Redis, with one Lua script per state change (docs/design.md, "Redis";
docs/redis.md for Sentinel and Cluster).

Every script is given the keys of one shard, one hash tag (``redis_shards``), so each touches one
slot and the layout runs unchanged on Redis Cluster; on a cluster each model's queue has a shard of
its own, so models spread over the masters. Scripts get the time from the caller
(``settings.clock``), never from Redis, so that tests can move it and the scripts stay pure. The
scripts mirror the core's scheduling (``lua/_fairqueue.lua`` is FairQueue, ``lua/_classes.lua`` is
ClassScheduler, ``admit.lua`` is the queue policy with admission's checks), and a test checks that
the memory broker and this one make the same decisions.

The broker is one class made of parts, each a module: ``redis_core`` (connections, shards, upkeep
loop), ``redis_jobs`` (the gateway's side), ``redis_work`` (the worker's side), ``redis_upkeep``
(webhooks, expiry, lost leases, dead letters) and ``redis_admin`` (stats, reports, API keys,
connection slots).
"""

from __future__ import annotations

from sluice.broker.base import BrokerUnavailable
from sluice.broker.redis_admin import AdminMixin
from sluice.broker.redis_core import (
    CLAIM_BLOCK_S,
    DURABLE_SCRIPTS,
    MAINTAIN_INTERVAL_S,
    RECORD_GRACE_S,
    SCRIPT_NAMES,
    STREAM_MAXLEN,
)
from sluice.broker.redis_jobs import JobsMixin
from sluice.broker.redis_pipe import Script
from sluice.broker.redis_upkeep import UpkeepMixin

__all__ = [
    "CLAIM_BLOCK_S",
    "DURABLE_SCRIPTS",
    "MAINTAIN_INTERVAL_S",
    "RECORD_GRACE_S",
    "SCRIPT_NAMES",
    "STREAM_MAXLEN",
    "BrokerUnavailable",
    "RedisBroker",
    "Script",
]


class RedisBroker(JobsMixin, UpkeepMixin, AdminMixin):
    """Admitted jobs, queues, leases, results and events in Redis; any number of gateway and worker
    processes share one queue.

    Args:
        url: ``redis://``, ``rediss://`` or ``unix://`` URL of one Redis, ``redis+sentinel://`` of the
            sentinels and the master's name, or ``redis+cluster://`` of some cluster nodes
            (``redis_topology``).
        settings: the broker settings; they travel to the scripts with every call.
        queue: the queue's name: the hash tag of all its keys, so several queues can share one Redis.
        max_connections: size of the command pool; callers beyond it wait up to ``pool_timeout_s``.
        pool_timeout_s: longest wait for a free connection before :class:`BrokerUnavailable`.
        socket_timeout_s: longest wait for a command's answer.
        connect_timeout_s: longest wait for a TCP connection.
        blocking_connections: size of the pool for blocking claims (one per concurrent ``claim``).
        min_replicas: replicas that must confirm an admission, settlement or cancel before it is
            answered (``WAIT``); None: 1 with Sentinel or Cluster, 0 with one Redis.
        wait_timeout_ms: how long they have; when fewer confirm, the call raises
            :class:`BrokerUnavailable`.
        spread: whether each model's queue gets a hash tag of its own (``redis_shards``); None: as
            the URL says (on a cluster unless ``spread=none``; never on one Redis or Sentinel).
    """
