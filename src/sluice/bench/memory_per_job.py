"""Memory the embedded broker holds per queued job, beyond the request body.

Queues N jobs (default 100,000) whose bodies are shared, so that the measure is the broker's own
bookkeeping: the job record, its queue entry, its deadline entry and its first event. Measured with
tracemalloc (every Python allocation, not the process RSS).

Usage: python -m sluice.bench.memory_per_job [--jobs 100000] [--tenants 100]
"""

from __future__ import annotations

import argparse
import asyncio
import gc
import time
import tracemalloc

from sluice.broker.base import BrokerSettings
from sluice.broker.memory import MemoryBroker
from sluice.core.admission import Bounds, QueueLimits
from sluice.core.job import Endpoint, Job, new_job_id

BODY = {"model": "m", "messages": [{"role": "user", "content": "hello " * 20}], "max_tokens": 128}


async def main(jobs: int, tenants: int) -> None:
    broker = MemoryBroker(BrokerSettings(default_limits=QueueLimits(Bounds(max_jobs=None))))
    now = time.time()
    gc.collect()
    tracemalloc.start()
    before = tracemalloc.get_traced_memory()[0]
    for i in range(jobs):
        job = Job(
            id=new_job_id(),
            model="m",
            endpoint=Endpoint.CHAT,
            body=BODY,  # shared: the body is the client's, not the broker's overhead
            tenant=f"tenant-{i % tenants}",
            priority="normal",
            prompt_tokens=40,
            max_tokens=128,
            created_at=now,
            deadline=now + 600,
        )
        await broker.admit(job)
    gc.collect()
    after = tracemalloc.get_traced_memory()[0]
    tracemalloc.stop()
    stats = (await broker.stats())["m"]
    assert stats.queued_jobs == jobs
    per_job = (after - before) / jobs
    total_mib = (after - before) / 2**20
    print(f"{jobs} jobs queued ({tenants} tenants): {total_mib:.1f} MiB, {per_job:.0f} bytes per job")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m sluice.bench.memory_per_job",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--jobs", type=int, default=100_000)
    parser.add_argument("--tenants", type=int, default=100)
    args = parser.parse_args()
    asyncio.run(main(args.jobs, args.tenants))
