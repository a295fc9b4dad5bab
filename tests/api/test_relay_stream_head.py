"""A chat stream's head waits for the engine to take the job, inside the stream
(sluice.api.openai.stream_answer, OpenAIStream's ``accept_within``): on the memory broker the head
and the first token's frame are written in the broker's call back, with no turn of the loop for
the route's task in between; a job that fails before its first token is still its error status
with nothing sent, a client that leaves before it cancels the job, and the client gets the same
messages whether the broker calls back or not."""

from __future__ import annotations

import asyncio
import contextlib
import json
import time
from collections.abc import Awaitable, Callable, MutableMapping
from typing import Any

import httpx
import pytest

from sluice.api import openai as openai_api
from sluice.api.errors import APIError
from sluice.api.sse import CLIENT_GONE
from sluice.bench.broker_cycles import MODEL, make_job, settings
from sluice.broker.base import EventType
from sluice.broker.memory import MemoryBroker
from sluice.core.job import Job, JobError, JobState
from sluice.sim.model import preset
from sluice.sim.server import serve_in_background
from tests.api.test_openai_gaps import MSG, fake_gateway
from tests.api.test_relay_direct import Unfollowed, token
from tests.broker.brokers import empty_redis
from tests.helpers import wait_until
from tests.redis_server import RedisServer
from tests.servers import run_gateway

SCOPE = {"type": "http", "method": "POST", "path": "/v1/chat/completions", "headers": []}
REFUSED = JobError("n must be 1", "invalid_request_error", "engine_rejected", "n")


class Watch:
    """The server's client watch (``sluice.client_gone``): :meth:`leave` is the client leaving."""

    def __init__(self) -> None:
        self.callbacks: list[Callable[[], None]] = []

    def watch(self, callback: Callable[[], None]) -> Callable[[], None]:
        self.callbacks.append(callback)
        return lambda: self.callbacks.remove(callback)

    def leave(self) -> None:
        for callback in list(self.callbacks):
            callback()


class Client:
    """An ASGI client that keeps every message sent; while ``gate`` is clear, a send waits."""

    def __init__(self) -> None:
        self.messages: list[dict[str, Any]] = []
        self.gate = asyncio.Event()
        self.gate.set()
        self.watch = Watch()
        self.scope = {**SCOPE, "extensions": {CLIENT_GONE: self.watch}}

    async def receive(self) -> dict[str, Any]:
        await asyncio.Future()
        raise AssertionError

    async def send(self, message: MutableMapping[str, Any]) -> None:
        await self.gate.wait()
        self.messages.append(dict(message))

    @property
    def started(self) -> bool:
        return any(m["type"] == "http.response.start" for m in self.messages)

    def bodies(self) -> list[bytes]:
        return [m["body"] for m in self.messages if m["type"] == "http.response.body" and m.get("body")]


Script = Callable[[MemoryBroker, Job, Client], Awaitable[None]]


class Slot:
    """A connection slot as the route holds it: an exit stack whose release is seen."""

    def __init__(self) -> None:
        self.released = False
        self.stack = contextlib.AsyncExitStack()
        self.stack.callback(self._release)

    def _release(self) -> None:
        self.released = True


async def head_waits(broker: MemoryBroker, job_id: str) -> None:
    """Return once a stream's head waits for the engine to take the job: followed (the broker
    calls back), or a reader of its events waiting (engine_accepted's, where it does not)."""
    record = broker._records[job_id]
    await wait_until(lambda: record.follower is not None or bool(record.readers))


async def streamed(
    script: Script, *, follow: bool = True, alive: bool = False
) -> tuple[Client, Job, BaseException | None, Slot]:
    """What the client got of a queued job's stream, made as the chat route makes it, while
    ``script`` runs the job; the job at the end, and the error the stream raised, if any."""
    broker = MemoryBroker(settings())
    async with broker:
        job = make_job(0)
        job.stream_tokens = True
        job.id, job.created_at = "job_head0", 1_700_000_000.0
        await broker.admit(job)
        client = Client()
        slot = Slot()
        reads: Any = broker if follow else Unfollowed(broker)

        async def still_valid() -> bool:
            return True

        stream = openai_api.stream_answer(
            reads, job, {"x-sluice-job-id": job.id}, True, slot.stack, still_valid if alive else None, None
        )
        writer = asyncio.create_task(stream(client.scope, client.receive, client.send))
        await head_waits(broker, job.id)  # the stream is open, its head waiting, before the claim
        assert not client.messages and not stream.started and not writer.done()
        claimed = await broker.claim("w", [MODEL], timeout=1.0)
        assert claimed is not None
        await script(broker, job, client)
        raised: BaseException | None = None
        try:
            await asyncio.wait_for(writer, 5)
        except APIError as exc:
            raised = exc
        final = await broker.get(job.id)
        assert final is not None
        return client, final, raised, slot


