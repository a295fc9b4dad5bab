"""Every bad input gets OpenAI's error shape and the right status: never a 500, never a hang."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest

from tests.servers import Gateway, run_gateway

MSG = [{"role": "user", "content": "hi"}]


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
        ("/v1/completions", {"model": "sim", "prompt": {"a": 1}}, None),
        ("/v1/jobs", {"model": "sim", "messages": MSG, "n": 0}, "n"),
        ("/submit", {}, "prompt"),
        ("/submit", {"prompt": ""}, "prompt"),
    ],
)
async def test_invalid_bodies_are_400(
    gw: Gateway, http: httpx.AsyncClient, path: str, body: dict[str, Any], param: str | None
) -> None:
    r = await http.post(gw.url + path, json=body)
    assert_error(r, 400, param=param)
    assert r.json()["error"]["type"] == "invalid_request_error"


@pytest.mark.parametrize("path", ["/v1/chat/completions", "/v1/completions", "/v1/jobs", "/submit"])
async def test_malformed_json(gw: Gateway, http: httpx.AsyncClient, path: str) -> None:
    r = await http.post(
        gw.url + path, content=b'{"model": "sim", "messages": [', headers={"content-type": "application/json"}
    )
    assert_error(r, 400, "invalid_json")


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
        await http.post(gw.url + "/v1/jobs", json={**body, "priority": "vip"}), 400, param="priority"
    )
    assert_error(
        await http.post(gw.url + "/v1/jobs", json=body, headers={"X-Request-Timeout": "soon"}),
        400,
        param="X-Request-Timeout",
    )
    assert_error(await http.post(gw.url + "/v1/jobs", json={**body, "prompt": "x"}), 400, "invalid_value")
    assert_error(await http.get(f"{gw.url}/v1/jobs/job_x", params={"wait": "-1"}), 400)
    job_id = (await http.post(gw.url + "/v1/jobs", json={**body, "max_tokens": 2})).json()["id"]
    r = await http.get(f"{gw.url}/v1/jobs/{job_id}/events", headers={"Last-Event-ID": "abc"})
    assert_error(r, 400, param="Last-Event-ID")


async def test_unknown_route_and_method(gw: Gateway, http: httpx.AsyncClient) -> None:
    assert_error(await http.get(gw.url + "/v2/nothing"), 404)
    assert_error(await http.get(gw.url + "/v1/chat/completions"), 405)


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
