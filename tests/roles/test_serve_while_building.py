"""`sluice serve` answers while its local engine is provisioned, and says how far along it is.

The engine here is the simulator, provisioned behind a gate the test opens: the build itself is
tested in tests/local_engine/; this tests what the gateway says meanwhile and that it then serves.
"""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx

from sluice import runtime
from sluice.config import Settings, load_settings
from sluice.startup import EngineStartup, StartupPhase
from tests.helpers import wait_until
from tests.servers import run_app

CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}


def pending_on(
    sim_url: str, gate: asyncio.Event, failures: list[str], fail: bool = False
) -> runtime.PendingEngine:
    startup = EngineStartup()

    @contextlib.asynccontextmanager
    async def provision() -> AsyncIterator[Settings]:
        await gate.wait()
        if fail:
            raise RuntimeError("compiling llama-server failed (exit code 1)")
        startup.enter(StartupPhase.STARTING)
        yield load_settings(overrides={"backends": [{"url": sim_url}]}, environ={})

    return runtime.PendingEngine(startup, provision, failures.append)


async def test_requests_during_the_build_get_503_with_progress_then_are_served(
    sim_url: str, http: httpx.AsyncClient
) -> None:
    gate, failures = asyncio.Event(), []
    pending = pending_on(sim_url, gate, failures)
    app = runtime.build_app(load_settings(environ={}), dispatch=True, pending=pending)
    async with run_app(app) as url:
        pending.startup.build_progress(10, 200)
        pending.startup.build_progress(20, 200)
        ready = await http.get(url + "/readyz")
        assert ready.status_code == 503
        body = ready.json()
        assert body["status"] == "starting" and body["engine"]["phase"] == "building"
        assert "step 20 of 200" in body["reason"]
        assert float(ready.headers["retry-after"]) >= 1
        chat = await http.post(url + "/v1/chat/completions", json=CHAT)
        assert chat.status_code == 503
        assert chat.json()["error"]["code"] == "engine_starting"
        assert "being built" in chat.json()["error"]["message"]
        assert "retry-after" in chat.headers and chat.headers.get("x-should-retry") != "false"

        gate.set()

        async def is_ready() -> bool:
            return (await http.get(url + "/readyz")).status_code == 200

        await wait_until(is_ready)
        served = await http.post(url + "/v1/chat/completions", json=CHAT)
        assert served.status_code == 200 and served.json()["choices"]
    assert failures == []


async def test_a_failed_build_is_reported_and_ends_the_wait(sim_url: str, http: httpx.AsyncClient) -> None:
    gate, failures = asyncio.Event(), []
    pending = pending_on(sim_url, gate, failures, fail=True)
    app = runtime.build_app(load_settings(environ={}), dispatch=True, pending=pending)
    async with run_app(app) as url:
        gate.set()
        await wait_until(lambda: bool(failures))
        assert "compiling llama-server failed" in failures[0]
        chat = await http.post(url + "/v1/chat/completions", json=CHAT)
        assert chat.status_code == 503 and chat.json()["error"]["code"] == "engine_failed"
        assert chat.headers["x-should-retry"] == "false"
