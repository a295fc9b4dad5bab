"""The memory broker's claim and admission with many tenants kept: Python calls and bytecode
instructions per claim and per admission, counts that the machine's other load does not move.

The broker keeps ``--tenants`` idle tenants (each sent a job with a key of its own requests per
minute, run and finished: the tenant stays for its bucket's level, with no job); then, ``--ops``
times, one job of another tenant is admitted and claimed, and only the claim (which finds the job
at once), or only the admission, is counted: its calls by a profile hook (``call`` and ``c_call``
events) and its bytecode instructions by a trace hook (``opcode`` events), each in a pass of its
own. ``--backlogged``: the tenants kept each have a job queued instead (a client that made up that
many tenant ids and queued one job under each); the admission's fair view reads every backlog of
its class (``ClassScheduler.fair_view``, as admit.lua does), so its count grows with them.

Usage: python -m sluice.bench.claim_tenants [--tenants 0,1000] [--ops 200] [--backlogged]
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import gc
import sys
from collections.abc import Iterator
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


@contextlib.contextmanager
def _no_collector() -> Iterator[None]:
    """The collector held off while counting: a pass it makes inside a counted call runs the
    finalizers of whatever garbage is about (another test's in one pytest process), counted too."""
    gc.collect()
    was = gc.isenabled()
    gc.disable()
    try:
        yield
    finally:
        if was:
            gc.enable()


def _hook(counter: Counter, kind: str) -> None:
    if kind == "calls":
        sys.setprofile(counter.profile)
    else:
        sys.settrace(counter.trace)


def _unhook() -> None:
    sys.setprofile(None)
    sys.settrace(None)


async def _kept(tenants: int, *, backlogged: bool = False) -> MemoryBroker:
    """A broker keeping ``tenants`` tenants of their own: idle (a job run and finished, its key's
    bucket kept), or ``backlogged`` (a job queued each)."""
    broker = MemoryBroker(settings())
    for i in range(tenants):
        job = make_job(i)
        job.tenant = f"idle-{i}"
        await broker.admit(job, TenantLimits(job.tenant, rpm=1_000_000))
        if backlogged:
            continue
        claimed = await broker.claim(W, [MODEL], timeout=1.0)
        assert claimed is not None
        await broker.finish(claimed.id, W, JobState.SUCCEEDED)
    assert len(broker._tenants) == tenants  # kept for their buckets (and jobs, if backlogged)
    return broker


async def per_claim(tenants: int, ops: int, kind: str) -> float:
    """Calls (``kind`` 'calls') or instructions ('opcodes') per claim with ``tenants`` idle tenants."""
    broker = await _kept(tenants)
    counter = Counter()
    with _no_collector():
        for i in range(ops):
            await broker.admit(make_job(i))
            _hook(counter, kind)
            try:
                claimed = await broker.claim(W, [MODEL], timeout=1.0)  # finds its job: no wait
            finally:
                _unhook()
            assert claimed is not None
            await broker.finish(claimed.id, W, JobState.SUCCEEDED)
    return counter.n / ops


async def per_admit(tenants: int, ops: int, kind: str, *, backlogged: bool = False) -> float:
    """Calls or instructions per admission (of one of 8 tenants, no key) with ``tenants`` tenants
    kept, idle or ``backlogged``; each admitted job is claimed and finished, uncounted, so that the
    queue stays as it was."""
    broker = await _kept(tenants, backlogged=backlogged)
    counter = Counter()
    with _no_collector():
        for i in range(ops):
            job = make_job(i)
            _hook(counter, kind)
            try:
                await broker.admit(job)
            finally:
                _unhook()
            if not backlogged:  # the kept tenants' jobs would be claimed first: this one stays queued
                claimed = await broker.claim(W, [MODEL], timeout=1.0)
                assert claimed is not None and claimed.id == job.id
                await broker.finish(claimed.id, W, JobState.SUCCEEDED)
    return counter.n / ops


def main() -> None:
    parser = argparse.ArgumentParser(prog="python -m sluice.bench.claim_tenants", description=__doc__)
    parser.add_argument("--tenants", default="0,1000", help="tenants kept, comma-separated")
    parser.add_argument("--ops", type=int, default=200)
    parser.add_argument("--backlogged", action="store_true", help="each kept tenant has a job queued")
    args = parser.parse_args()
    kept = "backlogged" if args.backlogged else "idle tenants"
    print(
        f"{kept:>12}  {'calls/claim':>11}  {'opcodes/claim':>13}  {'calls/admit':>11}  {'opcodes/admit':>13}"
    )
    for tenants in (int(t) for t in args.tenants.split(",")):
        claim = ["-", "-"]
        if not args.backlogged:
            claim = [f"{asyncio.run(per_claim(tenants, args.ops, k)):.1f}" for k in ("calls", "opcodes")]
        admit = [
            f"{asyncio.run(per_admit(tenants, args.ops, k, backlogged=args.backlogged)):.1f}"
            for k in ("calls", "opcodes")
        ]
        print(f"{tenants:>12}  {claim[0]:>11}  {claim[1]:>13}  {admit[0]:>11}  {admit[1]:>13}")


if __name__ == "__main__":
    main()
