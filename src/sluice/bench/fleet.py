"""``sluice bench fleet``: one fleet of different engines, the same arrivals, four ways of feeding it.

The fleet is several ``sluice sim`` processes of different presets (batch sizes 4 to 64, different
step times) and, with ``--with-llama``, the real llama-server (:mod:`sluice.local_engine`). Each arm
gets a fresh fleet and faces the same seeded arrivals (:func:`sluice.bench.load.arrivals`):

- ``adaptive``: Sluice, learning each engine's in-flight limit itself;
- ``fixed``: Sluice with hand-set limits, a small sweep (each engine's batch size times each of
  ``--fixed-scales``); the table marks the best;
- ``least-loaded``: Sluice with the fixed limits of ``--peer-scale`` (the batch sizes) and
  ``routing = "least_loaded"``: against ``fixed-x1``, only the routing differs (predicted
  completion, Sluice's default, against the largest free fraction of the limit);
- ``round-robin`` and ``least-busy``: the peers' routing with a fixed cap per engine
  (:mod:`sluice.bench.peer_router`, as LiteLLM's router does).

Besides what every ``sluice bench`` run reports, the engines' own ``/metrics`` are sampled: each
engine's share of the tokens generated, the work wasted on requests their clients gave up, and the
engine's largest waiting queue. ``--kill NAME`` SIGKILLs that engine at ``--kill-at`` (a share of
the run) in every arm, to see where its work goes.

Writes per arm the usual ``LABEL.json/.md/.png``, then ``fleet.md`` (the table), ``fleet.json``
(every arm's fleet figures) and the plots ``fleet.png`` (headline bars), ``fleet-time.png`` (the
arms over time) and ``fleet-engines.png`` (each engine's answers and queue over time).
"""

from __future__ import annotations

import argparse
import asyncio
import contextlib
import json
import sys
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import IO, Any

import httpx

from sluice.bench.fleet_engines import DEFAULT_FLEET, LLAMA_SLOTS, SIM_FLAGS, EngineSpec, parse_engine
from sluice.bench.fleet_report import arm_row, fleet_table, plot_engines, plot_fleet, plot_limits
from sluice.bench.fleet_watch import FleetWatcher, Member
from sluice.bench.load import Profile
from sluice.bench.measure import SETTLE_S, measure, plots_or_say_why
from sluice.bench.report import plot_compare, write_result
from sluice.bench.spawn import Targets, log_file, spawn_gateway, spawn_listener, spawn_sim, stop

__all__ = [
    "ARMS",
    "DEFAULT_FLEET",
    "Arm",
    "EngineSpec",
    "configure_parser",
    "fleet_table",
    "parse_engine",
    "plan_arms",
    "run",
    "sluice_config",
]

# What --arms may name.
ARMS = ("adaptive", "fixed", "least-loaded", "round-robin", "least-busy")


@dataclass(frozen=True, slots=True)
class Arm:
    """One way of feeding the fleet.

    ``label`` names the run and its files; ``kind`` is one of :data:`ARMS`; ``limits`` the in-flight
    cap per engine name (a Sluice ``fixed`` arm's ``max_concurrency``, a peer arm's cap; for
    ``adaptive``, which sets none, the batch sizes); ``scale`` what the batch sizes were multiplied by
    to get them.
    """

    label: str
    kind: str
    limits: dict[str, int]
    scale: float = 1.0

    @property
    def sluice(self) -> bool:
        return self.kind in ("adaptive", "fixed", "least-loaded")


def plan_arms(
    engines: Sequence[EngineSpec], kinds: Sequence[str], fixed_scales: Sequence[float], peer_scale: float
) -> list[Arm]:
    """The arms to run, in order: adaptive, the fixed sweep, then the peers."""

    def limits(scale: float) -> dict[str, int]:
        return {e.name: max(1, round(e.batch * scale)) for e in engines}

    arms: list[Arm] = []
    for kind in kinds:
        if kind == "fixed":
            arms += [Arm(f"fixed-x{s:g}", "fixed", limits(s), s) for s in fixed_scales]
        elif kind == "adaptive":
            # No ceiling is configured (see sluice_config): these batch sizes are only for the table.
            arms.append(Arm("adaptive", "adaptive", limits(1.0), 1.0))
        else:
            arms.append(Arm(kind, kind, limits(peer_scale), peer_scale))
    return arms


