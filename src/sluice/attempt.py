"""One attempt of a job on an engine, once the dispatcher has chosen the engine and reserved room
on it: the reservation (:class:`Hold`), the engine's answer streamed and each token published
(:func:`generate`), and what the answer or the failure tells of the engine: its in-flight limit
learns from the stream's timing (:func:`observe`), its health and limit from a failure
(:func:`note_failure`). Which job runs, where, when, and whether a failed one is tried again is the
dispatcher's (:mod:`sluice.dispatcher`); this module holds no state of its own.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass, replace
from typing import TypeGuard

from sluice.backends.base import BackendError
from sluice.broker.base import Broker, EventType
from sluice.core.concurrency import StreamSample
from sluice.core.job import Job, JobError
from sluice.fleet import Engine
from sluice.protocol import Assembler

# The dispatcher's logger: an engine's failure is a line of the worker's log, as it always was.
log = logging.getLogger("sluice.worker")

#: an engine's answer that says it is full (its limit should come down), not broken
OVERLOAD_STATUS = frozenset({429, 503})


@dataclass(frozen=True, slots=True)
class Hold:
    """A job's reservation on an engine: what it took, and the engine model it asks for."""

    engine: Engine
    #: slots taken (kept: the engine's limit, and so a wide job's width, may change meanwhile)
    width: int
    #: tokens of the engine's budget taken
    cost: int
    #: the engine model name the attempt asks for (an alias's draw, else the job's model)
    target: str


async def generate(broker: Broker, job: Job, hold: Hold) -> tuple[Assembler, bool]:
    """Run one attempt on the held engine, each chunk with choices published as a TOKEN event;
    what it measured of the stream feeds the engine's limit and speed. Returns the assembled
    answer, and whether the engine's limit moved (the capacity the dispatcher offers changed).

    A token event is the chunk's choices beside its own fields as the engine sent them
    (``Assembler.last_fields``: ``system_fingerprint``, ``service_tier``, ...), so that a relayed
    chunk says what the engine's said: a chunk less its identity and usage. Built here alone, as a
    dict display, not by a method: a call per token (memory_wakeup --whole 47.6 -> 48.6 calls a
    token with one)."""
    engine = hold.engine
    assembler = Assembler(job)
    # The engine is asked for its own model name (an alias's target), the client answered in
    # the name it asked for.
    sent = (
        job if job.body.get("model") == hold.target else replace(job, body={**job.body, "model": hold.target})
    )
    inflight = engine.inflight
    started = time.monotonic()
    # At once, not a whole answer later: the limit binds (slow start grows from it).
    engine.limiter.on_dispatch(inflight)
    first: float | None = None
    chunks = 0
    backend = engine.backend
    if not job.stream_tokens and backend.whole_answers:
        # One chunk, the whole answer, from one call: no async generator made, hooked, iterated
        # and closed around it (a short request's whole engine call).
        choices = assembler.add(await backend.whole(sent))
        if choices:
            first = time.monotonic()
            chunks = 1
            await broker.publish(job.id, EventType.TOKEN, {**assembler.last_fields, "choices": choices})
        return assembler, observe(engine, job, assembler, inflight, started, first, chunks)
    stream = backend.stream(sent)
    try:
        async for data in stream:
            choices = assembler.add(data)
            if choices:
                if first is None:
                    first = time.monotonic()
                    if job.stream_tokens:
                        # queueing inside the engine shows in the first token, not the end
                        engine.limiter.on_first_token(inflight, first - started)
                chunks += 1
                await broker.publish(job.id, EventType.TOKEN, {**assembler.last_fields, "choices": choices})
    finally:
        await stream.aclose()  # type: ignore[attr-defined]
    moved = observe(engine, job, assembler, inflight, started, first, chunks)
    return assembler, moved


def observe(
    engine: Engine,
    job: Job,
    assembler: Assembler,
    inflight: int,
    started: float,
    first: float | None,
    chunks: int,
) -> bool:
    """Feed the engine's limit a finished stream: its first token's time and the mean time of
    each token after it, per sequence (a whole answer, not streamed, gives only the mean time
    per token over all of it). Returns whether the limit moved."""
    ended = time.monotonic()
    usage = assembler.final_usage() or {}
    out = usage.get("completion_tokens")
    prompt = usage.get("prompt_tokens")
    output_tokens = out if count(out) else chunks
    prompt_tokens = prompt if count(prompt) else job.prompt_tokens
    per_sequence = output_tokens / max(job.sequences, 1)
    ttft: float | None = None
    tpot: float | None = None
    if job.stream_tokens and first is not None:
        ttft = first - started
        engine.observe_ttft(ttft)
        if per_sequence >= 2:
            tpot = (ended - first) / (per_sequence - 1)
    elif per_sequence >= 2:
        tpot = (ended - started) / per_sequence
    before = engine.limit
    engine.limiter.on_sample(
        StreamSample(
            inflight=inflight,
            ttft_s=ttft,
            tpot_s=tpot,
            output_tokens=output_tokens,
            prompt_tokens=prompt_tokens,
        )
    )
    return engine.limit != before


def note_failure(engine: Engine, exc: BackendError) -> None:
    """What a failed attempt tells of the engine: a refusal that it is up, an overload that its
    limit must come down, a broken answer that it may be ejected (health)."""
    now = time.monotonic()
    if not exc.retryable:
        # The engine answered (it refused the request itself): it is up, and a probe is over.
        engine.health.on_success(now)
        return
    engine.failures += 1
    if exc.status in OVERLOAD_STATUS:
        engine.limiter.on_overload()
    if exc.status != 429:  # "too many" is a full engine, not a broken one
        engine.health.on_failure(now)
    else:
        engine.health.probe_in_flight = False
    log.warning("backend %s failed: %s", engine.name, exc.detail)


def count(value: object) -> TypeGuard[int]:
    """Whether a usage field is a count (an int, not a bool)."""
    return isinstance(value, int) and not isinstance(value, bool)


def job_error(exc: BackendError, attempts: int = 1) -> JobError:
    """The job's error for the engine's failure; after several attempts it says how many (the
    client is then told not to retry: Sluice did)."""
    message = exc.message if attempts <= 1 else f"{exc.message} (gave up after {attempts} attempts)"
    return JobError(message, exc.type, exc.code, exc.param)
