"""Limits that hold, through the API: the attacks of docs/security.md ("Limits"), each a request
pattern that once got around a limit or made one tenant's limit hurt another."""

from __future__ import annotations

import time

import httpx

from sluice.api.auth import hash_key
from sluice.core.job import JobState
from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.helpers import wait_until
from tests.servers import run_gateway

MSG = [{"role": "user", "content": "hi"}]


def auth(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


async def test_alternating_keys_of_one_tenant_get_at_most_their_limits(
    sim_url: str, http: httpx.AsyncClient
) -> None:
    """Two keys of one tenant, 10 and 20 requests a minute, used in turn: at most 30 get in, not
    80 of 80 (each request used to install its key's limits and start the tenant's bucket afresh)."""
    keys = [
        {"key_sha256": hash_key("sk-ten"), "tenant": "acme", "rpm": 10},
        {"key_sha256": hash_key("sk-twenty"), "tenant": "acme", "rpm": 20},
    ]
    async with run_gateway([sim_url], keys=keys) as gw:
        body = {"model": "sim", "messages": MSG, "max_tokens": 1}
        admitted = {"sk-ten": 0, "sk-twenty": 0}
        started = time.monotonic()
        for i in range(80):
            key = ("sk-ten", "sk-twenty")[i % 2]
            r = await http.post(gw.url + "/v1/jobs", json=body, headers=auth(key))
            if r.status_code == 202:
                admitted[key] += 1
            else:
                assert r.status_code == 429 and r.json()["error"]["code"] == "rate_limit_exceeded"
        elapsed = time.monotonic() - started
        # Each key's own allowance, and what its bucket refilled meanwhile (half a request a second
        # for both together).
        assert admitted["sk-ten"] <= 10 + elapsed * 10 / 60
        assert admitted["sk-twenty"] <= 20 + elapsed * 20 / 60
        assert sum(admitted.values()) >= 30  # and each key has all of its own


async def test_a_capped_tenants_backlog_does_not_refuse_other_tenants(http: httpx.AsyncClient) -> None:
    """A tenant held to one job at a time queues many long jobs; another tenant's request is still
    admitted and answered, not refused as 503 deadline_unmeetable while the engine's slots are idle
    (its jobs beyond the cap wait for its own running job, not for the queue)."""
    keys = [
        {"key_sha256": hash_key("sk-capped"), "tenant": "capped", "max_concurrent": 1},
        {"key_sha256": hash_key("sk-other"), "tenant": "other"},
    ]
    slow = preset("fast", model="sim", base_step_s=0.01)  # 10 ms a token: 4000 tokens hold a slot 40 s
    async with serve_in_background(slow) as sim, run_gateway([sim], keys=keys, max_concurrency=16) as gw:
        short = {"model": "sim", "messages": MSG, "max_tokens": 5}
        # One job finished: the drain rate is measured, and the deadline prediction applies.
        warm = await http.post(gw.url + "/v1/chat/completions", json=short, headers=auth("sk-other"))
        assert warm.status_code == 200
        # A deadline past what the capped tenant's own queue will take at the rate admission promises
        # (below the mean, measured here on one short job): its jobs are admitted, not refused as late.
        long = {"model": "sim", "messages": MSG, "max_tokens": 4000, "timeout": 600}
        ids = []
        for _ in range(60):
            r = await http.post(gw.url + "/v1/jobs", json=long, headers=auth("sk-capped"))
            assert r.status_code == 202
            ids.append(r.json()["id"])

        async def one_running() -> bool:
            job = await gw.broker.get(ids[0])
            return bool(job.state is JobState.RUNNING)

        await wait_until(one_running)
        stats = (await gw.broker.stats())["sim"]
        assert stats.running_jobs == 1 and stats.queued_jobs == 59  # 15 of 16 slots idle
        # 59 jobs of 4000 tokens, had they been ahead, are minutes of work: far past 15 s.
        headers = {**auth("sk-other"), "X-Request-Timeout": "15"}
        r = await http.post(gw.url + "/v1/chat/completions", json=short, headers=headers)
        assert r.status_code == 200, r.text
        queued = await http.post(gw.url + "/v1/jobs", json={**short, "timeout": 15}, headers=auth("sk-other"))
        assert queued.status_code == 202 and queued.json()["position"] == 0
