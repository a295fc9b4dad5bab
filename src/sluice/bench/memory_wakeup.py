"""CPU per streamed token of the memory broker's live event path, in one process: a publisher
(standing for the dispatcher) publishes token events to one running job, and a reader of
``broker.events`` (standing for the relay) takes each as it comes; between two publishes the
publisher yields one turn of the event loop, as the dispatcher waits for its next engine chunk.
Reported: the process's CPU time per token (publish, the reader's wake-up, the bare turn), robust
to the machine's other load unlike a wall-clock rate. uvloop, as the gateway runs.

With ``--whole``, the whole per-token path of a streamed chat request instead, everything but the
two sockets: the engine's SSE bytes as the simulator writes them (``--per-read`` chunks in each
read, one turn of the loop between reads) read by the engine client (``OpenAIBackend.stream``),
assembled and published by a real :class:`~sluice.dispatcher.Dispatcher`, relayed by the route's
own ``openai_stream`` and :class:`~sluice.api.sse.EventStream` to the server's ``send``
(uvicorn's, over the gateway's coalescing transport) on a connection that keeps the bytes.
Reported per token: the CPU time, the Python calls (function and C-function calls, counted by a
profile hook in a second pass; a count the machine's load does not move), and a digest of the
body the client read (the job ids and times are fixed, so two trees that send the same bytes
print the same digest, however they were framed in HTTP chunks).

Usage: python -m sluice.bench.memory_wakeup [--tokens 20000] [--runs 3]
       python -m sluice.bench.memory_wakeup --whole [--tokens 20000] [--per-read 1] [--by-function N]
"""

from __future__ import annotations

import argparse
import asyncio
import hashlib
import json
import logging
import sys
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from types import FrameType
from typing import Any

import aiohttp
import uvloop
from uvicorn.protocols.http.flow_control import FlowControl
from uvicorn.protocols.http.httptools_impl import RequestResponseCycle

from sluice.api.relay import openai_stream
from sluice.api.sse import EventStream
from sluice.backends.openai import OpenAIBackend
from sluice.bench.broker_cycles import MODEL, make_job, settings
from sluice.bench.overhead_profile import function_name
from sluice.bench.token_events import EVENT
from sluice.broker.base import EventType
from sluice.broker.memory import MemoryBroker
from sluice.core.job import Endpoint, Job, JobState
from sluice.dispatcher import Dispatcher
from sluice.roles.http_limits import OneWrite

_LOG = logging.getLogger("sluice.bench.memory_wakeup")


async def per_token_us(tokens: int) -> float:
    """CPU µs per token published to and read from one running job."""
    async with MemoryBroker(settings()) as broker:
        job = make_job(0)
        await broker.admit(job)
        claimed = await broker.claim("bench", [MODEL], timeout=1.0)
        assert claimed is not None and claimed.id == job.id
        read = 0

        async def reader() -> None:
            nonlocal read
            async for _ in broker.events(job.id):
                read += 1

        reading = asyncio.create_task(reader())
        await asyncio.sleep(0)  # the reader is waiting before the first token
        start = time.process_time()
        for _ in range(tokens):
            await broker.publish(job.id, EventType.TOKEN, EVENT)
            await asyncio.sleep(0)  # the dispatcher's wait for its next chunk
        spent = time.process_time() - start
        await broker.finish(job.id, "bench", JobState.SUCCEEDED, result={}, usage={})
        await reading
        assert read >= tokens, f"the reader took {read} events of {tokens}"
        return spent / tokens * 1e6


# --- the whole per-token path (--whole) -------------------------------------------------------------

#: tokens of each job of the whole path: long, so that what each job costs once is a small share
JOB_TOKENS = 500


