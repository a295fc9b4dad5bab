"""Real answers of the gateway, checked against OpenAI's published schemas.

The schemas are those of OpenAI's OpenAPI spec, pinned in tests/data/openai-openapi/ (its README
says which commit). Each answer is validated against the schema the spec gives the operation it
answers (``paths``), or against a named component: chat completions and their chunks, completions,
the model list and a model, errors, the Responses API's Response object and stream events, and the
Batch API's files and batches.
"""

from __future__ import annotations

import copy
import functools
import json
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from jsonschema import Draft202012Validator
from jsonschema.exceptions import best_match
from referencing import Registry, Resource
from referencing.jsonschema import DRAFT202012

from sluice.api.auth import hash_key
from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.api.test_responses import WEATHER_TOOL, ScriptedEngine
from tests.helpers import wait_until
from tests.servers import Gateway, run_app, run_gateway

SPEC_DIR = Path(__file__).parent / "data" / "openai-openapi"
SPEC_URI = "urn:openai-openapi"
SCHEMAS = "#/components/schemas/"
KEY = "sk-schemas"
AUTH = {"Authorization": f"Bearer {KEY}"}


#: A component of our own, added to the spec: a streamed completion's chunk. The spec streams
#: completions as CreateCompletionResponse objects, whose finish_reason is a string; OpenAI's own
#: stream (and every engine's) sends null in each chunk before the last.
COMPLETION_CHUNK = "sluice.CompletionChunk"


def _nullable(node: Any) -> None:
    """OpenAPI 3.0's ``nullable: true``, which the spec still uses in places, as JSON Schema says
    it (null among the types, and among the values of an enum): a 3.1 document is plain JSON
    Schema 2020-12, and a validator of it ignores ``nullable``."""
    if isinstance(node, dict):
        if node.get("nullable") is True:
            kind = node.get("type")
            if isinstance(kind, str):
                node["type"] = [kind, "null"]
            elif isinstance(kind, list) and "null" not in kind:
                node["type"] = [*kind, "null"]
            if isinstance(node.get("enum"), list) and None not in node["enum"]:
                node["enum"] = [*node["enum"], None]
        for value in node.values():
            _nullable(value)
    elif isinstance(node, list):
        for value in node:
            _nullable(value)


@functools.cache
def spec() -> dict[str, Any]:
    loaded: dict[str, Any] = json.loads((SPEC_DIR / "openapi.json").read_text())
    _nullable(loaded)
    schemas = loaded["components"]["schemas"]
    chunk = copy.deepcopy(schemas["CreateCompletionResponse"])
    reason = chunk["properties"]["choices"]["items"]["properties"]["finish_reason"]
    reason["type"], reason["enum"] = ["string", "null"], [*reason["enum"], None]
    schemas[COMPLETION_CHUNK] = chunk
    return loaded


@functools.cache
def _registry() -> Registry[Any]:
    resource = Resource.from_contents(spec(), default_specification=DRAFT202012)
    return Registry().with_resource(SPEC_URI, resource)


@functools.cache
def validator(component: str) -> Draft202012Validator:
    """A validator of the spec's component schema ``component``; its $refs resolve in the spec."""
    assert component in spec()["components"]["schemas"], component
    return Draft202012Validator({"$ref": f"{SPEC_URI}{SCHEMAS}{component}"}, registry=_registry())


def answer_schema(path: str, method: str, media: str = "application/json", status: str = "200") -> str:
    """The component the spec names for an operation's answer (``/chat/completions``, ``post``)."""
    ref: str = spec()["paths"][path][method]["responses"][status]["content"][media]["schema"]["$ref"]
    return ref.removeprefix(SCHEMAS)


def conforms(instance: Any, component: str) -> None:
    error = best_match(validator(component).iter_errors(instance))
    if error is not None:
        where = "/".join(str(p) for p in error.absolute_path) or "(the whole answer)"
        shown = json.dumps(instance)[:2000]
        raise AssertionError(f"not a {component} at {where}: {error.message}\n{shown}")


