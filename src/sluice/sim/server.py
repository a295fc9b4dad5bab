"""``sluice sim``: the engine model of :mod:`sluice.sim.model` behind an OpenAI-compatible HTTP API.

One asyncio task drives the engine: it plans a step, sleeps until the step's deadline on the
monotonic clock, applies the step and wakes the requests that got a token. Each HTTP exchange
watches its client while it waits, so a disconnect aborts the request inside the engine at once,
as vLLM does, and the tokens it had produced are counted as wasted.

Python API for tests: :func:`create_app` and :func:`serve_in_background`.
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import logging
import random
import socket
import sys
import time
import uuid
from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import asdict, dataclass
from typing import Any

import uvicorn
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, Metric
from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route
from starlette.types import Receive, Scope, Send

from sluice.sim.model import (
    PRESET_NOTES,
    PRESETS,
    REFERENCE_COMPLETION_TOKENS,
    REFERENCE_PROMPT_TOKENS,
    BatchModel,
    SimParams,
    SimRequest,
    StepResult,
    capacity_rps,
    estimate_chat_tokens,
    estimate_text_tokens,
    lone_latency_s,
    prefix_blocks,
    prefix_blocks_of_chat,
    preset,
    token_text,
)

__all__ = ["SimService", "configure_parser", "create_app", "params_from_args", "run", "serve_in_background"]

log = logging.getLogger(__name__)

# If the host falls behind the model (tiny steps, a busy CPU), forget the debt beyond this instead
# of catching up with a burst of back-to-back steps that would starve the event loop.
_MAX_LAG_S = 0.05

# vLLM's own bucket bounds, so dashboards built for vLLM read the simulator unchanged.
_TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0)
_E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0, 120.0)


class _ApiError(Exception):
    def __init__(self, status: int, message: str, code: str, param: str | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param

    def response(self) -> JSONResponse:
        kind = "invalid_request_error" if self.status < 500 else "server_error"
        return _error(self.status, self.message, kind, self.code, self.param)


def _error(status: int, message: str, kind: str, code: str, param: str | None = None) -> JSONResponse:
    body = {"error": {"message": message, "type": kind, "param": param, "code": code}}
    return JSONResponse(body, status_code=status)


@dataclass(frozen=True, slots=True)
class _Job:
    chat: bool
    prompt_tokens: int
    max_tokens: int
    stream: bool
    include_usage: bool
    blocks: tuple[int, ...] = ()


def _message_text(message: object, index: int) -> str:
    if not isinstance(message, dict) or not isinstance(message.get("role"), str):
        raise _ApiError(400, f"messages[{index}] must be an object with a string 'role'", "invalid_value")
    content = message.get("content")
    if content is None or isinstance(content, str):
        return content or ""
    if isinstance(content, list):
        parts = [p.get("text") for p in content if isinstance(p, dict)]
        return "".join(p for p in parts if isinstance(p, str))
    raise _ApiError(400, f"messages[{index}].content must be a string or a list of parts", "invalid_value")


def _prompt_tokens(data: dict[str, Any], chat: bool) -> int:
    if chat:
        messages = data.get("messages")
        if messages is None:
            raise _ApiError(400, "'messages' is required", "missing_required_parameter", "messages")
        if not isinstance(messages, list) or not messages:
            raise _ApiError(400, "'messages' must be a non-empty list", "invalid_value", "messages")
        return estimate_chat_tokens([_message_text(m, i) for i, m in enumerate(messages)])
    if "prompt" not in data or data["prompt"] is None:
        raise _ApiError(400, "'prompt' is required", "missing_required_parameter", "prompt")
    prompt = data["prompt"]
    # A batch of prompts would need several choices; one prompt, as text or token ids, is enough here.
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    if isinstance(prompt, str):
        return estimate_text_tokens(prompt)
    if isinstance(prompt, list) and prompt and all(type(t) is int for t in prompt):
        return len(prompt)
    raise _ApiError(400, "'prompt' must be a string or a list of token ids", "invalid_value", "prompt")


def _prompt_blocks(
    data: dict[str, Any], chat: bool, prompt_tokens: int, params: SimParams
) -> tuple[int, ...]:
    """The prompt's chained block hashes for the prefix cache (called once the prompt is valid)."""
    size = params.prefix_block_tokens
    if chat:
        pairs = [(m["role"], _message_text(m, i)) for i, m in enumerate(data["messages"])]
        return prefix_blocks_of_chat(pairs, prompt_tokens, size)
    prompt = data["prompt"]
    if isinstance(prompt, list) and len(prompt) == 1 and isinstance(prompt[0], str | list):
        prompt = prompt[0]
    return prefix_blocks(prompt, prompt_tokens, size)


