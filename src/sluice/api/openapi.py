"""What ``/openapi.json`` says each operation answers: every status Sluice sends, each content type.

Generated clients and API gateways read that description, so it lists what the gateway really
does. A route names its answers in FastAPI's ``responses=``, built here: :func:`errors` for the
error statuses (all in OpenAI's error shape, :class:`ErrorResponse`), :func:`events` for an answer
sent as Server-Sent Events. :func:`document` finishes FastAPI's description: it drops the 422 that
FastAPI lists for every route with parameters (Sluice answers a request that fails validation with
400, in OpenAI's words) and adds the error schemas. ``tests/test_openapi.py`` holds the gateway to
it with schemathesis' status-code and content-type conformance checks.
"""

from __future__ import annotations

import copy
from collections.abc import Iterator
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, Field

SCHEMA_REF = "#/components/schemas/"
ERROR_SCHEMA = "ErrorResponse"


class Error(BaseModel):
    """An error, as OpenAI's API sends it (its spec's ``Error``)."""

    message: str = Field(description="What went wrong, for a person to read.")
    type: str = Field(description="The kind of error, e.g. invalid_request_error, rate_limit_error.")
    param: str | None = Field(description="The request parameter the error is about, if one.")
    code: str | None = Field(description="A stable, machine-readable code, e.g. model_not_found.")


class ErrorResponse(BaseModel):
    """The body of every error answer (OpenAI's ``ErrorResponse``)."""

    error: Error


#: Why each error status is sent; the description of its response.
WHY: dict[int, str] = {
    400: "The request is malformed or a value is refused: the body is not a JSON object, a parameter "
    "is missing or invalid (`param` names it), or the engine refused the request.",
    401: "No API key was sent, or it is not a valid key.",
    403: "The key may not use what the request asks for (a priority above its max_priority).",
    404: "Not found: the model, or the job or response (another tenant's reads as unknown); on the "
    "admin routes and /metrics, any key that is not an admin key.",
    405: "An id holding '/' makes the path name another route, which does not take this method.",
    408: "The request's headers or body came too slowly (header_timeout_s, body_timeout_s).",
    409: "The job was cancelled, or had already ended when asked to cancel it.",
    413: "The request body exceeds max_body_bytes.",
    429: "A rate limit, a queue cap or the key's connection cap: Retry-After (seconds) and "
    "retry-after-ms say when to try again.",
    431: "The request line and headers exceed max_header_bytes.",
    500: "A bug in Sluice; the request was not processed.",
    502: "The engine failed, after Sluice's own attempts.",
    503: "No capacity in time: overloaded, the deadline cannot be met, no backend serves the model "
    "now, the engine is starting, or the queue (broker) is unreachable. Retry-After says when to "
    "try again.",
    504: "The request's deadline passed before its answer came.",
}

#: What any request may be answered, whatever its route: slow or oversized headers (the HTTP
#: server's, sluice.roles.http_limits), an oversized body (sluice.api.limits), a bug.
ANY = (408, 413, 431, 500)
#: What a route that needs a key may answer besides: no or a wrong key, and the key store (the
#: broker) unreachable.
KEYED = (401, 503)
#: What building and admitting a job may answer (Gateway.build_job and Gateway.admit): a refused
#: value, a priority the key may not use, an unknown model, the limits, no capacity.
ADMIT = (400, 403, 404, 429, 503)
#: What waiting for a job's answer may add: the job gone (404), cancelled (409), failed at the
#: engine (400 if the engine refused it, else 502), past its deadline (504).
ANSWER = (400, 404, 409, 502, 504)
#: What an admin route may answer: those of a keyed route, and 404 to any key that is not an
#: admin key (the admin surface stays hidden).
ADMIN = (*KEYED, 404)

#: The headers that say when to retry, on a 429 and a 503.
_RETRY_HEADERS = {
    "Retry-After": {
        "description": "Seconds to wait before trying again (whole, rounded up).",
        "schema": {"type": "integer"},
    },
    "retry-after-ms": {
        "description": "Milliseconds to wait before trying again (the OpenAI SDKs honour it).",
        "schema": {"type": "integer"},
    },
}


