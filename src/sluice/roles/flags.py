"""The command-line flags of the roles, in groups, and the settings they make.

Each role takes only the groups it uses, so its ``--help`` lists only flags that change something.
Every flag overrides one setting; settings come from defaults, then ``--config``, then ``SLUICE_*``
environment variables, then flags.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from sluice.config import BackendConfig, ConfigError, Settings, load_settings


@dataclass(frozen=True)
class Flag:
    """One flag that sets one setting.

    Attributes:
        name: the flag, e.g. ``--port``.
        field: the setting it overrides.
        kind: the type its value is parsed as.
        help: what it does; the help adds the setting's default, read from :class:`Settings`.
    """

    name: str
    field: str
    kind: type
    help: str
    #: what the default means when it is None
    unset: str = "none"

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")


#: what every role reads: where the queue is, how it logs, how long results stay
COMMON = (
    Flag("--broker", "broker", str, "'memory' (embedded) or a redis:// URL (durable)"),
    Flag(
        "--result-ttl",
        "result_ttl_s",
        float,
        "seconds finished jobs, their results and events are kept",
    ),
    Flag("--log-level", "log_level", str, "debug, info, warning or error"),
    Flag("--log-format", "log_format", str, "json (one object per line) or text"),
)

#: what a process that serves HTTP reads
HTTP = (
    Flag("--host", "host", str, "address to listen on"),
    Flag("--port", "port", int, "port to listen on"),
    Flag("--max-body-bytes", "max_body_bytes", int, "request bodies above this many bytes get 413"),
)

#: what admission reads: deadlines, request caps, queue bounds and the queue policy
ADMISSION = (
    Flag(
        "--default-timeout",
        "default_timeout_s",
        float,
        "deadline in seconds of a request that sets none",
    ),
    Flag(
        "--max-timeout",
        "max_timeout_s",
        float,
        "the longest deadline a request may ask for, in seconds",
    ),
    Flag(
        "--queue-policy",
        "queue_policy",
        str,
        "cap, fifo, deadline or codel (see docs/configuration.md, Queue policy)",
    ),
    Flag(
        "--queue-target",
        "queue_target_s",
        float,
        "codel: queueing delay a standing queue is held to, in seconds",
    ),
    Flag(
        "--queue-interval",
        "queue_interval_s",
        float,
        "codel: seconds a steeply rising queue may grow before it counts as standing",
    ),
    Flag(
        "--queue-early",
        "queue_early_s",
        float,
        "codel: seconds after which a slowly rising queue counts as standing",
    ),
    Flag(
        "--queue-burst-rise",
        "queue_burst_rise",
        float,
        "codel: seconds of delay per second of rise that mark a burst",
    ),
    Flag(
        "--queue-half-life",
        "queue_half_life_s",
        float,
        "codel: half-life of the delay limit after a burst, in seconds",
    ),
    Flag("--fifo-max-queued", "fifo_max_queued", int, "fifo: jobs the buffer holds"),
    Flag("--max-queued-jobs", "max_queued_jobs", int, "queued jobs per model before 429 queue_full"),
    Flag(
        "--max-queued-tokens",
        "max_queued_tokens",
        int,
        "queued tokens per model before 429 queue_full",
        unset="unbounded",
    ),
    Flag("--default-max-tokens", "default_max_tokens", int, "max_tokens of a request that sets none"),
    Flag(
        "--max-tokens-cap",
        "max_tokens_cap",
        int,
        "the most max_tokens a request may ask for; more is a 400",
    ),
    Flag("--max-attempts", "max_attempts", int, "attempts on backends before a job fails"),
)

#: what a dispatcher reads: the engines and how much each takes at once
DISPATCH = (
    Flag(
        "--max-concurrency",
        "max_concurrency",
        int,
        "requests each backend runs at once: the engine's batch size, e.g. vLLM's --max-num-seqs or "
        "llama-server's -np",
    ),
)


#: the local engine that ``sluice serve`` runs when no backend is given
LOCAL_ENGINE = (
    Flag("--engine-port", "engine_port", int, "port of the local llama-server", unset="a free one"),
    Flag("--engine-slots", "engine_slots", int, "sequences the local llama-server runs at once"),
    Flag(
        "--engine-ctx",
        "engine_ctx_per_slot",
        int,
        "context of each of the local llama-server's sequences, in tokens: prompt + answer",
    ),
)


def add_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", metavar="FILE", help="TOML file with any setting (see docs/configuration.md)"
    )


def default_text(flag: Flag) -> str:
    """The setting's default, as the help shows it."""
    default = Settings.model_fields[flag.field].default
    return flag.unset if default is None else str(default)


def add_flags(parser: argparse.ArgumentParser, *groups: tuple[Flag, ...]) -> None:
    for group in groups:
        for flag in group:
            parser.add_argument(
                flag.name,
                type=flag.kind,
                help=f"{flag.help} (default: {default_text(flag)})",
                metavar=flag.name.lstrip("-").split("-")[-1].upper(),
            )


def add_insecure_open(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--insecure-open",
        action="store_true",
        default=None,
        help="serve without API keys on a non-loopback address (anyone who can reach it can use it)",
    )


def add_backends(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--backend",
        action="append",
        metavar="URL",
        help="an OpenAI-compatible engine, e.g. http://127.0.0.1:8001 (repeatable); it serves the models "
        "its /v1/models lists",
    )
    parser.add_argument(
        "--max-inflight-tokens",
        type=int,
        metavar="N",
        help="optional budget of in-flight tokens (prompt + max_tokens) per --backend, e.g. its KV cache",
    )


ALL_GROUPS = (COMMON, HTTP, ADMISSION, DISPATCH, LOCAL_ENGINE)


def settings_from_args(args: argparse.Namespace) -> Settings:
    """The settings, with the flags this role's parser has overriding the rest."""
    overrides: dict[str, Any] = {}
    for group in ALL_GROUPS:
        for flag in group:
            if hasattr(args, flag.dest):
                overrides[flag.field] = getattr(args, flag.dest)
    if hasattr(args, "insecure_open"):
        overrides["insecure_open"] = args.insecure_open
    if getattr(args, "backend", None):
        overrides["backends"] = [
            BackendConfig(url=url, max_inflight_tokens=args.max_inflight_tokens).model_dump()
            for url in args.backend
        ]
    return load_settings(args.config, overrides=overrides)


REDIS_SCHEMES = ("redis://", "rediss://", "unix://")


def shared_settings(args: argparse.Namespace, role: str) -> Settings:
    """The settings of a scaled-out role (gateway, worker), which must name a Redis broker."""
    settings = settings_from_args(args)
    if not settings.broker.startswith(REDIS_SCHEMES):
        raise ConfigError(f"needs --broker redis://HOST:PORT (the {role}s share a Redis broker)")
    return settings
