"""The dashboard over HTTP: who may open it (admin key, dashboard key, session cookie, open mode),
what its snapshot and feed say under load, refusals and a dead engine, the whole fleet on Redis,
the fleet's gauges on /metrics, and the Prometheus and Grafana files in deploy/."""

from __future__ import annotations

import asyncio
import contextlib
import json
import math
import re
import shutil
import subprocess
from collections.abc import AsyncIterator, Iterator
from pathlib import Path
from typing import Any

import httpx
import pytest
from fastapi import FastAPI

from sluice import runtime
from sluice.api.auth import hash_key
from sluice.api.dashboard import COOKIE, SESSION_S, DashboardAccess, _json
from sluice.config import Settings, load_settings
from sluice.dashboard import History, engine_state, histogram_quantile
from sluice.metrics import Metrics
from sluice.runtime import build_app
from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.broker.brokers import empty_redis
from tests.helpers import free_port, wait_until
from tests.redis_server import RedisServer
from tests.servers import run_app

ROOT = Path(__file__).resolve().parents[2]
MSG = [{"role": "user", "content": "hi"}]
ADMIN, USER, DASH = "sk-admin", "sk-user", "sk-dashboard-only"
KEYS = [
    {"key_sha256": hash_key(ADMIN), "tenant": "ops", "admin": True},
    {"key_sha256": hash_key(USER), "tenant": "user"},
]


def bearer(key: str) -> dict[str, str]:
    return {"Authorization": f"Bearer {key}"}


def settings_for(backends: list[dict[str, Any]], **overrides: Any) -> Settings:
    return load_settings(overrides={"backends": backends, "log_level": "warning", **overrides}, environ={})


@contextlib.asynccontextmanager
async def gateway(backends: list[dict[str, Any]], **overrides: Any) -> AsyncIterator[tuple[str, FastAPI]]:
    """``sluice serve`` on loopback for these backends (dicts, as in the config)."""
    app = build_app(settings_for(backends, **overrides), dispatch=bool(backends))
    async with run_app(app) as url:
        if backends:
            await wait_until(app.state.gateway.broker.served_models)
        await ticked(app)
        yield url, app


async def ticked(app: FastAPI) -> None:
    """Wait for the dashboard's first tick: what was counted before it is its baseline."""
    await wait_until(lambda: app.state.dashboard.seq >= 1)


async def snapshot(
    http: httpx.AsyncClient, url: str, headers: dict[str, str] | None = None
) -> dict[str, Any]:
    r = await http.get(url + "/dashboard/snapshot", headers=headers or {})
    assert r.status_code == 200, r.text
    body: dict[str, Any] = r.json()
    return body


async def chat(http: httpx.AsyncClient, url: str, max_tokens: int = 4, **headers: str) -> httpx.Response:
    return await http.post(
        url + "/v1/chat/completions",
        json={"model": "sim", "messages": MSG, "max_tokens": max_tokens},
        headers=headers,
    )


# --- who may look -----------------------------------------------------------------------------


async def test_a_pool_shows_its_engines_learned_limits_and_health(
    sim_url: str, http: httpx.AsyncClient
) -> None:
    pool = {"name": "gpu", "engines": [sim_url], "max_concurrency": 6}
    app = build_app(settings_for([], pools=[pool]), dispatch=True)
    async with run_app(app) as url:
        await wait_until(app.state.gateway.broker.served_models)
        await ticked(app)
        assert (await chat(http, url)).status_code == 200
        snap = await snapshot(http, url)
        (engine,) = snap["engines"]
        assert engine["pool"] == "gpu" and engine["limit_source"] == "learned"
        assert engine["ceiling"] == 6 and 1 <= engine["limit"] <= 6 and engine["health"] == "healthy"
        (model,) = snap["models"]
        (view,) = model["pools"]
        assert view["name"] == "gpu" and view["engines"] == 1 and view["learned"] == 1
        assert view["limit"] == engine["limit"] and view["out"] == 0

        async def signalled() -> bool:
            return (await snapshot(http, url))["models"][0]["desired_engines"] is not None

        # The scaling signal (sluice_desired_engines) reaches the page, as the gauge says it; with
        # nothing queued, no class is at risk.
        await wait_until(signalled, timeout=20)
        snap = await snapshot(http, url)
        metrics = (await http.get(url + "/metrics")).text
        wanted = snap["models"][0]["desired_engines"]
        assert f'sluice_desired_engines{{model="sim"}} {float(wanted)}' in metrics
        assert snap["models"][0]["deadlines_at_risk"] == []
        assert snap["scaling"]["desired_engines"] == snap["models"][0]["desired_engines"]


