"""The fleet's membership (URLs, DNS names resolved again), aliases and capacity, with a resolver
injected (and once the system's, for ``localhost``)."""

from __future__ import annotations

import random
from collections import Counter
from collections.abc import AsyncIterator
from typing import Any

import pytest

from sluice.backends.base import Backend
from sluice.config import ConfigError, load_settings
from sluice.core.job import Job
from sluice.fleet import TTFT_SMOOTHING, Engine, Fleet, PoolSpec, resolve_system, smoothed_ttft
from sluice.runtime import build_fleet
from tests.helpers import make_job


class StubBackend(Backend):
    """An engine adapter that is never called (membership only)."""

    def __init__(self, name: str, url: str, models: list[str]) -> None:
        super().__init__(name, max_concurrency=8, models=models)
        self.url = url
        self.closed = False

    async def discover_models(self) -> list[str]:
        return list(self.models)

    async def stream(self, job: Job) -> AsyncIterator[dict[str, Any]]:
        raise NotImplementedError
        yield {}

    async def healthy(self) -> bool:
        return True

    async def aclose(self) -> None:
        self.closed = True


def stub(spec: PoolSpec, url: str, name: str) -> Backend:
    return StubBackend(name, url, list(spec.models))


class Records:
    """A DNS zone the test edits: name -> addresses; a name mapped to None fails to resolve."""

    def __init__(self, **zone: list[str] | None) -> None:
        self.zone = dict(zone)
        self.asked: list[tuple[str, int]] = []

    async def __call__(self, host: str, port: int) -> list[str]:
        self.asked.append((host, port))
        found = self.zone.get(host)
        if found is None:
            raise OSError(f"cannot resolve {host}")
        return list(found)


def names(fleet: Fleet, *, leaving: bool | None = None) -> set[str]:
    return {e.name for e in fleet.engines if leaving is None or e.leaving is leaving}


async def test_dns_records_join_and_leave() -> None:
    zone = Records(vllm=["10.0.0.1", "10.0.0.2"])
    pool = PoolSpec("gpu", addresses=("dns://vllm:8000", "http://static:9000"), models=("llama",))
    fleet = Fleet([pool], factory=stub, resolver=zone)
    assert names(fleet) == {"gpu/static:9000"}  # URLs are members from the start, DNS at refresh

    change = await fleet.refresh()
    assert {e.name for e in change.joined} == {"gpu/10.0.0.1:8000", "gpu/10.0.0.2:8000"}
    assert zone.asked == [("vllm", 8000)]
    urls = {e.backend.url for e in fleet.engines if isinstance(e.backend, StubBackend)}
    assert "http://10.0.0.2:8000" in urls and "http://static:9000" in urls

    # A pod goes, another comes: one joins, one leaves (and stays until its work is done).
    zone.zone["vllm"] = ["10.0.0.2", "10.0.0.3"]
    change = await fleet.refresh()
    assert [e.name for e in change.joined] == ["gpu/10.0.0.3:8000"]
    assert [e.name for e in change.leaving] == ["gpu/10.0.0.1:8000"]
    leaving = change.leaving[0]
    leaving.inflight = 1
    assert fleet.departed() == [] and leaving in fleet.engines
    assert "llama" in fleet.capacity() and fleet.capacity()["llama"] == 3 * 4  # 3 members, not leaving
    leaving.inflight = 0
    assert fleet.departed() == [leaving] and leaving not in fleet.engines


async def test_a_failed_lookup_keeps_the_members_and_a_returning_address_stays() -> None:
    zone = Records(vllm=["10.0.0.1", "10.0.0.2"])
    fleet = Fleet([PoolSpec("gpu", addresses=("dns://vllm:8000",))], factory=stub, resolver=zone)
    await fleet.refresh()
    zone.zone["vllm"] = None
    change = await fleet.refresh()
    assert change.joined == [] and change.leaving == [] and len(names(fleet, leaving=False)) == 2

    zone.zone["vllm"] = ["10.0.0.1"]
    assert [e.name for e in (await fleet.refresh()).leaving] == ["gpu/10.0.0.2:8000"]
    zone.zone["vllm"] = ["10.0.0.1", "10.0.0.2"]
    change = await fleet.refresh()
    assert change.joined == [] and names(fleet, leaving=True) == set()  # the same engine, kept


async def test_ipv6_records_are_bracketed() -> None:
    zone = Records(vllm=["fd00::5"])
    fleet = Fleet([PoolSpec("gpu", addresses=("dns://vllm:8000",))], factory=stub, resolver=zone)
    await fleet.refresh()
    (engine,) = fleet.engines
    assert engine.name == "gpu/[fd00::5]:8000"
    assert isinstance(engine.backend, StubBackend) and engine.backend.url == "http://[fd00::5]:8000"


async def test_localhost_resolves_on_loopback() -> None:
    found = await resolve_system("localhost", 8000)
    assert "127.0.0.1" in found or "::1" in found
    fleet = Fleet([PoolSpec("local", addresses=("dns://localhost:8000",))], factory=stub)
    change = await fleet.refresh()
    assert {e.name for e in change.joined} <= {"local/127.0.0.1:8000", "local/[::1]:8000"}
    assert change.joined


