"""Broker throughput: admit → claim → finish cycles per second, and Redis memory per queued job.

Runs, one after another, on a ``redis-server`` this script starts itself on a free port:

* the Redis broker with ``--admitters`` processes admitting and ``--claimers`` processes claiming
  and finishing (each process its own event loop with ``--concurrency`` tasks), on Redis without
  persistence and on Redis with AOF ``appendfsync everysec``;
* the memory broker, one process (it is embedded by design), the same loop;
* RQ on the same Redis: enqueue the jobs, then ``SimpleWorker`` bursts in ``--claimers`` processes;
* Redis memory per queued job (``used_memory`` delta over N queued jobs), Sluice and RQ.

With ``--instructions`` it counts instead, with valgrind's callgrind, the instructions of one Redis
broker operation, on the Redis side and on the client side in turn: a measure that does not move
with the machine's load, as rates and CPU time do on a shared one (below, :func:`count_instructions`).

Jobs are empty on the engine side: this measures the broker, not an engine.

Needs ``redis-server`` on the PATH (or at ``$SLUICE_TEST_REDIS_SERVER``), and RQ for its rows
(``pip install rq``, or ``--skip-rq``).

Usage: python -m sluice.bench.broker_cycles [--jobs 20000] [--admitters 1] [--claimers 2] [--concurrency 32]
       python -m sluice.bench.broker_cycles --instructions [--side redis|client|both] [--ops 1000]
       python -m sluice.bench.broker_cycles --instructions --lua-costs
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import itertools
import multiprocessing as mp
import os
import re
import resource
import shutil
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, replace
from multiprocessing.sharedctypes import Synchronized
from pathlib import Path
from typing import Any

from sluice.bench.cli import free_port
from sluice.bench.spawn import stop_process
from sluice.broker.base import Broker, BrokerSettings
from sluice.broker.redis import RedisBroker
from sluice.core.admission import Bounds, QueueLimits
from sluice.core.job import Endpoint, Job, JobState, new_job_id
from sluice.core.policy import CoDelPolicy

REDIS_SERVER = os.environ.get("SLUICE_TEST_REDIS_SERVER", "redis-server")
MODEL = "bench-model"
TENANTS = [f"tenant-{i}" for i in range(8)]


def settings() -> BrokerSettings:
    # The broker's throughput, not admission: the default queue policy's code runs on every admit,
    # but its delay limit never bites (20,000 jobs queued at once are a standing queue to it).
    never_standing = CoDelPolicy(target_s=1e9, interval_s=1e9, early_s=1e9)
    return BrokerSettings(
        default_limits=QueueLimits(model=Bounds(max_jobs=None)), lease_s=60.0, policy=never_standing
    )


def make_job(i: int) -> Job:
    now = time.time()
    return Job(
        id=new_job_id(),
        model=MODEL,
        endpoint=Endpoint.CHAT,
        body={
            "model": MODEL,
            "messages": [{"role": "user", "content": "Say hello in one word."}],
            "max_tokens": 16,
        },
        tenant=TENANTS[i % len(TENANTS)],
        priority="normal",
        prompt_tokens=12,
        max_tokens=16,
        created_at=now,
        deadline=now + 600,
    )


def _wait_for_ping(
    proc: subprocess.Popen[bytes], url: str, *, within_s: float, socket_timeout_s: float, poll_s: float
) -> None:
    """Return once the redis-server ``proc`` answers PING at ``url``; raise if it exits first or
    stays silent ``within_s`` seconds."""
    from redis import Redis
    from redis.exceptions import RedisError

    client = Redis.from_url(url, socket_timeout=socket_timeout_s)
    try:
        deadline = time.monotonic() + within_s
        while True:
            if proc.poll() is not None:
                raise RuntimeError(f"redis-server exited with {proc.returncode}")
            with contextlib.suppress(RedisError):
                if client.ping():
                    return
            if time.monotonic() > deadline:
                raise RuntimeError(f"redis-server did not answer PING within {within_s:g} s")
            time.sleep(poll_s)
    finally:
        client.close()


@contextlib.contextmanager
def redis_server(*, aof: bool = False) -> Iterator[str]:
    """A throw-away ``redis-server`` on a free port, its data in a temporary folder; yields its URL.

    ``aof``: append-only file with ``appendfsync everysec``, the durable setup the docs quote.
    """

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    with tempfile.TemporaryDirectory(prefix="sluice-bench-redis-") as folder:
        opts = {
            "port": str(port),
            "bind": "127.0.0.1",
            "dir": folder,
            "save": "",
            "appendonly": "yes" if aof else "no",
            "appendfsync": "everysec",
            "maxmemory-policy": "noeviction",
        }
        args = [REDIS_SERVER, *(x for name, value in opts.items() for x in (f"--{name}", value))]
        proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        try:
            _wait_for_ping(proc, url, within_s=10, socket_timeout_s=0.5, poll_s=0.01)
            yield url
        finally:
            stop_process(proc)


# --- the Sluice loops -----------------------------------------------------------------------------


async def admit_loop(broker: Broker, count: int, concurrency: int) -> None:
    queue = iter(range(count))

    async def one() -> None:
        for i in queue:
            await broker.admit(make_job(i))

    await asyncio.gather(*(one() for _ in range(concurrency)))


async def claim_loop(
    broker: Broker, done: Synchronized[int] | list[int], total: int, concurrency: int
) -> int:
    finished = 0

    def count() -> int:
        return done.value if isinstance(done, Synchronized) else done[0]

    def add() -> None:
        if isinstance(done, Synchronized):
            with done.get_lock():
                done.value += 1
        else:
            done[0] += 1

    async def one(worker: str) -> None:
        nonlocal finished
        while count() < total:
            job = await broker.claim(worker, [MODEL], timeout=0.2)
            if job is None:
                continue
            await broker.finish(job.id, worker, JobState.SUCCEEDED, result={"ok": True})
            add()
            finished += 1

    await asyncio.gather(*(one(f"bench-{i}") for i in range(concurrency)))
    return finished


def _cpu_s() -> float:
    usage = resource.getrusage(resource.RUSAGE_SELF)
    return usage.ru_utime + usage.ru_stime


def _process(
    role: str,
    url: str,
    count: int,
    concurrency: int,
    start: Any,
    done: Any,
    total: int,
    cpu: Any,
    sent: Any = None,
) -> None:
    async def main() -> None:
        broker = RedisBroker(
            url, settings(), blocking_connections=concurrency, max_connections=concurrency + 8
        )
        try:
            await broker.ping()
            start.wait()
            began = _cpu_s()
            batch = broker.home.batch
            pipelines, commands = batch.pipelines, batch.commands
            if role == "admit":
                await admit_loop(broker, count, concurrency)
            else:
                await claim_loop(broker, done, total, concurrency)
            with cpu.get_lock():
                cpu.value += _cpu_s() - began
            if sent is not None:  # the pipelines' depth: commands sent over pipelines sent
                with sent.get_lock():
                    sent[0] += batch.pipelines - pipelines
                    sent[1] += batch.commands - commands
        finally:
            await broker.close()

    asyncio.run(main())


def redis_cpu_parts(url: str) -> tuple[float, float]:
    """redis-server's user and system CPU seconds so far."""
    from redis import Redis

    info = Redis.from_url(url).info("cpu")
    return float(info["used_cpu_user"]), float(info["used_cpu_sys"])


