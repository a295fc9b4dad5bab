"""``sluice sim`` over HTTP on a real loopback port, with the official ``openai`` SDK as the client."""

from __future__ import annotations

import asyncio
import json
import signal
import ssl
import sys
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any

import httpx
import openai
import pytest
import pytest_asyncio
from openai import AsyncOpenAI
from prometheus_client.parser import text_string_to_metric_families

from sluice.sim.model import SimParams, estimate_chat_tokens, estimate_text_tokens, preset, token_text
from sluice.sim.server import configure_parser, params_from_args, serve_in_background

FAST = preset("fast")
# Long enough that a request is certainly still running when a test disconnects from it.
LONG = 30_000
# Every client builds a TLS context unless given one, and that costs more than most tests here.
TLS = ssl.create_default_context()


@pytest.fixture
async def url() -> AsyncIterator[str]:
    async with serve_in_background(FAST) as base:
        yield base


@pytest_asyncio.fixture(scope="module", loop_scope="module")
async def shared_url() -> AsyncIterator[str]:
    """One server for the tests that only check refusals, which leave no trace in the engine."""
    async with serve_in_background(FAST) as base:
        yield base


@pytest.fixture
async def http() -> AsyncIterator[httpx.AsyncClient]:
    async with httpx.AsyncClient(timeout=10, verify=TLS) as client:
        yield client


def sdk(base: str) -> AsyncOpenAI:
    client = openai.DefaultAsyncHttpxClient(verify=TLS)
    return AsyncOpenAI(base_url=base + "/v1", api_key="x", max_retries=0, http_client=client)


async def stats(http: httpx.AsyncClient, base: str) -> dict[str, Any]:
    response = await http.get(base + "/sim/stats")
    response.raise_for_status()
    result: dict[str, Any] = response.json()
    return result


async def wait_until(check: Callable[[], Awaitable[bool]], timeout: float = 5.0) -> None:
    """Poll a condition that lives in the server, where no event of ours can reach; bounded."""
    async with asyncio.timeout(timeout):
        while not await check():  # noqa: ASYNC110
            await asyncio.sleep(0.01)


def tokens(n: int) -> str:
    return "".join(token_text(i) for i in range(n))


def assert_openai_error(response: httpx.Response, status: int) -> dict[str, Any]:
    assert response.status_code == status, response.text
    error = response.json()["error"]
    assert isinstance(error["message"], str) and error["message"]
    assert isinstance(error["type"], str) and error["type"]
    assert isinstance(error["code"], str) and error["code"]
    result: dict[str, Any] = error
    return result


async def test_chat_completion_without_streaming(url: str) -> None:
    messages: Any = [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hello there"}]

    reply = await sdk(url).chat.completions.create(model="sim", messages=messages, max_tokens=7)

    assert reply.object == "chat.completion"
    assert reply.model == "sim"
    assert reply.choices[0].message.role == "assistant"
    assert reply.choices[0].message.content == tokens(7)
    assert reply.choices[0].finish_reason == "length"
    assert reply.usage is not None
    prompt = estimate_chat_tokens(["be brief", "hello there"])
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens) == (prompt, 7)
    assert reply.usage.total_tokens == prompt + 7


