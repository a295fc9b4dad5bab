"""Brokers: where admitted jobs wait, and how they reach dispatchers. One interface, several stores."""

from __future__ import annotations

from sluice.broker.base import Broker, BrokerSettings, BrokerUnavailable, Event, EventType

__all__ = ["Broker", "BrokerSettings", "BrokerUnavailable", "Event", "EventType", "create_broker"]


def create_broker(url: str, settings: BrokerSettings) -> Broker:
    """``memory`` for the embedded broker, ``redis://…`` for the durable one."""
    if url in ("", "memory", "memory://"):
        from sluice.broker.memory import MemoryBroker

        return MemoryBroker(settings)
    if url.startswith(("redis://", "rediss://", "unix://")):
        import importlib

        try:
            module = importlib.import_module("sluice.broker.redis")
        except ModuleNotFoundError as exc:  # pragma: no cover - until the Redis broker lands
            raise ValueError("the Redis broker is not available in this build") from exc
        broker: Broker = module.RedisBroker(url, settings)
        return broker
    raise ValueError(f"unknown broker {url!r}: use 'memory' or a redis:// URL")
