"""One attempt (attempt.py): the token events :func:`generate` publishes, the one place a token
event is built (a chunk's choices beside its own fields as the engine sent them, never its
identity, usage or padding), for a stream and for a whole answer."""

from __future__ import annotations

from collections.abc import AsyncIterator
from typing import Any

from sluice.attempt import Hold, generate
from sluice.backends.base import Backend
from sluice.broker.base import BrokerSettings, EventType
from sluice.broker.memory import MemoryBroker
from sluice.core.job import Job
from sluice.fleet import Engine, PoolSpec
from tests.helpers import make_job

HEAD = {"id": "chatcmpl-engine", "object": "chat.completion.chunk", "created": 1, "model": "gpt"}


def delta(content: str, **extra: Any) -> dict[str, Any]:
    return {"choices": [{"index": 0, "delta": {"content": content, **extra}, "finish_reason": None}]}


#: each chunk an engine sends, and the token event it must give: its own fields as it sent them
CHUNKS: list[tuple[dict[str, Any], dict[str, Any]]] = [
    (
        {**HEAD, "system_fingerprint": "fp_1", "service_tier": "default", "obfuscation": "x", **delta("Hi")},
        {"system_fingerprint": "fp_1", "service_tier": "default", **delta("Hi")},
    ),
    # another fingerprint and a field of its own: the event says what this chunk said
    (
        {**HEAD, "system_fingerprint": "fp_2", "timings": {"n": 1}, **delta("!")},
        {"system_fingerprint": "fp_2", "timings": {"n": 1}, **delta("!")},
    ),
    # nothing but choices: an event of nothing but choices
    (delta("?"), delta("?")),
]
#: a usage-only chunk publishes nothing
USAGE_ONLY = {**HEAD, "choices": [], "usage": {"prompt_tokens": 1, "completion_tokens": 3, "total_tokens": 4}}


class ScriptBackend(Backend):
    """Streams :data:`CHUNKS` and the usage; answers a whole job with the first chunk alone."""

    def __init__(self, whole_answers: bool) -> None:
        super().__init__("e", max_concurrency=4, models=["m"])
        self.whole_answers = whole_answers

    async def discover_models(self) -> list[str]:
        return ["m"]

    async def healthy(self) -> bool:
        return True

    async def stream(self, job: Job) -> AsyncIterator[dict[str, Any]]:
        for data, _ in CHUNKS:
            yield data
        yield USAGE_ONLY

    async def whole(self, job: Job) -> dict[str, Any]:
        return CHUNKS[0][0]


class Recording(MemoryBroker):
    def __init__(self) -> None:
        super().__init__(BrokerSettings())
        self.published: list[tuple[str, EventType, dict[str, Any]]] = []

    async def publish(self, job_id: str, type: EventType, data: dict[str, Any]) -> None:
        self.published.append((job_id, type, data))


async def attempt(stream_tokens: bool, whole_answers: bool) -> list[tuple[str, EventType, dict[str, Any]]]:
    backend = ScriptBackend(whole_answers)
    engine = Engine(backend, "p", "e", PoolSpec("p", max_concurrency=4, adaptive=False).limiter())
    job = make_job()
    job.stream_tokens = stream_tokens
    broker = Recording()
    assembler, _ = await generate(broker, job, Hold(engine, 1, job.cost, "m"))
    assert assembler.response()["system_fingerprint"] == ("fp_2" if len(broker.published) > 1 else "fp_1")
    assert {job_id for job_id, _, _ in broker.published} == {job.id}
    return broker.published


async def test_a_streamed_attempt_publishes_each_chunks_choices_beside_its_own_fields() -> None:
    for stream_tokens, whole_answers in [(True, True), (True, False), (False, False)]:
        published = await attempt(stream_tokens, whole_answers)
        assert [t for _, t, _ in published] == [EventType.TOKEN] * len(CHUNKS)
        assert [data for _, _, data in published] == [event for _, event in CHUNKS]


async def test_a_whole_answer_is_one_token_event_with_its_own_fields() -> None:
    published = await attempt(stream_tokens=False, whole_answers=True)
    assert [(t, data) for _, t, data in published] == [(EventType.TOKEN, CHUNKS[0][1])]