async def answered(broker: MemoryBroker, job: Job, client: Client) -> None:
    for text in ("Hel", "lo", "a\nline"):
        await broker.publish(job.id, EventType.TOKEN, token(text))
    usage = {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}
    await broker.finish(job.id, "w", JobState.SUCCEEDED, result={"system_fingerprint": "fp"}, usage=usage)


async def retried_then_answered(broker: MemoryBroker, job: Job, client: Client) -> None:
    await broker.release(job.id, "w")  # a retry before any token: waited through
    assert await broker.claim("w", [MODEL], timeout=1.0) is not None
    await answered(broker, job, client)


async def answered_without_tokens(broker: MemoryBroker, job: Job, client: Client) -> None:
    await broker.finish(job.id, "w", JobState.SUCCEEDED, result={}, usage={"total_tokens": 0})


async def refused_before_its_first_token(broker: MemoryBroker, job: Job, client: Client) -> None:
    await broker.finish(job.id, "w", JobState.FAILED, error=REFUSED)


async def failed_after_a_token(broker: MemoryBroker, job: Job, client: Client) -> None:
    await broker.publish(job.id, EventType.TOKEN, token("a"))
    await broker.finish(job.id, "w", JobState.FAILED, error=JobError("engine down", "server_error", "x"))


SCRIPTS = (answered, retried_then_answered, answered_without_tokens, failed_after_a_token)


