"""kill -9 mid-batch, of a worker, of the gateway that drives the batch, and of Redis: the batch still
completes with every line in its output exactly once (real processes on a durable Redis)."""

from __future__ import annotations

import json
from collections.abc import Awaitable, Callable

import httpx

from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.failures.procs import Proc, served, start_gateway, start_worker
from tests.helpers import wait_until
from tests.redis_server import RedisServer

LINES = 120
#: short leases: a dead worker's jobs and a dead gateway's batches are taken over within seconds
ENV = {"SLUICE_LEASE_S": "2", "SLUICE_MAX_ATTEMPTS": "5"}
TERMINAL = {"completed", "failed", "expired", "cancelled"}


def input_file() -> bytes:
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "sim", "messages": [{"role": "user", "content": f"q{i}"}], "max_tokens": 20},
        }
        for i in range(LINES)
    ]
    return "".join(json.dumps(line) + "\n" for line in lines).encode()


async def create_batch(http: httpx.AsyncClient, url: str) -> str:
    r = await http.post(
        url + "/v1/files", files={"file": ("in.jsonl", input_file())}, data={"purpose": "batch"}
    )
    assert r.status_code == 200, r.text
    body = {"input_file_id": r.json()["id"], "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    r = await http.post(url + "/v1/batches", json=body)
    assert r.status_code == 200, r.text
    return str(r.json()["id"])


async def completed_lines(http: httpx.AsyncClient, url: str, batch_id: str) -> int:
    try:
        r = await http.get(f"{url}/v1/batches/{batch_id}", timeout=2)
    except httpx.HTTPError:
        return -1
    if r.status_code != 200:
        return -1
    return int(r.json()["request_counts"]["completed"])


async def check_output(http: httpx.AsyncClient, url: str, batch_id: str) -> None:
    """The batch completed, every line answered, each exactly once."""

    async def done() -> bool:
        try:
            r = await http.get(f"{url}/v1/batches/{batch_id}", timeout=2)
        except httpx.HTTPError:
            return False
        return r.status_code == 200 and r.json()["status"] in TERMINAL

    await wait_until(done, timeout=90)
    batch = (await http.get(f"{url}/v1/batches/{batch_id}")).json()
    assert batch["status"] == "completed", batch
    assert batch["request_counts"] == {"total": LINES, "completed": LINES, "failed": 0}, batch
    assert batch["error_file_id"] is None
    content = (await http.get(f"{url}/v1/files/{batch['output_file_id']}/content")).text
    ids = [json.loads(line)["custom_id"] for line in content.splitlines()]
    assert sorted(ids) == sorted(f"line-{i}" for i in range(LINES))  # none lost, none twice


async def mid_batch(
    http: httpx.AsyncClient, url: str, batch_id: str, between: tuple[int, int] = (10, LINES - 30)
) -> None:
    async def going() -> bool:
        n = await completed_lines(http, url, batch_id)
        assert n < between[1], "the batch ran too fast to be interrupted"
        return n >= between[0]

    await wait_until(going, timeout=60)


async def run_scenario(
    redis: RedisServer,
    http: httpx.AsyncClient,
    interrupt: Callable[[str, str, list[Proc]], Awaitable[str]],
    gateways: int = 1,
) -> None:
    async with serve_in_background(preset("fast", model="sim", base_step_s=0.02)) as sim:
        started = [await start_gateway(redis.url, ENV) for _ in range(gateways)]
        url = started[0][1]
        procs = [started[0][0], start_worker(redis.url, sim, concurrency=4, env=ENV)]
        procs += [proc for proc, _ in started[1:]]
        try:
            await wait_until(lambda: served(url), timeout=30)
            batch_id = await create_batch(http, url)  # the first gateway takes it at once
            await mid_batch(http, url, batch_id)
            url = await interrupt(sim, started[-1][1], procs)
            # interrupted mid-way: the batch had lines left when its process went (read once it
            # answers: a read right after the interruption may still fail, and is not an answer)
            seen: list[int] = []

            async def known() -> bool:
                seen.append(await completed_lines(http, url, batch_id))
                return seen[-1] >= 0

            await wait_until(known, timeout=30)
            assert 0 <= seen[-1] < LINES
            await check_output(http, url, batch_id)
        finally:
            for proc in procs:
                proc.stop()


async def test_a_killed_worker_loses_no_line(redis: RedisServer, http: httpx.AsyncClient) -> None:
    async def kill_worker(sim: str, url: str, procs: list[Proc]) -> str:
        procs[1].kill()
        procs.append(start_worker(redis.url, sim, concurrency=4, env=ENV))
        return url

    await run_scenario(redis, http, kill_worker)


async def test_a_killed_gateway_hands_its_batch_over(redis: RedisServer, http: httpx.AsyncClient) -> None:
    async def kill_gateway(sim: str, other_url: str, procs: list[Proc]) -> str:
        # The batch's runner is the first gateway's; the second takes it over once its lease lapses.
        procs[0].kill()
        return other_url

    await run_scenario(redis, http, kill_gateway, gateways=2)


async def test_a_killed_redis_loses_no_line(redis: RedisServer, http: httpx.AsyncClient) -> None:
    async def kill_redis(sim: str, url: str, procs: list[Proc]) -> str:
        redis.kill()
        redis.start()
        return url

    await run_scenario(redis, http, kill_redis)
