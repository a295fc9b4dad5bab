"""Retry-After is a reservation, through the API: the refusals of a burst, all of one tenant and
one kind, are told distinct times, spread over the capacity that frees (admission.reserve), and
the gateway does not collapse them into one."""

from __future__ import annotations

import itertools

import httpx

from sluice.core.job import JobState
from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.helpers import wait_until
from tests.servers import run_gateway

MSG = [{"role": "user", "content": "hi"}]


async def test_a_burst_of_refusals_is_told_distinct_times(http: httpx.AsyncClient) -> None:
    async with (
        serve_in_background(preset("fast", model="sim", base_step_s=0.01)) as sim,
        run_gateway([sim], max_concurrency=1, max_queued_jobs=1, queue_policy="deadline") as gw,
    ):
        body = {"model": "sim", "messages": MSG, "max_tokens": 4000}
        first = (await http.post(gw.url + "/v1/jobs", json=body)).json()["id"]

        async def running() -> bool:
            job = await gw.broker.get(first)
            return bool(job and job.state is JobState.RUNNING)

        await wait_until(running)
        assert (await http.post(gw.url + "/v1/jobs", json=body)).status_code == 202
        told = []
        for _ in range(5):
            r = await http.post(gw.url + "/v1/jobs", json={**body, "max_tokens": 100})
            assert r.status_code == 429 and r.headers["x-should-retry"] == "true"
            told.append(int(r.headers["retry-after-ms"]))
        # Each one later than the one before, by a job's cost at half the drain rate (the prior
        # 50 a second on one slot: 4.3 s for the 108 cost units of each, less the time passed).
        steps = [b - a for a, b in itertools.pairwise(told)]
        assert all(4000 <= s <= 4400 for s in steps), told
        await http.delete(f"{gw.url}/v1/jobs/{first}")
