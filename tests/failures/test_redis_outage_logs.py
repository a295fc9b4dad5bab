"""A Redis outage is logged once when it starts and once when it ends, per loop: no line per retry,
and no traceback (an outage is not a bug)."""

from __future__ import annotations

import logging

import pytest

from sluice import runtime
from sluice.broker.outage import OutageLog
from sluice.config import load_settings
from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.helpers import FakeClock, wait_until
from tests.redis_server import RedisServer

LOOPS = ("claims", "heartbeat", "webhook delivery")


def lines(caplog: pytest.LogCaptureFixture, what: str, word: str) -> list[logging.LogRecord]:
    return [r for r in caplog.records if r.getMessage().startswith(f"{what} {word}")]


async def test_an_outage_is_two_lines_per_loop(redis: RedisServer, caplog: pytest.LogCaptureFixture) -> None:
    caplog.set_level(logging.INFO, logger="sluice")
    async with serve_in_background(preset("fast", model="sim")) as sim:
        settings = load_settings(
            overrides={"broker": redis.url, "backends": [{"url": sim}], "lease_s": 3.0}, environ={}
        )
        async with runtime.running_worker(settings) as worker:
            redis.kill()
            await wait_until(lambda: all(lines(caplog, what, "paused") for what in LOOPS), timeout=30)
            # Every failed retry while Redis is away is counted, not logged.
            await wait_until(lambda: worker.dispatcher._claims_outage.failures >= 3, timeout=30)
            redis.start()
            await wait_until(lambda: all(lines(caplog, what, "resumed") for what in LOOPS), timeout=30)
    for what in LOOPS:
        assert len(lines(caplog, what, "paused")) == 1, what
        assert len(lines(caplog, what, "resumed")) == 1, what
    assert not [r for r in caplog.records if r.exc_info], "an outage logged a traceback"
    assert not [r for r in caplog.records if "upkeep skipped" in r.getMessage()]


def test_outage_log_counts_and_resumes(caplog: pytest.LogCaptureFixture) -> None:
    from sluice.broker.base import BrokerUnavailable

    clock = FakeClock(0.0)
    log = logging.getLogger("sluice.test_outage")
    outage = OutageLog(log, "claims", clock=clock)
    with caplog.at_level(logging.INFO, logger="sluice.test_outage"):
        outage.ok()  # nothing to end
        for _ in range(5):
            outage.failed(BrokerUnavailable("Redis did not answer in time"))
            clock.advance(1.0)
        outage.ok()
        outage.failed(ValueError("a bug"))
    messages = [r.getMessage() for r in caplog.records]
    assert messages[0].startswith("claims paused") and "Redis did not answer" in messages[0]
    assert messages[1] == "claims resumed: the broker is back after 5.0 s (5 failed calls)"
    assert messages[2] == "claims failed" and caplog.records[2].exc_info is not None
    assert len(messages) == 3
