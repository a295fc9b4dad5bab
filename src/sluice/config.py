"""Settings: defaults, then a TOML file (``--config``), then ``SLUICE_*`` environment variables, then flags.

Every field can be set in the TOML file; scalar fields also by ``SLUICE_<FIELD>`` (for example
``SLUICE_PORT=9000``) and ``SLUICE_BACKENDS`` takes a comma-separated list of engine URLs.
"""

from __future__ import annotations

import dataclasses
import os
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal, cast

from pydantic import Field, StringConstraints, ValidationError, model_validator

from sluice.broker.base import BrokerSettings
from sluice.broker.redis_topology import DEFAULT_WAIT_TIMEOUT_MS
from sluice.config_tables import (
    AliasConfig,
    BackendConfig,
    ClassConfig,
    KeyConfig,
    ModelConfig,
    PoolConfig,
    Strict,
)
from sluice.core import scheduler
from sluice.core.admission import Bounds, QueueLimits
from sluice.core.job import Job
from sluice.core.policy import CoDelPolicy, FifoPolicy, QueuePolicy, make_policy
from sluice.core.request import RequestLimits
from sluice.core.routing import DEFAULT_LOAD_FACTOR, DEFAULT_REMEMBER, Router
from sluice.core.scheduler import ClassSpec
from sluice.local_engine.server import DEFAULT_CTX_PER_SLOT as LOCAL_ENGINE_CTX_PER_SLOT
from sluice.local_engine.server import DEFAULT_SLOTS as LOCAL_ENGINE_SLOTS

#: after SIGTERM, how long running work may take to finish, unless configured (sluice.drain)
DEFAULT_DRAIN_GRACE_S = 30.0
#: after SIGTERM, how long a gateway still takes new requests, unless configured (seconds)
DEFAULT_DRAIN_ACCEPT_S = 0.0


# Every default that feeds the core or the broker is read from their own defaults, never written
# again here: a server configured with nothing runs exactly as they do by default, and the two
# cannot drift apart (tests/test_config.py pins it).

#: a batch's completion window: a number of seconds, minutes or hours (``24h``)
CompletionWindow = Annotated[str, StringConstraints(pattern=r"^[1-9][0-9]{0,6}[smh]$")]

#: the scheduler's default classes, as configuration
DEFAULT_CLASSES = [ClassConfig(name=c.name, min_share=c.min_share) for c in scheduler.DEFAULT_CLASSES]
#: the codel policy's parameters, for the queue_* defaults
_CODEL = CoDelPolicy()
#: the per-model queue bounds, for max_queued_jobs and max_queued_tokens
_QUEUE_LIMITS = QueueLimits()
#: lease_s, result_ttl_s and drain_prior_per_slot
_BROKER = BrokerSettings()
#: a job's attempts on backends (Job's dataclass has slots: its defaults live only in its fields)
_JOB_MAX_ATTEMPTS = cast(int, next(f.default for f in dataclasses.fields(Job) if f.name == "max_attempts"))


