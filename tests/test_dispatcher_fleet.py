"""A fleet of real ``sluice sim`` processes of different speeds behind a gateway: requests go only
to engines serving their model, an alias's weights split the traffic, DNS membership follows the
records (an injected resolver over loopback addresses, and the system's for ``localhost``)."""

from __future__ import annotations

import contextlib
import random
import re
from collections.abc import AsyncIterator, Sequence
from typing import Any

import httpx

from sluice.broker.base import BrokerSettings
from sluice.broker.memory import MemoryBroker
from sluice.core.job import JobState
from sluice.dispatcher import Dispatcher
from sluice.fleet import Fleet, PoolSpec
from sluice.runtime import pool_backend
from tests.failures.procs import Proc, answers, wait_answering
from tests.helpers import free_port, make_job, wait_until
from tests.servers import Gateway, run_gateway

MSG = [{"role": "user", "content": "hi"}]


class Sim:
    """A ``sluice sim`` process on loopback."""

    def __init__(self, proc: Proc, url: str) -> None:
        self.proc = proc
        self.url = url

    @property
    def port(self) -> int:
        return int(self.url.rsplit(":", 1)[1])

    async def finished(self) -> int:
        """Requests it finished (vllm:request_success, every finish reason)."""
        async with httpx.AsyncClient() as c:
            text = (await c.get(self.url + "/metrics", timeout=5)).text
        return int(sum(float(v) for v in re.findall(r"^vllm:request_success_total\{.*\} (\S+)$", text, re.M)))


async def start_sim(model: str, *args: str, host: str = "127.0.0.1", port: int | None = None) -> Sim:
    """``sluice sim --preset fast`` serving ``model``, with more flags (``--base-step-ms`` for a
    slower engine); up once it lists its models."""
    port = port or free_port()
    proc = Proc(["sim", "--preset", "fast", "--model", model, "--host", host, "--port", str(port), *args])
    url = f"http://{host}:{port}"
    await wait_answering(proc, lambda: answers(url + "/v1/models"))
    return Sim(proc, url)


@contextlib.asynccontextmanager
async def sims(*specs: tuple[str, Sequence[str]]) -> AsyncIterator[list[Sim]]:
    """Several simulators, each ``(model, extra flags)``, stopped at the end."""
    started: list[Sim] = []
    try:
        for model, args in specs:
            started.append(await start_sim(model, *args))
        yield started
    finally:
        for sim in started:
            sim.proc.stop()


async def submit(http: httpx.AsyncClient, gw: Gateway, model: str, n: int, **body: Any) -> list[str]:
    """``n`` jobs for ``model`` (POST /v1/jobs); their ids. (Gateways that take many at once use
    ``queue_policy = "fifo"``: admission is not what is tested.)"""
    ids = []
    for _ in range(n):
        r = await http.post(
            gw.url + "/v1/jobs", json={"model": model, "messages": MSG, "max_tokens": 8, **body}
        )
        assert r.status_code in (200, 201, 202), r.text
        ids.append(r.json()["id"])
    return ids


async def outcomes(http: httpx.AsyncClient, gw: Gateway, ids: list[str]) -> dict[str, str]:
    """Each job's engine, once every one has succeeded."""
    out = {}
    for job_id in ids:
        view = (await http.get(f"{gw.url}/v1/jobs/{job_id}", params={"wait": 30})).json()
        assert view["status"] == "succeeded", view
        job = await gw.broker.get(job_id)
        out[job_id] = job.backend
    return out


async def test_requests_go_only_to_the_engines_serving_their_model(http: httpx.AsyncClient) -> None:
    async with sims(("small", ()), ("big", ()), ("big", ("--base-step-ms", "2"))) as (small, big, slow_big):
        pools = [
            {"name": "small", "engines": [small.url], "max_concurrency": 4, "adaptive": False},
            {"name": "big", "engines": [big.url, slow_big.url], "max_concurrency": 4},
        ]
        aliases = [{"name": "chat", "targets": [{"model": "big"}]}]
        async with run_gateway(
            [], pools=pools, aliases=aliases, queue_policy="fifo", fifo_max_queued=1000
        ) as gw:
            listed = (await http.get(gw.url + "/v1/models")).json()
            assert {m["id"] for m in listed["data"]} == {"small", "big", "chat"}
            for_small = await submit(http, gw, "small", 12)
            for_big = await submit(http, gw, "big", 12) + await submit(http, gw, "chat", 12)
            small_ran = set((await outcomes(http, gw, for_small)).values())
            big_ran = set((await outcomes(http, gw, for_big)).values())
            assert small_ran == {f"small/127.0.0.1:{small.port}"}
            assert big_ran <= {f"big/127.0.0.1:{big.port}", f"big/127.0.0.1:{slow_big.port}"}
            # Counted at the engines: each request ran once, on an engine of its model.
            assert await small.finished() == 12
            assert await big.finished() + await slow_big.finished() == 24
            rows = {row["name"]: row for row in gw.app.state.backends.backends()}
            assert rows[f"small/127.0.0.1:{small.port}"]["limit"] == 4
            assert rows[f"big/127.0.0.1:{big.port}"]["adaptive"] is True

            # The learned limits are fed: each answer's timing, and the load the engine reports.
            def limiter(name: str) -> dict[str, Any]:
                rows = {row["name"]: row for row in gw.app.state.backends.backends()}
                return dict(rows[name]["limiter"])

            fed = [f"big/127.0.0.1:{e.port}" for e in (big, slow_big)]
            assert any(limiter(name)["seconds_per_token"] is not None for name in fed)
            await wait_until(lambda: all(limiter(n)["engine_running"] is not None for n in fed), timeout=20)


