"""CPU per streamed token of the memory broker's live event path, in one process: a publisher
(standing for the dispatcher) publishes token events to one running job, and a reader of
``broker.events`` (standing for the relay) takes each as it comes; between two publishes the
publisher yields one turn of the event loop, as the dispatcher waits for its next engine chunk.
Reported: the process's CPU time per token (publish, the reader's wake-up, the bare turn), robust
to the machine's other load unlike a wall-clock rate. uvloop, as the gateway runs.

Usage: python -m sluice.bench.memory_wakeup [--tokens 20000] [--runs 3]
"""

from __future__ import annotations

import argparse
import asyncio
import time

import uvloop

from sluice.bench.broker_cycles import MODEL, make_job, settings
from sluice.bench.token_events import EVENT
from sluice.broker.base import EventType
from sluice.broker.memory import MemoryBroker
from sluice.core.job import JobState


async def per_token_us(tokens: int) -> float:
    """CPU µs per token published to and read from one running job."""
    async with MemoryBroker(settings()) as broker:
        job = make_job(0)
        await broker.admit(job)
        claimed = await broker.claim("bench", [MODEL], timeout=1.0)
        assert claimed is not None and claimed.id == job.id
        read = 0

        async def reader() -> None:
            nonlocal read
            async for _ in broker.events(job.id):
                read += 1

        reading = asyncio.create_task(reader())
        await asyncio.sleep(0)  # the reader is waiting before the first token
        start = time.process_time()
        for _ in range(tokens):
            await broker.publish(job.id, EventType.TOKEN, EVENT)
            await asyncio.sleep(0)  # the dispatcher's wait for its next chunk
        spent = time.process_time() - start
        await broker.finish(job.id, "bench", JobState.SUCCEEDED, result={}, usage={})
        await reading
        assert read >= tokens, f"the reader took {read} events of {tokens}"
        return spent / tokens * 1e6


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m sluice.bench.memory_wakeup", description=__doc__)
    parser.add_argument("--tokens", type=int, default=20000)
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    for _ in range(args.runs):
        print(f"{uvloop.run(per_token_us(args.tokens)):.2f} µs of CPU per token")


if __name__ == "__main__":
    main()
