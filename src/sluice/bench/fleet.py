"""``sluice bench fleet``: one fleet of different engines, the same arrivals, four ways of feeding it.

The fleet is several ``sluice sim`` processes of different presets (batch sizes 4 to 64, different
step times) and, with ``--with-llama``, the real llama-server (:mod:`sluice.local_engine`). Each arm
gets a fresh fleet and faces the same seeded arrivals (:func:`sluice.bench.load.arrivals`):

- ``adaptive``: Sluice, learning each engine's in-flight limit itself;
- ``fixed``: Sluice with hand-set limits, a small sweep (each engine's batch size times each of
  ``--fixed-scales``); the table marks the best;
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
import itertools
import json
import math
import sys
import time
from collections.abc import AsyncIterator, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import IO, Any

import httpx

from sluice.bench import cli as bench_cli
from sluice.bench.load import PROMPT, Profile, parse_prometheus
from sluice.bench.report import goodput, plot_compare, records_of, write_result

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
ARMS = ("adaptive", "fixed", "round-robin", "least-busy")

# Batch sizes 4, 16 and 64 with different step times: a CPU llama-server, the article's vLLM, and a
# big batch whose steps are slow (about 6.9 req/s, 5.2 s per lone 128-token answer).
DEFAULT_FLEET = (
    "s4=llama-cpu",
    "s16=article",
    "s64=article,max-num-seqs=64,base-step-ms=40,per-seq-ms=0.5",
)

# `sluice sim` flags an engine spec may set, and the SimParams field each one is, with its scale.
_SIM_FLAGS = {
    "max-num-seqs": ("max_num_seqs", 1.0),
    "base-step-ms": ("base_step_s", 0.001),
    "per-seq-ms": ("per_seq_s", 0.001),
    "prefill-ms-per-token": ("prefill_s_per_token", 0.001),
    "kv-cache-tokens": ("kv_cache_tokens", 1.0),
}
# The engines' metrics are read this often: a queue that lasts less than this may go unseen.
SAMPLE_S = 0.5
# llama-server's slots when --with-llama starts it (as `sluice serve` starts it by default).
LLAMA_SLOTS = 4


@dataclass(frozen=True, slots=True)
class EngineSpec:
    """One engine of the fleet.

    ``name`` names it in configs, tables and plots; ``preset`` is the ``sluice sim`` preset and
    ``flags`` the sim flags (``_SIM_FLAGS``) that override it, as given (``{"max-num-seqs": "64"}``);
    ``llama``: the real llama-server instead of a simulator (``preset`` and ``flags`` then unused;
    its figures are estimated from the ``llama-cpu`` preset, which models it).
    """

    name: str
    preset: str = "article"
    flags: tuple[tuple[str, str], ...] = ()
    llama: bool = False

    def params(self) -> Any:
        """The simulator's :class:`~sluice.sim.model.SimParams` (for llama-server: its model's)."""
        from sluice.sim.model import preset

        if self.llama:
            return preset("llama-cpu", max_num_seqs=LLAMA_SLOTS)
        overrides: dict[str, Any] = {}
        for flag, value in self.flags:
            name, scale = _SIM_FLAGS[flag]
            overrides[name] = int(value) if scale == 1.0 else float(value) * scale
        return preset(self.preset, **overrides)

    @property
    def batch(self) -> int:
        """The engine's batch size: the hand-set limit a fixed configuration starts from."""
        return int(self.params().max_num_seqs)

    def capacity(self, max_tokens: int) -> float:
        """Requests per second it finishes with every slot busy, by the simulator's formula."""
        from sluice.sim.model import capacity_rps, estimate_chat_tokens

        return float(capacity_rps(self.params(), max_tokens, estimate_chat_tokens([PROMPT])))

    def sim_args(self) -> list[str]:
        return [arg for flag, value in self.flags for arg in (f"--{flag}", value)]

    def describe(self) -> str:
        if self.llama:
            return f"llama-server, {LLAMA_SLOTS} slots"
        p = self.params()
        return (
            f"sim {self.preset}: batch {p.max_num_seqs}, step {1000 * p.base_step_s:g} ms "
            f"+ {1000 * p.per_seq_s:g} ms per sequence"
        )


