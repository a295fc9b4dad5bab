"""Input meant to hurt: no request gets a 5xx or a dropped connection, and what the engine could not
take is refused at the door, naming the field.

Each case here was a 500 (or a cut stream, or a dead worker) before: JSON nested past what the
serializers take, a lone UTF-16 surrogate, a retry count too long for int(), event ids past what a
Redis stream id holds, a WebSocket ``after`` that str.isdigit() accepts and int() does not.
"""

from __future__ import annotations

import json
from collections.abc import AsyncIterator, Iterator
from typing import Any

import httpx
import pytest
import websockets
from websockets.exceptions import ConnectionClosed, InvalidStatus

from sluice.api.jobs import MAX_EVENT_ID
from sluice.api.schemas import MAX_JSON_DEPTH
from tests.redis_server import RedisServer
from tests.servers import Gateway, run_gateway

MSG = [{"role": "user", "content": "hi"}]
CHAT = {"model": "sim", "messages": MSG, "max_tokens": 2}


def nested(depth: int, leaf: Any = "x") -> Any:
    """``leaf`` inside ``depth`` objects."""
    value = leaf
    for _ in range(depth):
        value = {"a": value}
    return value


def raw_json(body: Any) -> bytes:
    """The body as JSON text, however deep (json.dumps recurses), with \\ud800 escapes kept."""
    deep = isinstance(body, dict) and any(_depth(v) > 500 for v in body.values())
    text = _deep_dumps(body) if deep else json.dumps(body, ensure_ascii=True)
    return text.encode()


def _depth(value: Any) -> int:
    depth = 0
    while isinstance(value, dict) and value:
        value = next(iter(value.values()))
        depth += 1
    return depth


def _deep_dumps(body: dict[str, Any]) -> str:
    # Only the shapes these tests build: a flat object whose one deep field is a chain of {"a": ...}.
    parts = []
    for key, value in body.items():
        depth = _depth(value)
        leaf = value
        for _ in range(depth):
            leaf = leaf["a"]
        parts.append(json.dumps(key) + ":" + '{"a":' * depth + json.dumps(leaf) + "}" * depth)
    return "{" + ",".join(parts) + "}"


async def post(http: httpx.AsyncClient, url: str, body: Any) -> httpx.Response:
    return await http.post(url, content=raw_json(body), headers={"content-type": "application/json"})


def assert_400(r: httpx.Response, param: str | None) -> None:
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["type"] == "invalid_request_error" and error["code"] == "invalid_value", error
    assert error["param"] == param, error


@pytest.fixture
async def gw(sim_url: str) -> AsyncIterator[Gateway]:
    async with run_gateway([sim_url], max_tokens_cap=50) as g:
        yield g


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


@pytest.fixture(params=["memory", "redis"])
async def either(request: pytest.FixtureRequest, sim_url: str) -> AsyncIterator[Gateway]:
    """A gateway on each broker."""
    broker = "memory"
    if request.param == "redis":
        broker = request.getfixturevalue("redis_server").url
    async with run_gateway([sim_url], broker=broker, max_tokens_cap=50) as g:
        yield g


# --- nesting ----------------------------------------------------------------------------------------


@pytest.mark.parametrize("depth", [MAX_JSON_DEPTH - 1, MAX_JSON_DEPTH, 256, 300, 900, 5000])
@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/jobs"])
async def test_json_nested_deep_in_an_unknown_field_is_a_400(
    gw: Gateway, http: httpx.AsyncClient, depth: int, path: str
) -> None:
    r = await post(http, gw.url + path, {**CHAT, "x_extra": nested(depth)})
    if depth + 1 <= MAX_JSON_DEPTH:  # the body itself is a level
        assert r.status_code < 300, r.text
        return
    assert r.status_code == 400, r.text
    error = r.json()["error"]
    assert error["code"] == "invalid_value"
    assert f"{MAX_JSON_DEPTH} levels" in error["message"]
    if depth < 900:  # deeper still, the JSON parser itself gives up: the body, not a field, is named
        assert error["param"] == "x_extra"


@pytest.mark.parametrize("depth", [256, 900])
async def test_a_response_format_schema_nested_too_deep_is_a_400(
    gw: Gateway, http: httpx.AsyncClient, depth: int
) -> None:
    schema = nested(depth, {"type": "string"})
    body = {
        **CHAT,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    }
    assert_400(await post(http, gw.url + "/v1/chat/completions", body), "response_format")


async def test_a_legitimately_deep_json_schema_still_works(gw: Gateway, http: httpx.AsyncClient) -> None:
    schema: dict[str, Any] = {"type": "string"}
    for _ in range(40):
        schema = {"type": "object", "properties": {"inner": schema}, "required": ["inner"]}
    body = {
        **CHAT,
        "response_format": {"type": "json_schema", "json_schema": {"name": "s", "schema": schema}},
    }
    r = await http.post(gw.url + "/v1/chat/completions", json=body)
    assert r.status_code == 200, r.text