async def test_open_mode_serves_the_page_its_assets_and_a_snapshot(
    sim_url: str, http: httpx.AsyncClient
) -> None:
    async with gateway([{"url": sim_url}]) as (url, _):
        page = await http.get(url + "/dashboard")
        assert page.status_code == 200 and "text/html" in page.headers["content-type"]
        assert '<script src="/dashboard/assets/dashboard.js"' in page.text
        csp = page.headers["content-security-policy"]
        assert "script-src 'self'" in csp and "frame-ancestors 'none'" in csp
        assert (
            page.headers["referrer-policy"] == "no-referrer" and page.headers["cache-control"] == "no-store"
        )
        # No CDN: everything the page loads is served from here.
        assert not re.search(r"(src|href)=\"(https?:)?//", page.text)
        js = await http.get(url + "/dashboard/assets/dashboard.js")
        assert js.status_code == 200 and js.headers["content-type"].startswith("text/javascript")
        assert (await http.get(url + "/dashboard/assets/dashboard.css")).status_code == 200
        assert (await http.get(url + "/dashboard/assets/icon.svg")).status_code == 200
        for name in ("dashboard.html", "..%2Fdashboard.py", "nothing.js"):
            assert (await http.get(url + "/dashboard/assets/" + name)).status_code == 404
        snap = await snapshot(http, url)
        assert snap["v"] == 1 and [m["name"] for m in snap["models"]] == ["sim"]
        (engine,) = snap["engines"]
        assert engine["name"] == sim_url and engine["limit"] == 8 and engine["limit_source"] == "configured"
        # a [[backends]] entry is a pool of one, named after it
        assert engine["state"] == "ok" and engine["pool"] == sim_url and engine["health"] == "healthy"
        assert snap["models"][0]["pools"] == [
            {"name": sim_url, "engines": 1, "inflight": 0, "limit": 8, "learned": 0, "out": 0}
        ]
        assert {p["role"] for p in snap["processes"]} == {"gateway", "worker"}


async def test_keys_cookie_and_redirect(sim_url: str, http: httpx.AsyncClient) -> None:
    async with gateway([{"url": sim_url}], keys=KEYS, dashboard_key_sha256=hash_key(DASH)) as (url, _):
        for path in ("/dashboard", "/dashboard/assets/dashboard.js", "/dashboard/assets/dashboard.css"):
            denied = await http.get(url + path)
            assert denied.status_code == 401 and "/dashboard?key=" in denied.text
        assert (await http.get(url + "/dashboard/assets/icon.svg")).status_code == 200  # the 401 page's
        for path in ("/dashboard/snapshot", "/dashboard/feed"):
            assert (await http.get(url + path)).status_code == 401
            assert (await http.get(url + path, headers=bearer(USER))).status_code == 401
        assert (await http.get(url + "/dashboard?key=" + USER)).status_code == 401
        assert (await http.get(url + "/dashboard?key=")).status_code == 401
        # Bearer keys work for scripts: an admin key, or the dashboard key.
        for key in (ADMIN, DASH):
            assert (await http.get(url + "/dashboard/snapshot", headers=bearer(key))).status_code == 200
        # The dashboard key opens the dashboard only, not the API nor /admin.
        assert (await chat(http, url, **bearer(DASH))).status_code == 401
        assert (await http.get(url + "/admin/queues", headers=bearer(DASH))).status_code == 401

        for key in (DASH, ADMIN):
            async with httpx.AsyncClient(base_url=url, timeout=30) as browser:
                login = await browser.get("/dashboard", params={"key": key})
                assert login.status_code == 303 and login.headers["location"] == "/dashboard"
                cookie = login.headers["set-cookie"]
                assert cookie.startswith(COOKIE + "=")
                attributes = {a.strip().split("=")[0].lower() for a in cookie.split(";")[1:]}
                assert {"httponly", "max-age", "path", "samesite"} <= attributes
                assert "samesite=strict" in cookie.lower() and "path=/dashboard" in cookie.lower()
                assert key not in cookie
                page = await browser.get("/dashboard")  # the cookie, no key in the address
                assert page.status_code == 200 and "dashboard.js" in page.text
                assert (await browser.get("/dashboard/snapshot")).status_code == 200
                # The cookie is for /dashboard only: the API does not take it.
                assert (await browser.get("/v1/models")).status_code == 401
        # A forged or altered cookie opens nothing.
        value = login.cookies[COOKIE]
        expires, digest, signature = value.split(".")
        for forged in (
            f"{int(expires) + 10**6}.{digest}.{signature}",
            f"{expires}.{hash_key(USER)}.{signature}",
            f"{expires}.{digest}.{'0' * 64}",
            "garbage",
        ):
            async with httpx.AsyncClient(base_url=url, cookies={COOKIE: forged}) as forger:
                assert (await forger.get("/dashboard/snapshot")).status_code == 401