async def test_the_head_and_the_first_frame_are_written_in_the_publishers_call() -> None:
    async def first_token(broker: MemoryBroker, job: Job, client: Client) -> None:
        await broker.publish(job.id, EventType.STARTED, {})
        assert not client.messages  # no head before the engine has taken the job
        await broker.publish(job.id, EventType.TOKEN, token("now"))
        # No turn of the loop in between: the stream's task has not run since.
        assert client.started and len(client.bodies()) == 1 and b'"now"' in client.bodies()[0]
        await answered(broker, job, client)

    client, job, raised, slot = await streamed(first_token)
    assert raised is None and job.state is JobState.SUCCEEDED and slot.released
    start = client.messages[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert (b"x-sluice-job-id", b"job_head0") in start["headers"]
    assert (b"content-type", b"text/event-stream; charset=utf-8") in start["headers"]
    assert client.bodies()[-1] == b"data: [DONE]\n\n" and len(client.bodies()) == 6


async def test_the_client_gets_the_same_messages_whether_the_broker_calls_back_or_not() -> None:
    for script in SCRIPTS:
        for alive in (False, True):
            direct, _, raised, _ = await streamed(script, alive=alive)
            read, _, _, _ = await streamed(script, follow=False, alive=alive)
            assert raised is None, script.__name__
            assert direct.messages == read.messages, (script.__name__, alive)
            assert direct.messages[0]["type"] == "http.response.start"
            assert direct.bodies()[-1] == b"data: [DONE]\n\n"
            assert direct.messages[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


async def test_a_failure_before_the_first_token_raises_its_status_and_sends_nothing() -> None:
    for follow in (True, False):
        client, job, raised, slot = await streamed(refused_before_its_first_token, follow=follow)
        assert isinstance(raised, APIError), follow
        assert raised.status == 400 and raised.param == "n" and raised.job_id == job.id
        assert not client.messages  # the route answers it with its status: nothing may precede
        assert job.state is JobState.FAILED and slot.released


async def test_a_client_that_leaves_before_the_first_token_cancels_the_job() -> None:
    async def leaves(broker: MemoryBroker, job: Job, client: Client) -> None:
        client.watch.leave()
        await wait_until(lambda: cancelled(broker, job.id), 2.0)

    client, job, raised, slot = await streamed(leaves)
    assert raised is None and not client.messages
    assert job.state is JobState.CANCELLED and slot.released


async def held_back(broker: MemoryBroker, job: Job, client: Client) -> None:
    """Tokens "0" to "2" while the connection's buffer is full (the head's send waits: nothing may
    be sent past it, however many turns the loop takes), then "3" and the job's end. A script of
    this module's and of test_responses_stream_head's."""
    client.gate.clear()
    for i in range(3):
        await broker.publish(job.id, EventType.TOKEN, token(str(i)))
    for _ in range(20):  # turns of the loop for the stream's task: none may send past the gate
        await asyncio.sleep(0)
    assert not client.messages
    client.gate.set()
    await broker.publish(job.id, EventType.TOKEN, token("3"))
    await broker.finish(job.id, "w", JobState.SUCCEEDED, result={}, usage={})


async def test_a_head_that_waits_for_the_connection_goes_first_and_the_frames_after_it_in_order() -> None:
    client, _, raised, _ = await streamed(held_back)
    assert raised is None and client.messages[0]["type"] == "http.response.start"
    texts = [json.loads(b[6:])["choices"][0]["delta"]["content"] for b in client.bodies()[:4]]
    assert texts == ["0", "1", "2", "3"]


async def test_a_stream_whose_engine_takes_its_time_starts_when_the_wait_runs_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(openai_api, "ACCEPT_WAIT_S", 0.05)

    async def slow(broker: MemoryBroker, job: Job, client: Client) -> None:
        await wait_until(lambda: client.started, 2.0)
        assert not client.bodies()  # the head alone, no token yet
        await broker.publish(job.id, EventType.TOKEN, token("late"))
        assert b'"late"' in client.bodies()[0]  # still written in the publisher's call
        await broker.finish(job.id, "w", JobState.SUCCEEDED, result={}, usage={})

    client, job, raised, _ = await streamed(slow)
    assert raised is None and job.state is JobState.SUCCEEDED
    assert client.bodies()[-1] == b"data: [DONE]\n\n"


async def test_a_refusal_in_the_turn_the_wait_runs_out_is_still_its_status(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The engine's refusal and the end of the accept wait fall in one turn of the loop, the refusal
    # first: the wait's timer, run after it in that turn, must not send the head (a 200 whose
    # stream holds the error), as engine_accepted's timer does not once the wait has its answer.
    monkeypatch.setattr(openai_api, "ACCEPT_WAIT_S", 0.05)

    async def refused_as_the_wait_runs_out(broker: MemoryBroker, job: Job, client: Client) -> None:
        # The loop held on purpose (no await): the wait's timer is due at the next turn's start.
        time.sleep(0.1)  # noqa: ASYNC251
        await asyncio.sleep(0)  # this task runs first in that turn, the timer after it
        await broker.finish(job.id, "w", JobState.FAILED, error=REFUSED)

    for follow in (True, False):
        client, job, raised, slot = await streamed(refused_as_the_wait_runs_out, follow=follow)
        assert isinstance(raised, APIError) and raised.status == 400, (follow, client.messages)
        assert not client.messages and slot.released, follow
        assert job.state is JobState.FAILED, follow


async def test_the_streams_time_limit_counts_from_its_head_not_from_the_wait_for_the_engine() -> None:
    # max_stream_s bounds the stream from its head, as when the route waited for the engine before
    # the stream began (engine_accepted, then the EventStream): a first token that comes after
    # limit_s but within the accept wait still streams. a5ca2b5 counted the wait in the limit, and
    # the client got an empty 200 (head, end) with its job cancelled.
    for follow in (True, False):
        await _a_first_token_after_the_limit_streams(follow)


async def _a_first_token_after_the_limit_streams(follow: bool) -> None:
    limit_s = 0.05
    broker = MemoryBroker(settings())
    async with broker:
        job = make_job(0)
        job.stream_tokens = True
        await broker.admit(job)
        assert await broker.claim("w", [MODEL], timeout=1.0) is not None
        client = Client()
        reads: Any = broker if follow else Unfollowed(broker)
        stream = openai_api.stream_answer(reads, job, {}, False, None, None, limit_s)
        writer = asyncio.create_task(stream(client.scope, client.receive, client.send))
        await asyncio.sleep(limit_s * 4)  # past the limit, well within ACCEPT_WAIT_S
        assert not client.messages and not writer.done(), follow  # the head waits on
        await broker.publish(job.id, EventType.TOKEN, token("late"))
        await wait_until(lambda: client.bodies(), 2.0)
        assert b'"late"' in client.bodies()[0], follow
        # No end from the engine: the limit, counted from the head, ends the stream.
        await asyncio.wait_for(writer, 5)
        assert client.messages[0]["type"] == "http.response.start"
        assert client.messages[-1] == {"type": "http.response.body", "body": b"", "more_body": False}
        assert await cancelled(broker, job.id), follow


async def cancelled(broker: Any, job_id: str) -> bool:
    """Whether the job has been cancelled (a condition for wait_until)."""
    job = await broker.get(job_id)
    return job is not None and job.state is JobState.CANCELLED


# --- through the gateway -------------------------------------------------------------------------


async def test_a_refusal_before_the_first_token_is_its_status_on_the_frameworks_route_too(
    http: httpx.AsyncClient,
) -> None:
    # JSON of another Content-Type: the lean route hands the request to FastAPI's, which raises the
    # same error from inside the stream's response, before it starts. The simulator refuses n=2.
    async with serve_in_background(preset("fast", model="sim")) as sim, run_gateway([sim]) as g:
        body = json.dumps({"model": "sim", "messages": MSG, "n": 2, "stream": True}).encode()
        for headers in (
            {"content-type": "application/vnd.sluice+json"},
            {"content-type": "application/json"},
        ):
            r = await http.post(g.url + "/v1/chat/completions", content=body, headers=headers)
            assert r.status_code == 400, (headers, r.text)
            assert r.headers["content-type"].startswith("application/json")
            error = r.json()["error"]
            assert error["param"] == "n" and error["code"] == "engine_rejected"
            assert r.headers["x-request-id"] == r.headers["x-sluice-job-id"]


async def test_a_client_that_leaves_before_the_first_token_cancels_its_job_at_once(
    http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The head's wait made far longer than the test's bound: a stream that held the job until the
    # wait ran out fails the test by a margin no loaded machine closes.
    monkeypatch.setattr(openai_api, "ACCEPT_WAIT_S", 600.0)
    async with fake_gateway("gate") as (engine, g):
        body = {"model": "fake", "messages": MSG, "stream": True}
        sending = asyncio.create_task(http.post(g.url + "/v1/chat/completions", json=body))
        await wait_until(lambda: engine.requests == 1)  # the engine has the job, no token yet
        (job,) = (await g.broker.list_jobs("anonymous", 10)).jobs  # the open mode's tenant
        assert job.state is JobState.RUNNING
        sending.cancel()  # the client leaves
        with contextlib.suppress(asyncio.CancelledError):
            await sending
        # Long before the accept wait's end: the stream's head no longer holds the job until then.
        await wait_until(lambda: cancelled(g.broker, job.id), 60.0)
        assert not engine.gate.is_set()


async def test_on_redis_a_stream_streams_and_a_refusal_before_its_first_token_is_its_status(
    http: httpx.AsyncClient,
) -> None:
    # No calls back on Redis: the stream's head waits through engine_accepted's read of the events.
    with RedisServer() as server:
        url = await empty_redis(server)
        async with (
            serve_in_background(preset("fast", model="sim")) as sim,
            run_gateway([sim], broker=url) as g,
        ):
            body = {"model": "sim", "messages": MSG, "max_tokens": 3, "stream": True}
            async with http.stream("POST", g.url + "/v1/chat/completions", json=body) as r:
                assert r.status_code == 200
                assert r.headers["content-type"] == "text/event-stream; charset=utf-8"
                payloads = [line[5:].strip() async for line in r.aiter_lines() if line.startswith("data:")]
            assert payloads[-1] == "[DONE]" and len(payloads) >= 2
            refused = await http.post(g.url + "/v1/chat/completions", json={**body, "n": 2})
            assert refused.status_code == 400 and refused.json()["error"]["param"] == "n"
            assert refused.headers["x-request-id"] == refused.headers["x-sluice-job-id"]
