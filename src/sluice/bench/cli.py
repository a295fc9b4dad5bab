"""``sluice bench``: the burst-traffic experiment, as an open-loop load generator.

Simulated clients arrive as a Poisson process (``steady``, ``spike`` or ``ramp``), each in its own
task, and give up after ``--client-timeout`` seconds by closing their connection. The target is an
engine (``--mode direct``), or a Sluice gateway through its OpenAI API (``sync``) or its jobs API
(``async``). ``--spawn-sim`` and ``--spawn-sluice`` start the simulator and a gateway in front of it
as child processes, so that one command reproduces a documented number; they listen on free ports
unless ``--sim-port`` and ``--sluice-port`` choose them.

Writes ``LABEL.json`` (every request and the summary), ``LABEL.md`` and ``LABEL.png`` to ``--out``;
``sluice bench compare A.json B.json ...`` merges saved runs into one table and overlaid plots;
``sluice bench fleet`` compares ways of feeding a fleet of different engines (:mod:`sluice.bench.fleet`).
``--policies direct,cap,codel`` runs the same arrivals once per entry, each against freshly spawned
targets (the engine alone, or a gateway with that ``--queue-policy``), and writes the comparison too.
"""

from __future__ import annotations

import argparse
import contextlib
import shlex
import sys
from collections.abc import AsyncIterator
from pathlib import Path
from typing import Any

import httpx

from sluice import aio
from sluice.bench.load import MODES, PROMPT, MetricsSampler, Profile
from sluice.bench.measure import measure, plots_or_say_why, settle
from sluice.bench.report import (
    load_result,
    markdown,
    plot_compare,
    plot_run,
    resummarize,
    write_result,
)
from sluice.bench.spawn import (
    Targets,
    choose_port,
    free_port,
    log_file,
    port_number,
    spawn_sim,
    spawn_sluice,
    stop,
)

__all__ = ["POLICY_ENTRIES", "choose_port", "configure_parser", "free_port", "measure", "port_number", "run"]

# What --policies may name: the engine alone, or a gateway with that --queue-policy in front of it.
POLICY_ENTRIES = ("direct", "cap", "fifo", "deadline", "codel")