def parse_engine(text: str) -> EngineSpec:
    """``NAME=PRESET[,FLAG=VALUE...]``, e.g. ``s64=article,max-num-seqs=64,base-step-ms=40``."""
    from sluice.sim.model import PRESETS

    name, sep, rest = text.partition("=")
    parts = [p.strip() for p in rest.split(",")]
    if not sep or not name or not parts[0]:
        raise ValueError(f"an engine is NAME=PRESET[,FLAG=VALUE...] (got {text!r})")
    if parts[0] not in PRESETS:
        raise ValueError(f"engine {name}: unknown preset {parts[0]!r}; known: {', '.join(PRESETS)}")
    flags: list[tuple[str, str]] = []
    for part in parts[1:]:
        flag, eq, value = part.partition("=")
        if not eq or flag not in _SIM_FLAGS:
            raise ValueError(
                f"engine {name}: {part!r} is not one of {', '.join(f + '=N' for f in _SIM_FLAGS)}"
            )
        try:
            float(value)
        except ValueError:
            raise ValueError(f"engine {name}: {flag} takes a number, not {value!r}") from None
        flags.append((flag, value))
    spec = EngineSpec(name=name, preset=parts[0], flags=tuple(flags))
    spec.params()  # an impossible engine (SimParams says why) fails here, before anything starts
    return spec


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
        return self.kind in ("adaptive", "fixed")


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
    lines.append(f"max_concurrency = {max(arm.limits.values())}")
    for name, url in urls.items():
        lines += ["", "[[backends]]", f"name = {_toml(name)}", f"url = {_toml(url)}"]
        lines += [f"models = {_toml([model])}", f"max_concurrency = {arm.limits[name]}"]
    return "\n".join(lines) + "\n"


# -- the fleet -----------------------------------------------------------------------------------


@dataclass
class Member:
    """A running engine of the fleet: its spec, URL, and process (None for llama-server, which
    :class:`~sluice.local_engine.server.LocalEngine` supervises)."""

    spec: EngineSpec
    url: str
    proc: asyncio.subprocess.Process | None = None
    engine: Any = None

    @property
    def pid(self) -> int | None:
        if self.proc is not None:
            return self.proc.pid if self.proc.returncode is None else None
        return self.engine.pid if self.engine is not None else None


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
                log = logs.enter_context(bench_cli._log_file(out / f"{tag}-{spec.name}.log"))
                extra = [*spec.sim_args(), "--model", model]
                proc, url = await bench_cli._spawn_sim(spec.preset, log, None, extra)
                members.append(Member(spec, url, proc))
            yield members
        finally:
            for member in reversed(members):
                if member.proc is not None:
                    await bench_cli._stop(member.proc)
                elif member.engine is not None:
                    await member.engine.__aexit__(None, None, None)


async def _start_llama(spec: EngineSpec, log: Path) -> Member:
    from sluice.local_engine.server import LocalEngine

    engine = LocalEngine(slots=LLAMA_SLOTS, log_path=log, restart=False)
    await engine.__aenter__()
    return Member(spec, engine.url, None, engine)


@contextlib.asynccontextmanager
async def front(
    arm: Arm, members: Sequence[Member], out: Path, model: str
) -> AsyncIterator[bench_cli.Targets]:
    """The gateway of ``arm`` in front of the fleet: ``sluice serve`` or the peer router."""
    with bench_cli._log_file(out / f"{arm.label}-front.log") as log:
        if arm.sluice:
            config = out / f"{arm.label}.toml"
            config.write_text(sluice_config(arm, {m.spec.name: m.url for m in members}, model))
            proc, url = await bench_cli._spawn_gateway(["--config", str(config)], log)
            found = bench_cli.Targets(url, "sync", gateway_metrics=f"{url}/metrics", processes=[proc])
        else:
            argv = ["-m", "sluice.bench.peer_router", "--strategy", arm.kind]
            for m in members:
                argv += ["--engine", f"{m.spec.name}={m.url}:{arm.limits[m.spec.name]}"]
            proc, url = await _spawn_router(argv, log)
            found = bench_cli.Targets(url, "direct", processes=[proc])
        try:
            yield found
        finally:
            await bench_cli._stop(proc)


async def _spawn_router(argv: list[str], log: IO[bytes]) -> tuple[asyncio.subprocess.Process, str]:
    return await bench_cli._spawn_listener(argv, log, "peer router")


# -- the engines' side of a run ------------------------------------------------------------------


