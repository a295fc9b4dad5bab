"""API keys stored in the broker by an administrator: created, used, listed, deleted."""

from __future__ import annotations

import httpx

from sluice.api.auth import STORED_KEY_CACHE_S, hash_key
from tests.servers import run_gateway

MSG = [{"role": "user", "content": "hi"}]
ADMIN = {"Authorization": "Bearer sk-root"}


async def test_stored_keys_lifecycle(sim_url: str, http: httpx.AsyncClient) -> None:
    keys = [{"key_sha256": hash_key("sk-root"), "tenant": "ops", "admin": True}]
    async with run_gateway([sim_url], keys=keys, key_store=True) as gw:
        r = await http.post(gw.url + "/admin/keys", json={"tenant": "acme", "rpm": 2}, headers=ADMIN)
        assert r.status_code == 201
        created = r.json()
        assert created["key"].startswith("sk-sluice-") and created["key_sha256"] == hash_key(created["key"])
        stored = await gw.broker.get_key(created["key_sha256"])
        assert stored is not None and created["key"] not in str(stored)  # only the hash is kept
        user = {"Authorization": f"Bearer {created['key']}"}
        body = {"model": "sim", "messages": MSG, "max_tokens": 2}
        ok = await http.post(gw.url + "/v1/jobs", json=body, headers=user)
        assert ok.status_code == 202 and (await gw.broker.get(ok.json()["id"])).tenant == "acme"
        assert ok.headers["x-ratelimit-limit-requests"] == "2"  # the stored limits apply
        listed = (await http.get(gw.url + "/admin/keys", headers=ADMIN)).json()["data"]
        assert [k["tenant"] for k in listed] == ["acme"]
        assert (
            await http.post(gw.url + "/admin/keys", json={"tenant": "x"}, headers=user)
        ).status_code == 404
        bad = await http.post(
            gw.url + "/admin/keys", json={"tenant": "x", "max_priority": "vip"}, headers=ADMIN
        )
        assert bad.status_code == 400
        gone = await http.delete(f"{gw.url}/admin/keys/{created['key_sha256']}", headers=ADMIN)
        assert gone.status_code == 200
        assert (
            await http.delete(f"{gw.url}/admin/keys/{created['key_sha256']}", headers=ADMIN)
        ).status_code == 404
        gw.app.state.keyring._stored.clear()  # what STORED_KEY_CACHE_S seconds would do
        assert STORED_KEY_CACHE_S <= 10
        denied = await http.post(gw.url + "/v1/jobs", json=body, headers=user)
        assert denied.status_code == 401 and denied.json()["error"]["code"] == "invalid_api_key"


async def test_key_store_off_by_default(sim_url: str, http: httpx.AsyncClient) -> None:
    keys = [{"key_sha256": hash_key("sk-root"), "tenant": "ops", "admin": True}]
    async with run_gateway([sim_url], keys=keys) as gw:
        r = await http.post(gw.url + "/admin/keys", json={"tenant": "acme"}, headers=ADMIN)
        assert r.status_code == 400 and r.json()["error"]["code"] == "unsupported"
