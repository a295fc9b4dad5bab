"""Reading an engine's own load: Prometheus text of vLLM, SGLang, TGI and llama-server (samples
written from their docs, and llama-server's as a real build prints it), /slots, and the real
simulator and llama-server over HTTP."""

from __future__ import annotations

import asyncio
import json
from collections.abc import Callable
from pathlib import Path

import httpx
import pytest

from sluice.backends.engine_load import (
    EngineKind,
    EngineLoadReader,
    detect_kind,
    load_from_metrics,
    load_from_slots,
    parse_prometheus,
)
from sluice.backends.http import EngineUnreachable
from sluice.backends.openai import OpenAIBackend
from sluice.core.concurrency import ConcurrencyLimit, EngineLoad
from sluice.local_engine.server import LocalEngine, find_llama_server, find_model
from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.helpers import free_port, wait_until

VLLM_V1 = """\
# HELP vllm:num_requests_running Number of requests in model execution batches.
# TYPE vllm:num_requests_running gauge
vllm:num_requests_running{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 12.0
# HELP vllm:num_requests_waiting Number of requests waiting to be processed.
# TYPE vllm:num_requests_waiting gauge
vllm:num_requests_waiting{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 3.0
# HELP vllm:kv_cache_usage_perc KV-cache usage. 1 means 100 percent usage.
# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 0.8125
# HELP vllm:num_preemptions_total Cumulative number of preemption from the engine.
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="meta-llama/Llama-3.1-8B-Instruct"} 7.0
# HELP vllm:time_to_first_token_seconds Histogram of time to first token in seconds.
# TYPE vllm:time_to_first_token_seconds histogram
vllm:time_to_first_token_seconds_bucket{engine="0",le="0.001",model_name="m"} 0.0
vllm:time_to_first_token_seconds_sum{engine="0",model_name="m"} 1.5
"""

# Older vLLM (V0): the KV gauge had the GPU in its name; two data-parallel engines label each one.
VLLM_V0_DATA_PARALLEL = """\
vllm:num_requests_running{model_name="m",engine="0"} 4
vllm:num_requests_running{model_name="m",engine="1"} 5
vllm:num_requests_waiting{model_name="m",engine="0"} 0
vllm:num_requests_waiting{model_name="m",engine="1"} 1
vllm:gpu_cache_usage_perc{model_name="m",engine="0"} 0.25
vllm:gpu_cache_usage_perc{model_name="m",engine="1"} 0.5
vllm:num_preemptions_total{model_name="m",engine="0"} 0
vllm:num_preemptions_total{model_name="m",engine="1"} 2
"""

SGLANG = """\
# TYPE sglang:num_running_reqs gauge
sglang:num_running_reqs{model_name="qwen"} 30.0
# TYPE sglang:num_queue_reqs gauge
sglang:num_queue_reqs{model_name="qwen"} 0.0
# TYPE sglang:token_usage gauge
sglang:token_usage{model_name="qwen"} 0.41
"""

TGI = """\
# TYPE tgi_queue_size gauge
tgi_queue_size 2
# TYPE tgi_batch_current_size gauge
tgi_batch_current_size 16
# TYPE tgi_request_duration histogram
tgi_request_duration_bucket{le="0.1"} 3
"""

# As llama-server (b5xxx and later, --metrics) prints it: no labels, integers.
LLAMA = """\
# HELP llamacpp:prompt_tokens_total Number of prompt tokens processed, excluding cached tokens
# TYPE llamacpp:prompt_tokens_total counter
llamacpp:prompt_tokens_total 120
# HELP llamacpp:requests_processing Number of requests processing
# TYPE llamacpp:requests_processing gauge
llamacpp:requests_processing 2
# HELP llamacpp:requests_deferred Number of requests deferred
# TYPE llamacpp:requests_deferred gauge
llamacpp:requests_deferred 1
# HELP llamacpp:n_busy_slots_per_decode Average number of busy slots per llama_decode() call
# TYPE llamacpp:n_busy_slots_per_decode gauge
llamacpp:n_busy_slots_per_decode 1.5
"""

SLOTS_NEW = [
    {"id": 0, "n_ctx": 512, "speculative": False, "is_processing": True},
    {"id": 1, "n_ctx": 512, "speculative": False, "is_processing": False},
    {"id": 2, "n_ctx": 512, "speculative": False, "is_processing": True},
]
SLOTS_OLD = [{"id": 0, "state": 1}, {"id": 1, "state": 0}]


def test_the_parser_reads_labels_with_quotes_braces_and_spaces_and_skips_what_it_cannot() -> None:
    text = (
        'odd{path="/a b}",x="{\\"q"} 3 1700000000000\n'
        'plain 4.5 # {trace_id="x"} 1\n'
        "not a number here\n"
        "nan_metric NaN\n"
        "broken{unclosed 7\n"
        "\n# comment only\n"
    )
    metrics = parse_prometheus(text)
    assert metrics == {"odd": [3.0], "plain": [4.5]}


