"""The load of :mod:`sluice.bench.overhead`: a closed loop of keep-alive connections, each sending
one request and the next as soon as the answer is whole, and the measured window, with the CPU
time of every process read at its two ends.

The load generator is a minimal HTTP/1.1 client on uvloop (0.1-0.3 ms of CPU per request), so that
the client is not what limits a row. :func:`client_requests` puts an HTTP client library in its
place, to measure what that library costs per request (the ``clients`` group).
"""

from __future__ import annotations

import asyncio
import functools
import json
import os
import time
from collections.abc import Awaitable, Callable, Coroutine, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, NamedTuple, cast
from urllib.parse import urlsplit

import httpx

from sluice.core.job import Endpoint, Job
from sluice.sim.model import token_text

MODEL = "sim"
# Every generated token's text starts with this (" tok0", " tok1", ...): counting it in the bytes
# received counts the tokens, streamed or not, without decoding JSON in the load generator.
TOKEN_MARK = token_text(0).rstrip("0").encode()
CLK_TCK = os.sysconf("SC_CLK_TCK") if hasattr(os, "sysconf") else 100
#: The client libraries of the ``clients`` group: httpx set up as the gateway's engine client was
#: until it moved to aiohttp, aiohttp alone, and the gateway's engine client itself.
CLIENTS = ("httpx", "aiohttp", "sluice")
#: The engine's slots in the ``clients`` group (httpx keeps as many connections alive).
CLIENT_SLOTS = 256


# -- CPU accounting --------------------------------------------------------------------------------


def _stat_fields(pid: int) -> list[str] | None:
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    # The command name is in parentheses and may hold spaces: the fields start after the last ')'.
    return text[text.rindex(")") + 2 :].split()


def _children() -> dict[int, list[int]]:
    """Parent pid -> child pids, of every process now running."""
    tree: dict[int, list[int]] = {}
    for entry in os.listdir("/proc"):
        if entry.isdigit() and (fields_ := _stat_fields(int(entry))) is not None:
            tree.setdefault(int(fields_[1]), []).append(int(entry))
    return tree


def cpu_seconds(pids: Sequence[int]) -> float | None:
    """User + system CPU seconds of these processes and all their descendants; None without /proc."""
    if not Path("/proc/self/stat").exists():
        return None
    tree, total, todo = _children(), 0, list(pids)
    while todo:
        pid = todo.pop()
        stat = _stat_fields(pid)
        if stat is not None:
            total += int(stat[11]) + int(stat[12])  # utime, stime (fields 14 and 15)
        todo.extend(tree.get(pid, ()))
    return total / CLK_TCK


def _own_cpu_seconds() -> float:
    times = os.times()
    return times.user + times.system


# -- the load ---------------------------------------------------------------------------------------


@dataclass(frozen=True, slots=True)
class Load:
    """What every connection of a closed loop sends, over and over.

    ``connections``: how many keep-alive connections, each with one request in flight at a time.
    ``max_tokens``: the answer's length in tokens (the simulator always produces all of them).
    ``stream``: whether the answer is streamed (SSE) or comes whole.
    """

    connections: int
    max_tokens: int
    stream: bool


def request_bytes(url: str, load: Load) -> bytes:
    """The whole HTTP/1.1 request, built once: the load generator writes it as it is."""
    parts = urlsplit(url)
    body = json.dumps(
        {
            "model": MODEL,
            "messages": [{"role": "user", "content": "Say hello."}],
            "max_tokens": load.max_tokens,
            "stream": load.stream,
        }
    ).encode()
    head = (
        f"POST {parts.path.rstrip('/')}/v1/chat/completions HTTP/1.1\r\nHost: {parts.netloc}\r\n"
        f"Content-Type: application/json\r\nContent-Length: {len(body)}\r\n\r\n"
    )
    return head.encode() + body


class Reply(NamedTuple):
    """One whole answer as the load generator saw it.

    ``status``: the HTTP status. ``tokens``: generated tokens in the body. ``first_token``: the
    ``perf_counter`` time the first token arrived, if any did. ``close``: the server asked to
    close the connection.
    """

    status: int
    tokens: int
    first_token: float | None
    close: bool