def _parse_job(body: bytes, *, chat: bool, params: SimParams) -> _Job:
    try:
        data = json.loads(body)
    except (ValueError, UnicodeDecodeError):
        raise _ApiError(400, "request body is not valid JSON", "invalid_json") from None
    if not isinstance(data, dict):
        raise _ApiError(400, "request body must be a JSON object", "invalid_json")
    prompt_tokens = _prompt_tokens(data, chat)

    name = "max_completion_tokens" if chat and data.get("max_completion_tokens") is not None else "max_tokens"
    max_tokens = data.get(name)
    if max_tokens is not None and (type(max_tokens) is not int or max_tokens < 1):
        raise _ApiError(400, f"'{name}' must be a positive integer", "invalid_value", name)
    stream = data.get("stream")
    if stream is not None and not isinstance(stream, bool):
        raise _ApiError(400, "'stream' must be a boolean", "invalid_value", "stream")
    options = data.get("stream_options")
    if options is not None and (not isinstance(options, dict) or not stream):
        raise _ApiError(400, "'stream_options' is an object allowed only with stream=true", "invalid_value")
    include_usage = bool(options and options.get("include_usage"))
    if data.get("n") not in (None, 1):
        raise _ApiError(400, "the simulator supports n=1 only", "invalid_value", "n")

    room = params.max_model_len - prompt_tokens
    if max_tokens is None:
        # Like vLLM, an absent limit shrinks to what the context has left rather than failing.
        max_tokens = min(params.default_max_tokens, room)
    if max_tokens > room or max_tokens < 1:
        raise _ApiError(
            400,
            f"This model's maximum context length is {params.max_model_len} tokens. However, you "
            f"requested {prompt_tokens + max_tokens} tokens ({prompt_tokens} in the "
            f"{'messages' if chat else 'prompt'}, {max_tokens} in the completion). Please reduce the "
            "length of the messages or completion.",
            "context_length_exceeded",
            "messages" if chat else "prompt",
        )
    blocks = _prompt_blocks(data, chat, prompt_tokens, params) if params.prefix_cache_tokens > 0 else ()
    return _Job(chat, prompt_tokens, max_tokens, bool(stream), include_usage, blocks)


class _EngineCollector:
    """Reads the engine's counters at scrape time, so they are kept in exactly one place."""

    def __init__(self, service: SimService) -> None:
        self._service = service

    def collect(self) -> Iterable[Metric]:
        engine, model = self._service.engine, self._service.params.model
        stats = engine.stats

        def gauge(name: str, doc: str, value: float) -> Metric:
            g = GaugeMetricFamily(name, doc, labels=["model_name"])
            g.add_metric([model], value)
            return g

        def counter(name: str, doc: str, value: float) -> Metric:
            c = CounterMetricFamily(name, doc, labels=["model_name"])
            c.add_metric([model], value)
            return c

        yield gauge("vllm:num_requests_running", "Requests in the running batch.", engine.num_running)
        yield gauge("vllm:num_requests_waiting", "Requests waiting to be admitted.", engine.num_waiting)
        yield gauge("vllm:gpu_cache_usage_perc", "KV cache usage, 0 to 1.", engine.kv_usage)
        yield gauge("vllm:kv_cache_usage_perc", "KV cache usage, 0 to 1.", engine.kv_usage)
        yield counter("vllm:prompt_tokens", "Prompt tokens prefilled.", stats.prompt_tokens_total)
        yield counter("vllm:generation_tokens", "Tokens generated.", stats.generation_tokens_total)
        yield counter("vllm:num_preemptions", "Preemptions by recompute.", stats.preemptions_total)
        success = CounterMetricFamily(
            "vllm:request_success", "Requests finished.", labels=["model_name", "finished_reason"]
        )
        success.add_metric([model, "length"], stats.finished_total)
        yield success
        yield counter(
            "sim:wasted_generation_tokens",
            "Tokens generated for requests that were aborted before finishing.",
            stats.wasted_generation_tokens_total,
        )
        yield counter("sim:aborted_requests", "Requests aborted (client disconnect).", stats.aborted_total)
        yield counter(
            "sim:recomputed_prefill_tokens",
            "Prefill tokens computed again after preemption.",
            stats.recomputed_prefill_tokens_total,
        )
        yield counter(
            "vllm:prefix_cache_queries",
            "Prompt tokens looked up in the prefix cache (0 while it is off).",
            stats.prefix_cache_queries_total,
        )
        yield counter(
            "vllm:prefix_cache_hits",
            "Prompt tokens found in the prefix cache, not prefilled.",
            stats.prefix_cache_hits_total,
        )
        yield counter("sim:engine_busy_seconds", "Simulated engine time spent in steps.", stats.busy_s_total)
        yield counter("sim:injected_faults", "Requests answered with an injected 500.", self._service.faults)