@pytest.mark.parametrize(
    ("text", "kind"),
    [
        (VLLM_V1, EngineKind.VLLM),
        (SGLANG, EngineKind.SGLANG),
        (TGI, EngineKind.TGI),
        (LLAMA, EngineKind.LLAMA_CPP),
    ],
)
def test_each_engine_is_known_by_its_running_metric(text: str, kind: EngineKind) -> None:
    assert detect_kind(parse_prometheus(text)) is kind


def test_a_report_with_no_known_names_is_no_kind() -> None:
    assert detect_kind(parse_prometheus("process_cpu_seconds_total 3\n")) is None


def test_vllm_v1() -> None:
    load = load_from_metrics(EngineKind.VLLM, parse_prometheus(VLLM_V1))
    assert load == EngineLoad(running=12, waiting=3, kv_usage=0.8125, preemptions=7)


def test_vllm_v0_data_parallel_sums_counts_and_takes_the_fullest_cache() -> None:
    load = load_from_metrics(EngineKind.VLLM, parse_prometheus(VLLM_V0_DATA_PARALLEL))
    assert load == EngineLoad(running=9, waiting=1, kv_usage=0.5, preemptions=2)


def test_sglang_tgi_and_llama_server() -> None:
    assert load_from_metrics(EngineKind.SGLANG, parse_prometheus(SGLANG)) == EngineLoad(30, 0, 0.41, None)
    assert load_from_metrics(EngineKind.TGI, parse_prometheus(TGI)) == EngineLoad(16, 2, None, None)
    llama = load_from_metrics(EngineKind.LLAMA_CPP, parse_prometheus(LLAMA), slots=4)
    assert llama == EngineLoad(2, 1, None, None, slots=4)


def test_a_kv_percent_above_one_is_read_as_a_percent() -> None:
    load = load_from_metrics(
        EngineKind.SGLANG, parse_prometheus("sglang:num_running_reqs 1\nsglang:token_usage 75\n")
    )
    assert load is not None and load.kv_usage == pytest.approx(0.75)


def test_slots_new_and_old_shapes() -> None:
    assert load_from_slots(SLOTS_NEW) == EngineLoad(2, None, None, None, slots=3)
    assert load_from_slots(SLOTS_OLD) == EngineLoad(1, None, None, None, slots=2)
    assert load_from_slots({"error": "no"}) is None
    assert load_from_slots([]) is None
    assert load_from_slots([{"id": 0}]) is None


# The reader's choices (what it asks, when it asks again) over canned answers: a GET that answers
# from a table by path, as EngineHTTP.get answers (status, body), or raises as it does.
Answer = tuple[int, bytes] | EngineUnreachable


def _reader(answers: Callable[[str], Answer], asked: list[str]) -> EngineLoadReader:
    async def get(path: str, timeout_s: float) -> tuple[int, bytes]:
        asked.append(path)
        answer = answers(path)
        if isinstance(answer, EngineUnreachable):
            raise answer
        return answer

    return EngineLoadReader(get)


async def test_an_engine_with_nothing_to_say_costs_its_first_read_only() -> None:
    asked: list[str] = []
    reader = _reader(lambda path: (404, b"not found"), asked)
    for _ in range(5):
        assert await reader.read() is None
    assert reader.kind is EngineKind.NONE
    assert asked == ["/metrics", "/slots"]


async def test_an_engine_that_cannot_be_reached_is_asked_again() -> None:
    asked: list[str] = []

    def answers(path: str) -> Answer:
        if len(asked) == 1:
            return EngineUnreachable("ClientConnectorError", "refused")
        return 200, TGI.encode()

    reader = _reader(answers, asked)
    assert await reader.read() is None
    assert reader.kind is None
    assert await reader.read() == EngineLoad(16, 2, None, None)
    assert reader.kind is EngineKind.TGI


async def test_slots_alone_are_read_where_metrics_are_off() -> None:
    def answers(path: str) -> Answer:
        if path == "/metrics":
            return 501, b'{"error": {"message": "This server does not support metrics endpoint."}}'
        return 200, json.dumps(SLOTS_NEW).encode()

    reader = _reader(answers, [])
    assert await reader.read() == EngineLoad(2, None, None, None, slots=3)
    assert reader.kind is EngineKind.LLAMA_SLOTS
    assert await reader.read() == EngineLoad(2, None, None, None, slots=3)


async def test_a_dead_engine_reports_nothing_and_the_backend_stays_usable() -> None:
    # Over real HTTP: a port nobody listens on is a failed read (None), not an exception.
    backend = OpenAIBackend(f"http://127.0.0.1:{free_port()}", connect_timeout_s=1.0)
    try:
        assert await backend.engine_load() is None
        assert backend.engine_kind is None
    finally:
        await backend.aclose()


