"""Time to first token added by the gateway at light load: direct to an engine vs through Sluice.

Starts the simulator (``article`` preset: a real first-token time of ~17 ms) and an embedded
gateway in front of it, then sends streaming chat completions one at a time, alternating direct
and through Sluice, and compares the time to the first content chunk. Light load: never more than
one request in flight.

Usage: python bench/ttft_overhead.py [--requests 200] [--preset article]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time
from pathlib import Path

import httpx

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

from tests.servers import run_gateway  # noqa: E402

from sluice.sim import preset  # noqa: E402
from sluice.sim_server import serve_in_background  # noqa: E402

BODY = {"model": "sim", "messages": [{"role": "user", "content": "hello"}], "max_tokens": 4, "stream": True}


async def ttft(client: httpx.AsyncClient, url: str) -> float:
    start = time.perf_counter()
    async with client.stream("POST", url + "/v1/chat/completions", json=BODY) as r:
        async for line in r.aiter_lines():
            if line.startswith("data:") and '"content"' in line:
                first = time.perf_counter() - start
                break
        async for _ in r.aiter_lines():
            pass
    return first


async def main(requests: int, preset_name: str) -> None:
    async with (
        serve_in_background(preset(preset_name, model="sim")) as sim,
        run_gateway([sim], max_concurrency=16) as gw,
        httpx.AsyncClient(timeout=30) as client,
    ):
        for url in (sim, gw.url):  # warm up connections and the drain-rate estimate
            for _ in range(5):
                await ttft(client, url)
        direct, via = [], []
        for _ in range(requests):
            direct.append(await ttft(client, sim))
            via.append(await ttft(client, gw.url))
    d50, s50 = statistics.median(direct), statistics.median(via)
    q = statistics.quantiles
    print(f"{requests} streaming requests each way, one at a time, preset {preset_name}")
    print(f"direct  TTFT p50 {d50 * 1000:.2f} ms  p90 {q(direct, n=10)[-1] * 1000:.2f} ms")
    print(f"sluice  TTFT p50 {s50 * 1000:.2f} ms  p90 {q(via, n=10)[-1] * 1000:.2f} ms")
    print(f"added by the gateway at p50: {(s50 - d50) * 1000:.2f} ms")


if __name__ == "__main__":
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--requests", type=int, default=200)
    parser.add_argument("--preset", default="article")
    args = parser.parse_args()
    asyncio.run(main(args.requests, args.preset))
