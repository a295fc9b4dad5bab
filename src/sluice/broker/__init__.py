"""Brokers: where admitted jobs wait, and how they reach dispatchers. One interface, several stores."""

from __future__ import annotations

from sluice.broker.base import Broker, BrokerSettings, BrokerUnavailable, Event, EventType

__all__ = ["Broker", "BrokerSettings", "BrokerUnavailable", "Event", "EventType", "create_broker"]


def create_broker(url: str, settings: BrokerSettings) -> Broker:
    """``memory`` for the embedded broker, ``redis://…`` (``rediss://``, ``unix://``) for the durable one."""
    # Each broker's module is imported only when it is used: the embedded one needs no Redis client.
    if url in ("", "memory", "memory://"):
        from sluice.broker.memory import MemoryBroker

        return MemoryBroker(settings)
    if url.startswith(("redis://", "rediss://", "unix://")):
        from sluice.broker.redis import RedisBroker

        return RedisBroker(url, settings)
    raise ValueError(f"unknown broker {url!r}: use 'memory' or a redis:// URL")
