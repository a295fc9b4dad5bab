"""The `sluice` command: one subcommand per role, each defined by the module that implements it.

Each subcommand module exposes ``configure_parser(parser)`` and ``run(args) -> int``; modules are
imported lazily so that ``sluice --help`` stays fast and one role's dependencies never load for another.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from collections.abc import Sequence

from sluice import __version__

# name -> (module, one-line help); the module has configure_parser(parser) and run(args)
SUBCOMMANDS: dict[str, tuple[str, str]] = {
    "serve": ("sluice.roles.serve", "run the whole system in one process: gateway, broker and dispatcher"),
    "gateway": ("sluice.roles.gateway", "run a gateway only, on a Redis broker (scale-out)"),
    "worker": ("sluice.roles.worker", "run a worker only, on a Redis broker (scale-out)"),
    "sim": ("sluice.sim.server", "run an engine simulator with the OpenAI API (continuous batching model)"),
    "bench": ("sluice.bench.cli", "open-loop load experiment against an engine or a Sluice gateway"),
    "engine": ("sluice.local_engine.server", "build, start or inspect the local llama-server engine"),
    "keys": ("sluice.apikeys", "make API keys (only their hashes go in the config)"),
    "kafka": ("sluice.kafka.cli", "requests from a Kafka topic, answers to another (needs the kafka extra)"),
}


def build_parser(only: str | None = None) -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="sluice",
        description="Sluice: a queue-scheduling gateway for LLM inference.",
    )
    parser.add_argument("--version", action="version", version=f"sluice {__version__}")
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        p = sub.add_parser(name, help=help_text, description=help_text)
        if only is None or only == name:
            try:
                module = importlib.import_module(module_name)
            except ModuleNotFoundError as exc:
                if exc.name != module_name:
                    raise
                continue
            module.configure_parser(p)
            p.set_defaults(_run=module.run)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    args_list = list(sys.argv[1:] if argv is None else argv)
    first = next((a for a in args_list if not a.startswith("-")), None)
    parser = build_parser(first if first in SUBCOMMANDS else None)
    args = parser.parse_args(args_list)
    run = getattr(args, "_run", None)
    if run is None:
        parser.print_help()
        return 2
    return int(run(args) or 0)


if __name__ == "__main__":
    sys.exit(main())
