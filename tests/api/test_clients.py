"""Clients nobody here wrote, unchanged, against a real gateway: LangChain (``langchain-openai``, over
chat completions and with ``use_responses_api=True``) and litellm (``completion``, streamed
``acompletion``, ``responses``).

The engines are the simulator ('sim': plain text, answers that run to their limit) and the
scripted engine of the Responses tests ('script': tool calls in fragments, and OpenAI's
chunk-level ``system_fingerprint`` and ``service_tier`` on every chunk). The gateway runs in the
test's event loop, so every blocking client call runs in a thread of its own.
"""

from __future__ import annotations

import asyncio
import json
import os
from collections.abc import AsyncIterator
from typing import Any

import pytest

# litellm fetches its model price list from the internet on import unless told to use its own copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")

import litellm
import openai
from langchain_core.messages import AIMessageChunk, HumanMessage
from langchain_core.tools import tool
from langchain_openai import ChatOpenAI

from tests.api.test_responses import ScriptedEngine
from tests.servers import Gateway, run_app, run_gateway

KEY = "sk-clients"
FIELDS = ScriptedEngine.FIELDS


@pytest.fixture
def engine() -> ScriptedEngine:
    return ScriptedEngine()


@pytest.fixture
async def gw(sim_url: str, engine: ScriptedEngine) -> AsyncIterator[Gateway]:
    async with run_app(engine.app()) as script_url, run_gateway([sim_url, script_url]) as g:
        yield g


@tool
def get_weather(city: str) -> str:
    """The weather in a city."""
    return f"sunny in {city}"


def chat(gw: Gateway, model: str, **options: Any) -> ChatOpenAI:
    return ChatOpenAI(model=model, base_url=gw.url + "/v1", api_key=KEY, max_retries=0, **options)  # type: ignore[arg-type]


def joined(chunks: list[AIMessageChunk]) -> AIMessageChunk:
    whole = chunks[0]
    for piece in chunks[1:]:
        whole = whole + piece
    return whole


# --- LangChain over chat completions -------------------------------------------------------------


async def test_langchain_invoke_and_stream(gw: Gateway) -> None:
    llm = chat(gw, "sim", max_tokens=4, stream_usage=True)
    answer = await llm.ainvoke("hello")
    assert len(answer.text.split()) == 4
    assert answer.response_metadata["finish_reason"] == "length"
    assert answer.usage_metadata is not None and answer.usage_metadata["output_tokens"] == 4
    assert answer.response_metadata["id"].startswith("chatcmpl-")
    chunks = [c async for c in llm.astream([HumanMessage("hello")])]
    streamed = joined(chunks)
    assert len(streamed.text.split()) == 4
    assert streamed.usage_metadata is not None and streamed.usage_metadata["output_tokens"] == 4
    assert streamed.response_metadata["finish_reason"] == "length"


async def test_langchain_without_a_limit_is_not_cut(gw: Gateway, engine: ScriptedEngine) -> None:
    # LangChain sends no max_tokens: the engine's own answer comes back whole.
    answer = await chat(gw, "script").ainvoke("hello")
    assert answer.text == "Answer: hello" and answer.response_metadata["finish_reason"] == "stop"
    assert "max_tokens" not in engine.bodies[-1] and "max_completion_tokens" not in engine.bodies[-1]


async def test_langchain_tool_calls_whole_and_streamed(gw: Gateway) -> None:
    llm = chat(gw, "script").bind_tools([get_weather])
    answer = await llm.ainvoke("Weather in Paris?")
    [call] = answer.tool_calls  # type: ignore[attr-defined]
    assert (call["name"], call["args"], call["id"]) == ("get_weather", {"city": "Paris"}, "call_1")
    # Streamed, the fragments are relayed as the engine sent them and LangChain merges them.
    streamed = joined([c async for c in llm.astream("Weather in Paris?")])
    [call] = streamed.tool_calls
    assert (call["name"], call["args"], call["id"]) == ("get_weather", {"city": "Paris"}, "call_1")
    assert streamed.response_metadata["finish_reason"] == "tool_calls"


async def test_langchain_sees_the_engines_chunk_level_fields(gw: Gateway) -> None:
    llm = chat(gw, "script")
    whole = await llm.ainvoke("hello")
    streamed = joined([c async for c in llm.astream("hello")])
    for message in (whole, streamed):
        assert message.response_metadata["system_fingerprint"] == FIELDS["system_fingerprint"]
        assert message.response_metadata["service_tier"] == FIELDS["service_tier"]


async def test_langchain_hears_an_engines_refusal_as_openais_error(gw: Gateway) -> None:
    # A stream's headers wait for the engine: its 400 reaches LangChain as the SDK's error.
    llm = chat(gw, "script", max_tokens=ScriptedEngine.MOST_TOKENS + 1)
    with pytest.raises(openai.BadRequestError) as whole:
        await llm.ainvoke("hello")
    with pytest.raises(openai.BadRequestError) as streamed:
        async for _ in llm.astream("hello"):
            pass
    for info in (whole, streamed):  # LangChain sends max_tokens as max_completion_tokens
        assert info.value.status_code == 400 and info.value.param == "max_completion_tokens"


# --- LangChain over the Responses API ------------------------------------------------------------


