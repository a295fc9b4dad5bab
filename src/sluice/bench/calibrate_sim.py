"""Measure a ``sluice sim`` preset from the outside: lone-request latency and saturated throughput.

Starts ``sluice sim`` in its own process (so that the load generator does not share its event loop),
then:

1. sends lone streaming requests one after another and times them (first token, last token);
2. keeps ``--concurrency`` requests in flight for ``--seconds`` and counts the answers that finish
   after a warm-up, which is the engine's capacity when the concurrency exceeds its batch (the
   workers start spread over 3 s, so that completions do not come in whole batches).

Usage: python -m sluice.bench.calibrate_sim [--preset article] [--seconds 30] [--concurrency 48] [--stream]
"""

from __future__ import annotations

import argparse
import asyncio
import statistics
import sys
import time

import httpx

from sluice.sim.model import PRESETS, capacity_rps, lone_latency_s

PROMPT = "x" * 128  # 32 tokens by the simulator's estimate, the shape capacity is quoted for
ANSWER_TOKENS = 128


async def start_sim(preset: str) -> tuple[asyncio.subprocess.Process, str]:
    proc = await asyncio.create_subprocess_exec(
        sys.executable,
        "-m",
        "sluice.cli",
        "sim",
        "--preset",
        preset,
        "--port",
        "0",
        stdout=asyncio.subprocess.PIPE,
    )
    assert proc.stdout is not None
    line = (await asyncio.wait_for(proc.stdout.readline(), timeout=30)).decode()
    print(line.strip())
    return proc, line.split("listening on ")[1].split()[0]


async def lone(client: httpx.AsyncClient, url: str) -> tuple[float, float]:
    body = {"prompt": PROMPT, "max_tokens": ANSWER_TOKENS, "stream": True}
    start = time.perf_counter()
    first = 0.0
    async with client.stream("POST", url + "/v1/completions", json=body) as response:
        async for line in response.aiter_lines():
            if line.startswith("data: {") and not first:
                first = time.perf_counter() - start
    return first, time.perf_counter() - start


async def saturate(
    client: httpx.AsyncClient, url: str, concurrency: int, seconds: float, stream: bool
) -> float:
    # Workers start spread over one batch cycle: if they all started at once, a batch would fill
    # and finish together every cycle, and a window would count whole batches, not a rate.
    spread, warmup = 3.0, 8.0
    start = time.perf_counter()
    window = (start + warmup, start + warmup + seconds)
    done: list[float] = []
    body = {"prompt": PROMPT, "max_tokens": ANSWER_TOKENS, "stream": stream}

    async def worker(index: int) -> None:
        await asyncio.sleep(index * spread / concurrency)
        while time.perf_counter() < window[1]:
            if stream:
                async with client.stream("POST", url + "/v1/completions", json=body) as response:
                    async for _ in response.aiter_lines():
                        pass
            else:
                (await client.post(url + "/v1/completions", json=body)).raise_for_status()
            done.append(time.perf_counter())

    await asyncio.gather(*(worker(i) for i in range(concurrency)))
    return sum(window[0] <= t < window[1] for t in done) / seconds


async def main() -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.bench.calibrate_sim",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--preset", default="article", choices=list(PRESETS))
    parser.add_argument("--seconds", type=float, default=30.0)
    parser.add_argument("--concurrency", type=int, default=48)
    parser.add_argument("--lone", type=int, default=5, help="lone requests to time")
    parser.add_argument("--stream", action="store_true", help="stream the saturating requests too")
    args = parser.parse_args()
    params = PRESETS[args.preset]

    proc, url = await start_sim(args.preset)
    try:
        limits = httpx.Limits(max_connections=args.concurrency + 8)
        async with httpx.AsyncClient(timeout=120, limits=limits) as client:
            await lone(client, url)  # warm the connection and the server's code paths
            times = [await lone(client, url) for _ in range(args.lone)]
            ttft = statistics.median(t[0] for t in times)
            e2e = [t[1] for t in times]
            print(
                f"lone {ANSWER_TOKENS}-token answer: median {statistics.median(e2e):.3f} s "
                f"(min {min(e2e):.3f}, max {max(e2e):.3f}; model {lone_latency_s(params):.3f} s), "
                f"first token {ttft * 1000:.1f} ms"
            )
            rate = await saturate(client, url, args.concurrency, args.seconds, args.stream)
            stats = (await client.get(url + "/sim/stats")).json()
            kind = "streaming" if args.stream else "whole answers"
            print(
                f"saturated, {args.concurrency} in flight, {kind}: "
                f"{rate:.2f} req/s over {args.seconds:.0f} s (model {capacity_rps(params):.2f} req/s); "
                f"preemptions {stats['preemptions_total']}"
            )
    finally:
        proc.terminate()
        await proc.wait()
    return 0


if __name__ == "__main__":
    sys.exit(asyncio.run(main()))