class Settings(Strict):
    """Everything Sluice reads (the top level of the TOML file); each field's ``description`` says what
    it is, and docs/configuration.md is generated from them (``python -m sluice.config_doc``)."""

    host: str = Field(
        default="127.0.0.1",
        description="address to listen on; open mode (no keys) only on loopback unless `insecure_open`",
    )
    port: int = Field(default=8000, ge=0, le=65535, description="port to listen on")
    broker: str = Field(
        default="memory",
        description="where the queue lives: `memory` (in the process, lost with it) or Redis: "
        "`redis://HOST:PORT`, `redis+sentinel://HOST:PORT,.../MASTER` or `redis+cluster://HOST:PORT,...` "
        "(docs/redis.md)",
    )
    redis_min_replicas: int | None = Field(
        default=None,
        ge=0,
        description="Redis replicas that must have an admission, a settlement or a cancel (`WAIT`) before "
        "it is answered; when fewer confirm in time the answer is 503 with Retry-After; unset: 1 with "
        "Sentinel or Cluster, 0 with one Redis",
    )
    redis_wait_timeout_ms: int = Field(
        default=DEFAULT_WAIT_TIMEOUT_MS,
        ge=1,
        description="how long a write waits for those replicas (milliseconds)",
    )
    backends: list[BackendConfig] = Field(
        default_factory=list,
        description="the engines (see `[[backends]]`); none: `sluice serve` builds and starts a local "
        "llama-server",
    )
    pools: list[PoolConfig] = Field(
        default_factory=list,
        description="pools of engines, by URL or DNS name, each serving some models (see `[[pools]]` "
        "and docs/fleet-config.md)",
    )
    aliases: list[AliasConfig] = Field(
        default_factory=list,
        description="public model names sent on to engine models by weight (see `[[aliases]]`)",
    )
    drain_grace_s: float = Field(
        default=DEFAULT_DRAIN_GRACE_S,
        ge=0,
        description="after SIGTERM, how long running work may take to finish (seconds): a worker then "
        "hands the rest back to the head of the queue, a gateway cuts the requests still open; a second "
        "SIGTERM cuts it short",
    )
    drain_accept_s: float = Field(
        default=DEFAULT_DRAIN_ACCEPT_S,
        ge=0,
        description="after SIGTERM, how long a gateway still takes new requests while `/readyz` already "
        "answers 503 (seconds); then they are refused with 503 and `Retry-After`",
    )
    dns_refresh_s: float = Field(
        default=5.0,
        gt=0,
        description="how often the `dns://` engines of the pools are resolved again (seconds): new "
        "addresses join, vanished ones are drained and removed",
    )
    routing: Literal["predicted", "least_loaded"] = Field(
        default="predicted",
        description="how an engine is picked among those serving a model: `predicted` (where the job "
        "should finish soonest, from each engine's measured speed and room; the engine a prompt prefix "
        "last went to is predicted without its prefill (its prefix cache), within `prefix_load_factor`'s "
        "bound, and wins a tie; predictions within 25 % of the soonest are a tie, broken by the most "
        "free room) or `least_loaded` (the most free room)",
    )
    prefix_affinity: bool = Field(
        default=True,
        description="requests sharing a prompt prefix (`prompt_cache_key`, `user`, the system prompt "
        "and first message) go to the same engine while its load allows, for its prefix cache",
    )
    prefix_load_factor: float = Field(
        default=DEFAULT_LOAD_FACTOR,
        ge=1,
        description="with `prefix_affinity`: how far over its share of the load (in flight, in "
        "proportion to limit and weight) an engine may run before a prefix homed on it spills to the "
        "next engine on the ring; 1 keeps the load even and moves more prefixes, higher keeps more "
        "prefixes home at the cost of imbalance",
    )
    prefix_remember: int = Field(
        default=DEFAULT_REMEMBER,
        ge=0,
        description="prefixes whose last engine is remembered (LRU), so a conversation that spilled "
        "once returns to the engine that caches it (with `prefix_affinity`) and `predicted` routing "
        "knows where a prefix is cached; 0: none",
    )
    max_concurrency: int = Field(
        default=8,
        ge=1,
        description="sequences a backend runs at once when it does not set its own: the engine's batch "
        "size, e.g. vLLM's `--max-num-seqs` or llama-server's `-np`",
    )
    classes: list[ClassConfig] = Field(
        default_factory=lambda: list(DEFAULT_CLASSES),
        description="the priority classes, highest first (see `[[classes]]`)",
    )
    default_priority: str = Field(default="normal", description="class of a request that names none")
    models: dict[str, ModelConfig] = Field(
        default_factory=dict, description="per-model queue bounds (see `[models.NAME]`)"
    )
    queue_policy: Literal["cap", "fifo", "deadline", "codel"] = Field(
        default="codel",
        description="which jobs a model's queue takes: `cap`, `fifo`, `deadline` or `codel` "
        '(see "Queue policy")',
    )
    queue_target_s: float = Field(
        default=_CODEL.target_s,
        ge=0,
        description="codel: the queueing delay a standing queue is driven down to (seconds)",
    )
    queue_interval_s: float = Field(
        default=_CODEL.interval_s,
        ge=0,
        description="codel: the longest a steeply rising queue may grow before it counts as standing "
        "(seconds)",
    )
    queue_early_s: float = Field(
        default=_CODEL.early_s,
        ge=0,
        description="codel: after this long above the target, a slowly rising queue counts as standing "
        "(seconds)",
    )
    queue_burst_rise: float = Field(
        default=_CODEL.burst_rise,
        ge=0,
        description="codel: seconds of delay gained per second above the target that mark a burst, not "
        'an overload (see "Queue policy")',
    )
    queue_half_life_s: float = Field(
        default=_CODEL.half_life_s,
        gt=0,
        description="codel: half-life of the delay limit a burst's queue keeps, on its way down to the "
        "target (seconds); also how long without refusals before a standing queue is good again",
    )
    fifo_max_queued: int = Field(
        default=FifoPolicy.max_queued, ge=1, description="fifo: jobs the buffer holds"
    )
    max_queued_jobs: int | None = Field(
        default=_QUEUE_LIMITS.model.max_jobs,
        ge=1,
        description="queued jobs per model before `429 queue_full`, for models not listed in `models`",
    )
    max_queued_tokens: int | None = Field(
        default=_QUEUE_LIMITS.model.max_tokens,
        ge=1,
        description="queued cost (prompt + max_tokens) per model before `429 queue_full`, for models not "
        "listed in `models`; unset: unbounded",
    )
    default_timeout_s: float = Field(
        default=120.0,
        gt=0,
        description="deadline of a request that sets none (seconds); follows a lower `max_timeout_s` "
        "unless set",
    )
    max_timeout_s: float = Field(
        default=600.0,
        gt=0,
        description="the longest deadline a request may ask for (seconds); longer ones are capped",
    )
    default_max_tokens: int | None = Field(
        default=None,
        ge=1,
        description="max_tokens of a request that sets none; unset: such a request reaches the engine "
        "without a limit (the engine decides), and is charged what the model's answers have been "
        "measured to need, within its context window",
    )
    max_tokens_cap: int = Field(
        default=4096, ge=1, description="the most max_tokens a request may ask for; more is a 400"
    )
    max_n: int = Field(
        default=4, ge=1, description="the most choices (`n`) a request may ask for; more is a 400"
    )
    max_body_bytes: int = Field(
        default=4 * 1024 * 1024, ge=1024, description="request bodies above this many bytes get 413"
    )
    max_header_bytes: int = Field(
        default=64 * 1024,
        ge=1024,
        description="a request line and headers above this many bytes get 431, and the connection is closed",
    )
    header_timeout_s: float = Field(
        default=10.0,
        gt=0,
        description="the longest a client may take to send a request's line and headers (seconds), from "
        "connecting or from the first byte of its next request; a slower one is closed (with 408 if "
        "anything came)",
    )
    body_timeout_s: float = Field(
        default=60.0,
        gt=0,
        description="the longest a client may take to send a request's body once its headers are in "
        "(seconds); a slower one gets 408 and is closed",
    )
    keep_alive_s: float = Field(
        default=5.0,
        gt=0,
        description="how long an idle connection is kept open for the client's next request (seconds)",
    )
    max_attempts: int = Field(
        default=_JOB_MAX_ATTEMPTS,
        ge=1,
        description="attempts on backends (retries and lost workers included) before a job fails",
    )
    unreached_grace_s: float = Field(
        default=60.0,
        ge=0,
        description="for how long tries that could not connect to an engine that answered before (one "
        "restarting) are not counted among a job's attempts (seconds): a restart that takes this long "
        "fails none of the jobs waiting for it, an engine that stays gone fails them after it (one that "
        "never answered, a wrong address, gets no grace); the job's deadline bounds the wait either way",
    )
    result_ttl_s: float = Field(
        default=_BROKER.result_ttl_s,
        gt=0,
        description="how long finished jobs, their results and events are kept (seconds)",
    )
    lease_s: float = Field(
        default=_BROKER.lease_s,
        gt=0,
        description="how long a claimed job stays with a worker without a heartbeat (seconds); also the "
        "worker registry's expiry, and how long a dead gateway's connection slots stay taken",
    )
    max_poll_wait_s: float = Field(
        default=60.0, gt=0, description="the longest `?wait=` a poll may hold the connection (seconds)"
    )
    drain_prior_per_slot: float = Field(
        default=_BROKER.drain_prior_per_slot,
        gt=0,
        description="the per-slot service rate (tokens/s) assumed before any job has finished",
    )
    keys: list[KeyConfig] = Field(
        default_factory=list,
        description="API keys (see `[[keys]]`); none configured means open mode, allowed only on a "
        "loopback address",
    )
    key_store: bool = Field(
        default=False,
        description="also accept API keys stored in the broker by an administrator (`POST /admin/keys`); "
        "with it the gateway is never in open mode, even with no keys in this file",
    )
    insecure_open: bool = Field(
        default=False, description="serve open mode (no keys) on a non-loopback address anyway"
    )
    metrics_public: bool = Field(
        default=False,
        description="serve `/metrics` to anyone; unset: with keys, only to an admin key (open mode "
        "serves it to all)",
    )
    docs_public: bool = Field(
        default=False,
        description="serve the API docs (`/docs`, `/redoc`, `/openapi.json`) to anyone; unset: with "
        "keys, only to a valid key (open mode serves them to all); admin routes are listed to admin "
        "keys only",
    )
    dashboard_key_sha256: str | None = Field(
        default=None,
        pattern="^[0-9a-f]{64}$",
        description="SHA-256 (hex) of a read-only key for `/dashboard` (`sluice keys hash` prints it); "
        "admin keys open it too; unset: admin keys only (open mode serves it to all)",
    )
    dashboard_session_secret: str | None = Field(
        default=None,
        min_length=16,
        description="signs the dashboard's session cookie; give every gateway behind one address the "
        "same; unset: a random one per process (a cookie then works on the gateway that set it)",
    )
    max_messages: int = Field(
        default=256, ge=1, description="the most messages a chat request may carry; more is a 400"
    )
    max_prompt_tokens: int = Field(
        default=32768,
        ge=1,
        description="the longest prompt (estimated tokens) a request may send; more is a 400",
    )
    max_stream_s: float = Field(
        default=900.0,
        gt=0,
        description="the longest an SSE or WebSocket stream stays open (seconds)",
    )
    max_connections_per_key: int = Field(
        default=64,
        ge=1,
        description="open connections per key (streams, long polls, websockets) when the key sets none",
    )
    webhooks_allow_private: bool = Field(
        default=False,
        description="webhooks may target loopback, private and link-local addresses (for local "
        "development only)",
    )
    log_level: str = Field(default="info", description="`debug`, `info`, `warning` or `error`")
    log_format: str = Field(
        default="json", pattern="^(json|text)$", description="`json` (one object per line) or `text`"
    )
    engine_port: int | None = Field(
        default=None,
        ge=1,
        le=65535,
        description="the local engine (`sluice serve` with no backend): the port llama-server listens "
        "on; unset: a free one",
    )
    engine_slots: int = Field(
        default=LOCAL_ENGINE_SLOTS,
        ge=1,
        le=256,
        description="the local engine: the sequences llama-server runs at once",
    )
    engine_ctx_per_slot: int = Field(
        default=LOCAL_ENGINE_CTX_PER_SLOT,
        ge=128,
        description="the local engine: each sequence's context in tokens (prompt + answer); "
        'llama-server\'s "context size exceeded ... try increasing it" means this one',
    )

    files_dir: str | None = Field(
        default=None,
        description="the Batch API's files and batches with the embedded broker (`memory`): a directory "
        "on the local disk that one process owns; unset: `files` in the user's data directory "
        "(`~/.local/share/sluice/files` on Linux); with a Redis broker they live in that Redis",
    )
    max_file_bytes: int = Field(
        default=200 * 1024 * 1024,
        ge=1024,
        description="the largest file `POST /v1/files` takes (bytes); a larger one is a 413 before "
        "anything is stored",
    )
    batch_max_lines: int = Field(
        default=50_000, ge=1, description="the most requests (lines) one batch's input file may hold"
    )
    batch_class: str = Field(
        default="batch",
        description="the priority class batch lines run in; unless `classes` names it, it is added "
        "below every configured class with no minimum share, and only batch lines may use it",
    )
    batch_max_inflight: int | None = Field(
        default=None,
        ge=1,
        description="batch lines of one model queued or running at once, over every batch, at most; "
        "unset: as many as the slots that interactive work and `batch_headroom_slots` leave idle",
    )
    batch_headroom_slots: int | None = Field(
        default=None,
        ge=0,
        description="slots of each model that batch lines leave free for interactive arrivals, beyond "
        "those interactive work holds, while there is any (none after 30 s without); unset: half the "
        "model's slots",
    )
    batch_completion_windows: list[CompletionWindow] = Field(
        default_factory=lambda: ["24h"],
        description="the `completion_window` values a batch may ask for (a number and `s`, `m` or `h`); "
        'OpenAI takes only `"24h"`',
    )

    @model_validator(mode="after")
    def _check(self) -> Settings:
        names = [c.name for c in self.classes]
        if not names or len(set(names)) != len(names):
            raise ValueError("classes must be a non-empty list of distinct names")
        if self.default_priority not in names:
            raise ValueError(f"default_priority {self.default_priority!r} is not one of the classes {names}")
        for key in self.keys:
            if key.max_priority is not None and key.max_priority not in names:
                raise ValueError(
                    f"key of tenant {key.tenant!r}: max_priority {key.max_priority!r} is not a class"
                )
        if len({k.key_sha256 for k in self.keys}) != len(self.keys):
            raise ValueError("two keys have the same key_sha256")
        # A default left unset follows a lowered cap; one set explicitly above its cap is a mistake.
        for default, cap in (
            ("default_timeout_s", "max_timeout_s"),
            ("default_max_tokens", "max_tokens_cap"),
        ):
            value = getattr(self, default)
            if value is not None and value > getattr(self, cap):
                if default in self.model_fields_set:
                    raise ValueError(f"{default} must not exceed {cap}")
                object.__setattr__(self, default, getattr(self, cap))
        if self.queue_interval_s < self.queue_early_s:
            raise ValueError("queue_interval_s must not be shorter than queue_early_s")
        self._check_fleet(names)
        return self

    def _check_fleet(self, classes: list[str]) -> None:
        """Pools, backends and aliases name distinct things, and a pool's priority map names classes."""
        engines = [p.name for p in self.pools] + [b.name or b.url for b in self.backends]
        duplicated = sorted({n for n in engines if engines.count(n) > 1})
        if duplicated:
            raise ValueError(f"pools and backends must have distinct names: {', '.join(duplicated)}")
        aliases = [a.name for a in self.aliases]
        if len(set(aliases)) != len(aliases):
            raise ValueError("two aliases have the same name")
        known = set(classes) | {self.batch_class}
        for pool in self.pools:
            unknown = sorted(set(pool.priority or {}) - known)
            if unknown:
                raise ValueError(f"pool {pool.name!r}: priority names unknown classes: {', '.join(unknown)}")

    @property
    def has_engines(self) -> bool:
        """Whether any engine is configured (backends or pools); none: `sluice serve` starts its own."""
        return bool(self.backends or self.pools)

    def policy(self) -> QueuePolicy:
        params: dict[str, float] = {}
        if self.queue_policy == "codel":
            params = {
                "target_s": self.queue_target_s,
                "interval_s": self.queue_interval_s,
                "early_s": self.queue_early_s,
                "burst_rise": self.queue_burst_rise,
                "half_life_s": self.queue_half_life_s,
            }
        elif self.queue_policy == "fifo":
            params = {"max_queued": self.fifo_max_queued}
        return make_policy(self.queue_policy, **params)

    def request_limits(self) -> RequestLimits:
        """What one request may ask for, and the defaults it gets (sluice.core.request)."""
        return RequestLimits(
            classes=tuple(c.name for c in self.classes),
            default_priority=self.default_priority,
            max_n=self.max_n,
            default_max_tokens=self.default_max_tokens,
            max_tokens_cap=self.max_tokens_cap,
            max_messages=self.max_messages,
            max_prompt_tokens=self.max_prompt_tokens,
            default_timeout_s=self.default_timeout_s,
            max_timeout_s=self.max_timeout_s,
        )

    def router(self) -> Router:
        """The dispatcher's engine picker: prefix affinity and its bound and memory, as set."""
        return Router(
            affinity=self.prefix_affinity, load_factor=self.prefix_load_factor, remember=self.prefix_remember
        )

    def class_specs(self) -> list[ClassSpec]:
        return [ClassSpec(c.name, c.min_share) for c in self.classes]

    def batch_files_dir(self) -> Path:
        """Where the embedded store keeps the Batch API's files (``files_dir``)."""
        if self.files_dir is not None:
            return Path(self.files_dir)
        from platformdirs import user_data_dir

        return Path(user_data_dir("sluice")) / "files"

    def queue_classes(self) -> list[ClassSpec]:
        """The broker's classes: the configured ones, and below them the batch class (no minimum
        share: it runs only on capacity no other class wants) unless it is configured already."""
        specs = self.class_specs()
        if self.batch_class not in {c.name for c in specs}:
            specs.append(ClassSpec(self.batch_class, 0.0))
        return specs

    def limits(self) -> tuple[dict[str, QueueLimits], QueueLimits]:
        classes = {
            c.name: Bounds(c.max_queued_jobs, c.max_queued_tokens)
            for c in self.classes
            if c.max_queued_jobs is not None or c.max_queued_tokens is not None
        }
        default = QueueLimits(Bounds(self.max_queued_jobs, self.max_queued_tokens), classes)
        per_model = {
            name: QueueLimits(
                Bounds(
                    m.max_queued_jobs if m.max_queued_jobs is not None else self.max_queued_jobs,
                    m.max_queued_tokens if m.max_queued_tokens is not None else self.max_queued_tokens,
                ),
                classes,
            )
            for name, m in self.models.items()
        }
        return per_model, default


