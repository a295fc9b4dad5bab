"""SIGTERM to a worker under load (scaling in): it stops claiming, lets its jobs finish within the
grace period, hands the rest back to the head of the queue and exits 0; a second worker finishes
what was handed back. Every accepted job ends exactly once, and none is answered twice by the
engine: a counting front of the simulator tells how often each job reached it and was answered."""

from __future__ import annotations

import asyncio
import collections
import contextlib
import os
import re
import signal
from collections.abc import AsyncIterator
from typing import Any

import httpx

from sluice.sim.model import preset
from sluice.sim.server import create_app
from tests.failures.procs import Proc, served, start_gateway, start_worker
from tests.helpers import wait_until
from tests.redis_server import RedisServer
from tests.servers import run_app

# A lease far longer than any test's waits: a job that comes back does so because it was handed
# back, never because its lease ran out. The FIFO queue takes every job of the load (the test is
# about what happens to them, not about admission).
ENV = {"SLUICE_LEASE_S": "120", "SLUICE_LOG_LEVEL": "info", "SLUICE_QUEUE_POLICY": "fifo"}
TAG = re.compile(rb"tag-(\d+)")


class CountingEngine:
    """The simulator behind an ASGI front that counts, per job (the ``tag-N`` in its prompt), the
    requests that reached the engine and the answers it sent to the end."""

    def __init__(self, **params: Any) -> None:
        self.app = create_app(preset("fast", model="sim", **params))
        self.requests: collections.Counter[int] = collections.Counter()
        self.answered: collections.Counter[int] = collections.Counter()

    def engine_stats(self) -> dict[str, Any]:
        stats: dict[str, Any] = self.app.state.sim.stats()
        return stats

    async def __call__(self, scope: Any, receive: Any, send: Any) -> None:
        if scope["type"] != "http" or not scope["path"].endswith("completions"):
            await self.app(scope, receive, send)
            return
        messages = []
        body = b""
        while True:  # read the body to find the tag, then hand it on unchanged
            message = await receive()
            messages.append(message)
            body += message.get("body", b"")
            if not message.get("more_body"):
                break
        found = TAG.search(body)
        tag = int(found.group(1)) if found else -1
        self.requests[tag] += 1
        replay = iter(messages)
        status = [0]

        async def replayed() -> Any:
            return next(replay, None) or await receive()

        async def counted(message: Any) -> None:
            if message["type"] == "http.response.start":
                status[0] = message["status"]
            await send(message)
            if message["type"] == "http.response.body" and not message.get("more_body") and status[0] == 200:
                self.answered[tag] += 1

        await self.app(scope, replayed, counted)


@contextlib.asynccontextmanager
async def counting_engine(**params: Any) -> AsyncIterator[tuple[CountingEngine, str]]:
    engine = CountingEngine(**params)
    async with run_app(engine) as url:  # type: ignore[arg-type]
        yield engine, url


async def submit(http: httpx.AsyncClient, url: str, tag: int, max_tokens: int) -> str:
    body = {"model": "sim", "messages": [{"role": "user", "content": f"tag-{tag}"}], "max_tokens": max_tokens}
    r = await http.post(url + "/v1/jobs", json=body)
    assert r.status_code == 202, r.text
    job_id: str = r.json()["id"]
    return job_id


async def views(http: httpx.AsyncClient, url: str, ids: list[str]) -> list[dict[str, Any]]:
    return [(await http.get(f"{url}/v1/jobs/{job_id}")).json() for job_id in ids]


async def streaming(http: httpx.AsyncClient, url: str, ids: list[str], count: int) -> bool:
    """Whether ``count`` of the jobs are running and have streamed a token."""
    running = [
        v for v in await views(http, url, ids) if v["status"] == "running" and v["timings"]["first_token_at"]
    ]
    return len(running) >= count


async def exited(proc: Proc, timeout: float) -> int:
    await wait_until(lambda: not proc.alive, timeout=timeout)
    code = proc.popen.returncode
    assert code is not None
    return code


async def all_succeeded(http: httpx.AsyncClient, url: str, ids: list[str], max_tokens: int) -> None:
    for job_id in ids:
        view = (await http.get(f"{url}/v1/jobs/{job_id}", params={"wait": 30})).json()
        assert view["status"] == "succeeded", view
        assert view["usage"]["completion_tokens"] == max_tokens, view
        # A job handed back is not charged the attempt it gave up: it ran once, to the end.
        assert view["attempts"] == 1, view


def sigterm(proc: Proc) -> None:
    os.kill(proc.popen.pid, signal.SIGTERM)


