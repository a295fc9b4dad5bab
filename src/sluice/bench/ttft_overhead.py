"""Time to first token added by the gateway at light load: direct to an engine, through the
raw pass-through, and through Sluice.

Starts the simulator (``article`` preset: a real first-token time of ~17 ms), the raw ASGI
pass-through (:mod:`sluice.bench.passthrough`: the floor of a Python proxy, one more HTTP hop and
nothing else) and ``sluice serve`` in front of it, each in its own process as in production, then
sends streaming chat completions one at a time, rotating direct, pass-through and Sluice, and
compares the time to the first content chunk. Light load: never more than one request in flight.
What the pass-through adds is the second hop's own cost, which any gateway in front of an engine
pays; Sluice's figure less it is what its features cost.

Usage: python -m sluice.bench.ttft_overhead [--requests 200] [--preset article]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import subprocess
import sys
import time

import httpx

from sluice.bench.cli import free_port
from sluice.bench.spawn import stop_process

BODY = {"model": "sim", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": True}


async def ttft(client: httpx.AsyncClient, url: str) -> float:
    start = time.perf_counter()
    first = None
    async with client.stream("POST", url + "/v1/chat/completions", json=BODY) as r:
        async for line in r.aiter_lines():
            if first is None and line.startswith("data:") and '"content"' in line:
                first = time.perf_counter() - start
    assert first is not None, "no content chunk"
    return first


async def up(client: httpx.AsyncClient, url: str) -> None:
    for _ in range(300):
        try:
            if (await client.get(url)).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        await asyncio.sleep(0.05)
    raise RuntimeError(f"{url} did not come up")


def start(preset_name: str) -> tuple[str, str, str, list[subprocess.Popen[bytes]]]:
    """The simulator's, the pass-through's and Sluice's URLs, and their processes."""
    sim_port, pass_port, gw_port = free_port(), free_port(), free_port()
    sim = f"http://127.0.0.1:{sim_port}"
    cli = [sys.executable, "-m", "sluice.cli"]
    sim_args = [*cli, "sim", "--preset", preset_name, "--model", "sim", "--port", str(sim_port)]
    pass_args = [
        sys.executable,
        "-m",
        "sluice.bench.passthrough",
        "--upstream",
        sim,
        "--port",
        str(pass_port),
    ]
    gateway_args = [*cli, "serve", "--backend", sim, "--max-concurrency", "16", "--port", str(gw_port)]
    gateway_args += ["--log-level", "warning"]
    procs = [
        subprocess.Popen(argv, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for argv in (sim_args, pass_args, gateway_args)
    ]
    return sim, f"http://127.0.0.1:{pass_port}", f"http://127.0.0.1:{gw_port}", procs


def p90(values: list[float]) -> float:
    return statistics.quantiles(values, n=10)[-1]


async def main(requests: int, sim: str, passthrough: str, gateway: str) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        await up(client, sim + "/health")
        # The pass-through answers what the engine answers: its /health is the engine's.
        await up(client, passthrough + "/health")
        await up(client, gateway + "/readyz")
        urls = {"direct": sim, "passthrough": passthrough, "sluice": gateway}
        for url in urls.values():  # warm up connections and the drain-rate estimate
            for _ in range(5):
                await ttft(client, url)
        times: dict[str, list[float]] = {name: [] for name in urls}
        for _ in range(requests):
            for name, url in urls.items():
                times[name].append(await ttft(client, url))
    p50 = {name: statistics.median(values) for name, values in times.items()}
    print(f"{requests} streaming requests each way, one at a time, each server in its own process")
    for name, values in times.items():
        print(f"{name:<12} TTFT p50 {p50[name] * 1000:.2f} ms  p90 {p90(values) * 1000:.2f} ms")
    print(f"added by the pass-through at p50: {(p50['passthrough'] - p50['direct']) * 1000:.2f} ms")
    print(f"added by the gateway at p50: {(p50['sluice'] - p50['direct']) * 1000:.2f} ms")
    above = (p50["sluice"] - p50["passthrough"]) * 1000
    print(f"added by the gateway above the pass-through at p50: {above:.2f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m sluice.bench.ttft_overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--preset", default="article")
    args = parser.parse_args()
    sim, passthrough, gateway, procs = start(args.preset)
    try:
        asyncio.run(main(args.requests, sim, passthrough, gateway))
    finally:
        for proc in procs:
            stop_process(proc)
