"""The gateway's Python calls per request, per streamed token and per refusal, counted in the whole
``sluice serve`` process: a figure that the machine's other load does not move, where the CPU
times of :mod:`sluice.bench.overhead` do.

The gateway runs as ``sluice serve`` does, in its own process, with a profile hook on its main
thread (the event loop's) counting every Python and C function call (``call`` and ``c_call``
events); a thread of its own, not hooked, writes the count to a file every 10 ms. The load sends
one request at a time on one keep-alive connection (the minimal client of
:mod:`sluice.bench.overhead_load`) and reads the count around each phase; the calls the gateway
makes on its own while idle (its upkeep ticks, the engine's polls), measured over two quiet seconds
before and two after each phase, are taken out at that rate; what is left of them is noise of
about a few thousand calls a phase, so a phase needs some hundreds of requests.

Phases (each ``--requests`` requests):

- *short*: non-streaming chat requests of 8 tokens against the fast engine (256 slots, 1.25 ms
  steps), as the ``closed`` rows of :mod:`sluice.bench.overhead`;
- *stream 8* and *stream 64*: the same, streamed; per extra token is their difference over 56;
- *refusal*: a second gateway (``--max-concurrency 1 --max-queued-jobs 1``) in front of the
  flood's engine (the ``article`` preset), its one slot held by a long answer (4,000 tokens, about
  a minute) and its queue by another: every request is
  refused (``429 queue_full``) by the broker's admission. The flood's refusals are the queue
  policy's delay rule instead, the same path up to the policy's answer.

The hook makes the gateway several times slower, which changes no count; a count that moves
between runs is a phase that waited on a timer (an upkeep tick, a retry) inside it.

Usage: python -m sluice.bench.overhead_calls [--requests 500] [--by-function N [--inclusive]]
       [--phases short,...]
"""

from __future__ import annotations

import argparse
import asyncio
import os
import pickle
import sys
import tempfile
import time
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import cast
from urllib.parse import urlsplit

import httpx
from prometheus_client.parser import text_string_to_metric_families

from sluice.bench.overhead import FAST_ENGINE, FLOOD_ENGINE
from sluice.bench.overhead_load import Load, Reply, _Client, _new_loop, request_bytes
from sluice.bench.overhead_procs import Spawner, _url, start_engine, wait_answer, wait_ready
from sluice.bench.spawn import free_port

#: Run in the gateway's process: the hook on the main thread, the writer thread, then the CLI. With
#: SLUICE_CALLS_BY set, the hook also counts each function's calls, and the writer puts them beside;
#: set to ``inclusive``, each Python function counts every call made under it (itself included): a
#: walk up the frames for each call, once per function however often it recurs.
COUNTED = """
import os, pickle, sys, threading, time
path = os.environ["SLUICE_CALLS_FILE"]
by = os.environ.get("SLUICE_CALLS_BY", "")
calls = [0]
each = {}
def count(frame, event, arg):
    if event == "call" or event == "c_call":
        calls[0] += 1
def count_each(frame, event, arg):
    if event == "call":
        calls[0] += 1
        code = frame.f_code
        each[code] = each.get(code, 0) + 1
    elif event == "c_call":
        calls[0] += 1
        each[arg] = each.get(arg, 0) + 1
deep = [False]  # set by the writer once the bench asks (the start-up's imports walk deep stacks)
def count_under(frame, event, arg):
    if not deep[0]:
        return count_each(frame, event, arg)
    if event == "call" or event == "c_call":
        calls[0] += 1
        if event == "c_call":
            each[arg] = each.get(arg, 0) + 1
        seen = set()
        while frame is not None:
            code = frame.f_code
            if code not in seen:
                seen.add(code)
                each[code] = each.get(code, 0) + 1
            frame = frame.f_back
from sluice.bench.overhead_profile import function_name as name
def write():
    tmp = path + ".tmp"
    while True:
        with open(tmp, "w") as f:
            f.write(str(calls[0]))
        os.replace(tmp, path)
        deep[0] = deep[0] or os.path.exists(path + ".deep")
        if by:
            snapshot = {}
            for k, v in each.copy().items():
                snapshot[name(k)] = snapshot.get(name(k), 0) + v
            with open(tmp, "wb") as f:
                pickle.dump((calls[0], snapshot), f)
            os.replace(tmp, path + ".by")
        time.sleep(0.01)
threading.Thread(target=write, daemon=True).start()
sys.setprofile(count_under if by == "inclusive" else count_each if by else count)
from sluice.cli import main
sys.argv = ["sluice", *sys.argv[1:]]
sys.exit(main())
"""

#: How long the count is left to settle around a phase (the writer's period is 10 ms).
SETTLE_S = 0.1
#: The idle windows before and after a phase: the gateway's own work comes in bursts (its upkeep
#: ticks, the engine's polls), so the longer, the closer its rate.
IDLE_S = 2.0


