"""The simulator's prefix cache: the model on a virtual clock, then over HTTP with the openai SDK."""

from __future__ import annotations

import ssl
from collections.abc import AsyncIterator

import httpx
import openai
import pytest
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from sluice.sim.model import (
    BatchModel,
    PrefixCache,
    SimParams,
    estimate_chat_tokens,
    prefix_blocks,
    prefix_blocks_of_chat,
    preset,
    step_duration_s,
)
from sluice.sim.server import configure_parser, params_from_args, serve_in_background

TLS = ssl.create_default_context()
SLOW_PREFILL = SimParams(prefill_s_per_token=0.001, prefix_cache_tokens=4096)


def run(engine: BatchModel, now: float = 0.0) -> float:
    while (d := engine.next_step_duration()) is not None:
        now += d
        engine.step(now)
    return now


# --- blocks --------------------------------------------------------------------------------------


def test_blocks_are_chained_full_blocks_of_the_text() -> None:
    a = prefix_blocks("x" * 64 * 3 + "tail", 50)
    b = prefix_blocks("x" * 64 * 3 + "other tail", 52)
    assert len(a) == 3 and a == b
    # A difference in the first block changes every block after it (the hash is chained).
    c = prefix_blocks("y" + "x" * (64 * 3 - 1), 50)
    assert all(x != y for x, y in zip(a, c, strict=True))
    # Never more blocks than the prompt's tokens fill.
    assert len(prefix_blocks("x" * 64 * 3, 20)) == 1
    assert prefix_blocks("short", 2) == ()


def test_token_id_prompts_block_by_ids() -> None:
    ids = list(range(40))
    assert len(prefix_blocks(ids, 40)) == 2
    assert prefix_blocks(ids, 40)[0] == prefix_blocks(ids[:16] + [99] * 20, 36)[0]


def test_a_growing_conversation_keeps_its_blocks() -> None:
    system = ("system", "You are helpful. " * 20)
    turn1 = [system, ("user", "first question " * 5)]
    turn2 = [*turn1, ("assistant", "an answer " * 10), ("user", "second")]
    b1 = prefix_blocks_of_chat(turn1, estimate_chat_tokens([t for _, t in turn1]))
    b2 = prefix_blocks_of_chat(turn2, estimate_chat_tokens([t for _, t in turn2]))
    assert len(b1) >= 4 and b2[: len(b1)] == b1


def test_lru_evicts_the_least_recent_and_tails_first() -> None:
    cache = PrefixCache(capacity_tokens=16 * 4)
    cache.insert([1, 2, 3])
    cache.insert([7, 8])
    # Five blocks into four: block 3 (the tail of the older chain) goes first.
    assert cache.cached_blocks([1, 2, 3]) == 2 and cache.cached_blocks([7, 8]) == 2
    assert len(cache) == 4
    off = PrefixCache(0)
    off.insert([1])
    assert off.cached_blocks([1]) == 0


# --- the engine ----------------------------------------------------------------------------------


def test_second_request_with_the_same_prefix_skips_its_prefill() -> None:
    engine = BatchModel(SLOW_PREFILL)
    text = "s" * 64 * 10 + "q1"
    blocks = prefix_blocks(text, 161)
    first = engine.submit("a", 161, 1, 0.0, blocks)
    t1 = run(engine)
    second = engine.submit("b", 161, 1, t1, blocks)
    t2 = run(engine, t1)
    assert (first.cached_tokens, second.cached_tokens) == (0, 160)
    assert t1 == pytest.approx(step_duration_s(SLOW_PREFILL, 1, 161))
    assert t2 - t1 == pytest.approx(step_duration_s(SLOW_PREFILL, 1, 1))
    assert engine.stats.prefix_cache_queries_total == 322
    assert engine.stats.prefix_cache_hits_total == 160


def test_the_last_prompt_token_is_always_computed() -> None:
    engine = BatchModel(SLOW_PREFILL)
    blocks = prefix_blocks("z" * 64 * 2, 32)
    engine.submit("a", 32, 1, 0.0, blocks)
    run(engine)
    again = engine.submit("b", 32, 1, 1.0, blocks)
    run(engine, 1.0)
    assert again.cached_tokens == 31