# A generator that sends this late is no longer offering the load it claims to.
MAX_SEND_LAG_S = 0.05


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.epilog = (
        "examples:\n"
        "  sluice bench --spawn-sim article --rate 10 --duration 60             # engine alone\n"
        "  sluice bench --spawn-sim article --spawn-sluice --rate 10            # Sluice in front\n"
        "  sluice bench --spawn-sim article --profile spike --rate 3 --peak 30  # 3 → 30 → 3 req/s\n"
        "  sluice bench --spawn-sim article --sim-port 8100 --spawn-sluice --sluice-port 8000\n"
        "  sluice bench --target http://127.0.0.1:8000 --mode async --profile ramp --rate 1 --to 20\n"
        "  sluice bench --spawn-sim article --policies direct,cap,fifo,codel --retriers 0.1\n"
        "  sluice bench --target http://127.0.0.1:8080 --spawn-sluice --slots 4 --policies direct,codel\n"
        "  sluice bench compare out/direct.json out/sluice.json --name steady\n"
    )
    target = parser.add_argument_group("target")
    target.add_argument("--target", metavar="URL", help="base URL of the engine or gateway (no /v1)")
    target.add_argument(
        "--mode",
        choices=MODES,
        help="direct: an engine's OpenAI API; sync: Sluice's OpenAI API (sends X-Request-Timeout); "
        "async: Sluice's jobs API (submit, long-poll, DELETE on give-up). Default: sync with "
        "--spawn-sluice, else direct",
    )
    target.add_argument("--model", help="model name to request (default: the first of /v1/models)")
    target.add_argument("--engine-metrics", metavar="URL", help="the engine's /metrics, for wasted work")
    target.add_argument(
        "--spawn-sim",
        metavar="PRESET",
        help="start `sluice sim --preset PRESET` on a free port as the engine",
    )
    target.add_argument(
        "--spawn-sluice",
        action="store_true",
        help="start `sluice serve` in front of the spawned simulator, or of the engine at --target",
    )
    target.add_argument(
        "--sim-port",
        type=port_number,
        metavar="PORT",
        help="the port of the simulator that --spawn-sim starts (default: a free one)",
    )
    target.add_argument(
        "--sluice-port",
        type=port_number,
        metavar="PORT",
        help="the port of the gateway that --spawn-sluice or --policies starts (default: a free one)",
    )
    target.add_argument(
        "--slots",
        type=int,
        metavar="N",
        help="the spawned gateway's --max-concurrency: the engine's batch size (default with "
        "--spawn-sim: the preset's; required with --target)",
    )
    target.add_argument(
        "--sluice-args",
        default="",
        metavar="ARGS",
        help="extra flags for the spawned gateway, e.g. --sluice-args='--max-queued-jobs 50'",
    )
    target.add_argument(
        "--policies",
        metavar="LIST",
        help="one run per entry, in turn, on the same arrivals: comma-separated among "
        f"{', '.join(POLICY_ENTRIES)}; direct is the engine alone, the others a fresh gateway with "
        "that --queue-policy (after --sluice-args). With --spawn-sim each entry gets a fresh engine",
    )

    load = parser.add_argument_group("offered load")
    load.add_argument("--profile", choices=("steady", "spike", "ramp"), default="steady")
    load.add_argument(
        "--rate", type=float, default=10.0, help="req/s: steady rate, spike base, ramp start (10)"
    )
    load.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (60)")
    load.add_argument("--peak", type=float, default=30.0, help="spike: rate during the spike (30)")
    load.add_argument("--spike-at", type=float, default=20.0, help="spike: when it starts, in seconds (20)")
    load.add_argument("--spike-for", type=float, default=10.0, help="spike: how long it lasts (10)")
    load.add_argument("--to", type=float, default=20.0, help="ramp: rate at the end (20)")
    load.add_argument("--seed", type=int, default=1, help="seed of the arrivals; same seed, same traffic (1)")

    client = parser.add_argument_group("clients")
    client.add_argument(
        "--client-timeout", type=float, default=15.0, help="seconds before a client gives up; 0: never (15)"
    )
    client.add_argument("--max-tokens", type=int, default=128, help="answer length asked for (128)")
    client.add_argument("--stream", action="store_true", help="stream answers (time to first token)")
    client.add_argument(
        "--retriers",
        type=float,
        default=0.0,
        metavar="FRACTION",
        help="share of the clients that, when refused with a Retry-After, wait exactly that long and "
        "retry once, as the openai SDK does; the same clients in every run with the seed (0)",
    )
    client.add_argument(
        "--users",
        type=int,
        default=1,
        help="through Sluice: spread requests over N bearer tokens (open mode tells callers apart by "
        "them); 1: anonymous (1)",
    )

    report = parser.add_argument_group("report")
    report.add_argument(
        "--capacity",
        type=float,
        help="the engine's capacity in req/s, for goodput as a share of it (default with --spawn-sim: "
        "the simulator's formula)",
    )
    report.add_argument("--out", type=Path, default=Path(".bench-out"), help="output folder (.bench-out)")
    report.add_argument("--label", help="name of this run and of its files (default MODE-PROFILE)")
    report.add_argument("--no-progress", action="store_true", help="no progress bar")
    report.add_argument("--no-plot", action="store_true", help="skip the PNG")

    sub = parser.add_subparsers(dest="bench_command", metavar="{compare,fleet}")
    compare = sub.add_parser("compare", help="merge saved runs into one table and overlaid plots")
    compare.add_argument("results", nargs="+", type=Path, metavar="RESULT.json")
    compare.add_argument("--out", type=Path, help="output folder (default: that of the first result)")
    compare.add_argument("--name", default="compare", help="file name of the table and plot (compare)")
    from sluice.bench import fleet

    fleet.configure_parser(
        sub.add_parser(
            "fleet",
            help="a fleet of different engines fed by Sluice (adaptive, fixed limits) and by the peers' "
            "routing (round-robin, least-busy), on the same arrivals",
        )
    )