class Counted:
    """A counted gateway: its URL and the file its call count is written to."""

    def __init__(self, spawner: Spawner, name: str, engine: str, flags: Sequence[str], out: Path) -> None:
        port = free_port()
        self.file = out / f"{name}.calls"
        argv = [sys.executable, "-c", COUNTED, "serve", "--backend", engine, "--port", str(port)]
        argv += ["--log-level", "warning", *flags]
        self.proc = spawner.start(name, argv, {"SLUICE_CALLS_FILE": str(self.file)})
        self.url = _url(port)
        wait_ready(self.url + "/readyz", self.proc, timeout_s=300)
        wait_answer(self.url)
        # Counted inclusively (SLUICE_CALLS_BY=inclusive) from now on, the start-up done.
        self.file.with_name(self.file.name + ".deep").touch()

    def calls(self) -> int:
        return int(self.file.read_text())

    def each(self) -> dict[str, int]:
        """Calls so far by function (only with ``SLUICE_CALLS_BY`` set)."""
        path = self.file.with_name(self.file.name + ".by")
        if not path.exists():
            return {}
        with path.open("rb") as f:
            _, each = pickle.load(f)  # written by the gateway this bench started
        return cast(dict[str, int], each)


async def _connect(url: str) -> _Client:
    parts = urlsplit(url)
    loop = asyncio.get_running_loop()
    _, client = await loop.create_connection(_Client, parts.hostname or "127.0.0.1", parts.port or 80)
    return client


#: A reading of a counted gateway: its calls so far, by function (empty without
#: ``--by-function``), and when (perf_counter seconds).
Mark = tuple[int, dict[str, int], float]


@dataclass(frozen=True)
class PhaseCalls:
    """What one phase cost the gateway, net of what it does idle.

    Attributes:
        per_request: calls a request.
        idle_rate: the gateway's calls a second while idle, around the phase.
        by_function: each function's calls a request (empty without ``--by-function``).
    """

    per_request: float
    idle_rate: float
    by_function: dict[str, float]


def net_of_idle(marks: Sequence[Mark], requests: int) -> PhaseCalls:
    """The calls of ``requests`` sent between the second and the third of four readings, less the
    idle rate of the windows before (first to second) and after (third to fourth) them."""
    (c0, e0, t0), (c1, e1, t1), (c2, e2, t2), (c3, e3, t3) = marks
    idle_s, busy_s = (t1 - t0) + (t3 - t2), t2 - t1
    rate = ((c1 - c0) + (c3 - c2)) / idle_s
    by_function = {
        key: (
            e2.get(key, 0)
            - e1.get(key, 0)
            - (e1.get(key, 0) - e0.get(key, 0) + e3.get(key, 0) - e2.get(key, 0)) * busy_s / idle_s
        )
        / requests
        for key in e3
    }
    return PhaseCalls((c2 - c1 - rate * busy_s) / requests, rate, by_function)


async def phase(gateway: Counted, load: Load, requests: int, expect: int) -> PhaseCalls:
    """``requests`` sent one at a time (each answered ``expect``), counted net of the idle rate
    measured over :data:`IDLE_S` before and after them."""
    client = await _connect(gateway.url)
    request = request_bytes(gateway.url, load)
    try:
        for _ in range(3):  # the connection's first requests, the engine's connection warm
            await client.exchange(request)
        await asyncio.sleep(SETTLE_S)
        marks: list[Mark] = [(gateway.calls(), gateway.each(), time.perf_counter())]
        await asyncio.sleep(IDLE_S)
        marks.append((gateway.calls(), gateway.each(), time.perf_counter()))
        for _ in range(requests):
            reply: Reply = await client.exchange(request)
            if reply.status != expect:
                raise RuntimeError(f"expected {expect}, got {reply.status}")
        await asyncio.sleep(SETTLE_S)
        marks.append((gateway.calls(), gateway.each(), time.perf_counter()))
        await asyncio.sleep(IDLE_S)
        marks.append((gateway.calls(), gateway.each(), time.perf_counter()))
    finally:
        client.close()
    return net_of_idle(marks, requests)


async def _hold(url: str, tokens: int) -> _Client:
    """A long streamed answer in flight (not awaited), to hold a slot or a queue place."""
    client = await _connect(url)
    reply = client.exchange(request_bytes(url, Load(1, tokens, stream=True)))
    reply.add_done_callback(lambda done: done.exception())  # closed before the end, on purpose
    return client


