"""The HTTP roles' drain middleware alone (sluice.roles.http.OpenRequests), in front of a small ASGI
app whose answers wait until the test lets them go. The real server, process and signal are in
tests/failures/test_gateway_sigterm.py."""

from __future__ import annotations

import asyncio
import gc
import signal
from typing import Any

import httpx
import uvicorn

from sluice import drain
from sluice.roles.http import YOUNG_GC_THRESHOLD, DrainingServer, OpenRequests, quiet_gc
from tests.helpers import wait_until


class Held:
    """An ASGI app: ``/slow`` answers once ``go`` is set, everything else at once."""

    def __init__(self) -> None:
        self.go = asyncio.Event()

    async def __call__(self, scope: dict[str, Any], receive: Any, send: Any) -> None:
        assert scope["type"] == "http"
        if scope["path"] == "/slow":
            await self.go.wait()
        await send(
            {"type": "http.response.start", "status": 200, "headers": [(b"content-type", b"text/plain")]}
        )
        await send({"type": "http.response.body", "body": b"ok"})


def client(app: Any) -> httpx.AsyncClient:
    return httpx.AsyncClient(transport=httpx.ASGITransport(app=app), base_url="http://gw")


async def test_open_requests_are_counted_and_finish_while_new_ones_are_refused() -> None:
    held = Held()
    shutdown = drain.Drain(grace_s=30)
    requests = OpenRequests(held, shutdown)
    async with client(requests) as c:
        slow = asyncio.create_task(c.get("/slow"))
        await wait_until(lambda: requests.open == 1, timeout=5)
        shutdown.signal()
        refused = await c.post("/v1/chat/completions", json={})
        assert refused.status_code == 503
        assert refused.headers["retry-after"] == "1" and refused.headers["connection"] == "close"
        assert refused.headers["x-request-id"].startswith("req_")
        error = refused.json()["error"]
        assert error["code"] == "shutting_down" and error["type"] == "server_error"
        # Probes and the dashboard are answered, and not waited for.
        for path in ("/readyz", "/healthz", "/metrics", "/dashboard/feed"):
            assert (await c.get(path)).status_code == 200
        assert requests.open == 1 and not slow.done()
        changed = asyncio.create_task(requests.changed())
        held.go.set()
        assert (await slow).status_code == 200
        await asyncio.wait_for(changed, 5)
        assert requests.open == 0


async def test_a_request_that_ends_as_the_drain_looks_is_not_missed() -> None:
    """The last open request ends in the loop turn between the drain's look (one open) and the
    start of its wait for a change: the drain still sees it end, rather than waiting out its grace
    (a gateway under SIGTERM sat out its 120 s so on a loaded machine)."""
    release: asyncio.Future[None] = asyncio.get_running_loop().create_future()

    async def app(scope: dict[str, Any], receive: Any, send: Any) -> None:
        await release

    shutdown = drain.Drain(grace_s=600)
    requests = OpenRequests(app, shutdown)
    request = asyncio.create_task(requests({"type": "http", "path": "/v1/chat/completions"}, None, None))
    await wait_until(lambda: requests.open == 1, timeout=5)
    shutdown.signal()

    def idle() -> bool:
        if not release.done():
            release.set_result(None)  # the request ends in the next turn, before the wait starts
        return requests.open == 0

    assert await asyncio.wait_for(shutdown.until(idle, requests.changed), 10)
    assert requests.open == 0
    await request


async def test_new_requests_are_still_taken_within_the_accept_window() -> None:
    now = [0.0]
    shutdown = drain.Drain(grace_s=30, clock=lambda: now[0])
    requests = OpenRequests(Held(), shutdown, accept_s=5)
    async with client(requests) as c:
        shutdown.signal()
        now[0] = 4.9
        assert (await c.get("/fast")).status_code == 200
        now[0] = 5.0
        assert (await c.get("/fast")).status_code == 503


def test_the_first_signal_drains_the_second_stops_the_third_forces() -> None:
    shutdown = drain.Drain(grace_s=30)
    server = DrainingServer(uvicorn.Config(Held()), shutdown)
    server._on_signal(signal.SIGTERM)
    assert shutdown.draining and not server.should_exit  # the drain decides when to stop
    server._on_signal(signal.SIGTERM)
    assert shutdown.phase is drain.DrainPhase.HURRYING and server.should_exit and not server.force_exit
    server._on_signal(signal.SIGINT)
    assert server.force_exit


def test_quiet_gc_freezes_start_up_and_widens_the_young_generation() -> None:
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        quiet_gc()
        assert gc.get_threshold() == (YOUNG_GC_THRESHOLD, 10, 10)
        assert gc.get_freeze_count() > 0
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)