async def test_chat_completion_streams_one_token_per_chunk_then_usage(url: str) -> None:
    stream = await sdk(url).chat.completions.create(
        model="sim",
        messages=[{"role": "user", "content": "abcdefgh"}],
        max_tokens=9,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = [chunk async for chunk in stream]

    token_chunks = [c for c in chunks if c.choices]
    assert [c.choices[0].delta.content for c in token_chunks] == [token_text(i) for i in range(9)]
    assert token_chunks[0].choices[0].delta.role == "assistant"
    assert [c.choices[0].finish_reason for c in token_chunks] == [None] * 8 + ["length"]
    usage = chunks[-1].usage
    assert chunks[-1].choices == [] and usage is not None
    assert (usage.prompt_tokens, usage.completion_tokens) == (estimate_chat_tokens(["abcdefgh"]), 9)
    assert all(c.usage is None for c in token_chunks)
    assert len({c.id for c in chunks}) == 1


async def test_completion_without_streaming(url: str) -> None:
    reply = await sdk(url).completions.create(model="sim", prompt="x" * 40, max_tokens=5)

    assert reply.object == "text_completion"
    assert reply.choices[0].text == tokens(5)
    assert reply.usage is not None
    assert (reply.usage.prompt_tokens, reply.usage.completion_tokens, reply.usage.total_tokens) == (10, 5, 15)


async def test_completion_streams_and_ends_with_usage_and_done(url: str, http: httpx.AsyncClient) -> None:
    stream = await sdk(url).completions.create(
        model="sim", prompt=[1, 2, 3], max_tokens=4, stream=True, stream_options={"include_usage": True}
    )
    chunks = [chunk async for chunk in stream]

    assert [c.choices[0].text for c in chunks[:-1]] == [token_text(i) for i in range(4)]
    assert chunks[-1].usage is not None and chunks[-1].usage.prompt_tokens == 3
    # The raw stream: SSE data lines, one per chunk, and a final [DONE].
    body = {"prompt": "hi", "max_tokens": 3, "stream": True}
    async with http.stream("POST", url + "/v1/completions", json=body) as response:
        assert response.headers["content-type"].startswith("text/event-stream")
        lines = [line async for line in response.aiter_lines() if line]
    assert lines[-1] == "data: [DONE]"
    assert [json.loads(line[6:])["choices"][0]["text"] for line in lines[:-1]] == [
        token_text(i) for i in range(3)
    ]


async def test_absent_max_tokens_uses_the_default() -> None:
    async with serve_in_background(preset("fast", default_max_tokens=6)) as base:
        reply = await sdk(base).completions.create(model="sim", prompt="hello")

    assert reply.choices[0].text == tokens(6)
    assert reply.usage is not None and reply.usage.completion_tokens == 6
    assert estimate_text_tokens("hello") == reply.usage.prompt_tokens


async def test_models_lists_the_served_name_and_health_answers() -> None:
    async with (
        serve_in_background(preset("fast", model="qwen-0.5b")) as base,
        httpx.AsyncClient(verify=TLS) as http,
    ):
        models = await sdk(base).models.list()
        health = await http.get(base + "/health")
        reply = await sdk(base).completions.create(model="anything", prompt="p", max_tokens=1)

    assert [m.id for m in models.data] == ["qwen-0.5b"]
    assert health.status_code == 200
    assert reply.model == "qwen-0.5b"


async def test_metrics_use_vllm_names_and_count_the_work(url: str, http: httpx.AsyncClient) -> None:
    await sdk(url).completions.create(model="sim", prompt="x" * 12, max_tokens=5)

    response = await http.get(url + "/metrics")

    assert response.status_code == 200
    samples = {
        s.name: s.value for family in text_string_to_metric_families(response.text) for s in family.samples
    }
    for name in (
        "vllm:num_requests_running",
        "vllm:num_requests_waiting",
        "vllm:gpu_cache_usage_perc",
        "vllm:num_preemptions_total",
        "sim:aborted_requests_total",
        "sim:wasted_generation_tokens_total",
    ):
        assert name in samples, name
    assert samples["vllm:generation_tokens_total"] == 5
    assert samples["vllm:prompt_tokens_total"] == 3
    assert samples["vllm:request_success_total"] == 1
    assert samples["vllm:e2e_request_latency_seconds_count"] == 1


async def test_disconnecting_mid_stream_aborts_the_request_and_counts_wasted_tokens(
    url: str, http: httpx.AsyncClient
) -> None:
    stream = await sdk(url).chat.completions.create(
        model="sim", messages=[{"role": "user", "content": "hi"}], max_tokens=LONG, stream=True
    )
    received = 0
    async for _ in stream:
        received += 1
        if received == 3:
            break
    await stream.close()

    async def aborted() -> bool:
        return bool((await stats(http, url))["aborted_total"] == 1)

    await wait_until(aborted)
    after = await stats(http, url)
    assert after["running"] == after["waiting"] == 0
    assert after["finished_total"] == 0
    assert 3 <= after["wasted_generation_tokens_total"] < LONG
    assert after["wasted_generation_tokens_total"] == after["generation_tokens_total"]
    metrics = (await http.get(url + "/metrics")).text
    assert 'sim:aborted_requests_total{model_name="sim"} 1.0' in metrics


async def test_disconnecting_while_waiting_for_a_whole_answer_aborts_it(
    url: str, http: httpx.AsyncClient
) -> None:
    body = {"prompt": "hi", "max_tokens": LONG}
    call = asyncio.create_task(http.post(url + "/v1/completions", json=body))

    async def generating() -> bool:
        return bool((await stats(http, url))["generation_tokens_total"] > 0)

    await wait_until(generating)
    call.cancel()  # closes the connection, as a client that gives up does
    await asyncio.gather(call, return_exceptions=True)

    async def aborted() -> bool:
        return bool((await stats(http, url))["aborted_total"] == 1)

    await wait_until(aborted)
    assert (await stats(http, url))["running"] == 0


async def test_fail_first_answers_500_in_openai_shape_before_any_token(http: httpx.AsyncClient) -> None:
    async with serve_in_background(preset("fast", fail_first=2)) as base:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "stream": True}
        first = await http.post(base + "/v1/chat/completions", json=body)
        with pytest.raises(openai.InternalServerError) as caught:
            await sdk(base).completions.create(model="sim", prompt="p", max_tokens=2)
        third = await sdk(base).completions.create(model="sim", prompt="p", max_tokens=2)
        after = await stats(http, base)

    assert assert_openai_error(first, 500)["code"] == "injected_fault"
    assert caught.value.status_code == 500
    assert third.choices[0].text == tokens(2)
    assert after["injected_faults"] == 2
    assert after["generation_tokens_total"] == 2


