"""kill -9 of one engine of a pool mid-run: its jobs finish on the others within their deadlines,
none is lost and none runs to the end twice."""

from __future__ import annotations

import httpx

from tests.helpers import wait_until
from tests.servers import run_gateway
from tests.test_dispatcher_fleet import Sim, sims, submit

JOBS = 30


async def _running(sim: Sim) -> bool:
    async with httpx.AsyncClient() as c:
        text = (await c.get(sim.url + "/metrics", timeout=5)).text
    return any(
        line.startswith("vllm:num_requests_running") and float(line.split()[-1]) > 0
        for line in text.splitlines()
    )


async def test_a_killed_engine_s_jobs_finish_on_the_others(http: httpx.AsyncClient) -> None:
    # About a second per answer (100 tokens at 10 ms a step), on engines of two speeds.
    slow = ("--base-step-ms", "10")
    slower = ("--base-step-ms", "15")
    async with sims(("m", slow), ("m", slower), ("m", slow)) as engines:
        victim = engines[1]
        pools = [{"name": "gpu", "engines": [e.url for e in engines], "max_concurrency": 4}]
        # Admission is not under test: every job is queued (fifo), none refused for a standing queue.
        async with run_gateway(
            [], pools=pools, default_timeout_s=60.0, queue_policy="fifo", fifo_max_queued=1000
        ) as gw:
            ids = await submit(http, gw, "m", JOBS, max_tokens=100)
            await wait_until(lambda: _running(victim), timeout=30)
            victim.proc.kill()

            ran: dict[str, str] = {}
            retried = 0
            for job_id in ids:
                view = (await http.get(f"{gw.url}/v1/jobs/{job_id}", params={"wait": 60})).json()
                assert view["status"] == "succeeded", view
                assert view["usage"]["completion_tokens"] == 100
                job = await gw.broker.get(job_id)
                assert job.finished_at <= job.deadline  # within its deadline
                ran[job_id] = job.backend
                retried += job.attempts > 1

            victim_name = f"gpu/127.0.0.1:{victim.port}"
            survivors = [e for e in engines if e is not victim]
            on_survivors = sum(1 for name in ran.values() if name != victim_name)
            # The jobs running on the victim moved: some were retried, and every job ended once.
            assert retried >= 1 and len(ran) == JOBS
            # Counted at the survivors: what they finished is exactly the jobs that ended there
            # (nothing ran to the end twice).
            assert sum([await e.finished() for e in survivors]) == on_survivors
            rows = {row["name"]: row for row in gw.app.state.backends.backends()}
            assert rows[victim_name]["health"]["ejections"] >= 1
