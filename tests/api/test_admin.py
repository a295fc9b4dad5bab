"""Admin endpoints: queue statistics, draining a backend, dead letters; invisible without an admin key."""

from __future__ import annotations

import httpx

from sluice.api.auth import hash_key
from sluice.core.job import JobState
from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.helpers import make_job, wait_until
from tests.servers import run_gateway

MSG = [{"role": "user", "content": "hi"}]
ADMIN = {"Authorization": "Bearer sk-admin"}
USER = {"Authorization": "Bearer sk-user"}
KEYS = [
    {"key_sha256": hash_key("sk-admin"), "tenant": "ops", "admin": True},
    {"key_sha256": hash_key("sk-user"), "tenant": "user"},
]


async def test_admin_surface_is_hidden_from_others(sim_url: str, http: httpx.AsyncClient) -> None:
    async with run_gateway([sim_url], keys=KEYS) as gw:
        for method, path in [
            ("GET", "/admin/queues"),
            ("GET", "/admin/dead-letters"),
            ("DELETE", "/admin/dead-letters"),
            ("POST", "/admin/backends/x/drain"),
        ]:
            for headers in (USER, {}):
                r = await http.request(method, gw.url + path, headers=headers)
                assert r.status_code in (401, 404) and "error" in r.json()
            assert (await http.request(method, gw.url + path, headers=USER)).status_code == 404


async def test_queues_and_drain(http: httpx.AsyncClient) -> None:
    async with (
        serve_in_background(preset("fast", model="sim")) as a,
        serve_in_background(preset("fast", model="sim")) as b,
        run_gateway([a, b], keys=KEYS) as gw,
    ):
        q = (await http.get(gw.url + "/admin/queues", headers=ADMIN)).json()
        assert q["models"]["sim"]["slots"] == 16 and {x["name"] for x in q["backends"]} == {a, b}
        r = await http.post(f"{gw.url}/admin/backends/{a}/drain", headers=ADMIN)
        assert r.status_code == 200 and r.json() == {"backend": a, "draining": True}
        for _ in range(6):
            r = await http.post(
                gw.url + "/v1/chat/completions",
                json={"model": "sim", "messages": MSG, "max_tokens": 2},
                headers=USER,
            )
            job = await gw.broker.get(r.headers["x-sluice-job-id"])
            assert job.backend == b  # nothing new goes to the drained one
        assert (await http.get(gw.url + "/admin/queues", headers=ADMIN)).json()["draining"] == [a]
        await http.post(f"{gw.url}/admin/backends/{a}/undrain", headers=ADMIN)
        assert (await http.get(gw.url + "/admin/queues", headers=ADMIN)).json()["draining"] == []
        missing = await http.post(gw.url + "/admin/backends/http://nowhere:1/drain", headers=ADMIN)
        assert missing.status_code == 404


async def test_a_pool_drains_by_name(http: httpx.AsyncClient) -> None:
    async with (
        serve_in_background(preset("fast", model="sim")) as a,
        serve_in_background(preset("fast", model="sim")) as b,
        run_gateway(
            [],
            keys=KEYS,
            pools=[
                {"name": "old", "engines": [a], "max_concurrency": 4, "adaptive": False},
                {"name": "new", "engines": [b], "max_concurrency": 4},
            ],
        ) as gw,
    ):
        q = (await http.get(gw.url + "/admin/queues", headers=ADMIN)).json()
        rows = {x["pool"]: x for x in q["backends"]}
        assert rows["old"]["limit"] == 4 and rows["old"]["adaptive"] is False
        assert rows["new"]["adaptive"] is True and rows["new"]["health"]["state"] == "healthy"
        assert "limiter" in rows["new"]
        r = await http.post(f"{gw.url}/admin/backends/old/drain", headers=ADMIN)
        assert r.status_code == 200 and r.json() == {"backend": "old", "draining": True}
        for _ in range(6):
            r = await http.post(
                gw.url + "/v1/chat/completions",
                json={"model": "sim", "messages": MSG, "max_tokens": 2},
                headers=USER,
            )
            job = await gw.broker.get(r.headers["x-sluice-job-id"])
            assert job.backend == rows["new"]["name"]  # nothing new goes to the drained pool
        drained = {
            x["pool"]: x["draining"]
            for x in (await http.get(gw.url + "/admin/queues", headers=ADMIN)).json()["backends"]
        }
        assert drained == {"old": True, "new": False}
        await http.post(f"{gw.url}/admin/backends/old/undrain", headers=ADMIN)
        assert (await http.get(gw.url + "/admin/queues", headers=ADMIN)).json()["draining"] == []


async def test_dead_letters_listed_and_purged(sim_url: str, http: httpx.AsyncClient) -> None:
    async with run_gateway([sim_url], keys=KEYS, lease_s=0.2) as gw:
        # A job whose worker vanishes (it claims, never heartbeats) on its only allowed attempt.
        job = make_job(model="ghost", max_attempts=1)
        await gw.broker.admit(job)
        assert (await gw.broker.claim("vanished", ["ghost"], timeout=1.0)).id == job.id

        async def dead() -> bool:
            got = await gw.broker.get(job.id)
            return bool(got.state is JobState.FAILED)

        await wait_until(dead)
        listed = (await http.get(gw.url + "/admin/dead-letters", headers=ADMIN)).json()["data"]
        assert [d["id"] for d in listed] == [job.id]
        assert listed[0]["job"]["error"]["code"] == "attempts_exhausted"
        assert (await http.delete(f"{gw.url}/admin/dead-letters/{job.id}", headers=ADMIN)).json() == {
            "purged": 1
        }
        assert (await http.delete(f"{gw.url}/admin/dead-letters/{job.id}", headers=ADMIN)).status_code == 404
        assert (await http.get(gw.url + "/admin/dead-letters", headers=ADMIN)).json()["data"] == []
        assert await gw.broker.get(job.id) is None
