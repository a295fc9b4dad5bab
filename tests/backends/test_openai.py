"""OpenAIBackend on its own: addresses, and how each kind of failure is classed (retryable or not)."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import gc
import itertools
import json
import warnings
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest
from fastapi import FastAPI, Request
from fastapi.responses import JSONResponse, PlainTextResponse, Response, StreamingResponse

from sluice.backends.base import BackendError
from sluice.backends.openai import OpenAIBackend
from sluice.core.job import Endpoint
from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.backends.conformance import MODES, SHORT, assemble, engine_job
from tests.helpers import free_port
from tests.servers import run_app


def test_the_url_may_name_v1_or_not() -> None:
    for url in ("http://127.0.0.1:9/v1", "http://127.0.0.1:9/v1/", "http://127.0.0.1:9/"):
        backend = OpenAIBackend(url)
        assert backend.url == backend.name == "http://127.0.0.1:9"
    assert OpenAIBackend("http://127.0.0.1:9", name="gpu-1").name == "gpu-1"


@MODES
async def test_a_dead_port_is_a_retryable_error(stream_tokens: bool) -> None:
    backend = OpenAIBackend(f"http://127.0.0.1:{free_port()}", connect_timeout_s=1.0)
    try:
        assert not await backend.healthy()
        with pytest.raises(BackendError) as listing:
            await backend.discover_models()
        assert listing.value.retryable
        job = engine_job("m", Endpoint.CHAT, max_tokens=SHORT, stream_tokens=stream_tokens)
        with pytest.raises(BackendError) as running:
            await assemble(backend, job)
        assert running.value.retryable and running.value.status is None
        # Nothing listened: the engine never saw the request, so it is not one of the job's attempts.
        assert not running.value.reached
    finally:
        await backend.aclose()


@MODES
async def test_an_engine_error_is_retryable_and_the_next_request_succeeds(stream_tokens: bool) -> None:
    async with serve_in_background(preset("fast", model="sim", fail_first=1)) as url:
        backend = OpenAIBackend(url)
        try:
            job = engine_job("sim", Endpoint.CHAT, max_tokens=SHORT, stream_tokens=stream_tokens)
            with pytest.raises(BackendError) as info:
                await assemble(backend, job)
            assert info.value.retryable and info.value.status == 500
            assert "injected fault" in info.value.message
            assembler, _ = await assemble(backend, job)
            assert assembler.final_usage()["completion_tokens"] == SHORT
        finally:
            await backend.aclose()


# Answers no real engine can be made to give on demand: a loopback engine whose every answer a
# test's handler gives (the path asked and the body sent -> the response).
Handler = Callable[[str, bytes], Response]


@contextlib.asynccontextmanager
async def _mocked(handler: Handler) -> AsyncIterator[OpenAIBackend]:
    app = FastAPI()

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def anything(request: Request) -> Response:
        return handler(request.url.path, await request.body())

    async with run_app(app) as url:
        backend = OpenAIBackend(url)
        try:
            yield backend
        finally:
            await backend.aclose()


def _json(status: int, body: Any) -> Response:
    return JSONResponse(body, status_code=status)


def _sse(*payloads: str) -> Response:
    body = "".join(f"data: {p}\n\n" for p in payloads)
    return Response(body, media_type="text/event-stream")


@pytest.mark.parametrize(
    ("status", "retryable"),
    [(400, False), (404, False), (413, False), (422, False)]
    + [(s, True) for s in (408, 409, 425, 429, 500, 502, 503, 504, 507)],
)
@MODES
async def test_status_codes_are_classed_by_whether_another_attempt_can_help(
    status: int, retryable: bool, stream_tokens: bool
) -> None:
    body = {"error": {"message": "engine says no", "type": "x", "code": None}}
    async with _mocked(lambda path, sent: _json(status, body)) as backend:
        job = engine_job("m", Endpoint.CHAT, max_tokens=SHORT, stream_tokens=stream_tokens)
        with pytest.raises(BackendError) as info:
            await assemble(backend, job)
        assert info.value.retryable is retryable and info.value.status == status
        assert "engine says no" in info.value.message


async def test_a_status_error_without_json_keeps_the_engines_text() -> None:
    async with _mocked(lambda path, sent: PlainTextResponse("upstream overloaded", 503)) as backend:
        job = engine_job("m", Endpoint.COMPLETIONS, max_tokens=SHORT)
        with pytest.raises(BackendError) as info:
            await assemble(backend, job)
        assert info.value.retryable and "upstream overloaded" in info.value.message


async def test_a_malformed_chunk_is_a_retryable_error() -> None:
    chunk = '{"choices": [{"index": 0, "delta": {"content": "a"}}]}'
    async with _mocked(lambda path, sent: _sse(chunk, "{not json", "[DONE]")) as backend:
        job = engine_job("m", Endpoint.CHAT, max_tokens=SHORT)
        with pytest.raises(BackendError) as info:
            await assemble(backend, job)
        assert info.value.retryable


async def test_an_error_inside_the_stream_ends_it_with_the_engines_message() -> None:
    chunk = '{"choices": [{"index": 0, "delta": {"content": "a"}}]}'
    error = '{"error": {"message": "context shifted out", "type": "server_error"}}'
    async with _mocked(lambda path, sent: _sse(chunk, error, "[DONE]")) as backend:
        job = engine_job("m", Endpoint.CHAT, max_tokens=SHORT)
        with pytest.raises(BackendError) as info:
            await assemble(backend, job)
        # Not asserted: such an error is classed not retryable whatever its type, even a
        # server_error that another engine might not have (a gap in the backend, not a contract).
        assert info.value.message == "context shifted out"


async def test_the_stream_asks_for_usage_and_the_whole_answer_drops_stream_options() -> None:
    sent: list[tuple[str, dict[str, Any]]] = []

    def handler(path: str, raw: bytes) -> Response:
        body = json.loads(raw)
        sent.append((path, body))
        if body["stream"]:
            return _sse('{"choices": [], "usage": {"prompt_tokens": 1}}', "[DONE]")
        return _json(200, {"choices": [], "usage": {"prompt_tokens": 1}})

    async with _mocked(handler) as backend:
        streamed = engine_job("m", Endpoint.CHAT, max_tokens=SHORT)
        streamed.body["stream_options"] = {"include_usage": False}
        await assemble(backend, streamed)
        whole = engine_job("m", Endpoint.COMPLETIONS, max_tokens=SHORT, stream_tokens=False)
        whole.body["stream_options"] = {"include_usage": True}
        await assemble(backend, whole)
    [(first_path, first), (second_path, second)] = sent
    assert first_path == "/v1/chat/completions" and second_path == "/v1/completions"
    assert first["stream"] is True and first["stream_options"] == {"include_usage": True}
    assert second["stream"] is False and "stream_options" not in second


@pytest.mark.parametrize("status", [400, 500, 503])
def test_an_engine_error_quoting_the_prompt_reaches_the_client_not_the_log(status: int) -> None:
    from sluice.backends.openai import _status_error

    marker = "PROMPT-MARKER-7f3a"
    body = json.dumps({"error": {"message": f"bad input: '{marker} ...'", "param": "messages"}}).encode()
    exc = _status_error(status, body)
    assert marker in exc.message  # the client hears what the engine said
    assert marker not in exc.detail and str(status) in exc.detail  # the log hears only the status


# ------------------------------------------------------------------ priority reaches the engine


@contextlib.asynccontextmanager
async def _recording_engine() -> AsyncIterator[tuple[str, list[dict[str, Any]]]]:
    """A loopback engine that keeps every request body it is sent and answers one short answer,
    streamed or whole as asked."""
    bodies: list[dict[str, Any]] = []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        body = await request.json()
        bodies.append(body)
        choice = {"index": 0, "finish_reason": "stop"}
        usage = {"prompt_tokens": 3, "completion_tokens": 1, "total_tokens": 4}
        if not body.get("stream"):
            answer = {"id": "x", "object": "chat.completion", "created": 0, "model": body["model"]}
            message = {"role": "assistant", "content": "hi"}
            return JSONResponse({**answer, "choices": [{**choice, "message": message}], "usage": usage})
        chunk = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": body["model"]}
        events = [
            {**chunk, "choices": [{**choice, "delta": {"role": "assistant", "content": "hi"}}]},
            {**chunk, "choices": [], "usage": usage},
        ]
        text = "".join(f"data: {json.dumps(e)}\n\n" for e in events) + "data: [DONE]\n\n"
        return Response(text, media_type="text/event-stream")

    async with run_app(app) as url:
        yield url, bodies


@MODES
async def test_the_priority_map_puts_the_class_in_the_body(stream_tokens: bool) -> None:
    async with _recording_engine() as (url, bodies):
        backend = OpenAIBackend(url, priority_map={"high": -10, "normal": 0})
        try:
            job = engine_job("m", Endpoint.CHAT, max_tokens=SHORT, stream_tokens=stream_tokens)
            for priority in ("high", "normal", "low"):
                await assemble(backend, dataclasses.replace(job, priority=priority))
        finally:
            await backend.aclose()
    # "low" is not in the map: it goes without a priority (the engine's default).
    assert [b.get("priority") for b in bodies] == [-10, 0, None]
    assert all(b["stream"] is stream_tokens for b in bodies)


async def test_without_a_priority_map_no_priority_is_sent() -> None:
    async with _recording_engine() as (url, bodies):
        backend = OpenAIBackend(url)
        try:
            job = engine_job("m", Endpoint.CHAT, max_tokens=SHORT)
            await assemble(backend, dataclasses.replace(job, priority="high"))
        finally:
            await backend.aclose()
    assert len(bodies) == 1 and "priority" not in bodies[0]


async def test_a_client_priority_is_replaced_by_the_map() -> None:
    async with _recording_engine() as (url, bodies):
        backend = OpenAIBackend(url, priority_map={"normal": 5})
        try:
            job = engine_job("m", Endpoint.CHAT, max_tokens=SHORT)
            job = dataclasses.replace(job, body={**job.body, "priority": -100})
            await assemble(backend, job)
        finally:
            await backend.aclose()
    assert bodies[0]["priority"] == 5


# ------------------------------------------------------------------ the HTTP connection itself


@contextlib.asynccontextmanager
async def _engine(app: FastAPI, **kwargs: Any) -> AsyncIterator[OpenAIBackend]:
    async with run_app(app) as url:
        backend = OpenAIBackend(url, **kwargs)
        try:
            yield backend
        finally:
            await backend.aclose()


CHUNK = {"id": "x", "object": "chat.completion.chunk", "created": 0, "model": "m"}


def _chunk_line(text: str) -> str:
    return "data: " + json.dumps({**CHUNK, "choices": [{"index": 0, "delta": {"content": text}}]})


@MODES
async def test_answers_reuse_one_kept_alive_connection(stream_tokens: bool) -> None:
    ports: list[int] = []
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(request: Request) -> Response:
        assert request.client is not None
        ports.append(request.client.port)
        if (await request.json())["stream"]:
            return _sse(_chunk_line("a")[6:], "[DONE]")
        message = {"index": 0, "message": {"role": "assistant", "content": "a"}, "finish_reason": "stop"}
        return _json(200, {**CHUNK, "object": "chat.completion", "choices": [message]})

    async with _engine(app) as backend:
        job = engine_job("m", Endpoint.CHAT, max_tokens=SHORT, stream_tokens=stream_tokens)
        for _ in range(3):
            assembler, _ = await assemble(backend, job)
            assert assembler.response()["choices"][0]["message"]["content"] == "a"
    assert len(ports) == 3 and len(set(ports)) == 1, "one connection, kept alive between answers"


async def test_stream_lines_cut_anywhere_with_any_line_break_are_read_whole() -> None:
    # SSE allows \n, \r\n and \r; the network may cut the stream anywhere, inside a line or a
    # line break; a line may be longer than aiohttp's own line limit (64 KiB).
    long_text = "y" * 200_000
    text = (
        _chunk_line("a") + "\r\n\r\n" + _chunk_line("b") + "\n\n" + _chunk_line("c") + "\r\r"
        ": a comment\n\n" + _chunk_line(long_text) + "\r\n\r\n" + "data: [DONE]\r\n\r\n"
    )
    cuts = [0, 3, 7, len(_chunk_line("a")) + 1, len(_chunk_line("a")) + 2, 250, 1000, 60_000, len(text)]

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat() -> Response:
        async def pieces() -> AsyncIterator[bytes]:
            for start, end in itertools.pairwise(sorted(set(cuts))):
                yield text[start:end].encode()
                await asyncio.sleep(0.005)  # each piece its own write (the test holds either way)

        return StreamingResponse(pieces(), media_type="text/event-stream")

    async with _engine(app) as backend:
        assembler, chunks = await assemble(backend, engine_job("m", Endpoint.CHAT, max_tokens=SHORT))
    assert chunks == 4
    assert assembler.response()["choices"][0]["message"]["content"] == "abc" + long_text


async def test_a_data_line_is_read_whatever_whitespace_stands_around_its_json() -> None:
    # "data: {...}" is read without a strip; every other spacing is stripped, as it always was.
    payload = _chunk_line("x")[len("data: ") :]
    lines = [
        "data: " + payload.replace('"x"', '"a"'),
        "data:" + payload.replace('"x"', '"b"'),
        "data:  " + payload.replace('"x"', '"c"') + " \t",
        "data:\t" + payload.replace('"x"', '"d"'),
        "data: " + payload.replace('"x"', '"e"') + " ",
        "data: [DONE] ",
        "data: " + payload.replace('"x"', '"never read"'),
    ]
    text = "".join(line + "\n\n" for line in lines)

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat() -> Response:
        return PlainTextResponse(text, media_type="text/event-stream")

    async with _engine(app) as backend:
        assembler, chunks = await assemble(backend, engine_job("m", Endpoint.CHAT, max_tokens=SHORT))
    assert chunks == 5
    assert assembler.response()["choices"][0]["message"]["content"] == "abcde"


@MODES
async def test_an_engine_that_stops_answering_is_a_retryable_error_not_a_deadline(
    stream_tokens: bool,
) -> None:
    # A bare TimeoutError would read as the job's own deadline in the dispatcher.
    release = asyncio.Event()
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat() -> Response:
        await release.wait()
        return _json(200, {"choices": []})

    async with _engine(app, read_timeout_s=0.3) as backend:
        try:
            job = engine_job("m", Endpoint.CHAT, max_tokens=SHORT, stream_tokens=stream_tokens)
            with pytest.raises(BackendError) as info:
                await assemble(backend, job)
        finally:
            release.set()  # before the server stops: it waits for its requests
    assert info.value.retryable and info.value.status is None
    assert info.value.reached  # the engine had the request: the try counts


async def test_a_stream_cut_off_by_the_engine_is_a_retryable_error() -> None:
    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat() -> Response:
        async def pieces() -> AsyncIterator[bytes]:
            yield (_chunk_line("a") + "\n\n").encode()
            raise RuntimeError("the engine died")  # uvicorn drops the connection mid-answer

        return StreamingResponse(pieces(), media_type="text/event-stream")

    async with _engine(app) as backend:
        with pytest.raises(BackendError) as info:
            await assemble(backend, engine_job("m", Endpoint.CHAT, max_tokens=SHORT))
    assert info.value.retryable and "the engine did not answer" in info.value.message
    assert info.value.reached  # it began answering: the try counts


async def test_the_api_key_goes_with_every_request() -> None:
    seen: list[tuple[str, str | None]] = []
    app = FastAPI()

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def anything(request: Request) -> Response:
        seen.append((request.url.path, request.headers.get("authorization")))
        if request.url.path == "/v1/models":
            return _json(200, {"data": [{"id": "m", "object": "model"}]})
        if request.url.path == "/v1/chat/completions":
            return _sse(_chunk_line("a")[6:], "[DONE]")
        return _json(404, {"error": "no"})

    async with _engine(app, api_key="sk-engine") as backend:
        assert await backend.discover_models() == ["m"]
        assert await backend.healthy()
        await assemble(backend, engine_job("m", Endpoint.CHAT, max_tokens=SHORT))
        assert await backend.engine_load() is None
    assert {path for path, _ in seen} >= {"/v1/models", "/v1/chat/completions", "/metrics", "/slots"}
    assert all(key == "Bearer sk-engine" for _, key in seen)


async def test_the_connections_open_when_first_used_and_close_without_a_warning() -> None:
    app = FastAPI()

    @app.get("/v1/models")
    async def models() -> Response:
        return _json(200, {"data": [{"id": "m"}]})

    # What earlier tests left unclosed is collected first, so that only this test's objects can
    # warn below (other tests' SDK clients leave sockets for the collector).
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        gc.collect()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        async with run_app(app) as url:
            unused = OpenAIBackend(url)
            await unused.aclose()  # never used: nothing to close
            backend = OpenAIBackend(url)
            assert await backend.healthy()
            await backend.aclose()
            # Used again after aclose (an engine that left and came back): it opens anew.
            assert await backend.healthy()
            await backend.aclose()
            del unused, backend
            gc.collect()
    assert not [w for w in caught if issubclass(w.category, ResourceWarning)]


async def test_the_environments_proxy_carries_the_requests_as_it_did_with_httpx(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # A proxy on loopback that answers in the engine's place; the engine's name does not resolve.
    asked: list[str] = []
    app = FastAPI()

    @app.api_route("/{path:path}", methods=["GET", "POST"])
    async def proxy(request: Request) -> Response:
        asked.append(f"{request.method} {request.url.path}")
        return _json(200, {"data": [{"id": "m"}]})

    async with run_app(app) as proxy_url:
        monkeypatch.setenv("HTTP_PROXY", proxy_url)
        monkeypatch.delenv("NO_PROXY", raising=False)
        monkeypatch.delenv("no_proxy", raising=False)
        backend = OpenAIBackend("http://engine.invalid:8000/v1")
        try:
            assert await backend.discover_models() == ["m"]
        finally:
            await backend.aclose()
    assert asked[0] == "GET /v1/models"  # and /props after it, as llama-server is asked


async def test_a_whole_answer_is_what_the_stream_of_a_job_that_does_not_stream_yields() -> None:
    answer = {
        "id": "x",
        "object": "chat.completion",
        "system_fingerprint": "fp",
        "choices": [{"index": 0, "message": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}],
        "usage": {"prompt_tokens": 1, "completion_tokens": 1, "total_tokens": 2},
    }
    async with _mocked(lambda path, raw: _json(200, answer)) as backend:
        assert backend.whole_answers
        job = engine_job("m", Endpoint.CHAT, max_tokens=SHORT, stream_tokens=False)
        streamed = [chunk async for chunk in backend.stream(job)]
        whole = await backend.whole(job)
    assert streamed == [whole]
    assert whole["choices"] == [
        {"index": 0, "delta": {"role": "assistant", "content": "hi"}, "finish_reason": "stop"}
    ]
    assert whole["system_fingerprint"] == "fp" and whole["usage"] == answer["usage"]