def errors(*statuses: int) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` entries for ``statuses`` and for what any request may be answered
    (:data:`ANY`), each an :class:`ErrorResponse` in JSON."""
    out: dict[int | str, dict[str, Any]] = {}
    for status in sorted({*statuses, *ANY}):
        entry: dict[str, Any] = {
            "description": WHY[status],
            "content": {"application/json": {"schema": {"$ref": SCHEMA_REF + ERROR_SCHEMA}}},
        }
        if status in (429, 503):
            entry["headers"] = _RETRY_HEADERS
        out[status] = entry
    return out


def events(what: str, status: int = 200) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` entry of an answer sent as Server-Sent Events (``text/event-stream``);
    ``what`` says what its events are."""
    schema = {"type": "string", "description": what}
    return {status: {"content": {"text/event-stream": {"schema": schema}}}}


def plain_text(what: str, status: int = 200) -> dict[int | str, dict[str, Any]]:
    """The ``responses=`` entry of an answer in ``text/plain``; ``what`` says what it holds."""
    return {status: {"content": {"text/plain": {"schema": {"type": "string", "description": what}}}}}


def schema_refs(node: Any) -> Iterator[str]:
    """The names of the component schemas ``node`` refers to."""
    if isinstance(node, dict):
        ref = node.get("$ref")
        if isinstance(ref, str) and ref.startswith(SCHEMA_REF):
            yield ref.removeprefix(SCHEMA_REF)
        for value in node.values():
            yield from schema_refs(value)
    elif isinstance(node, list):
        for value in node:
            yield from schema_refs(value)


def _error_schemas() -> dict[str, Any]:
    """The component schemas of :class:`ErrorResponse` and what it refers to."""
    schema = ErrorResponse.model_json_schema(ref_template=SCHEMA_REF + "{model}")
    defined: dict[str, Any] = schema.pop("$defs", {})
    return {**defined, ERROR_SCHEMA: schema}


# FastAPI's validation error answer, which Sluice never sends (it answers 400 in OpenAI's shape).
_FRAMEWORK_422 = "422"
_FRAMEWORK_SCHEMAS = ("HTTPValidationError", "ValidationError")


def _status_order(item: tuple[str, Any]) -> tuple[int, str]:
    status = item[0]
    return (int(status), "") if status.isdigit() else (1000, status)


def finish(schema: dict[str, Any]) -> dict[str, Any]:
    """FastAPI's description of the app, made true: without the 422 of FastAPI's own validation
    answer on each operation, and with the error schemas the routes refer to. ``schema`` is left
    as it was."""
    out = copy.deepcopy(schema)
    for operations in out.get("paths", {}).values():
        for operation in operations.values():
            responses = operation.get("responses", {}) if isinstance(operation, dict) else {}
            framework = responses.get(_FRAMEWORK_422)
            if framework is not None and set(schema_refs(framework)) <= set(_FRAMEWORK_SCHEMAS):
                del responses[_FRAMEWORK_422]
            if responses:  # in the order of their statuses, for a reader
                operation["responses"] = dict(sorted(responses.items(), key=_status_order))
    components = out.setdefault("components", {})
    defined = components.setdefault("schemas", {})
    defined.update(_error_schemas())
    ours = {name: spec for name, spec in defined.items() if name not in _FRAMEWORK_SCHEMAS}
    used = {*schema_refs(out.get("paths", {})), *schema_refs(ours)}
    for name in _FRAMEWORK_SCHEMAS:
        if name not in used:
            defined.pop(name, None)
    return out


def document(app: FastAPI) -> dict[str, Any]:
    """The whole OpenAPI description of ``app`` (:func:`finish` of FastAPI's), built once."""
    done: dict[str, Any] | None = getattr(app.state, "openapi_document", None)
    if done is None:
        done = app.state.openapi_document = finish(app.openapi())
    return done