# -- configuration of the Sluice arms ------------------------------------------------------------


def adaptive_supported() -> bool:
    """Whether this build's settings can learn engine limits (``[[pools]]`` with adaptive limits)."""
    from sluice.config import Settings

    return "pools" in Settings.model_fields


def _toml(value: Any) -> str:
    return json.dumps(value)  # a JSON string, number, bool or list of strings is TOML too


def sluice_config(arm: Arm, urls: dict[str, str], model: str) -> str:
    """The TOML of the gateway for ``arm``: the fleet's engines, their limits fixed or learned.

    ``adaptive``: one ``[[pools]]`` of every engine, with no limit and no ceiling, as a user who knows
    nothing of the engines would write it. ``fixed``: one ``[[backends]]`` per engine with its
    ``max_concurrency``. Prefix affinity is off in both: every request of the bench has the same prompt
    and the simulators have no prefix cache, so it could only pile work on one engine (its effect is
    measured by ``sluice.bench.prefix_routing``).
    """
    lines = [f"# sluice bench fleet, arm {arm.label}"]
    if adaptive_supported():
        lines.append("prefix_affinity = false")
    if arm.kind == "adaptive":
        if not adaptive_supported():
            raise RuntimeError("this build has no adaptive engine limits yet (no [[pools]] in the settings)")
        lines += ["", "[[pools]]", 'name = "fleet"', f"models = {_toml([model])}"]
        lines += [f"engines = {_toml(list(urls.values()))}", "adaptive = true"]
        return "\n".join(lines) + "\n"
    if arm.kind == "least-loaded":
        lines.append('routing = "least_loaded"')
    lines.append(f"max_concurrency = {max(arm.limits.values())}")
    for name, url in urls.items():
        lines += ["", "[[backends]]", f"name = {_toml(name)}", f"url = {_toml(url)}"]
        lines += [f"models = {_toml([model])}", f"max_concurrency = {arm.limits[name]}"]
    return "\n".join(lines) + "\n"


# -- the fleet -----------------------------------------------------------------------------------


@contextlib.asynccontextmanager
async def spawn_fleet(
    engines: Sequence[EngineSpec], out: Path, model: str, tag: str
) -> AsyncIterator[list[Member]]:
    """Start every engine (simulators on free ports, llama-server if asked), stop them all on exit."""
    members: list[Member] = []
    with contextlib.ExitStack() as logs:
        try:
            for spec in engines:
                if spec.llama:
                    members.append(await _start_llama(spec, out / f"{tag}-{spec.name}.log"))
                    continue
                log = logs.enter_context(log_file(out / f"{tag}-{spec.name}.log"))
                extra = [*spec.sim_args(), "--model", model]
                proc, url = await spawn_sim(spec.preset, log, None, extra)
                members.append(Member(spec, url, proc))
            yield members
        finally:
            for member in reversed(members):
                if member.proc is not None:
                    await stop(member.proc)
                elif member.engine is not None:
                    await member.engine.__aexit__(None, None, None)


async def _start_llama(spec: EngineSpec, log: Path) -> Member:
    from sluice.local_engine.server import LocalEngine

    engine = LocalEngine(slots=LLAMA_SLOTS, log_path=log, restart=False)
    await engine.__aenter__()
    return Member(spec, engine.url, None, engine)


