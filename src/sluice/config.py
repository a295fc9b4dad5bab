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
from typing import Any, Literal, cast

from pydantic import BaseModel, ConfigDict, Field, ValidationError, model_validator

from sluice.broker.base import BrokerSettings
from sluice.core import scheduler
from sluice.core.admission import Bounds, QueueLimits
from sluice.core.job import Job
from sluice.core.policy import CoDelPolicy, FifoPolicy, QueuePolicy, make_policy
from sluice.core.request import RequestLimits
from sluice.core.scheduler import ClassSpec
from sluice.local_engine.server import DEFAULT_CTX_PER_SLOT as LOCAL_ENGINE_CTX_PER_SLOT
from sluice.local_engine.server import DEFAULT_SLOTS as LOCAL_ENGINE_SLOTS


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid")


class BackendConfig(_Strict):
    """An OpenAI-compatible engine."""

    url: str
    name: str | None = None
    #: models it serves; empty: ask the engine's /v1/models
    models: list[str] = Field(default_factory=list)
    #: sequences it runs at once (vLLM --max-num-seqs, llama-server -np); None: the global default
    max_concurrency: int | None = Field(default=None, ge=1)
    #: optional budget of in-flight tokens (prompt + max_tokens), e.g. the KV cache size
    max_inflight_tokens: int | None = Field(default=None, ge=1)
    api_key: str | None = None


class ClassConfig(_Strict):
    """A priority class; the list order is the priority order, highest first."""

    name: str
    #: fraction of dispatches it keeps while higher classes compete (0 = strict priority only)
    min_share: float = Field(default=0.0, ge=0.0, le=1.0)
    max_queued_jobs: int | None = Field(default=None, ge=1)
    max_queued_tokens: int | None = Field(default=None, ge=1)


class KeyGrant(_Strict):
    """What the holder of an API key may do (the key itself is never stored)."""

    tenant: str = Field(min_length=1, max_length=128)
    #: highest priority class the key may use; None: any
    max_priority: str | None = None
    #: fair-share weight between tenants inside a class
    weight: float = Field(default=1.0, gt=0, le=1000)
    rpm: int | None = Field(default=None, ge=1)
    tpm: int | None = Field(default=None, ge=1)
    max_concurrent: int | None = Field(default=None, ge=1)
    max_queued: int | None = Field(default=None, ge=1)
    #: open connections (streams, long polls, websockets) at once
    max_connections: int | None = Field(default=None, ge=1)
    #: secret that signs this key's webhooks; None: webhooks are not signed
    webhook_secret: str | None = Field(default=None, max_length=256)
    #: may call /admin endpoints
    admin: bool = False


class KeyConfig(KeyGrant):
    """An API key, stored as its SHA-256 (``sluice keys new`` makes one), and its policy."""

    key_sha256: str = Field(pattern="^[0-9a-f]{64}$")


class ModelConfig(_Strict):
    """Queue bounds of one model; unset fields take the global defaults."""

    max_queued_jobs: int | None = Field(default=None, ge=1)
    max_queued_tokens: int | None = Field(default=None, ge=1)


# Every default that feeds the core or the broker is read from their own defaults, never written
# again here: a server configured with nothing runs exactly as they do by default, and the two
# cannot drift apart (tests/test_config.py pins it).

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


