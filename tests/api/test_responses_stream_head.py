"""A Responses stream's head waits for the engine to take the job inside the stream
(sluice.api.responses.ResponseStream's ``accept_within``), as chat's does: on the memory broker the
head and the first token's events (response.created, in_progress, output_item.added, ...,
the first delta) are written in the broker's call back, no turn of the loop for the stream's
task between; a job that fails before its first token is still its error status in the request's
words with nothing sent; a client that leaves before it cancels the response (not a background
one); and the client gets the same bytes whether the broker calls back or not, numbered as a
replay numbers them."""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
from typing import Any

import httpx
import pytest

from sluice.api import relay
from sluice.api import responses as responses_api
from sluice.api.errors import APIError
from sluice.bench import ttft_path
from sluice.bench.broker_cycles import MODEL, make_job, settings
from sluice.broker.base import EventType
from sluice.broker.memory import MemoryBroker
from sluice.core.job import Job, JobError, JobState
from sluice.core.response_request import RECORD_KEY
from sluice.core.responses import response_object
from tests.api.test_openai_gaps import fake_gateway
from tests.api.test_relay_direct import Unfollowed, token
from tests.api.test_relay_stream_head import (
    Client,
    Script,
    Slot,
    cancelled,
    failed_after_a_token,
    head_waits,
    held_back,
)
from tests.api.test_responses import ScriptedEngine
from tests.broker.brokers import empty_redis
from tests.broker.test_memory_wait import live_timers
from tests.helpers import FakeClock, wait_until
from tests.redis_server import RedisServer
from tests.servers import run_app, run_gateway

#: The engine's refusal, naming the chat field the request's max_output_tokens became.
REFUSED = JobError("max_tokens is past the window", "invalid_request_error", "engine_rejected", "max_tokens")


#: the broker's clock in every run (after the job's created_at below)
STOPPED_AT = 1_700_000_100.0


async def streamed(
    script: Script, *, follow: bool = True, background: bool = False, alive: bool = False
) -> tuple[Client, Job, BaseException | None, Slot]:
    """What the client got of a response's stream, made as the route makes it, while ``script``
    runs its job; the job at the end, the error the stream raised (if any), the slot."""
    # The broker's clock stands still, at the same moment in every run: the two runs a comparison
    # reads (called back or not) end at the same completed_at. A clock started at time.time() in
    # each run put them a second apart whenever a second's boundary fell between the two.
    broker = MemoryBroker(dataclasses.replace(settings(), clock=FakeClock(STOPPED_AT)))
    async with broker:
        job = make_job(0)
        job.stream_tokens = True
        job.id, job.created_at = "job_rhead0", 1_700_000_000.0
        job.extra[RECORD_KEY] = {"background": background} if background else {}
        await broker.admit(job)
        client = Client()
        slot = Slot()
        reads: Any = broker if follow else Unfollowed(broker)

        async def still_valid() -> bool:
            return True

        check = still_valid if alive else None
        stream = responses_api.stream_response(
            reads, job, {"x-sluice-job-id": job.id}, slot.stack, check, 60.0, background=background
        )
        writer = asyncio.create_task(stream(client.scope, client.receive, client.send))
        await head_waits(broker, job.id)  # the stream is open, its head waiting, before the claim
        assert not client.messages and not stream.started and not writer.done()
        claimed = await broker.claim("w", [MODEL], timeout=1.0)
        assert claimed is not None
        await broker.publish(job.id, EventType.STARTED, {})
        await script(broker, job, client)
        raised: BaseException | None = None
        try:
            await asyncio.wait_for(writer, 5)
        except APIError as exc:
            raised = exc
        final = await broker.get(job.id)
        assert final is not None
        return client, final, raised, slot


def wire(client: Client) -> bytes:
    return b"".join(client.bodies())


def parsed(data: bytes) -> list[dict[str, Any]]:
    """The SSE events on the wire, each checked to be named by its type and numbered by its
    sequence number."""
    events = []
    for block in data.decode().split("\n\n"):
        if not block:
            continue
        lines = dict(line.split(": ", 1) for line in block.split("\n"))
        event = json.loads(lines["data"])
        assert (lines["event"], int(lines["id"])) == (event["type"], event["sequence_number"])
        events.append(event)
    return events


async def answered(broker: MemoryBroker, job: Job, client: Client) -> None:
    for text in ("Hel", "lo", "a\nline"):
        await broker.publish(job.id, EventType.TOKEN, token(text))
    usage = {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}
    await broker.finish(job.id, "w", JobState.SUCCEEDED, result={"system_fingerprint": "fp"}, usage=usage)


async def retried_then_answered(broker: MemoryBroker, job: Job, client: Client) -> None:
    await broker.release(job.id, "w")  # a retry before any token: waited through
    assert await broker.claim("w", [MODEL], timeout=1.0) is not None
    await broker.publish(job.id, EventType.STARTED, {})
    await answered(broker, job, client)