@contextlib.asynccontextmanager
async def front(arm: Arm, members: Sequence[Member], out: Path, model: str) -> AsyncIterator[Targets]:
    """The gateway of ``arm`` in front of the fleet: ``sluice serve`` or the peer router."""
    with log_file(out / f"{arm.label}-front.log") as log:
        if arm.sluice:
            config = out / f"{arm.label}.toml"
            config.write_text(sluice_config(arm, {m.spec.name: m.url for m in members}, model))
            proc, url = await spawn_gateway(["--config", str(config)], log)
            found = Targets(url, "sync", gateway_metrics=f"{url}/metrics", processes=[proc])
        else:
            argv = ["-m", "sluice.bench.peer_router", "--strategy", arm.kind]
            for m in members:
                argv += ["--engine", f"{m.spec.name}={m.url}:{arm.limits[m.spec.name]}"]
            proc, url = await _spawn_router(argv, log)
            found = Targets(url, "direct", processes=[proc])
        try:
            yield found
        finally:
            await stop(proc)


async def _spawn_router(argv: list[str], log: IO[bytes]) -> tuple[asyncio.subprocess.Process, str]:
    return await spawn_listener(argv, log, "peer router")


# -- one arm, then all of them -------------------------------------------------------------------


async def run_arm(
    args: argparse.Namespace, engines: Sequence[EngineSpec], arm: Arm, profile: Profile, step: str
) -> dict[str, Any]:
    """A fresh fleet, ``arm``'s gateway in front of it, the arrivals; the run's result with ``fleet``."""
    out: Path = args.out
    kill_at = args.kill_at * profile.duration if args.kill else None
    async with (
        spawn_fleet(engines, out, args.model, arm.label) as members,
        front(arm, members, out, args.model) as found,
        httpx.AsyncClient() as http,
    ):
        watcher = FleetWatcher(http, members, args.kill, kill_at, found.gateway_metrics)
        await watcher.prime()
        try:
            result = await measure(
                args, found, profile, label=arm.label, policy=arm.kind, step=step, on_start=watcher.start
            )
        finally:
            await watcher.stop()
        stuck = await watcher.settle(SETTLE_S)
    fleet = watcher.report()
    fleet["stuck_at_engines"] = stuck
    fleet["arm"] = {"kind": arm.kind, "limits": arm.limits, "scale": arm.scale}
    fleet["capacity_rps"] = sum(e.capacity(args.max_tokens) for e in engines)
    summary = result["summary"]
    # The engines' own counters, summed over the fleet, are the run's waste (see report.summarize).
    summary["engine_generated_tokens"] = fleet["generated_tokens"]
    summary["engine_wasted_tokens"] = fleet["wasted_tokens"]
    if fleet["wasted_tokens"] is not None and fleet["generated_tokens"]:
        summary["wasted_share"] = fleet["wasted_tokens"] / fleet["generated_tokens"]
        summary["wasted_source"] = "engine counters sim:wasted_generation_tokens_total, summed over the fleet"
    if summary.get("stuck") is None:
        summary["stuck"] = stuck
    summary["nothing_lost"] = summary["lost"] == 0 and not summary["stuck"]
    result["fleet"] = fleet
    result["config"]["fleet"] = [{"name": e.name, "describe": e.describe()} for e in engines]
    return result


