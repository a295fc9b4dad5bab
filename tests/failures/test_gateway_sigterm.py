"""SIGTERM to a gateway (scaling in, a rolling update): ``/readyz`` turns 503 at once while
``/healthz`` stays 200, new requests are refused with 503 and Retry-After, the stream and the
synchronous request that were open finish whole, the async job it admitted is run by the workers,
and the process exits 0. And ``sluice serve``: on the embedded broker its queue is worked off
before it exits, a stream open at the signal finishes; on Redis, what its dispatcher still runs at
the end of the grace is handed back to the other workers."""

from __future__ import annotations

import asyncio
import os
import signal
from typing import Any

import httpx
import openai

from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.failures.procs import Proc, served, start_gateway, start_worker, wait_answering
from tests.failures.test_worker_sigterm import counting_engine, submit
from tests.helpers import free_port, wait_until
from tests.redis_server import RedisServer

MSG = [{"role": "user", "content": "hi"}]
ENV = {"SLUICE_LOG_LEVEL": "info", "SLUICE_QUEUE_POLICY": "fifo", "SLUICE_DRAIN_GRACE_S": "120"}
TOKENS = 300  # about 3 s an answer: open long after the signal


async def readiness(url: str) -> tuple[int, dict[str, Any]]:
    async with httpx.AsyncClient() as c:
        r = await c.get(url + "/readyz", timeout=5)
        return r.status_code, r.json()


async def exited(proc: Proc, timeout: float = 60) -> int:
    await wait_until(lambda: not proc.alive, timeout=timeout)
    code = proc.popen.returncode
    assert code is not None
    return code


async def read_stream(client: openai.AsyncOpenAI, first: asyncio.Event) -> tuple[int, int]:
    """(content chunks, completion tokens in the usage) of one whole stream; ``first`` is set at
    its first content chunk."""
    stream = await client.chat.completions.create(
        model="sim", messages=MSG, max_tokens=TOKENS, stream=True, stream_options={"include_usage": True}
    )  # type: ignore[call-overload]
    chunks, usage = 0, 0
    async for chunk in stream:
        if chunk.choices and chunk.choices[0].delta.content:
            chunks += 1
            first.set()
        if chunk.usage is not None:
            usage = chunk.usage.completion_tokens
    return chunks, usage


async def test_gateway_drains_on_sigterm(redis: RedisServer, http: httpx.AsyncClient) -> None:
    async with serve_in_background(preset("fast", model="sim", base_step_s=0.01)) as sim:
        gateway, url = await start_gateway(redis.url, ENV)
        other: Proc | None = None
        worker = start_worker(redis.url, sim, concurrency=4, env=ENV)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        try:
            await wait_until(lambda: served(url), timeout=30)
            assert (await readiness(url))[0] == 200
            first = asyncio.Event()
            stream = asyncio.ensure_future(read_stream(client, first))
            whole = asyncio.ensure_future(
                client.chat.completions.create(model="sim", messages=MSG, max_tokens=TOKENS)
            )
            job_id = await submit(http, url, 0, TOKENS)
            async with asyncio.timeout(30):
                await first.wait()

            os.kill(gateway.popen.pid, signal.SIGTERM)

            async def draining() -> bool:
                status, body = await readiness(url)
                return status == 503 and body["status"] == "draining"

            await wait_until(draining, timeout=10)
            async with httpx.AsyncClient() as fresh:
                assert (await fresh.get(url + "/healthz")).status_code == 200
                refused = await fresh.post(
                    url + "/v1/chat/completions", json={"model": "sim", "messages": MSG, "max_tokens": 5}
                )
            assert refused.status_code == 503, refused.text
            assert refused.headers["retry-after"] == "1"
            assert refused.json()["error"]["code"] == "shutting_down"
            assert gateway.alive and not stream.done()  # it waits for the stream

            assert await stream == (TOKENS, TOKENS)
            answer = await whole
            assert answer.usage is not None and answer.usage.completion_tokens == TOKENS
            assert await exited(gateway) == 0, gateway.output()
            assert "drained" in gateway.output()
            assert "cut off" not in gateway.output()
            # The async job it admitted is the workers': another gateway reads its answer.
            other, other_url = await start_gateway(redis.url, ENV)
            view = (await http.get(f"{other_url}/v1/jobs/{job_id}", params={"wait": 30})).json()
            assert view["status"] == "succeeded" and view["usage"]["completion_tokens"] == TOKENS, view
        finally:
            await client.close()
            for proc in (gateway, worker, other):
                if proc is not None:
                    proc.stop()


async def test_serve_works_off_its_embedded_queue_before_it_exits(http: httpx.AsyncClient) -> None:
    async with counting_engine(base_step_s=0.005) as (engine, sim):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        proc = Proc(["serve", "--backend", sim, "--max-concurrency", "2", "--port", str(port)], ENV)
        client = openai.AsyncOpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=60)
        try:
            await wait_answering(proc, lambda: served(url))
            first = asyncio.Event()
            stream = asyncio.ensure_future(read_stream(client, first))
            async with asyncio.timeout(30):
                await first.wait()
            # Queued behind the stream and each other (two slots): none has started at the signal.
            for tag in range(1, 6):
                await submit(http, url, tag, TOKENS)
            os.kill(proc.popen.pid, signal.SIGTERM)
            assert await stream == (TOKENS, TOKENS)
            assert await exited(proc) == 0, proc.output()
            assert "jobs left" not in proc.output()
            # Every async job it had accepted was run to its end before the process went.
            assert {tag: n for tag, n in engine.answered.items() if tag >= 1} == {t: 1 for t in range(1, 6)}
        finally:
            await client.close()
            proc.stop()


async def test_serve_on_redis_hands_its_jobs_back_to_the_other_workers(
    redis: RedisServer, http: httpx.AsyncClient
) -> None:
    tokens = 1000  # about 5 s: still running when the half-second grace ends
    async with counting_engine(base_step_s=0.005) as (engine, sim):
        port = free_port()
        url = f"http://127.0.0.1:{port}"
        args = ["serve", "--broker", redis.url, "--backend", sim, "--max-concurrency", "1"]
        args += ["--port", str(port)]
        proc = Proc(args, {**ENV, "SLUICE_DRAIN_GRACE_S": "0.5", "SLUICE_LEASE_S": "120"})
        gateway: Proc | None = None
        worker: Proc | None = None
        try:
            await wait_answering(proc, lambda: served(url))
            job_id = await submit(http, url, 1, tokens)

            async def streaming() -> bool:
                view = (await http.get(f"{url}/v1/jobs/{job_id}")).json()
                return view["status"] == "running" and view["timings"]["first_token_at"] is not None

            await wait_until(streaming, timeout=30)
            os.kill(proc.popen.pid, signal.SIGTERM)
            assert await exited(proc) == 0, proc.output()
            gateway, gateway_url = await start_gateway(redis.url, ENV)
            # Handed back (a lease of 120 s would keep it away from the new worker otherwise).
            view = (await http.get(f"{gateway_url}/v1/jobs/{job_id}")).json()
            assert view["status"] == "queued" and view["attempts"] == 0, view
            worker = start_worker(redis.url, sim, env=ENV)
            view = (await http.get(f"{gateway_url}/v1/jobs/{job_id}", params={"wait": 30})).json()
            assert view["status"] == "succeeded" and view["attempts"] == 1, view
            assert view["usage"]["completion_tokens"] == tokens
            assert engine.requests[1] == 2 and engine.answered[1] == 1
        finally:
            for p in (proc, gateway, worker):
                if p is not None:
                    p.stop()
