"""Errors in OpenAI's shape, with the status, Retry-After and x-should-retry a client needs."""

from __future__ import annotations

import logging
import math
from collections.abc import Sequence
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.routing import Match

from sluice.api.schemas import MAX_JSON_DEPTH, UNREADABLE
from sluice.broker.base import BrokerUnavailable
from sluice.core.admission import Refused
from sluice.protocol import error_body

log = logging.getLogger("sluice.gateway")

# OpenAI's own types: a client's mistake is an invalid_request_error, a failure on the way a
# server_error; what exactly went wrong is the error's code (model_not_found, job_finished,
# deadline_exceeded...), which the status and the code keep.
_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "invalid_request_error",
    405: "invalid_request_error",
    409: "invalid_request_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    502: "server_error",
    503: "server_error",
    504: "server_error",
}


class APIError(Exception):
    def __init__(
        self,
        status: int,
        message: str,
        code: str | None = None,
        *,
        param: str | None = None,
        type: str | None = None,
        retry_after_s: float | None = None,
        should_retry: bool | None = None,
    ) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.code = code
        self.param = param
        self.type = type or _TYPES.get(status, "server_error")
        self.retry_after_s = retry_after_s
        self.should_retry = should_retry
        self.job_id: str | None = None
        self.extra_headers: dict[str, str] = {}

    @classmethod
    def from_refused(cls, r: Refused) -> APIError:
        error = cls(r.status, r.message, r.code, retry_after_s=r.retry_after_s, should_retry=r.should_retry)
        if r.rate is not None:
            error.extra_headers = r.rate.headers()
        return error

    def headers(self) -> dict[str, str]:
        h: dict[str, str] = dict(self.extra_headers)
        if self.retry_after_s is not None:
            # Retry-After takes whole seconds; retry-after-ms (honoured by the OpenAI SDKs) keeps precision.
            # At least 1 each, by conditionals: max() is a call more, on every refusal.
            seconds, ms = math.ceil(self.retry_after_s), round(self.retry_after_s * 1000)
            h["Retry-After"] = str(seconds if seconds > 1 else 1)
            h["retry-after-ms"] = str(ms if ms > 1 else 1)
        if self.should_retry is not None:
            h["x-should-retry"] = "true" if self.should_retry else "false"
        if self.job_id is not None:
            h["x-sluice-job-id"] = self.job_id
        return h

    def response(self) -> JSONResponse:
        return JSONResponse(
            error_body(self.message, self.type, self.code, self.param),
            status_code=self.status,
            headers=self.headers(),
        )


_CURL_JSON = "send the header 'Content-Type: application/json' (curl: -H 'Content-Type: application/json')"

# What a JSON body that is not an object was, in the words of the JSON spec.
_JSON_KINDS: dict[type, str] = {
    list: "an array",
    str: "a string",
    int: "a number",
    float: "a number",
    bool: "a boolean",
    type(None): "null",
}


def is_json(content_type: str | None) -> bool:
    """Whether a Content-Type names JSON (``application/json``, ``application/*+json``), as the
    framework decides before it parses a body."""
    media = (content_type or "").split(";", 1)[0].strip().lower()
    return media == "application/json" or (media.startswith("application/") and media.endswith("+json"))


def param_name(loc: Sequence[Any], body: Any, missing: bool = False) -> str | None:
    """The parameter an error is about, named as the client sent it.

    A query, header or path parameter is its plain name ("wait"), not the framework's
    "query.wait". A body field is the dotted path through what was sent ("messages.0.content"):
    the validator's own segments for the branches of a union ("str", "list[str]",
    "function-after[...]") name nothing the client wrote, so a segment counts only while it is a
    key or an index of the body. The last segment of a missing field is kept, as it is absent by
    definition.
    """
    if not loc:
        return None
    source, *rest = loc
    if source != "body":
        return ".".join(str(p) for p in rest) or None
    parts: list[str] = []
    value = body
    for i, segment in enumerate(rest):
        is_key = isinstance(value, dict) and isinstance(segment, str) and segment in value
        is_index = isinstance(value, list) and isinstance(segment, int) and 0 <= segment < len(value)
        if is_key or is_index:
            value = value[segment]
        elif not (missing and i == len(rest) - 1):
            continue  # a union branch's name
        parts.append(str(segment))
    return ".".join(parts) or None


def _reasons(errors: list[Any], param: str | None, body: Any) -> str:
    """What is wrong with ``param``: each union branch that failed at that field adds its reason,
    so ``5`` for a string-or-list field reads "a valid string or a valid list"."""
    reasons: list[str] = []
    for error in errors:
        if error.get("type") == "missing" or param_name(error.get("loc", ()), body) != param:
            continue
        reason = str(error.get("msg", "invalid value"))
        if reason not in reasons:
            reasons.append(reason)
    prefix = "Input should be "
    if len(reasons) > 1 and all(r.startswith(prefix) for r in reasons):
        return prefix + " or ".join(r.removeprefix(prefix) for r in reasons)
    return "; ".join(reasons) or "invalid value"


