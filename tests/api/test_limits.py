"""Per-key limits through the API: 429 with Retry-After and OpenAI's x-ratelimit-* headers."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest

from sluice.api.auth import hash_key
from tests.servers import Gateway, run_gateway

MSG = [{"role": "user", "content": "hi"}]


@pytest.fixture
async def gw(sim_url: str) -> AsyncIterator[Gateway]:
    keys = [
        {"key_sha256": hash_key("sk-rpm"), "tenant": "rpm", "rpm": 3},
        {"key_sha256": hash_key("sk-tpm"), "tenant": "tpm", "tpm": 200},
    ]
    async with run_gateway([sim_url], keys=keys) as g:
        yield g


async def test_requests_per_minute(gw: Gateway, http: httpx.AsyncClient) -> None:
    headers = {"Authorization": "Bearer sk-rpm"}
    body = {"model": "sim", "messages": MSG, "max_tokens": 2}
    remaining = []
    for _ in range(3):
        r = await http.post(gw.url + "/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 200
        assert r.headers["x-ratelimit-limit-requests"] == "3"
        remaining.append(int(r.headers["x-ratelimit-remaining-requests"]))
    assert remaining == [2, 1, 0]
    refused = await http.post(gw.url + "/v1/jobs", json=body, headers=headers)
    assert refused.status_code == 429 and refused.json()["error"]["code"] == "rate_limit_exceeded"
    assert refused.json()["error"]["type"] == "rate_limit_error"
    assert 15 <= int(refused.headers["retry-after"]) <= 25  # one request every 20 s
    assert refused.headers["x-ratelimit-remaining-requests"] == "0"
    assert refused.headers["x-ratelimit-reset-requests"].endswith("s")


async def test_tokens_per_minute(gw: Gateway, http: httpx.AsyncClient) -> None:
    headers = {"Authorization": "Bearer sk-tpm"}
    r = await http.post(
        gw.url + "/v1/jobs", json={"model": "sim", "messages": MSG, "max_tokens": 150}, headers=headers
    )
    assert r.status_code == 202 and int(r.headers["x-ratelimit-remaining-tokens"]) < 50
    again = await http.post(
        gw.url + "/v1/jobs", json={"model": "sim", "messages": MSG, "max_tokens": 150}, headers=headers
    )
    assert again.status_code == 429 and "tokens" in again.json()["error"]["message"]
    assert again.headers["x-ratelimit-limit-tokens"] == "200"
    never = await http.post(
        gw.url + "/v1/jobs", json={"model": "sim", "messages": MSG, "max_tokens": 400}, headers=headers
    )
    assert never.status_code == 429 and never.headers["x-should-retry"] == "false"
