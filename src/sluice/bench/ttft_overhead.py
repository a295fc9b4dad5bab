"""Time to first token added by the gateway at light load: direct to an engine vs through Sluice.

Starts the simulator (``article`` preset: a real first-token time of ~17 ms) and ``sluice serve``
in front of it, each in its own process as in production, then sends streaming chat completions
one at a time, alternating direct and through Sluice, and compares the time to the first content
chunk. Light load: never more than one request in flight.

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


def start(preset_name: str) -> tuple[str, str, list[subprocess.Popen[bytes]]]:
    sim_port, gw_port = free_port(), free_port()
    sim, gateway = f"http://127.0.0.1:{sim_port}", f"http://127.0.0.1:{gw_port}"
    cli = [sys.executable, "-m", "sluice.cli"]
    sim_args = ["sim", "--preset", preset_name, "--model", "sim", "--port", str(sim_port)]
    gateway_args = ["serve", "--backend", sim, "--max-concurrency", "16", "--port", str(gw_port)]
    gateway_args += ["--log-level", "warning"]
    procs = [
        subprocess.Popen([*cli, *args], stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        for args in (sim_args, gateway_args)
    ]
    return sim, gateway, procs


async def main(requests: int, sim: str, gateway: str) -> None:
    async with httpx.AsyncClient(timeout=30) as client:
        await up(client, sim + "/health")
        await up(client, gateway + "/readyz")
        for url in (sim, gateway):  # warm up connections and the drain-rate estimate
            for _ in range(5):
                await ttft(client, url)
        direct, via = [], []
        for _ in range(requests):
            direct.append(await ttft(client, sim))
            via.append(await ttft(client, gateway))
    d50, s50 = statistics.median(direct), statistics.median(via)
    q = statistics.quantiles
    print(f"{requests} streaming requests each way, one at a time, each server in its own process")
    print(f"direct  TTFT p50 {d50 * 1000:.2f} ms  p90 {q(direct, n=10)[-1] * 1000:.2f} ms")
    print(f"sluice  TTFT p50 {s50 * 1000:.2f} ms  p90 {q(via, n=10)[-1] * 1000:.2f} ms")
    print(f"added by the gateway at p50: {(s50 - d50) * 1000:.2f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        prog="python -m sluice.bench.ttft_overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--preset", default="article")
    args = parser.parse_args()
    sim, gateway, procs = start(args.preset)
    try:
        asyncio.run(main(args.requests, sim, gateway))
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
