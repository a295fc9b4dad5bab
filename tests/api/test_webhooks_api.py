"""Webhooks end to end: a job with callback_url ends, a real receiver gets the signed result."""

from __future__ import annotations

import asyncio
import json
from collections.abc import AsyncIterator
from typing import Any

import httpx
import pytest
from fastapi import FastAPI, Request, Response

from sluice.api.auth import hash_key
from sluice.webhooks import verify
from tests.helpers import wait_until
from tests.servers import Gateway, run_app, run_gateway

MSG = [{"role": "user", "content": "hi"}]
SECRET = "whsec-test"


@pytest.fixture
async def receiver() -> AsyncIterator[tuple[str, asyncio.Queue[tuple[dict[str, str], bytes]]]]:
    got: asyncio.Queue[tuple[dict[str, str], bytes]] = asyncio.Queue()
    app = FastAPI()

    @app.post("/hook")
    async def hook(request: Request) -> Response:
        await got.put((dict(request.headers), await request.body()))
        return Response(status_code=204)

    async with run_app(app) as url:
        yield url + "/hook", got


def keys() -> list[dict[str, Any]]:
    return [{"key_sha256": hash_key("sk-a"), "tenant": "a", "webhook_secret": SECRET}]


async def test_signed_delivery_and_log(
    sim_url: str, http: httpx.AsyncClient, receiver: tuple[str, asyncio.Queue[tuple[dict[str, str], bytes]]]
) -> None:
    hook_url, got = receiver
    async with run_gateway([sim_url], keys=keys(), webhooks_allow_private=True) as gw:
        headers = {"Authorization": "Bearer sk-a"}
        body = {"model": "sim", "messages": MSG, "max_tokens": 3, "callback_url": hook_url}
        job_id = (await http.post(gw.url + "/v1/jobs", json=body, headers=headers)).json()["id"]
        received_headers, raw = await asyncio.wait_for(got.get(), 10)
        assert verify(SECRET, received_headers["sluice-signature"], raw)
        assert not verify(SECRET, received_headers["sluice-signature"], raw + b" ")
        payload = json.loads(raw)
        assert payload["type"] == "job.succeeded" and payload["data"]["id"] == job_id
        assert payload["data"]["result"]["usage"]["completion_tokens"] == 3

        async def logged() -> bool:
            view = (await http.get(f"{gw.url}/v1/jobs/{job_id}", headers=headers)).json()
            return bool(view["deliveries"]) and view["deliveries"][-1]["status"] == 204

        await wait_until(logged)


async def test_cancelled_job_is_announced_too(
    sim_url: str, http: httpx.AsyncClient, receiver: tuple[str, asyncio.Queue[tuple[dict[str, str], bytes]]]
) -> None:
    hook_url, got = receiver
    async with run_gateway([sim_url], keys=keys(), webhooks_allow_private=True, max_concurrency=1) as gw:
        headers = {"Authorization": "Bearer sk-a"}
        long = {"model": "sim", "messages": MSG, "max_tokens": 4000}
        await http.post(gw.url + "/v1/jobs", json=long, headers=headers)
        job_id = (
            await http.post(gw.url + "/v1/jobs", json={**long, "callback_url": hook_url}, headers=headers)
        ).json()["id"]
        assert (await http.delete(f"{gw.url}/v1/jobs/{job_id}", headers=headers)).status_code == 200
        received_headers, raw = await asyncio.wait_for(got.get(), 10)
        assert received_headers["sluice-event"] == "job.cancelled"
        assert json.loads(raw)["data"]["status"] == "cancelled"


@pytest.mark.parametrize("where", ["config", "key store"])
async def test_each_job_is_signed_with_the_secret_of_the_key_that_sent_it(
    sim_url: str,
    http: httpx.AsyncClient,
    receiver: tuple[str, asyncio.Queue[tuple[dict[str, str], bytes]]],
    where: str,
) -> None:
    """Two keys of one tenant with different secrets: each job's webhook verifies with its own key's
    secret and not with the other's (the tenant's last key used to sign them all)."""
    hook_url, got = receiver
    admin = {"key_sha256": hash_key("sk-admin"), "tenant": "ops", "admin": True}
    secrets = {"one": "whsec-one", "two": "whsec-two"}
    if where == "config":
        configured = [
            {"key_sha256": hash_key(f"sk-{name}"), "tenant": "a", "webhook_secret": secret}
            for name, secret in secrets.items()
        ]
        options: dict[str, Any] = {"keys": [admin, *configured]}
    else:
        options = {"keys": [admin], "key_store": True}
    async with run_gateway([sim_url], webhooks_allow_private=True, **options) as gw:
        tokens = {name: f"sk-{name}" for name in secrets}
        if where == "key store":
            for name, secret in secrets.items():
                made = await http.post(
                    gw.url + "/admin/keys",
                    json={"tenant": "a", "webhook_secret": secret},
                    headers={"Authorization": "Bearer sk-admin"},
                )
                assert made.status_code == 201, made.text
                tokens[name] = made.json()["key"]
        sent: dict[str, str] = {}
        for name, token in tokens.items():
            body = {"model": "sim", "messages": MSG, "max_tokens": 2, "callback_url": hook_url}
            r = await http.post(gw.url + "/v1/jobs", json=body, headers={"Authorization": f"Bearer {token}"})
            assert r.status_code == 202, r.text
            sent[r.json()["id"]] = name
        for _ in sent:
            headers, raw = await asyncio.wait_for(got.get(), 10)
            name = sent[json.loads(raw)["data"]["id"]]
            other = next(n for n in secrets if n != name)
            assert verify(secrets[name], headers["sluice-signature"], raw)
            assert not verify(secrets[other], headers["sluice-signature"], raw)


@pytest.mark.parametrize(
    "url",
    [
        "http://localhost:9/hook",  # a DNS name that resolves to loopback
        "http://127.0.0.1:9/hook",
        "http://[::1]:9/hook",
        "http://10.1.2.3/hook",
        "http://169.254.169.254/latest/meta-data",
        "http://2130706433/hook",  # 127.0.0.1 written as a number
        "ftp://example.com/hook",
        "http://user:pw@example.com/hook",
    ],
)
async def test_ssrf_targets_refused(sim_url: str, http: httpx.AsyncClient, url: str) -> None:
    async with run_gateway([sim_url]) as gw:
        r = await http.post(
            gw.url + "/v1/jobs", json={"model": "sim", "messages": MSG, "max_tokens": 2, "callback_url": url}
        )
        assert r.status_code == 400, r.text
        assert (
            r.json()["error"]["code"] == "invalid_callback_url"
            and r.json()["error"]["param"] == "callback_url"
        )
        if "localhost" in url:  # no DNS oracle: a name's addresses are never named
            assert "127.0.0.1" not in r.text and "::1" not in r.text
        assert (await gw.broker.stats())["sim"].queued_jobs == 0


async def test_webhook_secret_unset_sends_unsigned(
    sim_url: str, http: httpx.AsyncClient, receiver: tuple[str, asyncio.Queue[tuple[dict[str, str], bytes]]]
) -> None:
    hook_url, got = receiver
    gw: Gateway
    async with run_gateway([sim_url], webhooks_allow_private=True) as gw:
        body = {"model": "sim", "messages": MSG, "max_tokens": 2, "callback_url": hook_url}
        assert (await http.post(gw.url + "/v1/jobs", json=body)).status_code == 202
        received_headers, _ = await asyncio.wait_for(got.get(), 10)
        assert (
            "sluice-signature" not in received_headers and received_headers["sluice-event"] == "job.succeeded"
        )
