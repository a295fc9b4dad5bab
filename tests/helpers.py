"""Small helpers shared by the tests."""

from __future__ import annotations

import asyncio
import socket
import time
from collections.abc import Awaitable, Callable
from typing import Any

from sluice.core.job import Endpoint, Job, new_job_id


class FakeClock:
    """A wall clock that moves only when told to."""

    def __init__(self, start: float = 1_800_000_000.0) -> None:
        self.t = start

    def __call__(self) -> float:
        return self.t

    def advance(self, seconds: float) -> None:
        self.t += seconds


def make_job(
    clock: Callable[[], float] = time.time,
    *,
    model: str = "m",
    tenant: str = "t",
    priority: str = "normal",
    prompt_tokens: int = 10,
    max_tokens: int = 20,
    timeout: float = 600.0,
    idempotency_key: str | None = None,
    max_attempts: int = 3,
) -> Job:
    now = clock()
    return Job(
        id=new_job_id(),
        model=model,
        endpoint=Endpoint.CHAT,
        body={"model": model, "messages": [{"role": "user", "content": "hi"}], "max_tokens": max_tokens},
        tenant=tenant,
        priority=priority,
        prompt_tokens=prompt_tokens,
        max_tokens=max_tokens,
        created_at=now,
        deadline=now + timeout,
        idempotency_key=idempotency_key,
        max_attempts=max_attempts,
    )


async def wait_until(predicate: Callable[[], Awaitable[bool] | bool], timeout: float = 10.0) -> None:
    """Poll ``predicate`` until it holds; fail the test after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value: Any = predicate()
        if asyncio.iscoroutine(value) or isinstance(value, Awaitable):
            value = await value
        if value:
            return
        if time.monotonic() > deadline:
            raise AssertionError(f"condition not met within {timeout} s")
        await asyncio.sleep(0.02)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])