@functools.cache
def stream_event_schemas() -> dict[str, str]:
    """Each Responses stream event's ``type``, and the component that describes it."""
    out: dict[str, str] = {}
    for choice in spec()["components"]["schemas"]["ResponseStreamEvent"]["anyOf"]:
        name = choice["$ref"].removeprefix(SCHEMAS)
        kind = spec()["components"]["schemas"][name]["properties"]["type"]
        for value in kind.get("enum", [kind.get("const")]):
            out[value] = name
    return out


def data_lines(text: str) -> Iterator[Any]:
    """The JSON payloads of an SSE body, without the closing [DONE]."""
    for line in text.splitlines():
        if line.startswith("data:"):
            payload = line.removeprefix("data:").strip()
            if payload != "[DONE]":
                yield json.loads(payload)


@pytest.fixture
async def gw(sim_url: str) -> AsyncIterator[Gateway]:
    """A gateway over the simulator ('sim'), the scripted engine ('script': tool calls and
    reasoning) and a simulator that stalls after two tokens ('stall': work that is still
    running when it is cancelled), with a key."""
    engine = ScriptedEngine()
    keys = [{"key_sha256": hash_key(KEY), "tenant": "schemas"}]
    async with (
        run_app(engine.app()) as script_url,
        serve_in_background(preset("fast", model="stall", stall_after=2)) as stall_url,
        run_gateway([sim_url, script_url, stall_url], keys=keys) as g,
    ):
        yield g


@pytest.fixture
async def api(gw: Gateway) -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(base_url=gw.url, headers=AUTH, timeout=30) as client:
        yield client


HELLO = [{"role": "user", "content": "hello"}]
WEATHER = [{"role": "user", "content": "The weather in Paris?"}]
CHAT_TOOL = {"type": "function", "function": {k: v for k, v in WEATHER_TOOL.items() if k != "type"}}


def test_the_pinned_spec_is_openais() -> None:
    assert spec()["openapi"].startswith("3.1")
    assert spec()["info"]["title"] == "OpenAI API"
    assert answer_schema("/chat/completions", "post") == "CreateChatCompletionResponse"


def test_the_check_refuses_what_the_spec_forbids() -> None:
    """The validator resolves the spec's references and holds an answer to them: a tool-call
    message without ``refusal`` (which the spec requires, null) is refused."""
    message = {"role": "assistant", "content": None}
    choice = {"index": 0, "finish_reason": "stop", "logprobs": None, "message": message}
    answer = {"id": "c", "object": "chat.completion", "created": 1, "model": "m", "choices": [choice]}
    with pytest.raises(AssertionError, match="'refusal' is a required property"):
        conforms(answer, "CreateChatCompletionResponse")
    conforms(
        {**answer, "choices": [{**choice, "message": {**message, "refusal": None}}]},
        "CreateChatCompletionResponse",
    )


@pytest.mark.parametrize(
    "body",
    [
        {"model": "sim", "messages": HELLO, "max_tokens": 5},
        {"model": "script", "messages": HELLO},
        {"model": "script", "messages": WEATHER, "tools": [CHAT_TOOL]},  # a tool call, content null
        {"model": "script", "messages": HELLO, "reasoning_effort": "low"},
        {"model": "script", "messages": HELLO, "logprobs": True, "top_logprobs": 2},
    ],
    ids=["sim", "text", "tool-call", "reasoning", "logprobs"],
)
async def test_chat_completion_and_its_chunks(api: httpx.AsyncClient, body: dict[str, Any]) -> None:
    whole = await api.post("/v1/chat/completions", json=body)
    assert whole.status_code == 200, whole.text
    conforms(whole.json(), answer_schema("/chat/completions", "post"))

    streamed = {**body, "stream": True, "stream_options": {"include_usage": True}}
    chunks = await api.post("/v1/chat/completions", json=streamed)
    assert chunks.status_code == 200, chunks.text
    events = list(data_lines(chunks.text))
    assert len(events) >= 2 and events[-1]["usage"] is not None
    for chunk in events:
        conforms(chunk, answer_schema("/chat/completions", "post", "text/event-stream"))


