"""The virtual-time model of the engine, running the real core code: what the docs' figures rest on."""

from __future__ import annotations

from sluice.bench.policy_model import ARTICLE, capacity, draw_engine, loads, run
from sluice.core.policy import CoDelPolicy


def test_the_article_engine_keeps_its_capacity() -> None:
    assert 5.4 < capacity(ARTICLE) < 5.7


def test_retry_after_is_a_reservation_when_every_refused_client_retries() -> None:
    """The article's spike with every refused client retrying once at its Retry-After: with the
    reservations, at least 90 % of those who come back are served; the times of before (the same
    for everyone refused in the same second, share 0 here) served about a quarter."""
    spike = loads(5.5)["spike 0.55x-5.5x"]
    for share, at_least, at_most in ((0.5, 0.9, 1.0), (0.0, 0.0, 0.5)):
        results = [run(CoDelPolicy(), spike, seed, retriers=1.0, share=share) for seed in range(3)]
        retries = sum(r.retries for r in results)
        served = sum(r.retries_ok for r in results) / retries
        assert retries > 100 and at_least <= served <= at_most, (share, served, retries)


def test_the_family_draws_engines_of_every_shape() -> None:
    engines = [draw_engine(seed) for seed in range(40)]
    assert {e.answers for e in engines} == {"fixed", "early", "longtail"}
    assert min(e.slots for e in engines) <= 6 and max(e.slots for e in engines) >= 48
    assert any(e.kv_tokens is not None for e in engines) and any(e.kv_tokens is None for e in engines)
    assert draw_engine(7) == draw_engine(7)