async def test_sessions_expire_and_end_with_their_key() -> None:
    settings = settings_for([], keys=KEYS, key_store=True, dashboard_session_secret="s" * 32)
    broker = runtime.build_broker(settings)
    from sluice.api.auth import KeyRing
    from sluice.api.gateway import Gateway

    keyring = KeyRing(settings, broker)
    access = DashboardAccess(Gateway(settings, broker, Metrics()), keyring)
    stored = hash_key("sk-stored-admin")
    await broker.put_key(stored, {"tenant": "ops2", "admin": True})
    cookie = access.session(stored, now=1000.0)
    assert await access.session_allows(cookie, now=1000.0 + SESSION_S - 1)
    assert not await access.session_allows(cookie, now=1000.0 + SESSION_S + 1)
    # The same secret on another gateway: the cookie works there too.
    other = DashboardAccess(Gateway(settings, broker, Metrics()), KeyRing(settings, broker))
    assert await other.session_allows(cookie, now=1001.0)
    await broker.delete_key(stored)
    fresh = DashboardAccess(Gateway(settings, broker, Metrics()), KeyRing(settings, broker))
    assert not await fresh.session_allows(cookie, now=1001.0)  # the key is gone, so is the session
    # Without a shared secret, each process signs with its own.
    lone = settings_for([], keys=KEYS)
    a = DashboardAccess(Gateway(lone, broker, Metrics()), KeyRing(lone, broker))
    b = DashboardAccess(Gateway(lone, broker, Metrics()), KeyRing(lone, broker))
    assert not await b.session_allows(a.session(hash_key(ADMIN), now=1000.0), now=1001.0)


# --- the feed ---------------------------------------------------------------------------------


async def read_events(response: httpx.Response, count: int) -> list[tuple[str, str, dict[str, Any]]]:
    """The first ``count`` events of an SSE response: (event, id, data)."""
    events: list[tuple[str, str, dict[str, Any]]] = []
    event, event_id, data = "", "", ""
    async for line in response.aiter_lines():
        if line.startswith("event:"):
            event = line[6:].strip()
        elif line.startswith("id:"):
            event_id = line[3:].strip()
        elif line.startswith("data:"):
            data += line[5:].strip()
        elif not line and data:
            events.append((event, event_id, json.loads(data)))
            event, event_id, data = "", "", ""
            if len(events) == count:
                break
    return events


async def test_feed_sends_history_then_a_snapshot_a_second(sim_url: str, http: httpx.AsyncClient) -> None:
    async with gateway([{"url": sim_url}]) as (url, _):
        async with asyncio.timeout(15):
            async with http.stream("GET", url + "/dashboard/feed") as r:
                assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
                events = await read_events(r, 4)
        assert events[0][0] == "history" and isinstance(events[0][2]["points"], list)
        assert [e[0] for e in events[1:]] == ["snapshot"] * 3
        ids = [int(e[1]) for e in events[1:]]
        assert ids == sorted(ids) and len(set(ids)) == 3
        ats = [e[2]["at"] for e in events[1:]]
        assert 0.5 < (ats[-1] - ats[0]) / 2 < 2.0  # about once a second
        assert all(e[2]["point"]["t"] == e[2]["at"] for e in events[1:])


# --- what it shows ----------------------------------------------------------------------------


