"""The routing model on a tiny config: every mode sees the same arrivals, and each mode routes by
its own rule (which engine gets the work), not how fast anything is."""

from __future__ import annotations

import itertools

import pytest

from sluice.bench.prefix_routing import EngineArgs, Workload
from sluice.bench.route_model import (
    FLEETS,
    ChatConfig,
    Config,
    arrivals,
    chat_turns,
    fleet_capacity,
    main,
    run,
    run_chat,
)

TINY = Config(fleet="mixed", load=0.25, duration_s=30.0, patience_s=30.0, seed=2)


def test_every_mode_sees_the_same_arrivals_at_the_load_asked() -> None:
    a = [(j.arrival, j.prompt, j.output) for j in arrivals(TINY)]
    assert a == [(j.arrival, j.prompt, j.output) for j in arrivals(TINY)]
    expected = 0.25 * fleet_capacity(FLEETS["mixed"]) * 30.0
    assert 0.7 * expected < len(a) < 1.3 * expected


def test_least_loaded_fills_the_big_engine_and_predicted_the_fast_ones() -> None:
    least = run(TINY, "least-loaded")
    predicted = run(TINY, "predicted")
    # Light load: nothing queues, every answer is good in both modes.
    assert least.good == predicted.good == least.sent == predicted.sent == len(arrivals(TINY))
    # The free fraction of the limit favours the 64-slot engine with its 40 ms steps; the
    # soonest predicted completion sends work where it finishes first (the 16 ms engine).
    assert least.share["s64"] > least.good / 3
    assert predicted.share["s64"] < predicted.good / 10
    assert predicted.share["s16"] > least.share["s16"]


def test_measurement_noise_changes_only_what_the_router_reads() -> None:
    exact = run(Config(fleet="same", load=0.25, duration_s=20.0, seed=3), "least-loaded")
    noisy = run(Config(fleet="same", load=0.25, duration_s=20.0, seed=3, jitter=0.3), "least-loaded")
    # least-loaded reads no measurement: the same picks, the same answers.
    assert exact.share == noisy.share and exact.e2e == noisy.e2e


def test_the_command_prints_a_table(capsys) -> None:  # type: ignore[no-untyped-def]
    main(["--loads", "0.3", "--seeds", "1", "--duration", "10"])
    out = capsys.readouterr().out
    assert "| load | mode |" in out and "| 0.3 | least-loaded |" in out and "| 0.3 | predicted |" in out


CHAT = ChatConfig(
    Workload(systems=2, system_tokens=300, doc_tokens=1500, turns=3, conversations=12, rate=4.0),
    EngineArgs(engines=3, prefix_cache_tokens=32_768),
)


def test_the_chat_workload_resends_each_conversation_and_the_cache_sees_it() -> None:
    starts, _, turns = chat_turns(CHAT)
    assert len(starts) == len(turns) == 12
    for conversation in turns:
        # Each turn resends the one before it: its blocks start with all of the previous turn's.
        for before, after in itertools.pairwise(conversation):
            assert after.prompt > before.prompt
            assert after.blocks[: len(before.blocks)] == before.blocks
        assert len({t.prefix for t in conversation}) == 1
    outcomes = {mode: run_chat(CHAT, mode) for mode in ("least-loaded", "predicted", "affinity")}
    # Every turn is answered in every mode, and the engines are asked for the same prompt tokens:
    # only where the turns went differs.
    assert {(o.answered, o.requests) for o in outcomes.values()} == {(36, 36)}
    assert len({o.cache_queries for o in outcomes.values()}) == 1
    # A turn sent back to the engine of the turn before finds its conversation cached there:
    # predicted completion counts that cache, least-loaded does not.
    assert outcomes["predicted"].cache_hits > outcomes["least-loaded"].cache_hits
    assert outcomes["affinity"].cache_hits > outcomes["least-loaded"].cache_hits


def test_the_chat_command_prints_its_table(capsys) -> None:  # type: ignore[no-untyped-def]
    main(["--workload", "chat", "--seeds", "1", "--conversations", "4", "--turns", "2"])
    out = capsys.readouterr().out
    assert "| mode | hit rate |" in out
    assert all(f"| {mode} |" in out for mode in ("least-loaded", "predicted", "affinity"))


def test_a_variant_changes_only_what_the_router_is_given() -> None:
    now = run_chat(CHAT, "predicted")
    before = run_chat(CHAT, "predicted", {"no-prefix": ""})
    # Withheld, the prefix key no longer sends a turn back to its conversation's cache.
    assert before.cache_hits < now.cache_hits
    assert before.cache_queries == now.cache_queries and before.answered == now.answered == 36
    # least-loaded reads no measurement and no prefix: no variant changes its picks.
    least = run_chat(CHAT, "least-loaded")
    for name in ("no-prefix", "one-key", "weights-1", "no-ttft", "ttft-smoothing"):
        variant = {name: "1.0" if name == "ttft-smoothing" else ""}
        again = run_chat(CHAT, "least-loaded", variant)
        assert again.share == least.share and again.e2e == least.e2e


def test_an_unknown_variant_is_refused() -> None:
    with pytest.raises(SystemExit):
        main(["--variant", "no-such-thing"])
