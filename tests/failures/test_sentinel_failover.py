"""kill -9 of the Redis primary under load, with Sentinel promoting a replica (docs/redis.md).

With the durability setting on (the default with Sentinel: an admission is answered once a replica
has it), every accepted job is on the new primary and runs to the end, and no job is settled twice
however its claim fared; with it off, what a failover loses is measured, not asserted. Clients get
503 with Retry-After while there is no primary, never a hang, and service resumes by itself.

Every process is real and on free ports: a primary, two replicas and three sentinels (AOF, fsync
always), gateways and workers as separate ``sluice`` processes, or brokers of their own.
"""

from __future__ import annotations

import asyncio
import random
import time
from collections.abc import Iterator

import httpx
import pytest

from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.failures.failover_load import FailoverLoad
from tests.failures.procs import served, start_gateway, start_worker
from tests.helpers import wait_until
from tests.redis_server import SentinelGroup

#: each test starts its own replicated Redis and waits out a failover
pytestmark = pytest.mark.slow

MSG = [{"role": "user", "content": "hi"}]
#: a lease lost with the primary lapses this soon, so that its job runs again within the test
ENV = {"SLUICE_LEASE_S": "3"}
#: the longest any answer may take while the primary is gone: the command timeout (2 s) and the
#: WAIT timeout (1 s), plus room for a loaded machine
ANSWER_BOUND_S = 5.0
#: how soon service must be back after the kill: Sentinel's down-after (1 s), its election and the
#: promotion take about 2.5 s
RESUME_BOUND_S = 15.0
#: how far the replicas lag in the broker-level tests: the stream reaches them this much later each
#: way, as across a network (on loopback a replica is microseconds behind and a kill -9 never finds
#: anything in flight)
LINK_DELAY_MS = 50


@pytest.fixture
def group() -> Iterator[SentinelGroup]:
    """A primary with two replicas (so that the promoted one still has a replica to confirm
    admissions to) and three sentinels."""
    with SentinelGroup(replicas=2) as group:
        yield group


@pytest.fixture
def lagged() -> Iterator[SentinelGroup]:
    """The same, with the replicas LINK_DELAY_MS behind, and the kill taking the primary's network
    with it (what was still on its way to them is gone)."""
    with SentinelGroup(replicas=2, link_delay_ms=LINK_DELAY_MS) as group:
        yield group


async def test_failover_under_load_loses_no_accepted_job(
    group: SentinelGroup, http: httpx.AsyncClient
) -> None:
    async with serve_in_background(preset("fast", model="sim", base_step_s=0.002)) as sim:
        gateway, url = await start_gateway(group.url, ENV)
        worker = start_worker(group.url, sim, concurrency=8, env=ENV)
        accepted: list[str] = []
        sent_at: list[float] = []  # when each accepted request was sent
        accepted_at: list[float] = []
        unavailable: list[httpx.Response] = []
        slowest = 0.0
        running = True

        async def submit() -> None:
            nonlocal slowest
            body = {"model": "sim", "messages": MSG, "max_tokens": 20, "timeout": 300}
            while running:
                started = time.monotonic()
                # A hang would raise ReadTimeout here and fail the test.
                r = await http.post(url + "/v1/jobs", json=body, timeout=ANSWER_BOUND_S * 2)
                slowest = max(slowest, time.monotonic() - started)
                if r.status_code == 202:
                    accepted.append(r.json()["id"])
                    sent_at.append(started)
                    accepted_at.append(time.monotonic())
                elif r.status_code == 429:  # the queue policy sheds a backlog: not the failover's doing
                    await asyncio.sleep(0.1)
                else:
                    assert r.status_code == 503, r.text
                    unavailable.append(r)
                    await asyncio.sleep(0.05)
                await asyncio.sleep(0.01)

        try:
            await wait_until(lambda: served(url), timeout=30)
            clients = [asyncio.create_task(submit()) for _ in range(4)]
            await wait_until(lambda: len(accepted) >= 40, timeout=30)
            killed_at = time.monotonic()
            group.kill_primary()
            await wait_until(lambda: sum(at > killed_at for at in sent_at) >= 40, timeout=RESUME_BOUND_S + 30)
            running = False
            await asyncio.gather(*clients)

            # From the kill to the first acceptance of a request sent after it (one in flight at the
            # kill may have been answered by the old primary just before it died).
            after = [done for sent, done in zip(sent_at, accepted_at, strict=True) if sent > killed_at]
            resumed_s = min(after) - killed_at
            print(
                f"\nsentinel failover: service resumed {resumed_s:.2f} s after kill -9 of the primary; "
                f"{len(unavailable)} admissions answered 503 meanwhile, the slowest answer {slowest:.2f} s"
            )
            assert resumed_s < RESUME_BOUND_S
            assert slowest < ANSWER_BOUND_S
            assert unavailable, "no admission met the failover"
            for r in unavailable:
                assert r.json()["error"]["code"] == "broker_unavailable", r.text
                assert int(r.headers["retry-after"]) >= 1
            for job_id in accepted:
                r = await http.get(f"{url}/v1/jobs/{job_id}", params={"wait": 60}, timeout=70)
                assert r.status_code == 200, f"accepted job {job_id} lost in the failover: {r.text}"
                assert r.json()["status"] == "succeeded", r.json()
        finally:
            running = False
            worker.stop()
            gateway.stop()


async def test_durable_admissions_survive_and_no_job_is_settled_twice(lagged: SentinelGroup) -> None:
    group = lagged
    load = FailoverLoad(group.url, min_replicas=None)  # the default with Sentinel: one replica
    await load.start()
    book = load.ledger
    try:
        await wait_until(lambda: len(book.accepted) >= 100, timeout=30)
        primary = group.primary()
        await asyncio.sleep(random.uniform(0, 0.1))  # any moment, not just as an admission is answered
        killed_at = time.monotonic()
        group.kill_primary(primary)
        resumed_s = await load.assert_nothing_lost_since(
            killed_at, resume_bound_s=RESUME_BOUND_S, answer_bound_s=ANSWER_BOUND_S
        )
        print(
            f"\nsentinel failover, durable, replicas {LINK_DELAY_MS} ms behind: "
            f"{len(book.accepted)} accepted, 0 lost; resumed after {resumed_s:.2f} s; "
            f"{len(book.claimed_twice)} job(s) claimed twice, {len(book.aborted)} run(s) fenced off by a "
            f"heartbeat, {book.refused_finishes} finish(es) refused"
        )
    finally:
        await load.stop()


async def test_without_wait_a_failover_may_lose_admissions(lagged: SentinelGroup) -> None:
    """The same load with the setting off: the loss is measured and printed, never asserted (it
    depends on timing: roughly the admissions answered within the replicas' lag before the kill)."""
    group = lagged
    load = FailoverLoad(group.url, min_replicas=0)
    await load.start()
    book = load.ledger
    try:
        await wait_until(lambda: len(book.accepted) >= 100, timeout=30)
        primary = group.primary()
        await asyncio.sleep(random.uniform(0, 0.1))  # any moment, not just as an admission is answered
        killed_at = time.monotonic()
        group.kill_primary(primary)
        await wait_until(lambda: book.accepted_since(killed_at) >= 20, timeout=RESUME_BOUND_S + 30)
        load.stop_admitting()
        before = book.accepted_before(killed_at)
        lost = await load.missing(before)
        print(
            f"\nsentinel failover, no WAIT, replicas {LINK_DELAY_MS} ms behind: {len(lost)} of {len(before)} "
            "admissions accepted before the kill are gone after it"
        )
        assert book.resumed_after(killed_at) is not None
    finally:
        await load.stop()