def _engine_values(values: dict[str, float]) -> dict[str, float]:
    """What the bench reads of one engine's metrics, whichever engine it is (sim, vLLM, llama-server);
    a figure the engine does not report is absent (llama-server counts no finished requests and no
    wasted tokens)."""
    names = {
        "running": ("vllm:num_requests_running", "llamacpp:requests_processing"),
        "waiting": ("vllm:num_requests_waiting", "llamacpp:requests_deferred"),
        "finished": ("vllm:request_success_total",),
        "generated": ("vllm:generation_tokens_total", "llamacpp:tokens_predicted_total"),
        "wasted": ("sim:wasted_generation_tokens_total",),
    }
    out: dict[str, float] = {}
    for key, candidates in names.items():
        found = next((values[n] for n in candidates if n in values), None)
        if found is not None and math.isfinite(found):
            out[key] = found
    return out


@dataclass
class FleetWatcher:
    """Samples every engine's ``/metrics`` during a run, and SIGKILLs one at ``kill_at`` if asked.

    ``samples`` holds, per sample, ``t`` (seconds from the run's origin) and per engine name the
    values of :func:`_engine_values` (absent once the engine stops answering); ``first`` and
    ``last`` each engine's values before the load and at its last answer; ``killed_at`` when the
    kill was sent (None: no kill). With ``gateway_metrics`` (a Sluice arm), each sample also has
    ``slots``: the gateway's ``sluice_slots``, the sum of its engines' in-flight limits (learned or
    fixed) at that moment.
    """

    http: httpx.AsyncClient
    members: Sequence[Member]
    kill: str | None = None
    kill_at: float | None = None
    gateway_metrics: str | None = None
    origin: float = 0.0
    samples: list[dict[str, Any]] = field(default_factory=list)
    first: dict[str, dict[str, float]] = field(default_factory=dict)
    last: dict[str, dict[str, float]] = field(default_factory=dict)
    killed_at: float | None = None
    _task: asyncio.Task[None] | None = None

    async def scrape(self) -> dict[str, dict[str, float]]:
        async def one(member: Member) -> tuple[str, dict[str, float] | None]:
            with contextlib.suppress(httpx.HTTPError):
                response = await self.http.get(f"{member.url}/metrics", timeout=2.0)
                if response.status_code == 200:
                    return member.spec.name, _engine_values(parse_prometheus(response.text))
            return member.spec.name, None

        got = await asyncio.gather(*(one(m) for m in self.members))
        values = {name: v for name, v in got if v is not None}
        self.last.update(values)
        return values

    async def prime(self) -> None:
        self.first = await self.scrape()

    def start(self, origin: float) -> None:
        self.origin = origin
        self._task = asyncio.create_task(self._run(), name="fleet-watcher")

    async def _run(self) -> None:
        while True:
            started = time.perf_counter()
            due = self.kill_at is not None and started - self.origin >= self.kill_at
            if self.kill and due and self.killed_at is None:
                self._kill()
            values: dict[str, Any] = dict(await self.scrape())
            if self.gateway_metrics is not None:
                with contextlib.suppress(httpx.HTTPError):
                    response = await self.http.get(self.gateway_metrics, timeout=2.0)
                    slots = parse_prometheus(response.text).get("sluice_slots")
                    if slots is not None:
                        values["slots"] = slots
            self.samples.append({"t": started - self.origin, **values})
            await asyncio.sleep(max(0.0, SAMPLE_S - (time.perf_counter() - started)))

    def _kill(self) -> None:
        member = next(m for m in self.members if m.spec.name == self.kill)
        if member.proc is not None and member.proc.returncode is None:
            member.proc.kill()  # SIGKILL: no goodbye, its connections just break
        elif member.engine is not None and member.engine.pid is not None:
            import os
            import signal

            os.kill(member.engine.pid, signal.SIGKILL)
        self.killed_at = time.perf_counter() - self.origin

    async def stop(self) -> None:
        if self._task is not None:
            self._task.cancel()
            await asyncio.gather(self._task, return_exceptions=True)

    async def settle(self, grace_s: float) -> int | None:
        """Requests still running or waiting at the live engines after up to ``grace_s``."""
        deadline = time.monotonic() + grace_s
        while True:
            values = await self.scrape()
            left = sum(v.get("running", 0.0) + v.get("waiting", 0.0) for v in values.values())
            if not left or time.monotonic() > deadline:
                return round(left)
            await asyncio.sleep(0.2)

    def report(self) -> dict[str, Any]:
        """Per engine: what it finished and generated during the run, its share, its largest queue."""
        engines: dict[str, dict[str, Any]] = {}
        for m in self.members:
            name = m.spec.name
            before, after = self.first.get(name, {}), self.last.get(name, {})

            def delta(
                key: str, before: dict[str, float] = before, after: dict[str, float] = after
            ) -> float | None:
                a, b = after.get(key), before.get(key)
                return None if a is None or b is None else a - b

            waits = [s[name]["waiting"] for s in self.samples if name in s and "waiting" in s[name]]
            runs = [s[name]["running"] for s in self.samples if name in s and "running" in s[name]]
            engines[name] = {
                "describe": m.spec.describe(),
                "batch": m.spec.batch,
                "finished": delta("finished"),
                "generated_tokens": delta("generated"),
                "wasted_tokens": delta("wasted"),
                "max_waiting": max(waits, default=None),
                "max_running": max(runs, default=None),
                "killed": name == self.kill and self.killed_at is not None,
            }
        generated = sum(e["generated_tokens"] or 0 for e in engines.values())
        for e in engines.values():
            e["share"] = (e["generated_tokens"] or 0) / generated if generated else None
        wasted = [e["wasted_tokens"] for e in engines.values()]
        return {
            "engines": engines,
            "generated_tokens": generated,
            "wasted_tokens": None if None in wasted else sum(w or 0 for w in wasted),
            "max_waiting": max((e["max_waiting"] or 0 for e in engines.values()), default=None),
            "killed": self.kill if self.killed_at is not None else None,
            "killed_at_s": self.killed_at,
            "samples": self.samples,
        }


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
            result = await bench_cli.measure(
                args, found, profile, label=arm.label, policy=arm.kind, step=step, on_start=watcher.start
            )
        finally:
            await watcher.stop()
        stuck = await watcher.settle(bench_cli.SETTLE_S)
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


