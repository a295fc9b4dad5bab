"""Queue bounds, deadlines, Retry-After, retries on another backend, and client disconnects."""

from __future__ import annotations

import asyncio
import time

import httpx
import openai

from sluice.bench.load import parse_prometheus
from sluice.core.job import JobState
from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.helpers import wait_until
from tests.servers import run_gateway

MSG = [{"role": "user", "content": "hi"}]
SLOW = {"base_step_s": 0.01}  # 10 ms per token: a 4000-token answer holds a slot for ~40 s


async def test_queue_full_answers_429_with_retry_after(http: httpx.AsyncClient) -> None:
    async with (
        serve_in_background(preset("fast", model="sim", **SLOW)) as sim,
        run_gateway([sim], max_concurrency=1, max_queued_jobs=2) as gw,
    ):
        body = {"model": "sim", "messages": MSG, "max_tokens": 4000}
        first = (await http.post(gw.url + "/v1/jobs", json=body)).json()["id"]
        await wait_until(lambda: gw.broker.get(first), timeout=5)

        async def running() -> bool:
            job = await gw.broker.get(first)
            return bool(job.state is JobState.RUNNING)

        await wait_until(running)
        for _ in range(2):
            assert (await http.post(gw.url + "/v1/jobs", json=body)).status_code == 202
        r = await http.post(gw.url + "/v1/jobs", json=body)
        assert r.status_code == 429 and r.json()["error"]["code"] == "queue_full"
        assert 1 <= int(r.headers["retry-after"]) <= 120
        assert 1 <= int(r.headers["retry-after-ms"]) <= 120_000
        assert r.headers["x-should-retry"] == "true"
        sync = await http.post(gw.url + "/v1/chat/completions", json=body)
        assert sync.status_code == 429
        stats = (await gw.broker.stats())["sim"]
        assert stats.queued_jobs == 2 and stats.running_jobs == 1


async def test_queued_job_past_deadline_never_reaches_engine(http: httpx.AsyncClient) -> None:
    async with (
        serve_in_background(preset("fast", model="sim", **SLOW)) as sim,
        run_gateway([sim], max_concurrency=1) as gw,
    ):
        blocker = {"model": "sim", "messages": MSG, "max_tokens": 4000}
        await http.post(gw.url + "/v1/jobs", json=blocker)
        short = (
            await http.post(
                gw.url + "/v1/jobs", json={"model": "sim", "messages": MSG, "max_tokens": 5, "timeout": 0.3}
            )
        ).json()["id"]
        view = (await http.get(f"{gw.url}/v1/jobs/{short}", params={"wait": 10})).json()
        assert view["status"] == "expired" and view["timings"]["started_at"] is None
        assert view["error"]["code"] == "deadline_exceeded"
        stats = (await http.get(sim + "/sim/stats")).json()
        assert stats["finished_total"] + stats["aborted_total"] + stats["running"] + stats["waiting"] == 1


async def test_running_job_past_deadline_is_aborted(http: httpx.AsyncClient) -> None:
    async with (
        serve_in_background(preset("fast", model="sim", **SLOW)) as sim,
        run_gateway([sim], max_concurrency=2) as gw,
    ):
        r = await http.post(
            gw.url + "/v1/chat/completions",
            json={"model": "sim", "messages": MSG, "max_tokens": 4000},
            headers={"X-Request-Timeout": "0.5"},
        )
        assert r.status_code == 504 and r.json()["error"]["code"] == "deadline_exceeded"

        async def aborted() -> bool:
            stats = (await http.get(sim + "/sim/stats")).json()
            return bool(stats["aborted_total"] == 1 and stats["running"] == 0)

        await wait_until(aborted)


async def test_backend_error_is_retried_on_another_backend(http: httpx.AsyncClient) -> None:
    async with (
        serve_in_background(preset("fast", model="sim", fail_first=1000)) as broken,
        serve_in_background(preset("fast", model="sim")) as healthy,
        run_gateway([broken, healthy], max_concurrency=1) as gw,
    ):
        # Each prompt has its own prefix, so prefix affinity sends some to each engine first.
        faults = 0
        for n in range(40):
            messages = [{"role": "user", "content": f"hi {n}"}]
            r = await http.post(
                gw.url + "/v1/jobs", json={"model": "sim", "messages": messages, "max_tokens": 3}
            )
            view = (await http.get(f"{gw.url}/v1/jobs/{r.json()['id']}", params={"wait": 10})).json()
            assert view["status"] == "succeeded", view
            assert view["attempts"] in (1, 2)
            faults = (await http.get(broken + "/sim/stats")).json()["injected_faults"]
            if faults and n >= 3:
                break
        assert faults >= 1


