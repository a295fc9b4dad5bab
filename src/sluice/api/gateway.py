"""Turning a validated request into a job (the rules are sluice.core.request), and admitting it."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import secrets
import time
from collections.abc import AsyncIterator
from dataclasses import dataclass, field
from typing import Any

from fastapi import Request
from fastapi.exceptions import RequestValidationError
from pydantic import ValidationError

from sluice.api.auth import Caller
from sluice.api.errors import APIError
from sluice.api.headers import header, headers
from sluice.api.schemas import SchedulingOptions
from sluice.broker.base import Admission, Broker
from sluice.config import Settings
from sluice.core.admission import Refused, clamp_retry_after
from sluice.core.job import Endpoint, Job, new_job_id
from sluice.core.model_info import ModelInfo
from sluice.core.request import RequestedJob, RequestLimits, RequestRejected, plan_job
from sluice.metrics import Metrics, counted, observed
from sluice.startup import EngineStartup
from sluice.webhooks import CallbackRefused, check_callback_url

log = logging.getLogger("sluice.gateway")

# How stale the model registry may be on the admission path (a worker's lease is 30 s by default).
SERVED_CACHE_S = 1.0
#: How long the models' info is kept when the workers describe none (Gateway.model_info): shorter,
#: so that a worker that has just registered is described soon (it describes its models right
#: after), yet bounded, so that workers that describe nothing cost a read a request no more.
EMPTY_INFO_CACHE_S = 0.25

# Fields that are Sluice's, not the engine's.
OWN_FIELDS = ("priority", "timeout", "callback_url")
_OWN = frozenset(OWN_FIELDS)

#: The headers a job is built from, read in one scan (api.headers.headers), by their place there.
_JOB_HEADERS = {
    name: place
    for place, name in enumerate(
        (
            b"x-priority",
            b"x-request-timeout",
            b"x-stainless-timeout",
            b"x-stainless-read-timeout",
            b"idempotency-key",
        )
    )
}


def _names(served: dict[str, int]) -> str:
    """The served models, for an error that must say which exist."""
    return ", ".join(sorted(served)) or "none right now"


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
    #: the local engine's progress while ``sluice serve`` provisions it; None when engines are given
    startup: EngineStartup | None = None
    #: the connections this gateway holds, counted in the broker: key SHA-256 → connection ids;
    #: their leases are renewed while they last (``_renew_forever``)
    connections: dict[str, set[str]] = field(default_factory=dict)
    _served: tuple[float, dict[str, int]] = (0.0, {})
    _info: tuple[float, dict[str, ModelInfo]] = (0.0, {})
    #: renews the leases of ``connections``; runs only while there are some
    _renewer: asyncio.Task[None] | None = None
    #: slots being given back (kept so that a release outlives the request that ended)
    _releases: set[asyncio.Task[None]] = field(default_factory=set)
    #: ``settings.request_limits()``, made once: it is on every request's path, and the settings
    #: do not change while the gateway runs
    _limits: RequestLimits | None = None
    #: the metrics' children this gateway counts admissions in, by refusal code (see admit)
    _refused: dict[str, tuple[Any, Any]] = field(default_factory=dict)
    _admitted: Any = None

    @contextlib.asynccontextmanager
    async def connection(self, caller: Caller) -> AsyncIterator[None]:
        """Count a long-lived connection (stream, long poll, websocket) against the cap of the
        caller's key. The count is the broker's, so it is the same on every gateway that shares it;
        the slot is leased, renewed while the connection lasts, given back as it ends, and it lapses
        within ``lease_s`` if this gateway dies."""
        key = caller.key_sha256
        if not caller.keyed or key is None:
            yield
            return
        cap = caller.max_connections or self.settings.max_connections_per_key
        conn_id = secrets.token_hex(12)
        try:
            taken = await self.broker.open_connection(key, conn_id, cap)
        except asyncio.CancelledError:
            self._give_back(key, conn_id)  # the take may have happened on its way
            raise
        if not taken:
            raise APIError(
                429,
                f"Too many open connections for this key ({cap}); close some first.",
                "too_many_connections",
                retry_after_s=1.0,
            )
        self.connections.setdefault(key, set()).add(conn_id)
        if self._renewer is None or self._renewer.done():
            self._renewer = asyncio.create_task(self._renew_forever(), name="gateway-connection-leases")
        try:
            yield
        finally:
            release = self._give_back(key, conn_id)
            # Shielded: a request cancelled as its client hangs up (an SSE stream is) still gives
            # its slot back.
            await asyncio.shield(release)

    def _give_back(self, key: str, conn_id: str) -> asyncio.Task[None]:
        """Stop renewing a connection and give its slot back, in a task of its own."""
        held = self.connections.get(key)
        if held is not None:
            held.discard(conn_id)
            if not held:
                del self.connections[key]
        if not self.connections and self._renewer is not None:
            self._renewer.cancel()
            self._renewer = None
        task = asyncio.create_task(self._close(key, conn_id), name="gateway-connection-release")
        self._releases.add(task)
        task.add_done_callback(self._releases.discard)
        return task

    async def _close(self, key: str, conn_id: str) -> None:
        try:
            await self.broker.close_connection(key, conn_id)
        except Exception as exc:  # the lease lapses on its own: the slot comes back anyway
            log.warning("connection slot not given back (it lapses with its lease): %s", exc)

    async def _renew_forever(self) -> None:
        every = max(min(self.broker.settings.lease_s / 3, 5.0), 0.05)
        while True:
            await asyncio.sleep(every)
            held = {key: list(ids) for key, ids in self.connections.items()}
            try:
                await self.broker.renew_connections(held)
            except Exception as exc:  # the next round tries again; a lapsed slot is counted again
                log.warning("connection leases not renewed: %s", exc)

    async def served_models(self) -> dict[str, int]:
        """The registry, read at most once per SERVED_CACHE_S: it is on every admission's path, and
        on Redis each read is a round trip. An empty registry is not kept: the first worker to come
        up (the local engine once built) is served at once."""
        now = time.monotonic()
        kept = self.kept_served(now)
        if kept is None:
            kept = await self.broker.served_models()
            self._served = (now + SERVED_CACHE_S if kept else 0.0, kept)
        return kept

    def kept_served(self, now: float) -> dict[str, int] | None:
        """The registry as :meth:`served_models` keeps it, while it is fresh at ``now``
        (``time.monotonic()``); None once it must be read again."""
        expires, served = self._served
        return served if now < expires else None

    def kept_info(self, now: float) -> dict[str, ModelInfo] | None:
        """The models' info as :meth:`model_info` keeps it, while it is fresh at ``now``; None once
        it must be read again."""
        expires, info = self._info
        return info if now < expires else None

    async def model_info(self) -> dict[str, ModelInfo]:
        """What the workers know of the models they serve (context windows, answers' lengths), read
        at most once per SERVED_CACHE_S, as the registry is; an empty answer (workers that describe
        no model, or one just registered that has not described its models yet) for
        EMPTY_INFO_CACHE_S. Not kept at all, it was a broker read (on Redis a round trip) on every
        request of a deployment whose workers describe nothing."""
        now = time.monotonic()
        kept = self.kept_info(now)
        if kept is None:
            kept = await self.broker.model_info()
            self._info = (now + (SERVED_CACHE_S if kept else EMPTY_INFO_CACHE_S), kept)
        return kept

    def starting(self) -> APIError | None:
        """The answer for requests that need the local engine while it is not serving yet."""
        if self.startup is None or self.startup.ready:
            return None
        eta = self.startup.eta_s()
        failed = eta is None and self.startup.error is not None
        message = self.startup.describe()
        return APIError(
            503,
            message[:1].upper() + message[1:] + ".",
            "engine_failed" if failed else "engine_starting",
            retry_after_s=clamp_retry_after(eta if eta is not None else 30.0),
            should_retry=not failed,
        )

    async def resolve_model(self, requested: str | None) -> str:
        served = await self.served_models()
        if not served and (starting := self.starting()) is not None:
            raise starting
        if requested is None:
            if len(served) == 1:
                return next(iter(served))
            # Several models served, or none: say which exist, so the next try can name one.
            raise APIError(
                400,
                f"Missing required parameter: 'model' (models served: {_names(served)}).",
                "missing_required_parameter",
                param="model",
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
        raise APIError(
            404,
            f"The model '{requested}' does not exist (models served: {_names(served)}).",
            "model_not_found",
            param="model",
        )

    async def hold(self, caller: Caller) -> contextlib.AsyncExitStack:
        """Take a connection slot that outlives this call (a stream); ``aclose()`` gives it back."""
        stack = contextlib.AsyncExitStack()
        await stack.enter_async_context(self.connection(caller))
        return stack

    def job_for(self, caller: Caller, job: Job | None, job_id: str) -> Job:
        """The caller's own job, or 404: other tenants' ids are indistinguishable from unknown ones."""
        if job is None or job.tenant != caller.tenant:
            raise APIError(404, f"No job with id '{job_id}'.", "job_not_found")
        return job

    async def build_job(
        self,
        request: Request,
        caller: Caller,
        endpoint: Endpoint,
        body: dict[str, Any],
        opts: SchedulingOptions | None = None,
    ) -> Job:
        """The job a validated request body makes; raises the APIError of the first rule it breaks
        (the rules themselves are :func:`sluice.core.request.plan_job`). ``opts``: the body as the
        route validated it already (a ChatRequest is a SchedulingOptions), so that it is not
        validated, nor walked for unreadable strings, a second time."""
        if opts is None:
            try:
                opts = SchedulingOptions.model_validate(body)
            except ValidationError as exc:  # a body passed on unvalidated: a 4xx, not a 500
                errors = [{**e, "loc": ("body", *e["loc"])} for e in exc.errors()]
                # with the body: a param is named by walking what was sent (errors.param_name),
                # and without it no segment is the body's, so the param came back null
                raise RequestValidationError(errors, body=body) from None
        s = self.settings
        # The registry and the models' info as kept (kept_served, kept_info) while they are
        # fresh, read here without their two coroutines; a stale one, or a request that names
        # no model or one not served, goes the whole way.
        fresh = time.monotonic()
        served = self.kept_served(fresh)
        requested = opts.model
        if requested is not None and served is not None and requested in served:
            model = requested
        else:
            model = await self.resolve_model(requested)
        priority_header, timeout_header, node_timeout, python_timeout, idempotency_key = headers(
            request, _JOB_HEADERS
        )
        # By place, in RequestedJob's order, each line named by its field (mypy checks the
        # types, not which of two ``int | None`` goes where): made for every request, and
        # fifteen keywords are matched at twice the cost of the tuple itself (11.4k -> 5.1k
        # instructions, callgrind).
        asked = RequestedJob(
            endpoint,  # endpoint
            body.get("messages") if endpoint is Endpoint.CHAT else None,  # messages
            body.get("prompt") if endpoint is Endpoint.COMPLETIONS else None,  # prompt
            opts.n,  # n
            body.get("best_of"),  # best_of
            opts.max_tokens,  # max_tokens
            opts.max_completion_tokens,  # max_completion_tokens
            opts.priority,  # priority
            priority_header,  # priority_header
            opts.timeout,  # timeout_s
            timeout_header,  # timeout_header
            # client_timeout_header: the time-out the client's own library waits, as it sent it
            # (seconds): openai-node's x-stainless-timeout, else openai-python's
            # x-stainless-read-timeout
            node_timeout or python_timeout,
            body.get("tools"),  # tools
            body.get("functions"),  # functions
            body.get("response_format"),  # response_format
        )
        now = time.time()
        kept = self.kept_info(fresh)
        info = (kept if kept is not None else await self.model_info()).get(model)
        try:
            if self._limits is None:
                self._limits = s.request_limits()
            plan = plan_job(asked, self._limits, caller.limits, now, info)
        except RequestRejected as rejected:
            raise APIError(rejected.status, rejected.message, rejected.code, param=rejected.param) from None
        # The limits go to the engine as the client sent them (vLLM reads max_completion_tokens
        # first); a request without one gets the server's default_max_tokens, if it has one, else
        # none: the engine decides, as it would for the client.
        # Without Sluice's own fields: most bodies have none, and for them a copy (the same keys
        # in the same order) is a tenth of the comprehension's cost.
        if _OWN.isdisjoint(body):
            engine_body = body.copy()
        else:
            engine_body = {k: v for k, v in body.items() if k not in OWN_FIELDS}
        engine_body["model"] = model
        if opts.max_tokens is None and opts.max_completion_tokens is None and plan.engine_max_tokens:
            engine_body["max_tokens"] = plan.engine_max_tokens
        # By place, in Job's order, each line named by its field, as RequestedJob above: sixteen
        # keywords matched against the dataclass's twenty-eight parameters cost twice the call
        # itself (14.6k -> 7.1k instructions a Job, callgrind).
        return Job(
            new_job_id(),  # id
            model,  # model
            endpoint,  # endpoint
            engine_body,  # body
            caller.tenant,  # tenant
            plan.priority,  # priority
            plan.prompt_tokens,  # prompt_tokens
            plan.max_tokens,  # max_tokens
            now,  # created_at
            plan.deadline,  # deadline
            s.max_attempts,  # max_attempts
            idempotency_key or None,  # idempotency_key
            caller.limits.weight,  # weight
            # callback_url
            None if (url := body.get("callback_url")) is None else await self.callback_url(url),
            caller.key_sha256,  # key_sha256
            True,  # stream_tokens: Job's default (the route sets it)
            plan.sequences,  # sequences
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
            # The refusal's Retry-After is told as the broker gave it: a rate limit's is its
            # bucket's refill, every other is a reservation from the model's book (core/policy.py's
            # decide), already counted against the times handed out before it.
            refusals, retry_after = self._refusal_metrics(refused.code)
            refusals.inc(1)
            retry_after.observe(refused.retry_after_s)
            if retry:
                self.metrics.client_retries.labels("refused").inc()
            # Asked first: the fields are a dict built for every refusal, most often to be dropped.
            if log.isEnabledFor(logging.INFO):
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
        admitted = self._admitted
        if admitted is None:
            admitted = self._admitted = counted(self.metrics.admissions.labels("admitted", ""))
        (self.metrics.admissions.labels("duplicate", "") if admission.duplicate else admitted).inc(1)
        if retry:
            self.metrics.client_retries.labels("admitted").inc()
        return admission

    def _refusal_metrics(self, code: str) -> tuple[Any, Any]:
        """The refusal counter and the Retry-After histogram of ``code``, looked up once per code:
        a label lookup (a lock, a tuple of the values) on every refusal is a share of its cost."""
        found = self._refused.get(code)
        if found is None:
            found = self._refused[code] = (
                counted(self.metrics.admissions.labels("refused", code)),
                observed(self.metrics.retry_after.labels(code)),
            )
        return found


def client_retry(request: Request) -> int:
    """Which retry of the client this request is (0: a first try), from the OpenAI SDKs' header."""
    raw = header(request, b"x-stainless-retry-count")
    if not raw:
        return 0  # a first try, as most requests are (what "0" would give, without its checks)
    # ASCII only: str.isdigit() also accepts '²', which int() refuses; and short: int() refuses
    # more than 4300 digits, and no client retries a billion times.
    return int(raw) if raw.isascii() and raw.isdigit() and len(raw) <= 9 else 0


def rate_headers(admission: Admission) -> dict[str, str]:
    return admission.rate.headers() if admission.rate is not None else {}