async def test_error_rate_is_random_but_repeatable_with_a_seed(http: httpx.AsyncClient) -> None:
    params = preset("fast", error_rate=0.5, seed=7)
    runs = []
    for _ in range(2):
        async with serve_in_background(params) as base:
            statuses = []
            for _ in range(20):
                response = await http.post(base + "/v1/completions", json={"prompt": "p", "max_tokens": 1})
                statuses.append(response.status_code)
                if response.status_code == 500:
                    assert_openai_error(response, 500)
            runs.append(statuses)

    assert runs[0] == runs[1]
    assert set(runs[0]) == {200, 500}


async def test_stall_after_streams_k_tokens_then_hangs(http: httpx.AsyncClient) -> None:
    async with serve_in_background(preset("fast", stall_after=3)) as base:
        body = {"prompt": "p", "max_tokens": 10, "stream": True}
        async with http.stream("POST", base + "/v1/completions", json=body) as response:
            lines = aiter(line async for line in response.aiter_lines() if line)
            received = [json.loads((await anext(lines))[6:])["choices"][0]["text"] for _ in range(3)]

            async def engine_done() -> bool:
                return bool((await stats(http, base))["finished_total"] == 1)

            # The engine finishes the request; the client still gets nothing more.
            await wait_until(engine_done)
            with pytest.raises(TimeoutError):
                await asyncio.wait_for(anext(lines), timeout=0.2)

    assert received == [token_text(i) for i in range(3)]


async def test_leaving_serve_in_background_ends_open_streams(http: httpx.AsyncClient) -> None:
    async with serve_in_background(preset("fast", stall_after=1)) as base:
        body = {"prompt": "p", "max_tokens": 10, "stream": True}
        response = await http.send(
            http.build_request("POST", base + "/v1/completions", json=body), stream=True
        )
        lines = response.aiter_lines()
        first = await anext(lines)
    # The server is gone; the stream it had open has ended instead of hanging.
    rest = [line async for line in lines]
    await response.aclose()

    assert first.startswith("data: ")
    assert "data: [DONE]" not in rest