def _check_args(args: argparse.Namespace) -> list[str]:
    """Reject a command line that cannot run before anything is spawned; return the --policies entries."""
    entries = [e.strip() for e in (args.policies or "").split(",") if e.strip()]
    unknown = [e for e in entries if e not in POLICY_ENTRIES]
    if unknown or (args.policies is not None and not entries):
        raise ValueError(f"--policies takes names among {', '.join(POLICY_ENTRIES)} (got {args.policies!r})")
    if len(set(entries)) != len(entries):
        raise ValueError(f"--policies names an entry twice: {args.policies!r}")
    if entries and args.mode == "direct":
        raise ValueError("--mode direct with --policies: name the entry `direct` instead")
    if not 0.0 <= args.retriers <= 1.0:
        raise ValueError("--retriers is a share of the clients, from 0 to 1")
    if args.slots is not None and args.slots < 1:
        raise ValueError("--slots must be at least 1")
    if not args.spawn_sim and not args.target:
        raise ValueError("give --target URL, or --spawn-sim PRESET")
    gateway = any(e != "direct" for e in entries) if entries else args.spawn_sluice
    if gateway and not args.spawn_sim and args.slots is None:
        raise ValueError("a gateway in front of --target needs --slots N (the engine's batch size)")
    if args.sim_port is not None and not args.spawn_sim:
        raise ValueError("--sim-port is the port of the simulator --spawn-sim starts: add --spawn-sim")
    if args.sluice_port is not None and not gateway:
        raise ValueError(
            "--sluice-port is the port of a spawned gateway: add --spawn-sluice (or a --policies entry "
            "other than direct)"
        )
    if args.sluice_port is not None and args.sluice_port == args.sim_port:
        raise ValueError("--sim-port and --sluice-port must differ")
    for chosen in (args.sim_port, args.sluice_port):
        if chosen is not None:
            choose_port(chosen)  # taken: say so now, not after the first entries have run
    return entries


@contextlib.asynccontextmanager
async def targets(args: argparse.Namespace, out: Path, policy: str | None = None) -> AsyncIterator[Targets]:
    """The target named on the command line, or spawned ones that are stopped on exit.

    ``policy`` is one entry of --policies: ``direct`` is the engine alone, any other name a spawned
    gateway with that ``--queue-policy``. With --spawn-sim the engine is spawned afresh each time, so
    no entry inherits another's engine state; an engine at --target is shared by all entries.
    """
    gateway = policy != "direct" if policy else args.spawn_sluice
    mode = "direct" if policy == "direct" else args.mode or ("sync" if gateway else "direct")
    capacity = args.capacity
    source = "--capacity" if capacity else None
    suffix = f"-{policy}" if policy else ""
    if not args.spawn_sim and not gateway:
        url = args.target.rstrip("/").removesuffix("/v1")
        engine = args.engine_metrics or (f"{url}/metrics" if mode == "direct" else None)
        gateway_metrics = f"{url}/metrics" if mode != "direct" else None
        yield Targets(url, mode, engine, gateway_metrics, capacity, source)
        return

    found = Targets("", mode, capacity=capacity, capacity_source=source)
    with contextlib.ExitStack() as logs:
        try:
            if args.spawn_sim:
                from sluice.sim.model import capacity_rps, estimate_chat_tokens, preset

                params = preset(args.spawn_sim)  # KeyError for an unknown name, before anything starts
                if capacity is None:
                    found.capacity = capacity_rps(params, args.max_tokens, estimate_chat_tokens([PROMPT]))
                    found.capacity_source = f"simulator formula (preset {args.spawn_sim})"
                slots = args.slots or params.max_num_seqs
                sim_log = logs.enter_context(log_file(out / f"sim{suffix}.log"))
                proc, engine_url = await spawn_sim(args.spawn_sim, sim_log, args.sim_port)
                found.processes.append(proc)
                found.engine_metrics = f"{engine_url}/metrics"
            else:
                engine_url = args.target.rstrip("/").removesuffix("/v1")
                found.engine_metrics = args.engine_metrics or f"{engine_url}/metrics"
                slots = args.slots  # _check_args made sure a gateway in front of --target has it
            found.target = engine_url
            if gateway:
                gw_log = logs.enter_context(log_file(out / f"sluice{suffix}.log"))
                # Flags given later win, so the entry's policy overrides one in --sluice-args.
                extra = shlex.split(args.sluice_args) + (["--queue-policy", policy] if policy else [])
                proc, gw_url = await spawn_sluice(engine_url, slots, extra, gw_log, args.sluice_port)
                found.processes.append(proc)
                found.target, found.gateway_metrics = gw_url, f"{gw_url}/metrics"
            elif mode != "direct":
                raise RuntimeError(f"--mode {mode} needs a gateway: add --spawn-sluice")
            yield found
        finally:
            for proc in reversed(found.processes):
                await stop(proc)


