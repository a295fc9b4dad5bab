"""Sluice's one middleware around the framework's routes (:class:`Guard`): every answer's
``x-request-id`` (:mod:`sluice.api.request_id`), the body size cap, and the last resort for a bug,
in one layer and one wrapper of ``send`` where there were three (``RequestId``, ``BodySizeLimit``,
``LastResort``). The lean routes (:mod:`sluice.api.lean`) do the same themselves."""

from __future__ import annotations

import contextlib
import logging
from collections.abc import Collection

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sluice.api.errors import APIError, internal_error
from sluice.api.request_id import HEADER, JOB_HEADER, new_request_id

log = logging.getLogger("sluice.gateway")

_HEADER = HEADER.encode()
_JOB_HEADER = JOB_HEADER.encode()


class _TooLarge(HTTPException):
    """An HTTPException, because the framework re-raises those from body parsing and wraps the rest."""


def with_request_id(message: Message) -> None:
    """Give an ``http.response.start`` its ``x-request-id`` if it has none: the job's id where the
    answer names a job, else a fresh one."""
    headers = message.setdefault("headers", [])
    job_id: bytes | None = None
    for name, value in headers:
        low = name.lower()
        if low == _HEADER:
            return
        if low == _JOB_HEADER:
            job_id = value
    message["headers"] = [*headers, (_HEADER, job_id or new_request_id().encode())]


class Guard:
    """The request id, the body cap (413 before a body over ``max_bytes`` is read into memory,
    except on the ``exempt`` paths, whose routes count their own bodies) and the last resort: an
    exception that no handler took (a bug) is logged once, by its type and frames (sluice.logs never
    prints an exception's message, which may hold request data), and answered 500 in OpenAI's shape,
    or, once a response or a WebSocket has begun, by closing it. It is not re-raised: the framework's
    own last handler would re-raise it to the server, which logs it a second time, as raw text."""

    def __init__(self, app: ASGIApp, max_bytes: int, exempt: Collection[str] = ()) -> None:
        self.app = app
        self.max_bytes = max_bytes
        self.exempt = frozenset(exempt)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        kind = scope["type"]
        if kind == "websocket":
            await self._websocket(scope, receive, send)
            return
        if kind != "http":
            await self.app(scope, receive, send)
            return
        started = False

        async def guarded_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
                with_request_id(message)
            await send(message)

        limited = scope.get("path") not in self.exempt
        if limited:
            for name, value in scope.get("headers", []):
                if name == b"content-length":
                    try:
                        too_large = int(value) > self.max_bytes
                    except ValueError:
                        too_large = False
                    if too_large:
                        await self._too_large().response()(scope, receive, guarded_send)
                        return
        seen = 0

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge(413, self._too_large().message)
            return message

        try:
            await self.app(scope, limited_receive if limited else receive, guarded_send)
        except _TooLarge:
            if not started:
                await self._too_large().response()(scope, receive, guarded_send)
        except HTTPException:
            raise
        except Exception as exc:
            log.error("unexpected error", exc_info=exc, extra={"fields": _where(scope)})
            if not started:
                with contextlib.suppress(Exception):  # the client may be gone already
                    await internal_error().response()(scope, receive, guarded_send)

    def _too_large(self) -> APIError:
        return APIError(413, f"The request body exceeds {self.max_bytes} bytes.", "request_too_large")

    async def _websocket(self, scope: Scope, receive: Receive, send: Send) -> None:
        try:
            await self.app(scope, receive, send)
        except HTTPException:
            raise
        except Exception as exc:
            log.error("unexpected error", exc_info=exc, extra={"fields": _where(scope)})
            with contextlib.suppress(Exception):  # the client may be gone already
                await send({"type": "websocket.close", "code": 1011, "reason": "internal_error"})


def _where(scope: Scope) -> dict[str, object]:
    return {"method": scope.get("method", "WEBSOCKET"), "path": scope.get("path")}
