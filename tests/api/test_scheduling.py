"""Scheduling seen through the API: priority, fairness between tenants, deadline prediction."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from sluice.core.job import JobState
from sluice.core.policy import LEARNING_BATCHES
from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.helpers import wait_until
from tests.servers import Gateway, run_gateway

MSG = [{"role": "user", "content": "hi"}]


@contextlib.asynccontextmanager
async def _one_slow_slot(policy: str) -> AsyncIterator[tuple[str, Gateway]]:
    # 10 ms a token and one slot: a queue forms, and its order is observable.
    async with (
        serve_in_background(preset("fast", model="sim", base_step_s=0.01)) as sim,
        run_gateway([sim], max_concurrency=1, queue_policy=policy) as gw,
    ):
        yield sim, gw


@pytest.fixture
async def one_slow_slot() -> AsyncIterator[tuple[str, Gateway]]:
    # The deadline policy: these tests are of the fair order, not of codel, whose cold start holds a
    # queue above its target for `queue_early_s` (0.5 s) as standing, so that it would refuse some of
    # the jobs they queue whenever the machine is slow enough that posting them takes that long.
    async with _one_slow_slot("deadline") as both:
        yield both


@pytest.fixture
async def one_slow_slot_codel() -> AsyncIterator[tuple[str, Gateway]]:
    async with _one_slow_slot("codel") as both:
        yield both


async def submit(http: httpx.AsyncClient, gw: Gateway, key: str = "k", **body: Any) -> str:
    r = await http.post(
        gw.url + "/v1/jobs",
        json={"model": "sim", "messages": MSG, "max_tokens": 10, **body},
        headers={"Authorization": f"Bearer {key}"},
    )
    assert r.status_code == 202, r.text
    return str(r.json()["id"])


async def started_at(gw: Gateway, job_id: str) -> float:
    job = await gw.broker.wait(job_id, 30)
    assert job is not None and job.state is JobState.SUCCEEDED and job.started_at is not None
    return float(job.started_at)


async def test_high_priority_jumps_the_queue(
    one_slow_slot: tuple[str, Gateway], http: httpx.AsyncClient
) -> None:
    _, gw = one_slow_slot
    blocker = await submit(http, gw, key="other", max_tokens=200)
    await wait_until(lambda: _running(gw, blocker))
    normal = [await submit(http, gw) for _ in range(3)]
    low = await submit(http, gw, priority="low")
    high = await submit(http, gw, priority="high")
    times = {j: await started_at(gw, j) for j in [*normal, low, high]}
    assert times[high] < min(times[j] for j in normal)
    assert times[low] > max(times[j] for j in normal)


async def test_flooding_tenant_cannot_starve_another(
    one_slow_slot: tuple[str, Gateway], http: httpx.AsyncClient
) -> None:
    _, gw = one_slow_slot
    blocker = await submit(http, gw, key="other", max_tokens=200)
    await wait_until(lambda: _running(gw, blocker))
    flood = [await submit(http, gw, key="flooder") for _ in range(12)]
    polite = await submit(http, gw, key="polite")
    polite_start = await started_at(gw, polite)
    flood_starts = [await started_at(gw, j) for j in flood]
    # The flooder queued first, yet at most one of its jobs starts before the polite tenant's.
    assert sum(1 for t in flood_starts if t < polite_start) <= 1


async def test_deadline_unmeetable_is_refused_at_once(
    one_slow_slot_codel: tuple[str, Gateway], http: httpx.AsyncClient
) -> None:
    _, gw = one_slow_slot_codel
    # Finished jobs measure the drain rate; two batches of the one slot end codel's cold start, so
    # the queue below is judged by its deadline, not held as standing after `queue_early_s`.
    for _ in range(LEARNING_BATCHES):
        await started_at(gw, await submit(http, gw, max_tokens=20))
    blocker = await submit(http, gw, max_tokens=3000)
    await wait_until(lambda: _running(gw, blocker))
    await submit(http, gw, max_tokens=3000)  # ~30 s of its tenant's work queued ahead
    r = await http.post(
        gw.url + "/v1/chat/completions",
        json={"model": "sim", "messages": MSG, "max_tokens": 10, "timeout": 5},
        headers={"Authorization": "Bearer k"},
    )
    assert r.status_code == 503 and r.json()["error"]["code"] == "deadline_unmeetable"
    assert 1 <= int(r.headers["retry-after"]) <= 120 and r.headers["x-should-retry"] == "true"
    hopeless = await http.post(
        gw.url + "/v1/jobs", json={"model": "sim", "messages": MSG, "max_tokens": 3000, "timeout": 1}
    )
    assert hopeless.status_code == 503 and hopeless.headers["x-should-retry"] == "false"
    assert int(hopeless.headers["retry-after"]) >= 1
    await http.delete(f"{gw.url}/v1/jobs/{blocker}")


async def _running(gw: Gateway, job_id: str) -> bool:
    job = await gw.broker.get(job_id)
    return job is not None and job.state is JobState.RUNNING


async def test_health_ready_metrics(sim_url: str, http: httpx.AsyncClient) -> None:
    async with run_gateway([sim_url]) as gw:
        assert (await http.get(gw.url + "/healthz")).json() == {"status": "ok"}
        ready = await http.get(gw.url + "/readyz")
        assert ready.status_code == 200 and ready.json()["models"] == {"sim": 8}
        await http.post(
            gw.url + "/v1/chat/completions", json={"model": "sim", "messages": MSG, "max_tokens": 2}
        )
        text = (await http.get(gw.url + "/metrics")).text
        assert 'sluice_jobs_total{model="sim",status="succeeded"} 1.0' in text
        assert 'sluice_slots{model="sim"} 8.0' in text
        assert "sluice_queue_wait_seconds_bucket" in text


async def test_not_ready_without_backends(http: httpx.AsyncClient) -> None:
    # An engine that is not there: nothing is served, so the gateway is not ready, and says why.
    from tests.helpers import free_port

    settings_backend = f"http://127.0.0.1:{free_port()}"
    from sluice.config import load_settings
    from sluice.runtime import build_app
    from tests.servers import run_app

    settings = load_settings(overrides={"backends": [{"url": settings_backend}]}, environ={})
    async with run_app(build_app(settings, dispatch=True)) as url:
        r = await http.get(url + "/readyz")
        assert r.status_code == 503 and "no backend" in r.json()["reason"]
        r = await http.post(url + "/v1/chat/completions", json={"model": "sim", "messages": MSG})
        assert r.status_code == 404