def _status_counts(records: Sequence[dict[str, Any]]) -> dict[str, int]:
    def count(pred: Any) -> int:
        return sum(1 for r in records if pred(r))

    return {
        "429": count(lambda r: r["status"] == 429),
        "503": count(lambda r: r["status"] == 503),
        "504": count(lambda r: r["status"] == 504),
        "gave_up": count(lambda r: r["code"] == "client_gave_up"),
        "errors": count(lambda r: r["outcome"] == "error"),
    }


def arm_row(result: dict[str, Any]) -> dict[str, Any]:
    """One arm's line of the comparison, from its result (see :func:`run_arm`)."""
    s, fleet = result["summary"], result["fleet"]
    duration = float(result["config"]["duration"])
    lat = s["latency_ok_s"]
    killed = fleet.get("killed")
    kill: dict[str, Any] | None = None
    if killed is not None:
        t = fleet["killed_at_s"]
        inflight = [
            r
            for r in result["records"]
            if r["sent_s"] is not None and r["sent_s"] <= t and (r["ended_s"] or 0) > t
        ]
        kill = {"engine": killed, "at_s": t, "in_flight": len(inflight), "outcomes": {}}
        for r in inflight:
            kill["outcomes"][r["outcome"]] = kill["outcomes"].get(r["outcome"], 0) + 1
    return {
        "label": result["label"],
        "kind": fleet["arm"]["kind"],
        "limits": fleet["arm"]["limits"],
        "offered": s["offered"],
        "goodput_rps": s["goodput_rps"],
        # The second half of the arrivals: once a learned limit has had time to converge.
        "goodput_late_rps": goodput(records_of(result), duration / 2, duration),
        "capacity_rps": fleet["capacity_rps"],
        "ok_p50_s": lat["p50"],
        "ok_p99_s": lat["p99"],
        "wasted_share": s["wasted_share"],
        "outcomes": s["outcomes"],
        "statuses": _status_counts(result["records"]),
        "lost": s["lost"],
        "stuck": s["stuck"],
        "engines": {
            name: {k: e[k] for k in ("share", "finished", "max_waiting", "max_running", "killed")}
            for name, e in fleet["engines"].items()
        },
        "max_waiting": fleet["max_waiting"],
        "kill": kill,
        # Whether the machine kept up: how late requests left, and its load while the arm ran.
        "send_lag_p99_s": s["send_lag_s"]["p99"],
        "load_avg_1m": result["config"].get("load_avg_1m"),
    }


