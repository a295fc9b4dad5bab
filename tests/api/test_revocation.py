"""A revoked key's open streams end within the key cache's window (STORED_KEY_CACHE_S): the OpenAI
stream with an invalid_api_key error (and its job is cancelled), a Responses API stream (its response
cancelled too), a job's SSE events stream, and its WebSocket with close code 4401; streams of keys
that still stand go on."""

from __future__ import annotations

import asyncio
import json
import time
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
import websockets

from sluice.api import auth
from sluice.api.auth import hash_key
from sluice.core.job import JobState
from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.helpers import wait_until
from tests.servers import Gateway, run_gateway

MSG = [{"role": "user", "content": "hi"}]
ADMIN = {"Authorization": "Bearer sk-admin"}
WINDOW_S = 0.5  # the key cache's window in this test, and so the period streams check their key
LONG = {"model": "sim", "messages": MSG, "max_tokens": 4000}  # ~40 s at 10 ms a token


@pytest.fixture
async def gw(monkeypatch: pytest.MonkeyPatch) -> AsyncIterator[Gateway]:
    monkeypatch.setattr(auth, "STORED_KEY_CACHE_S", WINDOW_S)
    keys = [{"key_sha256": hash_key("sk-admin"), "tenant": "ops", "admin": True}]
    async with (
        serve_in_background(preset("fast", model="sim", base_step_s=0.01)) as sim,
        run_gateway([sim], keys=keys, key_store=True) as g,
    ):
        yield g


async def new_key(http: httpx.AsyncClient, gw: Gateway, tenant: str) -> tuple[str, dict[str, str]]:
    made = (await http.post(gw.url + "/admin/keys", json={"tenant": tenant}, headers=ADMIN)).json()
    return made["key_sha256"], {"Authorization": f"Bearer {made['key']}"}


async def sse_lines(
    http: httpx.AsyncClient, method: str, url: str, **kwargs: Any
) -> tuple[httpx.Headers, list[str]]:
    """The headers and every line of an SSE response, until the server ends it."""
    lines: list[str] = []
    async with http.stream(method, url, **kwargs) as response:
        assert response.status_code == 200
        async for line in response.aiter_lines():
            lines.append(line)
    return response.headers, lines


async def ws_close(url: str, headers: dict[str, str]) -> tuple[int | None, str | None, int]:
    """The close code and reason of a job's WebSocket, and how many events came before it."""
    count = 0
    async with websockets.connect(url, additional_headers=headers, open_timeout=5) as ws:
        try:
            async for _ in ws:
                count += 1
        except websockets.ConnectionClosed:
            pass
        assert ws.close_code is not None
        return ws.close_code, ws.close_reason, count


async def test_a_revoked_keys_open_streams_end_within_the_window(
    gw: Gateway, http: httpx.AsyncClient
) -> None:
    digest, revoked = await new_key(http, gw, "acme")
    _, kept = await new_key(http, gw, "acme")

    chat = asyncio.create_task(
        sse_lines(
            http, "POST", gw.url + "/v1/chat/completions", json={**LONG, "stream": True}, headers=revoked
        )
    )
    job_id = (await http.post(gw.url + "/v1/jobs", json=LONG, headers=revoked)).json()["id"]
    events = asyncio.create_task(sse_lines(http, "GET", f"{gw.url}/v1/jobs/{job_id}/events", headers=revoked))
    socket_url = gw.url.replace("http://", "ws://") + f"/v1/jobs/{job_id}/ws"
    socket = asyncio.create_task(ws_close(socket_url, revoked))
    response = {"model": "sim", "input": "hi", "max_output_tokens": 4000, "stream": True}
    responses = asyncio.create_task(
        sse_lines(http, "POST", gw.url + "/v1/responses", json=response, headers=revoked)
    )
    other_id = (await http.post(gw.url + "/v1/jobs", json=LONG, headers=kept)).json()["id"]
    other = asyncio.create_task(sse_lines(http, "GET", f"{gw.url}/v1/jobs/{other_id}/events", headers=kept))

    async def all_streaming() -> bool:
        jobs = [await gw.broker.get(job_id), await gw.broker.get(other_id)]
        return all(j is not None and j.state is JobState.RUNNING for j in jobs)

    await wait_until(all_streaming)
    await asyncio.sleep(2 * WINDOW_S)  # a few checks pass while the key stands
    assert not any(t.done() for t in (chat, events, socket, responses, other))

    revoked_at = time.monotonic()
    assert (await http.delete(f"{gw.url}/admin/keys/{digest}", headers=ADMIN)).status_code == 200
    # Within the window, plus the time a check and the closing take on a loaded machine.
    (
        (chat_headers, chat_lines),
        (_, event_lines),
        (code, reason, count),
        (response_headers, _),
    ) = await asyncio.wait_for(asyncio.gather(chat, events, socket, responses), timeout=WINDOW_S + 3.0)
    assert time.monotonic() - revoked_at < WINDOW_S + 3.0
    data = [line.removeprefix("data: ") for line in chat_lines if line.startswith("data: ")]
    assert json.loads(data[-1])["error"]["code"] == "invalid_api_key"
    assert any(line.startswith("event: token") for line in event_lines)  # it streamed until then
    assert (code, reason) == (4401, "invalid_api_key") and count > 0

    # The refused key's new requests get 401 too; the other key's stream goes on.
    assert (await http.get(f"{gw.url}/v1/jobs/{job_id}", headers=revoked)).status_code == 401
    assert not other.done()

    chat_job = await gw.broker.get(chat_headers["x-sluice-job-id"])
    assert chat_job.state is JobState.CANCELLED  # the OpenAI stream's job: nobody may read it now
    response_job = await gw.broker.get(response_headers["x-sluice-job-id"])
    assert response_job.state is JobState.CANCELLED
    other.cancel()
    await asyncio.gather(other, return_exceptions=True)
