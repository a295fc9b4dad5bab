"""Errors in OpenAI's shape, with the status, Retry-After and x-should-retry a client needs."""

from __future__ import annotations

import logging
import math
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from sluice.broker.base import BrokerUnavailable
from sluice.core.admission import Refused
from sluice.protocol import error_body

log = logging.getLogger("sluice.gateway")

_TYPES = {
    400: "invalid_request_error",
    401: "authentication_error",
    403: "permission_error",
    404: "not_found_error",
    405: "invalid_request_error",
    409: "conflict_error",
    413: "invalid_request_error",
    415: "invalid_request_error",
    422: "invalid_request_error",
    429: "rate_limit_error",
    502: "server_error",
    503: "overloaded_error",
    504: "timeout",
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
            h["Retry-After"] = str(max(1, math.ceil(self.retry_after_s)))
            h["retry-after-ms"] = str(max(1, round(self.retry_after_s * 1000)))
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


def _validation_message(exc: RequestValidationError) -> tuple[str, str | None]:
    errors: list[Any] = list(exc.errors())
    if not errors:
        return "Invalid request.", None
    first = errors[0]
    if first.get("type") == "json_invalid":
        return "The request body is not valid JSON.", None
    loc = [str(p) for p in first.get("loc", ()) if p != "body"]
    param = ".".join(loc) or None
    if first.get("type") == "missing":
        return f"Missing required parameter: '{param}'.", param
    return f"Invalid value for '{param}': {first.get('msg')}.", param


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
        message, param = _validation_message(exc)
        code = "invalid_json" if message.startswith("The request body is not valid JSON") else "invalid_value"
        return APIError(400, message, code, param=param).response()

    @app.exception_handler(StarletteHTTPException)
    async def _http(request: Request, exc: StarletteHTTPException) -> JSONResponse:
        code = {404: "not_found", 405: "method_not_allowed", 413: "request_too_large"}.get(exc.status_code)
        return APIError(exc.status_code, str(exc.detail), code).response()

    @app.exception_handler(Exception)
    async def _unexpected(request: Request, exc: Exception) -> JSONResponse:
        log.exception("unexpected error")
        return APIError(500, "Internal error; the request was not processed.", "internal_error").response()