async def test_load_refusals_and_retry_after_show(http: httpx.AsyncClient) -> None:
    slow = preset("article", model="sim", max_num_seqs=1)
    async with (
        serve_in_background(slow) as sim,
        gateway([{"url": sim, "max_concurrency": 1}], max_queued_jobs=2, queue_policy="cap") as (url, _),
    ):
        answers = await asyncio.gather(*(chat(http, url, max_tokens=8) for _ in range(12)))
        codes = [a.status_code for a in answers]
        assert 429 in codes and 200 in codes

        async def shown() -> bool:
            s = await snapshot(http, url)
            return bool(
                s["window"]["refused_by_code"].get("queue_full")
                and s["window"]["jobs_by_status"].get("succeeded")
                and s["latency"]["ttft"]["count"]
            )

        await wait_until(shown, timeout=10)
        s = await snapshot(http, url)
        refused = codes.count(429)
        assert s["window"]["refused_by_code"]["queue_full"] == refused
        assert s["window"]["admitted"] == codes.count(200)
        assert s["window"]["jobs_by_status"]["succeeded"] == codes.count(200)
        assert s["retry_after"]["count"] == refused and s["retry_after"]["by_code"] == {"queue_full": refused}
        assert 0.5 <= s["retry_after"]["p50"] <= s["retry_after"]["p99"] <= 120  # interpolated in buckets
        assert sum(b["count"] for b in s["retry_after"]["buckets"]) == refused
        (model,) = s["models"]
        assert model["max_queued_jobs"] == 2 and [c["name"] for c in model["classes"]] == [
            "high",
            "normal",
            "low",
            "batch",  # the Batch API's, below every class
        ]
        assert model["drain_rate"] > 0 and [p["name"] for p in model["pools"]] == [sim]
        points = (await http.get(url + "/dashboard/snapshot")).json()["point"]
        assert set(points) >= {"queued", "admitted", "refused", "refused_by_code", "goodput", "ttft_p99"}
        # The Retry-After histogram is on /metrics as well.
        metrics = (await http.get(url + "/metrics")).text
        assert f'sluice_retry_after_seconds_count{{code="queue_full"}} {float(refused)}' in metrics


async def test_queue_by_class_tenant_and_predicted_wait(http: httpx.AsyncClient) -> None:
    keys = [{"key_sha256": hash_key(f"sk-{t}"), "tenant": t} for t in ("alice", "bob")] + KEYS
    stalled = preset("article", model="sim", max_num_seqs=1)
    async with (
        serve_in_background(stalled) as sim,
        gateway([{"url": sim, "max_concurrency": 1}], keys=keys) as (url, _),
    ):
        tasks = [
            asyncio.create_task(chat(http, url, 64, **bearer(f"sk-{t}"), **{"X-Priority": p}))
            for t, p in [("alice", "normal")] * 3 + [("bob", "low")] * 2 + [("bob", "high")]
        ]
        try:

            async def queued() -> bool:
                s = await snapshot(http, url, bearer(ADMIN))
                return bool(s["models"] and s["models"][0]["queued_jobs"] == 5)

            await wait_until(queued, timeout=10)
            (m,) = (await snapshot(http, url, bearer(ADMIN)))["models"]
            assert sum(c["jobs"] for c in m["classes"]) == 5
            assert sum(c["tokens"] for c in m["classes"]) == m["queued_tokens"]
            assert m["tenant_count"] == 2 and {t["tenant"] for t in m["tenants"]} == {"alice", "bob"}
            assert sum(t["jobs"] for t in m["tenants"]) == 5
            assert [t["jobs"] for t in m["tenants"]] == sorted(
                (t["jobs"] for t in m["tenants"]), reverse=True
            )
            # queued tokens over the drain rate; a class waits for itself and those above it
            assert m["predicted_wait_s"] == pytest.approx(m["queued_tokens"] / m["drain_rate"])
            waits = [c["predicted_wait_s"] for c in m["classes"]]
            assert waits == sorted(waits) and waits[-1] == pytest.approx(m["predicted_wait_s"])
            # one engine of one slot, one running and five queued: six engines' worth of work
            assert m["engines"] == 1 and m["engines_busy"] == pytest.approx(6.0)
        finally:
            for task in tasks:
                task.cancel()
            await asyncio.gather(*tasks, return_exceptions=True)


