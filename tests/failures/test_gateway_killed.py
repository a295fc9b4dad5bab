"""kill -9 of a gateway while clients wait: their jobs finish, and another gateway serves the results."""

from __future__ import annotations

import asyncio

import httpx

from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.failures.procs import served, start_gateway, start_worker
from tests.helpers import wait_until
from tests.redis_server import RedisServer

MSG = [{"role": "user", "content": "hi"}]


async def test_results_outlive_their_gateway(redis: RedisServer, http: httpx.AsyncClient) -> None:
    async with serve_in_background(preset("fast", model="sim", base_step_s=0.005)) as sim:
        doomed, doomed_url = await start_gateway(redis.url)
        other, other_url = await start_gateway(redis.url)
        worker = start_worker(redis.url, sim, concurrency=4)
        try:
            await wait_until(lambda: served(doomed_url), timeout=30)
            ids = [
                (
                    await http.post(
                        doomed_url + "/v1/jobs", json={"model": "sim", "messages": MSG, "max_tokens": 200}
                    )
                ).json()["id"]
                for _ in range(8)
            ]
            # Clients long-poll the gateway that is about to die.
            polls = [
                asyncio.create_task(http.get(f"{doomed_url}/v1/jobs/{job_id}", params={"wait": 30}))
                for job_id in ids
            ]
            await asyncio.sleep(0.2)
            doomed.kill()
            outcomes = await asyncio.gather(*polls, return_exceptions=True)
            assert all(isinstance(o, httpx.HTTPError) for o in outcomes)  # the connections died with it
            for job_id in ids:
                view = (await http.get(f"{other_url}/v1/jobs/{job_id}", params={"wait": 30})).json()
                assert view["status"] == "succeeded" and view["usage"]["completion_tokens"] == 200
            # The events of a job made through the dead gateway replay through the live one.
            events = (await http.get(f"{other_url}/v1/jobs/{ids[0]}/events")).text
            assert events.count("event: token") == 200 and "event: done" in events
        finally:
            worker.stop()
            other.stop()
            doomed.stop()


async def test_cancel_through_another_gateway(redis: RedisServer, http: httpx.AsyncClient) -> None:
    async with serve_in_background(preset("fast", model="sim", base_step_s=0.01)) as sim:
        a, a_url = await start_gateway(redis.url)
        b, b_url = await start_gateway(redis.url)
        worker = start_worker(redis.url, sim, concurrency=1)
        try:
            await wait_until(lambda: served(a_url), timeout=30)
            job_id = (
                await http.post(
                    a_url + "/v1/jobs", json={"model": "sim", "messages": MSG, "max_tokens": 3000}
                )
            ).json()["id"]

            async def running() -> bool:
                return bool((await http.get(f"{b_url}/v1/jobs/{job_id}")).json()["status"] == "running")

            await wait_until(running, timeout=30)
            r = await http.delete(f"{b_url}/v1/jobs/{job_id}")
            assert r.status_code == 200 and r.json()["status"] == "cancelled"

            async def engine_aborted() -> bool:
                stats = (await http.get(sim + "/sim/stats")).json()
                return bool(stats["aborted_total"] == 1 and stats["running"] == 0)

            await wait_until(engine_aborted, timeout=30)
            assert (await http.get(f"{a_url}/v1/jobs/{job_id}")).json()["status"] == "cancelled"
        finally:
            worker.stop()
            a.stop()
            b.stop()
