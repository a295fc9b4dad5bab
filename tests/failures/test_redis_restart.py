"""Redis restarted under load (AOF, appendfsync always): nothing accepted is lost, everyone reconnects,
and while Redis is down the gateway answers 503 with Retry-After at once instead of hanging."""

from __future__ import annotations

import asyncio

import httpx

from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.failures.procs import served, start_gateway, start_worker
from tests.helpers import wait_until
from tests.redis_server import RedisServer

MSG = [{"role": "user", "content": "hi"}]
TERMINAL = {"succeeded", "failed", "cancelled", "expired"}


async def test_nothing_accepted_is_lost(redis: RedisServer, http: httpx.AsyncClient) -> None:
    async with serve_in_background(preset("fast", model="sim", base_step_s=0.002)) as sim:
        gateway, url = await start_gateway(redis.url)
        worker = start_worker(redis.url, sim, concurrency=4)
        accepted: list[str] = []
        try:
            await wait_until(lambda: served(url), timeout=30)
            body = {"model": "sim", "messages": MSG, "max_tokens": 50, "timeout": 120}

            async def submit(n: int) -> None:
                for _ in range(n):
                    try:
                        r = await http.post(url + "/v1/jobs", json=body, timeout=5)
                    except httpx.HTTPError:
                        continue
                    if r.status_code == 202:
                        accepted.append(r.json()["id"])
                    else:
                        assert r.status_code in (429, 503), r.text
                    await asyncio.sleep(0.01)

            await submit(40)
            before_outage = len(accepted)
            redis.kill()
            # Down: answers come at once, 503 with Retry-After, never a hang.
            for _ in range(5):
                # A hang would raise ReadTimeout here; the answer must come well inside 2 s.
                r = await http.post(url + "/v1/jobs", json=body, timeout=2)
                assert r.status_code == 503 and r.json()["error"]["code"] == "broker_unavailable", r.text
                assert int(r.headers["retry-after"]) >= 1
            redis.start()
            await submit(40)  # gateway and worker reconnected by themselves
            # How many the queue policy takes depends on the machine's speed; that some were taken
            # after the restart is what shows the reconnection.
            assert before_outage > 0 and len(accepted) > before_outage
            for job_id in accepted:
                view = (await http.get(f"{url}/v1/jobs/{job_id}", params={"wait": 60}, timeout=70)).json()
                assert view["status"] in TERMINAL, view
                assert view["status"] == "succeeded", view
        finally:
            worker.stop()
            gateway.stop()
