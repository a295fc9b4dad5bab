"""The Responses API, driven by the official SDK and the OpenAI Agents SDK, through Sluice to engines
that speak only chat completions: the simulator (whose answers always run to their token limit)
and a scripted engine that finishes, calls tools and thinks aloud."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import openai
import pytest
from openai.types.responses import Response as SDKResponse
from openai.types.responses import ResponseStreamEvent
from pydantic import TypeAdapter
from starlette.applications import Starlette
from starlette.requests import Request
from starlette.responses import JSONResponse, Response, StreamingResponse
from starlette.routing import Route

from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.helpers import wait_until
from tests.redis_server import RedisServer
from tests.servers import Gateway, run_app, run_gateway

EVENTS: TypeAdapter[Any] = TypeAdapter(ResponseStreamEvent)
KEY = "test-key"
AUTH = {"Authorization": f"Bearer {KEY}"}

WEATHER_TOOL = {
    "type": "function",
    "name": "get_weather",
    "description": "The weather in a city.",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    "strict": True,
}


class ScriptedEngine:
    """A chat-completions engine that answers by rule, so that a test knows the answer: with tools
    and no tool result yet, it calls the first tool for Paris; otherwise it answers "Answer: "
    and the last message's text, finishing with "stop". A request with ``reasoning_effort``
    thinks aloud first (``reasoning_content``). Streamed, every piece is a chunk of its own and a
    tool call's arguments come in fragments, as vLLM sends them. Every chunk and whole answer
    carries OpenAI's chunk-level fields (:data:`FIELDS`), and each piece of content its log
    probability when the request asks for them (:meth:`logprob`). A request asking for more than
    :data:`MOST_TOKENS` tokens is refused with a 400 naming the field it came in
    (``max_completion_tokens`` or ``max_tokens``), as vLLM refuses one past the context window.
    It keeps the bodies it got."""

    #: What OpenAI says on every chunk besides the choices.
    FIELDS = {"system_fingerprint": "fp_script", "service_tier": "default"}
    MOST_TOKENS = 1000

    def __init__(self) -> None:
        self.bodies: list[dict[str, Any]] = []

    def pieces(self, body: dict[str, Any]) -> tuple[list[dict[str, Any]], str]:
        messages = body["messages"]
        last = messages[-1]
        deltas: list[dict[str, Any]] = [{"role": "assistant"}]
        if body.get("reasoning_effort"):
            deltas += [{"reasoning_content": "Let me "}, {"reasoning_content": "think."}]
        if body.get("tools") and last["role"] != "tool":
            name = body["tools"][0]["function"]["name"]
            head = {
                "index": 0,
                "id": "call_1",
                "type": "function",
                "function": {"name": name, "arguments": ""},
            }
            deltas += [
                {"tool_calls": [head]},
                {"tool_calls": [{"index": 0, "function": {"arguments": '{"city": '}}]},
                {"tool_calls": [{"index": 0, "function": {"arguments": '"Paris"}'}}]},
            ]
            return deltas, "tool_calls"
        content = last["content"]
        text = content if isinstance(content, str) else " ".join(p.get("text", "") for p in content)
        deltas += [{"content": "Answer: "}, {"content": text}]
        return deltas, "stop"

    @staticmethod
    def logprob(piece: str, body: dict[str, Any]) -> dict[str, Any]:
        """A piece's log probability as chat has it (OpenAI's shape, ``bytes`` null as it may
        be), with ``top_logprobs`` alternatives when the request asked for some."""
        top = [
            {"token": f"alt{k}", "logprob": -2.0 - k, "bytes": None}
            for k in range(body.get("top_logprobs") or 0)
        ]
        return {"token": piece, "logprob": -0.5, "bytes": None, "top_logprobs": top}

    async def chat(self, request: Request) -> Response:
        body = await request.json()
        self.bodies.append(body)
        limit = "max_completion_tokens" if "max_completion_tokens" in body else "max_tokens"
        if int(body.get(limit) or 0) > self.MOST_TOKENS:
            message = f"{limit} must be at most {self.MOST_TOKENS} (the context window)."
            error = {"message": message, "type": "BadRequestError", "param": limit, "code": 400}
            return JSONResponse({"error": error}, status_code=400)
        deltas, finish = self.pieces(body)
        usage = {"prompt_tokens": 11, "completion_tokens": len(deltas), "total_tokens": 11 + len(deltas)}
        base = {"id": "chatcmpl-x", "created": 1, "model": "script", **self.FIELDS}
        if not body.get("stream"):
            message: dict[str, Any] = {"role": "assistant", "content": None}
            for d in deltas[1:]:
                if "content" in d:
                    message["content"] = (message["content"] or "") + d["content"]
                if "reasoning_content" in d:
                    message["reasoning_content"] = (
                        message.get("reasoning_content", "") + d["reasoning_content"]
                    )
            calls = [d["tool_calls"][0] for d in deltas if "tool_calls" in d]
            if calls:
                arguments = "".join(c["function"]["arguments"] for c in calls)
                message["tool_calls"] = [
                    {**calls[0], "function": {**calls[0]["function"], "arguments": arguments}}
                ]
                del message["tool_calls"][0]["index"]
            logprobs = None
            if body.get("logprobs"):
                content = [self.logprob(d["content"], body) for d in deltas if "content" in d]
                logprobs = {"content": content, "refusal": None}
            choice = {"index": 0, "message": message, "finish_reason": finish, "logprobs": logprobs}
            return JSONResponse({**base, "object": "chat.completion", "choices": [choice], "usage": usage})

        async def chunks() -> AsyncIterator[bytes]:
            for i, delta in enumerate(deltas):
                choice = {
                    "index": 0,
                    "delta": delta,
                    "finish_reason": finish if i == len(deltas) - 1 else None,
                }
                if body.get("logprobs") and "content" in delta:
                    piece = self.logprob(delta["content"], body)
                    choice["logprobs"] = {"content": [piece], "refusal": None}
                data = {**base, "object": "chat.completion.chunk", "choices": [choice]}
                yield f"data: {json.dumps(data)}\n\n".encode()
            if (body.get("stream_options") or {}).get("include_usage"):
                tail = {**base, "object": "chat.completion.chunk", "choices": [], "usage": usage}
                yield f"data: {json.dumps(tail)}\n\n".encode()
            yield b"data: [DONE]\n\n"

        return StreamingResponse(chunks(), media_type="text/event-stream")

    def app(self) -> Starlette:
        async def models(request: Request) -> Response:
            return JSONResponse({"object": "list", "data": [{"id": "script", "object": "model"}]})

        return Starlette(
            routes=[Route("/v1/chat/completions", self.chat, methods=["POST"]), Route("/v1/models", models)]
        )


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine()


@pytest.fixture
async def gw(sim_url: str, engine: ScriptedEngine) -> AsyncIterator[Gateway]:
    """A gateway over three engines: the simulator ('sim'), the scripted engine ('script') and a
    simulator that stalls after two tokens ('stall'), for responses that are still running."""
    async with (
        run_app(engine.app()) as script_url,
        serve_in_background(preset("fast", model="stall", stall_after=2)) as stall_url,
        run_gateway([sim_url, script_url, stall_url], max_concurrency=4) as g,
    ):
        yield g


@pytest.fixture
def client(gw: Gateway) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)


async def job_state(gw: Gateway, response_id: str) -> str | None:
    job = await gw.broker.get("job_" + response_id.removeprefix("resp_"))
    return None if job is None else str(job.state.value)


async def raw_events(
    gw: Gateway, path: str, body: dict[str, Any] | None = None, headers: dict[str, str] | None = None
) -> list[dict[str, Any]]:
    """The events of a stream as sent, each validated against the SDK's event types; each SSE
    event is named by its type and numbered by its sequence number."""
    events = []
    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH, timeout=30) as http:
        method = "POST" if body is not None else "GET"
        async with http.stream(method, path, json=body, headers=headers) as r:
            name, number = None, None
            assert r.status_code == 200, await r.aread()
            async for line in r.aiter_lines():
                if line.startswith("event:"):
                    name = line[6:].strip()
                elif line.startswith("id:"):
                    number = int(line[3:])
                elif line.startswith("data:"):
                    event = json.loads(line[5:])
                    EVENTS.validate_python(event)
                    assert (name, number) == (event["type"], event["sequence_number"])
                    events.append(event)
    return events


# --- create -------------------------------------------------------------------------------------


async def test_create_translates_to_chat_and_back(client: openai.AsyncOpenAI, engine: ScriptedEngine) -> None:
    raw = await client.responses.with_raw_response.create(
        model="script", input="hello", instructions="Be brief.", metadata={"case": "1"}, temperature=0.5
    )
    r = raw.parse()
    SDKResponse.model_validate(r.to_dict())
    assert r.id.startswith("resp_") and raw.headers["x-sluice-job-id"] == "job_" + r.id.removeprefix("resp_")
    assert (r.object, r.status, r.model, r.output_text) == (
        "response",
        "completed",
        "script",
        "Answer: hello",
    )
    assert r.completed_at is not None and r.error is None and r.incomplete_details is None
    assert (r.instructions, r.metadata, r.temperature) == ("Be brief.", {"case": "1"}, 0.5)
    message = r.output[0]
    assert message.type == "message" and message.role == "assistant" and message.status == "completed"
    assert r.usage is not None
    assert (r.usage.input_tokens, r.usage.output_tokens, r.usage.total_tokens) == (11, 3, 14)
    assert r.usage.input_tokens_details.cached_tokens == 0
    assert r.usage.output_tokens_details.reasoning_tokens == 0
    sent = engine.bodies[-1]
    assert sent["messages"] == [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "hello"},
    ]
    assert sent["temperature"] == 0.5 and "metadata" not in sent and "instructions" not in sent


async def test_an_answer_cut_by_its_limit_is_incomplete(client: openai.AsyncOpenAI) -> None:
    r = await client.responses.create(model="sim", input="hello", max_output_tokens=5)
    assert r.status == "incomplete" and r.incomplete_details is not None
    assert r.incomplete_details.reason == "max_output_tokens" and r.completed_at is None
    assert r.max_output_tokens == 5 and r.usage is not None and r.usage.output_tokens == 5
    assert r.output[0].status == "incomplete" and len(r.output_text.split()) == 5


async def test_items_and_tool_calls_round_trip(client: openai.AsyncOpenAI, engine: ScriptedEngine) -> None:
    first = await client.responses.create(
        model="script",
        input=[{"role": "developer", "content": "Use tools."}, {"role": "user", "content": "Weather?"}],
        tools=[WEATHER_TOOL],
        tool_choice="required",
    )
    assert first.status == "completed" and first.tools[0].name == "get_weather"
    call = first.output[-1]
    assert call.type == "function_call" and call.status == "completed"
    assert (call.call_id, call.name, json.loads(call.arguments)) == (
        "call_1",
        "get_weather",
        {"city": "Paris"},
    )
    assert engine.bodies[-1]["tools"] == [
        {"type": "function", "function": {k: v for k, v in WEATHER_TOOL.items() if k != "type"}}
    ]
    assert engine.bodies[-1]["tool_choice"] == "required"

    history: list[Any] = [{"role": "user", "content": "Weather?"}, *[o.to_dict() for o in first.output]]
    history.append({"type": "function_call_output", "call_id": call.call_id, "output": "sunny"})
    second = await client.responses.create(model="script", input=history, tools=[WEATHER_TOOL])
    assert second.output_text == "Answer: sunny"
    messages = engine.bodies[-1]["messages"]
    assert messages[1]["role"] == "assistant" and messages[1]["tool_calls"][0]["id"] == "call_1"
    assert messages[1]["tool_calls"][0]["function"] == {
        "name": "get_weather",
        "arguments": '{"city": "Paris"}',
    }
    assert messages[2] == {"role": "tool", "tool_call_id": "call_1", "content": "sunny"}


async def test_previous_response_id_continues_without_old_instructions(
    client: openai.AsyncOpenAI, engine: ScriptedEngine
) -> None:
    first = await client.responses.create(model="script", input="one", instructions="Old.")
    second = await client.responses.create(
        model="script", input="two", instructions="New.", previous_response_id=first.id
    )
    assert second.previous_response_id == first.id and second.output_text == "Answer: two"
    assert engine.bodies[-1]["messages"] == [
        {"role": "system", "content": "New."},
        {"role": "user", "content": "one"},
        {"role": "assistant", "content": "Answer: one"},
        {"role": "user", "content": "two"},
    ]
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model="script", input="x", previous_response_id="resp_nothing")
    assert info.value.code == "previous_response_not_found"


# --- streams ------------------------------------------------------------------------------------


async def test_stream_events_in_order(client: openai.AsyncOpenAI, gw: Gateway) -> None:
    stream = await client.responses.create(model="sim", input="hello", max_output_tokens=4, stream=True)
    events = [e async for e in stream]
    types = [e.type for e in events]
    assert types == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * 4,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        "response.incomplete",
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    deltas = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    final = events[-1].response
    assert final.output_text == deltas and final.usage is not None and final.usage.output_tokens == 4
    assert await client.responses.retrieve(final.id) == final  # the stream ends with what GET returns
    # The raw stream names each event and validates against the SDK's event types.
    raw = await raw_events(
        gw, "/v1/responses", {"model": "sim", "input": "x", "max_output_tokens": 2, "stream": True}
    )
    assert [e["type"] for e in raw][-1] == "response.incomplete"


async def test_stream_helper_with_tool_calls_and_reasoning(client: openai.AsyncOpenAI) -> None:
    async with client.responses.stream(
        model="script", input="Weather?", tools=[WEATHER_TOOL], reasoning={"effort": "low"}
    ) as stream:
        types = [event.type async for event in stream]
        final = await stream.get_final_response()
    assert final.status == "completed"
    assert [o.type for o in final.output] == ["reasoning", "function_call"]
    reasoning, call = final.output
    assert reasoning.content is not None and reasoning.content[0].text == "Let me think."
    assert call.type == "function_call" and json.loads(call.arguments) == {"city": "Paris"}
    assert types.count("response.function_call_arguments.delta") == 2
    assert "response.function_call_arguments.done" in types and "response.reasoning_text.delta" in types
    assert types[-1] == "response.completed"


async def test_disconnect_cancels_a_streamed_response(client: openai.AsyncOpenAI, gw: Gateway) -> None:
    stream = await client.responses.create(model="stall", input="hello", max_output_tokens=50, stream=True)
    rid = ""
    async for event in stream:
        if event.type == "response.created":
            rid = event.response.id
        if event.type == "response.output_text.delta":
            break
    await stream.close()

    async def cancelled() -> bool:
        return await job_state(gw, rid) == "cancelled"

    await wait_until(cancelled)


async def test_disconnect_cancels_a_waiting_response(gw: Gateway) -> None:
    async def running() -> int:
        stats = await gw.broker.stats()
        return int(stats["stall"].running_jobs) if "stall" in stats else 0

    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH) as http:
        body = {"model": "stall", "input": "hello", "max_output_tokens": 50}
        request = asyncio.create_task(http.post("/v1/responses", json=body, timeout=30))
        await wait_until(running)
        request.cancel()  # the client gives up: its connection closes
        await asyncio.gather(request, return_exceptions=True)

    async def idle() -> bool:
        return await running() == 0

    await wait_until(idle)


# --- background ---------------------------------------------------------------------------------


async def test_background_retrieve_and_resume(client: openai.AsyncOpenAI, gw: Gateway) -> None:
    queued = await client.responses.create(model="sim", input="hello", max_output_tokens=3, background=True)
    assert queued.status == "queued" and queued.background is True and queued.output == []

    async def ended() -> bool:
        return (await client.responses.retrieve(queued.id)).status not in ("queued", "in_progress")

    await wait_until(ended)
    done = await client.responses.retrieve(queued.id)
    assert done.status == "incomplete" and len(done.output_text.split()) == 3

    full = await raw_events(gw, f"/v1/responses/{queued.id}?stream=true")
    assert [e["type"] for e in full[:3]] == ["response.created", "response.queued", "response.in_progress"]
    assert full[0]["response"]["status"] == "queued" and full[-1]["response"] == done.to_dict(mode="json")
    tail = await client.responses.retrieve(queued.id, stream=True, starting_after=4)
    resumed = [e.to_dict(mode="json") async for e in tail]
    assert resumed == [e for e in full if e["sequence_number"] > 4] and resumed
    # An EventSource reconnecting says where it was with Last-Event-ID.
    assert (
        await raw_events(gw, f"/v1/responses/{queued.id}?stream=true", headers={"Last-Event-ID": "4"})
        == resumed
    )


async def test_background_cancel(client: openai.AsyncOpenAI, gw: Gateway) -> None:
    r = await client.responses.create(model="stall", input="hello", max_output_tokens=50, background=True)

    async def running() -> bool:
        return (await client.responses.retrieve(r.id)).status == "in_progress"

    await wait_until(running)
    cancelled = await client.responses.cancel(r.id)
    assert cancelled.status == "cancelled" and cancelled.error is None
    assert (await client.responses.retrieve(r.id)).status == "cancelled"
    assert await job_state(gw, r.id) == "cancelled"
    again = await client.responses.cancel(r.id)  # cancelling what has ended answers it as it is
    assert again.status == "cancelled"


async def test_a_background_stream_outlives_its_client(client: openai.AsyncOpenAI, gw: Gateway) -> None:
    stream = await client.responses.create(
        model="stall", input="hello", max_output_tokens=50, background=True, stream=True
    )
    rid = ""
    async for event in stream:
        if event.type == "response.created":
            rid = event.response.id
            assert event.response.status == "queued"
        if event.type == "response.output_text.delta":
            break
    await stream.close()
    await asyncio.sleep(0.2)  # time for a cancellation to land, if one were (wrongly) made
    assert await job_state(gw, rid) == "running"
    await client.responses.cancel(rid)


async def test_delete(client: openai.AsyncOpenAI, gw: Gateway) -> None:
    r = await client.responses.create(model="stall", input="hello", max_output_tokens=50, background=True)
    assert await client.responses.delete(r.id) is None
    assert await job_state(gw, r.id) == "cancelled"  # deleting a running response stops it
    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH) as http:
        answer = await http.delete(f"/v1/responses/{r.id}")
    assert answer.json() == {"id": r.id, "object": "response.deleted", "deleted": True}


async def test_background_on_redis(sim_url: str) -> None:
    """The same flow on the Redis broker: the response's record and its event log live in Redis."""
    from tests.broker.brokers import empty_redis

    with RedisServer() as server:
        url = await empty_redis(server)
        async with (
            serve_in_background(preset("fast", model="stall", stall_after=2)) as stall_url,
            run_gateway([sim_url, stall_url], broker=url) as g,
        ):
            client = openai.AsyncOpenAI(base_url=g.url + "/v1", api_key=KEY, max_retries=0)
            queued = await client.responses.create(
                model="sim", input="hi", max_output_tokens=3, background=True, metadata={"on": "redis"}
            )

            async def ended() -> bool:
                return (await client.responses.retrieve(queued.id)).status == "incomplete"

            await wait_until(ended)
            done = await client.responses.retrieve(queued.id)
            assert done.metadata == {"on": "redis"} and len(done.output_text.split()) == 3
            full = await raw_events(g, f"/v1/responses/{queued.id}?stream=true")
            assert full[-1]["response"] == done.to_dict(mode="json")
            assert await raw_events(g, f"/v1/responses/{queued.id}?stream=true&starting_after=5") == full[6:]

            running = await client.responses.create(
                model="stall", input="hi", max_output_tokens=50, background=True
            )

            async def started() -> bool:
                return (await client.responses.retrieve(running.id)).status == "in_progress"

            await wait_until(started)
            assert (await client.responses.cancel(running.id)).status == "cancelled"