async def _until_held(url: str, running: int, queued: int, timeout_s: float = 30.0) -> None:
    """Wait, bounded, until the gateway's /metrics say ``running`` jobs run and ``queued`` wait."""
    wanted = {"sluice_running_jobs": running, "sluice_queued_jobs": queued}
    deadline = time.monotonic() + timeout_s
    seen: dict[str, float] = {}
    async with httpx.AsyncClient(timeout=5.0) as http:
        while time.monotonic() < deadline:
            text = (await http.get(url + "/metrics")).text
            seen = {
                sample.name: sample.value
                for family in text_string_to_metric_families(text)
                for sample in family.samples
                if sample.name in wanted
            }
            if all(seen.get(name, 0) >= n for name, n in wanted.items()):
                return
            await asyncio.sleep(0.05)
    raise RuntimeError(f"{url}: the held answers did not take the slot and the queue: {seen}")


#: The phases, in the order they run.
PHASES = ("short", "stream 8", "stream 64", "refusal")


async def measure(
    fast: Counted | None, refusing: Counted | None, requests: int, phases: Sequence[str] = PHASES
) -> dict[str, PhaseCalls]:
    """Each phase's calls, of those in ``phases``: ``short``, ``stream 8``, ``stream 64`` (on
    ``fast``), ``refusal`` (on ``refusing``)."""
    out = {}
    for name, tokens, stream in (("short", 8, False), ("stream 8", 8, True), ("stream 64", 64, True)):
        if name in phases:
            assert fast is not None
            out[name] = await phase(fast, Load(1, tokens, stream=stream), requests, 200)
    if "refusal" not in phases:
        return out
    assert refusing is not None
    held = [await _hold(refusing.url, 4_000)]
    await _until_held(refusing.url, running=1, queued=0)  # the first one running ...
    held.append(await _hold(refusing.url, 4_000))
    await _until_held(refusing.url, running=1, queued=1)  # ... the second one queued behind it
    try:
        out["refusal"] = await phase(refusing, Load(1, 8, stream=False), requests, 429)
    finally:
        for client in held:
            client.close()
        await asyncio.sleep(0.1)
    return out


def main(requests: int, by_function: int, inclusive: bool = False, only: Sequence[str] = PHASES) -> None:
    with tempfile.TemporaryDirectory(prefix="sluice-calls-") as tmp:
        out = Path(tmp)
        spawner = Spawner(out)
        if by_function:
            os.environ["SLUICE_CALLS_BY"] = "inclusive" if inclusive else "1"
        try:
            fast = refusing = None
            if set(only) - {"refusal"}:
                engine, _ = start_engine(spawner, "engine", FAST_ENGINE)
                fast = Counted(spawner, "gateway", engine, ["--max-concurrency", "256"], out)
            if "refusal" in only:
                slow, _ = start_engine(spawner, "slow-engine", FLOOD_ENGINE)
                refusing = Counted(
                    spawner, "refusing", slow, ["--max-concurrency", "1", "--max-queued-jobs", "1"], out
                )
            with asyncio.Runner(loop_factory=_new_loop) as runner:
                phases = runner.run(measure(fast, refusing, requests, only))
        finally:
            spawner.stop_all()
    print(f"{requests} requests a phase, one at a time; gateway calls (Python + C) counted in its process")
    for name, calls in phases.items():
        print(f"{name:<18} {calls.per_request:>10,.1f} calls   (idle {calls.idle_rate:,.0f} calls a second)")
    if "stream 8" in phases and "stream 64" in phases:
        extra = (phases["stream 64"].per_request - phases["stream 8"].per_request) / 56
        print(f"{'per extra token':<18} {extra:>10,.1f} calls")
    for name, calls in phases.items() if by_function else ():
        what = "calls made under them (themselves included)" if inclusive else "called most"
        print(f"\n{name}: the {by_function} functions {what}, a request")
        for key, value in sorted(calls.by_function.items(), key=lambda kv: -kv[1])[:by_function]:
            print(f"{value:>8.1f}  {key}")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m sluice.bench.overhead_calls",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--requests", type=int, default=500, help="requests a phase (500)")
    parser.add_argument(
        "--by-function",
        type=int,
        default=0,
        metavar="N",
        help="also list each phase's N functions called most",
    )
    parser.add_argument(
        "--inclusive",
        action="store_true",
        help="with --by-function: count for each function the calls made under it (slower)",
    )
    parser.add_argument(
        "--phases",
        default=",".join(PHASES),
        help=f"the phases to run, comma-separated (all: {','.join(PHASES)})",
    )
    args = parser.parse_args()
    only = [name.strip() for name in args.phases.split(",") if name.strip()]
    if unknown := set(only) - set(PHASES):
        parser.error(f"unknown phases: {', '.join(sorted(unknown))}")
    if os.environ.get("SLUICE_CALLS_FILE"):
        raise SystemExit("SLUICE_CALLS_FILE is the counted gateway's; unset it here")
    main(args.requests, args.by_function, args.inclusive, only)
