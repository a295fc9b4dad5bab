"""Redis time per token event: what a streamed answer costs the Redis broker beyond its
admit → claim → finish cycle (docs/batches.md, "When is the Redis queue the bottleneck?").

A job whose tokens someone reads (``Job.stream_tokens``) has one ``publish`` per engine chunk, each
appending to the job's event stream, and the gateway reads them back; a job nobody streams (a batch
line, a Kafka request, a synchronous request without ``stream``) asks the engine for the whole
answer and has one event. This admits and claims ``--jobs`` jobs, publishes ``--tokens`` token
events to each from that many concurrent tasks, finishes them, and reads every stream back, on a
``redis-server`` of its own, and reports redis-server's CPU per operation (robust to the machine's
other load, unlike wall-clock rates).

Usage: python -m sluice.bench.token_events [--jobs 200] [--tokens 128]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import time

from sluice.bench.broker_cycles import make_job, redis_cpu_s, redis_server, settings
from sluice.broker.base import EventType
from sluice.broker.redis import RedisBroker
from sluice.core.job import Job, JobState

# One chat token as an engine streams it, as the dispatcher publishes it (attempt.generate).
EVENT = {
    "system_fingerprint": "fp",
    "choices": [{"index": 0, "delta": {"content": " word"}, "logprobs": None, "finish_reason": None}],
}


async def measure(url: str, jobs: int, tokens: int) -> dict[str, float]:
    """Redis CPU (µs) per token event published, per finish, and per event read back."""
    async with RedisBroker(url, settings()) as broker:
        for i in range(jobs):
            await broker.admit(make_job(i))
        claimed: list[Job] = []
        while len(claimed) < jobs:
            job = await broker.claim("w1", [make_job(0).model], 1.0)
            if job is not None:
                claimed.append(job)

        async def publish(job: Job) -> None:
            for _ in range(tokens):
                await broker.publish(job.id, EventType.TOKEN, EVENT)

        before = redis_cpu_s(url)
        await asyncio.gather(*(publish(job) for job in claimed))
        per_event = (redis_cpu_s(url) - before) / (jobs * tokens)

        before = redis_cpu_s(url)
        for job in claimed:
            await broker.finish(job.id, "w1", JobState.SUCCEEDED, result={"choices": []})
        per_finish = (redis_cpu_s(url) - before) / jobs

        async def read(job: Job) -> int:
            return len([e async for e in broker.events(job.id, 0, timeout=5)])

        before = redis_cpu_s(url)
        read_back = sum(await asyncio.gather(*(read(job) for job in claimed)))
        per_read = (redis_cpu_s(url) - before) / read_back
    return {"publish_us": per_event * 1e6, "finish_us": per_finish * 1e6, "read_us": per_read * 1e6}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--jobs", type=int, default=200)
    parser.add_argument("--tokens", type=int, default=128)
    args = parser.parse_args()
    with redis_server() as url:
        began = time.monotonic()
        figures = asyncio.run(measure(url, args.jobs, args.tokens))
    print(
        f"{args.jobs} jobs x {args.tokens} token events, redis-server CPU: "
        f"{figures['publish_us']:.1f} µs per token event published, {figures['read_us']:.1f} µs per "
        f"event read back, {figures['finish_us']:.0f} µs per finish "
        f"({time.monotonic() - began:.1f} s, load average {os.getloadavg()[0]:.1f})"
    )


if __name__ == "__main__":
    main()
