"""What answers without a key: /metrics and the API docs are settings (metrics_public, docs_public),
closed by default once keys are configured; open mode (no keys, loopback) serves them to all; and
/openapi.json lists the admin routes to admin keys only."""

from __future__ import annotations

from typing import Any

import httpx
import pytest

from sluice.api.auth import hash_key
from tests.servers import run_gateway

KEYS = [
    {"key_sha256": hash_key("sk-user"), "tenant": "a"},
    {"key_sha256": hash_key("sk-admin"), "tenant": "ops", "admin": True},
]
NOBODY: dict[str, str] = {}
USER = {"Authorization": "Bearer sk-user"}
ADMIN = {"Authorization": "Bearer sk-admin"}
WRONG = {"Authorization": "Bearer sk-wrong"}
DOCS = ("/docs", "/redoc", "/openapi.json")


def admin_paths(schema: dict[str, Any]) -> list[str]:
    return [path for path in schema["paths"] if path.startswith("/admin")]


async def test_with_keys_metrics_need_an_admin_key_and_docs_a_valid_key(
    sim_url: str, http: httpx.AsyncClient
) -> None:
    async with run_gateway([sim_url], keys=KEYS) as gw:
        assert (await http.get(gw.url + "/metrics")).status_code == 401
        assert (await http.get(gw.url + "/metrics", headers=WRONG)).status_code == 401
        assert (await http.get(gw.url + "/metrics", headers=USER)).status_code == 404  # as /admin
        metrics = await http.get(gw.url + "/metrics", headers=ADMIN)
        assert metrics.status_code == 200 and "sluice_" in metrics.text
        for path in DOCS:
            for headers in (NOBODY, WRONG):
                refused = await http.get(gw.url + path, headers=headers)
                assert refused.status_code == 401, path
                assert refused.json()["error"]["code"] in {"missing_api_key", "invalid_api_key"}
            assert (await http.get(gw.url + path, headers=USER)).status_code == 200, path
        user_view = (await http.get(gw.url + "/openapi.json", headers=USER)).json()
        assert admin_paths(user_view) == [] and "/v1/chat/completions" in user_view["paths"]
        assert "KeyGrant" not in user_view.get("components", {}).get("schemas", {})
        admin_view = (await http.get(gw.url + "/openapi.json", headers=ADMIN)).json()
        assert "/admin/queues" in admin_paths(admin_view) and "/v1/chat/completions" in admin_view["paths"]
        # Liveness and readiness stay open: load balancers ask them without a key.
        assert (await http.get(gw.url + "/healthz")).status_code == 200
        assert (await http.get(gw.url + "/readyz")).status_code == 200


async def test_public_settings_open_them_but_never_list_admin_routes_to_others(
    sim_url: str, http: httpx.AsyncClient
) -> None:
    async with run_gateway([sim_url], keys=KEYS, metrics_public=True, docs_public=True) as gw:
        assert (await http.get(gw.url + "/metrics")).status_code == 200
        for path in DOCS:
            assert (await http.get(gw.url + path)).status_code == 200, path
        assert admin_paths((await http.get(gw.url + "/openapi.json")).json()) == []
        assert admin_paths((await http.get(gw.url + "/openapi.json", headers=USER)).json()) == []
        assert admin_paths((await http.get(gw.url + "/openapi.json", headers=ADMIN)).json())


@pytest.mark.parametrize("headers", [NOBODY, USER])
async def test_open_mode_serves_metrics_and_docs_without_admin_routes(
    sim_url: str, http: httpx.AsyncClient, headers: dict[str, str]
) -> None:
    async with run_gateway([sim_url]) as gw:
        assert (await http.get(gw.url + "/metrics", headers=headers)).status_code == 200
        for path in DOCS:
            assert (await http.get(gw.url + path, headers=headers)).status_code == 200, path
        # Every admin route answers 404 in open mode: the description does not list them.
        assert admin_paths((await http.get(gw.url + "/openapi.json", headers=headers)).json()) == []