def _profile(args: argparse.Namespace) -> Profile:
    return Profile(
        kind=args.profile,
        rate=args.rate,
        duration=args.duration,
        peak=args.peak,
        spike_at=args.spike_at,
        spike_for=args.spike_for,
        to=args.to,
    )


def _write(out: Path, name: str, results: list[dict[str, Any]], plot: bool) -> list[Path]:
    table = out / f"{name}.md"
    table.write_text(markdown(results))
    written = [table]
    if plot:
        png = out / f"{name}.png"
        if len(results) == 1:
            plot_run(results[0], png)
        else:
            plot_compare(results, png)
        written.append(png)
    return written


def _save(out: Path, result: dict[str, Any], plot: bool) -> list[Path]:
    """One run's RESULT.json, .md and .png; a warning if the generator fell behind its schedule."""
    label = result["label"]
    write_result(out / f"{label}.json", result)
    written = [out / f"{label}.json", *_write(out, label, [result], plot)]
    lag = result["summary"]["send_lag_s"]["p99"]
    if lag is not None and lag > MAX_SEND_LAG_S:
        print(
            f"warning: {label}: requests left up to {lag * 1000:.0f} ms late (p99); the generator could "
            "not keep up and under-reports the offered load",
            file=sys.stderr,
        )
    return written


async def _engine_idle(args: argparse.Namespace) -> None:
    """Between --policies entries on a shared engine (--target): wait until it holds no request.

    A stopped gateway's last jobs, or a direct run's abandoned requests, must not eat into the next
    entry's capacity. Bounded by the same grace period as the end of a run.
    """
    url = args.engine_metrics or args.target.rstrip("/").removesuffix("/v1") + "/metrics"
    async with httpx.AsyncClient(timeout=None) as http:
        await settle(MetricsSampler(http, [url]))


async def _policies(args: argparse.Namespace, entries: list[str], profile: Profile) -> int:
    """One run per entry, in turn, on the same arrivals; then the comparison of them all."""
    out: Path = args.out
    base = args.label or profile.kind
    results: list[dict[str, Any]] = []
    written: list[Path] = []
    for i, entry in enumerate(entries, 1):
        if i > 1 and not args.spawn_sim:
            await _engine_idle(args)
        async with targets(args, out, entry) as found:
            result = await measure(
                args, found, profile, label=f"{base}-{entry}", policy=entry, step=f"{i}/{len(entries)} "
            )
        written += _save(out, result, not args.no_plot)
        results.append(result)
    name = args.label or f"policies-{profile.kind}"
    written += _write(out, name, results, not args.no_plot)
    print(markdown(results))
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0


async def _main(args: argparse.Namespace) -> int:
    entries = _check_args(args)
    profile = _profile(args)
    if entries:
        return await _policies(args, entries, profile)
    async with targets(args, args.out) as found:
        result = await measure(args, found, profile)
    written = _save(args.out, result, not args.no_plot)
    print(markdown([result]))
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0


def _compare(args: argparse.Namespace) -> int:
    try:
        results = [resummarize(load_result(p)) for p in args.results]
    except (OSError, ValueError) as exc:
        print(f"sluice bench compare: {exc}", file=sys.stderr)
        return 2
    out: Path = args.out or args.results[0].parent
    out.mkdir(parents=True, exist_ok=True)
    written = _write(out, args.name, results, not args.no_plot)
    print(markdown(results))
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)
    return 0


def run(args: argparse.Namespace) -> int:
    if getattr(args, "bench_command", None) == "fleet":
        from sluice.bench import fleet

        return fleet.run(args)
    plots_or_say_why(args)
    if getattr(args, "bench_command", None) == "compare":
        return _compare(args)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        return aio.run(_main(args))
    except (RuntimeError, ValueError, KeyError, OSError) as exc:
        print(f"sluice bench: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