# --- errors -------------------------------------------------------------------------------------


async def test_errors_in_openai_shape(client: openai.AsyncOpenAI) -> None:
    with pytest.raises(openai.NotFoundError) as missing_model:
        await client.responses.create(model="nope", input="x")
    assert missing_model.value.code == "model_not_found"
    with pytest.raises(openai.BadRequestError) as hosted:
        await client.responses.create(model="sim", input="x", tools=[{"type": "web_search"}])
    assert hosted.value.param == "tools.0.type"
    with pytest.raises(openai.BadRequestError) as limit:
        await client.responses.create(model="sim", input="x", max_output_tokens=0)
    assert limit.value.param == "max_output_tokens" and "'max_output_tokens'" in limit.value.message
    with pytest.raises(openai.BadRequestError) as item:
        await client.responses.create(
            model="sim", input=[{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]
        )
    assert item.value.param == "input.0.content.0.type"
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve("resp_unknown")
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve("job_notaresponse")
    done = await client.responses.create(model="sim", input="x", max_output_tokens=1)
    with pytest.raises(openai.BadRequestError):
        await client.responses.cancel(done.id)  # only background responses can be cancelled


async def test_a_stream_the_engine_refuses_is_its_status_in_the_requests_words(
    client: openai.AsyncOpenAI, gw: Gateway
) -> None:
    # The engine refuses max_tokens past its window: a 400 naming what the client sent, streamed
    # or not, never an HTTP 200 whose stream holds response.failed.
    ask = {"model": "script", "input": "hello", "max_output_tokens": ScriptedEngine.MOST_TOKENS + 1}
    errors = []
    for stream in (False, True):
        with pytest.raises(openai.BadRequestError) as info:
            await client.responses.create(**ask, stream=stream)  # type: ignore[call-overload]
        errors.append(info.value)
    for error in errors:
        assert error.status_code == 400 and error.param == "max_output_tokens"
        assert "at most 1000" in error.message  # the engine's own words
    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH, timeout=30) as http:
        raw = await http.post("/v1/responses", json={**ask, "stream": True})
    assert raw.status_code == 400 and raw.headers["content-type"].startswith("application/json")
    assert raw.json()["error"]["param"] == "max_output_tokens"
    job = await gw.broker.get(raw.headers["x-sluice-job-id"])
    assert job is not None and job.terminal


