"""``sluice serve``: gateway, embedded broker and dispatcher in one process."""

from __future__ import annotations

import argparse
import contextlib
import gc
import logging
import sys
from collections.abc import AsyncIterator
from typing import Any

import uvicorn

from sluice import aio
from sluice.api.app import create_app
from sluice.api.auth import is_loopback
from sluice.backends.base import Backend
from sluice.backends.openai import OpenAIBackend
from sluice.config import BackendConfig, ConfigError, Settings, load_settings
from sluice.logs import setup_logging

log = logging.getLogger("sluice.serve")

# flag -> (settings field, type, help)
FLAGS: dict[str, tuple[str, Any, str]] = {
    "--host": ("host", str, "address to listen on (default 127.0.0.1)"),
    "--port": ("port", int, "port to listen on (default 8000)"),
    "--broker": ("broker", str, "'memory' (default, embedded) or a redis:// URL (durable)"),
    "--max-concurrency": (
        "max_concurrency",
        int,
        "requests each backend runs at once: the engine's batch size, e.g. vLLM's --max-num-seqs or "
        "llama-server's -np (default 8)",
    ),
    "--default-timeout": (
        "default_timeout_s",
        float,
        "deadline in seconds of a request that sets none (120)",
    ),
    "--max-timeout": ("max_timeout_s", float, "the longest deadline a request may ask for, in seconds (600)"),
    "--queue-policy": (
        "queue_policy",
        str,
        "cap, fifo, deadline or codel (default; see docs/configuration.md, Queue policy)",
    ),
    "--queue-target": ("queue_target_s", float, "codel: queueing delay a standing queue is held to (0.5 s)"),
    "--queue-interval": (
        "queue_interval_s",
        float,
        "codel: how long a steeply rising queue may grow before it counts as standing (2.5 s)",
    ),
    "--queue-early": (
        "queue_early_s",
        float,
        "codel: how soon a slowly rising queue counts as standing (0.5 s)",
    ),
    "--queue-burst-rise": (
        "queue_burst_rise",
        float,
        "codel: seconds of delay per second of rise that mark a burst (2)",
    ),
    "--queue-half-life": (
        "queue_half_life_s",
        float,
        "codel: half-life of the delay limit after a burst (30 s)",
    ),
    "--fifo-max-queued": ("fifo_max_queued", int, "fifo: jobs the buffer holds (50)"),
    "--max-queued-jobs": ("max_queued_jobs", int, "queued jobs per model before 429 queue_full (1000)"),
    "--max-queued-tokens": (
        "max_queued_tokens",
        int,
        "queued tokens per model before 429 queue_full (unbounded)",
    ),
    "--default-max-tokens": ("default_max_tokens", int, "max_tokens of a request that sets none (512)"),
    "--max-tokens-cap": (
        "max_tokens_cap",
        int,
        "the most max_tokens a request may ask for; more is a 400 (4096)",
    ),
    "--max-body-bytes": ("max_body_bytes", int, "request bodies above this size get 413 (4 MiB)"),
    "--max-attempts": ("max_attempts", int, "attempts on backends before a job fails (3)"),
    "--result-ttl": ("result_ttl_s", float, "seconds finished jobs, their results and events are kept (600)"),
    "--log-level": ("log_level", str, "debug, info, warning or error (info)"),
    "--log-format": ("log_format", str, "json (one object per line, default) or text"),
}


def configure_parser(parser: argparse.ArgumentParser) -> None:
    parser.description = (
        "Run the whole system in one process: the gateway (OpenAI-compatible API and async jobs), "
        "the broker (embedded by default) and a dispatcher feeding the backends. With no backend "
        "configured, a local llama-server with a small model is built (once) and started. "
        "Settings come from defaults, then --config, then SLUICE_* environment variables, then flags."
    )
    parser.add_argument(
        "--config", metavar="FILE", help="TOML file with any setting (see docs/configuration.md)"
    )
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
    parser.add_argument(
        "--insecure-open",
        action="store_true",
        default=None,
        help="serve without API keys on a non-loopback address (anyone who can reach it can use it)",
    )
    for flag, (_, kind, help_text) in FLAGS.items():
        parser.add_argument(flag, type=kind, help=help_text, metavar=flag.lstrip("-").split("-")[-1].upper())