async def test_langchain_responses_api_invoke_stream_and_tools(gw: Gateway, engine: ScriptedEngine) -> None:
    llm = chat(gw, "script", use_responses_api=True)
    answer = await llm.ainvoke("hello")
    assert answer.text == "Answer: hello"
    assert answer.response_metadata["id"].startswith("resp_")
    assert answer.usage_metadata is not None and answer.usage_metadata["output_tokens"] == 3
    streamed = joined([c async for c in llm.astream("hello")])
    assert streamed.text == "Answer: hello"
    tools = llm.bind_tools([get_weather])
    called = await tools.ainvoke("Weather in Paris?")
    [call] = called.tool_calls  # type: ignore[attr-defined]
    assert (call["name"], call["args"]) == ("get_weather", {"city": "Paris"})
    streamed_call = joined([c async for c in tools.astream("Weather in Paris?")])
    assert [(c["name"], c["args"]) for c in streamed_call.tool_calls] == [("get_weather", {"city": "Paris"})]
    assert engine.bodies[-1]["tools"][0]["function"]["name"] == "get_weather"


async def test_langchain_responses_api_against_the_simulator(gw: Gateway) -> None:
    answer = await chat(gw, "sim", use_responses_api=True, max_tokens=3).ainvoke("hello")
    assert len(answer.text.split()) == 3
    assert answer.response_metadata["status"] == "incomplete"


# --- openai-python's own stream helper ------------------------------------------------------------


async def test_the_sdks_stream_helper_rebuilds_the_answer_the_gateway_gives_whole(gw: Gateway) -> None:
    # client.chat.completions.stream() folds the relayed chunks itself (the chunk-level fields
    # included): what it builds is the answer the gateway gives without streaming.
    client = openai.AsyncOpenAI(base_url=gw.url + "/v1", api_key=KEY, max_retries=0)
    ask: dict[str, Any] = {
        "model": "script",
        "messages": [{"role": "user", "content": "Weather?"}],
        "tools": [
            {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
        ],
    }
    whole = await client.chat.completions.create(**ask)
    async with client.chat.completions.stream(**ask) as stream:
        kinds = [event.type async for event in stream]
        built = await stream.get_final_completion()
    assert "tool_calls.function.arguments.delta" in kinds
    assert (built.system_fingerprint, built.service_tier) == (whole.system_fingerprint, whole.service_tier)
    assert (built.system_fingerprint, built.service_tier) == tuple(FIELDS.values())
    [mine] = built.choices[0].message.tool_calls or []
    [theirs] = whole.choices[0].message.tool_calls or []
    assert (mine.id, mine.type, mine.function.name) == (theirs.id, theirs.type, theirs.function.name)
    assert json.loads(mine.function.arguments) == json.loads(theirs.function.arguments) == {"city": "Paris"}
    assert built.choices[0].finish_reason == whole.choices[0].finish_reason == "tool_calls"


# --- litellm ---------------------------------------------------------------------------------------


def litellm_options(gw: Gateway) -> dict[str, Any]:
    return {"api_base": gw.url + "/v1", "api_key": KEY, "num_retries": 0}


async def test_litellm_completion(gw: Gateway) -> None:
    options = litellm_options(gw)
    messages = [{"role": "user", "content": "hello"}]
    answer = await asyncio.to_thread(
        litellm.completion, model="openai/sim", messages=messages, max_tokens=3, **options
    )
    assert len(answer.choices[0].message.content.split()) == 3
    assert answer.choices[0].finish_reason == "length" and answer.usage.completion_tokens == 3
    called = await asyncio.to_thread(
        litellm.completion,
        model="openai/script",
        messages=[{"role": "user", "content": "Weather?"}],
        tools=[{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}],
        **options,
    )
    [call] = called.choices[0].message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}
    assert called.system_fingerprint == FIELDS["system_fingerprint"]


async def test_litellm_acompletion_streams(gw: Gateway) -> None:
    options = litellm_options(gw)
    stream = await litellm.acompletion(
        model="openai/script",
        messages=[{"role": "user", "content": "hello"}],
        stream=True,
        stream_options={"include_usage": True},
        **options,
    )
    chunks = [c async for c in stream]
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "Answer: hello"
    assert any(c.choices and c.choices[0].finish_reason == "stop" for c in chunks)
    assert {c.system_fingerprint for c in chunks if c.choices} == {FIELDS["system_fingerprint"]}
    rebuilt = litellm.stream_chunk_builder(chunks)
    assert rebuilt is not None and rebuilt.usage.completion_tokens == 3


async def test_litellm_responses(gw: Gateway) -> None:
    options = litellm_options(gw)
    answer = await asyncio.to_thread(
        litellm.responses, model="openai/script", input="hello", instructions="Be brief.", **options
    )
    assert answer.id.startswith("resp_") and answer.status == "completed"
    [message] = answer.output
    assert message.content[0].text == "Answer: hello"
    assert answer.usage.output_tokens == 3
    stream = await asyncio.to_thread(
        litellm.responses, model="openai/script", input="hello", stream=True, **options
    )
    events = await asyncio.to_thread(lambda: list(stream))
    types = [event.type for event in events]
    assert types[0] == "response.created" and types[-1] == "response.completed"
    assert "".join(e.delta for e in events if e.type == "response.output_text.delta") == "Answer: hello"
    assert events[-1].response.output[0].content[0].text == "Answer: hello"
    # litellm raises max_output_tokens to OpenAI's least (16); the simulator's answer runs to it.
    cut = await asyncio.to_thread(
        litellm.responses, model="openai/sim", input="hello", max_output_tokens=16, stream=True, **options
    )
    events = await asyncio.to_thread(lambda: list(cut))
    final = events[-1].response
    assert len(final.output[0].content[0].text.split()) == 16
    assert final.status == "incomplete" and final.incomplete_details.reason == "max_output_tokens"