async def answered_without_tokens(broker: MemoryBroker, job: Job, client: Client) -> None:
    result = {"choices": [{"index": 0, "message": {"content": "whole"}, "finish_reason": "stop"}]}
    await broker.finish(job.id, "w", JobState.SUCCEEDED, result=result, usage={"total_tokens": 1})


async def refused_before_its_first_token(broker: MemoryBroker, job: Job, client: Client) -> None:
    await broker.finish(job.id, "w", JobState.FAILED, error=REFUSED)


SCRIPTS = (answered, retried_then_answered, answered_without_tokens, failed_after_a_token)


async def test_the_head_and_the_first_events_are_written_in_the_publishers_call() -> None:
    async def first_token(broker: MemoryBroker, job: Job, client: Client) -> None:
        assert not client.messages  # its start: no head before the engine has taken the job
        await broker.publish(job.id, EventType.TOKEN, token("now"))
        # No turn of the loop in between: the stream's task has not run since.
        assert client.started and len(client.bodies()) == 1
        first = [e["type"] for e in parsed(client.bodies()[0])]
        assert first == [
            "response.created",
            "response.in_progress",
            "response.output_item.added",
            "response.content_part.added",
            "response.output_text.delta",
        ]
        await answered(broker, job, client)

    client, job, raised, slot = await streamed(first_token)
    assert raised is None and job.state is JobState.SUCCEEDED and slot.released
    start = client.messages[0]
    assert start["type"] == "http.response.start" and start["status"] == 200
    assert (b"x-sluice-job-id", b"job_rhead0") in start["headers"]
    assert (b"content-type", b"text/event-stream; charset=utf-8") in start["headers"]
    events = parsed(wire(client))
    assert [e["sequence_number"] for e in events] == list(range(len(events)))
    deltas = [e["delta"] for e in events if e["type"] == "response.output_text.delta"]
    assert deltas == ["now", "Hel", "lo", "a\nline"]
    final = events[-1]
    assert final["type"] == "response.completed" and final["response"]["status"] == "completed"
    assert final["response"]["output"][0]["content"][0]["text"] == "".join(deltas)
    assert client.messages[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


async def test_the_client_gets_the_same_bytes_whether_the_broker_calls_back_or_not() -> None:
    for script in SCRIPTS:
        for background in (False, True):
            for alive in (False, True):
                case = (script.__name__, background, alive)
                direct, job, raised, _ = await streamed(script, background=background, alive=alive)
                read, _, _, _ = await streamed(script, follow=False, background=background, alive=alive)
                assert raised is None, case
                assert wire(direct) == wire(read) and wire(direct), case
                assert direct.messages[0] == read.messages[0], case  # the same head
                events = parsed(wire(direct))
                assert [e["sequence_number"] for e in events] == list(range(len(events))), case
                assert events[-1]["response"]["status"] == response_object(job)["status"], case
                assert direct.messages[-1] == {"type": "http.response.body", "body": b"", "more_body": False}


async def test_a_replay_numbers_the_events_as_the_stream_did() -> None:
    # The same script on a broker of its own, its event log replayed (GET ?stream=true): the same
    # events, numbered the same, as the stream that relayed the first token from the call back.
    for background in (False, True):
        client, job, _, _ = await streamed(retried_then_answered, background=background)
        broker = MemoryBroker(settings())
        async with broker:
            again = make_job(0)
            again.id, again.created_at, again.extra = job.id, job.created_at, job.extra
            again.stream_tokens = True
            await broker.admit(again)
            assert await broker.claim("w", [MODEL], timeout=1.0) is not None
            await broker.publish(job.id, EventType.STARTED, {})
            await retried_then_answered(broker, again, client)
            replay = responses_api.ResponseStream(broker, again, -1, False, None, None, 60.0)
            replayed = parsed(b"".join([frame async for frame in replay]))
        streamed_events = parsed(wire(client))
        assert [(e["type"], e["sequence_number"]) for e in replayed] == [
            (e["type"], e["sequence_number"]) for e in streamed_events
        ], background
        assert replayed[:3] == streamed_events[:3], background  # the opening, the same objects


async def test_a_failure_before_the_first_token_raises_its_status_in_the_requests_words() -> None:
    for follow in (True, False):
        client, job, raised, slot = await streamed(refused_before_its_first_token, follow=follow)
        assert isinstance(raised, APIError), follow
        assert raised.status == 400 and raised.job_id == job.id, follow
        assert raised.param == "max_output_tokens", follow  # what the client sent, not max_tokens
        assert not client.messages, follow  # the route answers it with its status: nothing before
        assert job.state is JobState.FAILED and slot.released, follow


async def test_a_client_that_leaves_before_the_first_token_cancels_the_response() -> None:
    armed: list[int] = []

    async def leaves(broker: MemoryBroker, job: Job, client: Client) -> None:
        armed.append(live_timers(relay._ran_out))  # the followed head's wait, as chat's
        client.watch.leave()
        await wait_until(lambda: cancelled(broker, job.id), 2.0)

    for follow in (True, False):
        client, job, raised, slot = await streamed(leaves, follow=follow)
        assert raised is None and not client.messages, follow
        assert job.state is JobState.CANCELLED and slot.released, follow
        assert live_timers(relay._ran_out) == 0, follow  # the wait's timer went with it
    assert armed == [1, 0]  # no follow: engine_accepted reads the events, no timer


async def test_a_background_stream_whose_client_leaves_before_the_first_token_runs_on() -> None:
    async def leaves(broker: MemoryBroker, job: Job, client: Client) -> None:
        client.watch.leave()
        await wait_until(lambda: bool(client.watch.callbacks) is False, 2.0)

    client, job, raised, slot = await streamed(leaves, background=True)
    assert raised is None and not client.messages
    assert job.state is JobState.RUNNING and slot.released


async def test_a_head_that_waits_for_the_connection_goes_first_and_the_events_after_it_in_order() -> None:
    client, _, raised, _ = await streamed(held_back)
    assert raised is None and client.messages[0]["type"] == "http.response.start"
    events = parsed(wire(client))
    assert [e["delta"] for e in events if e["type"] == "response.output_text.delta"] == ["0", "1", "2", "3"]
    assert [e["sequence_number"] for e in events] == list(range(len(events)))


async def test_a_stream_whose_engine_takes_its_time_starts_when_the_wait_runs_out(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.setattr(relay, "ACCEPT_WAIT_S", 0.05)

    async def slow(broker: MemoryBroker, job: Job, client: Client) -> None:
        await wait_until(lambda: bool(client.bodies()), 2.0)
        assert [e["type"] for e in parsed(wire(client))] == ["response.created", "response.in_progress"]
        await answered(broker, job, client)

    client, job, raised, _ = await streamed(slow)
    assert raised is None and job.state is JobState.SUCCEEDED
    assert parsed(wire(client))[-1]["type"] == "response.completed"


# --- through the gateway -------------------------------------------------------------------------


async def test_a_client_that_leaves_before_the_first_token_cancels_its_response_at_once(
    http: httpx.AsyncClient, monkeypatch: pytest.MonkeyPatch
) -> None:
    # The head's wait made far longer than the test's bound: a stream that held the job until the
    # wait ran out fails the test by a margin no loaded machine closes.
    monkeypatch.setattr(relay, "ACCEPT_WAIT_S", 600.0)
    async with fake_gateway("gate") as (engine, g):
        body = {"model": "fake", "input": "hello", "stream": True}
        sending = asyncio.create_task(http.post(g.url + "/v1/responses", json=body))
        await wait_until(lambda: engine.requests == 1)  # the engine has the job, no token yet
        (job,) = (await g.broker.list_jobs("anonymous", 10)).jobs  # the open mode's tenant
        assert job.state is JobState.RUNNING
        sending.cancel()  # the client leaves
        with contextlib.suppress(asyncio.CancelledError):
            await sending
        # Long before the accept wait's end: the stream's head no longer holds the job until then.
        await wait_until(lambda: cancelled(g.broker, job.id), 60.0)
        assert not engine.gate.is_set()


async def test_the_first_delta_goes_out_in_the_tokens_publish_in_ttft_path(sim_url: str) -> None:
    # python -m sluice.bench.ttft_path --route responses: the first text delta is written with no
    # turn of the loop after the TOKEN event's publish (before: 2, the route's wait for the
    # engine woke its task, then the stream's read of the events woke it again).
    out = await ttft_path.run(3, sim_url, route="responses")
    figures = out[ttft_path.STEPS[2][2]]
    assert len(figures["turns"]) == 3 and all(turns == 0 for turns in figures["turns"]), figures
    assert all(calls > 0 for calls in figures["calls"]), figures


async def test_on_redis_a_response_streams_and_a_refusal_before_its_first_token_is_its_status(
    http: httpx.AsyncClient,
) -> None:
    # No calls back on Redis: the stream's head waits through engine_accepted's read of the events,
    # and the iterator reads them again from the start, numbered as a replay numbers them.
    engine = ScriptedEngine()
    with RedisServer() as server:
        url = await empty_redis(server)
        async with run_app(engine.app()) as script_url, run_gateway([script_url], broker=url) as g:
            body = {"model": "script", "input": "hello", "stream": True}
            async with http.stream("POST", g.url + "/v1/responses", json=body) as r:
                assert r.status_code == 200
                streamed = parsed(await r.aread())
            types = [e["type"] for e in streamed]
            assert types[:3] == ["response.created", "response.in_progress", "response.output_item.added"]
            assert types[-1] == "response.completed"
            assert [e["sequence_number"] for e in streamed] == list(range(len(streamed)))
            refused = await http.post(
                g.url + "/v1/responses", json={**body, "max_output_tokens": ScriptedEngine.MOST_TOKENS + 1}
            )
            assert refused.status_code == 400, refused.text
            assert refused.json()["error"]["param"] == "max_output_tokens"
            job = await g.broker.get(refused.headers["x-sluice-job-id"])
            assert job is not None and job.state is JobState.FAILED
