"""The memory broker's claim with many tenants kept: Python calls and bytecode instructions per
claim, counts that the machine's other load does not move.

The broker keeps ``--tenants`` idle tenants (each sent a job with a key of its own requests per
minute, run and finished: the tenant stays for its bucket's level, with no job); then, ``--ops``
times, one job of another tenant is admitted and claimed, and only the claim (which finds the job
at once) is counted: its calls by a profile hook (``call`` and ``c_call`` events) and its bytecode
instructions by a trace hook (``opcode`` events), each in a pass of its own.

Usage: python -m sluice.bench.claim_tenants [--tenants 0,1000] [--ops 200]
"""

from __future__ import annotations

import argparse
import asyncio
import sys
from types import FrameType
from typing import Any

from sluice.bench.broker_cycles import MODEL, make_job, settings
from sluice.broker.memory import MemoryBroker
from sluice.core.job import JobState
from sluice.core.ratelimit import TenantLimits

W = "worker-1"


class Counter:
    """The events a hook saw."""

    def __init__(self) -> None:
        self.n = 0

    def profile(self, frame: FrameType, event: str, arg: Any) -> None:
        if event in ("call", "c_call"):
            self.n += 1

    def trace(self, frame: FrameType, event: str, arg: Any) -> Any:
        if event == "call":
            frame.f_trace_opcodes = True
        elif event == "opcode":
            self.n += 1
        return self.trace


async def per_claim(tenants: int, ops: int, kind: str) -> float:
    """Calls (``kind`` 'calls') or instructions ('opcodes') per claim with ``tenants`` idle tenants."""
    broker = MemoryBroker(settings())
    for i in range(tenants):
        job = make_job(i)
        job.tenant = f"idle-{i}"
        await broker.admit(job, TenantLimits(job.tenant, rpm=1_000_000))
        claimed = await broker.claim(W, [MODEL], timeout=1.0)
        assert claimed is not None
        await broker.finish(claimed.id, W, JobState.SUCCEEDED)
    assert len(broker._tenants) == tenants  # kept for their buckets, with no job
    counter = Counter()
    for i in range(ops):
        await broker.admit(make_job(i))
        if kind == "calls":
            sys.setprofile(counter.profile)
        else:
            sys.settrace(counter.trace)
        try:
            claimed = await broker.claim(W, [MODEL], timeout=1.0)  # finds its job: no wait
        finally:
            sys.setprofile(None)
            sys.settrace(None)
        assert claimed is not None
        await broker.finish(claimed.id, W, JobState.SUCCEEDED)
    return counter.n / ops


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m sluice.bench.claim_tenants", description=__doc__)
    parser.add_argument("--tenants", default="0,1000", help="idle tenants kept, comma-separated")
    parser.add_argument("--ops", type=int, default=200)
    args = parser.parse_args()
    print(f"{'idle tenants':>12}  {'calls/claim':>11}  {'opcodes/claim':>13}")
    for tenants in (int(t) for t in args.tenants.split(",")):
        calls = asyncio.run(per_claim(tenants, args.ops, "calls"))
        opcodes = asyncio.run(per_claim(tenants, args.ops, "opcodes"))
        print(f"{tenants:>12}  {calls:>11.1f}  {opcodes:>13.1f}")


if __name__ == "__main__":
    main()