class SimService:
    """The state behind one app: the engine, its driver task, the waiting exchanges, the metrics."""

    def __init__(self, params: SimParams) -> None:
        self.params = params
        self.engine = BatchModel(params)
        self.faults = 0
        self.registry = CollectorRegistry(auto_describe=True)
        self.registry.register(_EngineCollector(self))
        self._ttft = Histogram(
            "vllm:time_to_first_token_seconds",
            "Time to first token.",
            ["model_name"],
            registry=self.registry,
            buckets=_TTFT_BUCKETS,
        ).labels(params.model)
        self._e2e = Histogram(
            "vllm:e2e_request_latency_seconds",
            "End-to-end latency of finished requests.",
            ["model_name"],
            registry=self.registry,
            buckets=_E2E_BUCKETS,
        ).labels(params.model)
        self._completions_seen = 0
        self._rng = random.Random(params.seed)
        # request id -> (wake-up event, whether the exchange wants every token or only the end)
        self._waiters: dict[str, tuple[asyncio.Event, bool]] = {}
        self._work = asyncio.Event()
        self.closing = asyncio.Event()
        self._driver: asyncio.Task[None] | None = None

    # -- engine driver ---------------------------------------------------------------------------

    def _ensure_driver(self) -> None:
        if self._driver is None or self._driver.done():
            self._driver = asyncio.get_running_loop().create_task(self._drive(), name="sim-engine")

    async def _drive(self) -> None:
        loop = asyncio.get_running_loop()
        deadline = loop.time()
        try:
            while True:
                duration = self.engine.next_step_duration()
                if duration is None:
                    self._work.clear()
                    await self._work.wait()
                    deadline = loop.time()
                    continue
                now = loop.time()
                deadline = max(deadline, now - _MAX_LAG_S) + duration
                # Always await, even when late, so that streams get to send between steps.
                await asyncio.sleep(max(0.0, deadline - now))
                self._deliver(self.engine.step(loop.time()))
        except Exception:
            log.exception("simulated engine crashed; it restarts with the next request")
            raise

    def _deliver(self, result: StepResult) -> None:
        for req in result.emitted:
            waiter = self._waiters.get(req.request_id)
            if waiter is not None and waiter[1]:
                waiter[0].set()
        for req in result.finished:
            assert req.first_token_at is not None and req.finished_at is not None
            self._ttft.observe(req.first_token_at - req.arrival)
            self._e2e.observe(req.finished_at - req.arrival)
            waiter = self._waiters.get(req.request_id)
            if waiter is not None:
                waiter[0].set()

    async def aclose(self) -> None:
        self.closing.set()
        if self._driver is not None:
            self._driver.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await self._driver

    # -- requests --------------------------------------------------------------------------------

    def _injected_fault(self) -> Response | None:
        self._completions_seen += 1
        if self._completions_seen <= self.params.fail_first:
            why = f"injected fault: request {self._completions_seen} of the first {self.params.fail_first}"
        elif self.params.error_rate > 0 and self._rng.random() < self.params.error_rate:
            why = f"injected fault: random error at rate {self.params.error_rate}"
        else:
            return None
        self.faults += 1
        return _error(500, why, "server_error", "injected_fault")

    async def completions(self, request: Request, *, chat: bool) -> Response | _Exchange:
        try:
            job = _parse_job(await request.body(), chat=chat, params=self.params)
        except _ApiError as exc:
            return exc.response()
        if self.closing.is_set():
            return _error(503, "the simulator is shutting down", "server_error", "shutting_down")
        fault = self._injected_fault()
        if fault is not None:
            return fault
        request_id = uuid.uuid4().hex
        handle = self.engine.submit(
            request_id, job.prompt_tokens, job.max_tokens, asyncio.get_running_loop().time(), job.blocks
        )
        self._waiters[request_id] = (asyncio.Event(), job.stream)
        self._ensure_driver()
        self._work.set()
        return _Exchange(self, handle, job)

    async def wait_tokens(self, handle: SimRequest, have: int) -> None:
        """Return once ``handle`` has more than ``have`` tokens, or is done."""
        event = self._waiters[handle.request_id][0]
        while handle.generated <= have and not handle.done:
            event.clear()
            await event.wait()

    def release(self, handle: SimRequest) -> None:
        self._waiters.pop(handle.request_id, None)
        if not handle.done:
            self.engine.abort(handle.request_id, asyncio.get_running_loop().time())

    def stats(self) -> dict[str, Any]:
        engine = self.engine
        return {
            "model": self.params.model,
            "running": engine.num_running,
            "waiting": engine.num_waiting,
            "kv_tokens_used": engine.kv_tokens_used,
            "prefix_cache_blocks": len(engine.prefix_cache),
            "injected_faults": self.faults,
            **asdict(engine.stats),
            "capacity_rps": capacity_rps(self.params),
            "params": asdict(self.params),
        }


