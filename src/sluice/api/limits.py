"""Refuse request bodies over the size cap with 413 before they are read into memory."""

from __future__ import annotations

from collections.abc import Collection

from starlette.exceptions import HTTPException
from starlette.types import ASGIApp, Message, Receive, Scope, Send

from sluice.api.errors import APIError


class _TooLarge(HTTPException):
    """An HTTPException, because the framework re-raises those from body parsing and wraps the rest."""


class BodySizeLimit:
    def __init__(self, app: ASGIApp, max_bytes: int, exempt: Collection[str] = ()) -> None:
        self.app = app
        self.max_bytes = max_bytes
        #: paths whose routes count their own bodies against a cap of their own (file uploads)
        self.exempt = frozenset(exempt)

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("path") in self.exempt:
            await self.app(scope, receive, send)
            return
        error = APIError(413, f"The request body exceeds {self.max_bytes} bytes.", "request_too_large")
        for name, value in scope.get("headers", []):
            if name == b"content-length":
                try:
                    too_large = int(value) > self.max_bytes
                except ValueError:
                    too_large = False
                if too_large:
                    await error.response()(scope, receive, send)
                    return
        seen = 0
        started = False

        async def limited_receive() -> Message:
            nonlocal seen
            message = await receive()
            if message["type"] == "http.request":
                seen += len(message.get("body", b""))
                if seen > self.max_bytes:
                    raise _TooLarge(413, error.message)
            return message

        async def tracking_send(message: Message) -> None:
            nonlocal started
            if message["type"] == "http.response.start":
                started = True
            await send(message)

        try:
            await self.app(scope, limited_receive, tracking_send)
        except _TooLarge:
            if not started:
                await error.response()(scope, receive, send)
