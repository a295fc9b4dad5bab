"""Brokers: where admitted jobs wait, and how they reach dispatchers. One interface, several stores."""

from __future__ import annotations

from sluice.broker.base import Broker, BrokerSettings, BrokerUnavailable, Event, EventType
from sluice.broker.redis_topology import DEFAULT_WAIT_TIMEOUT_MS, SCHEMES

__all__ = ["Broker", "BrokerSettings", "BrokerUnavailable", "Event", "EventType", "create_broker"]


def create_broker(
    url: str,
    settings: BrokerSettings,
    *,
    min_replicas: int | None = None,
    wait_timeout_ms: int = DEFAULT_WAIT_TIMEOUT_MS,
) -> Broker:
    """``memory`` for the embedded broker; for the durable one a Redis URL: ``redis://…``
    (``rediss://``, ``unix://``) for one Redis, ``redis+sentinel://…/MASTER`` for a primary that
    Sentinel fails over, ``redis+cluster://…`` for a Redis Cluster (``redis_topology``).
    ``min_replicas`` and ``wait_timeout_ms`` are the Redis broker's durability (None: 1 replica
    with Sentinel or Cluster, none with one Redis)."""
    # Each broker's module is imported only when it is used: the embedded one needs no Redis client.
    if url in ("", "memory", "memory://"):
        from sluice.broker.memory import MemoryBroker

        return MemoryBroker(settings)
    if url.startswith(SCHEMES):
        from sluice.broker.redis import RedisBroker

        return RedisBroker(url, settings, min_replicas=min_replicas, wait_timeout_ms=wait_timeout_ms)
    raise ValueError(
        f"unknown broker {url!r}: use 'memory' or a redis://, redis+sentinel:// or redis+cluster:// URL"
    )