async def test_running_jobs_finish_within_the_grace_and_the_queue_waits_for_another_worker(
    redis: RedisServer, http: httpx.AsyncClient
) -> None:
    tokens = 150
    async with counting_engine(base_step_s=0.01) as (engine, sim):
        gateway, url = await start_gateway(redis.url, ENV)
        first = start_worker(redis.url, sim, concurrency=2, env={**ENV, "SLUICE_DRAIN_GRACE_S": "60"})
        second: Proc | None = None
        try:
            await wait_until(lambda: served(url), timeout=30)
            ids = [await submit(http, url, i, tokens) for i in range(6)]
            await wait_until(lambda: streaming(http, url, ids, 2), timeout=30)
            sigterm(first)
            assert await exited(first, timeout=30) == 0, first.output()
            assert "worker drained" in first.output()
            seen = await views(http, url, ids)
            done = [v for v in seen if v["status"] == "succeeded"]
            # Its two running jobs finished on it; it claimed nothing after the signal.
            assert len(done) == 2, seen
            assert sorted(v["status"] for v in seen) == ["queued"] * 4 + ["succeeded"] * 2
            second = start_worker(redis.url, sim, concurrency=4, env=ENV)
            await all_succeeded(http, url, ids, tokens)
            assert engine.requests == {i: 1 for i in range(6)}
            assert engine.answered == {i: 1 for i in range(6)}
            assert engine.engine_stats()["aborted_total"] == 0
        finally:
            for proc in (first, second, gateway):
                if proc is not None:
                    proc.stop()


async def test_a_second_sigterm_hands_the_running_jobs_back_at_once(
    redis: RedisServer, http: httpx.AsyncClient
) -> None:
    tokens = 1000  # about 5 s each: far longer than the worker takes to go after the second signal
    async with counting_engine(base_step_s=0.005) as (engine, sim):
        gateway, url = await start_gateway(redis.url, ENV)
        first = start_worker(redis.url, sim, concurrency=2, env={**ENV, "SLUICE_DRAIN_GRACE_S": "600"})
        second: Proc | None = None
        try:
            await wait_until(lambda: served(url), timeout=30)
            ids = [await submit(http, url, i, tokens) for i in range(3)]
            await wait_until(lambda: streaming(http, url, ids, 2), timeout=30)
            sigterm(first)
            await wait_until(lambda: "draining" in first.output(), timeout=10)
            assert first.alive  # waiting for its jobs, which have seconds to go
            sigterm(first)
            assert await exited(first, timeout=30) == 0, first.output()
            seen = await views(http, url, ids)
            # Handed back to the head of the queue, unfinished: had it waited for them (the grace
            # is long), they would have succeeded; and a worker that is gone holds no lease on them.
            assert [v["status"] for v in seen] == ["queued"] * 3, seen
            assert all(v["attempts"] == 0 for v in seen), seen
            second = start_worker(redis.url, sim, concurrency=4, env=ENV)
            await all_succeeded(http, url, ids, tokens)
            started_twice = {i for i, n in engine.requests.items() if n == 2}
            assert len(started_twice) == 2 and set(engine.requests.values()) <= {1, 2}, engine.requests
            assert engine.answered == {
                i: 1 for i in range(3)
            }  # the first attempts were aborted, not answered
            await wait_until(lambda: engine.engine_stats()["aborted_total"] == 2, timeout=10)
        finally:
            for proc in (first, second, gateway):
                if proc is not None:
                    proc.stop()


async def test_sigterm_under_load_loses_no_job_and_runs_none_twice(
    redis: RedisServer, http: httpx.AsyncClient
) -> None:
    tokens = 300  # about 1.5 s each, and a grace of a fraction of that: running jobs are handed back
    async with counting_engine(base_step_s=0.005) as (engine, sim):
        gateway, url = await start_gateway(redis.url, ENV)
        leaving = start_worker(redis.url, sim, concurrency=3, env={**ENV, "SLUICE_DRAIN_GRACE_S": "0.3"})
        staying = start_worker(redis.url, sim, concurrency=3, env=ENV)
        try:
            await wait_until(lambda: served(url), timeout=30)
            ids = [await submit(http, url, i, tokens) for i in range(8)]
            await wait_until(lambda: streaming(http, url, ids, 6), timeout=30)
            more = asyncio.gather(*(submit(http, url, i, tokens) for i in range(8, 16)))
            sigterm(leaving)
            ids += await more  # admitted while the worker drains
            assert await exited(leaving, timeout=30) == 0, leaving.output()
            await all_succeeded(http, url, ids, tokens)
            assert engine.answered == {i: 1 for i in range(16)}
            assert set(engine.requests) == set(range(16)) and set(engine.requests.values()) <= {1, 2}
            again = sum(n - 1 for n in engine.requests.values())
            assert again >= 1  # some running job was handed back (and aborted) when the grace ran out
            await wait_until(lambda: engine.engine_stats()["aborted_total"] == again, timeout=10)
        finally:
            for proc in (leaving, staying, gateway):
                proc.stop()
