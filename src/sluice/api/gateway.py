"""Turning a validated request into a job: options, defaults, caps, tenant, cost, and admission."""

from __future__ import annotations

import contextlib
import logging
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request

from sluice.api.auth import Caller
from sluice.api.errors import APIError
from sluice.api.schemas import SchedulingOptions
from sluice.broker.base import Admission, Broker
from sluice.config import Settings
from sluice.core.admission import Refused
from sluice.core.cost import estimate_chat_tokens, estimate_prompt_tokens
from sluice.core.job import Endpoint, Job, new_job_id
from sluice.metrics import Metrics
from sluice.webhooks import CallbackRefused, check_callback_url

log = logging.getLogger("sluice.gateway")

# How stale the model registry may be on the admission path (a worker's lease is 30 s by default).
SERVED_CACHE_S = 1.0

# Fields that are Sluice's, not the engine's.
OWN_FIELDS = ("priority", "timeout", "callback_url")


def gateway(request: Request) -> Gateway:
    """The app's :class:`Gateway`, for the routes."""
    gw: Gateway = request.app.state.gateway
    return gw


@dataclass
class Gateway:
    """What the routes share; built once in the app's lifespan."""

    settings: Settings
    broker: Broker
    metrics: Metrics
    connections: dict[str, int] = field(default_factory=dict)
    _served: tuple[float, dict[str, int]] = (0.0, {})

    @contextlib.asynccontextmanager
    async def connection(self, caller: Caller) -> AsyncIterator[None]:
        """Count a long-lived connection (stream, long poll, websocket) against the caller's key's cap."""
        if not caller.keyed:
            yield
            return
        cap = caller.max_connections or self.settings.max_connections_per_key
        open_now = self.connections.get(caller.tenant, 0)
        if open_now >= cap:
            raise APIError(
                429,
                f"Too many open connections for this key ({cap}); close some first.",
                "too_many_connections",
                retry_after_s=1.0,
            )
        self.connections[caller.tenant] = open_now + 1
        try:
            yield
        finally:
            left = self.connections[caller.tenant] - 1
            if left:
                self.connections[caller.tenant] = left
            else:
                del self.connections[caller.tenant]

    async def served_models(self) -> dict[str, int]:
        """The registry, read at most once per SERVED_CACHE_S: it is on every admission's path, and
        on Redis each read is a round trip."""
        now = time.monotonic()
        if now >= self._served[0]:
            self._served = (now + SERVED_CACHE_S, await self.broker.served_models())
        return self._served[1]

    async def resolve_model(self, requested: str | None) -> str:
        served = await self.served_models()
        if requested is None:
            if len(served) == 1:
                return next(iter(served))
            raise APIError(
                400, "Missing required parameter: 'model'.", "missing_required_parameter", param="model"
            )
        if requested in served:
            return requested
        if requested in self.settings.models:
            raise APIError(
                503,
                f"No backend serving '{requested}' is available right now.",
                "no_backend",
                retry_after_s=5.0,
            )
        raise APIError(404, f"The model '{requested}' does not exist.", "model_not_found", param="model")

    async def hold(self, caller: Caller) -> contextlib.AsyncExitStack:
        """Take a connection slot that outlives this call (a stream); ``aclose()`` gives it back."""
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(self.connection(caller))
        return stack

    def priority(self, request: Request, caller: Caller, opts: SchedulingOptions) -> str:
        names = [c.name for c in self.settings.classes]
        ceiling = caller.limits.max_priority
        default = self.settings.default_priority
        if ceiling is not None and names.index(default) < names.index(ceiling):
            default = ceiling  # the key's own ceiling is its default when the server's is above it
        value = opts.priority or request.headers.get("x-priority") or default
        if value not in names:
            raise APIError(
                400, f"Unknown priority '{value}'; use one of {', '.join(names)}.", param="priority"
            )
        if ceiling is not None and names.index(value) < names.index(ceiling):
            raise APIError(
                403,
                f"This key may use priority '{ceiling}' at most; '{value}' is above it.",
                "priority_not_allowed",
                param="priority",
            )
        return value

    def job_for(self, caller: Caller, job: Job | None, job_id: str) -> Job:
        """The caller's own job, or 404: other tenants' ids are indistinguishable from unknown ones."""
        if job is None or job.tenant != caller.tenant:
            raise APIError(404, f"No job with id '{job_id}'.", "job_not_found")
        return job

    def timeout(self, request: Request, opts: SchedulingOptions) -> float:
        value: float | None = opts.timeout
        header = request.headers.get("x-request-timeout")
        if value is None and header is not None:
            try:
                value = float(header)
            except ValueError:
                value = -1
            if not value > 0 or value == float("inf"):
                raise APIError(
                    400, "X-Request-Timeout must be a positive number of seconds.", param="X-Request-Timeout"
                )
        return min(value or self.settings.default_timeout_s, self.settings.max_timeout_s)

    def max_tokens(self, opts: SchedulingOptions) -> int:
        s = self.settings
        for name in ("max_tokens", "max_completion_tokens"):
            value = getattr(opts, name)
            if value is None:
                continue
            if value <= 0:
                raise APIError(400, f"'{name}' must be at least 1.", "invalid_value", param=name)
            if value > s.max_tokens_cap:
                raise APIError(
                    400,
                    f"'{name}' must be at most {s.max_tokens_cap} on this server.",
                    "invalid_value",
                    param=name,
                )
            return int(value)
        return s.default_max_tokens

    async def build_job(
        self, request: Request, caller: Caller, endpoint: Endpoint, body: dict[str, Any]
    ) -> Job:
        opts = SchedulingOptions.model_validate(body)
        s = self.settings
        model = await self.resolve_model(opts.model)
        n = opts.n or 1
        if n > s.max_n:
            raise APIError(400, f"'n' must be at most {s.max_n} on this server.", param="n")
        max_tokens = self.max_tokens(opts)
        engine_body = {k: v for k, v in body.items() if k not in OWN_FIELDS and k != "max_completion_tokens"}
        engine_body["model"] = model
        engine_body["max_tokens"] = max_tokens
        if endpoint is Endpoint.CHAT:
            if len(body["messages"]) > s.max_messages:
                raise APIError(
                    400, f"At most {s.max_messages} messages per request on this server.", param="messages"
                )
            prompt_tokens = estimate_chat_tokens(body["messages"])
        else:
            prompt_tokens = estimate_prompt_tokens(body["prompt"])
        if prompt_tokens > s.max_prompt_tokens:
            raise APIError(
                400,
                f"The prompt is about {prompt_tokens} tokens; the most this server takes is "
                f"{s.max_prompt_tokens}.",
                "context_length_exceeded",
                param="messages" if endpoint is Endpoint.CHAT else "prompt",
            )
        now = time.time()
        return Job(
            id=new_job_id(),
            model=model,
            endpoint=endpoint,
            body=engine_body,
            tenant=caller.tenant,
            priority=self.priority(request, caller, opts),
            prompt_tokens=prompt_tokens,
            max_tokens=max_tokens * n,
            created_at=now,
            deadline=now + self.timeout(request, opts),
            max_attempts=s.max_attempts,
            idempotency_key=request.headers.get("idempotency-key") or None,
            weight=caller.limits.weight,
            callback_url=await self.callback_url(body.get("callback_url")),
        )

    async def callback_url(self, url: Any) -> str | None:
        if url is None:
            return None
        if not self.broker.supports_callbacks:
            raise APIError(
                400, "This deployment does not deliver webhooks.", "unsupported", param="callback_url"
            )
        try:
            await check_callback_url(str(url), allow_private=self.settings.webhooks_allow_private)
        except CallbackRefused as exc:
            raise APIError(
                400, f"callback_url refused: {exc}", "invalid_callback_url", param="callback_url"
            ) from None
        return str(url)

    async def admit(self, job: Job, caller: Caller, retry: int = 0) -> Admission:
        """Queue the job or raise the refusal's APIError. ``retry``: the client's own retry count
        (the official SDKs send it as ``x-stainless-retry-count``), counted so that a retry storm
        shows on the metrics."""
        try:
            admission = await self.broker.admit(job, caller.limits)
        except Refused as refused:
            self.metrics.admissions.labels("refused", refused.code).inc()
            if retry:
                self.metrics.client_retries.labels("refused").inc()
            log.info(
                "request refused",
                extra={
                    "fields": {
                        "model": job.model,
                        "tenant": job.tenant,
                        "priority": job.priority,
                        "status": refused.status,
                        "code": refused.code,
                        "retry_after_s": round(refused.retry_after_s, 3),
                        "client_retry": retry,
                    }
                },
            )
            raise APIError.from_refused(refused) from None
        self.metrics.admissions.labels("duplicate" if admission.duplicate else "admitted", "").inc()
        if retry:
            self.metrics.client_retries.labels("admitted").inc()
        return admission


def client_retry(request: Request) -> int:
    """Which retry of the client this request is (0: a first try), from the OpenAI SDKs' header."""
    raw = request.headers.get("x-stainless-retry-count", "0")
    # ASCII only: str.isdigit() also accepts '²', which int() refuses.
    return int(raw) if raw.isascii() and raw.isdigit() else 0


def rate_headers(admission: Admission) -> dict[str, str]:
    return admission.rate.headers() if admission.rate is not None else {}