# -- command line --------------------------------------------------------------------------------


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.formatter_class = argparse.RawDescriptionHelpFormatter
    parser.description = (__doc__ or "").split("\n\n")[0]
    parser.epilog = (
        "examples:\n"
        "  sluice bench fleet --duration 60                       # the default fleet, every arm\n"
        "  sluice bench fleet --arms fixed,least-busy --fixed-scales 1 --duration 10\n"
        "  sluice bench fleet --kill s64 --arms adaptive,least-busy  # one engine SIGKILLed at t/2\n"
        "  sluice bench fleet --engine a=article --engine b=llama-cpu --with-llama\n"
        f"default fleet: {' '.join(DEFAULT_FLEET)}\n"
    )
    g = parser.add_argument_group("fleet")
    g.add_argument(
        "--engine",
        action="append",
        metavar="NAME=PRESET[,FLAG=N...]",
        help=f"a simulator of the fleet (repeatable), FLAG among {', '.join(SIM_FLAGS)}; default: the "
        "fleet below",
    )
    g.add_argument(
        "--with-llama", action="store_true", help="add the real llama-server (sluice engine build)"
    )
    g.add_argument(
        "--model", default="sim", help="the model every engine serves (sim; smollm2 with --with-llama)"
    )
    g.add_argument("--arms", default=",".join(ARMS), help=f"comma-separated among {', '.join(ARMS)} (all)")
    g.add_argument(
        "--fixed-scales",
        default="0.5,1,2",
        help="the fixed sweep: each engine's limit is its batch size times each of these (0.5,1,2)",
    )
    g.add_argument("--peer-scale", type=float, default=1.0, help="the peers' cap: batch size times this (1)")
    g.add_argument("--kill", metavar="NAME", help="SIGKILL this engine mid-run in every arm")
    g.add_argument("--kill-at", type=float, default=0.5, help="when, as a share of --duration (0.5)")
    load = parser.add_argument_group("offered load")
    load.add_argument("--profile", choices=("steady", "spike", "ramp"), default="steady")
    load.add_argument(
        "--load",
        type=float,
        default=1.2,
        help="offered rate as a multiple of the fleet's capacity, unless --rate (1.2)",
    )
    load.add_argument("--rate", type=float, help="req/s: steady rate, spike base, ramp start")
    load.add_argument("--duration", type=float, default=60.0, help="seconds of arrivals (60)")
    load.add_argument("--peak", type=float, help="spike: rate during the spike (default 3x the rate)")
    load.add_argument("--spike-at", type=float, default=20.0)
    load.add_argument("--spike-for", type=float, default=10.0)
    load.add_argument("--to", type=float, help="ramp: rate at the end (default 2x the rate)")
    load.add_argument("--seed", type=int, default=1, help="seed of the arrivals (1)")
    client = parser.add_argument_group("clients")
    client.add_argument("--client-timeout", type=float, default=15.0, help="seconds; 0: never (15)")
    client.add_argument("--max-tokens", type=int, default=128, help="answer length asked for (128)")
    client.add_argument("--stream", action="store_true", help="stream answers")
    client.add_argument(
        "--retriers", type=float, default=0.0, help="share retrying once after Retry-After (0)"
    )
    report = parser.add_argument_group("report")
    report.add_argument("--out", type=Path, default=Path(".bench-out/fleet"), help="(.bench-out/fleet)")
    report.add_argument("--no-progress", action="store_true")
    report.add_argument("--no-plot", action="store_true")


def _engines(args: argparse.Namespace) -> list[EngineSpec]:
    engines = [parse_engine(t) for t in (args.engine or DEFAULT_FLEET)]
    if args.with_llama:
        engines.append(EngineSpec("llama", llama=True))
    names = [e.name for e in engines]
    if len(set(names)) != len(names):
        raise ValueError(f"two engines share a name: {names}")
    return engines


def _check(args: argparse.Namespace, engines: Sequence[EngineSpec]) -> tuple[list[str], list[float]]:
    kinds = [k.strip() for k in args.arms.split(",") if k.strip()]
    if not kinds or any(k not in ARMS for k in kinds) or len(set(kinds)) != len(kinds):
        raise ValueError(f"--arms takes names among {', '.join(ARMS)}, each once (got {args.arms!r})")
    try:
        scales = [float(s) for s in args.fixed_scales.split(",") if s.strip()]
    except ValueError:
        raise ValueError(f"--fixed-scales takes numbers (got {args.fixed_scales!r})") from None
    if "fixed" in kinds and (not scales or min(scales) <= 0):
        raise ValueError("--fixed-scales takes positive numbers")
    if args.peer_scale <= 0:
        raise ValueError("--peer-scale must be positive")
    if args.kill is not None and args.kill not in {e.name for e in engines}:
        raise ValueError(f"--kill {args.kill}: no such engine ({', '.join(e.name for e in engines)})")
    if not 0 < args.kill_at < 1:
        raise ValueError("--kill-at is a share of the run, between 0 and 1")
    if "adaptive" in kinds and not adaptive_supported():
        raise ValueError("this build has no adaptive engine limits yet: leave `adaptive` out of --arms")
    return kinds, scales