async def test_a_dead_engine_is_shown_ejected(sim_url: str, http: httpx.AsyncClient) -> None:
    dead = f"http://127.0.0.1:{free_port()}"  # nothing listens there
    backends = [{"url": dead, "name": "dead", "models": ["sim"]}, {"url": sim_url, "name": "alive"}]
    async with gateway(backends) as (url, _):

        async def ejected() -> bool:
            await chat(http, url)
            rows = {e["name"]: e for e in (await snapshot(http, url))["engines"]}
            # Ejected, then probing once its ejection ends, then ejected again (for twice as long)
            # when the probe fails: any of these says the engine is out; "ok" never does.
            dead = rows["dead"]
            return dead["failures"] >= 1 and dead["state"] in ("ejected", "probing", "recovering")

        await wait_until(ejected, timeout=15)
        rows = {e["name"]: e for e in (await snapshot(http, url))["engines"]}
        assert rows["alive"]["state"] == "ok" and rows["alive"]["failures"] == 0
        metrics = (await http.get(url + "/metrics")).text
        assert re.search(r'sluice_backend_failures\{backend="dead",worker="[^"]+"\} [1-9]', metrics)
        assert re.search(r'sluice_backend_limit\{backend="alive",worker="[^"]+"\} 8\.0', metrics)
        assert 'sluice_queue_max_jobs{model="sim"} 1000.0' in metrics


# --- the whole fleet on Redis -----------------------------------------------------------------


@pytest.fixture(scope="module")
def redis_server() -> Iterator[RedisServer]:
    with RedisServer() as server:
        yield server


async def test_on_redis_every_gateway_sees_the_whole_fleet(
    redis_server: RedisServer, sim_url: str, http: httpx.AsyncClient
) -> None:
    redis = await empty_redis(redis_server)
    worker_settings = settings_for([{"url": sim_url, "name": "engine-a"}], broker=redis)
    gateway_settings = settings_for([], broker=redis)
    apps = [build_app(gateway_settings), build_app(gateway_settings)]
    async with (
        runtime.running_worker(worker_settings) as worker,
        run_app(apps[0]) as one,
        run_app(apps[1]) as two,
    ):
        for app in apps:
            await ticked(app)
        for _ in range(3):
            assert (await chat(http, one)).status_code == 200
        assert (await chat(http, two)).status_code == 200

        async def whole() -> bool:
            s = await snapshot(http, two)
            roles = sorted(p["role"] for p in s["processes"])
            return (
                roles == ["gateway", "gateway", "worker"]
                and s["window"]["admitted"] == 4
                and s["window"]["jobs_by_status"].get("succeeded") == 4
            )

        await wait_until(whole, timeout=10)
        for url in (one, two):
            s = await snapshot(http, url)
            (engine,) = s["engines"]
            assert engine["name"] == "engine-a" and engine["worker"] == worker.dispatcher.worker_id
            assert [m["name"] for m in s["models"]] == ["sim"]


# --- the snapshot's arithmetic ---------------------------------------------------------------


def report(samples: dict[str, float], started_at: float = 0.0) -> dict[str, Any]:
    return {
        "role": "gateway",
        "started_at": started_at,
        "samples": [
            [name.split("|")[0], dict([name.split("|")[1].split("=")]), v] for name, v in samples.items()
        ],
    }


def test_history_reads_restarts_and_newcomers_right() -> None:
    ok = "sluice_admissions_total|outcome=admitted"
    key = ("sluice_admissions_total", (("outcome", "admitted"),))
    h = History(keep=5)
    assert h.advance(100.0, {"g1": report({ok: 500})}).grew == {}  # the first tick is the baseline
    assert h.advance(101.0, {"g1": report({ok: 510})}).grew == {key: 10}
    # g1 restarted (its counter went down: it counted 3 since), g2 is new (all it counted is new)
    tick = h.advance(102.0, {"g1": report({ok: 3}), "g2": report({ok: 4})})
    assert tick.grew == {key: 7} and tick.span_s == 1.0
    # g2 is silent for a while and comes back: counted from where it was, not from zero
    h.advance(103.0, {"g1": report({ok: 3})})
    assert h.advance(104.0, {"g1": report({ok: 3}), "g2": report({ok: 6})}).grew == {key: 2}
    grew, span = h.window(1.5)
    assert grew == {key: 2} and span == 2.0  # the ticks at 103 and 104
    assert len(h.ticks) == 5
    h.advance(105.0, {})
    assert len(h.ticks) == 5  # bounded