async def test_failing_engine_fails_job_after_max_attempts(http: httpx.AsyncClient) -> None:
    async with (
        serve_in_background(preset("fast", model="sim", fail_first=1000)) as broken,
        run_gateway([broken], max_concurrency=1, max_attempts=2) as gw,
    ):
        r = await http.post(
            gw.url + "/v1/chat/completions", json={"model": "sim", "messages": MSG, "max_tokens": 3}
        )
        assert r.status_code == 502 and r.json()["error"]["type"] == "server_error"
        job = await gw.broker.get(r.headers["x-sluice-job-id"])
        assert job.state is JobState.FAILED and job.attempts == 2


async def test_sync_client_disconnect_cancels_job(http: httpx.AsyncClient) -> None:
    async with (
        serve_in_background(preset("fast", model="sim", **SLOW)) as sim,
        run_gateway([sim], max_concurrency=1) as gw,
    ):
        body = {"model": "sim", "messages": MSG, "max_tokens": 4000}
        running = asyncio.create_task(http.post(gw.url + "/v1/chat/completions", json=body))
        queued = asyncio.create_task(http.post(gw.url + "/v1/chat/completions", json=body))

        async def both_admitted() -> bool:
            s = (await gw.broker.stats())["sim"]
            return bool(s.running_jobs == 1 and s.queued_jobs == 1)

        await wait_until(both_admitted)
        for task in (running, queued):
            task.cancel()
        await asyncio.gather(running, queued, return_exceptions=True)

        async def all_cancelled() -> bool:
            s = (await gw.broker.stats())["sim"]
            engine = (await http.get(sim + "/sim/stats")).json()
            return bool(s.running_jobs == 0 and s.queued_jobs == 0 and engine["aborted_total"] == 1)

        await wait_until(all_cancelled)


async def test_stream_client_disconnect_cancels_job(http: httpx.AsyncClient) -> None:
    async with (
        serve_in_background(preset("fast", model="sim", **SLOW)) as sim,
        run_gateway([sim], max_concurrency=1) as gw,
    ):
        body = {"model": "sim", "messages": MSG, "max_tokens": 4000, "stream": True}
        async with http.stream("POST", gw.url + "/v1/chat/completions", json=body) as r:
            job_id = r.headers["x-sluice-job-id"]
            lines = r.aiter_lines()
            seen = 0
            async for line in lines:
                if line.startswith("data:"):
                    seen += 1
                if seen >= 3:
                    break

        async def cancelled() -> bool:
            job = await gw.broker.get(job_id)
            engine = (await http.get(sim + "/sim/stats")).json()
            return bool(job.state is JobState.CANCELLED and engine["aborted_total"] == 1)

        await wait_until(cancelled)


async def test_sdk_retries_after_retry_after_and_sluice_counts_the_retry(http: httpx.AsyncClient) -> None:
    """The official SDK retries a 429 by itself, after the Retry-After it was given, and marks the
    retry with x-stainless-retry-count; Sluice counts it apart from first tries."""
    async with (
        serve_in_background(preset("fast", model="sim", **SLOW)) as sim,
        run_gateway([sim], max_concurrency=1, queue_policy="cap") as gw,
    ):
        blocker = {"model": "sim", "messages": MSG, "max_tokens": 4000}
        first = (await http.post(gw.url + "/v1/jobs", json=blocker)).json()["id"]

        async def running() -> bool:
            job = await gw.broker.get(first)
            return bool(job and job.state is JobState.RUNNING)

        await wait_until(running)
        # Each answer the SDK got, with when it arrived: the first refusal's Retry-After is the
        # wait the SDK must honour before its retry (the retry's own refusal reserves a later time).
        answers: list[tuple[float, httpx.Response]] = []

        async def heard(response: httpx.Response) -> None:
            answers.append((time.monotonic(), response))

        sdk_http = httpx.AsyncClient(event_hooks={"response": [heard]})
        client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="x", max_retries=1, http_client=sdk_http)
        try:
            await client.chat.completions.create(model="sim", messages=MSG, max_tokens=5)  # type: ignore[arg-type]
        except openai.RateLimitError as exc:
            refusal = exc.response
        else:
            raise AssertionError("the only slot is busy: the cap policy must refuse")
        finally:
            await client.close()
        assert refusal.json()["error"]["code"] == "queue_full"
        (first_at, first), (retry_at, _) = answers  # one refusal, then the retry's
        # The retry left after the first refusal's Retry-After (it is sent within the gap measured
        # here, which ends when its answer arrived).
        assert retry_at - first_at >= float(first.headers["retry-after-ms"]) / 1000
        metrics = parse_prometheus((await http.get(gw.url + "/metrics")).text)
        assert metrics['sluice_client_retries_total{outcome="refused"}'] == 1
        assert metrics['sluice_admissions_total{code="queue_full",outcome="refused"}'] == 2
