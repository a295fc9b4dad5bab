"""Redis time per token event: what a streamed answer costs the Redis broker beyond its
admit → claim → finish cycle (docs/batches.md, "When is the Redis queue the bottleneck?").

A job whose tokens someone reads (``Job.stream_tokens``) has one ``publish`` per engine chunk, each
appending to the job's event stream, and the gateway reads them back; a job nobody streams (a batch
line, a Kafka request, a synchronous request without ``stream``) asks the engine for the whole
answer and has one event. This admits and claims ``--jobs`` jobs, publishes ``--tokens`` token
events to each from that many concurrent tasks, finishes them, and reads every stream back, on a
``redis-server`` of its own, and reports redis-server's CPU per operation (robust to the machine's
other load, unlike wall-clock rates).

With ``--memory``, the memory broker's side instead, in one process: ``--live`` streams at once
(32, the closed loop's connections), their token events published in turn as a saturated
gateway's dispatcher publishes them, each job finished after ``--tokens`` and packed once
``--keep`` more tokens have been published (the upkeep's ``PACK_AFTER_S``, 1 s, at the 16,000 tokens
a second of a saturated gateway streaming 64-token answers), with the gateway's collector settings
(the start-up frozen, the young generation's threshold ``YOUNG_GC_THRESHOLD``). It prints the
collector's passes per generation and the process's CPU per token. Its instructions per token are a
figure the machine's load does not move: under valgrind's callgrind, two ``--jobs`` and the
difference of the totals over the difference of the tokens.

Usage: python -m sluice.bench.token_events [--jobs 200] [--tokens 128]
       python -m sluice.bench.token_events --memory [--jobs 1200] [--tokens 64] [--live 32] [--keep 16000]
"""

from __future__ import annotations

import argparse
import asyncio
import collections
import gc
import os
import time
from typing import Any

from sluice.bench.broker_cycles import make_job, redis_cpu_s, redis_server, settings
from sluice.broker.base import EventType
from sluice.broker.memory import MemoryBroker
from sluice.broker.redis import RedisBroker
from sluice.core.job import Job, JobState
from sluice.roles.http import YOUNG_GC_THRESHOLD

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


def token_event(i: int) -> dict[str, Any]:
    """A chat token's event as the dispatcher publishes it for the simulator's chunk ``i``."""
    delta = {"content": f" w{i % 97}"}
    return {"choices": [{"index": 0, "delta": delta, "logprobs": None, "finish_reason": None}]}


async def memory_streams(jobs: int, tokens: int, live: int, keep: int) -> tuple[int, list[int], float]:
    """``jobs`` streams of ``tokens`` token events, ``live`` at once, on a memory broker (see the
    module): the tokens published, the collector's passes per generation, CPU µs per token. The
    collector is set as the gateway sets it (roles.http.quiet_gc) and put back after."""
    threshold = gc.get_threshold()
    gc.collect()
    gc.freeze()
    gc.set_threshold(YOUNG_GC_THRESHOLD, threshold[1], threshold[2])
    try:
        passes = [g["collections"] for g in gc.get_stats()]
        started = time.process_time()
        published = await _publish_streams(MemoryBroker(settings()), jobs, tokens, live, keep)
        spent = time.process_time() - started
        done = [g["collections"] - before for g, before in zip(gc.get_stats(), passes, strict=True)]
    finally:
        gc.set_threshold(*threshold)
        gc.unfreeze()
    return published, done, spent / max(published, 1) * 1e6


async def _publish_streams(broker: MemoryBroker, jobs: int, tokens: int, live: int, keep: int) -> int:
    running: list[list[Any]] = []  # [job, tokens published]
    ended: collections.deque[tuple[int, str]] = collections.deque()  # (tokens published then, job id)
    admitted = published = 0

    async def start() -> None:
        nonlocal admitted
        await broker.admit(make_job(admitted))
        admitted += 1
        job = await broker.claim("w1", [make_job(0).model], 1.0)
        assert job is not None
        running.append([job, 0])

    for _ in range(min(live, jobs)):
        await start()
    while running:
        for entry in list(running):
            job, n = entry
            await broker.publish(job.id, EventType.TOKEN, token_event(n))
            published += 1
            entry[1] = n + 1
            if n + 1 == tokens:
                usage = {"total_tokens": tokens}
                await broker.finish(job.id, "w1", JobState.SUCCEEDED, result={}, usage=usage)
                running.remove(entry)
                ended.append((published, job.id))
                if admitted < jobs:
                    await start()
            while ended and ended[0][0] <= published - keep:
                broker._records[ended.popleft()[1]].pack()  # the upkeep's pack, by the token count
    return published


def main() -> None:
    parser = argparse.ArgumentParser(
        description=__doc__.split("\n\n")[0],
        epilog=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--jobs", type=int, default=None, help="200 (Redis), 1200 (--memory)")
    parser.add_argument("--tokens", type=int, default=None, help="128 (Redis), 64 (--memory)")
    parser.add_argument("--memory", action="store_true", help="the memory broker's token events (see above)")
    parser.add_argument("--live", type=int, default=32, help="--memory: streams at once")
    parser.add_argument(
        "--keep", type=int, default=16000, help="--memory: tokens between a job's end and its pack"
    )
    args = parser.parse_args()
    if args.memory:
        jobs, tokens = args.jobs or 1200, args.tokens or 64
        published, passes, us = asyncio.run(memory_streams(jobs, tokens, args.live, args.keep))
        print(
            f"memory broker, {jobs} jobs x {tokens} token events, {args.live} at once: {published} tokens, "
            f"collector passes per generation {passes}, {us:.2f} µs of CPU per token"
        )
        return
    args.jobs, args.tokens = args.jobs or 200, args.tokens or 128
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
