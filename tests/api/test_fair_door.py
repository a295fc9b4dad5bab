"""Fair at the door, through the API on the simulator: a tenant flooding one class at twice the
engine's capacity does not get another tenant of that class refused.

The engine: two slots of 10 ms a token, answers of 20 tokens, so about 10 answers a second. The
flooder sends 20 requests a second for 6 s; the light tenant one every 2 s. Each light request
lands near the head of the fair order (one heavy job ahead at most), so admission judges it by that
and takes it; at a hard bound the flooder's newest job gives way to it.
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
LOAD_S = 6.0
LIGHT_EVERY_S = 2.0


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
async def test_a_light_tenant_is_served_beside_a_flooding_one(
    http: httpx.AsyncClient, settings: dict[str, Any]
) -> None:
    async with (
        serve_in_background(preset("fast", model="sim", base_step_s=0.01)) as sim,
        run_gateway([sim], max_concurrency=2, **settings) as gw,
    ):
        loop = asyncio.get_running_loop()
        start = loop.time()
        flood: list[asyncio.Task[tuple[int, str | None]]] = []
        light: list[asyncio.Task[tuple[int, str | None]]] = []
        n_flood = int(FLOOD_RPS * LOAD_S)
        arrivals = sorted(
            [(i / FLOOD_RPS, "flood") for i in range(n_flood)]
            + [(0.5 + i * LIGHT_EVERY_S, "light") for i in range(int(LOAD_S / LIGHT_EVERY_S))]
        )
        for at, who in arrivals:
            await asyncio.sleep(max(start + at - loop.time(), 0))
            task = asyncio.create_task(_ask(http, gw.url, who))
            (flood if who == "flood" else light).append(task)
        light_outcomes = await asyncio.gather(*light)
        flood_outcomes = Counter(await asyncio.gather(*flood))
    assert light_outcomes == [(200, None)] * len(light), light_outcomes
    # The flood was an overload: the queue turned it away or made it give way, in its own share.
    turned_away = sum(n for (status, _), n in flood_outcomes.items() if status != 200)
    assert turned_away >= n_flood // 4, flood_outcomes
    if settings:
        assert flood_outcomes[(502, "evicted")] >= 1, flood_outcomes