async def test_completion_and_its_chunks(api: httpx.AsyncClient) -> None:
    body = {"model": "sim", "prompt": "once upon a time", "max_tokens": 5}
    whole = await api.post("/v1/completions", json=body)
    assert whole.status_code == 200, whole.text
    conforms(whole.json(), answer_schema("/completions", "post"))
    chunks = await api.post("/v1/completions", json={**body, "stream": True})
    events = list(data_lines(chunks.text))
    assert len(events) >= 5
    for chunk in events:
        conforms(chunk, COMPLETION_CHUNK)
    conforms(events[-1], answer_schema("/completions", "post"))  # the last says why it ended


async def test_models(api: httpx.AsyncClient) -> None:
    listed = await api.get("/v1/models")
    assert listed.status_code == 200
    conforms(listed.json(), answer_schema("/models", "get"))
    assert {m["id"] for m in listed.json()["data"]} == {"sim", "script", "stall"}
    for model in listed.json()["data"]:
        conforms(model, "Model")


async def test_a_model(api: httpx.AsyncClient) -> None:
    one = await api.get("/v1/models/sim")
    if one.status_code == 404 and one.json()["error"]["code"] == "not_found":
        pytest.skip("GET /v1/models/{id} is not served yet")
    assert one.status_code == 200, one.text
    conforms(one.json(), answer_schema("/models/{model}", "get"))


async def test_errors(gw: Gateway, api: httpx.AsyncClient) -> None:
    answers = [
        await api.post("/v1/chat/completions", json={"model": "nope", "messages": HELLO}),
        await api.post("/v1/chat/completions", json={"model": "sim"}),
        await api.post("/v1/chat/completions", content=b"{", headers={"Content-Type": "application/json"}),
        await api.post("/v1/responses", json={"model": "sim", "input": 5}),
        await api.get("/v1/responses/resp_nope"),
        await api.get("/v1/nothing-here"),
        await api.delete("/v1/models"),
        await api.get("/v1/models", headers={"Authorization": "Bearer wrong"}),
    ]
    for answer in answers:
        assert answer.status_code >= 400
        conforms(answer.json(), "ErrorResponse")


