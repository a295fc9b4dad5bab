"""Instructions per request of ``sluice serve`` under valgrind's callgrind: a count that does not
move with the machine's other load, unlike CPU time on a shared machine.

Starts the simulator (256 slots, 10-ms steps: however slow valgrind makes the gateway, each token
arrives on its own) and ``sluice serve`` in front of it under ``valgrind --tool=callgrind``
(counting from once it serves the model: its start-up is not counted), sends 10 warm-up requests
of each kind, then measures, one request at a time: ``--requests`` short non-streaming chat
requests, streamed ones of 8 tokens and of 64 tokens, each group between two windows of an idle
gateway over 10 s (its upkeep ticks and engine polls, in instructions a second). The counters are
zeroed (``callgrind_control -z``) before each group and window and dumped (``-d``) after it, a
group's 1.5 s after its last request (the memory broker's upkeep packs the group's events inside
its count); the mean of the idle rates before and after a group, times its wall time, is
subtracted. Two trees compare by running this on each at the same time, through
``PYTHONPATH``. The gateway under valgrind runs at ``nice -n 10``, the simulator and the requests at
the command's own priority.

Usage: python -m sluice.bench.overhead_callgrind OUTDIR [--requests 50]
"""

from __future__ import annotations

import argparse
import asyncio
import json
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

import httpx

from sluice.bench.broker_cycles import _control, _dump_total
from sluice.bench.cli import free_port
from sluice.bench.spawn import stop_process

ENGINE = ["--max-num-seqs", "256", "--base-step-ms", "10", "--per-seq-ms", "0", "--prefill-ms-per-token", "0"]
#: (group, max_tokens, stream)
GROUPS = (("short", 8, False), ("stream8", 8, True), ("stream64", 64, True))
IDLE_S = 10.0
#: how long the gateway may take to start under valgrind (seconds)
START_S = 1800.0
#: The gateway under valgrind is the one CPU-bound process here (valgrind runs it tens of times
#: slower): it yields to the machine's other work, and the simulator does not. A simulator starved
#: as much (the whole command under ``nice``) answered too late on a loaded machine, and the
#: gateway's retries went into its counts. ``nice`` execs valgrind: the pid stays the gateway's.
NICE = ["nice", "-n", "10"]


def _body(tokens: int, stream: bool) -> dict[str, Any]:
    body: dict[str, Any] = {"model": "sim", "messages": [{"role": "user", "content": "hello"}]}
    body["max_tokens"] = tokens
    if stream:
        body["stream"] = True
    return body


async def _one(client: httpx.AsyncClient, url: str, tokens: int, stream: bool) -> None:
    if stream:
        async with client.stream("POST", url + "/v1/chat/completions", json=_body(tokens, True)) as r:
            async for _ in r.aiter_bytes():
                pass
        return
    r = await client.post(url + "/v1/chat/completions", json=_body(tokens, False))
    assert r.status_code == 200, r.text


class Counted:
    """The gateway under callgrind: zero its counters, dump them, read the dump's total."""

    def __init__(self, pid: int, out: Path) -> None:
        self.pid, self.out, self.dumps = pid, out, 0

    async def start(self) -> None:
        await asyncio.to_thread(_control, self.pid, "-i", "on")

    async def zero(self) -> None:
        await asyncio.to_thread(_control, self.pid, "-z")

    async def dump(self, name: str) -> int:
        await asyncio.to_thread(_control, self.pid, "-d")
        self.dumps += 1
        # Polls, within a bound, until callgrind has written the count since the last -z (its
        # ``summary:`` line, what the docs' figures read; ``totals:`` came out ~2 % higher in a trial).
        total = await asyncio.to_thread(_dump_total, self.out, self.pid, self.dumps, "summary:")
        (self.out / f"callgrind.{self.pid}.{self.dumps}").rename(self.out / f"{name}.cg")
        return total


