"""The cyclic garbage collector's share of the gateway's CPU in the closed loop (by default the
``closed`` row of :mod:`sluice.bench.overhead`: 32 connections of short non-streaming requests in
front of the fast engine; ``--tokens 64 --stream`` gives its saturated streamed-64 row), for one
or more thresholds of its youngest generation.

The gateway runs as ``sluice serve`` does, in its own process, with a ``gc.callbacks`` hook that
times each pass of the collector in the CPU time of the thread that runs it (the event loop's)
and counts the passes and what they freed, per generation; a thread of its own writes the
figures to a file every 50 ms. ``--thresholds`` sets the youngest generation's threshold that
the gateway's start-up sets (:data:`sluice.roles.http.YOUNG_GC_THRESHOLD`, 10,000; Python's own
is 700). The share is the collector's CPU over the gateway's between the load's start (warm-up
included) and its end; answers/s and CPU per answer are the measured window's, as in
:mod:`sluice.bench.overhead`. Runs alternate the thresholds ``--rounds`` times, each on a new
gateway, since a shared machine moves the absolute figures between runs more than the shares.

Why it is here: at saturation the young generation's passes find the 32 requests in flight
alive, promote their objects, and those promotions set off full passes over the whole heap; one
request at a time leaves few objects alive at a pass. So the collector's cost per request grows
with the load, which :mod:`sluice.bench.overhead_calls` (one request at a time, calls only) does
not see. A streamed answer adds its token events to what is alive at a pass, which the short row
does not show (the memory broker has kept them as bytes since aaa8ed4 for that reason).

Usage: python -m sluice.bench.overhead_gc [--thresholds 700,10000] [--rounds 2] [--seconds 8]
    [--tokens 8] [--stream]
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from sluice.bench.overhead import FAST_ENGINE, FAST_SLOTS
from sluice.bench.overhead_load import Load, closed_loop, cpu_seconds
from sluice.bench.overhead_procs import Spawner, _url, start_engine, wait_answer, wait_ready
from sluice.bench.spawn import free_port

#: Run in the gateway's process: the threshold, the hook, the writer thread, then the CLI.
COLLECTED = """
import gc, json, os, sys, threading, time
path = os.environ["SLUICE_GC_FILE"]
threshold = os.environ.get("SLUICE_GC_THRESHOLD")
if threshold:  # quiet_gc sets it after freezing the start-up's objects
    import sluice.roles.http
    sluice.roles.http.YOUNG_GC_THRESHOLD = int(threshold)
figures = {"passes": [0, 0, 0], "seconds": [0.0, 0.0, 0.0], "collected": [0, 0, 0]}
began = [0.0]
def timed(phase, info):
    if phase == "start":
        began[0] = time.thread_time()
        return
    g = info["generation"]
    figures["passes"][g] += 1
    figures["seconds"][g] += time.thread_time() - began[0]
    figures["collected"][g] += info["collected"]
gc.callbacks.append(timed)
def write():
    tmp = path + ".tmp"
    while True:
        with open(tmp, "w") as f:
            json.dump(figures, f)
        os.replace(tmp, path)
        time.sleep(0.05)
threading.Thread(target=write, daemon=True).start()
from sluice.cli import main
sys.argv = ["sluice", *sys.argv[1:]]
sys.exit(main())
"""


@dataclass(frozen=True)
class GcRun:
    """One run's figures.

    Attributes:
        threshold: the youngest generation's threshold in the gateway.
        answers_per_s: the window's answers a second.
        cpu_ms: the gateway's CPU per answer in the window.
        share: the collector's CPU over the gateway's, warm-up and window together.
        passes: passes per generation, warm-up and window together.
        pause_ms: the mean pass's CPU per generation (0 without passes).
    """

    threshold: int
    answers_per_s: float
    cpu_ms: float
    share: float
    passes: tuple[int, int, int]
    pause_ms: tuple[float, float, float]


def collector_figures(
    before: Mapping[str, Sequence[float]], after: Mapping[str, Sequence[float]], cpu_s: float
) -> tuple[float, tuple[int, int, int], tuple[float, float, float]]:
    """From the hook's figures at the two ends and the gateway's CPU seconds between them: the
    collector's share of that CPU, its passes per generation, and its mean pass in ms."""
    passes = [int(after["passes"][g] - before["passes"][g]) for g in range(3)]
    seconds = [after["seconds"][g] - before["seconds"][g] for g in range(3)]
    pause = [seconds[g] / passes[g] * 1000 if passes[g] else 0.0 for g in range(3)]
    share = sum(seconds) / cpu_s if cpu_s > 0 else 0.0
    return share, (passes[0], passes[1], passes[2]), (pause[0], pause[1], pause[2])