async def test_the_engines_service_tier_is_the_responses(client: openai.AsyncOpenAI) -> None:
    tier = ScriptedEngine.FIELDS["service_tier"]
    whole = await client.responses.create(model="script", input="hello")
    assert whole.service_tier == tier
    stream = await client.responses.create(model="script", input="hello", stream=True)
    events = [e async for e in stream]
    final = events[-1]
    assert final.type == "response.completed" and final.response.service_tier == tier
    assert (await client.responses.retrieve(final.response.id)).service_tier == tier
    # An engine that says no tier (the simulator): the field is left out, as the spec allows.
    plain = await client.responses.with_raw_response.create(model="sim", input="x", max_output_tokens=1)
    assert "service_tier" not in json.loads(plain.text)


async def test_log_probabilities_of_the_output_text(
    client: openai.AsyncOpenAI, engine: ScriptedEngine
) -> None:
    def tokens(logprobs: Any) -> list[tuple[str, int]]:
        return [(t.token, len(t.top_logprobs or [])) for t in logprobs or []]

    whole = await client.responses.create(model="script", input="hello", top_logprobs=2)
    assert engine.bodies[-1]["logprobs"] is True and engine.bodies[-1]["top_logprobs"] == 2
    part = whole.output[0].content[0]
    assert part.type == "output_text" and tokens(part.logprobs) == [("Answer: ", 2), ("hello", 2)]
    assert part.logprobs is not None and part.logprobs[0].bytes == list(b"Answer: ")
    assert part.logprobs[0].top_logprobs[0].token == "alt0" and whole.top_logprobs == 2

    stream = await client.responses.create(model="script", input="hello", top_logprobs=1, stream=True)
    events = [e async for e in stream]
    deltas = [e for e in events if e.type == "response.output_text.delta"]
    assert [tokens(e.logprobs) for e in deltas] == [[("Answer: ", 1)], [("hello", 1)]]
    [done] = [e for e in events if e.type == "response.output_text.done"]
    assert tokens(done.logprobs) == [("Answer: ", 1), ("hello", 1)]
    final = events[-1].response
    assert tokens(final.output[0].content[0].logprobs) == [("Answer: ", 1), ("hello", 1)]
    assert await client.responses.retrieve(final.id) == final

    # include alone asks for them without alternatives; neither asks for none.
    included = await client.responses.create(
        model="script", input="hello", include=["message.output_text.logprobs"]
    )
    assert engine.bodies[-1]["logprobs"] is True and "top_logprobs" not in engine.bodies[-1]
    assert tokens(included.output[0].content[0].logprobs) == [("Answer: ", 0), ("hello", 0)]
    plain = await client.responses.create(model="script", input="hello")
    assert "logprobs" not in engine.bodies[-1] and plain.output[0].content[0].logprobs == []
    with pytest.raises(openai.BadRequestError) as info:
        await client.responses.create(model="script", input="hello", top_logprobs=21)
    assert info.value.param == "top_logprobs"


