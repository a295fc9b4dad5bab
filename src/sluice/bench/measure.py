"""One bench run against spawned or given targets: the arrivals, the clients, the targets'
metrics before and after, and the result (config, summary, records, samples) that
:mod:`sluice.bench.report` writes; shared by ``sluice bench`` and ``sluice bench fleet``."""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import os
import shlex
import sys
import time
from collections.abc import Callable
from typing import Any

import httpx

from sluice.bench.load import Client, MetricsSampler, Profile, Record, arrivals, run_load
from sluice.bench.report import PLOTS_NEED, RESULT_VERSION, plots_available, summarize
from sluice.bench.spawn import Targets

__all__ = ["SETTLE_S", "counter", "delta", "measure", "plots_or_say_why", "progress", "settle"]

# Once every client has its outcome, give the targets this long to abort and forget what is left.
SETTLE_S = 5.0


def counter(values: dict[str, float], name: str, **labels: str) -> float | None:
    """Sum of the samples of ``name`` whose labels include ``labels``; None if there is none."""
    if not labels:
        return values.get(name)
    want = [f'{k}="{v}"' for k, v in labels.items()]
    hits = [v for k, v in values.items() if k.startswith(name + "{") and all(w in k for w in want)]
    return sum(hits) if hits else None


def delta(after: float | None, before: float | None) -> int | None:
    return None if after is None or before is None else round(after - before)


async def discover_model(http: httpx.AsyncClient, url: str) -> str | None:
    with contextlib.suppress(httpx.HTTPError, ValueError, KeyError, IndexError, TypeError):
        response = await http.get(f"{url}/v1/models", timeout=5.0)
        return str(response.json()["data"][0]["id"])
    return None