def fleet_table(rows: Sequence[dict[str, Any]]) -> str:
    """The comparison as markdown: one line per arm, the best fixed arm in bold."""
    fixed = [r for r in rows if r["kind"] == "fixed"]
    # "Best" only means something in a sweep of two or more fixed limits.
    best = max(fixed, key=lambda r: r["goodput_rps"])["label"] if len(fixed) > 1 else None
    names = list(rows[0]["engines"]) if rows else []

    def num(v: float | None, fmt: str) -> str:
        return "-" if v is None else fmt.format(v)

    head = (
        "| arm | limits | goodput | 2nd half | ok p50 / p99 | waste | 429 | 504 | gave up | errors | lost "
        + "| share "
        + " / ".join(names)
        + " | max engine queue | send lag p99 | load |"
    )
    lines = [head, "|---" * 15 + "|"]
    for r in rows:
        label = f"**{r['label']}** (best fixed)" if r["label"] == best else r["label"]
        limits = "learned" if r["kind"] == "adaptive" else " / ".join(str(r["limits"][n]) for n in names)
        rate = f"{r['goodput_rps']:.2f} req/s"
        if r["capacity_rps"]:
            rate += f" ({100 * r['goodput_rps'] / r['capacity_rps']:.0f} %)"
        share = " / ".join(
            num(e["share"] and 100 * e["share"], "{:.0f} %") + (" †" if e["killed"] else "")
            for e in r["engines"].values()
        )
        worst = max(r["engines"].items(), key=lambda kv: kv[1]["max_waiting"] or 0)
        queue = f"{worst[1]['max_waiting']:g} ({worst[0]})" if worst[1]["max_waiting"] is not None else "-"
        late = f"{r['goodput_late_rps']:.2f} req/s"
        st = r["statuses"]
        load = "→".join(f"{v:g}" for v in r.get("load_avg_1m") or []) or "-"
        lines.append(
            f"| {label} | {limits} | {rate} | {late} "
            f"| {num(r['ok_p50_s'], '{:.2f}')} / {num(r['ok_p99_s'], '{:.2f}')} s"
            f" | {num(r['wasted_share'] and 100 * r['wasted_share'], '{:.1f} %')} | {st['429']} | {st['504']}"
            f" | {st['gave_up']} | {st['errors']} | {r['lost']} | {share} | {queue}"
            f" | {num(r.get('send_lag_p99_s') and 1000 * r['send_lag_p99_s'], '{:.0f} ms')} | {load} |"
        )
    killed = [r for r in rows if r["kill"]]
    if killed:
        lines += ["", "Engine killed mid-run (†: its share is what it did before it died):", ""]
        for r in killed:
            k = r["kill"]
            outcomes = ", ".join(f"{v} {o}" for o, v in sorted(k["outcomes"].items())) or "none"
            lines.append(
                f"- **{r['label']}**: {k['engine']} SIGKILLed at {k['at_s']:.1f} s; of the {k['in_flight']} "
                f"requests in flight then (on every engine): {outcomes}"
            )
    return "\n".join(lines) + "\n"


# -- plots ---------------------------------------------------------------------------------------