def engine_stream(tokens: int, per_read: int) -> list[bytes]:
    """The engine's answer as the simulator writes it (``sluice.sim.server``: json.dumps' default
    separators, the usage on every chunk), ``per_read`` chunks to a read."""
    chunks = []
    for i in range(tokens):
        delta = {"role": "assistant", "content": "Hello"} if i == 0 else {"content": f" w{i % 97}"}
        finish = "length" if i == tokens - 1 else None
        choice = {"index": 0, "delta": delta, "logprobs": None, "finish_reason": finish}
        body = {"id": "cmpl-sim", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
        chunks.append(b"data: " + json.dumps({**body, "choices": [choice], "usage": None}).encode() + b"\n\n")
    usage = {"prompt_tokens": 9, "completion_tokens": tokens, "total_tokens": tokens + 9}
    tail = {"id": "cmpl-sim", "object": "chat.completion.chunk", "created": 1, "model": MODEL}
    chunks.append(b"data: " + json.dumps({**tail, "choices": [], "usage": usage}).encode() + b"\n\n")
    chunks.append(b"data: [DONE]\n\n")
    return [b"".join(chunks[i : i + per_read]) for i in range(0, len(chunks), per_read)]


class _Content:
    """aiohttp's ``response.content`` for one answer: a read waits one turn of the loop (the
    engine's next write arriving), then returns the next piece; b"" at the end."""

    def __init__(self, pieces: list[bytes]) -> None:
        self._pieces = iter(pieces)

    async def readany(self) -> bytes:
        await asyncio.sleep(0)
        return next(self._pieces, b"")


class _Response:
    status = 200

    def __init__(self, pieces: list[bytes]) -> None:
        self.content = _Content(pieces)

    def release(self) -> None:
        pass

    def close(self) -> None:
        pass


class FakeEngine(OpenAIBackend):
    """An OpenAI engine client whose answers are :func:`engine_stream`'s bytes, with no socket."""

    def __init__(self, per_read: int) -> None:
        super().__init__("http://engine.invalid", name="bench", max_concurrency=8, models=[MODEL])
        self.pieces = engine_stream(JOB_TOKENS, per_read)

    async def discover_models(self) -> list[str]:
        return [MODEL]

    async def healthy(self) -> bool:
        return True

    async def engine_load(self) -> None:
        return None

    async def _send(self, job: Job, content: bytes) -> aiohttp.ClientResponse:
        return _Response(self.pieces)  # type: ignore[return-value]


@dataclass
class Counter:
    """A profile hook counting calls; with ``each``, by function too."""

    calls: int = 0
    each: dict[Any, int] | None = None
    by: dict[str, int] = field(default_factory=dict)

    def count(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" or event == "c_call":
            self.calls += 1
            if self.each is not None:
                key = frame.f_code if event == "call" else arg
                self.each[key] = self.each.get(key, 0) + 1


def streamed_job(i: int) -> Job:
    job = make_job(i)
    job.id = f"job_bench{i:06d}"
    job.created_at = 1_700_000_000.0
    job.deadline = time.time() + 600
    job.endpoint = Endpoint.CHAT
    job.stream_tokens = True
    job.body = {**job.body, "stream": True, "max_tokens": JOB_TOKENS}
    job.max_tokens = JOB_TOKENS
    return job


async def never_received() -> dict[str, Any]:
    """A server's ``receive`` for a client that sends nothing more and never leaves."""
    await asyncio.Future()
    raise AssertionError  # never reached


class ClientTransport:
    """The client's connection, as the server's transport: keeps what is written."""

    def __init__(self) -> None:
        self.written = bytearray()

    def write(self, data: bytes) -> None:
        self.written += data

    def is_closing(self) -> bool:
        return False

    def get_extra_info(self, name: str, default: Any = None) -> Any:
        return default

    def pause_reading(self) -> None:
        pass

    def resume_reading(self) -> None:
        pass


def dechunked(written: bytes) -> bytes:
    """An answer's body as the client reads it: its head dropped, its chunked framing undone."""
    at = written.index(b"\r\n\r\n") + 4
    body = bytearray()
    while True:
        end = written.index(b"\r\n", at)
        size = int(written[at:end], 16)
        if size == 0:
            return bytes(body)
        body += written[end + 2 : end + 2 + size]
        at = end + 2 + size + 2


def response_cycle(scope: Any, transport: Any) -> RequestResponseCycle:
    """uvicorn's request cycle for ``scope`` as its server makes one (no access log, no default
    headers, keep-alive), writing to ``transport`` through the gateway's coalescing ``OneWrite``;
    called in the running loop."""
    return RequestResponseCycle(
        scope,
        OneWrite(transport, asyncio.get_running_loop()),  # type: ignore[arg-type]
        FlowControl(transport),
        _LOG,
        _LOG,
        False,
        [],
        asyncio.Event(),
        False,
        True,
        lambda: None,
    )


async def relay_one(broker: MemoryBroker, job: Job, sent: list[bytes]) -> None:
    """One streamed job admitted, run by the dispatcher, relayed as the chat route relays it, to
    the server's own ``send`` (uvicorn's, over the gateway's coalescing transport) on a connection
    that keeps the bytes; the body the client reads is appended to ``sent``."""
    await broker.admit(job)
    transport = ClientTransport()
    scope: Any = {"type": "http", "method": "POST", "http_version": "1.1", "path": "/v1/chat/completions"}
    cycle = response_cycle(scope, transport)
    payloads: AsyncIterator[str | bytes] = openai_stream(broker, job, include_usage=True)
    send: Any = cycle.send
    await EventStream(payloads, {"x-sluice-job-id": job.id}, ping_s=0)(scope, never_received, send)
    await asyncio.sleep(0)  # the transport's last write, at the end of the turn
    sent.append(dechunked(bytes(transport.written)))


async def whole_path(jobs: int, per_read: int, counter: Counter | None) -> tuple[float, float, str]:
    """CPU µs per token, calls per token (with ``counter``), and the digest of the client's bytes."""
    broker = MemoryBroker(settings())
    await broker.start()
    dispatcher = Dispatcher(broker, [FakeEngine(per_read)])
    await dispatcher.start()
    sent: list[bytes] = []
    try:
        await relay_one(broker, streamed_job(10**5), [])  # warm: the first job's one-time costs
        start_cpu = time.process_time()
        if counter is not None:
            sys.setprofile(counter.count)
        try:
            for i in range(jobs):
                await relay_one(broker, streamed_job(i), sent)
        finally:
            sys.setprofile(None)
        spent = time.process_time() - start_cpu
    finally:
        await dispatcher.stop()
        await broker.close()
    tokens = jobs * JOB_TOKENS
    calls = counter.calls / tokens if counter is not None else 0.0
    return spent / tokens * 1e6, calls, hashlib.sha256(b"".join(sent)).hexdigest()[:16]


def whole(tokens: int, per_read: int, runs: int, by_function: int, count: bool = True) -> None:
    jobs = max(tokens // JOB_TOKENS, 1)
    print(
        f"the whole per-token path: {jobs} streamed jobs of {JOB_TOKENS} tokens one at a time, "
        f"{per_read} engine chunk(s) a read"
    )
    for _ in range(runs):
        us, _, digest = uvloop.run(whole_path(jobs, per_read, None))
        print(f"{us:.2f} µs of CPU per token   (client bytes {digest})")
    if not count:
        return
    counter = Counter(each={} if by_function else None)
    _, calls, digest = uvloop.run(whole_path(jobs, per_read, counter))
    print(f"{calls:.1f} calls per token (client bytes {digest})")
    if counter.each:
        named: dict[str, int] = {}
        for key, n in counter.each.items():
            named[function_name(key)] = named.get(function_name(key), 0) + n
        print(f"\nthe {by_function} functions called most, calls a token")
        for name, n in sorted(named.items(), key=lambda kv: -kv[1])[:by_function]:
            print(f"{n / (jobs * JOB_TOKENS):>8.2f}  {name}")


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m sluice.bench.memory_wakeup", description=__doc__)
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--whole", action="store_true", help="the whole per-token path (see above)")
    parser.add_argument("--per-read", type=int, default=1, help="--whole: engine chunks in each read")
    parser.add_argument(
        "--by-function", type=int, default=0, metavar="N", help="--whole: the N functions called most"
    )
    parser.add_argument(
        "--no-count",
        action="store_true",
        help="--whole: no counted pass (under valgrind: instructions per token from two --tokens)",
    )
    args = parser.parse_args()
    if args.whole:
        whole(args.tokens, args.per_read, args.runs, args.by_function, count=not args.no_count)
        return
    for _ in range(args.runs):
        print(f"{uvloop.run(per_token_us(args.tokens)):.2f} µs of CPU per token")


if __name__ == "__main__":
    main()