def redis_cpu_s(url: str) -> float:
    return sum(redis_cpu_parts(url))


def redis_calls(url: str) -> int:
    """Commands sent to Redis so far, those the scripts run not counted (FCALL is one)."""
    from redis import Redis

    stats = Redis.from_url(url).info("commandstats")
    inner = ("cmdstat_fcall", "cmdstat_bzpopmin", "cmdstat_multi", "cmdstat_exec")
    return sum(int(v["calls"]) for k, v in stats.items() if k in inner)


@dataclass
class Run:
    rate: float  # cycles per second
    client_cpu_us: float  # CPU of the benchmark processes per cycle
    redis_cpu_us: float  # CPU of redis-server per cycle (user + system)
    redis_sys_us: float = 0.0  # of which system time
    depth: float = 0.0  # commands per pipeline the benchmark's processes sent
    calls: float = 0.0  # FCALLs (and blocking pops) per cycle that reached Redis


def run_redis(url: str, jobs: int, admitters: int, claimers: int, concurrency: int) -> Run:
    # Fork, not spawn: a spawn context starts multiprocessing's resource tracker (for its named
    # semaphores and for every process it starts), a process that outlives the run until its
    # caller exits. Fork's locks are unnamed and need none. Each child makes its own broker and
    # event loop after the fork and uses nothing else it inherits (the caller runs no loop here).
    ctx = mp.get_context("fork")
    start = ctx.Event()
    done = ctx.Value("q", 0)
    cpu = ctx.Value("d", 0.0)
    sent = ctx.Array("q", 2)
    procs = []
    for i in range(admitters):
        share = jobs // admitters + (1 if i < jobs % admitters else 0)
        args = ("admit", url, share, concurrency, start, done, jobs, cpu, sent)
        procs.append(ctx.Process(target=_process, args=args))
    for _ in range(claimers):
        args = ("claim", url, 0, concurrency, start, done, jobs, cpu, sent)
        procs.append(ctx.Process(target=_process, args=args))
    for p in procs:
        p.start()
    time.sleep(1.5)  # every process connected and waiting
    redis_before = redis_cpu_parts(url)
    calls_before = redis_calls(url)
    began = time.perf_counter()
    start.set()
    # A process that fails (a refused admit) would leave the others waiting for jobs forever.
    while any(p.is_alive() for p in procs) and not any(p.exitcode for p in procs):
        time.sleep(0.01)
    elapsed = time.perf_counter() - began
    for p in procs:
        if p.is_alive():
            p.terminate()
        p.join()
    if done.value != jobs or any(p.exitcode for p in procs):
        raise RuntimeError(f"only {done.value} of {jobs} jobs finished")
    user, system = (after - before for after, before in zip(redis_cpu_parts(url), redis_before, strict=True))
    calls = (redis_calls(url) - calls_before) / jobs
    depth = sent[1] / sent[0] if sent[0] else 0.0
    us = 1e6 / jobs
    return Run(jobs / elapsed, cpu.value * us, (user + system) * us, system * us, depth, calls)


