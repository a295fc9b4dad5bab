"""Where the engines are stays the operator's: a failing engine's URL, host or port never reaches a
client, not in errors, not in `retry` events (which name a backend by its configured name, or
"backend N" when its name is its URL)."""

from __future__ import annotations

import contextlib
from collections.abc import AsyncIterator
from typing import Any

import httpx

from sluice.config import load_settings
from sluice.runtime import build_app
from tests.helpers import free_port, wait_until
from tests.servers import Gateway, run_app

MSG = [{"role": "user", "content": "hi"}]


@contextlib.asynccontextmanager
async def gateway(backends: list[dict[str, Any]], **overrides: Any) -> AsyncIterator[Gateway]:
    """A gateway with a worker, on backends given in full (name, models), not only as URLs."""
    settings = load_settings(
        overrides={"backends": backends, "log_level": "warning", **overrides}, environ={}
    )
    app = build_app(settings, dispatch=True)
    async with run_app(app) as url:
        await wait_until(app.state.gateway.broker.served_models)
        yield Gateway(url, app)


def assert_no_address(text: str, url: str) -> None:
    port = url.rsplit(":", 1)[1]
    assert url not in text and "127.0.0.1" not in text and port not in text, text


async def test_a_failing_engine_is_not_named_in_retry_events(sim_url: str, http: httpx.AsyncClient) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens: every attempt fails to connect
    backends = [{"url": dead, "models": ["sim"]}, {"url": sim_url, "name": "gpu-b"}]
    async with gateway(backends) as gw:
        # Each prompt has its own prefix, so the router's prefix affinity sends some to each
        # engine: one that goes to the dead engine first is retried on the other.
        for n in range(40):
            body = {"model": "sim", "messages": [{"role": "user", "content": f"hi {n}"}], "max_tokens": 2}
            job_id = (await http.post(gw.url + "/v1/jobs", json=body)).json()["id"]
            events = (await http.get(f"{gw.url}/v1/jobs/{job_id}/events")).text
            assert "event: done" in events
            assert_no_address(events, dead)
            if "event: retry" in events:
                break
        assert "event: retry" in events  # one was tried on the dead engine first
        assert '"backend": "backend 1"' in events
        assert_no_address(events, dead)
        view = (await http.get(f"{gw.url}/v1/jobs/{job_id}")).text
        assert_no_address(view, dead)


async def test_a_failing_engine_is_not_named_in_errors(http: httpx.AsyncClient) -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    # An engine that never answered gets no grace for its refused connections: the job fails at
    # its first try, with the error whose text is checked here.
    async with gateway([{"url": dead, "models": ["sim"]}], max_attempts=1) as gw:
        body = {"model": "sim", "messages": MSG, "max_tokens": 2}
        sync = await http.post(gw.url + "/v1/chat/completions", json=body)
        assert sync.status_code == 502 and sync.json()["error"]["code"] == "engine_error"
        assert_no_address(sync.text, dead)
        stream = await http.post(gw.url + "/v1/chat/completions", json={**body, "stream": True})
        assert "engine" in stream.text
        assert_no_address(stream.text, dead)
        job_id = (await http.post(gw.url + "/v1/jobs", json=body)).json()["id"]
        events = (await http.get(f"{gw.url}/v1/jobs/{job_id}/events")).text
        assert "event: error" in events
        assert_no_address(events, dead)
        assert_no_address((await http.get(f"{gw.url}/v1/jobs/{job_id}")).text, dead)
