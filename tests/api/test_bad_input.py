"""Every bad input gets OpenAI's error shape and the right status: never a 500, never a hang."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.helpers import wait_until
from tests.servers import Gateway, run_gateway

MSG = [{"role": "user", "content": "hi"}]
BODY_PATHS = ["/v1/chat/completions", "/v1/completions", "/v1/jobs", "/submit"]


@pytest.fixture
async def gw(sim_url: str) -> AsyncIterator[Gateway]:
    async with run_gateway([sim_url], max_tokens_cap=100, max_body_bytes=4096, max_n=2) as g:
        yield g


def assert_error(r: httpx.Response, status: int, code: str | None = None, param: str | None = None) -> None:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) >= {"message", "type", "code"} and err["message"]
    if code is not None:
        assert err["code"] == code
    if param is not None:
        assert err["param"] == param


@pytest.mark.parametrize(
    ("path", "body", "param"),
    [
        ("/v1/chat/completions", {"model": "sim"}, "messages"),
        ("/v1/chat/completions", {"model": "sim", "messages": []}, "messages"),
        ("/v1/chat/completions", {"model": "sim", "messages": "hello"}, "messages"),
        ("/v1/chat/completions", {"model": "sim", "messages": [{"content": "x"}]}, "messages.0.role"),
        ("/v1/chat/completions", {"model": 5, "messages": MSG}, "model"),
        ("/v1/chat/completions", {"model": "sim", "messages": MSG, "max_tokens": "ten"}, "max_tokens"),
        ("/v1/chat/completions", {"model": "sim", "messages": MSG, "stream": "yes"}, "stream"),
        ("/v1/chat/completions", {"model": "sim", "messages": MSG, "timeout": -1}, "timeout"),
        ("/v1/completions", {"model": "sim"}, "prompt"),
        (
            "/v1/chat/completions",
            {"model": "sim", "messages": [{"role": "user", "content": 5}]},
            "messages.0.content",
        ),
        ("/v1/completions", {"model": "sim", "prompt": {"a": 1}}, "prompt"),
        ("/v1/jobs", {"model": "sim", "prompt": ["a", 1]}, "prompt"),
        ("/v1/jobs", {"model": "sim", "messages": MSG, "n": 0}, "n"),
        ("/submit", {}, "prompt"),
        ("/submit", {"prompt": ""}, "prompt"),
        # The article's route passes its extra fields on to the options unvalidated (the fuzzer's find).
        ("/submit", {"prompt": "0", "n": []}, "n"),
        ("/submit", {"prompt": "0", "n": 0}, "n"),
        ("/submit", {"prompt": "0", "stream": "yes"}, "stream"),
        ("/submit", {"prompt": "0", "max_completion_tokens": "ten"}, "max_completion_tokens"),
        ("/submit", {"prompt": "0", "n": {"a": [1]}}, "n"),
    ],
)
async def test_invalid_bodies_are_400(
    gw: Gateway, http: httpx.AsyncClient, path: str, body: dict[str, Any], param: str | None
) -> None:
    r = await http.post(gw.url + path, json=body)
    assert_error(r, 400, param=param)
    err = r.json()["error"]
    assert err["type"] == "invalid_request_error"
    # The validator's names for a union's branches are nothing the client sent.
    assert not any(name in err["message"] for name in (".str", "list[", "function-after", "'None'"))


async def test_a_missing_field_says_so(gw: Gateway, http: httpx.AsyncClient) -> None:
    r = await http.post(gw.url + "/v1/chat/completions", json={"model": "sim"})
    assert_error(r, 400, "missing_required_parameter", param="messages")
    assert r.json()["error"]["message"] == "Missing required parameter: 'messages'."


async def test_both_branches_of_a_union_are_named(gw: Gateway, http: httpx.AsyncClient) -> None:
    body = {"model": "sim", "messages": [{"role": "user", "content": 5}]}
    r = await http.post(gw.url + "/v1/chat/completions", json=body)
    assert r.json()["error"]["message"] == (
        "Invalid value for 'messages.0.content': Input should be a valid string or a valid list."
    )


@pytest.mark.parametrize("path", BODY_PATHS)
@pytest.mark.parametrize(
    ("content_type", "said"),
    [
        ("application/x-www-form-urlencoded", "what curl -d sends"),  # curl -d without -H
        (None, "is missing"),
        ("text/plain", "'text/plain'"),
    ],
)
async def test_a_body_not_sent_as_json_names_the_header(
    gw: Gateway, http: httpx.AsyncClient, path: str, content_type: str | None, said: str
) -> None:
    body = b'{"model": "sim", "messages": [{"role": "user", "content": "hi"}], "prompt": "hi"}'
    headers = {"content-type": content_type} if content_type else {}
    r = await http.post(gw.url + path, content=body, headers=headers)
    assert_error(r, 400, "invalid_content_type", param="Content-Type")
    message = r.json()["error"]["message"]
    assert message.startswith(
        "The body must be JSON: send the header 'Content-Type: application/json' "
        "(curl: -H 'Content-Type: application/json')."
    )
    assert said in message


@pytest.mark.parametrize("path", BODY_PATHS)
@pytest.mark.parametrize(
    ("raw", "what"), [(b"[1, 2]", "an array"), (b'"hi"', "a string"), (b"7", "a number"), (b"null", "null")]
)
async def test_a_json_body_that_is_not_an_object(
    gw: Gateway, http: httpx.AsyncClient, path: str, raw: bytes, what: str
) -> None:
    r = await http.post(gw.url + path, content=raw, headers={"content-type": "application/json"})
    assert_error(r, 400, "invalid_json")
    assert r.json()["error"]["message"] == (
        f'The request body must be a JSON object, {{"name": value, ...}}; this one is {what}.'
    )


@pytest.mark.parametrize("path", BODY_PATHS)
async def test_an_empty_body(gw: Gateway, http: httpx.AsyncClient, path: str) -> None:
    r = await http.post(gw.url + path, content=b"", headers={"content-type": "application/json"})
    assert_error(r, 400, "invalid_json")
    assert r.json()["error"]["message"] == "The request body is empty; it must be a JSON object."


@pytest.mark.parametrize("path", BODY_PATHS)
async def test_malformed_json(gw: Gateway, http: httpx.AsyncClient, path: str) -> None:
    r = await http.post(
        gw.url + path, content=b'{"model": "sim", "messages": [', headers={"content-type": "application/json"}
    )
    assert_error(r, 400, "invalid_json")
    assert (
        r.json()["error"]["message"] == "The request body is not valid JSON: Expecting value at character 30."
    )
    r = await http.post(
        gw.url + path, content=b'{"prompt": "\xff"}', headers={"content-type": "application/json"}
    )
    assert_error(r, 400, "invalid_json")
    assert r.json()["error"]["message"] == "The request body is not valid JSON: it is not UTF-8 text."


@pytest.mark.parametrize(("value", "name"), [(0, "max_tokens"), (-5, "max_tokens"), (101, "max_tokens")])
async def test_max_tokens_bounds(gw: Gateway, http: httpx.AsyncClient, value: int, name: str) -> None:
    r = await http.post(gw.url + "/v1/chat/completions", json={"model": "sim", "messages": MSG, name: value})
    assert_error(r, 400, "invalid_value", param=name)


async def test_max_completion_tokens_bound(gw: Gateway, http: httpx.AsyncClient) -> None:
    r = await http.post(
        gw.url + "/v1/chat/completions", json={"model": "sim", "messages": MSG, "max_completion_tokens": 500}
    )
    assert_error(r, 400, "invalid_value", param="max_completion_tokens")


async def test_n_above_cap(gw: Gateway, http: httpx.AsyncClient) -> None:
    r = await http.post(gw.url + "/v1/chat/completions", json={"model": "sim", "messages": MSG, "n": 3})
    assert_error(r, 400, param="n")


async def test_body_too_large(gw: Gateway, http: httpx.AsyncClient) -> None:
    big = {"model": "sim", "messages": [{"role": "user", "content": "x" * 10_000}]}
    assert_error(await http.post(gw.url + "/v1/chat/completions", json=big), 413, "request_too_large")

    async def chunks() -> AsyncIterator[bytes]:  # no Content-Length: counted as it streams in
        for _ in range(10):
            yield b" " * 1000

    r = await http.post(gw.url + "/v1/jobs", content=chunks(), headers={"content-type": "application/json"})
    assert_error(r, 413, "request_too_large")


async def test_unknown_model(gw: Gateway, http: httpx.AsyncClient) -> None:
    r = await http.post(gw.url + "/v1/chat/completions", json={"model": "gpt-9", "messages": MSG})
    assert_error(r, 404, "model_not_found", param="model")
    assert r.json()["error"]["message"] == "The model 'gpt-9' does not exist (models served: sim)."


async def test_model_may_be_left_out_when_one_is_served(gw: Gateway, http: httpx.AsyncClient) -> None:
    r = await http.post(gw.url + "/v1/chat/completions", json={"messages": MSG, "max_tokens": 2})
    assert r.status_code == 200, r.text
    assert r.json()["model"] == "sim"


async def test_model_is_required_when_several_are_served(sim_url: str, http: httpx.AsyncClient) -> None:
    async with (
        serve_in_background(preset("fast", model="other")) as other,
        run_gateway([sim_url, other]) as g,
    ):
        await wait_until(lambda: _serves_two(g))
        r = await http.post(g.url + "/v1/chat/completions", json={"messages": MSG})
        assert_error(r, 400, "missing_required_parameter", param="model")
        assert (
            r.json()["error"]["message"] == "Missing required parameter: 'model' (models served: other, sim)."
        )


async def _serves_two(g: Gateway) -> bool:
    return len(await g.app.state.gateway.served_models()) == 2


async def test_unknown_job(gw: Gateway, http: httpx.AsyncClient) -> None:
    for method, path in [
        ("GET", "/v1/jobs/job_nope"),
        ("GET", "/v1/jobs/job_nope/events"),
        ("DELETE", "/v1/jobs/job_nope"),
        ("GET", "/result/job_nope"),
    ]:
        assert_error(await http.request(method, gw.url + path), 404, "job_not_found")


async def test_cancel_finished_job(gw: Gateway, http: httpx.AsyncClient) -> None:
    job_id = (
        await http.post(gw.url + "/v1/jobs", json={"model": "sim", "messages": MSG, "max_tokens": 2})
    ).json()["id"]
    assert (await http.get(f"{gw.url}/v1/jobs/{job_id}", params={"wait": 10})).json()["status"] == "succeeded"
    assert_error(await http.delete(f"{gw.url}/v1/jobs/{job_id}"), 409, "job_finished")


async def test_bad_options(gw: Gateway, http: httpx.AsyncClient) -> None:
    body = {"model": "sim", "messages": MSG}
    assert_error(
        await http.post(gw.url + "/v1/jobs", json={**body, "priority": "vip"}),
        400,
        "invalid_value",
        param="priority",
    )
    assert_error(
        await http.post(gw.url + "/v1/jobs", json=body, headers={"X-Priority": "vip"}),
        400,
        "invalid_value",
        param="priority",
    )
    assert_error(
        await http.post(gw.url + "/v1/jobs", json=body, headers={"X-Request-Timeout": "soon"}),
        400,
        param="X-Request-Timeout",
    )
    assert_error(await http.post(gw.url + "/v1/jobs", json={**body, "prompt": "x"}), 400, "invalid_value")
    job_id = (await http.post(gw.url + "/v1/jobs", json={**body, "max_tokens": 2})).json()["id"]
    r = await http.get(f"{gw.url}/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "abc"})
    assert_error(r, 400, "invalid_value", param="Last-Event-ID")
    r = await http.get(f"{gw.url}/v1/jobs/{job_id}/events", params={"after": "abc"})
    assert_error(r, 400, "invalid_value", param="after")


@pytest.mark.parametrize(
    ("wait", "reason"),
    [("-1", "Input should be greater than or equal to 0"), ("soon", "Input should be a valid number")],
)
async def test_query_parameters_are_named_as_sent(
    gw: Gateway, http: httpx.AsyncClient, wait: str, reason: str
) -> None:
    r = await http.get(f"{gw.url}/v1/jobs/job_x", params={"wait": wait})
    assert_error(r, 400, "invalid_value", param="wait")
    assert r.json()["error"]["message"].startswith(f"Invalid value for 'wait': {reason}")


async def test_unknown_route(gw: Gateway, http: httpx.AsyncClient) -> None:
    r = await http.get(gw.url + "/v2/nothing")
    assert_error(r, 404, "not_found")
    assert r.json()["error"]["message"] == "Invalid URL (GET /v2/nothing)."


@pytest.mark.parametrize(
    ("method", "path", "allow"),
    [
        ("GET", "/v1/chat/completions", "POST"),
        ("PUT", "/v1/jobs/job_x", "GET, DELETE"),  # two routes share the path: both are listed
        ("POST", "/v1/models", "GET"),
    ],
)
async def test_a_wrong_method_lists_the_allowed_ones(
    gw: Gateway, http: httpx.AsyncClient, method: str, path: str, allow: str
) -> None:
    r = await http.request(method, gw.url + path)
    assert_error(r, 405, "method_not_allowed")
    assert r.headers["allow"] == allow
    assert r.json()["error"]["type"] == "invalid_request_error"
    assert (
        r.json()["error"]["message"]
        == f"{method} is not allowed on {path}; use {allow.replace(', ', ' or ')}."
    )


@pytest.mark.parametrize("value", [b"abc", b"-1", b"\xb2", b"1.5", b""])
async def test_malformed_retry_count_is_a_first_try(
    gw: Gateway, http: httpx.AsyncClient, value: bytes
) -> None:
    """x-stainless-retry-count is the client's own bookkeeping: a value that is not a count never
    fails the request (b'\\xb2' is the superscript two, a digit to str.isdigit() but not to int())."""
    body = {"model": "sim", "messages": MSG, "max_tokens": 2}
    r = await http.post(
        gw.url + "/v1/chat/completions", json=body, headers=[(b"x-stainless-retry-count", value)]
    )
    assert r.status_code == 200, r.text
    metrics = (await http.get(gw.url + "/metrics")).text
    assert 'sluice_client_retries_total{outcome="admitted"}' not in metrics