# --- lone surrogates --------------------------------------------------------------------------------


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        (
            "/v1/chat/completions",
            {"model": "sim", "messages": [{"role": "user", "content": "a \ud800 b"}]},
            "messages.0.content",
        ),
        (
            "/v1/chat/completions",
            {"model": "sim", "messages": [{"role": "user", "content": [{"type": "text", "text": "\udfff"}]}]},
            "messages.0.content.0.text",
        ),
        ("/v1/completions", {"model": "sim", "prompt": ["fine", "\ud83d"]}, "prompt.1"),
        (
            "/v1/chat/completions",
            {**CHAT, "tools": [{"type": "function", "function": {"name": "f", "description": "\ud800"}}]},
            "tools.0.function.description",
        ),
        ("/v1/jobs", {**CHAT, "x_extra": {"\ud800": 1}}, "x_extra.\\ud800"),
        ("/v1/chat/completions", {**CHAT, "model": "s\ud800m"}, "model"),
        ("/submit", {"prompt": "\ud800"}, "prompt"),
    ],
)
async def test_a_lone_surrogate_is_a_400_naming_the_field(
    gw: Gateway, http: httpx.AsyncClient, path: str, body: dict[str, Any], param: str
) -> None:
    r = await post(http, gw.url + path, body)
    assert_400(r, param)
    assert "surrogate" in r.json()["error"]["message"]
    # Nothing was queued: the gateway is still idle, and still answers.
    assert (await http.post(gw.url + "/v1/chat/completions", json=CHAT)).status_code == 200


async def test_a_surrogate_pair_is_text(gw: Gateway, http: httpx.AsyncClient) -> None:
    body = {"model": "sim", "messages": [{"role": "user", "content": "\U0001f600"}], "max_tokens": 2}
    r = await post(http, gw.url + "/v1/chat/completions", body)  # sent as "\ud83d\ude00"
    assert r.status_code == 200, r.text


# --- headers and ids --------------------------------------------------------------------------------


async def test_a_retry_count_of_5000_digits_is_a_first_try(gw: Gateway, http: httpx.AsyncClient) -> None:
    r = await http.post(
        gw.url + "/v1/chat/completions", json=CHAT, headers={"x-stainless-retry-count": "9" * 5000}
    )
    assert r.status_code == 200, r.text
    metrics = (await http.get(gw.url + "/metrics")).text
    assert 'sluice_client_retries_total{outcome="admitted"}' not in metrics


@pytest.mark.parametrize("raw", [str(2**64), str(2**63), str(MAX_EVENT_ID + 1), "9" * 5000])
async def test_an_event_id_past_the_largest_is_a_400(
    either: Gateway, http: httpx.AsyncClient, raw: str
) -> None:
    job_id = (await http.post(either.url + "/v1/jobs", json=CHAT)).json()["id"]
    done = await http.get(f"{either.url}/v1/jobs/{job_id}", params={"wait": 10})
    assert done.json()["status"] == "succeeded"
    r = await http.get(f"{either.url}/v1/jobs/{job_id}/events", headers={"Last-Event-ID": raw})
    assert_400(r, "Last-Event-ID")
    r = await http.get(f"{either.url}/v1/jobs/{job_id}/events", params={"after": raw})
    assert_400(r, "after")
    # The largest id is still an id: nothing comes after it, and the stream ends cleanly.
    r = await http.get(f"{either.url}/v1/jobs/{job_id}/events", headers={"Last-Event-ID": str(MAX_EVENT_ID)})
    assert r.status_code == 200, r.text
    r = await http.get(f"{either.url}/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "1"})
    assert r.status_code == 200 and "event: done" in r.text


@pytest.mark.parametrize("after", ["%C2%B2", str(2**64), "-1", "x"])
async def test_a_websocket_after_that_is_no_event_id_is_refused_in_words(
    either: Gateway, http: httpx.AsyncClient, after: str
) -> None:
    """Refused at the handshake with a 400 (or, where the server cannot answer a handshake so, a
    close frame with a reason): never accepted and then dropped."""
    job_id = (await http.post(either.url + "/v1/jobs", json=CHAT)).json()["id"]
    url = either.url.replace("http://", "ws://") + f"/v1/jobs/{job_id}/ws?after={after}"
    try:
        async with websockets.connect(url, open_timeout=10) as ws:
            with pytest.raises(ConnectionClosed) as closed:
                await ws.recv()
        assert closed.value.rcvd is not None and closed.value.rcvd.reason, "closed without a reason"
    except InvalidStatus as refused:
        assert refused.response.status_code == 400
        assert json.loads(refused.response.body or b"{}")["error"]["param"] == "after"
