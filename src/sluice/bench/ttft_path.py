"""Sluice's own steps on the first token's path, in one process, in a figure that the machine's
other load does not move: the Python calls (function and C-function calls, counted by a profile
hook) that run between two points of the path, whatever task runs them; and the wall-clock time
of the same steps, from a second pass without the hook (noisy on a shared machine); and, from a
third pass, the turns of the event loop each step waited (:class:`Turns`), a figure as
load-independent as the calls: a wake-up of another task, or a task of aiohttp's own, is a turn.

The embedded broker, a dispatcher and the engine client (as ``sluice serve`` runs them, on uvloop)
in this process, the simulator (``article`` preset) in its own; streamed jobs one at a time, each
answered from its admission on by the chat route's own stream (:func:`sluice.api.openai.
stream_answer`, the :class:`~sluice.api.sse.EventStream` it returns) to uvicorn's own ``send``
over the gateway's coalescing transport (:class:`~sluice.roles.http_limits.OneWrite`), with the
server's client watch in the scope, as the route answers a client. Three steps:

- *admitted → request written*: from ``broker.admit`` to aiohttp writing the engine request's body
  on the socket: the claim, the engine's choice, the request built and sent, and whatever other
  task the loop runs before that write (the engine waits for it);
- *chunk in → token published*: from the first chunk's bytes reaching the engine client (aiohttp's
  ``data_received``) to the dispatcher's ``broker.publish`` of its TOKEN event: the parse, the
  assembler;
- *token published → first frame written*: from that publish to the client's connection being
  handed the bytes of the stream's head and first ``data:`` frame (its transport's ``write``):
  the route's wait for the first token, the stream's start, the frame's encoding and send.

Not here: the HTTP front (uvicorn's parse, the body's validation, the job built), which
``python -m sluice.bench.ttft_overhead`` measures whole, with the engine's own time.

``--route responses``: answered by the Responses route's stream (``responses.stream_response``)
instead, the first frame its first text delta (after the opening events, or with them).

Usage: python -m sluice.bench.ttft_path [--jobs 300] [--by-function N] [--timeline] [--route responses]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import statistics
import sys
import time
from collections.abc import Callable
from types import FrameType
from typing import IO, Any

import aiohttp.client_proto
import aiohttp.client_reqrep
import uvloop

from sluice.api.openai import stream_answer
from sluice.api.responses import stream_response
from sluice.api.sse import CLIENT_GONE
from sluice.backends.http import EngineHTTP
from sluice.backends.openai import OpenAIBackend
from sluice.bench.memory_wakeup import ClientTransport, never_received, response_cycle
from sluice.bench.overhead_profile import function_name
from sluice.bench.spawn import spawn_sim, stop
from sluice.broker.base import EventType
from sluice.broker.memory import MemoryBroker
from sluice.core.job import Endpoint, Job, JobState, new_job_id
from sluice.dispatcher import Dispatcher
from sluice.roles.http_limits import ClientGone

MODEL = "sim"
STEPS = (
    ("admitted", "written", "admitted -> request written"),
    ("chunk", "token", "chunk in -> token published"),
    ("token", "frame", "token published -> frame written"),
)
# A point that starts a step and ends another ("token") keeps the turns counting on.
STARTS = frozenset(start for start, _, _ in STEPS)
ENDS = frozenset(end for _, end, _ in STEPS) - STARTS


class Turns:
    """The turns of the event loop while counting: a callback that puts itself back on the ready
    queue each time it runs runs once a turn (a callback scheduled during a turn runs in the next,
    asyncio's and uvloop's rule alike). It counts only from :meth:`start` to :meth:`stop`, so that
    the loop is not kept spinning while the job waits on the engine; it never waits on I/O itself,
    and steps that wait on none (both steps here: the engine's bytes are in before the first, the
    connection is kept alive) take the same turns with it as without."""

    def __init__(self) -> None:
        self.turns = 0
        self.running = False
        self.enabled = False

    def start(self) -> None:
        if self.enabled and not self.running:
            self.running = True
            asyncio.get_running_loop().call_soon(self._tick)

    def stop(self) -> None:
        self.running = False

    def _tick(self) -> None:
        if self.running:
            self.turns += 1
            asyncio.get_running_loop().call_soon(self._tick)


class Marks:
    """When (perf_counter ns), after how many calls and after how many turns of the loop
    (:class:`Turns`, in its pass) each point of one job's path was reached; with ``by_function``,
    also each function's calls inside each step (keyed by the step's label)."""

    def __init__(self, by_function: bool = False) -> None:
        self.calls = 0
        self.loop_turns = Turns()
        self.at: dict[str, tuple[int, int, int]] = {}
        self.by_function = by_function
        self.step: dict[Any, int] | None = None
        self.each: dict[str, dict[Any, int]] = {label: {} for _, _, label in STEPS}

    def count(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" or event == "c_call":
            self.calls += 1
            step = self.step
            if step is not None:
                key = frame.f_code if event == "call" else arg
                step[key] = step.get(key, 0) + 1

    def mark(self, name: str) -> None:
        turns = self.loop_turns
        self.at[name] = (time.perf_counter_ns(), self.calls, turns.turns)
        if turns.enabled:  # in its own pass: no call in the counted one
            if name in STARTS:
                turns.start()
            elif name in ENDS:
                turns.stop()
        if self.by_function:
            self.step = None
            for start, _, label in STEPS:
                if name == start:
                    self.step = self.each[label]


def hook_engine_client(marks: Marks) -> Callable[[], None]:
    """Mark the engine request's body write (the first of a job), each read of the engine's
    bytes until the token is published (so the last one before it: the first chunk's) and the
    first token's publish; returns the undo."""
    write_bytes = aiohttp.client_reqrep.ClientRequest.write_bytes
    data_received = aiohttp.client_proto.ResponseHandler.data_received
    publish = MemoryBroker.publish

    async def traced_publish(self: MemoryBroker, job_id: str, type: EventType, data: Any) -> None:
        # Before the publish, which hands the token to whoever follows the job.
        if type is EventType.TOKEN and "token" not in marks.at:
            marks.mark("token")
        await publish(self, job_id, type, data)

    async def traced_write(self: Any, *args: Any, **kwargs: Any) -> None:
        # When the writer's task runs (the body goes on the socket), not when its coroutine is made.
        if "written" not in marks.at:
            marks.mark("written")
        await write_bytes(self, *args, **kwargs)

    def traced_received(self: Any, data: bytes) -> None:
        # Each read of the engine's bytes until the token's, so the last is the token's chunk; not
        # aiohttp's own data_received(b"") (its resume_reading, from inside the engine client's
        # read of that chunk: the step would start half-way). The turns are counted only from a
        # read that carries a chunk, not from the answer's head on through the engine's time to
        # its first token.
        if data and "token" not in marks.at:
            if b"data:" in data or not marks.loop_turns.enabled:
                marks.mark("chunk")
            else:
                marks.at["chunk"] = (time.perf_counter_ns(), marks.calls, marks.loop_turns.turns)
        data_received(self, data)

    aiohttp.client_reqrep.ClientRequest.write_bytes = traced_write  # type: ignore[method-assign]
    aiohttp.client_proto.ResponseHandler.data_received = traced_received  # type: ignore[method-assign]
    MemoryBroker.publish = traced_publish  # type: ignore[method-assign]

    def undo() -> None:
        aiohttp.client_reqrep.ClientRequest.write_bytes = write_bytes  # type: ignore[method-assign]
        aiohttp.client_proto.ResponseHandler.data_received = data_received  # type: ignore[method-assign]
        MemoryBroker.publish = publish  # type: ignore[method-assign]

    return undo


#: ``--timeline``: the first step cut at two more points, the claim's return (the dispatcher's
#: task has the job) and the engine client's ``post`` (the request handed to aiohttp)
TIMELINE = (
    ("admitted", "claimed", "  admitted -> claimed"),
    ("claimed", "sending", "  claimed -> client's post"),
    ("sending", "written", "  post -> request written"),
)


def hook_timeline(marks: Marks) -> Callable[[], None]:
    """Mark the claim's return with a job and the engine client's ``post`` (each wrapper's own
    calls are in the figures); returns the undo."""
    claim = MemoryBroker._claim
    post = EngineHTTP.post

    async def traced_claim(self: MemoryBroker, *args: Any) -> Job | None:
        job = await claim(self, *args)
        if job is not None and "claimed" not in marks.at:
            marks.mark("claimed")
        return job

    async def traced_post(self: EngineHTTP, *args: Any) -> Any:
        if "sending" not in marks.at:
            marks.mark("sending")
        return await post(self, *args)

    MemoryBroker._claim = traced_claim  # type: ignore[method-assign,assignment]
    EngineHTTP.post = traced_post  # type: ignore[method-assign,assignment]

    def undo() -> None:
        MemoryBroker._claim = claim  # type: ignore[method-assign]
        EngineHTTP.post = post  # type: ignore[method-assign]

    return undo


def streamed_job() -> Job:
    now = time.time()
    return Job(
        id=new_job_id(),
        model=MODEL,
        endpoint=Endpoint.CHAT,
        body={
            "model": MODEL,
            "messages": [{"role": "user", "content": "hello"}],
            "max_tokens": 4,
            "stream": True,
        },
        tenant="bench",
        priority="normal",
        prompt_tokens=9,
        max_tokens=4,
        created_at=now,
        deadline=now + 600,
        stream_tokens=True,
    )


class Connection(ClientTransport):
    """The client's connection, as the server's transport: marks the first write that carries the
    first token's frame (``first``: chat's ``data:``, a Responses stream's first text delta, which
    come after its opening events), with the stream's head when they go out together."""

    def __init__(self, marks: Marks, first: bytes = b"data:") -> None:
        super().__init__()
        self.marks, self.first = marks, first

    def write(self, data: bytes) -> None:
        # After the token: not the last writes of the job before, flushed a turn after its stream
        if self.first in data and "token" in self.marks.at and "frame" not in self.marks.at:
            self.marks.mark("frame")


async def answered(broker: MemoryBroker, job: Job, marks: Marks, route: str = "chat") -> None:
    """The job's stream, as the chat route answers it (``stream_answer``, then the stream called
    with the server's ``send``), to uvicorn's request cycle over the gateway's coalescing
    transport, with the server's client watch in the scope."""
    loop = asyncio.get_running_loop()
    connection = Connection(marks, b"output_text.delta" if route == "responses" else b"data:")
    scope: Any = {"type": "http", "method": "POST", "http_version": "1.1", "path": "/v1/chat/completions"}
    cycle = response_cycle(scope, connection)
    scope["extensions"] = {CLIENT_GONE: ClientGone(cycle, loop)}
    headers = {"x-sluice-job-id": job.id, "x-request-id": job.id}
    if route == "responses":
        stream = stream_response(broker, job, headers, None, None, 600.0)
    else:
        stream = stream_answer(broker, job, headers, False, None, None, None)
    send: Any = cycle.send
    await stream(scope, never_received, send)


async def one(broker: MemoryBroker, marks: Marks, route: str = "chat") -> dict[str, tuple[int, int, int]]:
    """One job's marks, from its admission to its stream's first frame written."""
    job = streamed_job()
    marks.at = {}
    marks.mark("admitted")
    await broker.admit(job)
    await answered(broker, job, marks, route)
    done = await broker.wait(job.id, 30)
    assert done is not None and done.state is JobState.SUCCEEDED, done
    assert "frame" in marks.at, marks.at
    return marks.at


async def run(
    jobs: int, sim_url: str, marks: Marks | None = None, *, timeline: bool = False, route: str = "chat"
) -> dict[str, dict[str, list[float]]]:
    """Per step: its calls in the counted pass, its µs in the plain one, its turns of the loop in
    a third (``marks``: where they are kept, with each function's calls when it was made
    ``by_function``)."""
    marks = Marks() if marks is None else marks
    undo = hook_engine_client(marks)
    undo_timeline = hook_timeline(marks) if timeline else None
    steps = STEPS + TIMELINE if timeline else STEPS
    broker = MemoryBroker()
    await broker.start()
    backend = OpenAIBackend(sim_url, max_concurrency=16)
    dispatcher = Dispatcher(broker, [backend])
    await dispatcher.start()
    out: dict[str, dict[str, list[float]]] = {
        label: {"calls": [], "us": [], "turns": []} for _, _, label in steps
    }
    try:
        for _ in range(10):  # the connection opened, the drain rate measured
            await one(broker, marks, route)
        sys.setprofile(marks.count)
        try:
            counted = [await one(broker, marks, route) for _ in range(jobs)]
        finally:
            sys.setprofile(None)
            marks.by_function, marks.step = False, None
        timed = [await one(broker, marks, route) for _ in range(jobs)]
        marks.loop_turns.enabled = True
        try:
            turned = [await one(broker, marks, route) for _ in range(jobs)]
        finally:
            marks.loop_turns.enabled = False
            marks.loop_turns.stop()
    finally:
        undo()
        if undo_timeline is not None:
            undo_timeline()
        await dispatcher.stop()
        await backend.aclose()
        await broker.close()
    for start, end, label in steps:
        out[label]["calls"] = [float(m[end][1] - m[start][1]) for m in counted]
        out[label]["us"] = [(m[end][0] - m[start][0]) / 1000 for m in timed]
        out[label]["turns"] = [float(m[end][2] - m[start][2]) for m in turned]
    return out


def spread(values: list[float]) -> str:
    deciles = statistics.quantiles(values, n=10)
    return f"{statistics.median(values):,.0f} [{deciles[0]:,.0f}-{deciles[-1]:,.0f}]"


async def main(jobs: int, by_function: int, timeline: bool, log: IO[bytes], route: str = "chat") -> None:
    sim, url = await spawn_sim("article", log, extra=["--model", MODEL])
    marks = Marks(by_function=by_function > 0)
    try:
        out = await run(jobs, url, marks, timeline=timeline, route=route)
    finally:
        await stop(sim)
    print(f"{jobs} streamed jobs one at a time; memory broker, dispatcher and engine client in one process")
    heads = ("calls p50 [p10-p90]", "loop turns p50 [p10-p90]", "wall µs p50 [p10-p90]")
    print(f"{'step':<34} {heads[0]:>22} {heads[1]:>26} {heads[2]:>24}")
    if timeline:
        print("(--timeline: the first step's parts follow it; both hooks' own calls are in the figures)")
    for _, _, label in STEPS + TIMELINE if timeline else STEPS:
        figures = out[label]
        shown = [spread(figures[key]) for key in ("calls", "turns", "us")]
        print(f"{label:<34} {shown[0]:>22} {shown[1]:>26} {shown[2]:>24}")
    for _, _, label in STEPS if by_function else ():
        named: dict[str, int] = {}
        for key, calls in marks.each[label].items():
            named[function_name(key)] = named.get(function_name(key), 0) + calls
        print(f"\n{label}: the {by_function} functions called most, calls a job")
        for name, calls in sorted(named.items(), key=lambda kv: -kv[1])[:by_function]:
            print(f"{calls / jobs:>8.1f}  {name}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m sluice.bench.ttft_path",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--jobs", type=int, default=300)
    parser.add_argument(
        "--by-function",
        type=int,
        default=0,
        metavar="N",
        help="also list each step's N functions called most",
    )
    parser.add_argument(
        "--timeline",
        action="store_true",
        help="also cut the first step where the claim returns and where the engine client posts",
    )
    parser.add_argument("--route", choices=("chat", "responses"), default="chat", help="whose stream answers")
    args = parser.parse_args()
    with open(os.devnull, "wb") as log:
        uvloop.run(main(args.jobs, args.by_function, args.timeline, log, args.route))