def test_cache_off_changes_nothing() -> None:
    params = SimParams(prefill_s_per_token=0.001)
    engine = BatchModel(params)
    blocks = prefix_blocks("s" * 640, 160)
    engine.submit("a", 160, 1, 0.0, blocks)
    t1 = run(engine)
    engine.submit("b", 160, 1, t1, blocks)
    t2 = run(engine, t1)
    assert t2 - t1 == pytest.approx(t1)
    assert engine.stats.prefix_cache_queries_total == 0 and engine.stats.prefix_cache_hits_total == 0


def test_a_small_cache_forgets() -> None:
    engine = BatchModel(SimParams(prefix_cache_tokens=64))  # four blocks
    first = prefix_blocks("a" * 64 * 4, 64)
    engine.submit("a", 64, 1, 0.0, first)
    run(engine)
    engine.submit("b", 64, 1, 1.0, prefix_blocks("b" * 64 * 4, 64))
    run(engine, 1.0)
    back = engine.submit("c", 64, 1, 2.0, first)
    run(engine, 2.0)
    assert back.cached_tokens == 0


def test_bad_cache_settings_are_refused() -> None:
    with pytest.raises(ValueError):
        SimParams(prefix_cache_tokens=-1)
    with pytest.raises(ValueError):
        SimParams(prefix_block_tokens=0)


# --- over HTTP -----------------------------------------------------------------------------------


@pytest.fixture
async def cached_url() -> AsyncIterator[str]:
    async with serve_in_background(preset("fast", prefix_cache_tokens=100_000)) as base:
        yield base


def sdk(base: str) -> AsyncOpenAI:
    client = openai.DefaultAsyncHttpxClient(verify=TLS)
    return AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0, http_client=client)


def metric(text: str, name: str) -> float:
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            if sample.name == name:
                return float(sample.value)
    raise AssertionError(f"{name} not exported")


async def test_usage_reports_cached_tokens_and_metrics_count_hits(cached_url: str) -> None:
    system = {"role": "system", "content": "You are a terse assistant. " * 40}
    client = sdk(cached_url)
    first = await client.chat.completions.create(
        model="sim", messages=[system, {"role": "user", "content": "one"}], max_tokens=2
    )
    second = await client.chat.completions.create(
        model="sim", messages=[system, {"role": "user", "content": "two"}], max_tokens=2
    )
    assert first.usage is not None and second.usage is not None
    assert first.usage.prompt_tokens_details is not None
    assert first.usage.prompt_tokens_details.cached_tokens == 0
    cached = second.usage.prompt_tokens_details
    assert cached is not None and cached.cached_tokens is not None
    # The shared system prompt (about 270 tokens) is cached, in whole 16-token blocks.
    assert 240 <= cached.cached_tokens < second.usage.prompt_tokens
    assert cached.cached_tokens % 16 == 0

    stream = await client.completions.create(
        model="sim",
        prompt="p" * 400,
        max_tokens=2,
        stream=True,
        stream_options={"include_usage": True},
    )
    usage = [c.usage async for c in stream if c.usage is not None]
    assert usage and usage[0].prompt_tokens_details is not None

    async with httpx.AsyncClient(verify=TLS) as http:
        text = (await http.get(cached_url + "/metrics")).text
    queries = metric(text, "vllm:prefix_cache_queries_total")
    hits = metric(text, "vllm:prefix_cache_hits_total")
    assert queries == first.usage.prompt_tokens + second.usage.prompt_tokens + usage[0].prompt_tokens
    assert hits == cached.cached_tokens


async def test_without_the_cache_usage_has_no_details() -> None:
    async with serve_in_background(preset("fast")) as base:
        reply = await sdk(base).completions.create(model="sim", prompt="q" * 400, max_tokens=1)
        async with httpx.AsyncClient(verify=TLS) as http:
            text = (await http.get(base + "/metrics")).text
    assert reply.usage is not None and reply.usage.prompt_tokens_details is None
    assert metric(text, "vllm:prefix_cache_queries_total") == 0


def test_command_line_sets_the_cache() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    configure_parser(parser)
    params = params_from_args(parser.parse_args(["--prefix-cache-tokens", "8192"]))
    assert params.prefix_cache_tokens == 8192 and params.prefix_block_tokens == 16
    assert params_from_args(parser.parse_args([])).prefix_cache_tokens == 0
