"""The hot routes without the framework: ``POST /v1/chat/completions`` and ``POST /v1/completions``
as plain ASGI (read the body, validate it once, authenticate, admit, answer), in front of FastAPI,
which keeps every other route, these routes' OpenAPI schema, and every answer to a body that is not
plainly valid.

A request takes the lean way only when its body is an ``application/json`` object that the route's
model accepts; anything else (another Content-Type or none, JSON that does not parse or is not an
object, a body the model refuses) is handed to FastAPI as it came, body included, so that its
errors are exactly the framework's (:mod:`sluice.api.errors`). What the lean way answers itself is
what the routes would: the same handler (:func:`sluice.api.openai.complete`), the same 401s and
refusals (:class:`~sluice.api.errors.APIError`), the same 413 for a body over the cap
(:mod:`sluice.api.limits`), the same 503 when the broker is unreachable, the same 500 for a bug
(:class:`~sluice.api.limits.Guard`), each with its ``x-request-id``.

What it saves per request (docs/benchmarks/overhead.md): FastAPI's dependency solving and second
validation, and the six middleware layers each ``send`` went through.
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI
from pydantic import BaseModel, ValidationError
from starlette.requests import Request
from starlette.types import Message, Receive, Scope, Send

from sluice.api.auth import KeyRing
from sluice.api.errors import APIError, internal_error
from sluice.api.gateway import Gateway
from sluice.api.openai import complete
from sluice.api.relay import JSON_TYPE, WholeAnswer
from sluice.api.request_id import HEADER as REQUEST_ID
from sluice.api.request_id import JOB_HEADER, new_request_id
from sluice.api.schemas import READABLE, ChatRequest, CompletionRequest, SchedulingOptions, plainly_readable
from sluice.api.sse import CLIENT_GONE, EventStream
from sluice.broker.base import BrokerUnavailable
from sluice.core.admission import Refused
from sluice.core.job import Endpoint
from sluice.protocol import compact_json, error_body, loads

log = logging.getLogger("sluice.gateway")

_REQUEST_ID = REQUEST_ID.encode()

#: The lean routes (all POST): the endpoint each one makes, and the model its body must pass.
ROUTES: dict[str, tuple[Endpoint, type[SchedulingOptions]]] = {
    "/v1/chat/completions": (Endpoint.CHAT, ChatRequest),
    "/v1/completions": (Endpoint.COMPLETIONS, CompletionRequest),
}


def is_lean(scope: Scope) -> bool:
    """Whether this request is one for the lean routes."""
    return scope["type"] == "http" and scope["method"] == "POST" and scope["path"] in ROUTES


def _replay(body: bytes, receive: Receive) -> Receive:
    """``receive`` for the framework, with the body already read given back first."""
    sent = False

    async def replayed() -> Message:
        nonlocal sent
        if not sent:
            sent = True
            return {"type": "http.request", "body": body, "more_body": False}
        return await receive()

    return replayed


#: The names an error's headers come with (``APIError.headers``, a rate limit's), as they go out:
#: lowercase latin-1 made once, not for every refusal.
_NAMES: dict[str, bytes] = {
    name: name.lower().encode("latin-1")
    for name in (
        "Retry-After",
        "retry-after-ms",
        "x-should-retry",
        JOB_HEADER,
        "x-ratelimit-limit-requests",
        "x-ratelimit-remaining-requests",
        "x-ratelimit-reset-requests",
        "x-ratelimit-limit-tokens",
        "x-ratelimit-remaining-tokens",
        "x-ratelimit-reset-tokens",
    )
}


#: The most error bodies :func:`send_error` keeps made; past it, it starts again.
BODIES_KEPT = 256
#: An error's body and its Content-Length header, by what it is made of: a flood's refusals say
#: the same few things (the message names the model, the code the rule), each encoded once.
_BODIES: dict[tuple[str, str, str | None, str | None], tuple[bytes, tuple[bytes, bytes]]] = {}


def _error_body(error: APIError) -> tuple[bytes, tuple[bytes, bytes]]:
    """``error``'s JSON body and its Content-Length header, made once for each (message, type,
    code, param): the four parts :func:`sluice.protocol.error_body` makes the body of, so a kept
    one is the body this error would be encoded to."""
    key = (error.message, error.type, error.code, error.param)
    made = _BODIES.get(key)
    if made is None:
        # compact_json: what JSONResponse renders, by an encoder made once.
        body = compact_json(error_body(error.message, error.type, error.code, error.param))
        if len(_BODIES) >= BODIES_KEPT:
            _BODIES.clear()
        made = _BODIES[key] = (body, (b"content-length", str(len(body)).encode()))
    return made


async def send_error(send: Send, error: APIError) -> None:
    """``error`` as its JSON answer (the bytes and headers ``error.response()`` makes, without
    building the Response), with its ``x-request-id`` (the job's where there is one)."""
    body, length = _error_body(error)
    named = error.headers()
    headers = [(_NAMES.get(k) or k.lower().encode("latin-1"), v.encode("latin-1")) for k, v in named.items()]
    headers += (length, JSON_TYPE, (_REQUEST_ID, (named.get(JOB_HEADER) or new_request_id()).encode()))
    await send({"type": "http.response.start", "status": error.status, "headers": headers})
    await send({"type": "http.response.body", "body": body})


async def serve(app: FastAPI, scope: Scope, receive: Receive, send: Send, framework: Any) -> None:
    """Answer one lean request, or hand it to ``framework`` (the app's own ASGI stack)."""
    gw: Gateway = app.state.gateway
    max_bytes = gw.settings.max_body_bytes
    content_type = b""
    for name, value in scope["headers"]:
        if name == b"content-length":
            # A try, not contextlib.suppress (three calls more, on every request with a body).
            try:
                length = int(value)
            except ValueError:  # not a number: the body's own length is checked below
                length = 0
            if length > max_bytes:
                await send_error(send, _too_large(max_bytes))
                return
        elif name == b"content-type":
            content_type = value
    message = await receive()
    if message["type"] != "http.request":
        return  # the client left before its body was in: nobody to answer
    raw: bytes = message.get("body", b"")
    if message.get("more_body", False):
        # A body in several parts; a short request's comes whole in one, read without a list.
        chunks = [raw]
        seen = len(raw)
        while True:
            if seen > max_bytes:
                await send_error(send, _too_large(max_bytes))
                return
            message = await receive()
            if message["type"] != "http.request":
                return
            part = message.get("body", b"")
            seen += len(part)
            chunks.append(part)
            if not message.get("more_body", False):
                break
        raw = b"".join(chunks)
    if len(raw) > max_bytes:
        await send_error(send, _too_large(max_bytes))
        return
    endpoint, model = ROUTES[scope["path"]]
    opts = _valid(raw, content_type, model)
    if opts is None:
        await framework(scope, _replay(raw, receive), send)
        return
    sent = False
    stream: EventStream | None = None

    def started() -> bool:
        return sent or (stream is not None and stream.started)

    try:
        request = Request(scope, receive)
        keyring: KeyRing = app.state.keyring
        who = await keyring.authenticate(request)
        body = opts.model_dump(exclude_none=True, mode="json")
        answer = await complete(request, who, endpoint, body, opts, gw)
        if isinstance(answer, EventStream):
            # A stream says itself whether its head went out, so that each of its tokens goes to
            # the server's send straight, not through one more coroutine.
            stream = answer
            await answer(scope, receive, send)
        else:
            # A whole answer's first act is its head's send: from here on it has begun (the
            # server's send does not raise for a client that left), without a wrapper of send
            # that would say so one coroutine later for each of its two messages.
            sent = True
            if type(answer) is WholeAnswer:
                # Its two messages, as Response.__call__ sends them, without that coroutine.
                await send(
                    {
                        "type": "http.response.start",
                        "status": answer.status_code,
                        "headers": answer.raw_headers,
                    }
                )
                await send({"type": "http.response.body", "body": answer.body})
            else:
                await answer(scope, receive, send)
    except APIError as error:
        await _answer_error(send, error, started())
    except Refused as refused:
        await _answer_error(send, APIError.from_refused(refused), started())
    except BrokerUnavailable as exc:
        log.warning("broker unavailable: %s", exc)
        unreachable = APIError(
            503, "The queue is unreachable right now; retry shortly.", "broker_unavailable", retry_after_s=1.0
        )
        await _answer_error(send, unreachable, started())
    except Exception as exc:
        log.error(
            "unexpected error", exc_info=exc, extra={"fields": {"method": "POST", "path": scope["path"]}}
        )
        await _answer_error(send, internal_error(), started())
    finally:
        # The server's client watch refers to the request's cycle, whose scope refers to the watch:
        # dropped here, the request's objects go by their counts at its end instead of staying for
        # the cyclic collector (about ten objects a request; at saturation the collector's passes
        # were a tenth of the gateway's CPU). The watch itself lives on where the server keeps it.
        extensions = scope.get("extensions")
        if extensions:
            extensions.pop(CLIENT_GONE, None)


def _too_large(max_bytes: int) -> APIError:
    """The 413 of a body over the cap, made only for one (it was made for every request before)."""
    return APIError(413, f"The request body exceeds {max_bytes} bytes.", "request_too_large")


async def _answer_error(send: Send, error: APIError, started: bool) -> None:
    if started:
        return  # an answer has begun (a stream): it cannot become an error now
    try:
        await send_error(send, error)
    except Exception:  # the client may be gone already; contextlib.suppress is 3 calls more
        return


def _valid(raw: bytes, content_type: bytes, model: type[SchedulingOptions]) -> SchedulingOptions | None:
    """The body as ``model`` validated it, or None where the framework must answer it."""
    # The exact type, as clients send it, answered without splitting it (three calls).
    if (
        content_type != b"application/json"
        and content_type.split(b";", 1)[0].strip().lower() != b"application/json"
    ):
        return None
    try:
        data = loads(raw)  # as json.loads, without its guess of the encoding
    except Exception:  # not JSON, not UTF-8, nested past the recursion limit: the framework's words
        return None
    if not isinstance(data, dict):
        return None
    try:
        # The walk for what the engine could not take is skipped where the bytes rule it out.
        opts: BaseModel = model.model_validate(data, context=READABLE if plainly_readable(raw) else None)
    except (ValidationError, ValueError, RecursionError):
        return None
    assert isinstance(opts, SchedulingOptions)
    return opts