class ConfigError(Exception):
    pass


def _env_overrides(environ: Mapping[str, str]) -> dict[str, Any]:
    out: dict[str, Any] = {}
    for name in Settings.model_fields:
        raw = environ.get(f"SLUICE_{name.upper()}")
        if raw is None or name in ("classes", "models", "pools", "aliases"):
            continue
        if name == "keys":
            continue
        if name == "backends":
            out[name] = [{"url": u.strip()} for u in raw.split(",") if u.strip()]
        else:
            out[name] = raw  # pydantic converts numbers and booleans from strings
    return out


def load_settings(
    path: str | Path | None = None,
    *,
    overrides: Mapping[str, Any] | None = None,
    environ: Mapping[str, str] | None = None,
) -> Settings:
    data: dict[str, Any] = {}
    if path is not None:
        try:
            with open(path, "rb") as f:
                data = tomllib.load(f)
        except OSError as exc:
            raise ConfigError(f"cannot read config file {path}: {exc.strerror}") from exc
        except tomllib.TOMLDecodeError as exc:
            raise ConfigError(f"config file {path} is not valid TOML: {exc}") from exc
    data.update(_env_overrides(os.environ if environ is None else environ))
    data.update({k: v for k, v in (overrides or {}).items() if v is not None})
    try:
        return Settings.model_validate(data)
    except ValidationError as exc:
        problems = "; ".join(f"{'.'.join(map(str, e['loc'])) or 'config'}: {e['msg']}" for e in exc.errors())
        raise ConfigError(f"invalid configuration: {problems}") from exc