def run_memory(jobs: int, concurrency: int) -> float:
    from sluice.broker.memory import MemoryBroker

    async def main() -> float:
        async with MemoryBroker(settings()) as broker:
            done = [0]
            began = time.perf_counter()
            await asyncio.gather(
                admit_loop(broker, jobs, concurrency), claim_loop(broker, done, jobs, concurrency)
            )
            return jobs / (time.perf_counter() - began)

    return asyncio.run(main())


# --- RQ on the same Redis -------------------------------------------------------------------------


def noop() -> bool:
    return True


def _rq_worker(url: str) -> None:
    from redis import Redis
    from rq import Queue, SimpleWorker

    conn = Redis.from_url(url)  # bytes, as RQ needs (decode_responses=True breaks its workers)
    SimpleWorker([Queue("bench", connection=conn)], connection=conn).work(burst=True, logging_level="WARNING")


def run_rq(url: str, jobs: int, workers: int) -> float:
    from redis import Redis
    from rq import Queue

    conn = Redis.from_url(url)
    queue = Queue("bench", connection=conn)
    began = time.perf_counter()
    for _ in range(jobs):
        queue.enqueue(time.time)
    ctx = mp.get_context("fork")  # RQ resolves __main__.noop: the workers must share this module
    procs = [ctx.Process(target=_rq_worker, args=(url,)) for _ in range(workers)]
    for p in procs:
        p.start()
    for p in procs:
        p.join()
    elapsed = time.perf_counter() - began
    finished = queue.finished_job_registry.count
    if finished != jobs:
        raise RuntimeError(f"RQ finished {finished} of {jobs}")
    return jobs / elapsed


# --- memory per queued job --------------------------------------------------------------------------


def used_memory(url: str) -> int:
    from redis import Redis

    return int(Redis.from_url(url).info("memory")["used_memory"])


def memory_per_job_sluice(url: str, jobs: int) -> float:
    before = used_memory(url)

    async def main() -> None:
        async with RedisBroker(url, settings()) as broker:
            await admit_loop(broker, jobs, 32)

    asyncio.run(main())
    return (used_memory(url) - before) / jobs


def memory_per_job_rq(url: str, jobs: int) -> float:
    from redis import Redis
    from rq import Queue

    before = used_memory(url)
    queue = Queue("idle", connection=Redis.from_url(url))
    for _ in range(jobs):
        queue.enqueue(time.time)
    return (used_memory(url) - before) / jobs