def _read(path: Path) -> dict[str, Any]:
    figures: dict[str, Any] = json.loads(path.read_text())  # written by the gateway this bench started
    return figures


def one_run(
    spawner: Spawner, out: Path, engine: str, threshold: int, load: Load, warmup_s: float, seconds: float
) -> GcRun:
    """One gateway at ``threshold`` under the closed loop; its figures file goes to ``out``."""
    file = out / f"gc-{threshold}.json"
    port = free_port()
    argv = [sys.executable, "-c", COLLECTED, "serve", "--backend", engine, "--port", str(port)]
    argv += ["--max-concurrency", str(FAST_SLOTS), "--log-level", "warning"]
    env = {"SLUICE_GC_FILE": str(file), "SLUICE_GC_THRESHOLD": str(threshold)}
    proc = spawner.start(f"gateway-{threshold}", argv, env)
    try:
        url = _url(port)
        wait_ready(url + "/readyz", proc, timeout_s=120)
        wait_answer(url)
        gc_before, cpu_before = _read(file), cpu_seconds([proc.pid]) or 0.0
        window = closed_loop([url], load, warmup_s, seconds, {"gateway": [proc.pid]})
        gc_after, cpu_after = _read(file), cpu_seconds([proc.pid]) or 0.0
    finally:
        spawner.stop(proc)
    share, passes, pause = collector_figures(gc_before, gc_after, cpu_after - cpu_before)
    answered = len(window.tally.answered)
    answers = answered / window.seconds if window.seconds > 0 else 0.0
    start, end = window.cpu_before.get("gateway"), window.cpu_after.get("gateway")
    known = start is not None and end is not None and answered > 0
    cpu_ms = (end - start) / answered * 1000 if known else 0.0  # type: ignore[operator]
    return GcRun(threshold, answers, cpu_ms, share, passes, pause)


def main(thresholds: Sequence[int], rounds: int, seconds: float, warmup_s: float, load: Load) -> None:
    runs: list[GcRun] = []
    with tempfile.TemporaryDirectory(prefix="sluice-gc-") as tmp:
        out = Path(tmp)
        spawner = Spawner(out)
        try:
            engine, _ = start_engine(spawner, "engine", FAST_ENGINE)
            for _ in range(rounds):
                for threshold in thresholds:
                    runs.append(one_run(spawner, out, engine, threshold, load, warmup_s, seconds))
                    print(_row(runs[-1]), flush=True)
        finally:
            spawner.stop_all()


HEADER = (
    "| threshold | answers/s | gateway CPU ms/answer | collector's share | passes gen 0/1/2 "
    "| mean pass ms |\n|---|---|---|---|---|---|"
)


def _row(run: GcRun) -> str:
    passes = "/".join(str(n) for n in run.passes)
    pauses = "/".join(f"{ms:.2f}" for ms in run.pause_ms)
    return (
        f"| {run.threshold:,} | {run.answers_per_s:,.0f} | {run.cpu_ms:.2f} | {run.share:.1%} "
        f"| {passes} | {pauses} |"
    )


def parse(argv: Sequence[str] | None = None) -> argparse.Namespace:
    """The command line's options (``argv`` None: the process's own)."""
    parser = argparse.ArgumentParser(
        prog="python -m sluice.bench.overhead_gc",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("--thresholds", default="700,10000", help="first thresholds, comma-separated")
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--seconds", type=float, default=8.0)
    parser.add_argument("--warmup", type=float, default=1.0)
    parser.add_argument("--connections", type=int, default=32)
    parser.add_argument("--tokens", type=int, default=8, help="each answer's length in tokens")
    parser.add_argument("--stream", action="store_true", help="stream the answers (SSE)")
    return parser.parse_args(argv)


def load_of(options: argparse.Namespace) -> Load:
    """What each connection sends, from the options: the short whole answer unless told."""
    return Load(options.connections, options.tokens, stream=options.stream)


if __name__ == "__main__":
    options = parse()
    print(HEADER)
    thresholds = [int(t) for t in options.thresholds.split(",")]
    main(thresholds, options.rounds, options.seconds, options.warmup, load_of(options))