async def test_the_simulator_reports_its_batch_and_queue() -> None:
    # Two slots, ~2 s a lone answer: four streams give two running and two waiting.
    async with serve_in_background(preset("article", model="sim", max_num_seqs=2)) as url:
        backend = OpenAIBackend(url)
        try:
            idle = await backend.engine_load()
            assert backend.engine_kind is EngineKind.VLLM
            assert idle == EngineLoad(running=0, waiting=0, kv_usage=0.0, preemptions=0)
            body = {"model": "sim", "prompt": "hello", "max_tokens": 200, "stream": True}

            async def one() -> None:
                async with (
                    httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as http,
                    http.stream("POST", "/v1/completions", json=body) as r,
                ):
                    async for _ in r.aiter_lines():
                        pass

            tasks = [asyncio.create_task(one()) for _ in range(4)]
            seen: list[EngineLoad | None] = []

            async def busy() -> bool:
                seen.append(await backend.engine_load())
                return seen[-1] is not None and seen[-1].running == 2 and seen[-1].waiting == 2

            try:
                await wait_until(busy, timeout=10)
            finally:
                for t in tasks:
                    t.cancel()
                await asyncio.gather(*tasks, return_exceptions=True)
            last = seen[-1]
            assert last is not None and last.kv_usage is not None and 0 < last.kv_usage < 1
        finally:
            await backend.aclose()


@pytest.mark.llm
@pytest.mark.skipif(
    find_llama_server() is None or find_model() is None,
    reason="llama-server or the model is absent: run `sluice engine build` (about 4 minutes)",
)
async def test_llama_server_reports_its_slots_and_busy_ones(tmp_path: Path) -> None:
    async with LocalEngine(slots=2, ctx_per_slot=1024, log_path=tmp_path / "engine.log") as engine:
        backend = OpenAIBackend(engine.url)
        try:
            idle = await backend.engine_load()
            assert backend.engine_kind is EngineKind.LLAMA_CPP
            assert idle == EngineLoad(running=0, waiting=0, kv_usage=None, preemptions=None, slots=2)
            body = {
                "model": engine.model,
                "prompt": "Once upon a time",
                "max_tokens": 400,
                "ignore_eos": True,
            }
            async with httpx.AsyncClient(base_url=engine.url, trust_env=False, timeout=60) as http:
                answer = asyncio.create_task(http.post("/v1/completions", json=body))
                seen: list[EngineLoad | None] = []

                async def running() -> bool:
                    seen.append(await backend.engine_load())
                    return answer.done() or (seen[-1] is not None and seen[-1].running == 1)

                try:
                    await wait_until(running, timeout=30)
                finally:
                    # Seen or not, the answer is not needed: closing the connection aborts it.
                    answer.cancel()
                    await asyncio.gather(answer, return_exceptions=True)
                assert seen[-1] is not None and seen[-1].running == 1, "the request ended before it was seen"
        finally:
            await backend.aclose()


async def test_the_limit_learned_from_a_real_simulator_is_its_batch() -> None:
    # A loop that keeps the limit in flight on a six-slot simulator and feeds the limiter what
    # the engine's /metrics say, as the dispatcher's heartbeat does (a short interval, so the test
    # is quick; the logic is the same).
    async with serve_in_background(preset("fast", model="sim", max_num_seqs=6, base_step_s=0.002)) as url:
        backend = OpenAIBackend(url, max_concurrency=64)
        limiter = ConcurrencyLimit(interval_s=0.1, reprobe_s=60.0)
        inflight: set[asyncio.Task[None]] = set()
        body = {"model": "sim", "prompt": "hello", "max_tokens": 200, "stream": False}

        async def one() -> None:
            async with httpx.AsyncClient(base_url=url, trust_env=False, timeout=30) as http:
                (await http.post("/v1/completions", json=body)).raise_for_status()

        async def settled() -> bool:
            while len(inflight) < limiter.limit:
                task = asyncio.create_task(one())
                inflight.add(task)
                task.add_done_callback(inflight.discard)
                limiter.on_dispatch(len(inflight))
            load = await backend.engine_load()
            if load is not None:
                limiter.on_engine_load(load)
            await asyncio.sleep(0.05)
            return limiter.snapshot()["reason"] == "engine queue"

        try:
            await wait_until(settled, timeout=30)
        finally:
            for t in list(inflight):
                t.cancel()
            await asyncio.gather(*inflight, return_exceptions=True)
            await backend.aclose()
        # It doubled past the six slots, saw the engine queue, and came back to what it runs.
        assert limiter.limit == 6
        assert limiter.snapshot()["known_capacity"] == 6


@pytest.mark.parametrize("text", [VLLM_V1, SGLANG, TGI, LLAMA])
def test_the_names_asked_for_are_parsed_as_the_whole_exposition_parses_them(text: str) -> None:
    whole = parse_prometheus(text)
    for names in ({"vllm:num_requests_running", "tgi_queue_size"}, {"sglang:token_usage"}, set(), set(whole)):
        assert parse_prometheus(text, names) == {k: v for k, v in whole.items() if k in names}
