"""The peers' routing (sluice.bench.peer_router) in front of real simulators on loopback: the picks of
each strategy, the fixed cap and the queue behind it, a client's give-up reaching the engine, a dead
engine retried around, and bad input answered in OpenAI's error shape."""

from __future__ import annotations

import asyncio
import contextlib
from collections.abc import AsyncIterator

import httpx
import pytest

from sluice.bench.load import parse_prometheus
from sluice.bench.peer_router import EngineSlot, PeerRouter, Strategy, parse_engine, serve_in_background
from sluice.sim.model import preset
from sluice.sim.server import serve_in_background as serve_sim
from tests.helpers import free_port, wait_until

BODY = {"model": "sim", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 8}


def _slots(*caps: int) -> list[EngineSlot]:
    return [EngineSlot(f"e{i}", f"http://127.0.0.1:{9000 + i}", cap) for i, cap in enumerate(caps)]


def _name(router: PeerRouter, tried: set[str] | None = None) -> str:
    engine = router.pick(tried or set())
    assert engine is not None
    return engine.name


def test_round_robin_takes_the_engines_in_turn() -> None:
    router = PeerRouter(_slots(1, 1, 1), Strategy.ROUND_ROBIN)
    assert [_name(router) for _ in range(6)] == ["e0", "e1", "e2", "e0", "e1", "e2"]


def test_least_busy_takes_the_engine_with_fewest_assigned() -> None:
    router = PeerRouter(_slots(4, 4, 4), Strategy.LEAST_BUSY)
    router.engines[0].assigned, router.engines[1].assigned, router.engines[2].assigned = 3, 1, 2
    assert _name(router) == "e1"
    # It counts requests, not room: a cap of 64 does not draw more than a cap of 4.
    big = PeerRouter(
        [EngineSlot("small", "http://a:1", 4), EngineSlot("big", "http://b:1", 64)], Strategy.LEAST_BUSY
    )
    big.engines[0].assigned, big.engines[1].assigned = 5, 5
    assert {_name(big) for _ in range(4)} == {"small", "big"}


def test_a_retry_goes_to_an_engine_not_tried_and_cooling_engines_are_left_out() -> None:
    now = [100.0]
    router = PeerRouter(_slots(1, 1), Strategy.ROUND_ROBIN, clock=lambda: now[0])
    assert _name(router, {"e0"}) == "e1"
    router.engines[1].cooldown_until = 105.0
    assert _name(router, {"e0"}) == "e0"  # every live engine tried: any live one
    router.engines[0].cooldown_until = 105.0
    assert router.pick(set()) is None
    now[0] = 106.0
    assert router.pick(set()) is not None


def test_an_engine_is_name_url_and_cap() -> None:
    assert parse_engine("s4=http://127.0.0.1:8101:4") == ("s4", "http://127.0.0.1:8101", 4)
    for bad in ("s4", "s4=http://127.0.0.1:8101", "=http://x:1:4", "s4=ftp://x:1:4"):
        with pytest.raises(ValueError, match="NAME=URL:CAP"):
            parse_engine(bad)
    with pytest.raises(ValueError, match="at least 1"):
        EngineSlot("x", "http://x:1", 0)


# -- against real simulators ---------------------------------------------------------------------


@contextlib.asynccontextmanager
async def _router(engines: list[EngineSlot], strategy: Strategy) -> AsyncIterator[tuple[PeerRouter, str]]:
    router = PeerRouter(engines, strategy)
    async with serve_in_background(router) as url:
        yield router, url


async def _metrics(http: httpx.AsyncClient, url: str) -> dict[str, float]:
    return parse_prometheus((await http.get(f"{url}/metrics")).text)


async def test_round_robin_spreads_answers_over_two_engines() -> None:
    fast = preset("fast", model="sim")
    async with (
        serve_sim(fast) as a,
        serve_sim(fast) as b,
        _router([EngineSlot("a", a, 4), EngineSlot("b", b, 4)], Strategy.ROUND_ROBIN) as (router, url),
        httpx.AsyncClient(timeout=10) as http,
    ):
        for _ in range(6):
            response = await http.post(f"{url}/v1/chat/completions", json=BODY)
            assert response.status_code == 200
            assert response.json()["choices"][0]["message"]["content"]
        assert [e.answered for e in router.engines] == [3, 3]
        models = await http.get(f"{url}/v1/models")
        assert models.json()["data"][0]["id"] == "sim"