async def test_response_objects(api: httpx.AsyncClient) -> None:
    schema = answer_schema("/responses", "post")
    for body in (
        {"model": "sim", "input": "hello", "max_output_tokens": 5},  # incomplete: cut at its limit
        {"model": "script", "input": "hello", "instructions": "Be brief.", "metadata": {"a": "b"}},
        {"model": "script", "input": "The weather in Paris?", "tools": [WEATHER_TOOL]},
        {"model": "script", "input": "hello", "reasoning": {"effort": "low"}},
        {"model": "script", "input": "hello", "top_logprobs": 2},
    ):
        created = await api.post("/v1/responses", json=body)
        assert created.status_code == 200, created.text
        conforms(created.json(), schema)

        rid = created.json()["id"]
        read = await api.get(f"/v1/responses/{rid}")
        conforms(read.json(), answer_schema("/responses/{response_id}", "get"))

    background = {"model": "sim", "input": "hello", "max_output_tokens": 5, "background": True}
    queued = await api.post("/v1/responses", json=background)
    conforms(queued.json(), schema)
    cancelled = await api.post(f"/v1/responses/{queued.json()['id']}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    conforms(cancelled.json(), answer_schema("/responses/{response_id}/cancel", "post"))


@pytest.mark.parametrize(
    "body",
    [
        {"model": "sim", "input": "hello", "max_output_tokens": 5},
        {"model": "script", "input": "The weather in Paris?", "tools": [WEATHER_TOOL]},
        {"model": "script", "input": "hello", "reasoning": {"effort": "low"}},
        {"model": "script", "input": "hello", "top_logprobs": 2},
    ],
    ids=["sim", "tool-call", "reasoning", "logprobs"],
)
async def test_response_stream_events(api: httpx.AsyncClient, body: dict[str, Any]) -> None:
    answer = await api.post("/v1/responses", json={**body, "stream": True})
    assert answer.status_code == 200, answer.text
    events = list(data_lines(answer.text))
    assert events and events[0]["type"] == "response.created"
    schemas = stream_event_schemas()
    for event in events:
        assert event["type"] in schemas, event["type"]
        conforms(event, schemas[event["type"]])
        conforms(event, answer_schema("/responses", "post", "text/event-stream"))


def as_published(answer: dict[str, Any], component: str) -> dict[str, Any]:
    """A file or batch object with its optional fields that are null left out. OpenAI's own
    answers send null for a file's ``status_details`` and ``expires_at`` and for a batch's
    timestamps, files and usage not yet there; its spec types them without a null but requires
    none of them, and the official SDKs type them optional: null and absent read alike."""
    required = set(spec()["components"]["schemas"][component].get("required", []))
    return {k: v for k, v in answer.items() if v is not None or k in required}


def as_published_list(answer: dict[str, Any], component: str) -> dict[str, Any]:
    return {**answer, "data": [as_published(item, component) for item in answer["data"]]}


async def test_files_and_batches(api: httpx.AsyncClient) -> None:
    lines = [
        {
            "custom_id": f"line-{i}",
            "method": "POST",
            "url": "/v1/chat/completions",
            "body": {"model": "sim", "messages": HELLO, "max_tokens": 2},
        }
        for i in range(2)
    ]
    content = "".join(json.dumps(line) + "\n" for line in lines).encode()
    uploaded = await api.post(
        "/v1/files", data={"purpose": "batch"}, files={"file": ("in.jsonl", content, "application/jsonl")}
    )
    assert uploaded.status_code == 200, uploaded.text
    conforms(as_published(uploaded.json(), "OpenAIFile"), answer_schema("/files", "post"))
    file_id = uploaded.json()["id"]
    read = (await api.get(f"/v1/files/{file_id}")).json()
    conforms(as_published(read, "OpenAIFile"), answer_schema("/files/{file_id}", "get"))
    listed = (await api.get("/v1/files")).json()
    conforms(as_published_list(listed, "OpenAIFile"), answer_schema("/files", "get"))

    ask = {"input_file_id": file_id, "endpoint": "/v1/chat/completions", "completion_window": "24h"}
    created = await api.post("/v1/batches", json=ask)
    assert created.status_code == 200, created.text
    conforms(as_published(created.json(), "Batch"), answer_schema("/batches", "post"))
    batch_id = created.json()["id"]

    async def finished() -> bool:
        read = await api.get(f"/v1/batches/{batch_id}")
        return bool(read.json()["status"] in ("completed", "failed"))

    await wait_until(finished, timeout=30)
    done = (await api.get(f"/v1/batches/{batch_id}")).json()
    assert done["status"] == "completed", done
    conforms(as_published(done, "Batch"), answer_schema("/batches/{batch_id}", "get"))
    batches = (await api.get("/v1/batches")).json()
    conforms(as_published_list(batches, "Batch"), answer_schema("/batches", "get"))
    # Each output line's answer is a chat completion as the spec has it.
    output = await api.get(f"/v1/files/{done['output_file_id']}/content")
    answers = [json.loads(line) for line in output.text.splitlines()]
    assert sorted(a["custom_id"] for a in answers) == ["line-0", "line-1"]
    for line in answers:
        assert line["response"]["status_code"] == 200
        conforms(line["response"]["body"], answer_schema("/chat/completions", "post"))

    # A batch whose line stalls is still running when it is cancelled.
    stalled = {**lines[0], "body": {**lines[0]["body"], "model": "stall", "max_tokens": 50}}
    upload = ("stall.jsonl", (json.dumps(stalled) + "\n").encode(), "application/jsonl")
    stall_file = await api.post("/v1/files", data={"purpose": "batch"}, files={"file": upload})
    other = await api.post("/v1/batches", json={**ask, "input_file_id": stall_file.json()["id"]})
    cancelled = await api.post(f"/v1/batches/{other.json()['id']}/cancel")
    assert cancelled.status_code == 200, cancelled.text
    assert cancelled.json()["status"] in ("cancelling", "cancelled")
    conforms(as_published(cancelled.json(), "Batch"), answer_schema("/batches/{batch_id}/cancel", "post"))
    deleted = await api.delete(f"/v1/files/{done['output_file_id']}")
    assert deleted.status_code == 200, deleted.text
    conforms(deleted.json(), answer_schema("/files/{file_id}", "delete"))
