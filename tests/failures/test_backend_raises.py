"""A backend that raises, whatever it raises: the job fails with an error at once, the dispatcher
keeps running the next jobs, and no log line holds the prompt.

Before, any exception other than BackendError (a lone surrogate's UnicodeEncodeError while the
engine request was encoded) killed the job's task: the job sat "running" until its lease ran out,
was retried into the same failure until its attempts were spent, and every death was logged by
asyncio with the task's repr, the prompt in it.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import AsyncIterator, Callable
from typing import Any

import pytest

from sluice.backends.base import Backend
from sluice.backends.openai import OpenAIBackend
from sluice.broker.base import BrokerSettings
from sluice.broker.memory import MemoryBroker
from sluice.core.job import Job, JobState
from sluice.dispatcher import Dispatcher
from sluice.logs import JsonFormatter, TextFormatter
from tests.helpers import make_job

MARKER = "MARKER-7f3a-the-prompt-must-never-reach-a-log"


def job_with(text: str, **kwargs: Any) -> Job:
    job = make_job(**kwargs)
    job.body["messages"] = [{"role": "user", "content": text}]
    return job


class RaisingBackend(Backend):
    """Raises ``error(prompt)`` for prompts that ask for it (holding the prompt, as an encoder's
    error does), answers the others."""

    def __init__(self) -> None:
        super().__init__("raising", max_concurrency=2, models=["m"])

    async def discover_models(self) -> list[str]:
        return ["m"]

    async def healthy(self) -> bool:
        return True

    async def stream(self, job: Job) -> AsyncIterator[dict[str, Any]]:
        prompt = job.body["messages"][0]["content"]
        if "unicode" in prompt:
            raise UnicodeEncodeError("utf-8", prompt, 0, 1, "surrogates not allowed")
        if "key" in prompt:
            raise KeyError(prompt)
        if "runtime" in prompt:
            raise RuntimeError(f"bad state while sending {prompt!r}")
        yield {"choices": [{"index": 0, "delta": {"content": "ok"}, "finish_reason": "stop"}]}


@pytest.fixture
def log_lines(caplog: pytest.LogCaptureFixture) -> Callable[[], list[str]]:
    """Every record of every logger so far, as each of Sluice's formatters writes it."""
    caplog.set_level(logging.DEBUG)

    def lines() -> list[str]:
        formatters = (JsonFormatter(), TextFormatter("%(message)s"))
        return [f.format(record) for record in caplog.records for f in formatters]

    return lines


async def run(backend: Backend, jobs: list[Job]) -> list[Job]:
    broker = MemoryBroker(BrokerSettings(lease_s=2.0))
    dispatcher = Dispatcher(broker, [backend])
    async with broker:
        await dispatcher.start()
        try:
            for job in jobs:
                await broker.admit(job)
            finished = [await broker.wait(job.id, 10) for job in jobs]
            assert all(task.done() is False for task in dispatcher._tasks), "a dispatcher loop died"
        finally:
            await dispatcher.stop()
    assert all(j is not None for j in finished)
    return [j for j in finished if j is not None]


@pytest.mark.parametrize("kind", ["unicode", "key", "runtime"])
async def test_a_backend_that_raises_fails_the_job_and_the_dispatcher_goes_on(
    kind: str, log_lines: Callable[[], list[str]]
) -> None:
    failing = job_with(f"{kind} {MARKER}", max_attempts=3)
    after = job_with("fine")
    failed, served = await run(RaisingBackend(), [failing, after])
    # At once, in one attempt: the same failure would come again on every retry.
    assert failed.state is JobState.FAILED and failed.attempts == 1
    assert failed.error is not None and failed.error.code == "internal_error"
    assert MARKER not in failed.error.message
    assert served.state is JobState.SUCCEEDED
    await asyncio.sleep(0)  # let any dead task be reported
    lines = log_lines()
    assert any("unexpected error" in line for line in lines)
    assert not [line for line in lines if MARKER in line]


async def test_a_body_with_no_json_form_fails_as_the_clients_error(
    sim_url: str, log_lines: Callable[[], list[str]]
) -> None:
    """A job that reached a worker with a lone surrogate (queued by a build without the door's
    check): the engine request cannot be encoded, which is the request's fault, not the engine's."""
    backend = OpenAIBackend(sim_url, models=["sim"])
    try:
        failing = job_with(f"\ud800 {MARKER}", model="sim")
        after = job_with("fine", model="sim")
        failed, served = await run(backend, [failing, after])
    finally:
        await backend.aclose()
    assert failed.state is JobState.FAILED and failed.attempts == 1
    assert failed.error is not None and failed.error.type == "invalid_request_error"
    assert failed.error.code == "invalid_value"
    assert served.state is JobState.SUCCEEDED
    assert not [line for line in log_lines() if MARKER in line]
    json.dumps(failed.error.to_dict())  # the error record itself has a JSON form