def plot_fleet(rows: Sequence[dict[str, Any]], path: Path) -> None:
    """Goodput, latency, each engine's share and the engines' largest queue, per arm."""
    from sluice.bench.report import _pyplot

    plt = _pyplot()
    labels = [r["label"] for r in rows]
    names = list(rows[0]["engines"])
    fig, axes = plt.subplots(2, 2, figsize=(12, 8))
    x = range(len(rows))
    ax = axes[0][0]
    ax.bar(x, [r["goodput_rps"] for r in rows], color="tab:green")
    cap = rows[0]["capacity_rps"]
    if cap:
        ax.axhline(cap, color="black", linestyle=":", label=f"fleet capacity {cap:.2f}/s")
        ax.legend(loc="lower right", fontsize="small")
    ax.set_ylabel("goodput (req/s)")
    ax = axes[0][1]
    width = 0.4
    ax.bar([i - width / 2 for i in x], [r["ok_p50_s"] or 0 for r in rows], width, label="p50")
    ax.bar([i + width / 2 for i in x], [r["ok_p99_s"] or 0 for r in rows], width, label="p99")
    ax.set_ylabel("latency of successes (s)")
    ax.legend(fontsize="small")
    ax = axes[1][0]
    bottom = [0.0] * len(rows)
    for name in names:
        shares = [100 * (r["engines"][name]["share"] or 0) for r in rows]
        ax.bar(x, shares, bottom=bottom, label=name)
        bottom = [b + s for b, s in zip(bottom, shares, strict=True)]
    ax.set_ylabel("share of the tokens generated (%)")
    ax.legend(fontsize="small", loc="lower right")
    ax = axes[1][1]
    for i, name in enumerate(names):
        ax.bar(
            [j + (i - len(names) / 2 + 0.5) * 0.8 / len(names) for j in x],
            [r["engines"][name]["max_waiting"] or 0 for r in rows],
            0.8 / len(names),
            label=name,
        )
    ax.set_ylabel("engine's largest waiting queue")
    ax.legend(fontsize="small")
    for row in axes:
        for a in row:
            a.set_xticks(list(x))
            a.set_xticklabels(labels, rotation=20, fontsize="small")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_engines(results: Sequence[dict[str, Any]], path: Path) -> None:
    """Per arm: each engine's answers per second and its waiting queue over time (a kill marked)."""
    from sluice.bench.report import _pyplot

    plt = _pyplot()
    fig, axes = plt.subplots(len(results), 2, figsize=(12, 2.6 * len(results)), squeeze=False, sharex=True)
    colors = plt.rcParams["axes.prop_cycle"].by_key()["color"]
    for row, result in zip(axes, results, strict=True):
        fleet = result["fleet"]
        samples = fleet["samples"]
        for i, name in enumerate(fleet["engines"]):
            pts = [(s["t"], s[name]) for s in samples if name in s]
            color = colors[i % len(colors)]
            rate = [
                (t1, max(0.0, (b["finished"] - a["finished"]) / (t1 - t0)))
                for (t0, a), (t1, b) in itertools.pairwise(pts)
                if t1 > t0 and "finished" in a and "finished" in b
            ]
            smooth = [
                (t, sum(v for _, v in rate[max(0, j - 7) : j + 1]) / len(rate[max(0, j - 7) : j + 1]))
                for j, (t, _) in enumerate(rate)
            ]
            if smooth:
                row[0].plot(*zip(*smooth, strict=True), color=color, label=name)
            waits = [(t, v["waiting"]) for t, v in pts if "waiting" in v]
            if waits:
                row[1].plot(*zip(*waits, strict=True), color=color, label=name)
        for ax in row:
            if fleet.get("killed_at_s") is not None:
                ax.axvline(
                    fleet["killed_at_s"], color="black", linestyle=":", label=f"{fleet['killed']} killed"
                )
            ax.legend(fontsize="x-small", loc="upper right")
        row[0].set_ylabel(f"{result['label']}\nanswers/s (2 s mean)")
        row[1].set_ylabel("engine's waiting queue")
    axes[-1][0].set_xlabel("time since start (s)")
    axes[-1][1].set_xlabel("time since start (s)")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


def plot_limits(results: Sequence[dict[str, Any]], path: Path) -> None:
    """The Sluice arms' in-flight limit, summed over the fleet, over time, against the batch sizes."""
    from sluice.bench.report import _pyplot

    plt = _pyplot()
    fig, ax = plt.subplots(figsize=(10, 4))
    batches = None
    for result in results:
        points = [(s["t"], s["slots"]) for s in result["fleet"]["samples"] if "slots" in s]
        if points:
            ax.plot(*zip(*points, strict=True), label=result["label"])
        batches = sum(e["batch"] for e in result["fleet"]["engines"].values())
    if batches:
        ax.axhline(batches, color="black", linestyle=":", label=f"sum of the batch sizes ({batches})")
    ax.set_ylabel("Sluice's in-flight limit,\nsummed over the engines")
    ax.set_xlabel("time since start (s)")
    ax.legend(fontsize="small", loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=90)
    plt.close(fig)


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
        help=f"a simulator of the fleet (repeatable), FLAG among {', '.join(_SIM_FLAGS)}; default: the "
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
        from sluice.local_engine.build import MODEL_ALIAS

        args.model = MODEL_ALIAS
    capacity = sum(e.capacity(args.max_tokens) for e in engines)
    profile = _profile(args, capacity)
    arms = plan_arms(engines, kinds, scales, args.peer_scale)
    # What bench_cli.measure reads of the arguments besides these.
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

    bench_cli._plots_or_say_why(args)
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