class Settings(_Strict):
    host: str = "127.0.0.1"
    port: int = Field(default=8000, ge=0, le=65535)
    #: "memory" (embedded) or a redis:// URL
    broker: str = "memory"
    backends: list[BackendConfig] = Field(default_factory=list)
    #: concurrency of a backend that does not set its own
    max_concurrency: int = Field(default=8, ge=1)
    classes: list[ClassConfig] = Field(default_factory=lambda: list(DEFAULT_CLASSES))
    default_priority: str = "normal"
    models: dict[str, ModelConfig] = Field(default_factory=dict)
    #: the queue policy (docs/configuration.md, "Queue policy"): cap, fifo, deadline or codel
    queue_policy: Literal["cap", "fifo", "deadline", "codel"] = "codel"
    #: codel: the queueing delay a standing queue is driven down to (seconds)
    queue_target_s: float = Field(default=_CODEL.target_s, ge=0)
    #: codel: the longest a queue may stay above the target, growing, before it counts as standing
    queue_interval_s: float = Field(default=_CODEL.interval_s, ge=0)
    #: codel: after this long above the target, a slowly rising queue counts as standing already
    queue_early_s: float = Field(default=_CODEL.early_s, ge=0)
    #: codel: seconds of delay gained per second above the target that mark a burst, not an overload
    queue_burst_rise: float = Field(default=_CODEL.burst_rise, ge=0)
    #: codel: half-life of the delay limit a burst's queue keeps, on its way down to the target (seconds)
    queue_half_life_s: float = Field(default=_CODEL.half_life_s, gt=0)
    #: fifo: jobs the buffer holds
    fifo_max_queued: int = Field(default=FifoPolicy.max_queued, ge=1)
    #: per-model bounds for models not listed in ``models``
    max_queued_jobs: int | None = Field(default=_QUEUE_LIMITS.model.max_jobs, ge=1)
    max_queued_tokens: int | None = Field(default=_QUEUE_LIMITS.model.max_tokens, ge=1)
    #: deadline of a request that sets none (seconds)
    default_timeout_s: float = Field(default=120.0, gt=0)
    max_timeout_s: float = Field(default=600.0, gt=0)
    #: max_tokens of a request that sets none
    default_max_tokens: int = Field(default=512, ge=1)
    max_tokens_cap: int = Field(default=4096, ge=1)
    max_n: int = Field(default=4, ge=1)
    max_body_bytes: int = Field(default=4 * 1024 * 1024, ge=1024)
    max_attempts: int = Field(default=_JOB_MAX_ATTEMPTS, ge=1)
    result_ttl_s: float = Field(default=_BROKER.result_ttl_s, gt=0)
    lease_s: float = Field(default=_BROKER.lease_s, gt=0)
    #: longest ?wait= a poll may hold the connection (seconds)
    max_poll_wait_s: float = Field(default=60.0, gt=0)
    #: the per-slot service rate (tokens/s) assumed before any job has finished
    drain_prior_per_slot: float = Field(default=_BROKER.drain_prior_per_slot, gt=0)
    #: API keys; none configured means open mode, allowed only on a loopback address
    keys: list[KeyConfig] = Field(default_factory=list)
    #: also accept API keys stored in the broker by an administrator (POST /admin/keys); with it the
    #: gateway is never in open mode, even with no keys in this file
    key_store: bool = False
    #: serve open mode (no keys) on a non-loopback address anyway
    insecure_open: bool = False
    #: limits on what a client controls
    max_messages: int = Field(default=256, ge=1)
    max_prompt_tokens: int = Field(default=32768, ge=1)
    max_stream_s: float = Field(default=900.0, gt=0)
    #: open connections per key (streams, long polls, websockets) when the key sets none
    max_connections_per_key: int = Field(default=64, ge=1)
    #: webhooks may target loopback, private and link-local addresses (for local development only)
    webhooks_allow_private: bool = False
    log_level: str = "info"
    log_format: str = Field(default="json", pattern="^(json|text)$")
    #: the local engine (``sluice serve`` with no backend): the port llama-server listens on (None: a
    #: free one), the sequences it runs at once, and each sequence's context in tokens (prompt +
    #: answer; llama-server's "context size exceeded ... try increasing it" means this one)
    engine_port: int | None = Field(default=None, ge=1, le=65535)
    engine_slots: int = Field(default=LOCAL_ENGINE_SLOTS, ge=1, le=256)
    engine_ctx_per_slot: int = Field(default=LOCAL_ENGINE_CTX_PER_SLOT, ge=128)

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
            if getattr(self, default) > getattr(self, cap):
                if default in self.model_fields_set:
                    raise ValueError(f"{default} must not exceed {cap}")
                object.__setattr__(self, default, getattr(self, cap))
        if self.queue_interval_s < self.queue_early_s:
            raise ValueError("queue_interval_s must not be shorter than queue_early_s")
        return self

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

    def class_specs(self) -> list[ClassSpec]:
        return [ClassSpec(c.name, c.min_share) for c in self.classes]

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
        if raw is None or name in ("classes", "models"):
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
