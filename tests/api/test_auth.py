"""API keys, tenant isolation, priority ceilings, and the limits on what a client controls."""

from __future__ import annotations

from collections.abc import AsyncIterator

import httpx
import pytest
from starlette.requests import Request

from sluice.api.auth import hash_key
from sluice.config import ConfigError, load_settings
from sluice.core.job import new_job_id
from sluice.roles.http import check_exposure
from tests.servers import Gateway, run_gateway

MSG = [{"role": "user", "content": "hi"}]
ALICE, BOB, LOWLY, ADMIN = "sk-alice", "sk-bob", "sk-lowly", "sk-admin"


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


@pytest.fixture
async def gw(sim_url: str) -> AsyncIterator[Gateway]:
    keys = [
        {"key_sha256": hash_key(ALICE), "tenant": "alice", "max_connections": 1},
        {"key_sha256": hash_key(BOB), "tenant": "bob"},
        {"key_sha256": hash_key(LOWLY), "tenant": "lowly", "max_priority": "low"},
        {"key_sha256": hash_key(ADMIN), "tenant": "ops", "admin": True},
    ]
    async with run_gateway([sim_url], keys=keys, max_messages=3, max_prompt_tokens=100) as g:
        yield g


async def test_missing_and_wrong_keys_are_401(gw: Gateway, http: httpx.AsyncClient) -> None:
    body = {"model": "sim", "messages": MSG, "max_tokens": 2}
    for headers, code in [
        ({}, "missing_api_key"),
        (auth("sk-nope"), "invalid_api_key"),
        ({"Authorization": "Basic x"}, "missing_api_key"),
    ]:
        r = await http.post(gw.url + "/v1/chat/completions", json=body, headers=headers)
        assert r.status_code == 401 and r.json()["error"]["code"] == code
    assert (await http.get(gw.url + "/v1/models")).status_code == 401
    assert (await http.post(gw.url + "/v1/chat/completions", json=body, headers=auth(BOB))).status_code == 200
    assert (await http.get(gw.url + "/healthz")).status_code == 200  # probes need no key


async def test_jobs_are_private_to_their_tenant(gw: Gateway, http: httpx.AsyncClient) -> None:
    r = await http.post(
        gw.url + "/v1/jobs", json={"model": "sim", "messages": MSG, "max_tokens": 2}, headers=auth(BOB)
    )
    job_id = r.json()["id"]
    for method, path in [
        ("GET", f"/v1/jobs/{job_id}"),
        ("GET", f"/v1/jobs/{job_id}/events"),
        ("DELETE", f"/v1/jobs/{job_id}"),
        ("GET", f"/result/{job_id}"),
    ]:
        other = await http.request(method, gw.url + path, headers=auth(ALICE))
        unknown = await http.request(method, gw.url + path.replace(job_id, new_job_id()), headers=auth(ALICE))
        # Another tenant's job looks exactly like one that does not exist.
        assert other.status_code == unknown.status_code == 404
        assert other.json()["error"]["code"] == unknown.json()["error"]["code"] == "job_not_found"
    mine = await http.get(f"{gw.url}/v1/jobs/{job_id}", params={"wait": 10}, headers=auth(BOB))
    assert mine.status_code == 200 and mine.json()["status"] == "succeeded"


def test_job_ids_are_unguessable() -> None:
    ids = {new_job_id() for _ in range(10_000)}
    assert len(ids) == 10_000
    assert all(len(i) >= 4 + 22 for i in ids)  # "job_" + 128 random bits in base64url


async def test_priority_ceiling(gw: Gateway, http: httpx.AsyncClient) -> None:
    body = {"model": "sim", "messages": MSG, "max_tokens": 2}
    r = await http.post(gw.url + "/v1/jobs", json={**body, "priority": "high"}, headers=auth(LOWLY))
    assert r.status_code == 403 and r.json()["error"]["code"] == "priority_not_allowed"
    r = await http.post(gw.url + "/v1/jobs", json=body, headers=auth(LOWLY))
    assert r.status_code == 202
    job = await gw.broker.get(r.json()["id"])
    assert job.priority == "low" and job.tenant == "lowly"
    r = await http.post(gw.url + "/v1/jobs", json={**body, "priority": "high"}, headers=auth(BOB))
    assert r.status_code == 202


async def test_client_controlled_limits(gw: Gateway, http: httpx.AsyncClient) -> None:
    many = [{"role": "user", "content": "x"}] * 4
    r = await http.post(
        gw.url + "/v1/chat/completions", json={"model": "sim", "messages": many}, headers=auth(BOB)
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "messages"
    long_prompt = [{"role": "user", "content": "x" * 2000}]
    r = await http.post(
        gw.url + "/v1/chat/completions", json={"model": "sim", "messages": long_prompt}, headers=auth(BOB)
    )
    assert r.status_code == 400 and r.json()["error"]["code"] == "context_length_exceeded"
    r = await http.post(
        gw.url + "/v1/completions", json={"model": "sim", "prompt": "y" * 2000}, headers=auth(BOB)
    )
    assert r.status_code == 400 and r.json()["error"]["param"] == "prompt"


async def test_open_connections_per_key(gw: Gateway, http: httpx.AsyncClient) -> None:
    # Alice may hold one connection at a time; the test holds it the way a long poll would.
    body = {"model": "sim", "messages": MSG, "max_tokens": 2}
    job_id = (await http.post(gw.url + "/v1/jobs", json=body, headers=auth(ALICE))).json()["id"]
    await gw.broker.wait(job_id, 10)
    gateway = gw.app.state.gateway
    scope = {"type": "http", "headers": [(b"authorization", f"Bearer {ALICE}".encode())]}
    alice = await gw.app.state.keyring.authenticate(Request(scope))
    async with gateway.connection(alice):
        r = await http.get(f"{gw.url}/v1/jobs/{job_id}/events", headers=auth(ALICE))
        assert r.status_code == 429 and r.json()["error"]["code"] == "too_many_connections"
        assert int(r.headers["retry-after"]) >= 1
        r = await http.post(gw.url + "/v1/chat/completions", json=body, headers=auth(ALICE))
        assert r.status_code == 429
        assert (
            await http.post(gw.url + "/v1/chat/completions", json=body, headers=auth(BOB))
        ).status_code == 200
    r = await http.get(f"{gw.url}/v1/jobs/{job_id}/events", headers=auth(ALICE))
    assert r.status_code == 200 and "event: done" in r.text
    assert gateway.connections == {}  # every slot was given back


def test_open_mode_only_on_loopback() -> None:
    check_exposure(load_settings(overrides={"host": "127.0.0.1"}, environ={}))
    check_exposure(load_settings(overrides={"host": "::1"}, environ={}))
    with pytest.raises(ConfigError, match="insecure-open"):
        check_exposure(load_settings(overrides={"host": "0.0.0.0"}, environ={}))
    check_exposure(load_settings(overrides={"host": "0.0.0.0", "insecure_open": True}, environ={}))
    keyed = load_settings(
        overrides={"host": "0.0.0.0", "keys": [{"key_sha256": hash_key("k"), "tenant": "t"}]}, environ={}
    )
    check_exposure(keyed)
