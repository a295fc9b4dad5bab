"""Fair at the door, through the API on the simulator: a tenant flooding one class at twice the
engine's capacity does not get another tenant of that class refused.

The engine: two slots of 10 ms a token, answers of 20 tokens, so about 10 answers a second. The
flooder sends 20 requests a second until the queue turns it away; then, each time it has just been
turned away, the light tenant sends one. Each light request lands near the head of the fair order
(one heavy job ahead at most), so admission judges it by that and takes it; at a hard bound the
flooder's newest job gives way to it.

What the test waits for is counted, not timed: the refusals of the flood, the light requests, and
(at a hard bound) an eviction, each bounded by a number of requests, so that a slower machine takes
longer but asks the same question. A light request sent into a queue that has just refused the
flooder is judged by a queue that would refuse it too were it judged by the whole queue.
"""

from __future__ import annotations

import asyncio
from collections import Counter
from typing import Any

import httpx
import pytest

from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.servers import run_gateway

MSG = [{"role": "user", "content": "hi"}]
FLOOD_RPS = 20.0  # twice the capacity
#: light requests, each sent just after a refusal of the flood
LIGHT_REQUESTS = 3
#: at most this many light requests while waiting for the flood's first eviction (a hard bound)
LIGHT_BOUND = 20
#: at most this many flood requests in all (60 s of flood), whatever the machine's speed
FLOOD_BOUND = 1200
#: the answers a turned-away flood request may get: a refusal at the door, or giving way
REFUSALS = {(429, "queue_full"), (503, "deadline_unmeetable"), (502, "evicted")}
#: what else a flood request may come back with: on a machine stalled past the promise it was
#: admitted on, its deadline passing (that is the deadline policy's concern, not fairness's)
LATE = "deadline_exceeded"


async def _ask(http: httpx.AsyncClient, url: str, key: str) -> tuple[int, str | None]:
    r = await http.post(
        url + "/v1/chat/completions",
        json={"model": "sim", "messages": MSG, "max_tokens": 20},
        headers={"Authorization": f"Bearer {key}", "X-Request-Timeout": "10"},
    )
    code = None if r.status_code == 200 else (r.json().get("error") or {}).get("code")
    return r.status_code, code


@pytest.mark.parametrize(
    "settings",
    [
        pytest.param({}, id="codel"),
        # A hard bound the flooder keeps reaching: there its newest job gives way.
        pytest.param({"queue_policy": "deadline", "max_queued_jobs": 4}, id="bounded"),
    ],
)
async def test_a_light_tenant_is_served_beside_a_flooding_one(settings: dict[str, Any]) -> None:
    flood_outcomes: Counter[tuple[int, str | None]] = Counter()
    refused = asyncio.Event()  # set by each refusal of the flood, cleared by each light request
    flooding = True

    async def flood_one(http: httpx.AsyncClient, url: str) -> None:
        outcome = await _ask(http, url, "flood")
        flood_outcomes[outcome] += 1
        if outcome[0] != 200:
            refused.set()

    # A client (and connection pool) for each tenant, as two tenants would have: the light
    # tenant's requests never wait behind the flood's for a connection.
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with (
        serve_in_background(preset("fast", model="sim", base_step_s=0.01)) as sim,
        run_gateway([sim], max_concurrency=2, **settings) as gw,
        httpx.AsyncClient(timeout=30, limits=limits) as flood_http,
        httpx.AsyncClient(timeout=30) as light_http,
    ):

        async def flood() -> int:
            loop = asyncio.get_running_loop()
            start = loop.time()
            tasks = []
            while flooding and len(tasks) < FLOOD_BOUND:
                await asyncio.sleep(max(start + len(tasks) / FLOOD_RPS - loop.time(), 0))
                tasks.append(asyncio.create_task(flood_one(flood_http, gw.url)))
            await asyncio.gather(*tasks)
            return len(tasks)

        flooder = asyncio.create_task(flood())
        light_outcomes: list[tuple[int, str | None]] = []
        try:
            while len(light_outcomes) < LIGHT_REQUESTS or (
                settings and not flood_outcomes[(502, "evicted")] and len(light_outcomes) < LIGHT_BOUND
            ):
                refused.clear()
                waiting = asyncio.create_task(refused.wait())
                await asyncio.wait([waiting, flooder], return_when=asyncio.FIRST_COMPLETED)
                waiting.cancel()
                assert refused.is_set(), f"the flood was never turned away: {flood_outcomes}"
                light_outcomes.append(await _ask(light_http, gw.url, "light"))
        finally:
            flooding = False
            sent = await flooder
    assert light_outcomes == [(200, None)] * len(light_outcomes), light_outcomes
    # Only the flood was turned away, by the queue's own refusals (at a hard bound, by giving way).
    turned_away = {o: n for o, n in flood_outcomes.items() if o[0] != 200}
    assert set(turned_away) & REFUSALS, flood_outcomes
    assert all(o in REFUSALS or o[1] == LATE for o in turned_away), flood_outcomes
    assert sum(flood_outcomes.values()) == sent
    if settings:
        assert flood_outcomes[(502, "evicted")] >= 1, (light_outcomes, flood_outcomes)
    print(f"\n{len(light_outcomes)} light requests served beside {sent} of the flood: {dict(flood_outcomes)}")