async def test_chat_jobs_are_not_responses(client: openai.AsyncOpenAI) -> None:
    raw = await client.chat.completions.with_raw_response.create(
        model="sim", messages=[{"role": "user", "content": "x"}], max_tokens=1
    )
    job_id = raw.headers["x-sluice-job-id"]
    with pytest.raises(openai.NotFoundError):
        await client.responses.retrieve("resp_" + job_id.removeprefix("job_"))


# --- the OpenAI Agents SDK ----------------------------------------------------------------------


@pytest.fixture
def run_config(client: openai.AsyncOpenAI) -> Any:
    agents = pytest.importorskip("agents")
    agents.set_tracing_disabled(True)  # traces would go to OpenAI's servers
    # The SDK's default provider and model: the Responses API over HTTP.
    return agents.RunConfig(model_provider=agents.OpenAIProvider(openai_client=client, use_responses=True))


async def test_agents_sdk_runs_a_tool_loop(run_config: Any, engine: ScriptedEngine) -> None:
    import agents

    calls: list[str] = []

    @agents.function_tool
    def get_weather(city: str) -> str:
        """The weather in a city."""
        calls.append(city)
        return f"sunny in {city}"

    agent = agents.Agent(name="weather", instructions="Use tools.", model="script", tools=[get_weather])
    result = await agents.Runner.run(agent, "Weather?", run_config=run_config)
    assert calls == ["Paris"] and result.final_output == "Answer: sunny in Paris"
    assert engine.bodies[-1]["messages"][0] == {"role": "system", "content": "Use tools."}

    streamed = agents.Runner.run_streamed(agent, "Weather?", run_config=run_config)
    kinds = {event.type async for event in streamed.stream_events()}
    assert streamed.final_output == "Answer: sunny in Paris" and "raw_response_event" in kinds


async def test_agents_sdk_against_the_simulator(run_config: Any) -> None:
    import agents

    agent = agents.Agent(
        name="sim", instructions="Be brief.", model="sim", model_settings=agents.ModelSettings(max_tokens=4)
    )
    # The simulator always runs to the limit, which the Responses API calls incomplete; the SDK
    # reads the response and refuses an incomplete answer, with the reason it was given.
    with pytest.raises(agents.exceptions.ModelBehaviorError, match="max_output_tokens"):
        await agents.Runner.run(agent, "hi", run_config=run_config)
