"""Gateway overhead: what one gateway process passes, how fast, and at what CPU cost per request.

A closed loop: ``--connections`` keep-alive connections each send a short chat completion, wait
for the whole answer and send the next at once, for ``--seconds`` after ``--warmup``. Every
process is its own, as in production, and each one's CPU time (user + system, from
``/proc/PID/stat``, children included) is read at the start and the end of the measured window,
so each row says what each process spent per request. Groups of rows:

* ``closed``: short non-streaming requests (``--tokens``, 8) against the engine directly, the raw
  pass-through reference (:mod:`sluice.bench.passthrough`: the floor of a Python proxy), Sluice
  (``sluice serve``, memory broker) and LiteLLM's proxy when it is installed;
* ``stream``: the same targets streamed, at ``--tokens`` and at ``--stream-tokens`` (64) tokens,
  for the CPU per relayed token (the difference of the two, per extra token) and the time to
  the first token under load;
* ``flood``: ``--flood-connections`` (64) in front of a saturated 16-sequence engine (the
  ``article`` preset): answers and refusals per second, and the CPU of each refusal;
* ``scaling``: Sluice on a real Redis (a ``redis-server`` started on a free port), with 1, 2, ...
  gateways (``--gateways``) and as many workers; the load is spread over the gateways;
* ``clients``: the gateway's HTTP client to the engine alone, each making the closed loop's
  requests from this process: httpx set up as the gateway had it before, aiohttp alone, and the
  gateway's own (:class:`sluice.backends.openai.OpenAIBackend` on aiohttp): what the client costs
  per request (the ``load`` CPU).

The engine for ``closed``, ``stream``, ``scaling`` and ``clients`` is the simulator with 256 slots
and 1.25 ms steps (an 8-token answer in 10 ms), so that the engine is not the limit. The load
generator is a minimal HTTP/1.1 client on uvloop in this process (its CPU is the ``load`` column).

Writes ``LABEL.json`` (every row) to ``--out``, and ``LABEL.png`` with ``--plot`` (the ``bench``
extra). ``--py-spy DIR`` records the Sluice gateway during each of its rows (py-spy's raw
collapsed stacks, ``DIR/ROW.txt``) and prints where its samples went: by library, by task, by frame.
``--syscalls DIR`` counts the Sluice gateway's socket system calls (write, read and their kin) with
perf's tracepoints during each of its rows (``DIR/ROW.txt``) and prints them per response (over the
warm-up and the window, whose responses are taken at the window's rate).

The parts: :mod:`~sluice.bench.overhead_load` (the load and the measured window),
:mod:`~sluice.bench.overhead_procs` (the processes), :mod:`~sluice.bench.overhead_report` (the rows
and tables), :mod:`~sluice.bench.overhead_profile` (py-spy, perf); this module runs the groups.

Usage: python -m sluice.bench.overhead [--seconds 10] [--connections 32] [--groups closed,stream,...]
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path
from typing import Any

from sluice.bench.overhead_load import CLIENT_SLOTS, CLIENTS, Load, client_requests, closed_loop
from sluice.bench.overhead_procs import (
    Note,
    Spawner,
    have_redis,
    litellm_python,
    redis_fleet,
    start_engine,
    start_gateway,
)
from sluice.bench.overhead_profile import perf_syscalls, print_profile, py_spy, syscall_counts
from sluice.bench.overhead_report import (
    GROUPS,
    Row,
    make_row,
    per_token_us,
    plot,
    refusal_ms,
    scaling_curve,
    table,
)

TARGETS = ("engine", "passthrough", "sluice", "litellm")
# 256 slots, 1.25 ms per step whatever the batch: an 8-token answer in 10 ms, and 32 connections
# never fill the engine.
FAST_ENGINE = ["--max-num-seqs", "256", "--base-step-ms", "1.25", "--per-seq-ms", "0"]
FAST_ENGINE += ["--prefill-ms-per-token", "0"]
# The article's engine: 16 sequences, 16 ms steps (about 88 eight-token answers per second).
FLOOD_ENGINE = ["--preset", "article"]
FLOOD_SLOTS = 16
FAST_SLOTS = CLIENT_SLOTS


@dataclass(slots=True)
class Options:
    """Everything a benchmark run needs (the command line's flags; see ``--help``)."""

    seconds: float = 10.0
    warmup_s: float = 2.0
    connections: int = 32
    tokens: int = 8
    stream_tokens: int = 64
    flood_connections: int = 64
    flood_tokens: int = 8
    gateways: tuple[int, ...] = (1, 2)
    groups: tuple[str, ...] = GROUPS
    targets: tuple[str, ...] = TARGETS
    litellm_python: str | None = None
    out: Path = Path(".bench-out")
    label: str = "overhead"
    plot: bool = False
    py_spy: Path | None = None
    syscalls: Path | None = None


# -- the groups -------------------------------------------------------------------------------------


def _measure(
    rows: list[Row],
    group: str,
    name: str,
    command: str,
    urls: Sequence[str],
    load: Load,
    roles: dict[str, list[int]],
    options: Options,
    profile_pid: int | None = None,
) -> Row:
    """Measure one row; with ``--py-spy`` (``--syscalls``), ``profile_pid`` (the Sluice gateway) is
    recorded (its system calls counted) meanwhile."""
    record = counted = None
    file_name = name.replace(" ", "-") + ".txt"
    if options.py_spy is not None and profile_pid is not None:
        options.py_spy.mkdir(parents=True, exist_ok=True)
        record = options.py_spy / file_name
    if options.syscalls is not None and profile_pid is not None:
        options.syscalls.mkdir(parents=True, exist_ok=True)
        counted = options.syscalls / file_name
    span_s = options.warmup_s + options.seconds
    with py_spy(profile_pid or 0, span_s, record), perf_syscalls(profile_pid or 0, span_s, counted):
        window = closed_loop(urls, load, options.warmup_s, options.seconds, roles)
    row = make_row(group, name, command, load, window)
    print(f"  {name}: {row.answers_per_s:,.0f} answers/s, {row.refusals_per_s:,.0f} refusals/s", flush=True)
    if counted is not None and counted.exists():
        # perf counts through the warm-up and the window; the responses of both are estimated at
        # the window's rate.
        responses = (row.answers_per_s + row.refusals_per_s) * span_s
        per = {k: v / responses for k, v in syscall_counts(counted).items() if responses > 0}
        row = replace(row, syscalls_per_response=per)
        shown = ", ".join(f"{k} {v:.2f}" for k, v in per.items() if v)
        print(f"  {name}: system calls per response: {shown}", flush=True)
    rows.append(row)
    return row


def run_fast_groups(spawner: Spawner, options: Options, rows: list[Row], note: Note) -> None:
    """``closed`` and ``stream``: every target in front of the fast engine."""
    engine, engine_proc = start_engine(spawner, "engine", FAST_ENGINE)
    short = Load(options.connections, options.tokens, stream=False)
    streams = [Load(options.connections, n, stream=True) for n in (options.tokens, options.stream_tokens)]
    for target in options.targets:
        if target == "litellm" and options.litellm_python is None:
            continue
        if target == "engine":
            url, command, roles = engine, "the engine directly", {"engine": [engine_proc.pid]}
            gateway_proc = None
        else:
            url, gateway_proc, command = start_gateway(
                spawner, target, engine, FAST_SLOTS, **_litellm(options)
            )
            roles = {"gateway": [gateway_proc.pid], "engine": [engine_proc.pid]}
        print(f"{target}: {command}", flush=True)
        spied = gateway_proc.pid if target == "sluice" and gateway_proc is not None else None
        if "closed" in options.groups:
            _measure(rows, "closed", target, command, [url], short, roles, options, spied)
        if "stream" in options.groups:
            for load in streams:
                name = f"{target} streamed {load.max_tokens}"
                _measure(rows, "stream", name, command, [url], load, roles, options, spied)
        if gateway_proc is not None:
            spawner.stop(gateway_proc)
    spawner.stop(engine_proc)


def run_flood(spawner: Spawner, options: Options, rows: list[Row], note: Note) -> None:
    """``flood``: many connections in front of a saturated 16-sequence engine."""
    engine, engine_proc = start_engine(spawner, "flood-engine", FLOOD_ENGINE)
    load = Load(options.flood_connections, options.flood_tokens, stream=False)
    for target in options.targets:
        if target == "passthrough":
            continue  # it queues nothing of its own: the engine's row says what it would pass
        if target == "litellm" and options.litellm_python is None:
            continue
        if target == "engine":
            url, command, roles = engine, "the engine directly", {"engine": [engine_proc.pid]}
            gateway_proc = None
        else:
            url, gateway_proc, command = start_gateway(
                spawner, target, engine, FLOOD_SLOTS, **_litellm(options)
            )
            roles = {"gateway": [gateway_proc.pid], "engine": [engine_proc.pid]}
        print(f"flood {target}: {command}", flush=True)
        spied = gateway_proc.pid if target == "sluice" and gateway_proc is not None else None
        _measure(rows, "flood", f"{target} flooded", command, [url], load, roles, options, spied)
        if gateway_proc is not None:
            spawner.stop(gateway_proc)
    # The same gateway with its dispatcher in another process (a worker): the refusals then no
    # longer share an event loop with the jobs that feed the engine.
    if "sluice" in options.targets and have_redis(note, "flood on Redis"):
        with redis_fleet(spawner, engine, 1, FLOOD_SLOTS) as (urls, roles, command):
            print(f"flood: {command}", flush=True)
            roles = {**roles, "engine": [engine_proc.pid]}
            _measure(rows, "flood", "sluice on Redis flooded", command, urls, load, roles, options)
    spawner.stop(engine_proc)


def run_scaling(spawner: Spawner, options: Options, rows: list[Row], note: Note) -> None:
    """``scaling``: 1, 2, ... gateways and as many workers on one Redis."""
    if "sluice" not in options.targets or not have_redis(note, "scaling"):
        return
    engine, engine_proc = start_engine(spawner, "scaling-engine", FAST_ENGINE)
    load = Load(options.connections, options.tokens, stream=False)
    for count in options.gateways:
        with redis_fleet(spawner, engine, count, FAST_SLOTS) as (urls, roles, command):
            print(f"scaling: {command}", flush=True)
            name = f"{count} gateway{'s' if count > 1 else ''} on Redis"
            roles = {**roles, "engine": [engine_proc.pid]}
            _measure(rows, "scaling", name, command, urls, load, roles, options)
    spawner.stop(engine_proc)


def run_clients(spawner: Spawner, options: Options, rows: list[Row], note: Note) -> None:
    """``clients``: the HTTP client to the engine alone, each of :data:`CLIENTS`, in this process."""
    engine, engine_proc = start_engine(spawner, "clients-engine", FAST_ENGINE)
    load = Load(options.connections, options.tokens, stream=False)
    for library in CLIENTS:
        command = f"{load.connections} concurrent POSTs through one {library} client, in this process"
        print(f"clients: {command}", flush=True)
        window = client_requests(
            engine, library, load, options.warmup_s, options.seconds, {"engine": [engine_proc.pid]}
        )
        rows.append(make_row("clients", f"{library} client alone", command, load, window))
    spawner.stop(engine_proc)


def _litellm(options: Options) -> dict[str, Any]:
    return {"litellm_python": options.litellm_python, "out": options.out}


def run(options: Options) -> tuple[list[Row], list[str]]:
    """Run the chosen groups; every row measured, and the notes on what was left out."""
    rows: list[Row] = []
    notes: list[str] = []
    options.out.mkdir(parents=True, exist_ok=True)
    options.litellm_python = litellm_python(options.litellm_python)
    if "litellm" in options.targets and options.litellm_python is None:
        notes.append(
            "LiteLLM's proxy: not importable here (pip install 'litellm[proxy]'), its rows are left out "
            "(--litellm-python PYTHON names one)"
        )
    with tempfile.TemporaryDirectory(prefix="sluice-overhead-") as folder:
        logs = Path(folder)
        spawner = Spawner(logs)
        try:
            if {"closed", "stream"} & set(options.groups):
                run_fast_groups(spawner, options, rows, notes.append)
            if "flood" in options.groups:
                run_flood(spawner, options, rows, notes.append)
            if "scaling" in options.groups:
                run_scaling(spawner, options, rows, notes.append)
            if "clients" in options.groups:
                run_clients(spawner, options, rows, notes.append)
        except RuntimeError:
            for log in sorted(logs.iterdir()):
                tail = log.read_text(errors="replace")[-2000:]
                print(f"--- {log.name} (last lines)\n{tail}", file=sys.stderr)
            raise
        finally:
            spawner.stop_all()
    return rows, notes


# -- command line --------------------------------------------------------------------------------------


def _names(text: str, known: Sequence[str]) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in known]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown: {', '.join(unknown)}; known: {', '.join(known)}")
    return names


