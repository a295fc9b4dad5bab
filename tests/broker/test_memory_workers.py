"""The memory broker's workers (memory_workers.py): the kept sum of their slots (``Workers.slots``)
is what a fresh walk of the registrations gives, through registrations, lapses and a clock that
steps back."""

from __future__ import annotations

import random

from sluice.broker.memory import MemoryBroker
from tests.broker.brokers import make_settings
from tests.helpers import FakeClock


def fresh(broker: MemoryBroker, now: float) -> dict[str, int]:
    total: dict[str, int] = {}
    for slots, expires in broker._workers.registrations.values():
        if expires >= now:
            for model, n in slots.items():
                total[model] = total.get(model, 0) + n
    return total


async def test_the_kept_slots_are_a_fresh_sum_at_every_step() -> None:
    clock = FakeClock()
    broker = MemoryBroker(make_settings(clock))  # leases of 5 s: a registration lapses after 5 s
    rng = random.Random(7)
    kept = 0
    for _ in range(3_000):
        step = rng.random()
        if step < 0.15:
            worker = f"w{rng.randrange(4)}"
            await broker.register(
                worker, {m: rng.randrange(1, 9) for m in rng.sample("abc", rng.randrange(1, 3))}
            )
        elif step < 0.2:
            await broker.unregister(f"w{rng.randrange(4)}")
        elif step < 0.25:
            clock.advance(-rng.random() * 3)  # a clock stepped back
        else:
            clock.advance(rng.random() * 0.8)
        before = broker._workers.live_slots
        assert broker._workers.slots(clock()) == fresh(broker, clock())
        assert await broker.served_models() == fresh(broker, clock())
        kept += broker._workers.live_slots is before
    assert kept > 1_000  # the sum was mostly kept, not walked afresh


async def test_a_registration_that_lapses_leaves_the_sum_at_its_expiry() -> None:
    clock = FakeClock()
    broker = MemoryBroker(make_settings(clock))
    await broker.register("w1", {"m": 4})
    clock.advance(2.0)
    await broker.register("w2", {"m": 3})
    assert broker._workers.slots(clock()) == {"m": 7}
    clock.advance(3.0)  # w1's registration expires now: still counted (expiry >= now)
    assert broker._workers.slots(clock()) == {"m": 7}
    clock.advance(0.001)
    assert broker._workers.slots(clock()) == {"m": 3}
    clock.advance(-1.0)  # back before w1's expiry: counted again
    assert broker._workers.slots(clock()) == {"m": 7}
    served = await broker.served_models()
    served["m"] = 0  # the caller's copy
    assert broker._workers.slots(clock()) == {"m": 7}
