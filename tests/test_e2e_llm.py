"""End to end with a real LLM: the openai SDK → Sluice → llama-server running SmolLM2-135M on the CPU.

Assertions are about structure, token counts and states, never the model's words.
"""

from __future__ import annotations

import re
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from openai import AsyncOpenAI, DefaultAsyncHttpxClient
from openai.types.chat import ChatCompletionMessageParam

from sluice.core.job import JobState
from sluice.local_engine.server import LocalEngine, find_llama_server, find_model
from tests.helpers import wait_until
from tests.servers import Gateway, run_gateway

pytestmark = [
    pytest.mark.llm,
    pytest.mark.skipif(
        find_llama_server() is None or find_model() is None,
        reason="llama-server or the model is absent: run `sluice engine build` (about 4 minutes)",
    ),
]
MSG: list[ChatCompletionMessageParam] = [
    {"role": "user", "content": "Tell me a long story about a lighthouse."}
]
# Completions with ignore_eos (a llama-server option) generate until max_tokens: long and predictable.
LONG = {"model": "smollm2", "prompt": "Once upon a time", "max_tokens": 1500, "ignore_eos": True}


@pytest.fixture
async def engine(tmp_path: Path) -> AsyncIterator[LocalEngine]:
    async with LocalEngine(slots=2, ctx_per_slot=2048, log_path=tmp_path / "engine.log") as running:
        yield running


@pytest.fixture
async def gw(engine: LocalEngine) -> AsyncIterator[Gateway]:
    async with run_gateway([engine.url], max_concurrency=engine.slots, max_queued_jobs=2) as g:
        yield g


def client(gw: Gateway) -> AsyncOpenAI:
    return AsyncOpenAI(
        base_url=gw.url + "/v1",
        api_key="x",
        max_retries=0,
        http_client=DefaultAsyncHttpxClient(trust_env=False),
    )


async def processing(engine: LocalEngine, http: httpx.AsyncClient) -> int:
    text = (await http.get(engine.url + "/metrics")).text
    match = re.search(r"^llamacpp:requests_processing\s+(\S+)", text, re.MULTILINE)
    assert match, "llama-server exposes requests_processing"
    return int(float(match.group(1)))


async def test_sdk_through_sluice(gw: Gateway) -> None:
    async with client(gw) as c:
        r = await c.chat.completions.create(model="smollm2", messages=MSG, max_tokens=16, temperature=0)
        assert r.model == "smollm2" and r.choices[0].message.role == "assistant"
        assert r.usage is not None and 0 < r.usage.completion_tokens <= 16 and r.usage.prompt_tokens > 0
        stream = await c.chat.completions.create(
            model="smollm2", messages=MSG, max_tokens=16, stream=True, stream_options={"include_usage": True}
        )
        pieces, usage = 0, None
        async for chunk in stream:
            pieces += sum(1 for ch in chunk.choices if ch.delta.content)
            usage = chunk.usage or usage
        assert usage is not None and 0 < pieces <= usage.completion_tokens <= 16
        models = [m.id async for m in c.models.list()]
        assert models == ["smollm2"]


async def test_async_job(gw: Gateway, http: httpx.AsyncClient) -> None:
    r = await http.post(gw.url + "/v1/jobs", json={"model": "smollm2", "messages": MSG, "max_tokens": 12})
    assert r.status_code == 202
    done = (await http.get(f"{gw.url}/v1/jobs/{r.json()['id']}", params={"wait": 60})).json()
    assert done["status"] == "succeeded" and done["attempts"] == 1
    assert 0 < done["usage"]["completion_tokens"] <= 12
    assert done["result"]["choices"][0]["message"]["role"] == "assistant"