def test_histogram_quantile_as_prometheus() -> None:
    buckets = [(0.1, 10.0), (1.0, 30.0), (10.0, 40.0), (math.inf, 40.0)]
    assert histogram_quantile(0.25, buckets) == pytest.approx(0.1)
    assert histogram_quantile(0.5, buckets) == pytest.approx(0.1 + 0.9 * (20 - 10) / 20)
    assert histogram_quantile(0.125, buckets) == pytest.approx(0.05)  # from 0 in the first bucket
    assert histogram_quantile(0.125, buckets, floor=0.08) == pytest.approx(0.09)
    assert histogram_quantile(0.99, [(1.0, 1.0), (math.inf, 5.0)]) == 1.0  # +Inf: the last bound
    assert histogram_quantile(0.5, [(1.0, 0.0), (math.inf, 0.0)]) is None


def test_a_snapshot_is_always_json() -> None:
    assert json.loads(_json({"a": [1.0, math.nan, {"b": math.inf}], "c": None})) == {
        "a": [1.0, None, {"b": None}],
        "c": None,
    }


def test_engine_states() -> None:
    assert engine_state({"failures": 0, "cooldown_s": 0}, age_s=0.1) == "ok"
    assert engine_state({"failures": 2, "cooldown_s": 1.5}, age_s=0.1) == "ejected"
    assert engine_state({"failures": 2, "cooldown_s": 0}, age_s=0.1) == "recovering"
    assert engine_state({"failures": 0, "cooldown_s": 0, "draining": True}, age_s=0.1) == "draining"
    assert engine_state({"failures": 0, "cooldown_s": 0}, age_s=60.0) == "stale"


# --- deploy/: Prometheus rules and the Grafana dashboard --------------------------------------


def exported_names(metrics: Metrics) -> set[str]:
    """Every series name a gateway's /metrics can serve, with the suffixes of each type."""
    suffixes = {"counter": ("_total",), "histogram": ("_bucket", "_count", "_sum"), "gauge": ("",)}
    names = set()
    for family in metrics.registry.collect():
        for suffix in suffixes.get(family.type, ("",)):
            names.add(family.name + suffix)
    return names


def used_names(text: str) -> set[str]:
    return set(re.findall(r"\bsluice_[a-z_]+\b", text))


async def test_deploy_files_use_only_metrics_sluice_exports(sim_url: str, http: httpx.AsyncClient) -> None:
    async with gateway([{"url": sim_url}]) as (url, app):
        await chat(http, url)
        await app.state.dashboard.tick()  # the fleet gauges come from the latest tick
        exported = exported_names(app.state.gateway.metrics)
    assert {"sluice_backend_up", "sluice_queue_max_jobs", "sluice_retry_after_seconds_bucket"} <= exported
    lines = (ROOT / "deploy/prometheus/alerts.yml").read_text().splitlines()
    rules = "\n".join(line for line in lines if not line.lstrip().startswith("#"))
    grafana = json.loads((ROOT / "deploy/grafana/sluice-dashboard.json").read_text())
    exprs = [t["expr"] for p in grafana["panels"] for t in p["targets"]]
    assert used_names(rules) and used_names(" ".join(exprs))
    assert used_names(rules) - exported == set()
    assert used_names(" ".join(exprs)) - exported == set()
    alerts = set(re.findall(r"alert: (\w+)", rules))
    assert alerts >= {
        "SluiceDeadlinesAtRisk",
        "SluiceRefusalRateHigh",
        "SluiceEngineDown",
        "SluiceQueueNearBound",
    }
    assert grafana["uid"] and all(p["datasource"]["uid"] == "${datasource}" for p in grafana["panels"])


@pytest.mark.skipif(
    shutil.which("promtool") is None, reason="promtool (Debian's prometheus) is not installed"
)
def test_promtool_checks_and_tests_the_rules() -> None:
    folder = ROOT / "deploy/prometheus"
    for args in (["check", "rules", "alerts.yml"], ["test", "rules", "alerts_test.yml"]):
        done = subprocess.run(["promtool", *args], cwd=folder, capture_output=True, text=True, timeout=60)
        assert done.returncode == 0, done.stdout + done.stderr
