"""kill -9 of a worker mid-generation: the job is re-delivered after its lease and succeeds."""

from __future__ import annotations

import httpx

from sluice.broker.base import BrokerSettings
from sluice.broker.redis import RedisBroker
from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.failures.procs import served, start_gateway, start_worker
from tests.helpers import wait_until
from tests.redis_server import RedisServer

MSG = [{"role": "user", "content": "hi"}]
ENV = {"SLUICE_LEASE_S": "1.5", "SLUICE_MAX_ATTEMPTS": "3"}


async def test_job_survives_its_worker(redis: RedisServer, http: httpx.AsyncClient) -> None:
    async with serve_in_background(preset("fast", model="sim", base_step_s=0.01)) as sim:
        gateway, url = await start_gateway(redis.url, ENV)
        first = start_worker(redis.url, sim, env=ENV)
        try:
            await wait_until(lambda: served(url), timeout=30)
            job_id = (
                await http.post(url + "/v1/jobs", json={"model": "sim", "messages": MSG, "max_tokens": 300})
            ).json()["id"]

            async def streaming() -> bool:
                view = (await http.get(f"{url}/v1/jobs/{job_id}")).json()
                return view["status"] == "running" and view["timings"]["first_token_at"] is not None

            await wait_until(streaming, timeout=30)
            first.kill()
            second = start_worker(redis.url, sim, env=ENV)
            try:
                view = (await http.get(f"{url}/v1/jobs/{job_id}", params={"wait": 30})).json()
                assert view["status"] == "succeeded", view
                assert view["attempts"] == 2
                assert view["usage"]["completion_tokens"] == 300
            finally:
                second.stop()
        finally:
            first.stop()
            gateway.stop()


async def test_job_that_kills_every_worker_is_dead_lettered(
    redis: RedisServer, http: httpx.AsyncClient
) -> None:
    env = {**ENV, "SLUICE_MAX_ATTEMPTS": "2"}
    async with serve_in_background(preset("fast", model="sim", base_step_s=0.01)) as sim:
        gateway, url = await start_gateway(redis.url, env)
        workers = [start_worker(redis.url, sim, env=env)]
        try:
            await wait_until(lambda: served(url), timeout=30)
            body = {"model": "sim", "messages": MSG, "max_tokens": 2000}
            job_id = (await http.post(url + "/v1/jobs", json=body)).json()["id"]
            for attempt in (1, 2):

                async def running(n: int = attempt) -> bool:
                    view = (await http.get(f"{url}/v1/jobs/{job_id}")).json()
                    return view["status"] == "running" and view["attempts"] == n

                await wait_until(running, timeout=30)
                workers[-1].kill()  # the poison job takes its worker down with it
                workers.append(start_worker(redis.url, sim, env=env))
            view = (await http.get(f"{url}/v1/jobs/{job_id}", params={"wait": 30})).json()
            assert view["status"] == "failed" and view["attempts"] == 2
            assert view["error"]["code"] == "attempts_exhausted"
            async with RedisBroker(redis.url, BrokerSettings()) as broker:
                assert job_id in await broker.dead_letters()
        finally:
            for worker in workers:
                worker.stop()
            gateway.stop()