def parse_args(argv: Sequence[str] | None = None) -> Options:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.bench.overhead",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--seconds", type=float, default=10.0, help="measured window of each row (10)")
    parser.add_argument("--warmup", type=float, default=2.0, help="load before each window (2)")
    parser.add_argument("--connections", type=int, default=32, help="closed-loop connections (32)")
    parser.add_argument("--tokens", type=int, default=8, help="tokens of a short answer (8)")
    parser.add_argument(
        "--stream-tokens", type=int, default=64, help="tokens of the long streamed answer (64)"
    )
    parser.add_argument("--flood-connections", type=int, default=64, help="connections of the flood (64)")
    parser.add_argument("--flood-tokens", type=int, default=8, help="tokens of a flood answer (8)")
    parser.add_argument(
        "--gateways",
        type=lambda t: tuple(int(x) for x in t.split(",")),
        default=(1, 2),
        help="gateway counts of the scaling rows (1,2)",
    )
    parser.add_argument(
        "--groups",
        type=lambda t: _names(t, GROUPS),
        default=GROUPS,
        help=f"which groups ({','.join(GROUPS)})",
    )
    parser.add_argument(
        "--targets",
        type=lambda t: _names(t, TARGETS),
        default=TARGETS,
        help=f"which targets ({','.join(TARGETS)})",
    )
    parser.add_argument(
        "--litellm-python", help="a Python with litellm installed (default: this one, if it has it)"
    )
    parser.add_argument("--out", type=Path, default=Path(".bench-out"), help="output folder (.bench-out)")
    parser.add_argument("--label", default="overhead", help="name of the output files (overhead)")
    parser.add_argument("--plot", action="store_true", help="write LABEL.png too (needs matplotlib)")
    parser.add_argument(
        "--py-spy",
        type=Path,
        metavar="DIR",
        help="record the Sluice gateway's rows with py-spy in DIR/ROW.txt",
    )
    parser.add_argument(
        "--syscalls",
        type=Path,
        metavar="DIR",
        help="count the Sluice gateway's socket system calls in each of its rows with perf "
        "(DIR/ROW.txt), and print them per response",
    )
    args = parser.parse_args(argv)
    return Options(
        seconds=args.seconds,
        warmup_s=args.warmup,
        connections=args.connections,
        tokens=args.tokens,
        stream_tokens=args.stream_tokens,
        flood_connections=args.flood_connections,
        flood_tokens=args.flood_tokens,
        gateways=args.gateways,
        groups=args.groups,
        targets=args.targets,
        litellm_python=args.litellm_python,
        out=args.out,
        label=args.label,
        plot=args.plot,
        py_spy=args.py_spy,
        syscalls=args.syscalls,
    )


def main(argv: Sequence[str] | None = None) -> int:
    options = parse_args(argv)
    print(f"load average before: {' '.join(f'{x:.2f}' for x in os.getloadavg())}, {os.cpu_count()} CPUs")
    rows, notes = run(options)
    text = table(rows)
    print("\n" + text)
    for line in notes:
        print(line)
    result = {
        "options": {k: str(v) if isinstance(v, Path) else v for k, v in asdict(options).items()},
        "cpus": os.cpu_count(),
        "rows": [r.as_dict() for r in rows],
        "per_token_us": per_token_us(rows),
        "refusal_ms": refusal_ms(rows),
        "scaling_curve": scaling_curve(rows),
        "notes": notes,
    }
    path = options.out / f"{options.label}.json"
    path.write_text(json.dumps(result, indent=2))
    print(f"wrote {path}")
    if options.plot:
        png = options.out / f"{options.label}.png"
        try:
            plot(rows, png)
            print(f"wrote {png}")
        except ImportError as exc:
            print(exc)
    if options.py_spy is not None and options.py_spy.exists():
        for record in sorted(options.py_spy.glob("*.txt")):
            print_profile(record)
    return 0


if __name__ == "__main__":
    sys.exit(main())