async def _until_disconnect(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


class _Exchange:
    """The ASGI response of one completion: relays the engine's tokens while it watches the client."""

    def __init__(self, service: SimService, handle: SimRequest, job: _Job) -> None:
        self._service = service
        self._handle = handle
        self._job = job
        self._id = ("chatcmpl-" if job.chat else "cmpl-") + handle.request_id
        self._created = int(time.time())
        self._started = False

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        work = asyncio.ensure_future(self._produce(send))
        gone = asyncio.ensure_future(_until_disconnect(receive))
        closing = asyncio.ensure_future(self._service.closing.wait())
        try:
            done, _ = await asyncio.wait({work, gone, closing}, return_when=asyncio.FIRST_COMPLETED)
            if work in done:
                work.result()
            elif gone not in done:
                work.cancel()
                await asyncio.gather(work, return_exceptions=True)
                await self._end_early(scope, send)
        finally:
            for task in (work, gone, closing):
                task.cancel()
            await asyncio.gather(work, gone, closing, return_exceptions=True)
            # After a disconnect this aborts the request in the engine and counts its waste.
            self._service.release(self._handle)

    async def _end_early(self, scope: Scope, send: Send) -> None:
        """The server is closing: end the response cleanly instead of leaving the client hanging."""
        if self._started:
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        else:
            response = _error(503, "the simulator is shutting down", "server_error", "shutting_down")
            await response(scope, _never_receive, send)

    def _usage(self) -> dict[str, Any]:
        prompt, completion = self._handle.prompt_tokens, self._handle.generated
        usage: dict[str, Any] = {
            "prompt_tokens": prompt,
            "completion_tokens": completion,
            "total_tokens": prompt + completion,
        }
        if self._service.params.prefix_cache_tokens > 0:
            # OpenAI's field for the prompt tokens served from its prompt cache.
            usage["prompt_tokens_details"] = {"cached_tokens": self._handle.cached_tokens}
        return usage

    def _headers(self, content_type: bytes) -> list[tuple[bytes, bytes]]:
        return [(b"content-type", content_type), (b"x-request-id", self._handle.request_id.encode())]

    async def _produce(self, send: Send) -> None:
        if self._job.stream:
            await self._produce_stream(send)
        else:
            await self._produce_whole(send)

    async def _produce_whole(self, send: Send) -> None:
        handle = self._handle
        if self._service.params.stall_after is not None:
            await asyncio.Future()  # hang until the client gives up
        await self._service.wait_tokens(handle, handle.max_tokens - 1)
        text = "".join(token_text(i) for i in range(handle.generated))
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length"}
        if self._job.chat:
            choice["message"] = {"role": "assistant", "content": text}
            kind = "chat.completion"
        else:
            choice["text"] = text
            kind = "text_completion"
        body = {
            "id": self._id,
            "object": kind,
            "created": self._created,
            "model": self._service.params.model,
            "choices": [choice],
            "usage": self._usage(),
        }
        payload = json.dumps(body).encode()
        self._started = True
        await send(
            {"type": "http.response.start", "status": 200, "headers": self._headers(b"application/json")}
        )
        await send({"type": "http.response.body", "body": payload, "more_body": False})

    def _chunk(self, choices: list[dict[str, Any]], usage: dict[str, Any] | None = None) -> bytes:
        body: dict[str, Any] = {
            "id": self._id,
            "object": "chat.completion.chunk" if self._job.chat else "text_completion",
            "created": self._created,
            "model": self._service.params.model,
            "choices": choices,
        }
        if self._job.include_usage:
            body["usage"] = usage
        return b"data: " + json.dumps(body).encode() + b"\n\n"

    def _token_chunk(self, index: int) -> bytes:
        last = index == self._handle.max_tokens - 1
        choice: dict[str, Any] = {"index": 0, "logprobs": None, "finish_reason": "length" if last else None}
        if self._job.chat:
            # The role rides on the first token, so that every chunk carries exactly one token.
            choice["delta"] = (
                {"role": "assistant", "content": token_text(0)}
                if index == 0
                else {"content": token_text(index)}
            )
        else:
            choice["text"] = token_text(index)
        return self._chunk([choice])

    async def _produce_stream(self, send: Send) -> None:
        handle, service = self._handle, self._service
        headers = [*self._headers(b"text/event-stream; charset=utf-8"), (b"cache-control", b"no-cache")]
        await send({"type": "http.response.start", "status": 200, "headers": headers})
        self._started = True
        limit = handle.max_tokens
        if service.params.stall_after is not None:
            limit = min(limit, service.params.stall_after)
        sent = 0
        while sent < limit:
            await service.wait_tokens(handle, sent)
            ready = min(handle.generated, limit)
            # One write for all tokens that are ready: a slow reader gets them in fewer syscalls.
            body = b"".join(self._token_chunk(i) for i in range(sent, ready))
            sent = ready
            await send({"type": "http.response.body", "body": body, "more_body": True})
        if sent < handle.max_tokens:
            await asyncio.Future()  # the injected stall: hang until the client gives up
        tail = self._chunk([], self._usage()) if self._job.include_usage else b""
        await send({"type": "http.response.body", "body": tail + b"data: [DONE]\n\n", "more_body": False})


async def _never_receive() -> Any:
    await asyncio.Future()


def create_app(params: SimParams | None = None) -> Starlette:
    """A fresh simulator app with its own engine and metrics registry; ``app.state.sim`` is its
    :class:`SimService`."""
    service = SimService(params if params is not None else PRESETS["article"])

    async def chat(request: Request) -> Response | _Exchange:
        return await service.completions(request, chat=True)

    async def completions(request: Request) -> Response | _Exchange:
        return await service.completions(request, chat=False)

    async def models(request: Request) -> Response:
        card = {
            "id": service.params.model,
            "object": "model",
            "created": int(time.time()),
            "owned_by": "sluice-sim",
            "max_model_len": service.params.max_model_len,
        }
        return JSONResponse({"object": "list", "data": [card]})

    async def health(request: Request) -> Response:
        return JSONResponse({"status": "ok"})

    async def metrics(request: Request) -> Response:
        return Response(generate_latest(service.registry), media_type=CONTENT_TYPE_LATEST)

    async def stats(request: Request) -> Response:
        return JSONResponse(service.stats())

    async def http_error(request: Request, exc: Exception) -> Response:
        assert isinstance(exc, HTTPException)
        code = "not_found" if exc.status_code == 404 else "http_error"
        return _error(exc.status_code, str(exc.detail), "invalid_request_error", code)

    async def crash(request: Request, exc: Exception) -> Response:
        return _error(500, f"simulator bug: {exc!r}", "server_error", "internal_error")

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        try:
            yield
        finally:
            await service.aclose()

    app = Starlette(
        routes=[
            Route("/v1/chat/completions", chat, methods=["POST"]),
            Route("/v1/completions", completions, methods=["POST"]),
            Route("/v1/models", models, methods=["GET"]),
            Route("/health", health, methods=["GET"]),
            Route("/metrics", metrics, methods=["GET"]),
            Route("/sim/stats", stats, methods=["GET"]),
        ],
        exception_handlers={HTTPException: http_error, Exception: crash},
        lifespan=lifespan,
    )
    app.state.sim = service
    return app


class _EmbeddedServer(uvicorn.Server):
    def __init__(self, config: uvicorn.Config) -> None:
        super().__init__(config)
        self._stop = asyncio.Event()

    def stop(self) -> None:
        self.should_exit = True
        self._stop.set()

    # Signals belong to whoever owns the process (pytest, an application), not to a helper server.
    @contextlib.contextmanager
    def capture_signals(self) -> Iterator[None]:
        yield

    async def main_loop(self) -> None:
        # uvicorn's loop, except that stop() wakes it at once instead of at the next 0.1 s tick:
        # tests start and stop many servers.
        counter = 0
        while not await self.on_tick(counter):
            counter = (counter + 1) % 864_000
            with contextlib.suppress(TimeoutError):
                async with asyncio.timeout(0.1):
                    await self._stop.wait()


def _bind(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    # An explicit protocol number matters: asyncio sets TCP_NODELAY on accepted sockets only when
    # it sees IPPROTO_TCP, and without it small responses wait ~40 ms for delayed ACKs.
    sock = socket.socket(family, socket.SOCK_STREAM, socket.IPPROTO_TCP)
    try:
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        sock.bind((host, port))
        sock.listen(2048)
        sock.setblocking(False)
    except BaseException:
        sock.close()
        raise
    return sock


def _base_url(host: str, sock: socket.socket) -> str:
    port = sock.getsockname()[1]
    return f"http://[{host}]:{port}" if ":" in host else f"http://{host}:{port}"


@contextlib.asynccontextmanager
async def serve_in_background(
    params: SimParams | None = None, host: str = "127.0.0.1", port: int = 0
) -> AsyncIterator[str]:
    """Serve a fresh simulator from the current event loop; yields its base URL (no ``/v1``).

    ``port=0`` picks a free port. On exit, open responses are ended and the server shuts down.
    """
    app = create_app(params)
    service: SimService = app.state.sim
    sock = _bind(host, port)
    config = uvicorn.Config(app, log_level="warning", access_log=False, timeout_graceful_shutdown=5)
    server = _EmbeddedServer(config)
    task = asyncio.create_task(server.serve(sockets=[sock]), name="sim-server")
    try:
        async with asyncio.timeout(10):
            while not server.started:
                if task.done():
                    task.result()
                    raise RuntimeError("the simulator's server stopped during start-up")
                await asyncio.sleep(0.005)
        yield _base_url(host, sock)
    finally:
        service.closing.set()
        server.stop()
        try:
            async with asyncio.timeout(10):
                await task
        except TimeoutError:
            server.force_exit = True
            task.cancel()
            await asyncio.gather(task, return_exceptions=True)
        sock.close()


# -- command line --------------------------------------------------------------------------------


def _preset_help() -> str:
    lines = ["presets (capacity for 128-token answers to 32-token prompts, with every slot busy):"]
    for name, p in PRESETS.items():
        lines.append(f"  {name}: {PRESET_NOTES[name]}")
        lines.append(
            f"    max_num_seqs={p.max_num_seqs} base_step_ms={p.base_step_s * 1000:g} "
            f"per_seq_ms={p.per_seq_s * 1000:g} prefill_ms_per_token={p.prefill_s_per_token * 1000:g} "
            f"kv_cache_tokens={p.kv_cache_tokens} max_model_len={p.max_model_len}"
        )
        lines.append(f"    capacity {capacity_rps(p):.2f} req/s, lone answer {lone_latency_s(p):.3f} s")
    lines.append(
        "capacity = S / (N * (base + per_seq * S) + S * prefill_per_token * P), "
        "S = max_num_seqs, N = answer tokens, P = prompt tokens"
    )
    return "\n".join(lines)


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = _preset_help()
    parser.add_argument("--host", default="127.0.0.1", help="address to listen on (default %(default)s)")
    parser.add_argument(
        "--port", type=int, default=8100, help="port; 0 picks a free one (default %(default)s)"
    )
    parser.add_argument("--model", default="sim", help="served model name (default %(default)s)")
    parser.add_argument(
        "--preset",
        choices=list(PRESETS),
        default="article",
        help="engine preset, listed below (default %(default)s)",
    )
    group = parser.add_argument_group("engine (each overrides the preset)")
    group.add_argument("--max-num-seqs", type=int, help="sequences in the running batch at most")
    group.add_argument("--base-step-ms", type=float, help="fixed cost of one engine step")
    group.add_argument("--per-seq-ms", type=float, help="cost of one step per running sequence")
    group.add_argument("--prefill-ms-per-token", type=float, help="cost of prefill per admitted token")
    group.add_argument("--kv-cache-tokens", type=int, help="KV cache size in tokens")
    group.add_argument("--max-model-len", type=int, help="prompt + max_tokens cap (larger: 400)")
    group.add_argument("--default-max-tokens", type=int, help="max_tokens when a request has none")
    group.add_argument(
        "--prefix-cache-tokens",
        type=int,
        help="prefix cache size in tokens, LRU over 16-token prompt blocks (default 0: off)",
    )
    group.add_argument("--prefix-block-tokens", type=int, help="tokens per prefix-cache block (16)")
    faults = parser.add_argument_group("fault injection")
    faults.add_argument("--fail-first", type=int, default=0, help="answer the first N completions with 500")
    faults.add_argument("--error-rate", type=float, default=0.0, help="answer this fraction with 500")
    faults.add_argument("--stall-after", type=int, help="stream K tokens, then hang until the client leaves")
    faults.add_argument("--seed", type=int, default=0, help="seed of --error-rate (default %(default)s)")
    parser.add_argument(
        "--log-level",
        default="warning",
        choices=["debug", "info", "warning", "error"],
        help="server log level (default %(default)s)",
    )


def params_from_args(args: argparse.Namespace) -> SimParams:
    """The preset named by ``args.preset`` with the command line's overrides; ``ValueError`` if invalid."""
    overrides: dict[str, Any] = {
        "model": args.model,
        "fail_first": args.fail_first,
        "error_rate": args.error_rate,
        "stall_after": args.stall_after,
        "seed": args.seed,
    }
    for flag, name, scale in (
        ("max_num_seqs", "max_num_seqs", None),
        ("base_step_ms", "base_step_s", 1000.0),
        ("per_seq_ms", "per_seq_s", 1000.0),
        ("prefill_ms_per_token", "prefill_s_per_token", 1000.0),
        ("kv_cache_tokens", "kv_cache_tokens", None),
        ("max_model_len", "max_model_len", None),
        ("default_max_tokens", "default_max_tokens", None),
        ("prefix_cache_tokens", "prefix_cache_tokens", None),
        ("prefix_block_tokens", "prefix_block_tokens", None),
    ):
        value = getattr(args, flag)
        if value is not None:
            overrides[name] = value / scale if scale else value
    return preset(args.preset, **overrides)


def run(args: argparse.Namespace) -> int:
    try:
        params = params_from_args(args)
        sock = _bind(args.host, args.port)
    except (ValueError, OSError) as exc:
        print(f"sluice sim: {exc}", file=sys.stderr)
        return 2
    print(
        f"sluice sim: listening on {_base_url(args.host, sock)} (model {params.model!r}, preset "
        f"{args.preset}, {params.max_num_seqs} seqs): capacity {capacity_rps(params):.2f} req/s for "
        f"{REFERENCE_COMPLETION_TOKENS}-token answers ({REFERENCE_PROMPT_TOKENS}-token prompts), "
        f"lone answer {lone_latency_s(params):.2f} s"
        + (f", prefix cache {params.prefix_cache_tokens} tokens" if params.prefix_cache_tokens else ""),
        flush=True,
    )
    config = uvicorn.Config(create_app(params), log_level=args.log_level, timeout_graceful_shutdown=2)
    try:
        uvicorn.Server(config).run(sockets=[sock])
    except KeyboardInterrupt:
        pass
    finally:
        sock.close()
    return 0
