"""What the official SDK and the clients built on it (LangChain, litellm, the Agents SDK) rely on:
no hidden length limit, errors with their proper status also for streams, one layer of retries,
the SDK's own time-out as the deadline, request ids, model objects, and a tenant's list of jobs."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import AsyncIterator
from dataclasses import replace
from typing import Any

import httpx
import openai
import pytest
import websockets
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, Response, StreamingResponse

from sluice.api import openai as openai_api
from sluice.api.auth import hash_key
from sluice.core.job import Job
from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.helpers import wait_until
from tests.servers import Gateway, run_app, run_gateway

MSG = [{"role": "user", "content": "hello"}]

#: The simulator's own length for a request that sets none: above the 512 Sluice used to send.
SIM_DEFAULT_TOKENS = 600


@pytest.fixture
async def long_sim() -> AsyncIterator[str]:
    """The fast simulator, answering 600 tokens to a request without a limit."""
    params = replace(preset("fast", model="sim"), default_max_tokens=SIM_DEFAULT_TOKENS)
    async with serve_in_background(params) as url:
        yield url


@pytest.fixture
async def gw(long_sim: str) -> AsyncIterator[Gateway]:
    # Short leases: the worker's heartbeat (a third of one) tells the broker what it learned soon.
    async with run_gateway([long_sim], max_concurrency=4, lease_s=1.5) as g:
        yield g


@pytest.fixture
def client(gw: Gateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="test-key", max_retries=0)


async def job_of(gw: Gateway, headers: httpx.Headers) -> Job:
    job: Job | None = await gw.broker.get(headers["x-sluice-job-id"])
    assert job is not None
    return job


# --- 3. no hidden length limit ------------------------------------------------------------------


async def test_a_request_without_a_limit_gets_what_the_engine_gives(
    gw: Gateway, client: openai.AsyncOpenAI
) -> None:
    # What LangChain, litellm and the Agents SDK send: no max_tokens at all.
    raw = await client.chat.completions.with_raw_response.create(model="sim", messages=MSG)
    answer = raw.parse()
    assert answer.usage is not None and answer.usage.completion_tokens == SIM_DEFAULT_TOKENS
    job = await job_of(gw, raw.headers)
    assert "max_tokens" not in job.body and "max_completion_tokens" not in job.body
    # Its cost is an estimate: nothing measured yet, so the most a request may ask for, within
    # the context window the engine reports.
    assert job.max_tokens == 4096


async def test_a_streamed_request_without_a_limit_is_not_cut(client: openai.AsyncOpenAI) -> None:
    stream = await client.chat.completions.create(
        model="sim", messages=MSG, stream=True, stream_options={"include_usage": True}
    )
    pieces, usage, reasons = 0, None, []
    async for chunk in stream:
        usage = chunk.usage or usage
        for choice in chunk.choices:
            pieces += bool(choice.delta.content)
            if choice.finish_reason:
                reasons.append(choice.finish_reason)
    assert pieces == SIM_DEFAULT_TOKENS and usage is not None
    assert usage.completion_tokens == SIM_DEFAULT_TOKENS


async def test_max_completion_tokens_is_forwarded_as_sent(gw: Gateway, client: openai.AsyncOpenAI) -> None:
    raw = await client.chat.completions.with_raw_response.create(
        model="sim", messages=MSG, max_completion_tokens=9
    )
    assert raw.parse().usage.completion_tokens == 9  # type: ignore[union-attr]
    job = await job_of(gw, raw.headers)
    assert job.body["max_completion_tokens"] == 9 and "max_tokens" not in job.body
    assert job.max_tokens == 9
    # Both sent: the newer name wins, as in vLLM.
    both = await client.chat.completions.with_raw_response.create(
        model="sim", messages=MSG, max_tokens=3, max_completion_tokens=5
    )
    assert (await job_of(gw, both.headers)).max_tokens == 5


async def test_the_cost_of_a_request_without_a_limit_is_learned(
    gw: Gateway, client: openai.AsyncOpenAI
) -> None:
    for _ in range(3):
        await client.chat.completions.create(model="sim", messages=MSG)

    async def learned() -> bool:
        info = (await gw.app.state.gateway.model_info()).get("sim")
        return info is not None and info.output_tokens == SIM_DEFAULT_TOKENS

    await wait_until(learned, timeout=10)
    raw = await client.chat.completions.with_raw_response.create(model="sim", messages=MSG)
    assert (await job_of(gw, raw.headers)).max_tokens == SIM_DEFAULT_TOKENS


async def test_a_default_max_tokens_still_applies_when_set(long_sim: str) -> None:
    async with run_gateway([long_sim], default_max_tokens=20) as g:
        client = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key="k", max_retries=0)
        raw = await client.chat.completions.with_raw_response.create(model="sim", messages=MSG)
        assert raw.parse().usage.completion_tokens == 20  # type: ignore[union-attr]
        assert (await job_of(g, raw.headers)).body["max_tokens"] == 20


# --- 4. errors before the first token have their status, also for streams ------------------------


async def test_a_stream_the_engine_refuses_raises_bad_request_with_its_param(
    client: openai.AsyncOpenAI,
) -> None:
    # The simulator generates one choice only: n=2 is its 400, naming 'n'.
    with pytest.raises(openai.BadRequestError) as info:
        await client.chat.completions.create(model="sim", messages=MSG, n=2, stream=True)
    assert info.value.status_code == 400
    assert info.value.param == "n" and info.value.code == "engine_rejected"
    assert "n=1" in info.value.message


async def test_the_refusal_of_a_stream_is_the_same_as_without_streaming(
    gw: Gateway, http: httpx.AsyncClient
) -> None:
    body = {"model": "sim", "messages": MSG, "n": 2}
    plain = await http.post(gw.url + "/v1/chat/completions", json=body)
    streamed = await http.post(gw.url + "/v1/chat/completions", json={**body, "stream": True})
    assert plain.status_code == streamed.status_code == 400
    assert plain.json()["error"]["param"] == streamed.json()["error"]["param"] == "n"
    assert streamed.headers["content-type"].startswith("application/json")
    assert streamed.headers["x-request-id"] == streamed.headers["x-sluice-job-id"]


#: What OpenAI says on each chunk besides its identity and choices (the simulator says neither).
CHUNK_FIELDS = {"system_fingerprint": "fp_fake1", "service_tier": "default"}


class FakeEngine:
    """An OpenAI-compatible engine that misbehaves on demand, and counts what it is asked. Every
    chunk carries :data:`CHUNK_FIELDS`, as OpenAI's do.

    Modes: ``fail`` answers 500; ``cut`` streams one token and then drops the connection;
    ``gate`` streams its answer once ``gate`` is set; ``ok`` streams it at once (chat and
    completions, with a usage chunk when asked). A chat request without ``stream`` gets its
    answer whole.
    """

    def __init__(self, mode: str) -> None:
        self.mode = mode
        self.requests = 0
        self.gate = asyncio.Event()
        self.app = FastAPI()
        self.app.add_api_route("/v1/models", self.models, methods=["GET"])
        self.app.add_api_route("/v1/chat/completions", self.chat, methods=["POST"])
        self.app.add_api_route("/v1/completions", self.completions, methods=["POST"])

    async def models(self) -> JSONResponse:
        data = [{"id": "fake", "object": "model", "created": 1_700_000_000, "max_model_len": 4096}]
        return JSONResponse({"object": "list", "data": data})

    async def chat(self, request: Request) -> Response:
        self.requests += 1
        if self.mode == "fail":
            error = {"message": "the engine is broken", "type": "server_error", "code": None, "param": None}
            return JSONResponse({"error": error}, status_code=500)
        body = await request.json()
        if not body.get("stream"):
            message = {"role": "assistant", "content": "hi"}
            choice = {"index": 0, "message": message, "finish_reason": "stop", "logprobs": None}
            usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
            whole = {"id": "x", "object": "chat.completion", "created": 0, "model": "fake"}
            return JSONResponse({**whole, **CHUNK_FIELDS, "choices": [choice], "usage": usage})
        return StreamingResponse(self._stream(body, chat=True), media_type="text/event-stream")

    async def completions(self, request: Request) -> Response:
        self.requests += 1
        body = await request.json()
        return StreamingResponse(self._stream(body, chat=False), media_type="text/event-stream")

    async def _stream(self, body: dict[str, Any], chat: bool) -> AsyncIterator[str]:
        if self.mode == "gate":
            await self.gate.wait()
        kind = "chat.completion.chunk" if chat else "text_completion"
        piece = {"id": "x", "object": kind, "created": 0, "model": "fake", **CHUNK_FIELDS}
        if chat:
            first = {"index": 0, "delta": {"role": "assistant", "content": "hi"}, "finish_reason": None}
            last = {"index": 0, "delta": {}, "finish_reason": "stop"}
        else:
            first = {"index": 0, "text": "hi", "logprobs": None, "finish_reason": None}
            last = {"index": 0, "text": "", "logprobs": None, "finish_reason": "stop"}
        yield f"data: {json.dumps({**piece, 'choices': [first]})}\n\n"
        if self.mode == "cut":
            raise RuntimeError("the engine fell over mid-answer")
        yield f"data: {json.dumps({**piece, 'choices': [last]})}\n\n"
        if (body.get("stream_options") or {}).get("include_usage"):
            usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
            yield f"data: {json.dumps({**piece, 'choices': [], 'usage': usage})}\n\n"
        yield "data: [DONE]\n\n"


@contextlib.asynccontextmanager
async def fake_gateway(mode: str, **settings: Any) -> AsyncIterator[tuple[FakeEngine, Gateway]]:
    engine = FakeEngine(mode)
    async with run_app(engine.app) as url, run_gateway([url], **settings) as g:
        yield engine, g


async def test_an_error_after_the_first_token_is_an_error_event_then_done(http: httpx.AsyncClient) -> None:
    async with fake_gateway("cut") as (_, g):
        body = {"model": "fake", "messages": MSG, "stream": True}
        async with http.stream("POST", g.url + "/v1/chat/completions", json=body) as r:
            assert r.status_code == 200
            payloads = [line[5:].strip() async for line in r.aiter_lines() if line.startswith("data:")]
    error = json.loads(payloads[-2])["error"]
    assert error["type"] == "server_error" and error["code"] == "engine_error"
    assert "param" in error and error["param"] is None
    assert payloads[-1] == "[DONE]"


async def test_a_stream_still_queued_after_the_wait_starts_as_before(
    http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    monkeypatch.setattr(openai_api, "ACCEPT_WAIT_S", 0.2)
    async with fake_gateway("gate") as (engine, g):
        body = {"model": "fake", "messages": MSG, "stream": True}
        async with http.stream("POST", g.url + "/v1/chat/completions", json=body) as r:
            # The headers came while the engine had not answered anything.
            assert r.status_code == 200 and not engine.gate.is_set()
            engine.gate.set()
            payloads = [line[5:].strip() async for line in r.aiter_lines() if line.startswith("data:")]
    assert payloads[-1] == "[DONE]" and "hi" in payloads[0]


# --- 2. what the engine says on each chunk reaches streaming clients too ---------------------------


async def test_a_chat_stream_relays_each_chunks_own_fields() -> None:
    async with fake_gateway("ok") as (_, g):
        client = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key="k", max_retries=0)
        stream = await client.chat.completions.create(
            model="fake", messages=MSG, stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
        whole = await client.chat.completions.create(model="fake", messages=MSG)
    assert [c.choices[0].delta.content for c in chunks[:1]] == ["hi"] and chunks[-1].usage is not None
    assert len({c.id for c in chunks}) == 1 and chunks[0].id.startswith("chatcmpl-")
    for c in chunks:  # the usage chunk too, as OpenAI's own last chunk
        assert (c.system_fingerprint, c.service_tier) == ("fp_fake1", "default")
        assert c.model == "fake" and c.object == "chat.completion.chunk"
    assert (whole.system_fingerprint, whole.service_tier) == ("fp_fake1", "default")


async def test_a_completions_stream_relays_each_chunks_own_fields() -> None:
    async with fake_gateway("ok") as (_, g):
        client = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key="k", max_retries=0)
        stream = await client.completions.create(
            model="fake", prompt="hello", stream=True, stream_options={"include_usage": True}
        )
        chunks = [c async for c in stream]
    assert chunks[0].choices[0].text == "hi" and chunks[-1].usage is not None
    for c in chunks:
        assert c.system_fingerprint == "fp_fake1" and c.model_dump()["service_tier"] == "default"
        assert c.id.startswith("cmpl-") and c.object == "text_completion"


async def test_job_events_carry_each_chunks_own_fields_over_sse_and_websocket(
    http: httpx.AsyncClient,
) -> None:
    async with fake_gateway("ok") as (_, g):
        body = {"model": "fake", "messages": MSG, "max_tokens": 5}
        job_id = (await http.post(g.url + "/v1/jobs", json=body)).json()["id"]
        sse = await http.get(f"{g.url}/v1/jobs/{job_id}/events")
        tokens = [
            json.loads(line[5:])
            for block in sse.text.split("\n\n")
            if "event: token" in block
            for line in block.splitlines()
            if line.startswith("data:")
        ]
        ws_url = g.url.replace("http://", "ws://") + f"/v1/jobs/{job_id}/ws"
        async with websockets.connect(ws_url, open_timeout=5) as ws:
            over_ws = [json.loads(m) async for m in ws]
    assert len(tokens) == 2
    for data in tokens:
        assert {k: data[k] for k in CHUNK_FIELDS} == CHUNK_FIELDS and "choices" in data
        # The identity is the job's to give: an event carries none of the engine's.
        assert "id" not in data and "model" not in data
    ws_tokens = [e["data"] for e in over_ws if e["event"] == "token"]
    assert ws_tokens == tokens
    done = over_ws[-1]["data"]["result"]
    assert {k: done[k] for k in CHUNK_FIELDS} == CHUNK_FIELDS


# --- 5. one layer of retries, within the deadline -------------------------------------------------


async def test_a_failing_engine_is_retried_by_sluice_alone() -> None:
    async with fake_gateway("fail") as (engine, g):
        # The SDK's own default: two retries of its own on a 5xx, unless told not to.
        client = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key="k", max_retries=2)
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as info:
            await client.chat.completions.create(model="fake", messages=MSG, max_tokens=5)
        took = time.monotonic() - started
    assert info.value.status_code == 502
    assert info.value.response.headers["x-should-retry"] == "false"
    assert "3 attempts" in info.value.message
    # Sluice's three attempts, and none of the SDK's: not 9.
    assert engine.requests == 3
    assert took < 15


async def test_no_attempt_starts_after_the_deadline() -> None:
    async with fake_gateway("fail") as (engine, g):
        client = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key="k", max_retries=2)
        started = time.monotonic()
        with pytest.raises(openai.InternalServerError) as info:
            # The second attempt waits out the backend's 1 s cooldown; the third would wait 2 s
            # more, past the deadline: the job gives up then rather than wait for nothing.
            await client.chat.completions.create(
                model="fake", messages=MSG, max_tokens=5, extra_body={"timeout": 2.0}
            )
        took = time.monotonic() - started
    assert engine.requests == 2 and "2 attempts" in info.value.message
    assert info.value.response.headers["x-should-retry"] == "false"
    assert took < 2.0


# --- 6. the smaller gaps --------------------------------------------------------------------------


async def test_models_carry_the_engines_context_window_and_a_real_creation_time(
    client: openai.AsyncOpenAI,
) -> None:
    listed = [m async for m in client.models.list()]
    assert [m.id for m in listed] == ["sim"]
    sim = listed[0].model_dump()
    assert sim["max_model_len"] == preset("fast").max_model_len
    assert abs(sim["created"] - time.time()) < 120
    one = await client.models.retrieve("sim")
    assert one.id == "sim" and one.object == "model" and one.created == sim["created"]
    with pytest.raises(openai.NotFoundError) as info:
        await client.models.retrieve("nope")
    assert info.value.code == "model_not_found"
    assert info.value.body["type"] == "invalid_request_error"  # type: ignore[index]


async def test_a_models_creation_time_is_the_engines_where_it_gives_one() -> None:
    async with fake_gateway("gate") as (_, g):
        client = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key="k", max_retries=0)
        one = await client.models.retrieve("fake")
    assert one.created == 1_700_000_000 and one.model_dump()["max_model_len"] == 4096


async def test_every_answer_has_a_request_id(gw: Gateway, client: openai.AsyncOpenAI) -> None:
    raw = await client.chat.completions.with_raw_response.create(model="sim", messages=MSG, max_tokens=2)
    assert raw.request_id == raw.headers["x-sluice-job-id"]
    assert raw.parse()._request_id == raw.request_id
    listed = await client.models.with_raw_response.list()
    assert listed.request_id is not None and listed.request_id.startswith("req_")
    with pytest.raises(openai.NotFoundError) as info:
        await client.chat.completions.create(model="nope", messages=MSG)
    assert info.value.request_id is not None and info.value.request_id.startswith("req_")


async def test_the_sdks_own_timeout_is_the_deadline(gw: Gateway, http: httpx.AsyncClient) -> None:
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key="k", max_retries=0, timeout=42.0)
    raw = await client.chat.completions.with_raw_response.create(model="sim", messages=MSG, max_tokens=2)
    job = await job_of(gw, raw.headers)
    assert job.deadline - job.created_at == pytest.approx(42.0)
    # openai-node's header; the request's own time-out wins over either.
    body = {"model": "sim", "messages": MSG, "max_tokens": 2}
    node = await http.post(gw.url + "/v1/chat/completions", json=body, headers={"x-stainless-timeout": "30"})
    job = await job_of(gw, node.headers)
    assert job.deadline - job.created_at == pytest.approx(30.0)
    asked = await http.post(
        gw.url + "/v1/chat/completions",
        json=body,
        headers={"x-stainless-timeout": "30", "X-Request-Timeout": "12"},
    )
    job = await job_of(gw, asked.headers)
    assert job.deadline - job.created_at == pytest.approx(12.0)


async def test_error_types_are_openais(gw: Gateway, http: httpx.AsyncClient) -> None:
    missing = await http.get(gw.url + "/v1/jobs/job_nope")
    assert missing.status_code == 404 and missing.json()["error"]["type"] == "invalid_request_error"
    body = {"model": "sim", "messages": MSG, "max_tokens": 2}
    job_id = (await http.post(gw.url + "/v1/jobs", json=body)).json()["id"]
    await http.get(gw.url + f"/v1/jobs/{job_id}", params={"wait": 10})
    finished = await http.delete(gw.url + f"/v1/jobs/{job_id}")
    assert finished.status_code == 409 and finished.json()["error"]["type"] == "invalid_request_error"
    assert finished.json()["error"]["code"] == "job_finished"


async def test_a_tenant_lists_its_own_jobs_newest_first(long_sim: str, http: httpx.AsyncClient) -> None:
    keys = [
        {"key_sha256": hash_key("sk-a"), "tenant": "a"},
        {"key_sha256": hash_key("sk-b"), "tenant": "b"},
    ]
    async with run_gateway([long_sim], keys=keys) as g:
        a, b = {"Authorization": "Bearer sk-a"}, {"Authorization": "Bearer sk-b"}
        body = {"model": "sim", "messages": MSG, "max_tokens": 2}
        ids = []
        for _ in range(3):
            submitted = await http.post(g.url + "/v1/jobs", json=body, headers=a)
            assert submitted.headers["x-request-id"] == submitted.json()["id"]
            ids.append(submitted.json()["id"])
        theirs = (await http.post(g.url + "/v1/jobs", json=body, headers=b)).json()["id"]

        first = (await http.get(g.url + "/v1/jobs", params={"limit": 2}, headers=a)).json()
        assert first["object"] == "list" and first["has_more"] is True
        assert [j["id"] for j in first["data"]] == ids[::-1][:2]
        assert (first["first_id"], first["last_id"]) == (ids[2], ids[1])
        assert first["data"][0]["object"] == "job"
        rest = await http.get(g.url + "/v1/jobs", params={"after": first["last_id"]}, headers=a)
        assert [j["id"] for j in rest.json()["data"]] == [ids[0]] and rest.json()["has_more"] is False
        only_theirs = (await http.get(g.url + "/v1/jobs", headers=b)).json()
        assert [j["id"] for j in only_theirs["data"]] == [theirs]
        empty = (await http.get(g.url + "/v1/jobs", params={"after": theirs}, headers=a)).json()
        assert empty == {"object": "list", "data": [], "first_id": None, "last_id": None, "has_more": False}
        bad = await http.get(g.url + "/v1/jobs", params={"limit": 0}, headers=a)
        assert bad.status_code == 400 and bad.json()["error"]["param"] == "limit"


async def test_a_repeated_refusal_is_never_told_a_time_sooner_than_the_first(http: httpx.AsyncClient) -> None:
    # Retry-After is a reservation: the tenant's own bound takes its time from the model's book, so
    # a refusal repeated while nothing has started or ended is told a time no sooner than the
    # first was (it is the next one the book has free), never the same moment again.
    keys = [{"key_sha256": hash_key("sk-q"), "tenant": "q", "max_queued": 1}]
    async with fake_gateway("gate", keys=keys, max_concurrency=1) as (engine, g):
        headers = {"Authorization": "Bearer sk-q"}
        body = {"model": "fake", "messages": MSG, "max_tokens": 500}
        running = await http.post(g.url + "/v1/jobs", json=body, headers=headers)
        assert running.status_code == 202
        await wait_until(lambda: engine.requests == 1)  # it holds the only slot
        assert (await http.post(g.url + "/v1/jobs", json=body, headers=headers)).status_code == 202
        first = await http.post(g.url + "/v1/jobs", json=body, headers=headers)
        told_first = time.monotonic()
        assert first.status_code == 429 and first.json()["error"]["code"] == "too_many_queued"
        await asyncio.sleep(1.0)  # time passes; nothing starts or ends
        again = await http.post(g.url + "/v1/jobs", json=body, headers=headers)
        told_again = time.monotonic()
        assert again.status_code == 429 and again.json()["error"]["code"] == "too_many_queued"
        waited, left = int(first.headers["retry-after-ms"]), int(again.headers["retry-after-ms"])
        # The moments the two were told to come back at, on this clock (a 50 ms margin for the
        # time between the gateway's decision and the answer's arrival here).
        assert told_again + left / 1000 >= told_first + waited / 1000 - 0.05
        # And it is a time of its own: the book gave the first's away, so the repeat's is later.
        assert told_again + left / 1000 > told_first + waited / 1000 + 0.05
        engine.gate.set()