def settings_from_args(args: argparse.Namespace) -> Settings:
    overrides: dict[str, Any] = {
        field: getattr(args, flag[2:].replace("-", "_")) for flag, (field, _, _) in FLAGS.items()
    }
    overrides["insecure_open"] = args.insecure_open
    if args.backend:
        overrides["backends"] = [
            BackendConfig(url=url, max_inflight_tokens=args.max_inflight_tokens).model_dump()
            for url in args.backend
        ]
    return load_settings(args.config, overrides=overrides)


def check_exposure(settings: Settings) -> None:
    """Open mode (no keys) is for local use: refuse it on a reachable address unless forced."""
    if settings.keys or settings.key_store or is_loopback(settings.host):
        return
    if not settings.insecure_open:
        raise ConfigError(
            f"no API keys are configured, so Sluice would serve anyone who can reach {settings.host}; "
            "add [[keys]] to the config (see `sluice keys new`), bind to 127.0.0.1, or pass --insecure-open"
        )
    log.warning("serving WITHOUT API KEYS on %s: anyone who can reach it can use it", settings.host)


def build_backends(settings: Settings) -> list[Backend]:
    return [
        OpenAIBackend(
            b.url,
            name=b.name,
            max_concurrency=b.max_concurrency or settings.max_concurrency,
            max_inflight_tokens=b.max_inflight_tokens,
            models=b.models,
            api_key=b.api_key,
        )
        for b in settings.backends
    ]


@contextlib.asynccontextmanager
async def local_engine(settings: Settings) -> AsyncIterator[Settings]:
    """With no backend configured, provision and supervise the local llama-server."""
    if settings.backends:
        yield settings
        return
    from sluice.local_engine.server import LocalEngine

    async with LocalEngine() as engine:
        log.info("local engine ready", extra={"fields": {"url": engine.url, "slots": engine.slots}})
        yield with_local_engine(settings, engine.url, engine.model, engine.slots)


# codel's burst_rise in front of the local engine, unless configured. llama-server on a CPU slows each
# sequence down ~2.7x as its batch fills, so the drain rate learnt at light load is optimistic and a
# burst from light load seems to rise half as steeply as it does (docs/configuration.md, Queue policy).
LOCAL_ENGINE_BURST_RISE = 1.0


def with_local_engine(settings: Settings, url: str, model: str, slots: int) -> Settings:
    """The settings with the local engine as their one backend, and queue defaults that suit it."""
    backend = BackendConfig(url=url, name="local", models=[model], max_concurrency=slots)
    update: dict[str, Any] = {"backends": [backend]}
    if "queue_burst_rise" not in settings.model_fields_set:
        update["queue_burst_rise"] = LOCAL_ENGINE_BURST_RISE
    return settings.model_copy(update=update)


async def serve(settings: Settings) -> None:
    async with local_engine(settings) as effective:
        app = create_app(effective, backends=lambda: build_backends(effective))
        config = uvicorn.Config(
            app,
            host=effective.host,
            port=effective.port,
            log_level="warning",
            access_log=False,
            lifespan="on",
        )
        server = uvicorn.Server(config)
        quiet_gc()
        log.info(
            "sluice serving",
            extra={
                "fields": {"url": f"http://{effective.host}:{effective.port}", "broker": effective.broker}
            },
        )
        await server.serve()


def quiet_gc() -> None:
    """Keep collector pauses off the admission path.

    Everything allocated at start-up lives for the whole run: freezing it keeps full collections
    from walking it again and again while requests wait.
    """
    gc.collect()
    gc.freeze()


def run(args: argparse.Namespace) -> int:
    try:
        settings = settings_from_args(args)
        setup_logging(settings.log_level, settings.log_format)
        check_exposure(settings)
    except ConfigError as exc:
        print(f"sluice: {exc}", file=sys.stderr)
        return 2
    with contextlib.suppress(KeyboardInterrupt):
        aio.run(serve(settings))
    return 0
