"""Asynchronous jobs: submit, long-poll, events (with resume), cancel, idempotency, the article's aliases."""

from __future__ import annotations

import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.helpers import wait_until
from tests.servers import Gateway, run_gateway

CHAT = {"model": "sim", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 5}


@pytest.fixture
async def gw(sim_url: str) -> AsyncIterator[Gateway]:
    async with run_gateway([sim_url], max_concurrency=4) as g:
        yield g


def parse_sse(text: str) -> list[dict[str, Any]]:
    events = []
    for block in text.replace("\r\n", "\n").split("\n\n"):
        fields: dict[str, Any] = {}
        for line in block.split("\n"):
            if ":" in line and not line.startswith(":"):
                key, _, value = line.partition(":")
                fields[key] = value.strip()
        if "data" in fields:
            fields["data"] = json.loads(fields["data"])
            events.append(fields)
    return events


async def test_submit_and_long_poll(gw: Gateway, http: httpx.AsyncClient) -> None:
    r = await http.post(gw.url + "/v1/jobs", json=CHAT)
    assert r.status_code == 202
    body = r.json()
    assert body["id"].startswith("job_") and body["status"] == "queued"
    assert isinstance(body["position"], int) and body["estimated_start_s"] >= 0
    assert r.headers["location"] == f"/v1/jobs/{body['id']}"
    done = (await http.get(f"{gw.url}/v1/jobs/{body['id']}", params={"wait": 10})).json()
    assert done["status"] == "succeeded"
    assert done["result"]["object"] == "chat.completion"
    assert done["usage"]["completion_tokens"] == 5 and done["attempts"] == 1
    t = done["timings"]
    assert t["queued_at"] <= t["started_at"] <= t["first_token_at"] <= t["finished_at"]


async def test_completions_job(gw: Gateway, http: httpx.AsyncClient) -> None:
    r = await http.post(gw.url + "/v1/jobs", json={"model": "sim", "prompt": "abc", "max_tokens": 3})
    done = (await http.get(f"{gw.url}/v1/jobs/{r.json()['id']}", params={"wait": 10})).json()
    assert done["result"]["object"] == "text_completion"


async def test_events_replay_and_resume(gw: Gateway, http: httpx.AsyncClient) -> None:
    job_id = (await http.post(gw.url + "/v1/jobs", json=CHAT)).json()["id"]
    events = parse_sse((await http.get(f"{gw.url}/v1/jobs/{job_id}/events")).text)
    types = [e["event"] for e in events]
    assert types[0] == "queued" and types[1] == "started" and types[-1] == "done"
    assert types.count("token") == 5
    assert [int(e["id"]) for e in events] == list(range(1, len(events) + 1))
    assert events[-1]["data"]["status"] == "succeeded"
    # Finished job: a new stream replays from the start, and Last-Event-ID resumes after that id.
    resumed = parse_sse(
        (await http.get(f"{gw.url}/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "3"})).text
    )
    assert [int(e["id"]) for e in resumed] == list(range(4, len(events) + 1))


async def test_idempotency_key(gw: Gateway, http: httpx.AsyncClient) -> None:
    first = await http.post(gw.url + "/v1/jobs", json=CHAT, headers={"Idempotency-Key": "abc"})
    again = await http.post(gw.url + "/v1/jobs", json=CHAT, headers={"Idempotency-Key": "abc"})
    assert first.status_code == 202 and again.status_code == 200
    assert first.json()["id"] == again.json()["id"]
    other = await http.post(gw.url + "/v1/jobs", json=CHAT, headers={"Idempotency-Key": "abd"})
    assert other.json()["id"] != first.json()["id"]


async def test_article_aliases(gw: Gateway, http: httpx.AsyncClient) -> None:
    r = await http.post(gw.url + "/submit", json={"prompt": "explain transformers"})
    assert r.status_code == 200
    body = r.json()
    assert set(body) == {"job_id", "status"} and body["status"] == "queued"

    async def done() -> bool:
        res = (await http.get(f"{gw.url}/result/{body['job_id']}")).json()
        assert res["status"] in ("processing", "done")
        return bool(res["status"] == "done")

    await wait_until(done)
    res = (await http.get(f"{gw.url}/result/{body['job_id']}")).json()
    assert isinstance(res["result"]["answer"], str) and res["result"]["answer"]
    missing = await http.get(f"{gw.url}/result/job_nope")
    assert missing.status_code == 404 and missing.json()["error"]["code"] == "job_not_found"


async def test_cancel_queued_then_cancel_again(http: httpx.AsyncClient) -> None:
    # One slot, held by a long generation (10 ms a token, 5000 tokens): the second job stays queued.
    async with (
        serve_in_background(preset("fast", model="sim", base_step_s=0.01)) as sim,
        run_gateway([sim], max_concurrency=1) as gw,
    ):
        long = {**CHAT, "max_tokens": 4000}
        running = (await http.post(gw.url + "/v1/jobs", json=long)).json()["id"]
        queued = (await http.post(gw.url + "/v1/jobs", json=CHAT)).json()["id"]

        async def is_running() -> bool:
            return bool((await http.get(f"{gw.url}/v1/jobs/{running}")).json()["status"] == "running")

        await wait_until(is_running)
        view = (await http.get(f"{gw.url}/v1/jobs/{queued}")).json()
        assert view["status"] == "queued" and view["position"] == 0
        r = await http.delete(f"{gw.url}/v1/jobs/{queued}")
        assert r.status_code == 200 and r.json()["status"] == "cancelled"
        again = await http.delete(f"{gw.url}/v1/jobs/{queued}")
        assert again.status_code == 409 and again.json()["error"]["code"] == "job_finished"
        # Cancelling the running job reaches the engine: it aborts the request.
        r = await http.delete(f"{gw.url}/v1/jobs/{running}")
        assert r.status_code == 200 and r.json()["status"] == "cancelled"

        async def engine_aborted() -> bool:
            stats = (await http.get(sim + "/sim/stats")).json()
            return bool(stats["aborted_total"] == 1 and stats["running"] == 0)

        await wait_until(engine_aborted)