class _Client(asyncio.Protocol):
    """One keep-alive HTTP/1.1 connection: one request at a time, Content-Length or chunked answers."""

    def __init__(self) -> None:
        self._transport: asyncio.Transport | None = None
        self._buffer = bytearray()
        self._reply: asyncio.Future[Reply] | None = None
        self._lost = False
        self._start_reply()

    def _start_reply(self) -> None:
        self._status = 0
        self._in_body = False
        self._length: int | None = None
        self._chunked = False
        self._close = False
        self._tokens = 0
        self._first: float | None = None
        self._tail = b""

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        # uvloop's transports are not subclasses of asyncio's, only alike.
        self._transport = cast(asyncio.Transport, transport)

    def connection_lost(self, exc: Exception | None) -> None:
        self._lost = True
        if self._reply is not None and not self._reply.done():
            self._reply.set_exception(ConnectionError("the server closed the connection"))

    def data_received(self, data: bytes) -> None:
        self._buffer += data
        try:
            self._parse()
        except ValueError as exc:
            if self._reply is not None and not self._reply.done():
                self._reply.set_exception(ConnectionError(f"unreadable answer: {exc}"))
            assert self._transport is not None
            self._transport.close()

    def exchange(self, request: bytes) -> asyncio.Future[Reply]:
        if self._lost or self._transport is None:
            raise ConnectionError("the connection is closed")
        self._reply = asyncio.get_running_loop().create_future()
        self._transport.write(request)
        return self._reply

    def close(self) -> None:
        if self._transport is not None:
            self._transport.close()

    def _body(self, piece: bytes) -> None:
        # A token's mark may straddle two pieces: count it in the last few bytes kept from before.
        text = self._tail + piece
        found = text.count(TOKEN_MARK)
        if found and self._first is None:
            self._first = time.perf_counter()
        self._tokens += found
        self._tail = text[-(len(TOKEN_MARK) - 1) :]

    def _finish(self) -> None:
        reply = Reply(self._status, self._tokens, self._first, self._close)
        self._start_reply()
        if self._reply is not None and not self._reply.done():
            self._reply.set_result(reply)

    def _parse(self) -> None:
        buffer = self._buffer
        while True:
            if not self._in_body:
                end = buffer.find(b"\r\n\r\n")
                if end < 0:
                    return
                lines = bytes(buffer[:end]).split(b"\r\n")
                del buffer[: end + 4]
                self._status = int(lines[0].split()[1])
                for line in lines[1:]:
                    name, _, value = line.partition(b":")
                    name, value = name.strip().lower(), value.strip().lower()
                    if name == b"content-length":
                        self._length = int(value)
                    elif name == b"transfer-encoding":
                        self._chunked = b"chunked" in value
                    elif name == b"connection":
                        self._close = value == b"close"
                self._in_body = True
            elif not self._chunked:
                length = self._length or 0
                if len(buffer) < length:
                    return
                self._body(bytes(buffer[:length]))
                del buffer[:length]
                self._finish()
            else:
                line_end = buffer.find(b"\r\n")
                if line_end < 0:
                    return
                size = int(bytes(buffer[:line_end]).split(b";")[0], 16)
                if len(buffer) < line_end + 2 + size + 2:
                    return
                piece = bytes(buffer[line_end + 2 : line_end + 2 + size])
                del buffer[: line_end + 2 + size + 2]  # no trailers: none of these servers sends any
                if size:
                    self._body(piece)
                else:
                    self._finish()


@dataclass(slots=True)
class Tally:
    """What the load got back inside the measured window.

    ``answered``: latencies (seconds) of 200 answers. ``refused``: latencies of 429 and 503
    answers (the gateway's refusals). ``ttft``: times from sending to the first token, of the
    answers that had one. ``tokens``: tokens received in answers. ``errors``: other statuses,
    dropped connections and failed connects.
    """

    answered: list[float] = field(default_factory=list)
    refused: list[float] = field(default_factory=list)
    ttft: list[float] = field(default_factory=list)
    tokens: int = 0
    errors: int = 0


async def _connection(url: str, load: Load, tally: Tally, window: list[float]) -> None:
    """One connection of the closed loop, until cancelled; records what ends inside ``window``."""
    loop = asyncio.get_running_loop()
    parts = urlsplit(url)
    host, port = parts.hostname or "127.0.0.1", parts.port or 80
    request = request_bytes(url, load)
    while True:
        client: _Client | None = None
        try:
            _, client = await loop.create_connection(_Client, host, port)
            while True:
                start = time.perf_counter()
                reply = await client.exchange(request)
                end = time.perf_counter()
                if window[0] <= end < window[1]:
                    if reply.status == 200:
                        tally.answered.append(end - start)
                        tally.tokens += reply.tokens
                        if reply.first_token is not None:
                            tally.ttft.append(reply.first_token - start)
                    elif reply.status in (429, 503):
                        tally.refused.append(end - start)
                    else:
                        tally.errors += 1
                if reply.close:
                    break
        except OSError:  # ConnectionError included: count it and connect again
            if window[0] <= time.perf_counter() < window[1]:
                tally.errors += 1
            await asyncio.sleep(0.01)
        finally:
            if client is not None:
                client.close()


class Window(NamedTuple):
    """One measured window: the load's tally, its length, and CPU seconds per role at its two ends."""

    tally: Tally
    seconds: float
    cpu_before: dict[str, float | None]
    cpu_after: dict[str, float | None]


Worker = Callable[[Tally, list[float]], Coroutine[Any, Any, None]]