BAD_INPUTS: list[tuple[str, bytes | dict[str, Any], str]] = [
    ("/v1/chat/completions", b"{not json", "invalid_json"),
    ("/v1/chat/completions", b"[1, 2]", "invalid_json"),
    ("/v1/chat/completions", {"model": "sim"}, "missing_required_parameter"),
    ("/v1/chat/completions", {"messages": []}, "invalid_value"),
    ("/v1/chat/completions", {"messages": ["hi"]}, "invalid_value"),
    ("/v1/chat/completions", {"messages": [{"role": "user", "content": 5}]}, "invalid_value"),
    (
        "/v1/chat/completions",
        {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 0},
        "invalid_value",
    ),
    ("/v1/completions", {"model": "sim"}, "missing_required_parameter"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": -1}, "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": "5"}, "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": True}, "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "stream": "yes"}, "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "stream_options": {"include_usage": True}}, "invalid_value"),
    ("/v1/completions", {"prompt": ["a", "b"]}, "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "n": 2}, "invalid_value"),
    ("/v1/completions", {"prompt": "hi", "max_tokens": FAST.max_model_len}, "context_length_exceeded"),
]


@pytest.mark.asyncio(loop_scope="module")
@pytest.mark.parametrize(("path", "body", "code"), BAD_INPUTS)
async def test_bad_requests_get_400_in_openai_shape(
    shared_url: str, path: str, body: bytes | dict[str, Any], code: str
) -> None:
    async with httpx.AsyncClient(base_url=shared_url, verify=TLS) as http:
        if isinstance(body, bytes):
            response = await http.post(path, content=body, headers={"content-type": "application/json"})
        else:
            response = await http.post(path, json=body)
        after = await stats(http, shared_url)

    error = assert_openai_error(response, 400)
    assert error["code"] == code
    assert error["type"] == "invalid_request_error"
    assert after["prompt_tokens_total"] == 0


async def test_context_length_error_names_the_limit(http: httpx.AsyncClient) -> None:
    async with serve_in_background(preset("fast", max_model_len=50)) as base:
        response = await http.post(base + "/v1/completions", json={"prompt": "x" * 40, "max_tokens": 41})
        # Without max_tokens the default shrinks to what the context has left.
        shrunk = await http.post(base + "/v1/completions", json={"prompt": "x" * 160})

    assert "maximum context length is 50 tokens" in assert_openai_error(response, 400)["message"]
    assert shrunk.status_code == 200
    assert shrunk.json()["usage"]["completion_tokens"] == 50 - 40


@pytest.mark.asyncio(loop_scope="module")
async def test_unknown_paths_and_methods_get_errors_in_openai_shape(shared_url: str) -> None:
    async with httpx.AsyncClient(base_url=shared_url, verify=TLS) as http:
        assert_openai_error(await http.get("/v1/nothing"), 404)
        assert_openai_error(await http.get("/v1/completions"), 405)


async def test_many_concurrent_streams_all_complete_within_the_batch_limit(http: httpx.AsyncClient) -> None:
    params = preset("fast", max_num_seqs=8)
    peak_running = 0

    async def one(client: httpx.AsyncClient, base: str) -> list[str]:
        body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 8, "stream": True}
        async with client.stream("POST", base + "/v1/chat/completions", json=body) as response:
            return [line async for line in response.aiter_lines() if line]

    async with (
        serve_in_background(params) as base,
        httpx.AsyncClient(timeout=30, verify=TLS, limits=httpx.Limits(max_connections=200)) as many,
    ):
        streams = asyncio.gather(*(one(many, base) for _ in range(120)))
        while not streams.done():
            # The server keeps answering other requests while 120 streams are open.
            peak_running = max(peak_running, (await stats(http, base))["running"])
            await asyncio.sleep(0.01)
        results = await streams
        final = await stats(http, base)

    assert all(len(lines) == 8 + 1 and lines[-1] == "data: [DONE]" for lines in results)
    assert final["finished_total"] == 120
    assert final["generation_tokens_total"] == 120 * 8
    assert peak_running <= 8


async def test_two_apps_in_one_process_keep_separate_engines_and_metrics(http: httpx.AsyncClient) -> None:
    async with (
        serve_in_background(preset("fast", model="a")) as a,
        serve_in_background(preset("fast", model="b")) as b,
    ):
        await sdk(a).completions.create(model="a", prompt="p", max_tokens=3)
        stats_a, stats_b = await stats(http, a), await stats(http, b)
        metrics_b = (await http.get(b + "/metrics")).text

    assert (stats_a["generation_tokens_total"], stats_b["generation_tokens_total"]) == (3, 0)
    assert 'vllm:generation_tokens_total{model_name="b"} 0.0' in metrics_b


def test_command_line_flags_override_the_preset() -> None:
    import argparse

    parser = argparse.ArgumentParser()
    configure_parser(parser)
    args = parser.parse_args(
        [
            "--preset",
            "fast",
            "--max-num-seqs",
            "3",
            "--base-step-ms",
            "2",
            "--fail-first",
            "1",
            "--model",
            "m",
        ]
    )

    params = params_from_args(args)

    assert isinstance(params, SimParams)
    assert (params.max_num_seqs, params.base_step_s, params.fail_first, params.model) == (3, 0.002, 1, "m")
    assert params.per_seq_s == FAST.per_seq_s
    assert "capacity" in parser.format_help()


async def test_sluice_sim_command_prints_where_it_listens_and_serves(http: httpx.AsyncClient) -> None:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sluice.cli",
        "sim",
        "--preset",
        "fast",
        "--port",
        "0",
        stdout=asyncio.subprocess.PIPE,
    )
    try:
        assert proc.stdout is not None
        line = (await asyncio.wait_for(proc.stdout.readline(), timeout=30)).decode()
        base = line.split("listening on ")[1].split()[0]
        health = await http.get(base + "/health")
        reply = await sdk(base).completions.create(model="sim", prompt="p", max_tokens=2)
    finally:
        proc.send_signal(signal.SIGINT)
        code = await asyncio.wait_for(proc.wait(), timeout=10)

    assert "req/s" in line
    assert health.status_code == 200
    assert reply.choices[0].text == tokens(2)
    assert code == 0