# --- instructions per operation (callgrind) ------------------------------------------------------
#
# One process of 32 tasks, on a redis-server of its own, with a clock that moves by 1 ms at each
# reading (the same times in every run, and jobs that take time, so that finishes feed the drain
# rate and claims check deadlines against it): N admissions (8 tenants, as above), then N claims
# of the jobs those queued, then the N finishes. --side redis runs redis-server under callgrind,
# --side client the client process. Counting is switched on (callgrind_control -i on) around each
# phase only; a phase's count is its dump's total over N. Two runs agree to within about 1 %.

VALGRIND = ["valgrind", "--tool=callgrind", "--instr-atstart=no"]
PHASES = ("admit", "claim", "finish")  # what --instructions counts, one after another


def _control(pid: int, *args: str) -> None:
    subprocess.run(["callgrind_control", *args, str(pid)], check=True, capture_output=True)


def _dump_total(folder: Path, pid: int, number: int, key: str = "totals:") -> int:
    """The instructions in dump ``number`` of process ``pid``: ``totals:`` the cost since the
    previous dump, ``summary:`` since the last zeroing (-z)."""
    dump = folder / f"callgrind.{pid}.{number}"
    for _ in range(600):  # callgrind_control answers before the file is whole
        text = dump.read_text(errors="replace") if dump.exists() else ""
        for line in text.splitlines():
            if line.startswith(key):
                return int(line.split()[1])
        time.sleep(0.1)
    raise RuntimeError(f"no total in {dump}")


class Counter:
    """Switches callgrind on and off in one process and reads the cost of what ran in between."""

    def __init__(self, pid: int, folder: Path) -> None:
        self.pid, self.folder, self.dumps = pid, folder, 0

    @contextlib.contextmanager
    def phase(self, totals: dict[str, int], name: str) -> Iterator[None]:
        _control(self.pid, "-z")
        _control(self.pid, "-i", "on")
        yield
        _control(self.pid, "-i", "off")
        _control(self.pid, "-d")
        self.dumps += 1
        totals[name] = _dump_total(self.folder, self.pid, self.dumps)


@contextlib.contextmanager
def callgrind_redis(under_callgrind: bool, folder: Path) -> Iterator[tuple[str, int]]:

    port = free_port()
    url = f"redis://127.0.0.1:{port}/0"
    args = [REDIS_SERVER, "--port", str(port), "--bind", "127.0.0.1", "--save", "", "--appendonly", "no"]
    args += ["--dir", str(folder)]
    if under_callgrind:
        args = [*VALGRIND, f"--callgrind-out-file={folder}/callgrind.%p", *args]
    proc = subprocess.Popen(args, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, cwd=folder)
    try:
        # Under callgrind redis-server starts many times slower: a longer bound, a longer poll.
        _wait_for_ping(proc, url, within_s=120, socket_timeout_s=2, poll_s=0.1)
        yield url, proc.pid
    finally:
        stop_process(proc, 30)


