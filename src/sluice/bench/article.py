"""The article's experiment on the simulator, end to end: the engine's measured capacity, then the
engine alone and Sluice in front of it, under a steady 10 req/s and under a 3 → 30 → 3 req/s
spike. Every run starts its own simulator (and gateway) and stops it afterwards, on free ports
unless --sim-port and --sluice-port choose them.

    python -m sluice.bench.article          # about 10 minutes; tables on stdout, files in .bench-out/article

Everything runs on this machine's cores, so run it on a quiet machine: the load average at the
start and end of each run is recorded in its result (a busy CPU slows the simulated engine).
The comparison plots are copied to docs/img/ for docs/benchmarks.md.
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
from collections.abc import Sequence
from pathlib import Path

from sluice.bench.cli import port_number
from sluice.bench.experiment import DOCS_IMG, bench, checkout_root, copy_plot, measured_capacity, sluice

__all__ = ["main"]


def _ports(sim_port: int | None, sluice_port: int | None, args: Sequence[str]) -> list[str]:
    """The port flags of one run: the simulator's if chosen, and the gateway's if chosen and spawned."""
    flags = [] if sim_port is None else ["--sim-port", str(sim_port)]
    if sluice_port is not None and "--spawn-sluice" in args:
        flags += ["--sluice-port", str(sluice_port)]
    return flags


def experiment(out: Path, sim_port: int | None = None, sluice_port: int | None = None) -> None:
    def run(*args: str) -> None:
        bench(out, "--spawn-sim", "article", *_ports(sim_port, sluice_port, args), *args)

    # Capacity: the engine alone, saturated (8 req/s against ~5.5), clients that never give up. The
    # measure is "goodput after the first answer": answers per second while the batch is full.
    run("--rate", "8", "--duration", "40", "--client-timeout", "0", "--label", "capacity")
    cap = str(measured_capacity(out / "capacity.json"))
    print(f"measured capacity: {cap} req/s", flush=True)

    # Steady 10 req/s for 60 s (the defaults), clients give up at 15 s (the default). Sluice runs
    # twice: as the article's clients reach it (anonymous, one caller), and as 50 users with a key each.
    run("--capacity", cap, "--label", "direct-steady")
    run("--spawn-sluice", "--capacity", cap, "--label", "sluice-steady")
    run("--spawn-sluice", "--capacity", cap, "--users", "50", "--label", "sluice-50-users-steady")

    # Spike: 3 req/s, 30 req/s from 20 s to 30 s, 3 req/s until 60 s (--peak/--spike-at/--spike-for
    # defaults).
    spike = ("--capacity", cap, "--profile", "spike", "--rate", "3")
    run(*spike, "--label", "direct-spike")
    run("--spawn-sluice", *spike, "--label", "sluice-spike")
    run("--spawn-sluice", *spike, "--users", "50", "--label", "sluice-50-users-spike")

    for shape in ("steady", "spike"):
        runs = [str(out / f"{who}-{shape}.json") for who in ("direct", "sluice", "sluice-50-users")]
        sluice("bench", "compare", *runs, "--name", shape)
        copy_plot(out / f"{shape}.png", f"article-{shape}.png")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.bench.article",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT", ".bench-out/article")),
        help="output folder, from the checkout's root ($OUT, else .bench-out/article)",
    )
    parser.add_argument(
        "--sim-port", type=port_number, metavar="PORT", help="the simulators' port (default: a free one)"
    )
    parser.add_argument(
        "--sluice-port", type=port_number, metavar="PORT", help="the gateways' port (default: a free one)"
    )
    args = parser.parse_args(argv)
    os.chdir(checkout_root())
    args.out.mkdir(parents=True, exist_ok=True)
    DOCS_IMG.mkdir(parents=True, exist_ok=True)
    try:
        experiment(args.out, args.sim_port, args.sluice_port)
    except subprocess.CalledProcessError as exc:
        return exc.returncode or 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
