"""The configuration file's tables: one typed record for each of ``[[backends]]``, ``[[pools]]``,
``[[aliases]]``, ``[[classes]]``, ``[[keys]]`` and ``[models.NAME]``.

:mod:`sluice.config` composes them into :class:`~sluice.config.Settings` (the file's top level) and
loads the file; each field's ``description`` is what ``docs/configuration.md`` prints for it.
"""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator


class Strict(BaseModel):
    """A record that refuses fields it does not know: a misspelt key in the file is an error, not a
    silently ignored default."""

    model_config = ConfigDict(extra="forbid")


class BackendConfig(Strict):
    """An OpenAI-compatible engine (``[[backends]]``); each field's ``description`` says what it is."""

    url: str = Field(description="the engine's base URL (with or without `/v1`)")
    name: str | None = Field(
        default=None, description="a name for logs, metrics and `/admin`; unset: the URL"
    )
    models: list[str] = Field(
        default_factory=list, description="models it serves; empty: ask the engine's `/v1/models`"
    )
    max_concurrency: int | None = Field(
        default=None,
        ge=1,
        description="sequences it runs at once (vLLM `--max-num-seqs`, llama-server `-np`); "
        "unset: the top-level `max_concurrency`",
    )
    max_inflight_tokens: int | None = Field(
        default=None,
        ge=1,
        description="optional budget of in-flight tokens (prompt + max_tokens), e.g. its KV cache size; "
        "unset: no budget",
    )
    api_key: str | None = Field(
        default=None, description="bearer token Sluice sends to the engine, if it needs one"
    )
    adaptive: bool = Field(
        default=False,
        description="learn the engine's in-flight limit, `max_concurrency` its ceiling; false: "
        "`max_concurrency` is the limit",
    )


class PoolConfig(Strict):
    """A pool of engines serving the same models (``[[pools]]``); each field's ``description`` says what
    it is. docs/fleet-config.md shows pools, aliases and DNS membership at work."""

    name: str = Field(
        min_length=1, description="the pool's name, for logs, `/admin` and draining the whole pool"
    )
    models: list[str] = Field(
        default_factory=list,
        description="engine model names its engines serve; empty: ask each engine's `/v1/models`",
    )
    engines: list[str] = Field(
        min_length=1,
        description="the engines' addresses: `http://HOST:PORT` URLs, or `dns://NAME:PORT`, re-resolved "
        "every `dns_refresh_s`, each A/AAAA record one engine (a Kubernetes headless Service gives one "
        "per pod)",
    )
    max_concurrency: int | None = Field(
        default=None,
        ge=1,
        description="the most sequences an engine of the pool runs at once: with `adaptive` the ceiling "
        "of the learned limit (unset: none), without it the fixed limit (required then)",
    )
    adaptive: bool = Field(
        default=True,
        description="learn each engine's in-flight limit from what it reports and what Sluice measures; "
        "false: `max_concurrency` is the limit",
    )
    tpot_objective_s: float | None = Field(
        default=None,
        gt=0,
        description="adaptive: the time per output token (seconds) the learned limit keeps each stream "
        "within; unset: the limiter's own objective",
    )
    max_inflight_tokens: int | None = Field(
        default=None,
        ge=1,
        description="optional budget of in-flight tokens (prompt + max_tokens) per engine, e.g. its KV "
        "cache size; unset: no budget",
    )
    priority: dict[str, int] | None = Field(
        default=None,
        description="priority class -> the `priority` value sent in each request (vLLM "
        "`--scheduling-policy priority`: lower runs sooner); unset: no `priority` field is sent",
    )
    api_key: str | None = Field(
        default=None, description="bearer token Sluice sends to the pool's engines, if they need one"
    )

    @model_validator(mode="after")
    def _check(self) -> PoolConfig:
        if not self.adaptive and self.max_concurrency is None:
            raise ValueError(f"pool {self.name!r}: adaptive = false needs max_concurrency (the fixed limit)")
        for address in self.engines:
            problem = engine_address_problem(address)
            if problem is not None:
                raise ValueError(f"pool {self.name!r}: engine {address!r}: {problem}")
        if len(set(self.engines)) != len(self.engines):
            raise ValueError(f"pool {self.name!r}: an engine is listed twice")
        return self