async def _count_phases(url: str, ops: int, counter: Counter, concurrency: int = 32) -> dict[str, int]:
    # A clock that moves by 1 ms at each reading: the same times in every run, and jobs that take
    # time to run, so that finishes feed the drain rate and claims check deadlines against it.
    ticks = itertools.count()
    start = time.time()

    def clock() -> float:
        return start + next(ticks) * 0.001

    broker = RedisBroker(
        url,
        replace(settings(), clock=clock),
        blocking_connections=concurrency,
        max_connections=concurrency + 8,
        socket_timeout_s=60.0,
        connect_timeout_s=30.0,
    )
    totals: dict[str, int] = {}
    try:
        await broker.ping()
        # The scripts loaded and every connection opened before anything is counted.
        warm = [make_job(i) for i in range(concurrency)]
        await asyncio.gather(*(broker.admit(j) for j in warm))
        claimed = await asyncio.gather(
            *(broker.claim(f"w{i}", [MODEL], timeout=1) for i in range(concurrency))
        )
        await asyncio.gather(
            *(broker.finish(j.id, f"w{i}", JobState.SUCCEEDED, result={}) for i, j in enumerate(claimed) if j)
        )
        queue = iter(range(ops))

        async def admit() -> None:
            for i in queue:
                await broker.admit(make_job(i))

        with counter.phase(totals, "admit"):
            await asyncio.gather(*(admit() for _ in range(concurrency)))
        work = iter(range(ops))
        claimed_jobs: list[tuple[str, str]] = []

        async def claim(worker: str) -> None:
            for _ in work:
                job = await broker.claim(worker, [MODEL], timeout=1)
                assert job is not None, "the queue ran dry"
                claimed_jobs.append((job.id, worker))

        async def finish(jobs: list[tuple[str, str]]) -> None:
            for job_id, worker in jobs:
                done = await broker.finish(job_id, worker, JobState.SUCCEEDED, result={"ok": True})
                assert done is not None, "a finish was refused"

        with counter.phase(totals, "claim"):
            await asyncio.gather(*(claim(f"bench-{i}") for i in range(concurrency)))
        with counter.phase(totals, "finish"):
            await asyncio.gather(*(finish(claimed_jobs[i::concurrency]) for i in range(concurrency)))
    finally:
        await broker.close()
    return {name: total // ops for name, total in totals.items()}


def count_instructions(side: str, ops: int, keep: Path | None = None) -> dict[str, int]:
    """Instructions per operation of ``side`` ('redis' or 'client'), by phase; ``keep``: a folder
    to copy the dumps to (for ``callgrind_annotate``)."""
    with tempfile.TemporaryDirectory(prefix="sluice-callgrind-") as tmp:
        folder = Path(tmp)
        with contextlib.ExitStack() as stack:
            if keep is not None:
                stack.callback(_keep, folder, keep, side)
            return _count(side, ops, folder)


def _keep(folder: Path, keep: Path, side: str) -> None:
    keep.mkdir(parents=True, exist_ok=True)
    for dump in folder.glob("callgrind.*.*"):
        shutil.copy(dump, keep / f"{side}.{dump.name}")


def _count(side: str, ops: int, folder: Path) -> dict[str, int]:
    with callgrind_redis(side == "redis", folder) as (url, redis_pid):
        if side == "redis":
            return asyncio.run(_count_phases(url, ops, Counter(redis_pid, folder)))
        # The client under callgrind: this module again, in a child that counts itself.
        out = folder / "client.txt"
        command = [*VALGRIND, f"--callgrind-out-file={folder}/callgrind.%p", sys.executable, "-m"]
        command += ["sluice.bench.broker_cycles", "--instructions"]
        command += ["--_child", url, "--ops", str(ops), "--_out", str(out), "--_folder", str(folder)]
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        found = dict(re.findall(r"(\w+) (\d+)", out.read_text()))
        return {name: int(v) for name, v in found.items()}


# --- main -----------------------------------------------------------------------------------------


@dataclass
class Row:
    what: str
    setup: str
    value: str
    cpu: str = ""


def flush(url: str) -> None:
    from redis import Redis

    Redis.from_url(url).flushall()


def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.bench.broker_cycles",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--jobs", type=int, default=20_000, help="cycles per Sluice run (default 20000)")
    parser.add_argument("--rq-jobs", type=int, default=3_000, help="jobs for the RQ run (default 3000)")
    parser.add_argument("--admitters", type=int, default=1, help="admitting processes (default 1)")
    parser.add_argument("--claimers", type=int, default=2, help="claiming processes (default 2)")
    parser.add_argument("--concurrency", type=int, default=32, help="tasks per process (default 32)")
    parser.add_argument("--memory-jobs", type=int, default=10_000, help="queued jobs for the memory probe")
    parser.add_argument(
        "--repeat", type=int, default=3, help="runs of each Sluice setup; the median is shown"
    )
    parser.add_argument("--skip-rq", action="store_true")
    parser.add_argument(
        "--instructions", action="store_true", help="count instructions per operation with callgrind instead"
    )
    parser.add_argument(
        "--side", choices=("redis", "client", "both"), default="both", help="with --instructions"
    )
    parser.add_argument("--ops", type=int, default=1000, help="operations per phase with --instructions")
    parser.add_argument("--keep", type=Path, help="with --instructions: copy the callgrind dumps here")
    parser.add_argument(
        "--lua-costs",
        action="store_true",
        help="with --instructions: what pieces of a script cost in redis-server, by the state's encoding",
    )
    parser.add_argument("--_child", help=argparse.SUPPRESS)
    parser.add_argument("--_out", help=argparse.SUPPRESS)
    parser.add_argument("--_folder", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.instructions:
        return instructions_main(args)

    procs = f"{args.admitters} admit + {args.claimers} claim processes x {args.concurrency} tasks"
    rows: list[Row] = []

    def show(row: Row) -> None:
        rows.append(row)
        print(row, flush=True)

    for label, aof in (("no persistence", False), ("AOF everysec", True)):
        runs = []
        for _ in range(args.repeat):
            with redis_server(aof=aof) as url:
                runs.append(run_redis(url, args.jobs, args.admitters, args.claimers, args.concurrency))
        runs.sort(key=lambda r: r.rate)
        mid = runs[len(runs) // 2]
        cpu = f"{mid.client_cpu_us:,.0f} + {mid.redis_cpu_us:,.0f} µs"
        show(Row(f"Sluice RedisBroker, Redis {label}", procs, f"{mid.rate:,.0f} cycles/s", cpu))
        print(
            f"  Redis system time {mid.redis_sys_us:,.0f} µs a cycle; {mid.calls:.2f} calls a cycle"
            f" reached Redis, {mid.depth:.1f} commands a pipeline",
            flush=True,
        )

    with redis_server() as url:
        show(Row("Sluice, Redis memory per queued job", f"{args.memory_jobs:,} jobs",
                 f"{memory_per_job_sluice(url, args.memory_jobs):,.0f} B"))  # fmt: skip
        if not args.skip_rq:
            flush(url)
            show(Row("RQ, Redis memory per queued job", f"{args.memory_jobs:,} jobs",
                     f"{memory_per_job_rq(url, args.memory_jobs):,.0f} B"))  # fmt: skip
            flush(url)
            rate = run_rq(url, args.rq_jobs, args.claimers)
            show(Row("RQ (enqueue, then SimpleWorker bursts)", f"{args.claimers} worker processes",
                     f"{rate:,.0f} cycles/s"))  # fmt: skip

    rates = sorted(run_memory(args.jobs, args.concurrency) for _ in range(args.repeat))
    show(Row("Sluice MemoryBroker", f"1 process, {args.concurrency} + {args.concurrency} tasks",
             f"{rates[len(rates) // 2]:,.0f} cycles/s"))  # fmt: skip

    head = ("what", "setup", "result", "CPU per cycle (clients + Redis)")
    cols = [[r.what for r in rows], [r.setup for r in rows], [r.value for r in rows], [r.cpu for r in rows]]
    width = [max(len(h), *(len(v) for v in col)) for h, col in zip(head, cols, strict=True)]
    print()
    print("| " + " | ".join(h.ljust(w) for h, w in zip(head, width, strict=True)) + " |")
    print(
        "|"
        + "|".join("-" * (w + 2) for w in width[:2])
        + "|"
        + "|".join("-" * (w + 1) + ":" for w in width[2:])
        + "|"
    )
    for r in rows:
        cells = [
            r.what.ljust(width[0]),
            r.setup.ljust(width[1]),
            r.value.rjust(width[2]),
            r.cpu.rjust(width[3]),
        ]
        print("| " + " | ".join(cells) + " |")
    return 0


# --- what the pieces of a script cost (callgrind) --------------------------------------------------
#
# Each snippet runs N times by EVALSHA on a queue state shaped like the benchmark's (8 tenants of
# 125 jobs, a state hash of 45 fields with names under 64 bytes), once with the state hash a
# listpack and once a hashtable; printed: instructions per EVALSHA over an empty script's.

_LUA_TENANTS = 8
_LUA_SNIPPETS: dict[str, str] = {
    "empty script": "return 0",
    "LLEN of a tenant list, x8": "for i = 1, 8 do redis.call('LLEN', KEYS[i]) end",
    "LINDEX 0 of a tenant list, x8": "for i = 1, 8 do redis.call('LINDEX', KEYS[i], 0) end",
    "HGET of a state field, x8": "for i = 1, 8 do redis.call('HGET', KEYS[9], ARGV[i]) end",
    "HMGET of 24 state fields, x1": "redis.call('HMGET', KEYS[9], unpack(ARGV, 1, 24))",
    "HMGET of a job's cost and weight, x8": (
        "for i = 1, 8 do redis.call('HMGET', ARGV[24 + i], 'cost', 'weight') end"
    ),
    "a .. b of two strings, x24": "local t = {} for i = 1, 24 do t[i] = 'w:' .. KEYS[1 + i % 8] end",
    "tonumber of a 17-digit number, x8": "for i = 1, 8 do tonumber('123.45678901234567') end",
    "string.match of 3 numbers and tonumber, x8": (
        "for i = 1, 8 do local a, b, c = string.match('125 28 1', '^(%d+) (%S+) (%S+)$')"
        " tonumber(a) tonumber(b) tonumber(c) end"
    ),
    "cmsgpack.unpack of 4 values, x8": (
        "local h = cmsgpack.pack(125, 28, 1, 'id') for i = 1, 8 do cmsgpack.unpack(h) end"
    ),
}


def lua_costs(calls: int = 300) -> dict[str, dict[str, float]]:
    """Instructions per EVALSHA of each snippet over the empty script's, by the state's encoding."""
    from redis import Redis

    prefix = "sluice:"
    lists = [f"{prefix}tq:{MODEL}:normal:{t}" for t in TENANTS[:_LUA_TENANTS]]
    state = f"{prefix}qs:{MODEL}"
    # the state hash: the fields of three classes, codel's, and per tenant its tags and work
    classes = ("high", "normal", "low")
    fields: dict[Any, Any] = {f"{f}:{c}": "12345.678901234567" for c in classes for f in "jkcv"}
    fields |= {f"s:{c}": "1234" for c in classes}
    fields |= {f: "1764620000.1234567" for f in ("pa", "ps", "pl", "pr", "rv")}
    # a head job's record: its cost and weight, and 18 more fields of a record's size
    job_fields: dict[Any, Any] = {"cost": 28, "weight": "1.0"}
    job_fields |= {f"x{k}": "v" * 20 for k in range(18)}
    for tq, tenant in zip(lists, TENANTS, strict=False):
        fields |= {f"t:normal:{tenant}": "123.45678901234567", f"f:normal:{tenant}": "123.4567890123456"}
        fields[f"w:{tq}"] = "3500"
    names = [f"w:{tq}" for tq in lists] + [f"t:normal:{t}" for t in TENANTS[:_LUA_TENANTS]]
    names += [f"f:normal:{t}" for t in TENANTS[:_LUA_TENANTS]]
    out: dict[str, dict[str, float]] = {}
    with tempfile.TemporaryDirectory(prefix="sluice-callgrind-") as tmp:
        folder = Path(tmp)
        with callgrind_redis(True, folder) as (url, pid):
            r = Redis.from_url(url)
            counter = Counter(pid, folder)
            for encoding in ("listpack", "hashtable"):
                r.flushall()
                heads: list[str] = []
                for i, tq in enumerate(lists):
                    ids = [f"job-{i}-{j:03d}" for j in range(125)]
                    r.rpush(tq, *ids)
                    heads.append(f"{prefix}job:{ids[0]}")
                    r.hset(heads[-1], mapping=job_fields)
                r.hset(state, mapping=fields)
                if encoding == "hashtable":
                    r.hset(state, "ht", "x" * 65)  # a value over hash-max-listpack-value
                assert r.object("encoding", state).decode() == encoding
                keys, argv = [*lists, state], [*names[:24], *heads]
                for name, body in _LUA_SNIPPETS.items():
                    sha = r.script_load(body)
                    r.evalsha(sha, len(keys), *keys, *argv)
                    totals: dict[str, int] = {}
                    with counter.phase(totals, name):
                        for _ in range(calls):
                            r.evalsha(sha, len(keys), *keys, *argv)
                    out.setdefault(name, {})[encoding] = totals[name] / calls
    empty = out.pop("empty script")
    return {name: {e: v - empty[e] for e, v in by.items()} for name, by in out.items()}


def instructions_main(args: argparse.Namespace) -> int:
    if args.lua_costs:
        costs = lua_costs()
        print("| snippet | state hash a listpack | a hashtable |")
        print("|---|---:|---:|")
        for name, by in costs.items():
            print(f"| {name} | {by['listpack']:,.0f} | {by['hashtable']:,.0f} |")
        return 0
    if args._child:  # the client side, run under callgrind by count_instructions
        totals = asyncio.run(_count_phases(args._child, args.ops, Counter(os.getpid(), Path(args._folder))))
        Path(args._out).write_text("".join(f"{name} {v}\n" for name, v in totals.items()))
        return 0
    sides = ("redis", "client") if args.side == "both" else (args.side,)
    rows = {side: count_instructions(side, args.ops, args.keep) for side in sides}
    print("| side | " + " | ".join(f"{p} (instructions per op)" for p in PHASES) + " |")
    print("|---|" + "---:|" * len(PHASES))
    for side, totals in rows.items():
        print(f"| {side} | " + " | ".join(f"{totals.get(p, 0):,}" for p in PHASES) + " |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
