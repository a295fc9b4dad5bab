from __future__ import annotations

from sluice.core.cost import estimate_chat_tokens, estimate_prompt_tokens
from sluice.core.job import Endpoint, Job, JobError, JobState


def test_prompt_estimates() -> None:
    assert estimate_prompt_tokens("a" * 400) == 100
    assert estimate_prompt_tokens("") == 1
    assert estimate_prompt_tokens([1, 2, 3]) == 3
    assert estimate_prompt_tokens(["abcd", "abcdefgh"]) == 3


def test_chat_estimate_grows_with_messages_and_parts() -> None:
    one = estimate_chat_tokens([{"role": "user", "content": "a" * 40}])
    two = estimate_chat_tokens([{"role": "system", "content": "b"}, {"role": "user", "content": "a" * 40}])
    assert two > one > 10
    parts = estimate_chat_tokens([{"role": "user", "content": [{"type": "text", "text": "a" * 40}]}])
    assert parts == one


def test_job_round_trip_and_cost() -> None:
    job = Job(
        id="job_x",
        model="m",
        endpoint=Endpoint.COMPLETIONS,
        body={"prompt": "hi"},
        tenant="t",
        priority="normal",
        prompt_tokens=7,
        max_tokens=9,
        created_at=1.0,
        deadline=2.0,
        state=JobState.FAILED,
        error=JobError("boom", "server_error", "engine_error"),
    )
    assert job.cost == 16 and job.terminal
    assert Job.from_dict(job.to_dict()) == job
    assert Endpoint.COMPLETIONS.path == "/v1/completions"