def test_alias_weights_split_requests() -> None:
    rng = random.Random(7)
    a = StubBackend("a", "http://a", ["llama-v1"])
    b = StubBackend("b", "http://b", ["llama-v2"])
    fleet = Fleet(
        engines=[
            (a, PoolSpec("a", max_concurrency=4, adaptive=False)),
            (b, PoolSpec("b", max_concurrency=4, adaptive=False)),
        ],
        aliases={"llama": [("llama-v1", 9.0), ("llama-v2", 1.0)]},
        rng=rng,
    )
    drawn = Counter(fleet.choose("llama") for _ in range(2000))
    # 10 % canary: binomial(2000, 0.1) has a standard deviation of about 13.
    assert 140 <= drawn["llama-v2"] <= 260 and drawn["llama-v1"] + drawn["llama-v2"] == 2000
    assert fleet.choose("llama-v1") == "llama-v1"  # an engine model is itself
    assert fleet.capacity() == {"llama": 8, "llama-v1": 4, "llama-v2": 4}


def test_alias_goes_only_to_served_targets_and_shadows_a_model_of_its_name() -> None:
    a = StubBackend("a", "http://a", ["llama"])
    fleet = Fleet(
        engines=[(a, PoolSpec("a", max_concurrency=2, adaptive=False))],
        aliases={"llama": [("llama", 95.0), ("llama-next", 5.0)]},
        rng=random.Random(1),
    )
    # Nobody serves llama-next yet: every draw is llama.
    assert {fleet.choose("llama") for _ in range(200)} == {"llama"}
    assert fleet.capacity() == {"llama": 2}
    assert fleet.public_names(fleet.engines[0]) == {"llama"}


def test_engine_limits_fixed_or_learned() -> None:
    fixed = PoolSpec("f", max_concurrency=6, adaptive=False).limiter()
    learned = PoolSpec("l", max_concurrency=6).limiter()
    assert fixed.limit == 6 and not fixed.adaptive
    assert learned.adaptive and 1 <= learned.limit <= 6


def test_width_and_room_follow_the_limit() -> None:
    backend = StubBackend("a", "http://a", ["m"])
    engine = Engine(backend, "a", "a", PoolSpec("a", max_concurrency=3, adaptive=False).limiter())
    wide = make_job()
    wide.sequences = 5
    assert engine.width(wide) == 3 and engine.has_slots_for(wide)
    engine.inflight = 1
    assert not engine.has_slots_for(wide) and engine.available(0.0)
    engine.draining = True
    assert not engine.available(0.0)


def test_settings_build_the_fleet() -> None:
    settings = load_settings(
        overrides={
            "backends": [{"url": "http://one:1", "name": "one", "models": ["m"]}],
            "pools": [
                {
                    "name": "gpu",
                    "engines": ["http://e1:8000/v1", "dns://vllm.ns.svc:8000"],
                    "models": ["llama"],
                    "max_concurrency": 32,
                    "priority": {"high": 0, "normal": 5},
                }
            ],
            "aliases": [{"name": "chat", "targets": [{"model": "llama"}]}],
        },
        environ={},
    )
    fleet = build_fleet(settings, resolver=Records())
    by_name = {e.name: e for e in fleet.engines}
    assert set(by_name) == {"one", "gpu/e1:8000"} and fleet.dynamic
    assert not by_name["one"].limiter.adaptive and by_name["one"].limit == 8
    gpu = by_name["gpu/e1:8000"]
    assert gpu.limiter.adaptive and gpu.limiter.ceiling == 32
    assert getattr(gpu.backend, "priority_map", None) == {"high": 0, "normal": 5}
    assert set(fleet.capacity()) == {"m", "llama", "chat"}


@pytest.mark.parametrize(
    ("pool", "needle"),
    [
        ({"name": "p", "engines": ["ftp://x:1"]}, "http://, https:// or dns://"),
        ({"name": "p", "engines": ["dns://vllm"]}, "dns://NAME:PORT"),
        ({"name": "p", "engines": ["dns://vllm:99999"]}, "port"),
        ({"name": "p", "engines": ["http://x:1/a/b"]}, "http://HOST:PORT"),
        ({"name": "p", "engines": []}, "engines"),
        ({"name": "p", "engines": ["http://x:1"], "adaptive": False}, "needs max_concurrency"),
        ({"name": "p", "engines": ["http://x:1", "http://x:1"]}, "listed twice"),
        ({"name": "p", "engines": ["http://x:1"], "priority": {"vip": 0}}, "unknown classes: vip"),
    ],
)
def test_bad_pools_are_refused_clearly(pool: dict[str, Any], needle: str) -> None:
    with pytest.raises(ConfigError, match=needle):
        load_settings(overrides={"pools": [pool]}, environ={})


def test_an_engines_ttft_is_smoothed_by_the_shared_rule() -> None:
    """The dispatcher's engines and the routing model fold a TTFT by one function: the first
    sample is taken whole, each later one moves the value TTFT_SMOOTHING of the way to it."""
    assert smoothed_ttft(None, 0.8) == 0.8
    assert smoothed_ttft(1.0, 2.0) == pytest.approx(1.0 + TTFT_SMOOTHING)
    engine = Engine(StubBackend("e", "http://e", ["m"]), "p", "e", PoolSpec("p").limiter())
    folded: float | None = None
    for sample in (0.5, 2.0, 0.1, 0.1):
        engine.observe_ttft(sample)
        folded = smoothed_ttft(folded, sample)
        assert engine.ttft_s == folded