async def test_the_cap_holds_requests_in_the_proxy_and_a_give_up_reaches_the_engine() -> None:
    # The article's engine: 1,000 tokens take it 16 s, longer than the test waits.
    slow = preset("article", model="sim")
    async with (
        serve_sim(slow) as engine_url,
        _router([EngineSlot("only", engine_url, 1)], Strategy.LEAST_BUSY) as (router, url),
        httpx.AsyncClient(timeout=10) as http,
    ):

        async def stream() -> None:
            body = {**BODY, "stream": True, "max_tokens": 1000}
            async with http.stream("POST", f"{url}/v1/chat/completions", json=body) as response:
                async for _ in response.aiter_lines():
                    pass

        clients = [asyncio.create_task(stream()) for _ in range(3)]

        async def held() -> bool:
            mine = await _metrics(http, url)
            theirs = await _metrics(http, engine_url)
            return (
                mine.get('peer_router_assigned{engine="only"}') == 3
                and mine.get('peer_router_running{engine="only"}') == 1
                and mine.get("peer_router_waiting") == 2
                and theirs.get("vllm:num_requests_running") == 1
            )

        await wait_until(held)
        for task in clients:
            task.cancel()
        await asyncio.gather(*clients, return_exceptions=True)

        async def released() -> bool:
            theirs = await _metrics(http, engine_url)
            return router.engines[0].assigned == 0 and theirs.get("vllm:num_requests_running") == 0

        await wait_until(released)
        assert (await _metrics(http, engine_url))["sim:aborted_requests_total"] >= 1


async def test_a_dead_engine_is_retried_around_and_cooled_down() -> None:
    dead = f"http://127.0.0.1:{free_port()}"
    async with (
        serve_sim(preset("fast", model="sim")) as live,
        _router([EngineSlot("dead", dead, 4), EngineSlot("live", live, 4)], Strategy.ROUND_ROBIN) as (
            router,
            url,
        ),
        httpx.AsyncClient(timeout=10) as http,
    ):
        answers = [await http.post(f"{url}/v1/chat/completions", json=BODY) for _ in range(4)]
        assert [r.status_code for r in answers] == [200] * 4
        dead_slot, live_slot = router.engines
        assert dead_slot.failed == 1  # tried once, then out of picks for the cooldown
        assert dead_slot.cooldown_until > router.clock()
        assert live_slot.answered == 4


async def test_every_engine_dead_is_an_openai_error_not_a_hang() -> None:
    def dead(name: str) -> EngineSlot:
        return EngineSlot(name, f"http://127.0.0.1:{free_port()}", 2)

    async with (
        _router([dead("x"), dead("y")], Strategy.LEAST_BUSY) as (router, url),
        httpx.AsyncClient(timeout=10) as http,
    ):
        first = await http.post(f"{url}/v1/chat/completions", json=BODY)
        # Each tried once and cooling down: the third attempt finds no engine.
        assert first.status_code == 503
        assert first.json()["error"]["code"] == "no_engine"
        assert [e.failed for e in router.engines] == [1, 1]
    # Without a cooldown every attempt is made, then the last failure is told.
    eager = PeerRouter([dead("z")], Strategy.ROUND_ROBIN, cooldown_s=0.0)
    async with serve_in_background(eager) as url, httpx.AsyncClient(timeout=10) as http:
        response = await http.post(f"{url}/v1/chat/completions", json=BODY)
        assert response.status_code == 502
        assert response.json()["error"]["code"] == "upstream_error"
        assert eager.engines[0].failed == 3


async def test_a_body_that_is_not_json_is_a_400() -> None:
    async with (
        _router(_slots(1), Strategy.ROUND_ROBIN) as (_state, url),
        httpx.AsyncClient(timeout=10) as http,
    ):
        response = await http.post(f"{url}/v1/chat/completions", content=b"{not json")
        assert response.status_code == 400
        assert response.json()["error"]["code"] == "invalid_json"