async def _windowed(
    workers: Sequence[Worker], warmup_s: float, seconds: float, roles: dict[str, list[int]]
) -> Window:
    """Run ``workers`` (each records into the tally what ends inside the window) and measure a window."""
    tally = Tally()
    window = [float("inf"), float("inf")]
    tasks = [asyncio.create_task(worker(tally, window)) for worker in workers]
    try:
        await asyncio.sleep(warmup_s)
        before = _snapshot(roles)
        window[0] = time.perf_counter()
        await asyncio.sleep(seconds)
        window[1] = time.perf_counter()
        after = _snapshot(roles)
    finally:
        for task in tasks:
            task.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
    return Window(tally, window[1] - window[0], before, after)


def _snapshot(roles: dict[str, list[int]]) -> dict[str, float | None]:
    cpu: dict[str, float | None] = {role: cpu_seconds(pids) for role, pids in roles.items()}
    cpu["load"] = _own_cpu_seconds()
    return cpu


def _new_loop() -> asyncio.AbstractEventLoop:
    try:
        import uvloop
    except ImportError:  # Windows: no uvloop; the load generator then costs more of the CPU
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


def closed_loop(
    urls: Sequence[str], load: Load, warmup_s: float, seconds: float, roles: dict[str, list[int]]
) -> Window:
    """Run the closed loop against ``urls`` (connections spread round-robin) and measure one window."""
    workers = [functools.partial(_connection, urls[i % len(urls)], load) for i in range(load.connections)]
    with asyncio.Runner(loop_factory=_new_loop) as runner:
        return runner.run(_windowed(workers, warmup_s, seconds, roles))


async def _client_requests(
    url: str, library: str, load: Load, warmup_s: float, seconds: float, roles: dict[str, list[int]]
) -> Window:
    """The closed loop with a client library in place of the load generator's own HTTP client."""
    body = json.loads(request_bytes(url, load).partition(b"\r\n\r\n")[2])
    path = "/v1/chat/completions"
    post: Callable[[], Awaitable[bytes]]
    close: Callable[[], Awaitable[None]]
    if library == "httpx":
        # As the gateway's engine client was set up before aiohttp: no pool limit.
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=CLIENT_SLOTS)
        client = httpx.AsyncClient(base_url=url, limits=limits, timeout=30.0)

        async def post() -> bytes:
            answer = await client.post(path, json=body)
            answer.raise_for_status()
            return answer.content

        close = client.aclose
    elif library == "aiohttp":
        import aiohttp

        session = aiohttp.ClientSession(url, connector=aiohttp.TCPConnector(limit=0))

        async def post() -> bytes:
            async with session.post(path, json=body) as answer:
                answer.raise_for_status()
                return await answer.read()

        close = session.close
    else:
        # The gateway's own: a whole answer through OpenAIBackend.stream, as the dispatcher asks.
        from sluice.backends.openai import OpenAIBackend

        backend = OpenAIBackend(url, max_concurrency=CLIENT_SLOTS)
        job = _client_job(body)

        async def post() -> bytes:
            chunks = [chunk async for chunk in backend.stream(job)]
            # Encoded again for the load's token count (the JSON the gateway would answer).
            return json.dumps(chunks).encode()

        close = backend.aclose

    async def worker(tally: Tally, window: list[float]) -> None:
        while True:
            start = time.perf_counter()
            try:
                text = await post()
                json.loads(text)  # the gateway reads the answer as JSON too
            except Exception:  # any library's errors: counted, and the loop goes on
                if window[0] <= time.perf_counter() < window[1]:
                    tally.errors += 1
                await asyncio.sleep(0.01)
                continue
            end = time.perf_counter()
            if window[0] <= end < window[1]:
                tally.answered.append(end - start)
                tally.ttft.append(end - start)
                tally.tokens += text.count(TOKEN_MARK)

    try:
        return await _windowed([worker] * load.connections, warmup_s, seconds, roles)
    finally:
        await close()


def _client_job(body: dict[str, Any]) -> Job:
    """A whole (not streamed) chat job of ``body``, as the gateway queues one."""
    now = time.time()
    return Job(
        id="job_bench",
        model=body["model"],
        endpoint=Endpoint.CHAT,
        body=body,
        tenant="bench",
        priority="normal",
        prompt_tokens=8,
        max_tokens=body["max_tokens"],
        created_at=now,
        deadline=now + 3600,
        stream_tokens=False,
    )


def client_requests(
    url: str, library: str, load: Load, warmup_s: float, seconds: float, roles: dict[str, list[int]]
) -> Window:
    """``load.connections`` concurrent requests through ``library``'s client (:data:`CLIENTS`) alone."""
    with asyncio.Runner(loop_factory=_new_loop) as runner:
        return runner.run(_client_requests(url, library, load, warmup_s, seconds, roles))