async def test_an_alias_splits_traffic_by_its_weights(http: httpx.AsyncClient) -> None:
    async with sims(("llama-v1", ()), ("llama-v2", ())) as (stable, canary):
        pools = [
            {"name": "stable", "engines": [stable.url], "max_concurrency": 8, "adaptive": False},
            {"name": "canary", "engines": [canary.url], "max_concurrency": 8, "adaptive": False},
        ]
        aliases = [
            {
                "name": "llama",
                "targets": [{"model": "llama-v1", "weight": 3}, {"model": "llama-v2", "weight": 1}],
            }
        ]
        async with run_gateway(
            [], pools=pools, aliases=aliases, queue_policy="fifo", fifo_max_queued=1000
        ) as gw:
            gw.app.state.backends.fleet.rng = random.Random(11)
            ids = await submit(http, gw, "llama", 160)
            ran = list((await outcomes(http, gw, ids)).values())
            on_canary = sum(1 for name in ran if name.startswith("canary/"))
            # A quarter of 160 is 40; the binomial's standard deviation is about 5.5.
            assert 24 <= on_canary <= 56, on_canary
            assert await canary.finished() == on_canary
            assert await stable.finished() == 160 - on_canary


class Zone:
    """DNS records the test edits: name -> addresses."""

    def __init__(self, **records: list[str]) -> None:
        self.records = dict(records)

    async def __call__(self, host: str, port: int) -> list[str]:
        if host not in self.records:
            raise OSError(f"no such name {host}")
        return list(self.records[host])


async def run_jobs(broker: MemoryBroker, n: int) -> list[str]:
    """``n`` jobs for model ``m`` to the end; the engine each ran on."""
    jobs = [make_job(model="m", max_tokens=4) for _ in range(n)]
    for job in jobs:
        await broker.admit(job)
    out = []
    for job in jobs:
        done = await broker.wait(job.id, 20)
        assert done is not None and done.state is JobState.SUCCEEDED, done
        out.append(str(done.backend))
    return out


async def served(broker: MemoryBroker, model: str, slots: int) -> bool:
    """Whether the broker's registry says ``model`` is served with ``slots`` in all."""
    return (await broker.served_models()).get(model) == slots


async def test_dns_members_join_and_leave_as_the_records_change() -> None:
    # Two engines on one port at two loopback addresses: what a headless Service's pods look like.
    port = free_port()
    first = await start_sim("m", host="127.0.0.1", port=port)
    second = await start_sim("m", host="127.0.0.2", port=port)
    zone = Zone(engines=["127.0.0.1"])
    fleet = Fleet(
        [PoolSpec("pool", addresses=(f"dns://engines:{port}",), max_concurrency=4, adaptive=False)],
        factory=pool_backend,
        resolver=zone,
    )
    broker = MemoryBroker(BrokerSettings())
    await broker.start()
    dispatcher = Dispatcher(broker, fleet=fleet, dns_refresh_s=0.1, load_poll_s=0.05)
    await dispatcher.start()
    one, two = f"pool/127.0.0.1:{port}", f"pool/127.0.0.2:{port}"
    try:
        assert set(await run_jobs(broker, 8)) == {one}
        zone.records["engines"] = ["127.0.0.1", "127.0.0.2"]
        await wait_until(lambda: {e.name for e in fleet.engines} == {one, two})
        await wait_until(lambda: all(e.backend.models for e in fleet.engines))
        # Both limits registered: the dispatcher publishes them on its next pass, not at once.
        await wait_until(lambda: served(broker, "m", 8))
        zone.records["engines"] = ["127.0.0.2"]
        await wait_until(lambda: {e.name for e in fleet.engines} == {two})
        assert set(await run_jobs(broker, 8)) == {two}
        await wait_until(lambda: served(broker, "m", 4))
    finally:
        await dispatcher.stop()
        await broker.close()
        for engine in fleet.engines:
            await engine.backend.aclose()
        first.proc.stop()
        second.proc.stop()


async def test_a_dns_pool_resolves_localhost(http: httpx.AsyncClient) -> None:
    async with sims(
        ("m", ()),
    ) as (sim,):
        pools = [{"name": "local", "engines": [f"dns://localhost:{sim.port}"], "max_concurrency": 4}]
        async with run_gateway([], pools=pools) as gw:
            ids = await submit(http, gw, "m", 6)
            ran = set((await outcomes(http, gw, ids)).values())
            # localhost's IPv4 record is the engine (an IPv6 one, where there is one, fails and is
            # ejected: the jobs go on the other).
            assert f"local/127.0.0.1:{sim.port}" in ran
            assert await sim.finished() == 6


async def test_an_engine_that_joins_is_asked_for_its_models() -> None:
    sim = await start_sim("late")
    zone = Zone()
    fleet = Fleet([PoolSpec("p", addresses=(f"dns://late:{sim.port}",))], factory=pool_backend, resolver=zone)
    broker = MemoryBroker(BrokerSettings())
    await broker.start()
    dispatcher = Dispatcher(broker, fleet=fleet, dns_refresh_s=0.1, load_poll_s=0.05)
    await dispatcher.start()
    try:
        assert await broker.served_models() == {}
        zone.records["late"] = ["127.0.0.1"]
        await wait_until(lambda: broker.served_models())
        assert set(await broker.served_models()) == {"late"}
        job = make_job(model="late", max_tokens=4)
        await broker.admit(job)
        done = await broker.wait(job.id, 20)
        assert done is not None and done.state is JobState.SUCCEEDED
    finally:
        await dispatcher.stop()
        await broker.close()
        for engine in fleet.engines:
            await engine.backend.aclose()
        sim.proc.stop()
