"""A generation longer than the lease is not re-delivered while its worker is alive."""

from __future__ import annotations

import httpx

from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.failures.procs import served, start_gateway, start_worker
from tests.helpers import wait_until
from tests.redis_server import RedisServer

MSG = [{"role": "user", "content": "hi"}]


async def test_heartbeats_keep_a_long_job(redis: RedisServer, http: httpx.AsyncClient) -> None:
    env = {"SLUICE_LEASE_S": "1"}  # the generation takes about 4 s: four leases
    async with serve_in_background(preset("fast", model="sim", base_step_s=0.01)) as sim:
        gateway, url = await start_gateway(redis.url, env)
        workers = [start_worker(redis.url, sim, env=env), start_worker(redis.url, sim, env=env)]
        try:
            await wait_until(lambda: served(url), timeout=30)
            body = {"model": "sim", "messages": MSG, "max_tokens": 400}
            job_id = (await http.post(url + "/v1/jobs", json=body)).json()["id"]
            view = (await http.get(f"{url}/v1/jobs/{job_id}", params={"wait": 30})).json()
            assert view["status"] == "succeeded" and view["attempts"] == 1
            events = (await http.get(f"{url}/v1/jobs/{job_id}/events")).text
            assert "event: retry" not in events and events.count("event: started") == 1
            stats = (await http.get(sim + "/sim/stats")).json()
            assert stats["finished_total"] == 1 and stats["aborted_total"] == 0  # the engine ran it once
        finally:
            for worker in workers:
                worker.stop()
            gateway.stop()