def _profile(args: argparse.Namespace, capacity: float) -> Profile:
    rate = args.rate if args.rate is not None else round(args.load * capacity, 2)
    return Profile(
        kind=args.profile,
        rate=rate,
        duration=args.duration,
        peak=args.peak if args.peak is not None else 3 * rate,
        spike_at=args.spike_at,
        spike_for=args.spike_for,
        to=args.to if args.to is not None else 2 * rate,
    )


async def _main(args: argparse.Namespace) -> tuple[Profile, list[dict[str, Any]]]:
    engines = _engines(args)
    kinds, scales = _check(args, engines)
    if args.with_llama and args.model == "sim":
        from sluice.local_engine.cache import MODEL_ALIAS

        args.model = MODEL_ALIAS
    capacity = sum(e.capacity(args.max_tokens) for e in engines)
    profile = _profile(args, capacity)
    arms = plan_arms(engines, kinds, scales, args.peer_scale)
    # What measure reads of the arguments besides these.
    args.label, args.users, args.spawn_sim, args.sluice_args = None, 1, None, ""
    print(
        f"fleet: {', '.join(f'{e.name} ({e.describe()})' for e in engines)}; capacity {capacity:.2f} "
        f"req/s; {profile.describe()}; {len(arms)} arms",
        file=sys.stderr,
        flush=True,
    )
    results: list[dict[str, Any]] = []
    for i, arm in enumerate(arms, 1):
        result = await run_arm(args, engines, arm, profile, f"{i}/{len(arms)} ")
        summary = result["summary"]
        summary["capacity_rps"] = capacity
        summary["goodput_pct_capacity"] = 100 * summary["goodput_rps"] / capacity
        result["config"]["capacity_rps"] = capacity
        result["config"]["capacity_source"] = "simulator formula, summed over the fleet"
        # Saved as it ends: an interrupted comparison keeps the arms it finished.
        write_result(args.out / f"{arm.label}.json", result)
        results.append(result)
    return profile, results


def _report(args: argparse.Namespace, profile: Profile, results: list[dict[str, Any]]) -> None:
    """Each arm's result, the table, the figures and the plots, into --out."""
    out: Path = args.out
    rows = [arm_row(r) for r in results]
    command = results[0]["config"]["command"]
    header = (
        f"{profile.describe()}, seed {args.seed}, client timeout {args.client_timeout:g} s, "
        f"max_tokens {args.max_tokens}"
    )
    text = f"{header}\n\n{fleet_table(rows)}" + (f"\n`{command}`\n" if command else "")
    (out / "fleet.md").write_text(text)
    (out / "fleet.json").write_text(
        json.dumps({"profile": profile.describe(), "rows": rows}, indent=1) + "\n"
    )
    written = [out / "fleet.md", out / "fleet.json"]
    if not args.no_plot:
        plot_fleet(rows, out / "fleet.png")
        plot_compare(results, out / "fleet-time.png")
        plot_engines(results, out / "fleet-engines.png")
        written += [out / "fleet.png", out / "fleet-time.png", out / "fleet-engines.png"]
        if any("slots" in s for r in results for s in r["fleet"]["samples"]):
            plot_limits(results, out / "fleet-limits.png")
            written.append(out / "fleet-limits.png")
    print(text)
    print("wrote " + ", ".join(str(p) for p in written), file=sys.stderr)


def run(args: argparse.Namespace) -> int:
    """``sluice bench fleet``: every arm in turn, then the comparison."""
    from sluice import aio

    plots_or_say_why(args)
    try:
        args.out.mkdir(parents=True, exist_ok=True)
        profile, results = aio.run(_main(args))
        _report(args, profile, results)
        return 0
    except (RuntimeError, ValueError, KeyError, OSError) as exc:
        print(f"sluice bench fleet: {exc}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        return 130