async def idle_rtt(http: httpx.AsyncClient, url: str, n: int = 20) -> float | None:
    """Median round trip of a trivial request before the load starts: the floor under every time
    the clients measure (this HTTP client, the loopback, the target's framework)."""
    times: list[float] = []
    for _ in range(n):
        started = time.perf_counter()
        try:
            await http.get(f"{url}/v1/models", timeout=5.0)
        except httpx.HTTPError:
            return None
        times.append(time.perf_counter() - started)
    return sorted(times)[n // 2]


async def settle(sampler: MetricsSampler) -> int | None:
    """Requests still queued or running at the targets after a grace period; None if unknown."""
    from sluice.bench.load import QUEUE_GAUGES

    deadline = time.monotonic() + SETTLE_S
    left: int | None = None
    while True:
        values = await sampler.scrape()
        present = [values[k] for k in QUEUE_GAUGES if k in values]
        left = round(sum(present)) if present else None
        if not left or time.monotonic() > deadline:
            return left
        await asyncio.sleep(0.2)


async def measure(
    args: argparse.Namespace,
    found: Targets,
    profile: Profile,
    *,
    label: str | None = None,
    policy: str | None = None,
    step: str = "",
    on_start: Callable[[float], None] | None = None,
) -> dict[str, Any]:
    """Drive one run against ``found`` and return its result (config, summary, records, samples).

    ``policy`` is the --policies entry this run is (recorded in its config); ``step`` prefixes the
    progress bar's description, e.g. "2/5 "; ``on_start`` is called with the run's origin (its
    ``time.perf_counter()`` at second 0 of the arrivals) as the load starts.
    """
    schedule = arrivals(profile, args.seed)
    timeout = args.client_timeout if args.client_timeout and args.client_timeout > 0 else None
    label = label or args.label or f"{found.mode}-{profile.kind}"
    limits = httpx.Limits(max_connections=None, max_keepalive_connections=None)
    async with httpx.AsyncClient(timeout=None, limits=limits) as http:
        model = args.model or await discover_model(http, found.target)
        metric_urls = [u for u in (found.gateway_metrics, found.engine_metrics) if u]
        sampler = MetricsSampler(http, list(dict.fromkeys(metric_urls)))
        before = await sampler.scrape()
        rtt = await idle_rtt(http, found.target)
        client = Client(
            http,
            found.target,
            mode=found.mode,
            model=model,
            max_tokens=args.max_tokens,
            client_timeout=timeout,
            stream=args.stream,
            users=max(args.users, 1),
            retriers=args.retriers,
            seed=args.seed,
        )
        bar = progress(len(schedule), step + label, disabled=args.no_progress)
        tally: dict[str, int] = {}

        def done(record: Record) -> None:
            tally[record.outcome or "?"] = tally.get(record.outcome or "?", 0) + 1
            if bar is not None:
                bar.set_postfix(tally, refresh=False)
                bar.update(1)

        load_before = os.getloadavg()[0]
        client.origin = sampler.origin = time.perf_counter()
        if on_start is not None:
            on_start(client.origin)
        sampling = asyncio.create_task(sampler.run_forever())
        try:
            records = await run_load(client, schedule, done)
        finally:
            sampling.cancel()
            await asyncio.gather(sampling, return_exceptions=True)
            if bar is not None:
                bar.close()
        stuck = await settle(sampler) if metric_urls else None
        after = await sampler.scrape()

    counters: dict[str, Any] = {
        "engine_generated_tokens": delta(
            after.get("vllm:generation_tokens_total"), before.get("vllm:generation_tokens_total")
        ),
        "engine_wasted_tokens": delta(
            after.get("sim:wasted_generation_tokens_total"), before.get("sim:wasted_generation_tokens_total")
        ),
        "server_admitted": delta(
            counter(after, "sluice_admissions_total", outcome="admitted"),
            counter(before, "sluice_admissions_total", outcome="admitted") or 0.0,
        ),
        "server_broken_promises": delta(
            after.get("sluice_broken_promises_total"), before.get("sluice_broken_promises_total") or 0.0
        ),
        "stuck": stuck,
    }
    summary = summarize(
        records,
        duration=profile.duration,
        capacity=found.capacity,
        counters=counters,
        capacity_source=found.capacity_source,
        profile=profile,
        client_timeout=timeout,
    )
    summary["idle_rtt_s"] = rtt
    argv = sys.argv[1:]
    config = {
        "mode": found.mode,
        "target": "spawned" if found.processes else found.target,
        "spawn_sim": args.spawn_sim,
        "spawn_sluice": found.gateway_metrics is not None and bool(found.processes),
        "sluice_args": args.sluice_args,
        "policy": policy,
        "model": model,
        "profile": {
            "kind": profile.kind,
            "rate": profile.rate,
            "duration": profile.duration,
            "peak": profile.peak,
            "spike_at": profile.spike_at,
            "spike_for": profile.spike_for,
            "to": profile.to,
        },
        "profile_text": profile.describe(),
        "duration": profile.duration,
        "seed": args.seed,
        "client_timeout": timeout,
        "max_tokens": args.max_tokens,
        "stream": args.stream,
        "users": args.users,
        "retriers": args.retriers,
        "capacity_rps": found.capacity,
        "capacity_source": found.capacity_source,
        "command": "sluice " + shlex.join(argv) if argv[:1] == ["bench"] else None,
        # Everything shares the machine's cores: a busy machine slows the simulator and the gateway.
        "load_avg_1m": [round(load_before, 2), round(os.getloadavg()[0], 2)],
        "cpus": os.cpu_count(),
    }
    return {
        "version": RESULT_VERSION,
        "label": label,
        "config": config,
        "summary": summary,
        "arrivals": schedule,
        "samples": sampler.samples,
        "records": [r.to_json() for r in records],
    }


def progress(total: int, label: str, *, disabled: bool) -> Any:
    """A tqdm bar on stderr; without tqdm (the ``bench`` extra), one plain line and no bar."""
    if disabled:
        return None
    try:
        from tqdm import tqdm
    except ImportError:
        print(f"{label}: {total} requests", file=sys.stderr, flush=True)
        return None
    return tqdm(total=total, desc=label, unit="req", mininterval=0.5, file=sys.stderr)


def plots_or_say_why(args: argparse.Namespace) -> None:
    """Turn plots off, with one line saying why, when matplotlib (the ``bench`` extra) is missing;
    checked before the run, so that a long run still writes its JSON and markdown."""
    if not args.no_plot and not plots_available():
        print(f"sluice bench: {PLOTS_NEED}", file=sys.stderr)
        args.no_plot = True
