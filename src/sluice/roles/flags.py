"""The command-line flags of the roles, in groups, and the settings they make.

Each role takes only the groups it uses, so its ``--help`` lists only flags that change something.
Every flag overrides one setting; settings come from defaults, then ``--config``, then ``SLUICE_*``
environment variables, then flags.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass
from typing import Any

from sluice.broker.redis_topology import SCHEMES
from sluice.config import ConfigError, Settings, load_settings
from sluice.config_tables import BackendConfig


@dataclass(frozen=True)
class Flag:
    """One flag that sets one setting.

    Attributes:
        name: the flag, e.g. ``--port``.
        field: the setting it overrides.
        kind: the type its value is parsed as.
    """

    name: str
    field: str
    kind: type

    @property
    def help(self) -> str:
        """The setting's description (one source for the flag's help and the docs), and its default."""
        field = Settings.model_fields[self.field]
        text = (field.description or "").replace("`", "").replace("%", "%%")
        return text if field.default is None else f"{text} (default: {field.default})"

    @property
    def dest(self) -> str:
        return self.name[2:].replace("-", "_")


#: what every role reads: where the queue is, how it logs, how long results stay
COMMON = (
    Flag("--broker", "broker", str),
    Flag("--redis-min-replicas", "redis_min_replicas", int),
    Flag("--redis-wait-timeout", "redis_wait_timeout_ms", int),
    Flag("--result-ttl", "result_ttl_s", float),
    Flag("--log-level", "log_level", str),
    Flag("--log-format", "log_format", str),
    Flag("--drain-grace", "drain_grace_s", float),
)

#: what a process that serves HTTP reads
HTTP = (
    Flag("--host", "host", str),
    Flag("--port", "port", int),
    Flag("--max-body-bytes", "max_body_bytes", int),
    Flag("--drain-accept", "drain_accept_s", float),
)

#: what admission reads: deadlines, request caps, queue bounds and the queue policy
ADMISSION = (
    Flag("--default-timeout", "default_timeout_s", float),
    Flag("--max-timeout", "max_timeout_s", float),
    Flag("--queue-policy", "queue_policy", str),
    Flag("--queue-target", "queue_target_s", float),
    Flag("--queue-interval", "queue_interval_s", float),
    Flag("--queue-early", "queue_early_s", float),
    Flag("--queue-burst-rise", "queue_burst_rise", float),
    Flag("--queue-half-life", "queue_half_life_s", float),
    Flag("--fifo-max-queued", "fifo_max_queued", int),
    Flag("--max-queued-jobs", "max_queued_jobs", int),
    Flag("--max-queued-tokens", "max_queued_tokens", int),
    Flag("--default-max-tokens", "default_max_tokens", int),
    Flag("--max-tokens-cap", "max_tokens_cap", int),
    Flag("--max-attempts", "max_attempts", int),
)

#: what a dispatcher reads: the engines, how much each takes at once, how one is picked
DISPATCH = (
    Flag("--max-concurrency", "max_concurrency", int),
    Flag("--routing", "routing", str),
    Flag("--prefix-load-factor", "prefix_load_factor", float),
    Flag("--prefix-remember", "prefix_remember", int),
    Flag("--dns-refresh", "dns_refresh_s", float),
    Flag("--unreached-grace", "unreached_grace_s", float),
)


#: the local engine that ``sluice serve`` runs when no backend is given
LOCAL_ENGINE = (
    Flag("--engine-port", "engine_port", int),
    Flag("--engine-slots", "engine_slots", int),
    Flag("--engine-ctx", "engine_ctx_per_slot", int),
)


def add_config(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--config", metavar="FILE", help="TOML file with any setting (see docs/configuration.md)"
    )


def add_flags(parser: argparse.ArgumentParser, *groups: tuple[Flag, ...]) -> None:
    for group in groups:
        for flag in group:
            parser.add_argument(
                flag.name,
                type=flag.kind,
                help=flag.help,
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


#: the broker URLs of a shared Redis: one Redis, Sentinel, Cluster (docs/redis.md)
REDIS_SCHEMES = SCHEMES


def shared_settings(args: argparse.Namespace, role: str) -> Settings:
    """The settings of a scaled-out role (gateway, worker), which must name a Redis broker."""
    settings = settings_from_args(args)
    if not settings.broker.startswith(REDIS_SCHEMES):
        raise ConfigError(f"needs --broker redis://HOST:PORT (the {role}s share a Redis broker)")
    return settings
