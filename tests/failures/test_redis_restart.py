"""Redis restarted under load (AOF, appendfsync always): nothing accepted is lost, everyone reconnects,
and while Redis is down the gateway answers 503 with Retry-After at once instead of hanging."""

from __future__ import annotations

import asyncio
import time

import httpx
import pytest

from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.failures.procs import served, start_gateway, start_worker
from tests.helpers import wait_until
from tests.redis_server import RedisServer

MSG = [{"role": "user", "content": "hi"}]
TERMINAL = {"succeeded", "failed", "cancelled", "expired"}
#: admissions each phase (before the outage, after the restart) must have accepted: counted, not
#: timed, since how many the queue policy takes of a given number sent is the workers' speed (on a
#: loaded machine a standing queue is refused until it drains)
ACCEPTED_EACH = 30
#: the most requests one phase sends, and the longest it sends them (seconds): bounds for a
#: loaded machine, far beyond what the phase takes alone (30 to 40 requests, a second or two)
MAX_SENT, MAX_SENDING_S = 2000, 60.0


#: its bounds: the gateway and the worker up (30 s each), two phases of sending, the jobs' ends
@pytest.mark.timeout(300)
async def test_nothing_accepted_is_lost(redis: RedisServer, http: httpx.AsyncClient) -> None:
    async with serve_in_background(preset("fast", model="sim", base_step_s=0.002)) as sim:
        gateway, url = await start_gateway(redis.url)
        worker = start_worker(redis.url, sim, concurrency=4)
        accepted: list[str] = []
        turned_away: list[int] = []  # the status of each request not accepted
        try:
            await wait_until(lambda: served(url), timeout=30)
            body = {"model": "sim", "messages": MSG, "max_tokens": 50, "timeout": 120}

            async def submit() -> int:
                """Send until ACCEPTED_EACH more are accepted (bounded); returns how many were."""
                got, give_up = 0, time.monotonic() + MAX_SENDING_S
                for _ in range(MAX_SENT):
                    if got >= ACCEPTED_EACH or time.monotonic() > give_up:
                        break
                    try:
                        r = await http.post(url + "/v1/jobs", json=body, timeout=5)
                    except httpx.HTTPError:
                        await asyncio.sleep(0.05)
                        continue
                    if r.status_code == 202:
                        accepted.append(r.json()["id"])
                        got += 1
                        await asyncio.sleep(0.01)
                    else:
                        # Refused by the queue (a standing queue drains at the workers' speed) or
                        # unavailable (reconnecting): as a client honouring Retry-After would,
                        # only sooner.
                        assert r.status_code in (429, 503), r.text
                        turned_away.append(r.status_code)
                        await asyncio.sleep(0.05)
                return got

            before_outage = await submit()
            redis.kill()
            # Down: answers come at once, 503 with Retry-After, never a hang.
            for _ in range(5):
                # A hang would raise ReadTimeout here; the answer must come well inside 2 s.
                r = await http.post(url + "/v1/jobs", json=body, timeout=2)
                assert r.status_code == 503 and r.json()["error"]["code"] == "broker_unavailable", r.text
                assert int(r.headers["retry-after"]) >= 1
            redis.start()
            after_restart = await submit()  # gateway and worker reconnected by themselves
            # That admissions were accepted again after the restart is what shows the reconnection.
            assert (before_outage, after_restart) == (ACCEPTED_EACH, ACCEPTED_EACH)
            print(
                f"\nredis restart: {len(accepted)} accepted, {turned_away.count(429)} refused (429) and "
                f"{turned_away.count(503)} unavailable (503) on the way"
            )
            for job_id in accepted:
                view = (await http.get(f"{url}/v1/jobs/{job_id}", params={"wait": 60}, timeout=70)).json()
                assert view["status"] in TERMINAL, view
                assert view["status"] == "succeeded", view
        finally:
            worker.stop()
            gateway.stop()
