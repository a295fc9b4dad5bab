"""The article's experiment on a real tiny LLM: llama-server (4 slots) with SmolLM2-135M on the CPU,
alone and behind Sluice with each queue policy (cap, fifo, deadline, codel), under a steady
overload and a spike. Same clients as ``python -m sluice.bench.article``: open loop, Poisson
arrivals, give up after 15 s; 10 % of them retry once after a refusal's Retry-After. About 30
minutes; needs ``sluice engine build`` first. The engine and the gateways listen on free ports
unless --engine-port and --sluice-port choose them.

    python -m sluice.bench.llm              # tables on stdout, files in .bench-out/llm

llama-server does not count tokens spent on abandoned requests, so wasted work is measured from
the client side with --stream (tokens streamed to clients that then gave up).
"""

from __future__ import annotations

import argparse
import contextlib
import os
import subprocess
import sys
import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import httpx

from sluice.bench.cli import choose_port, port_number
from sluice.bench.experiment import DOCS_IMG, bench, checkout_root, copy_plot, measured_capacity, sluice
from sluice.bench.spawn import stop_process

__all__ = ["main"]

POLICIES = "direct,cap,fifo,deadline,codel"
# llama-server loads the model before /health answers 200; give up on an engine that takes longer.
ENGINE_START_S = 120.0


@contextlib.contextmanager
def engine(out: Path, port: int | None = None) -> Iterator[str]:
    """``sluice engine start --slots 4`` on ``port`` (a free one if None), its log in ``out``; yields
    its URL, and stops it on the way out whatever happened."""
    port = choose_port(port)
    url = f"http://127.0.0.1:{port}"
    command = [sys.executable, "-m", "sluice.cli", "engine", "start", "--slots", "4", "--port", str(port)]
    with open(out / "engine.log", "wb") as log:
        proc = subprocess.Popen(command, stdout=log, stderr=subprocess.STDOUT)
        try:
            deadline = time.monotonic() + ENGINE_START_S
            while True:
                with contextlib.suppress(httpx.HTTPError):
                    if httpx.get(f"{url}/health", timeout=2.0).status_code == 200:
                        break
                if proc.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the engine did not become healthy (see {out / 'engine.log'})")
                time.sleep(0.2)
            yield url
        finally:
            stop_process(proc, 30)


def experiment(
    out: Path, policies: str, engine_port: int | None = None, sluice_port: int | None = None
) -> None:
    with engine(out, engine_port) as url:

        def run(*args: str) -> None:
            bench(out, "--max-tokens", "64", "--stream", *args)

        # Capacity: the engine saturated, clients that never give up.
        saturated = ["--mode", "direct", "--rate", "6", "--duration", "30", "--client-timeout", "0"]
        run("--target", url, *saturated, "--label", "capacity")
        cap = measured_capacity(out / "capacity.json")
        print(f"measured capacity: {cap} req/s", flush=True)

        def rate(times: float) -> str:
            return str(round(times * cap, 2))

        # Each policy in turn on the same arrivals: the engine alone (direct), then a fresh gateway with
        # --max-concurrency 4 and that --queue-policy in front of the same engine.
        def each_policy(names: str, *args: str) -> None:
            gateways = ["--target", url, "--spawn-sluice", "--slots", "4", "--policies", names]
            if sluice_port is not None:
                gateways += ["--sluice-port", str(sluice_port)]
            clients = ["--capacity", str(cap), "--users", "50", "--retriers", "0.1"]
            run(*gateways, *clients, *args)

        steady = ["--rate", rate(1.8), "--duration", "60"]  # 1.8x, the article's overload
        spike = ["--profile", "spike", "--rate", rate(0.5), "--peak", rate(5)]
        spike += ["--spike-at", "20", "--spike-for", "10", "--duration", "60"]
        each_policy(policies, *steady, "--label", "llm-steady")
        each_policy(policies, *spike, "--label", "llm-spike")
        # Every run of a load in one table and one plot. (codel's burst_rise 1, once the local
        # engine's own setting, is every engine's default now: no arm of its own.)

    names = [p.strip() for p in policies.split(",") if p.strip()]
    for shape in ("steady", "spike"):
        runs = [str(out / f"llm-{shape}-{p}.json") for p in names]
        sluice("bench", "compare", *runs, "--name", f"llm-{shape}")
        copy_plot(out / f"llm-{shape}.png", f"llm-{shape}.png")


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m sluice.bench.llm",
        description=__doc__,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument(
        "--out",
        type=Path,
        default=Path(os.environ.get("OUT", ".bench-out/llm")),
        help="output folder, from the checkout's root ($OUT, else .bench-out/llm)",
    )
    parser.add_argument(
        "--policies",
        default=os.environ.get("POLICIES", POLICIES),
        help=f"the --policies of the runs, comma-separated ($POLICIES, else {POLICIES})",
    )
    parser.add_argument(
        "--engine-port", type=port_number, metavar="PORT", help="llama-server's port (default: a free one)"
    )
    parser.add_argument(
        "--sluice-port", type=port_number, metavar="PORT", help="the gateways' port (default: a free one)"
    )
    args = parser.parse_args(argv)
    os.chdir(checkout_root())
    args.out.mkdir(parents=True, exist_ok=True)
    DOCS_IMG.mkdir(parents=True, exist_ok=True)
    try:
        experiment(args.out, args.policies, args.engine_port, args.sluice_port)
    except subprocess.CalledProcessError as exc:
        return exc.returncode or 1
    except (RuntimeError, ValueError) as exc:
        print(f"python -m sluice.bench.llm: {exc}", file=sys.stderr)
        return 1
    except KeyboardInterrupt:
        return 130
    return 0


if __name__ == "__main__":
    sys.exit(main())