def engine_address_problem(address: str) -> str | None:
    """What is wrong with an engine's address (None: nothing): ``http(s)://HOST[:PORT][/v1]`` or
    ``dns://NAME:PORT``."""
    scheme, sep, rest = address.partition("://")
    if not sep or scheme not in ("http", "https", "dns"):
        return "must start with http://, https:// or dns://"
    if scheme == "dns":
        host, colon, port = rest.rpartition(":")
        if not colon or not host or "/" in rest:
            return "a DNS address is dns://NAME:PORT"
        if not port.isdigit() or not 0 < int(port) < 65536:
            return "the port must be a number from 1 to 65535"
        return None
    host_port = rest.rstrip("/").removesuffix("/v1")
    if not host_port or "/" in host_port:
        return "a URL is http://HOST:PORT (with or without /v1)"
    host, colon, port = host_port.rpartition(":")
    if colon and host and not host.endswith("]") and "]" not in port and not port.isdigit():
        return "the port must be a number"
    return None


class AliasTarget(Strict):
    """One engine model a public name may go to, and its share (``targets`` of ``[[aliases]]``)."""

    model: str = Field(min_length=1, description="the engine model name (what the engines serve)")
    weight: float = Field(
        default=1.0, gt=0, description="its share of the alias's requests, relative to the others'"
    )


class AliasConfig(Strict):
    """A public model name (``[[aliases]]``) that clients ask for, sent to one of its targets by weight
    (a canary: `weight = 95` and `weight = 5`)."""

    name: str = Field(min_length=1, description="the public model name, as clients send it in `model`")
    targets: list[AliasTarget] = Field(
        min_length=1, description="the engine models it goes to, each `{model = ..., weight = N}`"
    )

    @model_validator(mode="after")
    def _check(self) -> AliasConfig:
        models = [t.model for t in self.targets]
        if len(set(models)) != len(models):
            raise ValueError(f"alias {self.name!r}: a target model is listed twice")
        return self


class ClassConfig(Strict):
    """A priority class (``[[classes]]``); the list order is the priority order, highest first."""

    name: str = Field(description="the class's name, as requests give it in `priority` or `X-Priority`")
    min_share: float = Field(
        default=0.0,
        ge=0.0,
        le=1.0,
        description="fraction of dispatches it keeps while higher classes compete (0 = strict priority only)",
    )
    max_queued_jobs: int | None = Field(
        default=None,
        ge=1,
        description="queued jobs of this class per model before `429 queue_full`; unset: only the "
        "model's bound",
    )
    max_queued_tokens: int | None = Field(
        default=None,
        ge=1,
        description="queued cost (prompt + max_tokens) of this class per model before `429 queue_full`; "
        "unset: only the model's bound",
    )


class KeyGrant(Strict):
    """What the holder of an API key may do (the key itself is never stored)."""

    tenant: str = Field(
        min_length=1,
        max_length=128,
        description="who the key belongs to; fair sharing and `max_concurrent` are per tenant, `rpm` and "
        "`tpm` per key",
    )
    max_priority: str | None = Field(
        default=None, description="highest priority class the key may use; unset: any"
    )
    weight: float = Field(
        default=1.0, gt=0, le=1000, description="fair-share weight between tenants inside a class"
    )
    rpm: int | None = Field(
        default=None,
        ge=1,
        description="requests per minute, this key's own (each key of a tenant has its own); unset: "
        "unlimited",
    )
    tpm: int | None = Field(
        default=None,
        ge=1,
        description="tokens (prompt + max_tokens, settled with real usage) per minute, this key's own; "
        "unset: unlimited",
    )
    max_concurrent: int | None = Field(
        default=None,
        ge=1,
        description="jobs of this key's tenant running at once (the cap of the key that sent its latest "
        "job: give a tenant's keys the same); unset: unlimited",
    )
    max_queued: int | None = Field(
        default=None,
        ge=1,
        description="this key's requests are refused while its tenant has this many jobs waiting; unset: "
        "unlimited",
    )
    max_connections: int | None = Field(
        default=None,
        ge=1,
        description="open connections (streams, long polls, websockets) at once; unset: the top-level "
        "`max_connections_per_key`",
    )
    webhook_secret: str | None = Field(
        default=None,
        max_length=256,
        description="secret that signs this key's webhooks; unset: webhooks are not signed",
    )
    admin: bool = Field(default=False, description="may call `/admin` endpoints")


class KeyConfig(KeyGrant):
    """An API key (``[[keys]]``), stored as its SHA-256 (``sluice keys new`` makes one), and its grant."""

    key_sha256: str = Field(
        pattern="^[0-9a-f]{64}$", description="SHA-256 (hex) of the key; `sluice keys new` makes one"
    )


class ModelConfig(Strict):
    """Queue bounds of one model (``[models.NAME]``); unset fields take the top-level values."""

    max_queued_jobs: int | None = Field(
        default=None, ge=1, description="this model's bound on queued jobs; unset: the top-level value"
    )
    max_queued_tokens: int | None = Field(
        default=None,
        ge=1,
        description="this model's bound on queued cost (prompt + max_tokens); unset: the top-level value",
    )