async def measure(url: str, counted: Counted, requests: int) -> dict[str, float]:
    """Instructions per request of each group (the idle gateway's subtracted), and per second idle."""
    async with httpx.AsyncClient(timeout=300) as client:
        # Its start-up under valgrind at nice 10 took more than 10 minutes on a loaded 2-core machine.
        # Ready once it serves the model: /readyz answers before the dispatcher has found the
        # engine's models, and a request then is a 404.
        deadline = time.monotonic() + START_S
        while True:
            try:
                models = await client.get(url + "/v1/models")
                if models.status_code == 200 and models.json()["data"]:
                    break
            except httpx.HTTPError:
                pass
            if time.monotonic() > deadline:
                raise RuntimeError(f"the gateway served no model within {START_S:.0f} s")
            await asyncio.sleep(0.5)
        await counted.start()
        for _, tokens, stream in GROUPS:
            for _ in range(10):
                await _one(client, url, tokens, stream)
        await asyncio.sleep(1.5)  # the warm-up's events packed
        # An idle window before each group and after it (the one after is the next one's before):
        # a group's idle share is taken at the mean of the two rates. One window before all of
        # them, on a busy machine, once gave a rate that left a short request 0.13 M: the idle
        # gateway's work (its ticks, the engine's polls) comes in bursts, and it is several times
        # a short request's under valgrind.
        idle_rates = [await _idle(counted, "idle")]
        result = {}
        for name, tokens, stream in GROUPS:
            await asyncio.sleep(1.5)
            await counted.zero()
            started = time.monotonic()
            for _ in range(requests):
                await _one(client, url, tokens, stream)
            await asyncio.sleep(1.5)
            total = await counted.dump(name)
            took = time.monotonic() - started
            idle_rates.append(await _idle(counted, f"{name}.idle"))
            rate = (idle_rates[-2] + idle_rates[-1]) / 2
            result[name] = (total - rate * took) / requests
        result["idle_per_s"] = sum(idle_rates) / len(idle_rates)
        result["idle_spread"] = (max(idle_rates) - min(idle_rates)) / max(result["idle_per_s"], 1.0)
        return result


async def _idle(counted: Counted, name: str) -> float:
    """The idle gateway's instructions a second, over :data:`IDLE_S`."""
    await counted.zero()
    await asyncio.sleep(IDLE_S)
    return await counted.dump(name) / IDLE_S


def main() -> None:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.bench.overhead_callgrind",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("out", type=Path, help="a folder for callgrind's dumps")
    parser.add_argument("--requests", type=int, default=50)
    args = parser.parse_args()
    out: Path = args.out
    out.mkdir(parents=True, exist_ok=True)
    sim_port, gw_port = free_port(), free_port()
    cli = [sys.executable, "-m", "sluice.cli"]
    sim = subprocess.Popen(
        [*cli, "sim", "--model", "sim", "--port", str(sim_port), *ENGINE],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL,
    )
    gateway_args = ["serve", "--backend", f"http://127.0.0.1:{sim_port}", "--port", str(gw_port)]
    gateway_args += ["--max-concurrency", "256", "--log-level", "warning"]
    # Not counting through the start-up (its imports are most of the run's instructions): counted
    # from once it answers (see measure), which made the start-up several times faster.
    valgrind = [*NICE, "valgrind", "--tool=callgrind", "--instr-atstart=no"]
    valgrind.append(f"--callgrind-out-file={out}/callgrind.%p")
    with (out / "valgrind.log").open("w") as log:
        gateway = subprocess.Popen(
            [*valgrind, *cli, *gateway_args],
            stdout=subprocess.DEVNULL,
            stderr=log,
        )
    try:
        result = asyncio.run(measure(f"http://127.0.0.1:{gw_port}", Counted(gateway.pid, out), args.requests))
    finally:
        stop_process(gateway, 60)  # under valgrind it takes longer to exit
        stop_process(sim)
    print(
        f"idle: {result['idle_per_s'] / 1e6:.3f} M instructions a second"
        f" (its windows {result['idle_spread']:.0%} apart)"
    )
    for name, _, _ in GROUPS:
        print(f"{name}: {result[name] / 1e6:.3f} M instructions per request, the idle rate subtracted")
    per_token = (result["stream64"] - result["stream8"]) / 56
    print(f"per extra streamed token: {per_token / 1e3:.1f} k instructions")
    print(json.dumps(result))


if __name__ == "__main__":
    main()