async def test_cancel_reaches_the_engine(gw: Gateway, engine: LocalEngine, http: httpx.AsyncClient) -> None:
    job_id = (await http.post(gw.url + "/v1/jobs", json=LONG)).json()["id"]

    async def streaming() -> bool:
        job = await gw.broker.get(job_id)
        return job.first_token_at is not None and await processing(engine, http) == 1

    await wait_until(streaming, timeout=60)
    r = await http.delete(f"{gw.url}/v1/jobs/{job_id}")
    assert r.status_code == 200 and r.json()["status"] == "cancelled"

    async def slot_free() -> bool:
        return await processing(engine, http) == 0

    await wait_until(slot_free, timeout=30)


async def test_queue_full_beyond_slots_and_bound(
    gw: Gateway, engine: LocalEngine, http: httpx.AsyncClient
) -> None:
    accepted = []
    for _ in range(engine.slots + 2):  # two slots busy, two waiting in Sluice's queue
        r = await http.post(gw.url + "/v1/jobs", json=LONG)
        assert r.status_code == 202
        accepted.append(r.json()["id"])

        async def placed(job_id: str = accepted[-1]) -> bool:
            job = await gw.broker.get(job_id)
            return job.state in (JobState.RUNNING, JobState.QUEUED)

        await wait_until(placed)

    async def engine_full() -> bool:
        return await processing(engine, http) == engine.slots

    await wait_until(engine_full, timeout=60)
    refused = await http.post(gw.url + "/v1/jobs", json=LONG)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "queue_full"
    assert 1 <= int(refused.headers["retry-after"]) <= 120
    # The engine's own queue stays empty: Sluice holds the rest.
    text = (await http.get(engine.url + "/metrics")).text
    deferred = re.search(r"^llamacpp:requests_deferred\s+(\S+)", text, re.MULTILINE)
    assert deferred is not None and float(deferred.group(1)) == 0
    stats = (await gw.broker.stats())["smollm2"]
    assert stats.running_jobs == engine.slots and stats.queued_jobs == 2
    for job_id in accepted:
        await http.delete(f"{gw.url}/v1/jobs/{job_id}")

    async def idle() -> bool:
        return await processing(engine, http) == 0

    await wait_until(idle, timeout=30)
    states = {(await gw.broker.get(j)).state for j in accepted}
    assert states == {JobState.CANCELLED}


#: how long the job killed mid-answer may take to end: the engine's restart on a loaded machine
#: (its own startup_timeout is 60 s), then the retry's 200 tokens from scratch; a bound, not a speed.
#: The job keeps its default attempts: tries that find the engine's port closed while it restarts
#: are not counted for a minute (unreached_grace_s), then each waits out an ejection of up to 30 s.
RESTARTED_JOB_S = 300.0


@pytest.mark.timeout(RESTARTED_JOB_S + 180)  # the engine's start, the streaming, then the bound
async def test_engine_killed_mid_job_is_restarted_and_the_job_retried(
    engine: LocalEngine, http: httpx.AsyncClient
) -> None:
    import os
    import signal

    async with run_gateway([engine.url], max_concurrency=engine.slots) as gw:
        # Its deadline counts from admission, and must not come before the restarted engine answers.
        body = {**LONG, "max_tokens": 200, "timeout": RESTARTED_JOB_S}
        job_id = (await http.post(gw.url + "/v1/jobs", json=body)).json()["id"]

        async def streaming() -> bool:
            job = await gw.broker.get(job_id)
            return job.first_token_at is not None

        await wait_until(streaming, timeout=60)
        assert engine.pid is not None
        os.kill(engine.pid, signal.SIGKILL)
        views: list[dict[str, Any]] = []

        async def ended() -> bool:
            r = await http.get(f"{gw.url}/v1/jobs/{job_id}", params={"wait": 20}, timeout=60)
            views.append(r.json())
            return views[-1]["status"] not in ("queued", "running")

        await wait_until(ended, timeout=RESTARTED_JOB_S)
        view = views[-1]
        assert view["status"] == "succeeded", view
        assert view["attempts"] >= 2 and view["usage"]["completion_tokens"] == 200
        assert engine.restarts >= 1
