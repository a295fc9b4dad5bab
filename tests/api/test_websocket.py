from __future__ import annotations

import json
from collections.abc import AsyncIterator

import httpx
import pytest
import websockets

from sluice.api.auth import hash_key
from tests.servers import Gateway, run_gateway

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def gw(sim_url: str) -> AsyncIterator[Gateway]:
    keys = [{"key_sha256": hash_key("sk-a"), "tenant": "a"}, {"key_sha256": hash_key("sk-b"), "tenant": "b"}]
    async with run_gateway([sim_url], keys=keys) as g:
        yield g


def ws_url(gw: Gateway, job_id: str, after: int | None = None) -> str:
    url = gw.url.replace("http://", "ws://") + f"/v1/jobs/{job_id}/ws"
    return url if after is None else f"{url}?after={after}"


async def test_same_events_as_sse(gw: Gateway, http: httpx.AsyncClient) -> None:
    headers = {"Authorization": "Bearer sk-a"}
    job_id = (
        await http.post(
            gw.url + "/v1/jobs", json={"model": "sim", "messages": MSG, "max_tokens": 4}, headers=headers
        )
    ).json()["id"]
    async with websockets.connect(ws_url(gw, job_id), additional_headers=headers, open_timeout=5) as ws:
        events = [json.loads(m) async for m in ws]
    assert events[0]["event"] == "queued" and events[-1]["event"] == "done"
    assert sum(e["event"] == "token" for e in events) == 4
    sse = (await http.get(f"{gw.url}/v1/jobs/{job_id}/events", headers=headers)).text
    assert sse.count("event: ") == len(events)
    async with websockets.connect(ws_url(gw, job_id, after=3), additional_headers=headers) as ws:
        resumed = [json.loads(m) async for m in ws]
    assert [e["id"] for e in resumed] == [e["id"] for e in events[3:]]


async def test_other_tenant_and_unknown_job_are_refused(gw: Gateway, http: httpx.AsyncClient) -> None:
    job_id = (
        await http.post(
            gw.url + "/v1/jobs",
            json={"model": "sim", "messages": MSG, "max_tokens": 2},
            headers={"Authorization": "Bearer sk-a"},
        )
    ).json()["id"]
    for headers, status in [
        ({"Authorization": "Bearer sk-b"}, 404),
        ({}, 401),
        ({"Authorization": "Bearer x"}, 401),
    ]:
        with pytest.raises(websockets.InvalidStatus) as info:
            async with websockets.connect(ws_url(gw, job_id), additional_headers=headers, open_timeout=5):
                pass
        assert info.value.response.status_code == status
        assert json.loads(info.value.response.body)["error"]["code"]
    with pytest.raises(websockets.InvalidStatus) as info:
        async with websockets.connect(
            ws_url(gw, "job_nope"), additional_headers={"Authorization": "Bearer sk-a"}
        ):
            pass
    assert info.value.response.status_code == 404