def _body_error(content_type: str | None, body: Any, kind: str | None) -> APIError:
    """The whole body is wrong: not sent as JSON, empty, or JSON that is not an object."""
    if not is_json(content_type):
        if not content_type:
            sent = "missing"
        elif content_type.startswith("application/x-www-form-urlencoded"):
            sent = f"'{content_type}', what curl -d sends unless told otherwise"
        else:
            sent = f"'{content_type}'"
        return APIError(
            400,
            f"The body must be JSON: {_CURL_JSON}. This request's Content-Type is {sent}.",
            "invalid_content_type",
            param="Content-Type",
        )
    if kind == "missing":
        return APIError(400, "The request body is empty; it must be a JSON object.", "invalid_json")
    what = _JSON_KINDS.get(type(body), "not an object")
    return APIError(
        400,
        f'The request body must be a JSON object, {{"name": value, ...}}; this one is {what}.',
        "invalid_json",
    )


def validation_error(exc: RequestValidationError, content_type: str | None) -> APIError:
    """The framework's validation failure as the client's mistake, in OpenAI's words."""
    errors: list[Any] = list(exc.errors())
    if not errors:
        return APIError(400, "Invalid request.", "invalid_value")
    first = errors[0]
    kind = first.get("type")
    loc = tuple(first.get("loc", ()))
    if kind == "json_invalid":
        ctx = first.get("ctx") or {}
        where = f" at character {loc[1]}" if len(loc) > 1 else ""
        reason = ctx.get("error", "JSON decode error")
        return APIError(400, f"The request body is not valid JSON: {reason}{where}.", "invalid_json")
    if kind == UNREADABLE:
        ctx = first.get("ctx") or {}
        param = str(ctx.get("param", "")) or None
        subject = f"'{param}'" if param else "the request body"
        return APIError(
            400, f"Invalid value for {subject}: {ctx.get('reason')}.", "invalid_value", param=param
        )
    if loc == ("body",):
        return _body_error(content_type, exc.body, kind)
    if kind == "missing":
        param = param_name(loc, exc.body, missing=True)
        return APIError(
            400, f"Missing required parameter: '{param}'.", "missing_required_parameter", param=param
        )
    param = param_name(loc, exc.body)
    reasons = _reasons(errors, param, exc.body)
    subject = f"'{param}'" if param else "the request body"
    return APIError(400, f"Invalid value for {subject}: {reasons}.", "invalid_value", param=param)


# The methods a 405's Allow header may list; OPTIONS and TRACE are never routed here.
_METHODS = ("GET", "HEAD", "POST", "PUT", "PATCH", "DELETE")


def allowed_methods(request: Request) -> list[str]:
    """Every method some route at this path accepts. The framework's own 405 names only the
    first route it matched (the GET of ``/v1/jobs/{id}``, not its DELETE), so each method is
    tried against the whole routing table, in a bare scope that carries nothing of this
    request's own match."""
    methods = []
    for method in _METHODS:
        scope = {
            "type": "http",
            "method": method,
            "path": request.scope["path"],
            "root_path": request.scope.get("root_path", ""),
            "headers": [],
            "query_string": b"",
        }
        if any(route.matches(scope)[0] is Match.FULL for route in request.app.router.routes):
            methods.append(method)
    return methods


def _http_error(request: Request, exc: StarletteHTTPException) -> APIError:
    status = exc.status_code
    code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(status)
    message = str(exc.detail)
    if status == 404 and message == "Not Found":
        message = f"Invalid URL ({request.method} {request.url.path})."
    elif status == 400 and message == "There was an error parsing the body":
        # The framework's answer to a JSON body its parser gave up on: nested past the recursion
        # limit, or not text at all (not UTF-8).
        if isinstance(exc.__cause__, RecursionError):
            message = f"The request body is JSON nested more than {MAX_JSON_DEPTH} levels deep."
            code = "invalid_value"
        else:
            message, code = "The request body is not valid JSON: it is not UTF-8 text.", "invalid_json"
    error = APIError(status, message, code)
    error.extra_headers = dict(exc.headers or {})
    if status == 405:
        allowed = allowed_methods(request) or [
            m.strip() for m in error.extra_headers.get("Allow", "").split(",") if m.strip()
        ]
        error.message = f"{request.method} is not allowed on {request.url.path}; use {' or '.join(allowed)}."
        error.extra_headers["Allow"] = ", ".join(allowed)
    return error


def install(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request: Request, exc: APIError) -> JSONResponse:
        return exc.response()

    @app.exception_handler(Refused)
    async def _refused(request: Request, exc: Refused) -> JSONResponse:
        return APIError.from_refused(exc).response()

    @app.exception_handler(BrokerUnavailable)
    async def _unavailable(request: Request, exc: BrokerUnavailable) -> JSONResponse:
        log.warning("broker unavailable: %s", exc)
        return APIError(
            503, "The queue is unreachable right now; retry shortly.", "broker_unavailable", retry_after_s=1.0
        ).response()

    @app.exception_handler(RequestValidationError)
    async def _invalid(request: Request, exc: RequestValidationError) -> JSONResponse:
        return validation_error(exc, request.headers.get("content-type")).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        return _http_error(request, exc).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        # Only what escapes the last resort (sluice.api.limits.Guard: an outer middleware's
        # failure) reaches the framework's last handler; the Guard answers the rest.
        log.error("unexpected error", exc_info=exc)
        return internal_error().response()


def internal_error() -> APIError:
    return APIError(500, "Internal error; the request was not processed.", "internal_error")
